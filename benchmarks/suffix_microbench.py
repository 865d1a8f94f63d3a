"""Cost of one suffix-decoding step, as the n-gram index was measured
(ngram_index_microbench.py): does it grow with the context or with the cache?

For prompts of 2k, 8k and 32k tokens and a shared cache holding the outputs of 0, 100 and
1,000 earlier requests (256 tokens each), this simulates `--steps` decode steps of 3 committed
tokens each through SuffixProposer.propose (a [1, L] tensor in, a DraftProposal out, exactly
as the engine calls it) and reports the median microseconds per step, the one-time cost of
reading the prompt per token, and the tries' node counts.

The token streams mix fresh tokens with copied spans over a 32k-token vocabulary, and the
earlier requests' outputs share spans with each other and with the prompt, so lookups find
real matches and draft real trees.

  python benchmarks/suffix_microbench.py --contexts 2048,8192,32768 --cache-requests 0,100,1000 --steps 300
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
from specdec.proposers.base import ProposeContext
from specdec.proposers.suffix import SuffixOptions
from specdec.sampling import SamplingParams

VOCAB = 32_000


def token_stream(length: int, rng: random.Random, pool: list[int] | None = None) -> list[int]:
    """Fresh tokens and copied spans (from itself, or from `pool`: what other requests wrote)."""
    tokens: list[int] = []
    while len(tokens) < length:
        source = pool if pool and rng.random() < 0.3 else tokens
        if len(source) > 64 and rng.random() < 0.5:
            start = rng.randrange(len(source) - 32)
            tokens.extend(source[start: start + rng.randint(4, 32)])
        else:
            tokens.extend(rng.randrange(VOCAB) for _ in range(rng.randint(1, 16)))
    return tokens[:length]


def bench(context_len: int, cache_requests: int, steps: int, max_k: int, per_step: int = 3) -> dict:
    rng = random.Random(context_len * 7 + cache_requests)
    shared = token_stream(4096, rng)  # what the requests of this workload have in common
    # The proposer `specdec generate --method suffix --suffix-cache-requests N` drafts with, called as
    # the engine calls it.
    proposer = proposer_for(SpecConfig(method="suffix", k=max_k,
                                       options=(SuffixOptions(cache_requests=max(cache_requests, 1)),)), None)
    started = time.perf_counter()
    for _ in range(cache_requests):
        proposer.end_request([], token_stream(256, rng, shared))
    cache_s = time.perf_counter() - started
    stream = token_stream(context_len + steps * per_step, rng, shared)
    tensor = torch.tensor([stream])
    params = SamplingParams(temperature=0)
    started = time.perf_counter()
    proposer.propose(ProposeContext(tensor[:, :context_len], params, None, VOCAB), max_k)
    prompt_s = time.perf_counter() - started
    times, drafted = [], 0
    for i in range(1, steps + 1):
        ctx = ProposeContext(tensor[:, : context_len + i * per_step], params, None, VOCAB)
        started = time.perf_counter()
        proposal = proposer.propose(ctx, max_k)
        times.append(time.perf_counter() - started)
        drafted += int(proposal.num_tokens[0])
    return dict(context=context_len, cache_requests=cache_requests, step_us=statistics.median(times) * 1e6,
                p90_step_us=statistics.quantiles(times, n=10)[-1] * 1e6,
                prompt_us_per_token=prompt_s / context_len * 1e6,
                cache_ms_per_request=cache_s / max(cache_requests, 1) * 1e3,
                local_nodes=proposer.local.node_count(), cache_nodes=proposer.cache.trie.node_count(),
                drafted_per_step=drafted / steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="2048,8192,32768")
    parser.add_argument("--cache-requests", default="0,100,1000")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--max-k", type=int, default=16)
    parser.add_argument("--out", default="benchmarks/results/suffix_microbench.json")
    args = parser.parse_args()
    rows = []
    print(f"{'context':>8} {'cache':>6} {'step us':>9} {'p90 us':>8} {'prompt us/tok':>14} "
          f"{'cache ms/req':>13} {'local nodes':>12} {'cache nodes':>12} {'drafts/step':>12}")
    for context in [int(c) for c in args.contexts.split(",")]:
        for requests in [int(r) for r in args.cache_requests.split(",")]:
            row = bench(context, requests, args.steps, args.max_k)
            rows.append(row)
            print(f"{row['context']:>8} {row['cache_requests']:>6} {row['step_us']:>9.0f} {row['p90_step_us']:>8.0f} "
                  f"{row['prompt_us_per_token']:>14.1f} {row['cache_ms_per_request']:>13.2f} "
                  f"{row['local_nodes']:>12} {row['cache_nodes']:>12} {row['drafted_per_step']:>12.2f}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
