"""Load test of `specdec serve`: throughput and latency at 1, 2, 4, 8 and 16 concurrent
clients, speculation on against the same server with speculation off, in one run.

For each server setup (plain decoding; then each --methods entry with -k, default
auto: each step's k per request, 0 included, from measured costs and acceptance;
optionally the first method again with --spec-max-batch) this starts `specdec serve`
on a free localhost port (nothing else is contacted), warms it up, and for each
concurrency level C runs C clients that each send their share of the requests one
after another (streaming chat completions, greedy, the same prompts in the same
order for every setup). The prompts interleave the suites' categories, so every
level mixes short questions with long documents (rag: ~800 tokens), which every
server prefills --prefill-chunk tokens per step (0: whole, before the next step).
It records per request: time to first token, end-to-end latency, completion
tokens; per level: wall time, throughput (completion tokens over all clients /
wall time), p50/p99 latency and TTFT. Bounded: max(--min-requests, clients)
requests per level and a --time-limit per level (requests not started by then
are skipped and counted).

Greedy decoding is lossless, so every setup generates the same tokens: the
comparison is pure speed. Writes OUT/serve_load.json, OUT/serve_load.md and
OUT/serve_load.png.

  python benchmarks/serve_load.py --repeats 2             # plain vs ngram and draft with -k auto, 1..16 clients
  python benchmarks/serve_load.py --methods draft -k 2 --spec-max-batch auto   # fixed k, and with the switch
  python benchmarks/serve_load.py --prefill-chunk 0       # whole-prompt prefill (before chunking)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
from itertools import zip_longest
import sys
import time
from pathlib import Path

import httpx

from specdec.bench.prompt_sets import load_prompts


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def setups(args) -> list[tuple[str, list[str]]]:
    """(label, serve options): speculation off first, the baseline."""
    chosen = [("plain", ["--method", "autoregressive"])]
    methods = [m for m in args.methods.split(",") if m]
    for method in methods:
        spec = ["--method", method, "-k", args.k, "--max-k", str(args.max_k)]
        if method in ("draft", "ngram+draft"):
            spec += ["--draft", args.draft]
        always = [] if args.k == "auto" else ["--spec-max-batch", str(args.max_batch)]  # fixed k: every step drafts
        chosen.append((f"{method} k={args.k}", spec + always))
        if args.spec_max_batch is not None and method == methods[0]:
            chosen.append((f"{method} k={args.k}, spec-max-batch {args.spec_max_batch}",
                           spec + ["--spec-max-batch", args.spec_max_batch]))
    return chosen


def mixed_prompts(sources: list[str], per_category: int) -> list[str]:
    """The suites' first prompts per category, interleaved across categories (long documents
    among short questions at every level)."""
    by_category: dict[str, list[str]] = {}
    for prompt in load_prompts(sources, per_category=per_category):
        by_category.setdefault(prompt.category, []).append(prompt.turns[0])
    return [p for group in zip_longest(*by_category.values()) for p in group if p is not None]


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile (q in 0..100): with 16 requests, p99 is the slowest."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, -(-len(ordered) * q // 100) - 1))]


def start_server(args, options: list[str], port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "specdec.cli", "serve", "--target", args.target, "--port", str(port),
               *options, "--max-batch", str(args.max_batch), "--max-queue", "64", "--served-model-name", "bench",
               "--prefill-chunk", str(args.prefill_chunk), "--log-level", "warning"]
    process = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 600
    while True:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with status {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise SystemExit("the server did not come up in 10 minutes")
        time.sleep(0.5)


async def one_request(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = None
    usage, speculative, text = None, None, []
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = first or time.perf_counter()
                text.append(chunk["choices"][0]["delta"]["content"])
            usage = chunk.get("usage") or usage
            speculative = chunk.get("speculative") or speculative
    done = time.perf_counter()
    return {"ttft_s": (first or done) - started, "latency_s": done - started, "tokens": usage["completion_tokens"],
            "text": "".join(text), "mean_accepted_length": speculative["mean_accepted_length"]}


async def run_level(url: str, prompts: list[str], clients: int, max_tokens: int, time_limit: float) -> dict:
    queue = list(enumerate(prompts))
    results: dict[int, dict] = {}
    started = time.perf_counter()

    async def client(http):
        while queue and time.perf_counter() - started < time_limit:
            index, prompt = queue.pop(0)
            results[index] = await one_request(http, url, prompt, max_tokens)

    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    wall = time.perf_counter() - started
    rows = [results[i] for i in sorted(results)]
    tokens = sum(r["tokens"] for r in rows)
    return {
        "clients": clients, "requests": len(rows), "skipped": len(prompts) - len(rows), "wall_s": wall,
        "tokens": tokens, "throughput_tok_s": tokens / wall,
        "ttft_p50_s": statistics.median(r["ttft_s"] for r in rows),
        "ttft_p99_s": percentile([r["ttft_s"] for r in rows], 99),
        "latency_p50_s": statistics.median(r["latency_s"] for r in rows),
        "latency_p90_s": percentile([r["latency_s"] for r in rows], 90),
        "latency_p99_s": percentile([r["latency_s"] for r in rows], 99),
        "per_request_tok_s_p50": statistics.median(r["tokens"] / r["latency_s"] for r in rows),
        # After each request's first token: what speculation can speed up (the prefill it cannot).
        "decode_tok_s": sum(r["tokens"] - 1 for r in rows) / max(sum(r["latency_s"] - r["ttft_s"] for r in rows), 1e-9),
        "mean_accepted_length": statistics.fmean(r["mean_accepted_length"] for r in rows),
        "texts": [r["text"] for r in rows],
    }


def median_row(rows: list[dict]) -> dict:
    """Medians over repeats of every timing; counts and texts from the first repeat."""
    merged = dict(rows[0])
    for key in ("wall_s", "throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "latency_p50_s", "latency_p90_s",
                "latency_p99_s", "per_request_tok_s_p50", "decode_tok_s", "mean_accepted_length"):
        if all(key in row for row in rows):
            merged[key] = statistics.median(row[key] for row in rows)
    merged["throughput_by_repeat"] = [row["throughput_tok_s"] for row in rows]
    return merged


def render(levels: dict[str, list[dict]]) -> str:
    """One row per (clients, setup); ratios against plain decoding at the same concurrency."""
    plain = {row["clients"]: row for row in levels["plain"]}
    lines = ["| clients | setup | requests | throughput tok/s | vs plain (per repeat) | latency p50 | p99 | "
             "TTFT p50 | p99 | per-request tok/s p50 | decode tok/s per request (vs plain) | tau | same text as plain |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for clients in plain:
        for label, rows in levels.items():
            row = next(r for r in rows if r["clients"] == clients)
            base = plain[clients]
            same = sum(a == b for a, b in zip(base["texts"], row["texts"]))
            ratios = [s / b for s, b in zip(row["throughput_by_repeat"], base["throughput_by_repeat"])]
            spread = "" if len(ratios) < 2 else f" ({', '.join(f'{r:.2f}' for r in ratios)})"
            lines.append(
                f"| {clients} | {label} | {row['requests']} | {row['throughput_tok_s']:.2f} | "
                f"{statistics.median(ratios):.2f}x{spread} | {row['latency_p50_s']:.1f} s | "
                f"{row.get('latency_p99_s', row['latency_p90_s']):.1f} s | {row['ttft_p50_s']:.1f} s | "
                f"{row.get('ttft_p99_s', float('nan')):.1f} s | {row['per_request_tok_s_p50']:.2f} | "
                f"{_decode(row, base)} | "
                f"{row['mean_accepted_length']:.2f} | {same}/{min(len(base['texts']), len(row['texts']))} |")
    return "\n".join(lines)


def _decode(row: dict, base: dict) -> str:
    """Each request's tokens after its first over its time after its first, summed over requests: the
    decode speed speculation changes (runs before it was recorded: n/a)."""
    if "decode_tok_s" not in row or "decode_tok_s" not in base:
        return "n/a"
    return f"{row['decode_tok_s']:.2f} ({row['decode_tok_s'] / base['decode_tok_s']:.2f}x)"


def plot(levels: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for index, (setup, rows) in enumerate(levels.items()):
        clients, color = [r["clients"] for r in rows], f"C{index}"
        left.plot(clients, [r["throughput_tok_s"] for r in rows], marker="o", color=color, label=setup)
        right.plot(clients, [r["latency_p50_s"] for r in rows], marker="o", color=color, label=f"{setup} p50")
        right.plot(clients, [r.get("latency_p99_s", r["latency_p90_s"]) for r in rows], marker="x",
                   linestyle="--", color=color, label=f"{setup} p99")
    for axis, label in ((left, "throughput, tokens/s (all clients)"), (right, "request latency, s")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent clients")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle("specdec serve: speculation on vs off, same server, same prompts")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--methods", default="ngram,draft",
                        help="speculative setups, each against plain (default: ngram,draft; any batched method)")
    parser.add_argument("-k", default="auto", help="draft tokens per step, or auto (default: auto, goodput per step)")
    parser.add_argument("--max-k", type=int, default=8, help="the largest k auto may choose (default: 8)")
    parser.add_argument("--clients", default="1,2,4,8,16", help="concurrency levels (default: 1,2,4,8,16)")
    parser.add_argument("--min-requests", type=int, default=8,
                        help="requests per level: max(this, clients); each client sends its share in turn "
                             "(default: 8)")
    parser.add_argument("--max-tokens", type=int, default=64, help="per request (default: 64)")
    parser.add_argument("--max-batch", type=int, default=16, help="the server's rows (default: 16)")
    parser.add_argument("--time-limit", type=float, default=900, help="seconds per level (default: 900)")
    parser.add_argument("--spec-max-batch", default=None,
                        help="also run the first method with this --spec-max-batch (default: no such setup)")
    parser.add_argument("--prefill-chunk", type=int, default=256,
                        help="every server's --prefill-chunk (default: 256, the server's; 0 = whole prompts)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every setup, in rotating order; medians reported (default: 1)")
    parser.add_argument("--out", default="benchmarks/results/serve")
    parser.add_argument("--report-only", action="store_true", help="redraw OUT's table and plot; start nothing")
    args = parser.parse_args()
    if args.report_only:
        saved = json.loads((Path(args.out) / "serve_load.json").read_text())
        print(render(saved["levels"]))
        plot(saved["levels"], Path(args.out) / "serve_load.png")
        return
    levels_clients = [int(c) for c in args.clients.split(",")]
    prompts = mixed_prompts(["humaneval", "mt-bench", "specdec"], per_category=3)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chosen = setups(args)
    runs: dict[str, list[list[dict]]] = {label: [] for label, _ in chosen}  # label -> repeat -> levels
    for repeat in range(args.repeats):
        # Rotate the order each repeat: this machine's speed drifts, and the baseline must not always go first.
        for label, options in chosen[repeat % len(chosen):] + chosen[:repeat % len(chosen)]:
            port = free_port()
            print(f"== repeat {repeat + 1}/{args.repeats}, {label}: starting the server on 127.0.0.1:{port}",
                  file=sys.stderr, flush=True)
            server = start_server(args, options, port)
            try:
                url = f"http://127.0.0.1:{port}"
                asyncio.run(run_level(url, prompts[:1], 1, 8, args.time_limit))  # warm-up
                rows = []
                for clients in levels_clients:
                    count = max(args.min_requests, clients)
                    level_prompts = (prompts * (count // len(prompts) + 1))[:count]
                    row = asyncio.run(run_level(url, level_prompts, clients, args.max_tokens, args.time_limit))
                    print(f"   {clients:>2} clients: {row['throughput_tok_s']:.2f} tok/s, p50 latency "
                          f"{row['latency_p50_s']:.1f} s, tau {row['mean_accepted_length']:.2f}", file=sys.stderr,
                          flush=True)
                    rows.append(row)
                runs[label].append(rows)
                (out / "serve_load_partial.json").write_text(json.dumps(runs, indent=1))  # survives a crash
            finally:
                server.terminate()
                server.wait(60)
    levels = {label: [median_row([repeat[i] for repeat in repeats]) for i in range(len(levels_clients))]
              for label, repeats in runs.items()}
    table = render(levels)
    print(table)
    settings = {key: getattr(args, key) for key in ("target", "draft", "methods", "k", "max_k", "clients",
                                                    "min_requests", "max_tokens", "max_batch", "spec_max_batch",
                                                    "prefill_chunk", "repeats")}
    (out / "serve_load.json").write_text(json.dumps({"settings": settings, "levels": levels, "runs": runs},
                                                    indent=1))
    (out / "serve_load.md").write_text(f"settings: {json.dumps(settings)}\n\n{table}\n")
    plot(levels, out / "serve_load.png")


if __name__ == "__main__":
    main()
