"""Load test of `specdec serve`: throughput and latency at 1, 4 and 16 concurrent clients,
speculation on against the same server with speculation off, in one run.

For each server setup (plain decoding; the speculative method drafting at
any batch size; the same with --spec-max-batch, default auto) this starts
`specdec serve` on a free localhost port (nothing else is contacted), warms it
up, and for each concurrency level C runs C clients that each send their share
of the requests one after another (streaming chat completions, greedy, the
same prompts in the same order for every setup). It records per request: time
to first token, end-to-end latency, completion tokens; per level: wall time
and throughput (completion tokens over all clients / wall time). Bounded:
max(--min-requests, clients) requests per level and a --time-limit per level
(requests not started by then are skipped and counted).

Greedy decoding is lossless, so both setups generate the same tokens: the
comparison is pure speed. Writes OUT/serve_load.json, OUT/serve_load.md and
OUT/serve_load.png.

  python benchmarks/serve_load.py                       # embedded pair, draft k=2 vs plain, 1/4/16 clients
  python benchmarks/serve_load.py --spec-max-batch 4    # third setup: draft only while <= 4 requests run
  python benchmarks/serve_load.py --method ngram -k 8 --clients 1,4 --min-requests 8 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
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
    spec = ["--method", args.method, "-k", str(args.k)] + (["--draft", args.draft] if args.method == "draft" else [])
    return [("plain", ["--method", "autoregressive"]),
            (f"{args.method} k={args.k}, always", spec + ["--spec-max-batch", str(args.max_batch)]),
            (f"{args.method} k={args.k}, spec-max-batch {args.spec_max_batch}",
             spec + ["--spec-max-batch", args.spec_max_batch])]


def start_server(args, options: list[str], port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "specdec.cli", "serve", "--target", args.target, "--port", str(port),
               *options, "--max-batch", str(args.max_batch), "--max-queue", "64", "--served-model-name", "bench",
               "--log-level", "warning"]
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
        "latency_p50_s": statistics.median(r["latency_s"] for r in rows),
        "latency_p90_s": sorted(r["latency_s"] for r in rows)[max(0, round(0.9 * len(rows)) - 1)],
        "per_request_tok_s_p50": statistics.median(r["tokens"] / r["latency_s"] for r in rows),
        "mean_accepted_length": statistics.fmean(r["mean_accepted_length"] for r in rows),
        "texts": [r["text"] for r in rows],
    }


def median_row(rows: list[dict]) -> dict:
    """Medians over repeats of every timing; counts and texts from the first repeat."""
    merged = dict(rows[0])
    for key in ("wall_s", "throughput_tok_s", "ttft_p50_s", "latency_p50_s", "latency_p90_s",
                "per_request_tok_s_p50", "mean_accepted_length"):
        merged[key] = statistics.median(row[key] for row in rows)
    merged["throughput_by_repeat"] = [row["throughput_tok_s"] for row in rows]
    return merged


def render(levels: dict[str, list[dict]]) -> str:
    """One row per (clients, setup); ratios against plain decoding at the same concurrency."""
    plain = {row["clients"]: row for row in levels["plain"]}
    lines = ["| clients | setup | requests | throughput tok/s | vs plain (per repeat) | latency p50 | p90 | "
             "TTFT p50 | per-request tok/s p50 | tau | same text as plain |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
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
                f"{row['latency_p90_s']:.1f} s | {row['ttft_p50_s']:.1f} s | {row['per_request_tok_s_p50']:.2f} | "
                f"{row['mean_accepted_length']:.2f} | {same}/{min(len(base['texts']), len(row['texts']))} |")
    return "\n".join(lines)


def plot(levels: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for index, (setup, rows) in enumerate(levels.items()):
        clients, color = [r["clients"] for r in rows], f"C{index}"
        left.plot(clients, [r["throughput_tok_s"] for r in rows], marker="o", color=color, label=setup)
        right.plot(clients, [r["latency_p50_s"] for r in rows], marker="o", color=color, label=f"{setup} p50")
        right.plot(clients, [r["latency_p90_s"] for r in rows], marker="x", linestyle="--", color=color,
                   label=f"{setup} p90")
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
    parser.add_argument("--method", default="draft", choices=["draft", "ngram"])
    parser.add_argument("-k", type=int, default=2, help="default: 2 (the best k of the bench run on CPU)")
    parser.add_argument("--clients", default="1,4,16", help="concurrency levels (default: 1,4,16)")
    parser.add_argument("--min-requests", type=int, default=4,
                        help="requests per level: max(this, clients); each client sends its share in turn "
                             "(default: 4)")
    parser.add_argument("--max-tokens", type=int, default=64, help="per request (default: 64)")
    parser.add_argument("--max-batch", type=int, default=16, help="the server's rows (default: 16)")
    parser.add_argument("--time-limit", type=float, default=900, help="seconds per level (default: 900)")
    parser.add_argument("--spec-max-batch", default="auto",
                        help="the third setup's --spec-max-batch (default: auto, the server's default)")
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
    prompts = [p.turns[0] for p in load_prompts(["humaneval", "mt-bench", "specdec"], per_category=3)]

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
    settings = {key: getattr(args, key) for key in ("target", "draft", "method", "k", "min_requests", "max_tokens",
                                                    "max_batch", "spec_max_batch", "repeats")}
    (out / "serve_load.json").write_text(json.dumps({"settings": settings, "levels": levels, "runs": runs},
                                                    indent=1))
    (out / "serve_load.md").write_text(f"settings: {json.dumps(settings)}\n\n{table}\n")
    plot(levels, out / "serve_load.png")


if __name__ == "__main__":
    main()
