"""What does verifying k drafts cost, and how fast is prefill, in each target weight format?

For each format of the embedded 1.5B target: prefill tokens/s over an
800-token prompt, then the median time of a target forward over n new tokens
(n = 1, 2, 5, 9, 16: plain decoding, and verification of k = 1, 4, 8, 15
drafts) after those 800 cached tokens, and its ratio to the 1-token step.
Speculation with k drafts pays only when the (k+1)-token forward stays close
to one step: verification at 1.3x a step with tau = 3.5 is a 2.7x speedup
before the draft's cost, at 5x it is a slowdown.

  python benchmarks/verify_cost.py [--formats none,int8,int4,w8a8,w4a8] [--context 800]
  python benchmarks/verify_cost.py --model qwen2.5-coder-0.5b    # the draft's step and prefill
  python benchmarks/verify_cost.py --formats w4a8 --rows 1,2,3,5,9,17 --draft qwen2.5-coder-0.5b
      # and the draft's forwards in the same process: `specdec replay --costs` prices a draft model with them
  python benchmarks/verify_cost.py --tree --rows 1,8,16,32,64 --formats none,w8a8,w4a8   # tree verification

`specdec costs` writes the same JSON for one format, installed with the package; this script
compares formats and tree shapes. Both time forwards through analysis/machine_costs.py: medians
over passes that interleave the rows, after two warm-up passes.

--tree verifies n nodes of a draft tree instead of a chain: each node sees its
ancestors only (a random tree, nodes in topological order, as EAGLE-2's are),
through the same tree attention mask the engine builds. On CPUs the cost of a
forward grows with its rows (AMX tiles hold 16 rows, AVX-512 registers fewer):
these are the costs from which a tree's size must be chosen.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdec.analysis.machine_costs import cost_file, model_costs
from specdec.models.cpu_features import cpu_model, effective_isa
from specdec.models.loader import load_model, resolve_device
from specdec.models.native.linear import w8a8_available
from specdec.models.native.w4a8 import w4a8_available

ROWS = (1, 2, 5, 9, 16)


def measure(name: str, quantize: str, context: int, steps: int, rows_list=ROWS, tree: bool = False,
            role: str = "target") -> dict:
    """One format's entry, timed as `specdec costs` times it (analysis/machine_costs.py)."""
    model = load_model(name, quantize=quantize, progress=False, probe=False, role=role)
    return model_costs(model, context, rows_list, steps, tree=tree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--formats", default="none,int8,int4,w8a8,w4a8")
    parser.add_argument("--context", type=int, default=800)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)),
                        help="tokens per measured forward, comma-separated; the first is the ratios' unit")
    parser.add_argument("--tree", action="store_true", help="verify tree nodes (tree attention mask), not a chain")
    parser.add_argument("--draft", help="also time this draft model's forwards of --draft-rows tokens (its "
                                        "default format, --draft-context cached tokens), after the target's, "
                                        "as the JSON's 'draft' entry")
    parser.add_argument("--draft-rows", default="1,2,9,64",
                        help="1-2: a drafting forward; 9: a catch-up after copied steps; 64: a prompt chunk")
    parser.add_argument("--draft-context", type=int, default=320,
                        help="the draft reads at most a prompt's last 256 tokens (default: 320)")
    parser.add_argument("--json", default="benchmarks/results/verify_cost.json")
    args = parser.parse_args()
    rows_list = tuple(int(n) for n in args.rows.split(","))
    print(f"{cpu_model()} ({effective_isa()}), {torch.get_num_threads()} threads, {args.context} cached tokens")
    print(f"{'format':<44}{'prefill tok/s':>14}" + "".join(f"{f'{n} node' if args.tree else f'{n} tok':>14}"
                                                         for n in rows_list))
    results = []
    for quantize in args.formats.split(","):
        reason = {"w8a8": w8a8_available, "w4a8": w4a8_available}.get(quantize, lambda: None)()
        if reason is not None:
            print(f"{quantize:<44}skipped: {reason}")
            continue
        row = measure(args.model, quantize, args.context, args.steps, rows_list, args.tree)
        results.append(row)
        cells = "".join(f"{row['step_ms'][n]:>7.1f} ({row['ratio'][n]:.2f}x)" for n in rows_list)
        print(f"{row['format']:<44}{row['prefill_tok_s']:>14.0f}{cells}", flush=True)
    output = cost_file(resolve_device("auto"), results)
    if args.draft:
        draft_rows = tuple(int(n) for n in args.draft_rows.split(","))
        output["draft"] = draft = measure(args.draft, "auto", args.draft_context, args.steps, draft_rows,
                                                  role="draft")
        unit = results[0]["step_ms"][rows_list[0]] if results else float("nan")
        cells = "".join(f"{draft['step_ms'][n]:>7.1f} ({draft['step_ms'][n] / unit:.2f}x)" for n in draft_rows)
        print(f"draft {draft['format']:<38}{draft['prefill_tok_s']:>14.0f}{cells}  (x: of the target's step; "
              f"rows {args.draft_rows})", flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(output, indent=1))


if __name__ == "__main__":
    main()
