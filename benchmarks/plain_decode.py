"""Plain greedy decode tok/s of the embedded target (prefill excluded): the number batch
invariance must not cost. A short chat prompt and a ~1,300-token one, 64 new tokens, best
of 2 in the process; one JSON line. Compare two versions by running this alternately in
each checkout (interleaved, several rounds, medians), e.g.

    git worktree add /tmp/before <commit>
    for round in 1 2 3; do
      (cd /tmp/before && PYTHONPATH=src python /path/to/benchmarks/plain_decode.py)
      python benchmarks/plain_decode.py
    done

    python benchmarks/plain_decode.py [--dtype auto|float32|bfloat16]
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import textwrap

from specdec.config import SpecConfig
from specdec.factory import load_models, plain_engine
from specdec.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    target, _ = load_models(SpecConfig(target="qwen2.5-coder-1.5b", dtype=args.dtype, quantize="none"), progress=False)
    # The factory's plain engine (`specdec generate --method autoregressive --quantize none`), but no
    # token ends a request: each prompt decodes all its 64 tokens, so every run times as many steps.
    engine = plain_engine(dataclasses.replace(target, eos_token_ids=frozenset()))
    params = SamplingParams(temperature=0)
    engine.generate("hi", params, max_new_tokens=4, chat=True)  # warm-up
    prompts = {"short": "Write a Python function that merges two sorted lists into one sorted list.",
               "long": "Explain what the following module does.\n\n" + inspect.getsource(textwrap)[:5200]}
    row = {}
    for name, prompt in prompts.items():
        rates = []
        for _ in range(2):
            out = engine.generate(prompt, params, max_new_tokens=64, chat=True)
            rates.append(out.stats.generated_tokens / out.stats.decode_time_s)
        row[name] = round(max(rates), 3)
        row[f"{name}_prompt_tokens"] = out.stats.prompt_tokens
        row[f"{name}_prefill_s"] = round(out.stats.prefill_time_s, 3)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
