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
import gc
import json
import statistics
from pathlib import Path

import torch

from public_engines import SharedModels  # benchmarks/public_engines.py

from specdec.bench.hf_baseline import hf_generate
from specdec.config import SpecConfig
from specdec.demo import DEMO_PROMPTS
from specdec.factory import plain_engine
from specdec.models.loader import load_model
from specdec.sampling import SamplingParams

# The demo's five prompts plus five more, so the demo's numbers are a subset of these.
PROMPTS = DEMO_PROMPTS + [
    ("code", "Write a Python class `Stack` with push, pop, peek and is_empty methods."),
    ("code", "Write a Python function that counts how often each word occurs in a text file."),
    ("prose", "Summarise the causes of the French Revolution in a few sentences."),
    ("prose", "Describe a pleasant walk through a forest in autumn."),
    ("prose", "Give three tips for getting better sleep, with one sentence on each."),
]


def load_done(out_path: Path) -> list[dict]:
    return [json.loads(line) for line in out_path.read_text().splitlines()] if out_path.exists() else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--k", default="2,4,6", help="comma-separated draft lengths")
    parser.add_argument("--hf-k", default=None, help="k values for transformers' assisted generation (default: --k)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=5, help="first N prompts per category (max 5)")
    parser.add_argument("--out", default="results/compare_hf_assisted.jsonl")
    args = parser.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    hf_ks = [int(k) for k in (args.hf_k or args.k).split(",") if k]
    seen: dict[str, int] = {}
    prompts = [(c, p) for c, p in PROMPTS if seen.setdefault(c, 0) < args.prompts and not seen.update({c: seen[c] + 1})]

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    rows = load_done(out_path)
    done = {(r["prompt"], r["system"], r["k"]) for r in rows}
    sink = out_path.open("a")

    def record(row: dict) -> None:
        rows.append(row)
        sink.write(json.dumps(row) + "\n")
        sink.flush()
        tau = row["mean_accepted_length"]
        print(f"  {row['system']:<14} k={row['k']:<2} {row['tokens_per_s']:6.2f} tok/s"
              f"{f'  tau={tau:.2f}' if tau else ''}  identical={row['identical']}", flush=True)

    # Phase 1: specdec (oneDNN-packed linears on CPU), plain then each k: the engines `specdec generate
    # --backend hf --method draft -k K` runs, built by its factory (benchmarks/public_engines.py).
    models = SharedModels()
    config = SpecConfig(target=args.target, draft=args.draft, method="draft", backend="hf")
    plain = plain_engine(models.target(config))
    eos = plain.eos_token_ids
    params = SamplingParams(temperature=0.0)
    prompt_ids = {prompt: plain.encode(prompt, chat=True) for _, prompt in prompts}
    plain.generate(prompts[0][1], params, max_new_tokens=4, chat=True)  # warm-up
    engines = [("specdec-plain", 0, plain)] + [("specdec-draft", k, models.engine(config.with_method("draft", k=k)))
                                               for k in ks]
    for index, (category, prompt) in enumerate(prompts, 1):
        print(f"[specdec {index}/{len(prompts)}] ({category}) {prompt}", flush=True)
        for system, k, engine in engines:
            if (prompt, system, k) in done:
                continue
            result = engine.generate(prompt_ids[prompt], params, max_new_tokens=args.max_new_tokens)
            reference = next((r["token_ids"] for r in rows if r["prompt"] == prompt and r["system"] == "specdec-plain"),
                             result.token_ids)
            record(dict(category=category, prompt=prompt, system=system, k=k, tokens=len(result.token_ids),
                        seconds=result.stats.total_time_s, tokens_per_s=result.stats.tokens_per_s,
                        mean_accepted_length=result.stats.mean_accepted_length,
                        acceptance_rate=result.stats.acceptance_rate if k else None,
                        identical=result.token_ids == reference, token_ids=result.token_ids))
    del models, plain, engines
    gc.collect()

    # Phase 2: stock transformers (plain nn.Linear), plain generate() and assisted generation: the peer,
    # loaded as transformers runs it, not as specdec's engines load it.
    target = load_model(args.target, backend="hf", cpu_linear="torch")
    draft = load_model(args.draft, backend="hf", cpu_linear="torch")
    hf_generate(target.runner.model, torch.tensor([prompt_ids[prompts[0][1]]]), 4)  # warm-up
    for index, (category, prompt) in enumerate(prompts, 1):
        print(f"[transformers {index}/{len(prompts)}] ({category}) {prompt}", flush=True)
        reference = next(r["token_ids"] for r in rows if r["prompt"] == prompt and r["system"] == "specdec-plain")
        for system, k in [("hf-plain", 0)] + [("hf-assisted", k) for k in hf_ks]:
            if (prompt, system, k) in done:
                continue
            assistant = draft.runner.model if k else None
            tokens, seconds, _ = hf_generate(target.runner.model, torch.tensor([prompt_ids[prompt]]), args.max_new_tokens,
                                          assistant, k)
            cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))  # stop at EOS like specdec
            tokens = tokens[:cut]
            record(dict(category=category, prompt=prompt, system=system, k=k, tokens=len(tokens), seconds=seconds,
                        tokens_per_s=len(tokens) / seconds, mean_accepted_length=None, acceptance_rate=None,
                        identical=tokens == reference, token_ids=tokens))
    sink.close()
    print_summary(rows)


def print_summary(rows: list[dict]) -> None:
    plain_tps = {(r["prompt"], r["system"].split("-")[0]): r["tokens_per_s"] for r in rows if r["k"] == 0}
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        for category in (row["category"], "all"):
            groups.setdefault((category, row["system"], row["k"]), []).append(row)
    print(f"\n{'category':<9}{'system':<15}{'k':>3}{'tok/s':>8}{'tau':>7}{'accept':>9}{'speedup':>9}"
          f"{'vs hf-plain':>13}{'identical':>11}")
    for (category, system, k), group in sorted(groups.items()):
        speedups = [r["tokens_per_s"] / plain_tps[(r["prompt"], system.split("-")[0])] for r in group]
        vs_hf = [r["tokens_per_s"] / plain_tps[(r["prompt"], "hf")] for r in group if (r["prompt"], "hf") in plain_tps]
        taus = [r["mean_accepted_length"] for r in group if r["mean_accepted_length"] is not None]
        accepts = [r["acceptance_rate"] for r in group if r["acceptance_rate"] is not None]
        print(f"{category:<9}{system:<15}{k:>3}{statistics.mean(r['tokens_per_s'] for r in group):>8.2f}"
              f"{(statistics.mean(taus) if taus else float('nan')):>7.2f}"
              f"{(statistics.mean(accepts) if accepts else float('nan')):>9.1%}"
              f"{statistics.mean(speedups):>8.2f}x{(statistics.mean(vs_hf) if vs_hf else float('nan')):>12.2f}x"
              f"{sum(r['identical'] for r in group):>8}/{len(group)}")
    print("speedup: mean over prompts of tok/s / tok/s of the same library's plain decoding of that prompt;\n"
          "vs hf-plain: the same ratio against stock transformers generate() without an assistant.\n"
          "identical: greedy tokens equal to specdec's plain decoding.")


if __name__ == "__main__":
    main()
