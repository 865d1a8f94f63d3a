"""specdec against llama.cpp and OpenVINO GenAI on the same CPU, same prompts, one interleaved run.

llama.cpp is built once from the source vendored in the llama-cpp-python sdist
on PyPI (benchmarks/llama_cpp_peer.py) and runs the GGUF files the embedded models
ship as (Q4_K_M). OpenVINO GenAI runs in a virtualenv of its own on the embedded
models exported to int4 IR with optimum-intel's defaults (benchmarks/openvino_peer.py;
`--openvino` with no modes leaves it out). Every configuration runs on every prompt, in an order that
rotates from prompt to prompt, so drift in the machine's speed spreads evenly.
Prompts are the bench suites' first turns with the chat template applied (the
same text for both engines). Decode tokens/s excludes prefill; time to first
token (TTFT) includes it: llama.cpp's own perf lines give its numbers, specdec's
RequestStats give ours. A llama.cpp run that crashes is recorded with its exit
status and retried once with --no-repack (its AMX weight repacking crashed
with SIGSEGV on a Sapphire Rapids Xeon).

  python benchmarks/peers.py                                  # greedy, every category, 1 prompt each
  python benchmarks/peers.py --per-category 2 --temperature 0.7
  python benchmarks/peers.py --temperature 0.7 --top-p 0.9 --out benchmarks/results/peers-top-p
  python benchmarks/peers.py --summary-only --out benchmarks/results/peers
  python benchmarks/peers.py --llama plain --openvino plain lookup --specdec "specdec copy=copy:k=auto,quantize=w4a8"

A specdec configuration is LABEL=METHOD[:k=K][,quantize=Q] (LABEL without "="; METHOD from
`specdec generate --help`, K a number or auto (default 4), Q the target's weights (default none)).
Its engine is the one `specdec generate --method METHOD -k K --quantize Q` runs, built by the same
factory (benchmarks/public_engines.py), every other option at its default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import llama_cpp_peer as llama_cpp  # benchmarks/llama_cpp_peer.py (not the llama-cpp-python package)
import openvino_peer  # benchmarks/openvino_peer.py
from public_engines import build_engines as factory_engines  # benchmarks/public_engines.py

from specdec.bench.prompt_sets import load_prompts
from specdec.config import SpecConfig
from specdec.engine import SpecEngine
from specdec.models.cpu_features import cpu_model, effective_isa
from specdec.sampling import SamplingParams

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
DEFAULT_SPECDEC = [
    "specdec plain w8a8=autoregressive,quantize=w8a8",
    "specdec plain w4a8=autoregressive,quantize=w4a8",
    "specdec draft auto w4a8=draft:k=auto,quantize=w4a8",
    "specdec ngram+draft auto w4a8=ngram+draft:k=auto,quantize=w4a8",
    "specdec ngram auto w4a8=ngram:k=auto,quantize=w4a8",
]
LLAMA_MODES = ("plain", "speculative", "lookup")


def parse_config(text: str) -> tuple[str, str, int | str, str]:
    label, _, spec = text.partition("=")
    method, _, options = spec.partition(",")
    method, _, k_text = method.partition(":k=")
    quantize = "none"
    for item in filter(None, options.split(",")):
        key, _, value = item.partition("=")
        if key != "quantize":
            raise ValueError(f"unknown option {key!r} in {text!r}")
        quantize = value
    k = "auto" if k_text == "auto" else int(k_text or 4)
    return label, method, k, quantize


def llama_command(mode: str, bin_dir: Path, prompt_file: Path, args, no_repack: bool) -> list[str]:
    target, draft = llama_cpp.gguf_path(TARGET), llama_cpp.gguf_path(DRAFT)
    tool = {"plain": "llama-completion", "speculative": "llama-speculative", "lookup": "llama-lookup"}[mode]
    command = [str(bin_dir / tool), "-m", str(target), "-f", str(prompt_file), "-n", str(args.max_new_tokens),
               "-t", str(args.threads), "-c", "4096", "--temp", str(args.temperature), "--seed", "1",
               "--poll", "0",  # polling threads starve each other on a 2-core machine (speculative: 0.8 tok/s)
               # The distribution specdec samples: llama.cpp's own top-k 40, top-p 0.95 and min-p 0.05 off.
               "--top-k", "0", "--top-p", str(args.top_p), "--min-p", "0"]
    if mode == "plain":
        command += ["-no-cnv", "--no-display-prompt"]
    if mode == "speculative":
        command += ["-md", str(draft), "-td", str(args.threads), "--spec-draft-n-max", "8"]
    if mode == "lookup":
        command += ["--spec-draft-n-max", "8"]
    if no_repack:
        command.append("--no-repack")
    return command


def run_llama(mode: str, bin_dir: Path, prompt_text: str, args) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as handle:
        handle.write(prompt_text)
    prompt_file = Path(handle.name)
    errors = []
    try:
        for no_repack in (False, True):
            started = time.perf_counter()
            result = subprocess.run(llama_command(mode, bin_dir, prompt_file, args, no_repack),
                                    capture_output=True, text=True, timeout=args.llama_timeout)
            wall = time.perf_counter() - started
            timings = llama_cpp.run_timings(mode, result.stderr)
            if result.returncode == 0 and timings is not None:
                return dict(timings, wall_seconds=wall, no_repack=no_repack, errors=errors)
            errors.append(f"exit {result.returncode}{' (--no-repack)' if no_repack else ''}: "
                          f"{result.stderr.strip().splitlines()[-1][-200:] if result.stderr.strip() else ''}")
    except subprocess.TimeoutExpired:
        errors.append(f"timed out after {args.llama_timeout} s")
    finally:
        prompt_file.unlink()
    return dict(errors=errors)


def run_specdec(engine: SpecEngine, prompt_ids: list[int], args) -> dict:
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=1)
    out = engine.generate(prompt_ids, params, max_new_tokens=args.max_new_tokens)
    stats = out.stats
    return dict(prompt_tokens=stats.prompt_tokens, tokens=stats.generated_tokens,
                decode_tok_s=stats.generated_tokens / stats.decode_time_s, ttft_s=stats.first_token_s,
                prefill_s=stats.prefill_time_s, tau=stats.mean_accepted_length, token_ids=out.token_ids, errors=[])


def spec_config(text: str) -> tuple[str, SpecConfig]:
    """(label, the SpecConfig `specdec generate --method METHOD -k K --quantize Q` builds), the draft
    the llama.cpp and OpenVINO rows draft with (its weights: the default, auto)."""
    label, method, k, quantize = parse_config(text)
    config = SpecConfig(target=TARGET, method=method, k=k, quantize=quantize)
    return label, dataclasses.replace(config, draft=DRAFT) if config.needs_draft_model else config


def build_engines(configs: list[str]) -> dict[str, SpecEngine]:
    """Each configuration's engine as specdec.load builds it (public_engines.py: the factory), each
    target format and the draft loaded once."""
    return factory_engines(dict(spec_config(text) for text in configs))


def summarise(rows: list[dict]) -> str:
    labels = list(dict.fromkeys(r["config"] for r in rows))
    categories = list(dict.fromkeys(r["category"] for r in rows))

    def rate(config: str, category: str | None = None) -> float | None:
        got = [r for r in rows if r["config"] == config and (category is None or r["category"] == category)
               and "decode_tok_s" in r]
        if not got:
            return None
        return sum(r["tokens"] for r in got) / sum(r["tokens"] / r["decode_tok_s"] for r in got)

    def ttft(config: str) -> float | None:
        got = [r["ttft_s"] for r in rows if r["config"] == config and "ttft_s" in r]
        return statistics.median(got) if got else None

    bar = rate("llama.cpp plain")
    lines = [f"{'configuration':<34}{'decode tok/s':>13}{'vs llama.cpp plain':>20}{'TTFT median s':>15}  failures"]
    for label in labels:
        value = rate(label)
        failures = sum(1 for r in rows if r["config"] == label and "decode_tok_s" not in r)
        ratio = f"{value / bar:.2f}x" if value and bar else "-"
        t = ttft(label)
        lines.append(f"{label:<34}{(f'{value:.2f}' if value else '-'):>13}{ratio:>20}"
                     f"{(f'{t:.2f}' if t is not None else '-'):>15}  {failures}")
    lines.append("")
    lines.append("decode tok/s vs llama.cpp plain, per category")
    lines.append(f"{'configuration':<34}" + "".join(f"{c[:11]:>12}" for c in categories))
    for label in labels:
        cells = []
        for category in categories:
            value, base = rate(label, category), rate("llama.cpp plain", category)
            cells.append(f"{value / base:.2f}x" if value and base else "-")
        lines.append(f"{label:<34}" + "".join(f"{c:>12}" for c in cells))
    # Lossless against the same target: each method's output vs plain decoding of that target format.
    plain_ids = {(r["quantize"], r["prompt"]): r["token_ids"] for r in rows
                 if r.get("method") == "autoregressive" and "token_ids" in r}
    if all_greedy(rows) and plain_ids:
        lines.append("")
        for label in labels:
            same = [r for r in rows if r["config"] == label and r.get("method") not in (None, "autoregressive")
                    and "token_ids" in r and (r["quantize"], r["prompt"]) in plain_ids]
            if same:
                equal = sum(1 for r in same if r["token_ids"] == plain_ids[r["quantize"], r["prompt"]])
                lines.append(f"{label}: {equal}/{len(same)} outputs identical to plain decoding of its target")
    # OpenVINO's speculative modes against its own plain decoding (the same int4 IR).
    openvino_plain = {r["prompt"]: r["token_ids"] for r in rows if r["config"] == "openvino plain" and "token_ids" in r}
    if all_greedy(rows) and openvino_plain:
        for label in (label for label in labels if label.startswith("openvino ") and label != "openvino plain"):
            same = [r for r in rows if r["config"] == label and "token_ids" in r and r["prompt"] in openvino_plain]
            equal = sum(1 for r in same if r["token_ids"] == openvino_plain[r["prompt"]])
            lines.append(f"{label}: {equal}/{len(same)} outputs identical to OpenVINO's plain decoding")
    return "\n".join(lines)


def all_greedy(rows: list[dict]) -> bool:
    return all(r.get("temperature", 0) == 0 for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="specdec,humaneval,mt-bench", help="prompt sets (default: %(default)s)")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus sampling in both engines, with --temperature > 0 (default 1.0: off); "
                             "llama.cpp's own top-k/top-p/min-p defaults are off either way, so both engines "
                             "sample the same distribution")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--specdec", nargs="+", default=DEFAULT_SPECDEC, metavar="LABEL=METHOD...")
    parser.add_argument("--llama", nargs="*", default=list(LLAMA_MODES), choices=LLAMA_MODES)
    parser.add_argument("--llama-timeout", type=float, default=600)
    parser.add_argument("--llama-bin", type=Path,
                        help="a llama.cpp build's bin folder (default: llama_cpp_peer.py's build: GGML_NATIVE=ON, or "
                             "on a CPU with AMX, whose AMX repacking crashed, AVX-512 without AMX)")
    parser.add_argument("--openvino", nargs="*", default=list(openvino_peer.MODES), choices=openvino_peer.MODES,
                        help="OpenVINO GenAI's modes (default: all; none: left out): plain, speculative (the 0.5B "
                             "draft), lookup (its prompt lookup)")
    parser.add_argument("--openvino-k", type=int, default=5,
                        help="OpenVINO's num_assistant_tokens for speculative and lookup (default: 5, as its own "
                             "samples use)")
    parser.add_argument("--out", default="benchmarks/results/peers")
    parser.add_argument("--summary-only", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    run_name = f"T{args.temperature:g}" + (f"-p{args.top_p:g}" if args.top_p < 1 else "")
    rows_path = out / f"rows-{run_name}.jsonl"
    if args.summary_only:
        print(summarise([json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]))
        return
    out.mkdir(parents=True, exist_ok=True)
    bin_dir = (args.llama_bin or llama_cpp.build()) if args.llama else None
    if args.openvino:
        openvino_peer.setup((TARGET, DRAFT) if "speculative" in args.openvino else (TARGET,))
    openvino = {mode: openvino_peer.Worker(mode, TARGET, DRAFT, args.threads, args.openvino_k)
                for mode in args.openvino}
    engines = build_engines(args.specdec)
    tokenizer = next(iter(engines.values())).tokenizer
    prompts = load_prompts(args.prompts.split(","), args.per_category)
    configs = ([f"llama.cpp {mode}" for mode in args.llama] + [f"openvino {mode}" for mode in args.openvino]
               + list(engines))
    print(f"{len(prompts)} prompts x {len(configs)} configurations on {cpu_model()} ({effective_isa()}), "
          f"{args.threads} threads, T={args.temperature:g}, {args.max_new_tokens} new tokens", flush=True)
    done = set()
    if rows_path.exists():
        done = {(r["prompt"], r["config"]) for r in map(json.loads, rows_path.read_text().splitlines())}
    for index, prompt in enumerate(prompts):
        messages = [{"role": "user", "content": prompt.turns[0]}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        shift = index % len(configs)
        for config in configs[shift:] + configs[:shift]:
            if (prompt.question_id, config) in done:
                continue
            if config.startswith("llama.cpp"):
                row = run_llama(config.split()[1], bin_dir, text, args)
            elif config.startswith("openvino"):
                row = openvino[config.split()[1]].generate(text, args.max_new_tokens, args.temperature, args.top_p)
            else:
                row = run_specdec(engines[config], ids, args)
                _, method, _, quantize = parse_config(next(c for c in args.specdec if c.startswith(config + "=")))
                row.update(method=method, quantize=quantize)
            row.update(config=config, prompt=prompt.question_id, category=prompt.category,
                       temperature=args.temperature, top_p=args.top_p, cpu=cpu_model(), isa=effective_isa())
            with open(rows_path, "a") as sink:
                sink.write(json.dumps(row) + "\n")
            shown = f"{row['decode_tok_s']:.2f} tok/s" if "decode_tok_s" in row else f"FAILED {row['errors']}"
            print(f"[{index + 1}/{len(prompts)}] {prompt.question_id:<28} {config:<34} {shown}", flush=True)
    for worker in openvino.values():
        worker.close()
    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    summary = summarise(rows)
    (out / f"summary-{run_name}.txt").write_text(summary + "\n")
    print(summary)


if __name__ == "__main__":
    main()
