"""Cost of one n-gram lookup step: full rescan (find_match) vs the incremental NgramIndex.

A decode step commits a few tokens and looks up the new suffix. The rescan's
cost grows with the context; the index's does not. For contexts of 2k, 8k and
32k tokens this simulates `--steps` decode steps (3 tokens committed per step)
and reports the median microseconds per step, plus the one-time cost of
indexing the prompt.

The token stream mixes fresh tokens with copied spans (as real copying text
does), over a 32k-token vocabulary, so lookups find real matches.

  python benchmarks/ngram_index_microbench.py --contexts 2048,8192,32768 --steps 300
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from specdec.config import SpecConfig
from specdec.factory import proposer_for
from specdec.proposers import NgramIndex, ProposeContext, find_match
from specdec.sampling import SamplingParams


def token_stream(length: int, seed: int = 0, vocab: int = 32_000) -> list[int]:
    rng = random.Random(seed)
    tokens: list[int] = []
    while len(tokens) < length:
        if len(tokens) > 64 and rng.random() < 0.5:  # copy an earlier span
            start = rng.randrange(len(tokens) - 32)
            tokens.extend(tokens[start : start + rng.randint(4, 32)])
        else:
            tokens.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 16)))
    return tokens[:length]


def time_steps(step, count: int) -> list[float]:
    times = []
    for i in range(count):
        started = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - started)
    return times


def bench(context_len: int, steps: int, max_k: int, per_step: int = 3) -> dict:
    stream = token_stream(context_len + steps * per_step)
    prompt = stream[:context_len]

    def rescan(i: int) -> None:
        find_match(stream[: context_len + i * per_step], max_k=max_k)

    started = time.perf_counter()
    index = NgramIndex(3, 1)
    index.extend(prompt)
    build_s = time.perf_counter() - started

    def indexed(i: int) -> None:
        start = context_len + (i - 1) * per_step
        if i:
            index.extend(stream[start : start + per_step])
        index.lookup(max_k)

    # The proposer as the engine calls it (`specdec generate --method ngram -k K`'s): a [1, L] tensor in, a
    # DraftProposal out.
    tensor = torch.tensor([stream])
    proposer = proposer_for(SpecConfig(method="ngram", k=max_k), None)
    proposer.propose(ProposeContext(tensor[:, :context_len], SamplingParams(), None, 32_000), max_k)

    def proposed(i: int) -> None:
        ctx = ProposeContext(tensor[:, : context_len + i * per_step], SamplingParams(), None, 32_000)
        proposer.propose(ctx, max_k)

    rescan_us = statistics.median(time_steps(rescan, steps)) * 1e6
    index_us = statistics.median(time_steps(indexed, steps)) * 1e6
    proposer_us = statistics.median(time_steps(proposed, steps)) * 1e6
    return {
        "context_tokens": context_len, "steps": steps, "max_k": max_k,
        "rescan_us_per_step": round(rescan_us, 1), "index_us_per_step": round(index_us, 1),
        "proposer_us_per_step": round(proposer_us, 1), "index_build_ms": round(build_s * 1e3, 1),
        "rescan_over_index": round(rescan_us / index_us, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="2048,8192,32768", help="comma-separated context lengths")
    parser.add_argument("--steps", type=int, default=300, help="decode steps timed per context (median reported)")
    parser.add_argument("-k", type=int, default=8, help="max draft tokens per lookup")
    parser.add_argument("--out", default="benchmarks/results/ngram_index_microbench.json")
    args = parser.parse_args()

    rows = [bench(int(n), args.steps, args.k) for n in args.contexts.split(",")]
    header = f"{'context':>8} {'rescan us/step':>15} {'index us/step':>14} {'proposer us/step':>17} " \
             f"{'rescan/index':>13} {'index build ms':>15}"
    print(header)
    for row in rows:
        print(f"{row['context_tokens']:>8} {row['rescan_us_per_step']:>15.1f} {row['index_us_per_step']:>14.1f} "
              f"{row['proposer_us_per_step']:>17.1f} {row['rescan_over_index']:>12.1f}x {row['index_build_ms']:>15.1f}")
    print("median over steps; 'proposer' is NgramProposer.propose with tensor input/output (what the engine pays).")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
