"""specdec vs transformers' assisted generation, same models, same prompts, one run.

For each prompt (5 code, 5 prose; chat template; greedy) this measures:
  - specdec plain decoding (method autoregressive) and specdec speculative
    decoding (method draft) for each k,
  - transformers `generate()` plain and `generate(assistant_model=draft)` with
    a constant number of assistant tokens k,
and checks that every greedy output equals specdec's plain output.
Results stream to a JSONL file (one line per generation, resumable) and a
summary table is printed: tokens/s, mean accepted length, acceptance rate,
speedup (mean of per-prompt tok/s ratios against the same library's plain run).

  python benchmarks/compare_hf_assisted.py --k 2,4,6 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specdec.engine import SpecEngine
from specdec.engine.engine import eos_ids_of
from specdec.models.loader import check_same_vocabulary, load_model
from specdec.proposers import DraftModelProposer
from specdec.sampling import SamplingParams

PROMPTS = [
    ("code", "Write a Python function `is_prime(n)` that returns True when n is a prime number."),
    ("code", "Write a Python function that merges two sorted lists into one sorted list."),
    ("code", "Implement binary search in Python as a function `binary_search(items, target)`."),
    ("code", "Write a Python class `Stack` with push, pop, peek and is_empty methods."),
    ("code", "Write a Python function that counts how often each word occurs in a text file."),
    ("prose", "Explain in a short paragraph why the sky is blue."),
    ("prose", "Write a short note to a colleague asking to move our meeting to Thursday."),
    ("prose", "Summarise the causes of the French Revolution in a few sentences."),
    ("prose", "Describe a pleasant walk through a forest in autumn."),
    ("prose", "Give three tips for getting better sleep, with one sentence on each."),
]


def hf_generate(model, input_ids, max_new_tokens, assistant=None, k=None):
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=model.generation_config.eos_token_id)
    if assistant is not None:
        # A constant k, no early stop on low confidence: the same algorithm as specdec's fixed k.
        assistant.generation_config.num_assistant_tokens = k
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = assistant
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
    elapsed = time.perf_counter() - started
    return out[0, input_ids.shape[1]:].tolist(), elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--k", default="2,4,6", help="comma-separated draft lengths")
    parser.add_argument("--hf-k", default=None, help="k values for transformers' assisted generation (default: --k)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="first N prompts per category")
    parser.add_argument("--out", default="results/compare_hf_assisted.jsonl")
    args = parser.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    hf_ks = [int(k) for k in (args.hf_k or args.k).split(",") if k]

    target = load_model(args.target)
    draft = load_model(args.draft)
    check_same_vocabulary(target.tokenizer, draft.tokenizer)
    tokenizer = target.tokenizer
    eos = eos_ids_of(tokenizer, target.runner.model.generation_config)
    plain = SpecEngine(target.runner, None, tokenizer, eos_token_ids=eos)
    spec = {k: SpecEngine(target.runner, DraftModelProposer(draft.runner), tokenizer, k=k, eos_token_ids=eos) for k in ks}
    params = SamplingParams(temperature=0.0)

    by_category: dict[str, int] = {}
    prompts = []
    for category, prompt in PROMPTS:
        by_category[category] = by_category.get(category, 0) + 1
        if by_category[category] <= args.prompts:
            prompts.append((category, prompt))

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if out_path.exists():
        for line in out_path.read_text().splitlines():
            row = json.loads(line)
            done.add((row["prompt"], row["system"], row["k"]))
    rows = [json.loads(line) for line in out_path.read_text().splitlines()] if out_path.exists() else []

    plain.generate(prompts[0][1], params, max_new_tokens=4, chat=True)  # warm-up
    with out_path.open("a") as sink:
        def record(row):
            rows.append(row)
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            print(f"  {row['system']:<16} k={row['k']!s:<4} {row['tokens_per_s']:6.2f} tok/s  "
                  f"tau={row.get('mean_accepted_length') or float('nan'):.2f}  identical={row['identical']}", flush=True)

        for index, (category, prompt) in enumerate(prompts, 1):
            print(f"[{index}/{len(prompts)}] ({category}) {prompt}", flush=True)
            ids = plain.encode(prompt, chat=True)
            reference = None
            if (prompt, "specdec-plain", 0) not in done:
                result = plain.generate(ids, params, max_new_tokens=args.max_new_tokens)
                reference = result.token_ids
                record(dict(category=category, prompt=prompt, system="specdec-plain", k=0, tokens=len(result.token_ids),
                            seconds=result.stats.total_time_s, tokens_per_s=result.stats.tokens_per_s,
                            mean_accepted_length=1.0, acceptance_rate=None, identical=True, token_ids=reference))
            else:
                reference = next(r["token_ids"] for r in rows if r["prompt"] == prompt and r["system"] == "specdec-plain")
            for k in ks:
                if (prompt, "specdec-draft", k) in done:
                    continue
                result = spec[k].generate(ids, params, max_new_tokens=args.max_new_tokens)
                record(dict(category=category, prompt=prompt, system="specdec-draft", k=k, tokens=len(result.token_ids),
                            seconds=result.stats.total_time_s, tokens_per_s=result.stats.tokens_per_s,
                            mean_accepted_length=result.stats.mean_accepted_length,
                            acceptance_rate=result.stats.acceptance_rate, identical=result.token_ids == reference))
            input_ids = torch.tensor([ids])
            for system, k in [("hf-plain", 0)] + [("hf-assisted", k) for k in hf_ks]:
                if (prompt, system, k) in done:
                    continue
                assistant = draft.runner.model if k else None
                tokens, seconds = hf_generate(target.runner.model, input_ids, args.max_new_tokens, assistant, k)
                tokens = [t for t in tokens]
                # transformers keeps generating pad after EOS only in batches; cut at our EOS set.
                cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
                tokens = tokens[:cut]
                record(dict(category=category, prompt=prompt, system=system, k=k, tokens=len(tokens), seconds=seconds,
                            tokens_per_s=len(tokens) / seconds, mean_accepted_length=None, acceptance_rate=None,
                            identical=tokens == reference))

    print_summary(rows)


def print_summary(rows: list[dict]) -> None:
    plain_tps = {(r["prompt"], r["system"].split("-")[0]): r["tokens_per_s"] for r in rows if r["k"] == 0}
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        for category in (row["category"], "all"):
            groups.setdefault((category, row["system"], row["k"]), []).append(row)
    print(f"\n{'category':<8}{'system':<16}{'k':>3}{'tok/s':>8}{'tau':>7}{'accept':>9}{'speedup':>9}{'identical':>11}")
    for (category, system, k), group in sorted(groups.items()):
        speedups = [r["tokens_per_s"] / plain_tps[(r["prompt"], system.split("-")[0])] for r in group]
        taus = [r["mean_accepted_length"] for r in group if r["mean_accepted_length"] is not None]
        accepts = [r["acceptance_rate"] for r in group if r["acceptance_rate"] is not None]
        print(f"{category:<8}{system:<16}{k:>3}{statistics.mean(r['tokens_per_s'] for r in group):>8.2f}"
              f"{(statistics.mean(taus) if taus else float('nan')):>7.2f}"
              f"{(statistics.mean(accepts) if accepts else float('nan')):>9.1%}"
              f"{statistics.mean(speedups):>8.2f}x{sum(r['identical'] for r in group):>7}/{len(group)}")
    print("speedup: mean over prompts of tok/s / tok/s of the same library's plain decoding of that prompt.")


if __name__ == "__main__":
    main()
