"""Median ms of one target forward of 1, 5 and 9 new tokens after a 300-token prompt: what a decode
step (1) and the verification of 4 or 8 drafts (5, 9) cost on the embedded target. One JSON line.

Compare two versions by running this alternately in each checkout (interleaved rounds, medians of
the rounds), as for plain_decode.py:

    git worktree add /tmp/before <commit>
    for round in 1 2 3; do
      (cd /tmp/before && PYTHONPATH=src python /path/to/benchmarks/step_time.py)
      python benchmarks/step_time.py
    done

    python benchmarks/step_time.py [--quantize w4a8] [--passes 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdec.models.loader import load_model

PROMPT_TOKENS = 300
NEW_TOKENS = (1, 5, 9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantize", default="auto")
    parser.add_argument("--passes", type=int, default=7)
    args = parser.parse_args()
    target = load_model("qwen2.5-coder-1.5b", progress=False, quantize=args.quantize)
    runner = target.runner
    generator = torch.Generator().manual_seed(0)
    runner.reset()
    runner.forward(torch.randint(100, 20000, (1, PROMPT_TOKENS), generator=generator),
                   torch.arange(PROMPT_TOKENS)[None])
    times: dict[int, list[float]] = {count: [] for count in NEW_TOKENS}
    with torch.inference_mode():
        for _ in range(args.passes):
            for count in NEW_TOKENS:  # interleaved, so a slow moment of the machine hits every size
                tokens = torch.randint(100, 20000, (1, count), generator=generator)
                start = time.perf_counter()
                runner.forward(tokens, torch.arange(PROMPT_TOKENS, PROMPT_TOKENS + count)[None])
                times[count].append(time.perf_counter() - start)
                runner.truncate([PROMPT_TOKENS])
    print(json.dumps({"quantize": args.quantize, **{f"{count}_tokens_ms": round(statistics.median(values) * 1e3, 2)
                                                     for count, values in times.items()}}))


if __name__ == "__main__":
    main()
