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
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specdec.models.cpu_features import cpu_model, effective_isa
from specdec.models.loader import load_model
from specdec.models.native.linear import w8a8_available
from specdec.models.native.w4a8 import w4a8_available

ROWS = (1, 2, 5, 9, 16)


def measure(name: str, quantize: str, context: int, steps: int) -> dict:
    model = load_model(name, quantize=quantize, progress=False, probe=False)
    runner = model.runner
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 150_000, (1, context), generator=generator)
    runner.reset()
    runner.forward(prompt[:, :64], torch.arange(64)[None], last_n_logits=1)  # warm-up
    runner.reset()
    started = time.perf_counter()
    runner.forward(prompt, torch.arange(context)[None], last_n_logits=1)
    prefill_s = time.perf_counter() - started
    step_ms = {}
    with torch.inference_mode():
        for rows in ROWS:
            times = []
            for _ in range(steps):
                tokens = torch.randint(0, 150_000, (1, rows), generator=generator)
                started = time.perf_counter()
                runner.forward(tokens, torch.arange(context, context + rows)[None])
                times.append(time.perf_counter() - started)
                runner.truncate([context])
            step_ms[rows] = statistics.median(times) * 1e3
    return dict(format=model.describe(), quantize=quantize, context=context, prefill_tok_s=context / prefill_s,
                step_ms=step_ms, ratio={rows: step_ms[rows] / step_ms[1] for rows in ROWS})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--formats", default="none,int8,int4,w8a8,w4a8")
    parser.add_argument("--context", type=int, default=800)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--json", default="benchmarks/results/verify_cost.json")
    args = parser.parse_args()
    print(f"{cpu_model()} ({effective_isa()}), {torch.get_num_threads()} threads, {args.context} cached tokens")
    print(f"{'format':<44}{'prefill tok/s':>14}" + "".join(f"{f'{n} tok':>14}" for n in ROWS))
    results = []
    for quantize in args.formats.split(","):
        reason = {"w8a8": w8a8_available, "w4a8": w4a8_available}.get(quantize, lambda: None)()
        if reason is not None:
            print(f"{quantize:<44}skipped: {reason}")
            continue
        row = measure(args.model, quantize, args.context, args.steps)
        results.append(row)
        cells = "".join(f"{row['step_ms'][n]:>7.1f} ({row['ratio'][n]:.2f}x)" for n in ROWS)
        print(f"{row['format']:<44}{row['prefill_tok_s']:>14.0f}{cells}", flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(dict(cpu=cpu_model(), isa=effective_isa(), results=results), indent=1))


if __name__ == "__main__":
    main()
