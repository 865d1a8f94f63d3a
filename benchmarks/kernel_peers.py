"""specdec's w4a8 kernel next to the field's maintained 4-bit CPU kernels, at 1..33 rows.

Verification pays only if a forward of k+1 tokens costs about one step, so what matters is how each
kernel's cost grows with its rows. Two comparisons, each interleaved (these VMs' bandwidth moves
within minutes, so runs minutes apart compare the machine, not the kernels):

- projections (one process, pass by pass in rotating order): the embedded 1.5B target's 112
  projections, random weights of the real shapes, at each row count, through
    specdec w4a8: kernels/w4a8.cpp on this CPU's path (4.625 bits a weight);
    torch int4: aten._weight_int4pack_mm_for_cpu, 4-bit weights with a bf16 scale and zero per
      group of 32 (torchao's int4 weight-only CPU layout), bf16 activations: it dequantizes a
      tile of weights to floats for every 4 rows (BLOCK_M 4);
    torch bf16: F.linear on bf16 weights through oneDNN (3.5x the bytes; AMX where the CPU has it).
- forwards (rounds alternating between the engines): a whole forward of k new tokens after
  --context cached tokens, the embedded target:
    specdec: the native runner, w4a8 (benchmarks/verify_cost.py's measure);
    llama.cpp: llama-bench -p k -n 0 -d CONTEXT on the same model's Q4_K_M GGUF (Q4_K, with Q6_K for
      some tensors), built by benchmarks/llama_cpp_peer.py; by default it repacks Q4_K weights for
      its multi-row GEMM (ggml-cpu's repack.cpp, q4_K_8x8_q8_K), and --no-repack runs its plain
      vec_dot path as well.

    python benchmarks/llama_cpp_peer.py build        # once
    python benchmarks/kernel_peers.py [--rows 1,2,5,9,17,33] [--passes 9] [--rounds 2] --json /tmp/peers.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F

from kernel_ab import interleaved  # benchmarks/kernel_ab.py
from verify_cost import measure  # benchmarks/verify_cost.py

from specdec.models.cpu_features import cpu_model, effective_isa
from specdec.models.loader import load_model
from specdec.models.native.w4a8 import ISA_PATHS, W4A8Linear

TARGET = "qwen2.5-coder-1.5b"
GROUP = 32


def torch_int4(out_features: int, in_features: int, generator: torch.Generator):
    """(packed weights, bf16 [K/32, N, 2] scales and zeros) for _weight_int4pack_mm_for_cpu; the
    values are random: the kernel's time does not depend on them."""
    codes = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    scales_and_zeros = (torch.rand(in_features // GROUP, out_features, 2, generator=generator) * 0.01).bfloat16()
    return packed, scales_and_zeros


def projections(rows_list, passes: int) -> list[dict]:
    target = load_model(TARGET, progress=False, quantize="w4a8", probe=False)
    linears = [module for module in target.runner.decoder.modules() if isinstance(module, W4A8Linear)]
    isa = ISA_PATHS[linears[0].path]
    ours = torch.ops.specdec_w4a8
    generator = torch.Generator().manual_seed(0)
    weights = []
    for linear in linears:
        weight = torch.randn(linear.out_features, linear.in_features, generator=generator).bfloat16() * 0.02
        padded = linear.out_features + (-linear.out_features % 16)
        weights.append((linear, ours.quantize_pack(weight, padded),
                        torch_int4(linear.out_features, linear.in_features, generator), weight))
    del target
    results = []
    for rows in rows_list:
        inputs = {linear.in_features: torch.randn(rows, linear.in_features, generator=generator).bfloat16()
                  for linear, *_ in weights}

        def specdec_w4a8() -> None:
            for linear, packed, _, _ in weights:
                ours.linear(inputs[linear.in_features], *packed, linear.bias, isa, linear.out_features, linear.dtype)

        def torch_int4_mm() -> None:
            for linear, _, (packed, scales_and_zeros), _ in weights:
                torch.ops.aten._weight_int4pack_mm_for_cpu(inputs[linear.in_features], packed, GROUP,
                                                           scales_and_zeros)

        def torch_bf16() -> None:
            for linear, _, _, weight in weights:
                F.linear(inputs[linear.in_features], weight)

        with torch.inference_mode():
            medians = interleaved({"specdec w4a8": specdec_w4a8, "torch int4": torch_int4_mm,
                                   "torch bf16": torch_bf16}, passes)
        row = dict(rows=rows, **{name: round(seconds * 1e3, 2) for name, seconds in medians.items()})
        results.append(row)
        print(json.dumps(row), flush=True)
    return results


def llama_bench(bin_dir: Path, gguf: Path, rows_list, context: int, repetitions: int, repack: bool) -> dict[int, float]:
    """ms per forward of k tokens after `context` cached tokens, from llama-bench's own t/s."""
    command = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", ",".join(map(str, rows_list)), "-n", "0",
               "-d", str(context), "-t", str(torch.get_num_threads()), "-r", str(repetitions), "-o", "json"]
    if not repack:
        command += ["--repack", "0"]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:  # e.g. SIGSEGV in its AMX repacking on a Sapphire Rapids Xeon (benchmarks/peers.py)
        print(f"llama-bench exited with {run.returncode}: {' '.join(command)}\n{run.stderr[-2000:]}", flush=True)
        return {}
    return {entry["n_prompt"]: 1e3 * entry["n_prompt"] / entry["avg_ts"] for entry in json.loads(run.stdout)}


def forwards(rows_list, context: int, steps: int, llama_reps: int, rounds: int, repack_modes,
             bin_dir: Path | None) -> dict:
    import llama_cpp_peer  # benchmarks/llama_cpp_peer.py

    if bin_dir is None:
        bin_dir = llama_cpp_peer.build(tools=llama_cpp_peer.TOOLS + ("llama-bench",))
    gguf = llama_cpp_peer.gguf_path(TARGET)
    runs: dict[str, list[dict[int, float]]] = {}
    for round_index in range(rounds):
        engines = ["specdec w4a8"] + [f"llama.cpp Q4_K_M{'' if repack else ' no-repack'}" for repack in repack_modes]
        for engine in engines if round_index % 2 == 0 else reversed(engines):
            if engine == "specdec w4a8":
                step_ms = measure(TARGET, "w4a8", context, steps, tuple(rows_list))["step_ms"]
            else:
                step_ms = llama_bench(bin_dir, gguf, rows_list, context, llama_reps, "no-repack" not in engine)
            runs.setdefault(engine, []).append(step_ms)
            print(json.dumps({"engine": engine, "round": round_index,
                              "ms": {k: round(v, 2) for k, v in step_ms.items()}}), flush=True)
    # An engine with a failed round (llama-bench printed why) is left out of the table.
    return {engine: {rows: statistics.median(run[rows] for run in values) for rows in rows_list}
            for engine, values in runs.items() if all(rows in run for run in values for rows in rows_list)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,5,9,17,33", help="rows (tokens) per call, comma-separated")
    parser.add_argument("--passes", type=int, default=9, help="interleaved passes over the 112 projections")
    parser.add_argument("--context", type=int, default=800, help="cached tokens before each forward")
    parser.add_argument("--steps", type=int, default=7, help="forwards per row count and round (median)")
    parser.add_argument("--llama-reps", type=int, default=3,
                        help="llama-bench repetitions per row count and round (each one prefills the context again)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of the whole-forward engines")
    parser.add_argument("--only", choices=["projections", "forwards"])
    parser.add_argument("--no-repack", action="store_true", help="also run llama.cpp without its repacked weights")
    parser.add_argument("--llama-bin", type=Path,
                        help="a llama.cpp build's bin folder holding llama-bench (default: llama_cpp_peer.py's build: "
                             "GGML_NATIVE=ON, or on a CPU with AMX, whose AMX repacking crashed, AVX-512 without AMX)")
    parser.add_argument("--json", required=True, help="where to write the results")
    args = parser.parse_args()
    rows_list = [int(n) for n in args.rows.split(",")]
    machine = f"{cpu_model()} ({effective_isa()}), {torch.get_num_threads()} threads"
    print(machine, flush=True)
    report = dict(cpu=cpu_model(), isa=effective_isa(), threads=torch.get_num_threads(), context=args.context)
    if args.only in (None, "projections"):
        report["projections_ms"] = projections(rows_list, args.passes)
        print(f"\nthe 112 projections, ms (x the same kernel's 1 row): {machine}")
        names = [name for name in report["projections_ms"][0] if name != "rows"]
        print(f"{'rows':>5}" + "".join(f"{name:>24}" for name in names))
        first = report["projections_ms"][0]
        for row in report["projections_ms"]:
            print(f"{row['rows']:>5}" + "".join(f"{row[n]:>14.1f} ({row[n] / first[n]:4.2f}x)" for n in names))
    if args.only in (None, "forwards"):
        modes = (True, False) if args.no_repack else (True,)
        medians = forwards(rows_list, args.context, args.steps, args.llama_reps, args.rounds, modes,
                           args.llama_bin)
        report["forward_ms"] = {engine: {str(k): round(v, 2) for k, v in ms.items()} for engine, ms in medians.items()}
        print(f"\na whole forward after {args.context} cached tokens, ms (x the same engine's 1 token): {machine}")
        print(f"{'tokens':>6}" + "".join(f"{engine:>28}" for engine in medians))
        for rows in rows_list:
            print(f"{rows:>6}" + "".join(f"{ms[rows]:>18.1f} ({ms[rows] / ms[rows_list[0]]:4.2f}x)"
                                         for ms in medians.values()))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
