"""Servers side by side, measured as a user would: `specdec bench --endpoint` and `specdec verify --endpoint`.

Starts the servers of one group on localhost (specdec serve, llama.cpp's llama-server,
vLLM's CPU build), runs one interleaved `specdec bench --endpoint ...` over all of them
(the first, specdec's plain server, is every group's reference, so ratios from different
groups share a denominator), then `specdec verify --endpoint SPEC --reference PLAIN` for
each speculative/plain pair of one engine. Groups exist because the machines here have
24 GiB: three fp32 vLLM servers of the 1.5B target do not fit at once.

  python benchmarks/endpoint_peers.py --group local       # specdec plain/draft/auto + llama-server plain/draft
  python benchmarks/endpoint_peers.py --group vllm-ngram  # specdec plain + vLLM plain/ngram
  python benchmarks/endpoint_peers.py --group vllm-draft  # specdec plain + vLLM plain/draft_model

Every server uses the embedded Qwen2.5-Coder pair: specdec and vLLM read specdec's converted
safetensors (vLLM in bf16 by default, $VLLM_DTYPE: two fp32 vLLM servers of the 1.5B target,
~10 GB resident each, made a 24 GB machine swap-thrash), llama.cpp the GGUF files they ship as.
Needs `make models`, `make vllm` (vLLM groups) and llama-server (benchmarks/llama_cpp_peer.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import llama_cpp_peer as llama_cpp  # benchmarks/llama_cpp_peer.py

from specdec.bench.vllm_peer import free_port, vllm_python, vllm_server, wait_until_healthy
from specdec.models import hub
from specdec.models.cpu_features import cpu_model, effective_isa

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def process_server(command: list[str], url: str, log: Path, timeout_s: float = 600):
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        wait_until_healthy(url, process, log, timeout_s, poll_s=1.0)
        yield url
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def specdec_server(label: str, options: list[str], logs: Path):
    port = free_port()
    command = [sys.executable, "-m", "specdec.cli", "serve", "--port", str(port), "--max-batch", "2",
               "--served-model-name", TARGET, "--log-level", "warning", *options]
    return process_server(command, f"http://127.0.0.1:{port}", logs / f"{label}.log")


def llama_server(label: str, draft: bool, logs: Path):
    binary = llama_cpp.build(tools=("llama-server",)) / "llama-server"
    port = free_port()
    command = [str(binary), "-m", str(llama_cpp.gguf_path(TARGET)), "--host", "127.0.0.1", "--port", str(port),
               "-c", "4096", "-t", str(os.cpu_count()), "--alias", TARGET, "--jinja", "-np", "1"]
    if draft:  # llama.cpp's speculative decoding with the 0.5B draft (its defaults for draft length)
        command += ["-md", str(llama_cpp.gguf_path(DRAFT))]
    return process_server(command, f"http://127.0.0.1:{port}", logs / f"{label}.log")


VLLM_DTYPE = os.environ.get("VLLM_DTYPE", "bfloat16")  # two fp32 servers of the 1.5B target (~10 GB each) thrash 24 GB


def vllm(label: str, speculative: dict | None, logs: Path):
    return vllm_server(hub.fetch(TARGET), python=vllm_python(ROOT), log_path=logs / f"{label}.log",
                       speculative_config=json.dumps(speculative) if speculative else None, kv_cache_gib=1,
                       dtype=VLLM_DTYPE)


GROUPS = {
    "local": [
        ("specdec-plain", lambda logs: specdec_server("specdec-plain", ["--method", "autoregressive"], logs)),
        # --spec-max-batch 8: verify draws 4 requests at a time, and the CPU default (1) would then not draft
        ("specdec-draft-k4", lambda logs: specdec_server("specdec-draft-k4", ["--method", "draft", "-k", "4",
                                                                              "--spec-max-batch", "8"], logs)),
        ("specdec-auto", lambda logs: specdec_server("specdec-auto", ["--spec-max-batch", "8"], logs)),  # ngram
        ("llama-plain", lambda logs: llama_server("llama-plain", False, logs)),
        ("llama-draft", lambda logs: llama_server("llama-draft", True, logs)),
    ],
    "vllm-ngram": [
        ("specdec-plain", lambda logs: specdec_server("specdec-plain", ["--method", "autoregressive"], logs)),
        ("vllm-plain", lambda logs: vllm("vllm-plain", None, logs)),
        ("vllm-ngram", lambda logs: vllm("vllm-ngram", {"method": "ngram", "num_speculative_tokens": 4,
                                                        "prompt_lookup_max": 3, "prompt_lookup_min": 1}, logs)),
    ],
    "vllm-draft": [
        ("specdec-plain", lambda logs: specdec_server("specdec-plain", ["--method", "autoregressive"], logs)),
        ("vllm-plain", lambda logs: vllm("vllm-plain", None, logs)),
        ("vllm-draft", lambda logs: vllm("vllm-draft", {"method": "draft_model", "model": str(hub.fetch(DRAFT)),
                                                        "num_speculative_tokens": 4}, logs)),
    ],
}
PAIRS = {"local": [("specdec-draft-k4", "specdec-plain"), ("specdec-auto", "specdec-plain"),
                   ("llama-draft", "llama-plain")],
         "vllm-ngram": [("vllm-ngram", "vllm-plain")], "vllm-draft": [("vllm-draft", "vllm-plain")]}


def specdec_command(*argv: str, log: Path) -> int:
    """A specdec command, its output shown and kept in log."""
    print("$ specdec " + " ".join(argv), flush=True)
    with open(log, "w") as handle:
        process = subprocess.run([sys.executable, "-m", "specdec.cli", *argv], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
        handle.write(process.stdout)
    print(process.stdout[-4000:], flush=True)
    return process.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group", choices=list(GROUPS), required=True)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/endpoints/GROUP")
    parser.add_argument("--prompts", default="humaneval,specdec")
    parser.add_argument("--per-category", default="1")
    parser.add_argument("--max-new-tokens", default="64")
    parser.add_argument("--temperature", default="0")
    parser.add_argument("--samples", default="200", help="verify: draws per side and prompt")
    parser.add_argument("--no-verify", action="store_true")
    parser.add_argument("--no-bench", action="store_true",
                        help="verify only: start only the servers of the pairs verified, bench nothing")
    parser.add_argument("--verify-seed", default="0", help="verify: its --seed (another draw of seeds)")
    parser.add_argument("--verify-only", default=None, metavar="LABEL,...",
                        help="verify only these speculative servers against their plain one (default: every pair)")
    args = parser.parse_args()
    out = Path(args.out or ROOT / "benchmarks" / "results" / "endpoints" / args.group)
    logs = out / "logs"
    out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {cpu_model()} ({effective_isa()}), {os.cpu_count()} cores", flush=True)
    chosen = args.verify_only.split(",") if args.verify_only else [spec for spec, _ in PAIRS[args.group]]
    pairs = [pair for pair in PAIRS[args.group] if pair[0] in chosen]
    needed = {label for pair in pairs for label in pair}
    with ExitStack() as servers:
        urls = {}
        for label, start in GROUPS[args.group]:
            if args.no_bench and label not in needed:
                continue
            started = time.perf_counter()
            urls[label] = servers.enter_context(start(logs))
            print(f"{label}: {urls[label]} (up in {time.perf_counter() - started:.0f} s)", flush=True)
        status = None
        if not args.no_bench:
            status = specdec_command("bench", *(f"--endpoint={label}={url}" for label, url in urls.items()),
                                     "--prompts", args.prompts, "--per-category", args.per_category,
                                     "--max-new-tokens", args.max_new_tokens, "--temperature", args.temperature,
                                     "--out", str(out / "bench"), "--quiet", log=out / "bench.log")
        verdicts = {}
        if not args.no_verify:
            suffix = "" if args.verify_seed == "0" else f"-seed{args.verify_seed}"
            for spec, plain in pairs:
                verdicts[f"{spec} vs {plain}{suffix.replace('-', ', ')}"] = specdec_command(
                    "verify", "--endpoint", f"{spec}={urls[spec]}", "--reference", f"{plain}={urls[plain]}",
                    "--samples", args.samples, "--greedy-prompts", "4", "--max-new-tokens", "32",
                    "--seed", args.verify_seed, log=out / f"verify-{spec}{suffix}.log")
    summary = out / "summary.json"
    earlier = json.loads(summary.read_text()).get("verify_status", {}) if summary.exists() else {}
    earlier_bench = json.loads(summary.read_text()).get("bench_status") if summary.exists() else None
    summary.write_text(json.dumps(dict(machine=f"{cpu_model()} ({effective_isa()})",
                                       bench_status=earlier_bench if status is None else status,
                                       verify_status={**earlier, **verdicts}), indent=1))
    return status or max(verdicts.values(), default=0)


if __name__ == "__main__":
    sys.exit(main())
