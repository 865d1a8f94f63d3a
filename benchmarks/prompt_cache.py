"""Prompt caching across requests (SpecEngine.reuse_prefix) on an agent loop.

The agent-loop prompt set is 20 SQL questions over one schema, then 20 calls of one tool:
every request repeats its predecessor's ~150-token preamble. With reuse_prefix a request
prefills only what follows the prefix it shares with the last request's prompt and answer.

  python benchmarks/prompt_cache.py [--methods autoregressive,ngram,suffix] [--repeats 1] [--out DIR]

For each method and repeat, the 40 requests run as one stream (greedy, 128 tokens, chat
template) with reuse_prefix off, then on, on one loaded target; outputs must be identical.
Reports per method the total time, prefill p50, time to first token p50 and the prompt
tokens read, off and on. (`specdec bench --stream` interleaves methods request by request,
on one target, so no engine there finds its own prefix still cached.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from specdec.bench.harness import _chat_ids
from specdec.bench.prompt_sets import load_prompts
from specdec.config import SpecConfig
from specdec.factory import engine_for, load_models, plain_engine
from specdec.models.cpu_features import cpu_model, effective_isa
from specdec.sampling import SamplingParams


def run_stream(engine, prompts, reuse: bool, max_new_tokens: int) -> list[dict]:
    engine.reuse_prefix = reuse
    engine.forget_earlier_requests()
    rows = []
    for prompt in prompts:
        ids = _chat_ids(engine.tokenizer, [{"role": "user", "content": prompt.turns[0]}])
        result = engine.generate(ids, SamplingParams(temperature=0), max_new_tokens=max_new_tokens)
        stats = result.stats
        rows.append(dict(question_id=prompt.question_id, seconds=stats.total_time_s, prefill=stats.prefill_time_s,
                         ttft=stats.first_token_s, prompt_tokens=stats.prompt_tokens,
                         reused=stats.prompt_tokens_reused, tokens=result.token_ids))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="autoregressive,ngram,suffix")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/prompt-cache"))
    args = parser.parse_args()
    prompts = load_prompts(["agent-loop"], None)
    config = SpecConfig(method="ngram", k="auto").resolved("cpu")
    target, _ = load_models(config, need_draft=False)
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"machine": f"{cpu_model()} ({effective_isa()})", "target": target.describe(), "methods": {}}
    for method in args.methods.split(","):
        engine = (plain_engine(target) if method == "autoregressive"
                  else engine_for(SpecConfig(method=method, k="auto").resolved("cpu"), target))
        if not engine.reuse_prefix:  # set at construction only where reuse is exact
            raise SystemExit(f"{method}: this engine cannot reuse prompts exactly (see SpecEngine.reuse_prefix)")
        runs = {False: [], True: []}
        for repeat in range(args.repeats):
            for reuse in (False, True):
                rows = run_stream(engine, prompts, reuse, args.max_new_tokens)
                runs[reuse].append(rows)
                print(f"{method} repeat {repeat} reuse {reuse}: {sum(r['seconds'] for r in rows):.1f}s", flush=True)
        identical = all(a["tokens"] == b["tokens"] for off, on in zip(runs[False], runs[True]) for a, b in zip(off, on))
        entry = {"identical": identical}
        for reuse, label in ((False, "off"), (True, "on")):
            flat = [row for rows in runs[reuse] for row in rows]
            entry[label] = {
                "total_s": round(statistics.median(sum(r["seconds"] for r in rows) for rows in runs[reuse]), 1),
                "prefill_p50_s": round(statistics.median(r["prefill"] for r in flat), 3),
                "ttft_p50_s": round(statistics.median(r["ttft"] for r in flat), 3),
                "prompt_tokens_read": sum(r["prompt_tokens"] - r["reused"] for r in runs[reuse][0]),
                "prompt_tokens": sum(r["prompt_tokens"] for r in runs[reuse][0]),
            }
        summary["methods"][method] = entry
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\n{summary['machine']}; {summary['target']}; 40 requests, greedy, {args.max_new_tokens} tokens")
    print("method          total off -> on      prefill p50       TTFT p50          prompt tokens read   identical")
    plain_off = summary["methods"].get("autoregressive", {}).get("off", {}).get("total_s")
    for method, entry in summary["methods"].items():
        off, on = entry["off"], entry["on"]
        ratio = f" ({plain_off / on['total_s']:.2f}x plain-off)" if plain_off else ""
        print(f"{method:<15} {off['total_s']:6.1f} -> {on['total_s']:6.1f}s{ratio}  "
              f"{off['prefill_p50_s']:.3f} -> {on['prefill_p50_s']:.3f}s  {off['ttft_p50_s']:.3f} -> "
              f"{on['ttft_p50_s']:.3f}s  {off['prompt_tokens_read']} -> {on['prompt_tokens_read']} of "
              f"{on['prompt_tokens']}   {entry['identical']}")
    return 0 if all(entry["identical"] for entry in summary["methods"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
