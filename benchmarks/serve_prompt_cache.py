"""Prompt caching across requests in `specdec serve`: the same requests against a server that keeps
finished requests' rows (the default) and one started with --no-prompt-cache, interleaved request
by request, in one run.

Two workloads, each one client sending requests one after another (streamed chat completions,
greedy, the chat template):
- agent-loop: the 40 prompts of the agent-loop set (20 SQL questions over one schema, then 20
  calls of one tool), each repeating its predecessor's ~150-token preamble;
- chat: MT-bench-style two-turn conversations, whose second turn sends the first turn's
  question and answer back (as every chat client does).
Both servers must write the same text for every request (greedy output is the target's either
way). Reports per workload and server the median time to first token, the median and total
request time, the prompt tokens the server did not read again (usage.prompt_tokens_details.
cached_tokens), and writes OUT/serve_prompt_cache.json and .md.

  python benchmarks/serve_prompt_cache.py                      # plain decoding, 64 new tokens
  python benchmarks/serve_prompt_cache.py --method ngram -k auto --limit 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx

from serve_load import free_port, start_server
from specdec.bench.prompt_sets import load_prompts
from specdec.models.cpu_features import cpu_model, effective_isa


def ask(url: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started, first, text, usage = time.perf_counter(), None, [], None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = first or time.perf_counter()
                text.append(chunk["choices"][0]["delta"]["content"])
            usage = chunk.get("usage") or usage
    done = time.perf_counter()
    return {"ttft_s": (first or done) - started, "seconds": done - started, "text": "".join(text),
            "prompt_tokens": usage["prompt_tokens"], "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def conversations(workload: str, limit: int | None) -> list[list[str]]:
    """Each conversation's user turns (agent-loop: one long stream of single-turn requests)."""
    if workload == "agent-loop":
        return [[prompt.turns[0]] for prompt in load_prompts(["agent-loop"], None)[:limit]]
    chats = [prompt.turns for prompt in load_prompts(["mt-bench"], None) if len(prompt.turns) >= 2]
    return chats[:limit or 8]


def run(workload: str, urls: dict[str, str], limit: int | None, max_tokens: int) -> dict:
    rows = {name: [] for name in urls}
    for number, turns in enumerate(conversations(workload, limit)):
        histories = {name: [] for name in urls}
        for turn in turns:
            for name, url in urls.items():  # interleaved: both servers see the VM at the same moment
                histories[name].append({"role": "user", "content": turn})
                row = ask(url, histories[name], max_tokens)
                histories[name].append({"role": "assistant", "content": row["text"]})
                rows[name].append(row)
            texts = {rows[name][-1]["text"] for name in urls}
            if len(texts) != 1:
                raise SystemExit(f"{workload} conversation {number}: the servers wrote different text")
            print(f"  {workload} {number + 1}: " + "  ".join(
                f"{name} ttft {rows[name][-1]['ttft_s']:.2f} s, cached {rows[name][-1]['cached_tokens']}"
                for name in urls), flush=True)
    return {name: {"requests": len(values), "ttft_p50_s": statistics.median(r["ttft_s"] for r in values),
                   "seconds_p50": statistics.median(r["seconds"] for r in values),
                   "total_s": sum(r["seconds"] for r in values),
                   "prompt_tokens": sum(r["prompt_tokens"] for r in values),
                   "cached_tokens": sum(r["cached_tokens"] for r in values)} for name, values in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--method", default="autoregressive")
    parser.add_argument("-k", default="auto")
    parser.add_argument("--workloads", default="agent-loop,chat")
    parser.add_argument("--limit", type=int, default=None, help="requests (agent-loop) or conversations (chat)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/serve-prompt-cache"))
    args = parser.parse_args()
    method = ["--method", args.method] + ([] if args.method == "autoregressive" else ["-k", args.k])
    servers, urls = [], {}
    try:
        for name, extra in (("cache", []), ("no cache", ["--no-prompt-cache"])):
            port = free_port()
            servers.append(start_server(args, method + extra, port))
            urls[name] = f"http://127.0.0.1:{port}"
        ask(urls["cache"], [{"role": "user", "content": "hi"}], 4)  # warm-up, both
        ask(urls["no cache"], [{"role": "user", "content": "hi"}], 4)
        results = {workload: run(workload, urls, args.limit, args.max_tokens)
                   for workload in args.workloads.split(",")}
    finally:
        for server in servers:
            server.terminate()
            server.wait()
    summary = {"machine": f"{cpu_model()} ({effective_isa()})", "method": args.method, "max_tokens": args.max_tokens,
               "results": results}
    lines = [f"# Prompt caching in specdec serve ({summary['machine']}, {args.method}, {args.max_tokens} new tokens)",
             "", "| workload | server | requests | TTFT p50 s | request p50 s | total s | prompt tokens | cached |",
             "|---|---|---|---|---|---|---|---|"]
    for workload, by_server in results.items():
        for name, r in by_server.items():
            lines.append(f"| {workload} | {name} | {r['requests']} | {r['ttft_p50_s']:.3f} | {r['seconds_p50']:.2f} | "
                         f"{r['total_s']:.1f} | {r['prompt_tokens']} | {r['cached_tokens']} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_prompt_cache.json").write_text(json.dumps(summary, indent=1))
    (args.out / "serve_prompt_cache.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
