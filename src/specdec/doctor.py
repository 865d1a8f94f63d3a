"""`specdec doctor`: is bit-exact greedy equality guaranteed on this machine, with this model?

Reports the CPU/GPU features, checks an embedded model's converted files
against the sha256 their fetch recorded (loads check only their sizes), reports
the oneDNN path in force and the kernels the model runs on, then runs the
invariance probe (models/native/invariance.py) at the model's real shapes:
projections fed 1..64 rows, every chunking of a 9-token window at several
context lengths, ragged rows decoded together, and a draft tree verified in
one forward. Then, for a real model, what a forward of
1..33 tokens costs here next to its two floors (weights / bandwidth, multiply-adds /
peak), measured on this machine (analysis/roofline.py).
Exit status 0 when every probe is bit-identical, 1 when not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from specdec.cli_options import positive_int
from specdec.models.native.linear import QUANTIZATIONS

EPILOG = """examples:
  specdec doctor                          the embedded target, as generate/demo load it
  specdec doctor --target ./my-model      your own Hugging Face directory (Qwen2/Llama run natively)
  specdec doctor --synthetic              one full-size layer with random weights (no model files)
  ONEDNN_MAX_CPU_ISA=AVX2 specdec doctor  the path an AVX2-only CPU takes
  specdec doctor --no-costs               the exactness probe only (skips the ~30 s cost table)
  specdec doctor --costs costs.json       and the cost table `specdec replay --costs` reads, as
                                          `specdec costs --out costs.json` writes it

"Guaranteed" means: on this machine, at this thread count, every probe gave
bit-identical logits, so a position decodes the same whether it is alone,
among k+1 drafts, in a tree or beside other requests. The same probe's cheap
part runs whenever a target loads; if it fails, specdec verifies one token per
call (exact, no speedup) and says so on stderr.

The cost table shows whether speculation can pay here: "x step" is a forward of
n tokens against one token (verifying k drafts costs the k+1 row), "x floor" how
far that forward is from the larger of its two floors. `-k auto` and
`--tree-size auto` measure the same costs while they run.
"""
COST_CONTEXT = 512  # cached tokens before the cost table's forwards, unless --cost-context


def add_doctor_command(sub) -> None:
    doctor = sub.add_parser("doctor", help="check that speculative output is bit-identical to plain output here",
                            epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    doctor.add_argument("--target", default="qwen2.5-coder-1.5b",
                        help="model name or HF directory (default: qwen2.5-coder-1.5b)")
    doctor.add_argument("--synthetic", action="store_true",
                        help="probe one Qwen2.5-1.5B-sized layer with random weights instead of --target")
    doctor.add_argument("--device", default="auto", help="cpu, cuda, ... (default: auto)")
    doctor.add_argument("--dtype", default="auto", help="auto (as generate picks it), float32, bfloat16")
    doctor.add_argument("--quantize", choices=["auto", *QUANTIZATIONS], default="auto",
                        help="the target's weight format (default: auto, as generate picks it: "
                             "w8a8 on a CPU with VNNI or AMX, else none)")
    doctor.add_argument("--contexts", type=_int_list, default=None, metavar="N,N,...",
                        help="context lengths for the chunking probe (default: 64,255,513 for a model; "
                             "16..4097 around every power of two with --synthetic)")
    doctor.add_argument("--no-costs", action="store_true",
                        help="skip the cost table (forwards of 1..33 tokens against their floors)")
    doctor.add_argument("--cost-context", type=positive_int, default=None, metavar="N",
                        help=f"cached tokens before the cost table's forwards (default: {COST_CONTEXT}), and before "
                             "--costs FILE's (default: `specdec costs --context`'s)")
    doctor.add_argument("--costs", metavar="FILE", default=None,
                        help="also write the target's cost table to FILE: `specdec costs --out FILE` for this "
                             "--target, --device, --dtype and --quantize (the file `specdec replay --costs` reads)")
    doctor.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"context lengths must be >= 1, got {text!r}")
    return values


def machine_facts(device: torch.device) -> dict:
    from specdec.models.cpu_features import cpu_flags, cpu_model, effective_isa, isa_cap_in_environment, \
        supported_isa_caps

    flags = cpu_flags()
    facts = {
        "cpu": cpu_model(),
        "cpu_features": sorted(flags & {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16",
                                        "amx_tile", "amx_int8", "avx_ne_convert"}),
        "onednn_paths_on_this_cpu": supported_isa_caps(flags),
        "onednn_cap_in_environment": isa_cap_in_environment(),
        "onednn_path_in_force": effective_isa(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "onednn": torch.backends.mkldnn.is_available(),
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(device)
        facts["cuda"] = torch.version.cuda
    return facts


def check_cached_files(target: str) -> str | None:
    """For an embedded model already converted: every converted file against the sha256 its fetch
    recorded (hub.verify_cache; loads check only sizes, as hashing takes seconds). A difference is a
    CorruptCacheError naming the file and the command that converts it again. None for a directory
    of the user's or a model not converted yet (loading it converts and records it)."""
    from specdec.models import hub

    if target not in hub.EMBEDDED or not hub.is_cached(target):
        return None
    started = time.perf_counter()
    count = hub.verify_cache(target)
    return f"{count} converted files match the sha256 their fetch recorded ({time.perf_counter() - started:.1f}s)"


def kernels_in_use(decoder) -> dict:
    from specdec.models.native.attention import KEY_BLOCK
    from specdec.models.native.invariance import decoder_projections

    def kind(module) -> str:  # specdec's own kernel says which of its instruction-set paths runs
        path = getattr(module, "path", None)
        return type(module).__name__ + (f" ({path} path)" if path else "")

    kinds = {name: kind(module) for name, module in decoder_projections(decoder).items()}
    from specdec.models.native import kernels

    on_cpu = decoder.device.type == "cpu" and kernels.load() is None
    where = f"specdec's C++ kernel, {torch.ops.specdec_attention.isa_path()} path" if on_cpu else "PyTorch ops"
    return {"projections": kinds, "dtype": str(decoder.dtype).removeprefix("torch."),
            "attention": f"blocked, {KEY_BLOCK}-key blocks aligned to position 0, fp32, combined in block order "
                         f"({where})"}


def probed_runner(args, device: torch.device):
    """(runner, its description, the chunking probe's contexts) of --synthetic's random layer or of
    --target; None for a target on the transformers backend (said on stdout: nothing to probe)."""
    from specdec.models.loader import auto_quantization, load_model, resolve_dtype
    from specdec.models.native import NativeRunner
    from specdec.models.native.invariance import QWEN2_5_1_5B_LAYER, contexts_around_powers_of_two, random_decoder

    if args.synthetic:
        dtype = resolve_dtype(args.dtype, device, "native")
        quantize = (auto_quantization("native", device, dtype, "target") if args.quantize == "auto"
                    else args.quantize)
        decoder = random_decoder(QWEN2_5_1_5B_LAYER, dtype=dtype, device=device, quantize=quantize)
        runner = NativeRunner(decoder, initial_cache_len=4096 + 64)
        contexts = args.contexts or contexts_around_powers_of_two(4096)
        return runner, "one Qwen2.5-1.5B-sized layer, random weights", contexts
    cache = check_cached_files(args.target)
    if cache:
        print(f"cache:     {cache}")
    loaded = load_model(args.target, device=args.device, dtype=args.dtype, quantize=args.quantize,
                        probe=False)  # the probe below is the full one
    if loaded.backend != "native":
        print(f"model: {args.target} runs on the transformers backend: its kernels are transformers' own; "
              "bit-exact greedy equality is NOT guaranteed (only the native decoder is built for it)")
        return None
    return loaded.runner, loaded.describe(), args.contexts or [64, 255, 513]


def check_costs_option(args) -> None:
    """--costs FILE's mistakes, before anything loads or is probed."""
    if args.costs is None:
        return
    if args.synthetic:
        raise ValueError("--costs times a real model's forwards: give --target, not --synthetic")
    if Path(args.costs).is_dir():
        raise ValueError(f"--costs {args.costs!r} is a directory; name the JSON file to write")


def write_costs(args) -> None:
    """--costs FILE: `specdec costs` itself (costs_cli.py), parsed from the flags it shares with doctor,
    so both commands write one file the same way."""
    from specdec.costs_cli import add_costs_command, cmd_costs

    parser = argparse.ArgumentParser(prog="specdec")
    add_costs_command(parser.add_subparsers())
    argv = ["costs", "--target", args.target, "--device", args.device, "--dtype", args.dtype,
            "--quantize", args.quantize, "--out", args.costs]
    if args.cost_context is not None:
        argv += ["--context", str(args.cost_context)]
    print()
    cmd_costs(parser.parse_args(argv))


def cmd_doctor(args) -> int:
    """The probe's verdict as the exit status (0 exact, 1 not); then --costs FILE, written either way."""
    check_costs_option(args)
    status = probe_and_report(args)
    if args.costs is not None:
        write_costs(args)
    return status


def probe_and_report(args) -> int:
    from specdec.models.loader import resolve_device
    from specdec.models.native.invariance import probe_batched_rows, probe_chunkings, probe_projections, probe_tree

    started = time.perf_counter()
    device = resolve_device(args.device)
    facts = machine_facts(device)
    _print_facts(facts)
    probed = probed_runner(args, device)
    if probed is None:
        return 1
    runner, model, contexts = probed
    contexts = [c for c in contexts if c + 16 <= runner.max_context]
    kernels = kernels_in_use(runner.decoder)
    print(f"model:     {model}")
    print(f"kernels:   {', '.join(f'{name} {kind}' for name, kind in kernels['projections'].items())}; "
          f"{kernels['dtype']}")
    print(f"attention: {kernels['attention']}")

    step = runner.step_tokens
    report = probe_projections(runner.decoder, step=step)
    _print_group("projections, 1..64 rows vs each row alone" if step is None else
                 f"projections, {step}..{8 * step} rows vs each block of {step} (every forward runs {step} tokens "
                 "a row here)", report.cases)
    # The tree goes on from the longest context the chunkings leave cached (one prefill for both).
    chunk_report = probe_chunkings(runner, contexts, keep_last_context=True)
    tree = probe_tree(runner, contexts[-1], prefilled=True) if contexts else probe_tree(runner, 64)
    _print_group(f"chunkings [1]*9 [9] [3,3,3] [5,4] [2,2,2,2,1] at contexts {','.join(map(str, contexts))}",
                 chunk_report.cases)
    report.extend(chunk_report)
    batched = probe_batched_rows(runner, contexts[len(contexts) // 2] if contexts else 64)
    _print_group("ragged rows decoded together vs alone", batched.cases)
    report.extend(batched)
    _print_group("a 7-node draft tree in one forward vs each path alone", tree.cases)
    report.extend(tree)

    elapsed = time.perf_counter() - started
    if report.ok:
        print(f"\nbit-exact greedy equality: GUARANTEED here ({len(report.cases)}/{len(report.cases)} probes "
              f"bit-identical, {elapsed:.0f}s)")
    else:
        print(f"\nbit-exact greedy equality: NOT guaranteed here ({len(report.failures)} of {len(report.cases)} "
              f"probes differ, {elapsed:.0f}s). specdec falls back to one token per call on this machine; "
              "please report this output.")
    costs = None
    if not args.synthetic and not args.no_costs:  # one random-weight layer has no costs worth showing
        from specdec.analysis.roofline import cost_curve

        context = max(1, min(args.cost_context or COST_CONTEXT, runner.max_context - 33))
        costs = cost_curve(runner, context=context)
        print("\n" + costs.table())
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"facts": facts, "model": model, "kernels": kernels, "ok": report.ok,
                       "cases": [case.__dict__ for case in report.cases],
                       "costs": costs.as_dict() if costs else None}, handle, indent=2)
    return 0 if report.ok else 1


def _print_facts(facts: dict) -> None:
    cap = facts["onednn_cap_in_environment"]
    print(f"cpu:       {facts['cpu']} ({' '.join(facts['cpu_features']) or 'flags unknown'}), "
          f"{facts['threads']} threads")
    print(f"oneDNN:    path in force {facts['onednn_path_in_force']}"
          f" ({'capped by ONEDNN_MAX_CPU_ISA=' + cap if cap else 'no cap'}); "
          f"this CPU runs {', '.join(facts['onednn_paths_on_this_cpu']) or 'unknown'}")
    if "gpu" in facts:
        print(f"gpu:       {facts['gpu']} (CUDA {facts['cuda']})")
    print(f"torch:     {facts['torch']}, python {facts['python']}")
    sys.stdout.flush()


def _print_group(title: str, cases) -> None:
    same = sum(case.identical for case in cases)
    print(f"  {'ok ' if same == len(cases) else 'BAD'} {same}/{len(cases)} identical: {title}")
    for case in cases:
        if not case.identical:
            print(f"      differs: {case.name} (max |diff| {case.max_abs_diff:.3g})")
    sys.stdout.flush()
