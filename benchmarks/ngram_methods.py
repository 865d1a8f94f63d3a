"""ngram vs draft vs ngram+draft vs plain decoding: same target, same prompts, one run.

Two suites (src/specdec/bench/suites.py): input-grounded (5 code edits, 5
summaries/extractions over a given text) and free generation (5 prompts). Every
method runs on every prompt with the chat template, greedy; every output must
equal plain decoding's token for token. Rows stream to a JSONL file (resumable:
finished (prompt, method) pairs are skipped) and the summary prints per suite:
tokens/s, speedup over plain (ratio of summed tokens over summed time, and the
median of per-prompt ratios), mean accepted length tau, acceptance rate.

  python benchmarks/ngram_methods.py --max-new-tokens 256
  python benchmarks/ngram_methods.py --summary-only     # re-print the table from the JSONL
  python benchmarks/ngram_methods.py --methods "ngram:k=8" "ngram:k=12,ngram_max=4" --prompts 2

A method is NAME[:option=value,...] with NAME from `specdec generate --help`
and options k, ngram_max, ngram_min, draft_k; its engine is the one `specdec generate --method NAME
-k K --ngram-max ... --backend B --quantize Q` runs, built by the same factory
(benchmarks/public_engines.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from public_engines import build_engines  # benchmarks/public_engines.py

from specdec.bench.suites import suite
from specdec.config import QUANTIZATIONS, NgramOptions, SpecConfig
from specdec.sampling import SamplingParams

DEFAULT_METHODS = [
    "autoregressive", "ngram:k=8", "draft:k=4", "ngram+draft:k=8,draft_k=4", "ngram+draft:k=8,draft_k=4,ngram_min=2",
]


def parse_method(spec: str) -> tuple[str, dict]:
    name, _, options = spec.partition(":")
    parsed = {}
    for item in filter(None, options.split(",")):
        key, _, value = item.partition("=")
        if key not in {"k", "ngram_max", "ngram_min", "draft_k"}:
            raise ValueError(f"unknown option {key!r} in method {spec!r}")
        parsed[key] = int(value)
    return name, parsed


def spec_config(spec: str, args) -> SpecConfig:
    """A method's SpecConfig: its options over --target, --draft, --backend and --quantize."""
    name, options = parse_method(spec)
    ngram = NgramOptions(**{key.removeprefix("ngram_"): options[key] for key in ("ngram_max", "ngram_min")
                            if key in options})
    return SpecConfig(target=args.target, method=name, k=options.get("k", 4), draft=args.draft,
                      backend=args.backend, quantize=args.quantize, options=(ngram,), draft_k=options.get("draft_k"))


def summarise(rows: list[dict], methods: list[str]) -> str:
    lines = []
    for suite_name in dict.fromkeys(r["suite"] for r in rows):
        in_suite = [r for r in rows if r["suite"] == suite_name]
        plain = {r["prompt"]: r for r in in_suite if r["method"] == "autoregressive"}
        plain_rate = sum(r["tokens"] for r in plain.values()) / sum(r["seconds"] for r in plain.values())
        lines.append(f"\n{suite_name} ({len(plain)} prompts)")
        lines.append(f"{'method':<34}{'tok/s':>7}{'speedup':>9}{'median':>8}{'tau':>7}{'accept':>8}  identical")
        for method in methods:
            got = [r for r in in_suite if r["method"] == method and r["prompt"] in plain]
            if not got:
                continue
            rate = sum(r["tokens"] for r in got) / sum(r["seconds"] for r in got)
            ratios = [r["tokens_per_s"] / plain[r["prompt"]]["tokens_per_s"] for r in got]
            forwards = sum(r["target_forwards"] for r in got)
            drafted = sum(r["drafted_tokens"] for r in got)
            accepted = sum(r["accepted_tokens"] for r in got)
            same = sum(r["identical"] for r in got)
            lines.append(
                f"{method:<34}{rate:>7.2f}{rate / plain_rate:>8.2f}x{statistics.median(ratios):>7.2f}x"
                f"{sum(r['tokens'] for r in got) / forwards:>7.2f}"
                f"{(accepted / drafted if drafted else 0):>8.1%}  {same}/{len(got)}"
            )
    lines.append("speedup = summed tokens / summed seconds over plain's; median = median of per-prompt ratios; "
                 "tau = tokens per target forward")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS)
    parser.add_argument("--suites", nargs="+", default=["input-grounded", "free"])
    parser.add_argument("--prompts", type=int, default=None, help="first N prompts of each category")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--backend", default="hf", choices=["hf", "native"],
                        help="model backend (default: hf, which the README's n-gram table was measured with)")
    parser.add_argument("--quantize", default="none", choices=["auto", *QUANTIZATIONS],
                        help="the target's weights (default: none, as the README's n-gram table was measured; "
                             "auto is generate's default); the draft's are auto, int4 on native bf16 CPUs")
    parser.add_argument("--out", default="benchmarks/results/ngram_methods.jsonl")
    parser.add_argument("--summary-only", action="store_true", help="print the summary of --out; load no model")
    args = parser.parse_args()
    methods = ["autoregressive"] + [m for m in args.methods if m != "autoregressive"]
    configs = {m: spec_config(m, args) for m in methods}  # a typo fails here, before any model loads

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in out_path.read_text().splitlines()] if out_path.exists() else []
    done = {(r["prompt"], r["method"]) for r in rows}
    if args.summary_only:
        print(summarise(rows, methods))
        return

    engines = build_engines(configs)
    params = SamplingParams(temperature=0.0)
    for engine in engines.values():  # warm-up: allocations, kernel selection
        engine.generate("def f(x): return x", params, max_new_tokens=8, chat=True)

    with out_path.open("a") as sink:
        for suite_name in args.suites:
            counts: dict[str, int] = {}
            prompts = [(c, p) for c, p in suite(suite_name)
                       if args.prompts is None or counts.setdefault(c, 0) < args.prompts
                       and not counts.update({c: counts[c] + 1})]
            for index, (category, prompt) in enumerate(prompts, 1):
                print(f"[{suite_name} {index}/{len(prompts)}] ({category}) {prompt[:70]!r}...", flush=True)
                for method, engine in engines.items():
                    if (prompt, method) in done:
                        continue
                    result = engine.generate(prompt, params, max_new_tokens=args.max_new_tokens, chat=True)
                    stats = result.stats
                    reference = next((r["token_ids"] for r in rows
                                      if r["prompt"] == prompt and r["method"] == "autoregressive"), result.token_ids)
                    row = dict(suite=suite_name, category=category, prompt=prompt, method=method,
                               tokens=len(result.token_ids), seconds=stats.total_time_s,
                               tokens_per_s=stats.tokens_per_s, target_forwards=stats.target_forwards,
                               drafted_tokens=stats.drafted_tokens, accepted_tokens=stats.accepted_tokens,
                               identical=result.token_ids == reference, token_ids=result.token_ids)
                    rows.append(row)
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()
                    print(f"  {method:<32}{row['tokens']:>4} tok {row['tokens_per_s']:6.2f} tok/s "
                          f"tau={stats.mean_accepted_length:.2f} identical={row['identical']}", flush=True)
    print(summarise(rows, methods))


if __name__ == "__main__":
    main()
