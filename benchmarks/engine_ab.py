"""The engines' speed and output on the default pair, for an A/B of two source trees.

Runs, greedy, on the embedded w4a8 pair:
  single  SpecEngine decode tok/s: plain, the default (ngram, -k auto) and the draft model (k 4),
          two prompts of 64 tokens, median over --reps;
  batch   BatchEngine tok/s with 1 and 4 rows (plain, ngram and the draft model, -k auto), four
          prompts of 48 tokens fed through the rows, median over --reps (after one warm-up);
and prints one JSON line with those medians and a hash of every output token, which two trees
that decode exactly alike must share (at the same --reps: every repeat's tokens go into it).
Compare trees by alternating processes on one machine, e.g.

  git worktree add /tmp/before HEAD~1
  for tree in /tmp/before . . /tmp/before; do PYTHONPATH=$tree/src python benchmarks/engine_ab.py; done
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time

from specdec.config import SpecConfig
from specdec.engine.batch import BatchEngine
from specdec.factory import batch_proposer_for, engine_for, load_models, plain_engine
from specdec.sampling import SamplingParams

PROMPTS = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
           "Explain how a hash map handles collisions, with a small Python example.",
           "Translate to French: The weather was cold, so we stayed inside and read books all afternoon.",
           'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n']


def single_rates(engines: dict, reps: int, digest) -> dict[str, float]:
    out = {}
    for name, engine in engines.items():
        engine.generate(PROMPTS[0], SamplingParams(), max_new_tokens=8, chat=True)  # warm-up
        rates = []
        for _ in range(reps):
            tokens = seconds = 0.0
            for prompt in PROMPTS[:2]:
                result = engine.generate(prompt, SamplingParams(), max_new_tokens=64, chat=True)
                tokens, seconds = tokens + result.stats.generated_tokens, seconds + result.stats.decode_time_s
                digest.update(str(result.token_ids).encode())
            rates.append(tokens / seconds)
        out[f"single {name}"] = round(statistics.median(rates), 2)
    return out


def batch_rate(engine: BatchEngine, reps: int, digest) -> float:
    rates = []
    for rep in range(reps + 1):  # the first is a warm-up
        started, tokens, queue, outputs = time.perf_counter(), 0, list(enumerate(PROMPTS)), {}
        while queue or engine.running:
            while queue and engine.free_slots:
                handle, prompt = queue.pop(0)
                engine.add(handle, engine.make_request(prompt, SamplingParams(), max_new_tokens=48, chat=True))
            for update in engine.step():
                tokens += len(update.token_ids)
                outputs.setdefault(update.handle, []).extend(update.token_ids)
        if rep:
            rates.append(tokens / (time.perf_counter() - started))
        digest.update(str(sorted(outputs.items())).encode())
    return round(statistics.median(rates), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=2, help="timed repeats per setup (default: 2)")
    args = parser.parse_args()
    target, draft = load_models(SpecConfig(method="draft"), need_draft=True)
    digest = hashlib.sha256()
    out = single_rates({"plain": plain_engine(target), "default": engine_for(SpecConfig().resolved("cpu"), target),
                        "draft": engine_for(SpecConfig(method="draft", k=4), target, draft)}, args.reps, digest)
    for slots in (1, 4):
        rows_target, rows_draft = target.runner.with_batch_size(slots), draft.runner.with_batch_size(slots)
        for method in ("autoregressive", "ngram", "draft"):
            proposer = batch_proposer_for(SpecConfig(method=method, k="auto"), slots=slots, draft_runner=rows_draft)
            # As `specdec serve` builds it (server/__init__.py): the factory's proposer in a BatchEngine.
            engine = BatchEngine(rows_target, proposer, target.tokenizer, k="auto")
            out[f"batch{slots} {method}"] = batch_rate(engine, args.reps, digest)
    out["outputs"] = digest.hexdigest()[:12]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
