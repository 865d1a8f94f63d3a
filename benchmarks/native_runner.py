"""specdec's native runner vs transformers on the embedded pair: one process, one run.

For each prompt of the code suite (chat template, greedy, 128 new tokens) and
for each configuration:
  transformers plain      model.generate(), fp32, stock nn.Linear
  transformers assisted   model.generate(assistant_model=draft), transformers' defaults
  specdec plain (hf)      specdec's engine on the transformers backend (fp32, oneDNN-packed linears)
  specdec plain (native)  the native decoder, one row per --native weight format
  specdec draft (native)  speculative decoding with the native draft, for each k in --k
(three phases, one after another, because all these models at once do not
fit in 24 GiB; within a phase configurations alternate prompt by prompt). It prints tokens/s (summed tokens / summed seconds) and each ratio, the
memory-bandwidth bound of one native target forward (weight bytes read per
token / measured copy bandwidth), how close plain native decoding comes to
it, and the per-step overhead outside model forwards. Every speculative
output must equal plain decoding of the same runner, token for token.

  python benchmarks/native_runner.py                      # the full run (about 30 minutes on 2 cores)
  python benchmarks/native_runner.py --prompts 2 --k 4    # a quick look
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
from pathlib import Path

from public_engines import SharedModels  # benchmarks/public_engines.py

from specdec.bench.hf_baseline import hf_generate
from specdec.bench.suites import suite
from specdec.bench.timing import TimedRunner, copy_bandwidth_gbs, weight_bytes_per_token
from specdec.config import SpecConfig
from specdec.engine import SpecEngine
from specdec.factory import engine_for, plain_engine
from specdec.models.loader import load_model, same_vocabulary
from specdec.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--suite", default="code")
    parser.add_argument("--prompts", type=int, default=10, help="first N prompts of the suite (default: 10)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--native", nargs="+", default=["none/int4", "none/int4/32768", "int8/int4"],
                        metavar="TARGET/DRAFT[/VOCAB]",
                        help="native weight formats (none, int8, int4; bf16 activations) of target and draft, and "
                             "optionally the draft head's vocabulary size (default: none/int4 none/int4/32768 int8/int4)")
    parser.add_argument("--k", type=int, nargs="+", default=[3, 4, 5, 6], help="draft lengths to try (default: 3 4 5 6)")
    parser.add_argument("--skip-transformers", action="store_true", help="leave out transformers' own generate()")
    parser.add_argument("--native-only", action="store_true",
                        help="only the native configurations (e.g. to sweep --native formats and draft vocabularies)")
    parser.add_argument("--json", default="benchmarks/results/native_runner.json")
    args = parser.parse_args()
    prompts = suite(args.suite)[: args.prompts]
    params = SamplingParams(temperature=0.0)

    rows: dict[str, list[dict]] = {}
    bytes_per_token: dict[str, int] = {}
    prompt_ids: dict[str, list[int]] = {}
    # Phases bound the memory (all models at once do not fit in 24 GiB); within a
    # phase the configurations are interleaved prompt by prompt.
    phases = [] if args.native_only else ([] if args.skip_transformers else [transformers_phase]) + [hf_backend_phase]
    for phase in [*phases, native_phase]:
        configs, engines = phase(args, bytes_per_token)
        if not prompt_ids:
            encoder = next(iter(engines.values()))
            prompt_ids.update({p: encoder.encode(p, chat=True) for _, p in prompts})
        run_phase(configs, engines, prompts, prompt_ids, params, args.max_new_tokens, rows)
        del configs, engines
        gc.collect()
    bandwidth = copy_bandwidth_gbs()
    report = summarise(rows, bandwidth, bytes_per_token)
    print(report)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(dict(args=vars(args), bandwidth_gbs=bandwidth,
                                               bytes_per_token=bytes_per_token, rows=rows, report=report), indent=1))


def transformers_phase(args, bytes_per_token):
    """transformers' own generate(), plain and assisted (its defaults), stock fp32 nn.Linear: the peer,
    loaded as transformers runs it (no specdec engine decodes here; the encoder only tokenizes)."""
    target = load_model(args.target, backend="hf", cpu_linear="torch")
    draft = load_model(args.draft, backend="hf", cpu_linear="torch")
    if not same_vocabulary(target.tokenizer, draft.tokenizer):  # assisted generation here assumes one tokenizer
        raise ValueError(f"{args.draft} does not share {args.target}'s tokenizer")
    configs = {
        "transformers plain": lambda ids: hf_generate(target.runner.model, ids, args.max_new_tokens),
        "transformers assisted": lambda ids: hf_generate(target.runner.model, ids, args.max_new_tokens,
                                                         assistant=draft.runner.model),
    }
    return configs, {"encoder": plain_engine(target)}


def hf_backend_phase(args, bytes_per_token):
    """specdec's engine on the transformers backend (fp32, oneDNN-packed linears)."""
    target = SharedModels().target(SpecConfig(target=args.target, backend="hf"))
    return {}, {"specdec plain (hf)": plain_engine(target)}


def native_phase(args, bytes_per_token):
    """Every --native TARGET/DRAFT[/VOCAB] format: plain decoding and speculative decoding at each k, the
    engines `specdec generate --backend native --quantize TARGET --draft-quantize DRAFT --draft-vocab VOCAB
    --method draft -k K` runs (the factory's), their models' forwards timed (bench/timing.py)."""
    engines = {}
    models, timed = SharedModels(), {}  # each format loaded once, shared by configurations; its timed runner
    for spec in args.native:
        target_format, draft_format, *vocab = spec.split("/")
        config = SpecConfig(target=args.target, draft=args.draft, method="draft", backend="native",
                            quantize=target_format, draft_quantize=draft_format,
                            draft_vocab=int(vocab[0]) if vocab else None)
        target, draft = models.target(config), models.draft(config)
        label = target.describe().split("[")[1].rstrip("]")
        if id(target) not in timed:
            timed[id(target)] = dataclasses.replace(target, runner=TimedRunner(target.runner))
            bytes_per_token[label] = weight_bytes_per_token(target.runner.decoder)
            engines[f"specdec plain ({label})"] = plain_engine(timed[id(target)])
        draft_label = draft.describe().split("[")[1].rstrip("]").replace("native, bfloat16", "").strip(", ") or "bf16"
        for k in args.k:
            engines[f"specdec draft k={k} [{draft_label} draft] ({label})"] = engine_for(
                config.with_method("draft", k=k), timed[id(target)],
                dataclasses.replace(draft, runner=TimedRunner(draft.runner)))
    return {}, engines


def run_phase(configs, engines, prompts, prompt_ids, params, max_new_tokens, rows) -> None:
    """configs: name -> callable(prompt ids) -> (tokens, seconds, stats); engines run through the engine."""
    runs = dict(configs)
    for name, engine in engines.items():
        if name != "encoder":
            runs[name] = lambda ids, engine=engine: _run_engine(engine, ids, params, max_new_tokens)
    for run in runs.values():  # warm-up: allocations, kernel selection
        run(prompt_ids[prompts[0][1]])
    for index, (_, prompt) in enumerate(prompts, 1):
        print(f"[{index}/{len(prompts)}] {prompt[:70]!r}", flush=True)
        for name, run in runs.items():
            timers = _timers(engines.get(name))
            for runner in timers:
                runner.forward_s, runner.forwards = 0.0, 0
            tokens, seconds, stats = run(prompt_ids[prompt])
            forward_s = sum(runner.forward_s for runner in timers) if timers else None
            rows.setdefault(name, []).append(dict(
                prompt=prompt, tokens=tokens, seconds=seconds, forward_s=forward_s,
                tau=stats.mean_accepted_length if stats else None, decode_s=stats.decode_time_s if stats else None))
            print(f"  {name:<58}{len(tokens):>4} tok {len(tokens) / seconds:7.2f} tok/s", flush=True)


def _timers(engine: SpecEngine | None) -> list[TimedRunner]:
    """The forward timers inside a configuration: its target's and its draft's."""
    if engine is None:
        return []
    runners = [engine.target, getattr(engine.proposer, "runner", None)]
    return [runner for runner in runners if isinstance(runner, TimedRunner)]


def _run_engine(engine: SpecEngine, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int):
    result = engine.generate(prompt_ids, params, max_new_tokens=max_new_tokens)
    return result.token_ids, result.stats.total_time_s, result.stats


def _rate(rows: list[dict]) -> float:
    return sum(len(r["tokens"]) for r in rows) / sum(r["seconds"] for r in rows)


def summarise(rows: dict[str, list[dict]], bandwidth: float, bytes_per_token: dict[str, int]) -> str:
    base_name = next((name for name in ("transformers plain", "specdec plain (hf)") if name in rows), next(iter(rows)))
    base = _rate(rows[base_name])
    base_header = f"vs {base_name}"
    width = max(24, len(base_header) + 2)
    lines = ["", f"{'configuration':<58}{'tok/s':>7}{base_header:>{width}}{'vs own plain':>14}{'tau':>6}  identical"]
    for name, got in rows.items():
        label = name.split("(")[-1].rstrip(")")
        own_plain = f"specdec plain ({label})" if name.startswith("specdec") else base_name
        plain_rows = {r["prompt"]: r for r in rows.get(own_plain, [])}
        same = sum(r["tokens"] == plain_rows[r["prompt"]]["tokens"] for r in got if r["prompt"] in plain_rows)
        tau = f"{statistics.mean(r['tau'] for r in got):6.2f}" if got[0]["tau"] else f"{'-':>6}"
        lines.append(f"{name:<58}{_rate(got):>7.2f}{_rate(got) / base:>{width - 1}.2f}x"
                     f"{_rate(got) / _rate(rows[own_plain]):>13.2f}x{tau}  {same}/{len(got)}")
    lines.append(f"\nmeasured copy bandwidth: {bandwidth:.1f} GB/s (read + write)")
    for label, size in bytes_per_token.items():
        bound = bandwidth * 1e9 / size
        plain = rows[f"specdec plain ({label})"]
        decode_rate = sum(len(r["tokens"]) - 1 for r in plain) / sum(r["decode_s"] for r in plain)
        lines.append(f"{label}: {size / 1e9:.2f} GB of weights per token -> bound {bound:.1f} tok/s; "
                     f"plain decode steps reach {decode_rate:.2f} tok/s = {decode_rate / bound:.0%} of it")
    lines.append("time outside model forwards (engine, proposer, verification; % of request time):")
    for name, got in rows.items():
        if got[0]["forward_s"] is not None:
            overhead = 1 - sum(r["forward_s"] for r in got) / sum(r["seconds"] for r in got)
            lines.append(f"  {name:<58}{overhead:>6.1%}")
    lines.append("tok/s = summed tokens / summed seconds (prefill included); identical = same tokens as the "
                 "configuration's own plain decoding")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
