"""Hostile requests beside a stream: does one client's abuse slow another's tokens?

A real `specdec serve` (a subprocess, its default limits, optionally an API key) streams a long
greedy completion to one client while a second client keeps sending what the server must refuse:
a 10 MB body (413), 16 stop strings of 10,000 characters (400), and a prompt of ~900,000
characters (tokenized off the event loop, then refused: longer than the context). Each round
streams once alone and once under that load; reported: the stream's inter-token latency p50 in
both (their ratio: the goal is within 1.2x), and each hostile request's answer time (the goal is
under 100 ms) with its status. Medians over rounds; writes OUT/hostile_load.json and .md.

  python benchmarks/hostile_load.py                       # the embedded target, ngram -k auto
  python benchmarks/hostile_load.py --api-key k --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import httpx

from serve_load import free_port, start_server
from specdec.models.cpu_features import cpu_model, effective_isa

# Bodies encoded once: the client shares the machine's cores with the server, and should spend them on sending.
HOSTILE = {
    "10 MB body": b"x" * (10 * 1024 * 1024),
    "16 stop strings of 10,000 chars": json.dumps({"model": "bench", "prompt": "hi", "max_tokens": 4,
                                                   "stop": ["s" * 10_000] * 16}).encode(),
    "900,000-character prompt": json.dumps({"model": "bench", "prompt": "word " * 180_000, "max_tokens": 4}).encode(),
}


def stream_gaps(url: str, headers: dict, max_tokens: int) -> list[float]:
    """Seconds between the stream's chunks that carry text (after the first)."""
    body = {"model": "bench", "prompt": "def quicksort(items):", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    arrivals = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


def hostile_loop(url: str, headers: dict, stop: threading.Event, record: dict[str, list], names: list[str]) -> None:
    with httpx.Client(timeout=60, headers=headers) as http:
        while not stop.is_set():
            for name in names:
                started = time.perf_counter()
                answer = http.post(f"{url}/v1/completions", content=HOSTILE[name],
                                   headers={"Content-Type": "application/json"})
                record[name].append((time.perf_counter() - started, answer.status_code))
                time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--method", default="ngram")
    parser.add_argument("-k", default="auto")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--hostile", default="all", help="which hostile requests, by number from 1, comma-separated "
                                                         f"(default: all): {', '.join(HOSTILE)}")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/hostile-load"))
    args = parser.parse_args()
    args.max_batch, args.prefill_chunk = 4, 256
    names = list(HOSTILE) if args.hostile == "all" else [list(HOSTILE)[int(n) - 1] for n in args.hostile.split(",")]
    options = ["--method", args.method, "-k", args.k] + (["--api-key", args.api_key] if args.api_key else [])
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    port = free_port()
    server = start_server(args, options, port)
    url = f"http://127.0.0.1:{port}"
    rounds, record = [], {name: [] for name in HOSTILE}
    try:
        stream_gaps(url, headers, 16)  # warm-up
        for number in range(args.rounds):
            alone = statistics.median(stream_gaps(url, headers, args.max_tokens))
            stop = threading.Event()
            attacker = threading.Thread(target=hostile_loop, args=(url, headers, stop, record, names), daemon=True)
            attacker.start()
            loaded = statistics.median(stream_gaps(url, headers, args.max_tokens))
            stop.set()
            attacker.join()
            rounds.append({"alone_p50_ms": alone * 1e3, "loaded_p50_ms": loaded * 1e3, "ratio": loaded / alone})
            print(f"round {number + 1}: inter-token p50 {alone * 1e3:.1f} ms alone, {loaded * 1e3:.1f} ms beside "
                  f"the hostile client ({loaded / alone:.2f}x)", flush=True)
    finally:
        server.terminate()
        server.wait()
    hostile = {name: {"requests": len(times), "statuses": sorted({status for _, status in times}),
                      "p50_ms": statistics.median(t for t, _ in times) * 1e3, "max_ms": max(t for t, _ in times) * 1e3}
               for name, times in record.items() if times}
    summary = {"machine": f"{cpu_model()} ({effective_isa()})", "method": f"{args.method} -k {args.k}",
               "api_key": bool(args.api_key), "rounds": rounds,
               "ratio_median": statistics.median(r["ratio"] for r in rounds), "hostile": hostile}
    lines = [f"# Hostile requests beside a stream ({summary['machine']}, {summary['method']}, "
             f"{'with' if args.api_key else 'without'} an API key)", "",
             f"Inter-token latency p50 of a {args.max_tokens}-token greedy stream, alone and beside the hostile "
             f"client (median over {args.rounds} rounds): {statistics.median(r['alone_p50_ms'] for r in rounds):.1f} "
             f"ms and {statistics.median(r['loaded_p50_ms'] for r in rounds):.1f} ms, "
             f"{summary['ratio_median']:.2f}x.", "",
             "| hostile request | answers | status | p50 ms | max ms |", "|---|---|---|---|---|"]
    for name, r in hostile.items():
        lines.append(f"| {name} | {r['requests']} | {', '.join(map(str, r['statuses']))} | {r['p50_ms']:.0f} | "
                     f"{r['max_ms']:.0f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "hostile_load_key" if args.api_key else "hostile_load"
    (args.out / f"{stem}.json").write_text(json.dumps(summary, indent=1))
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
