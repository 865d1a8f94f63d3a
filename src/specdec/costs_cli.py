"""`specdec costs`: this machine's cost table, the JSON `specdec replay --costs` predicts speed with.

The target's forward of 1..N new tokens after a context, medians over interleaved passes, and
optionally a draft model's forwards timed in the same process; the measuring and the file's
format live in analysis/machine_costs.py (which benchmarks/verify_cost.py writes through too).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specdec.cli_options import add_model_args, number_list, positive_int
from specdec.config import QUANTIZATIONS

EPILOG = """\
examples:
  specdec costs                                  # the embedded target as generate loads it -> costs.json
  specdec costs --draft qwen2.5-coder-0.5b       # and the draft, timed in the same process
  specdec replay bench-results --draft qwen2.5-coder-0.5b --k 2,4,8 --costs costs.json
      # then: the bench run's answers replayed, and their speed predicted on this machine
  specdec costs --target ./my-model --quantize w8a8 --rows 1,2,5,9,17,33 --out my-costs.json
  specdec costs --repeats 31 --context 2000      # steadier medians; agent loops' longer contexts
  specdec costs --device cuda --trees --rows 1,5,9,17,33 --out gpu-costs.json
      # a GPU: trees timed too; `specdec generate --method copy --copy-trees --copy-costs gpu-costs.json`

A replay prices a step that drafts d tokens as one target forward of 1 + d tokens, in multiples
of a 1-token step, and each draft-model forward in the same unit: this command measures those
multiples here (the "x step" column), after --context cached tokens, as the median of --repeats
passes that interleave the rows, so a slow minute of a shared machine hits every row alike. Rows
between the measured ones are interpolated and those past the last extrapolated along the last
two, so measure up to the longest k + 1 you will replay (the default covers k = 16).

The file records the machine (CPU model, oneDNN path in force, threads; the GPU where the models
ran on one): `specdec replay` names it in its label. Costs move with the memory a process's
weights land on, which on a VM can differ from one process to the next: the file also records the
bandwidth each model's weights were read at, so run it twice and compare. Time the draft here
(--draft), not in another process, and rerun after changing the machine, threads or formats.
"""


def add_costs_command(sub) -> None:
    costs = sub.add_parser("costs", help="time the target's (and a draft's) forwards here: the cost table "
                                         "`specdec replay --costs` reads",
                           epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(costs, draft=False)
    costs.add_argument("--draft", default=None,
                       help="also time this draft model (embedded name or HF directory) in the same process: "
                            "the file's draft entry, which prices `replay --draft` (default: no draft)")
    costs.add_argument("--draft-quantize", default="auto", choices=["auto", *QUANTIZATIONS],
                       help="the draft's weights, as replay and bench load it (default: auto)")
    costs.add_argument("--draft-vocab", type=positive_int, default=None, metavar="N",
                       help="the draft's head scores only the N most frequent tokens, as in bench")
    costs.add_argument("--out", default="costs.json", metavar="PATH", help="the JSON to write (default: costs.json)")
    costs.add_argument("--context", type=positive_int, default=800, metavar="N",
                       help="cached tokens before the target's timed forwards (default: 800)")
    costs.add_argument("--rows", default=None, metavar="N,N,...",
                       help="new tokens per timed target forward; 1, the unit, is always added "
                            "(default: 1,2,3,5,9,17: verifying k = 1, 2, 4, 8, 16 drafts)")
    costs.add_argument("--repeats", type=positive_int, default=15, metavar="N",
                       help="timed passes over the rows, after two warm-up passes; each row's median is "
                            "kept (default: 15)")
    costs.add_argument("--draft-context", type=positive_int, default=None, metavar="N",
                       help="cached tokens before the draft's timed forwards (default: 320, the most of a "
                            "prompt a draft reads and 64 tokens after it)")
    costs.add_argument("--trees", action="store_true",
                       help="also time the target verifying a draft tree of as many tokens as each row (a second "
                            "entry, \"tree\": true): on a GPU a tree's step costs more than a chain's, and "
                            "--copy-costs FILE then prices --copy-trees by it (default: chains only)")
    costs.add_argument("--draft-rows", default=None, metavar="N,N,...",
                       help="new tokens per timed draft forward, at least two (default: 1,2,9,64: drafting, "
                            "a catch-up after copied steps, a prompt chunk)")


def _rows(text: str | None, default: tuple[int, ...], option: str, unit: bool) -> list[int]:
    """A sorted list of distinct row counts >= 1 from "1,2,5"; unit: 1 added, the ratios' unit."""
    if text is None:
        return list(default)
    rows = set(number_list(text, int, 1, option)) | ({1} if unit else set())
    if len(rows) < 2:
        raise ValueError(f"{option} {text!r}: needs {'a forward of more than one token' if unit else 'two sizes'} "
                         "(replay interpolates between the measured rows)")
    return sorted(rows)


def _output_path(text: str) -> Path:
    path = Path(text)
    if path.is_dir():
        raise ValueError(f"--out {text!r} is a directory; name the JSON file to write")
    return path


def _timed_entry(model, context: int, rows: list[int], repeats: int, tree: bool = False) -> dict:
    from tqdm.auto import tqdm

    from specdec.analysis.machine_costs import forwards_per_model, model_costs

    with tqdm(total=forwards_per_model(rows, repeats), desc=f"timing {model.name}{' trees' if tree else ''}",
              unit="forward", file=sys.stderr) as bar:
        return model_costs(model, context, rows, repeats, tree=tree, on_forward=bar.update)


def cmd_costs(args) -> int:
    from specdec.analysis.machine_costs import DRAFT_CONTEXT, DRAFT_ROWS, TARGET_ROWS, check_fits, cost_file
    from specdec.models.loader import load_model

    started = time.perf_counter()
    rows = _rows(args.rows, TARGET_ROWS, "--rows", unit=True)
    draft_rows = _rows(args.draft_rows, DRAFT_ROWS, "--draft-rows", unit=False)
    draft_context = args.draft_context or DRAFT_CONTEXT
    out = _output_path(args.out)
    target = load_model(args.target, device=args.device, dtype=args.dtype, backend=args.backend,
                        quantize=args.quantize, probe=False)  # timing only: doctor checks exactness
    check_fits(target, args.context, rows, "--context")
    draft = None
    if args.draft:  # loaded and checked before any timing: bad input fails in seconds, not after the target's
        draft = load_model(args.draft, device=args.device, dtype=args.dtype, quantize=args.draft_quantize,
                           head_vocab=args.draft_vocab, role="draft")
        check_fits(draft, draft_context, draft_rows, "--draft-context")
    if args.trees and target.backend != "native":
        raise ValueError("--trees needs the native backend (a transformers runner verifies no trees)")
    entries = [_timed_entry(target, args.context, rows, args.repeats)]
    if args.trees:
        entries.append(_timed_entry(target, args.context, rows, args.repeats, tree=True))
    draft_entry = None if draft is None else _timed_entry(draft, draft_context, draft_rows, args.repeats)
    table = cost_file(target.runner.device, entries, draft_entry)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1) + "\n")
    print(_describe(table))
    print(f"\nwrote {out} ({time.perf_counter() - started:.0f}s); use it: specdec replay BENCH_DIR --costs {out}"
          + (f" --draft {args.draft}" if args.draft else ""))
    return 0


def _describe(table: dict) -> str:
    where = table.get("gpu") or f"{table['cpu']} ({table['isa'] or 'oneDNN path unknown'})"
    target = table["results"][0]
    lines = [f"machine: {where}, {table['threads']} threads, torch {table['torch']}",
             f"target:  {target['format']}, {target['context']} cached tokens, prefill "
             f"{target['prefill_tok_s']:.0f} tok/s{_read(target)}", f"  {'tokens':>6} {'ms':>9} {'x step':>8}"]
    lines += [f"  {n:>6} {ms:>9.2f} {target['ratio'][n]:>7.2f}x" for n, ms in target["step_ms"].items()]
    unit = target["step_ms"][1]
    if len(table["results"]) > 1:  # --trees
        trees = table["results"][1]
        lines += [f"trees:   {trees['format']}, a draft tree of tokens - 1 nodes", f"  {'tokens':>6} {'ms':>9} "
                  f"{'x chain step':>13}"]
        lines += [f"  {n:>6} {ms:>9.2f} {ms / unit:>12.2f}x" for n, ms in trees["step_ms"].items()]
    draft = table.get("draft")
    if draft is not None:
        lines += [f"draft:   {draft['format']}, {draft['context']} cached tokens{_read(draft)}",
                  f"  {'tokens':>6} {'ms':>9} {'x target step':>14}"]
        lines += [f"  {n:>6} {ms:>9.2f} {ms / unit:>13.2f}x" for n, ms in draft["step_ms"].items()]
    return "\n".join(lines)


def _read(entry: dict) -> str:
    return f", weights read at {entry['read_gb_s']:.0f} GB/s" if "read_gb_s" in entry else ""
