"""The working tree's w4a8 kernel against another version of kernels/w4a8.cpp, in one process.

A kernel change (a new weight format, a new tile) must be timed against the old one on the same
machine in the same minutes: these VMs' memory bandwidth moves by a third within minutes, so two
processes minutes apart compare the machine, not the kernels. This builds the other version under
its own op namespace, packs weights with each version's own quantize_pack, and interleaves:

- projections: the 1.5B target's 112 w4a8 projections (--model: another model's) with random
  weights of the real shapes, each version's copy allocated side by side, or one copy for both
  where the packings are the same bytes; on 2 MB pages as the decoder's own; at 1..17 rows;
- forwards: whole forwards of the embedded model (op by op from Python, both versions, the same
  300-token cache) of 1, 5 and 9 new tokens.

    git show ee4e8b0:src/specdec/models/native/kernels/w4a8.cpp > /tmp/w4a8_before.cpp
    python benchmarks/kernel_ab.py /tmp/w4a8_before.cpp [--rows 1 2 5 9 17] [--passes 11]
    python benchmarks/kernel_ab.py /tmp/w4a8_before.cpp --model qwen2.5-coder-0.5b   # the draft

Both versions must share the ops' signatures: linear(x, packed, a, b, bias, isa, columns, dtype)
and quantize_pack(weight, padded_outputs) -> [packed, a, b].
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from specdec.models.huge_pages import move_to_huge_pages
from specdec.models.loader import load_model
from specdec.models.native.w4a8 import ISA_PATHS, W4A8Linear


KERNELS = Path(__file__).resolve().parents[1] / "src/specdec/models/native/kernels"


def build_other(source: Path, library: str = "specdec_w4a8", extra: str = "") -> object:
    """Compile `source` with its ops moved from namespace `library` to `library`_other; returns
    torch.ops.<library>_other (benchmarks/attention_ab.py builds kernels/attention.cpp this way).
    `extra`: C++ appended to the source, NAMESPACE in it replaced by the new namespace (more ops,
    e.g. benchmarks/w4a8_tile_cycles.py's timing loop)."""
    from torch.utils import cpp_extension
    try:
        import ninja
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    other = f"{library}_other"
    text = re.sub(rf"TORCH_LIBRARY(_IMPL)?\({library},", rf"TORCH_LIBRARY\1({other},", source.read_text())
    build = Path(tempfile.mkdtemp(prefix="specdec-kernel-ab-"))
    (build / f"{other}.cpp").write_text(text + extra.replace("NAMESPACE", other))
    # The kernels include their shared headers (bf16_lanes.h, cpu_paths.h, ...): the source's own
    # folder first, then the tree's, so a version saved to /tmp still finds them.
    headers = [str(source.resolve().parent), str(KERNELS)]
    cpp_extension.load(name=other, sources=[str(build / f"{other}.cpp")], is_python_module=False,
                       extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp"],
                       extra_include_paths=headers, build_directory=str(build))
    return getattr(torch.ops, other)


def on_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors copied onto 2 MB pages, where the native decoder keeps its own weights
    (models/huge_pages.py), so both versions stream their weights as a forward does."""
    holder = nn.Module()
    for index, tensor in enumerate(tensors):
        holder.register_buffer(f"t{index}", tensor)
    move_to_huge_pages([holder])
    return [getattr(holder, f"t{index}") for index in range(len(tensors))]


def same_bytes(mine: list[torch.Tensor], theirs: list[torch.Tensor]) -> bool:
    """Whether two versions packed a weight into the same tensors. Then both read one copy: two copies
    of the same bytes can sit in memory of different speed (on the Zen 4 VM, a 256 MB sum read 34 GB/s
    in some processes and 60 in others), which would time the placement, not the kernels."""
    return len(mine) == len(theirs) and all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(mine, theirs))


def interleaved(runs: dict, passes: int) -> dict[str, float]:
    """Median seconds of each callable, run in alternating order pass by pass."""
    times = {name: [] for name in runs}
    for index in range(passes):
        for name in (list(runs) if index % 2 == 0 else list(reversed(runs))):
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("other", type=Path, help="another version's w4a8.cpp")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 9, 17])
    parser.add_argument("--passes", type=int, default=11)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b",
                        help="whose projections and forwards (qwen2.5-coder-0.5b: the draft's)")
    parser.add_argument("--other-path", choices=list(ISA_PATHS),
                        help="the other version's instruction-set path (default: this process's, as ours); "
                             "e.g. avx512_vnni for a version from before the amx path")
    args = parser.parse_args()
    other = build_other(args.other)
    ours = torch.ops.specdec_w4a8
    target = load_model(args.model, progress=False, quantize="w4a8")
    runner = target.runner
    linears = [module for module in runner.decoder.modules() if isinstance(module, W4A8Linear)]
    isa = ISA_PATHS[linears[0].path]
    other_isa = ISA_PATHS[args.other_path] if args.other_path else isa
    generator = torch.Generator().manual_seed(0)

    # Projections: both versions' packings of the same random weights, allocated side by side; one
    # copy read by both where the packings are the same bytes (a kernel change that keeps the format).
    packs = []
    for linear in linears:
        weight = torch.randn(linear.out_features, linear.in_features, generator=generator).bfloat16() * 0.02
        padded = linear.out_features + (-linear.out_features % 16)
        mine, theirs = ours.quantize_pack(weight, padded), other.quantize_pack(weight, padded)
        if same_bytes(mine, theirs):
            shared = on_huge_pages(list(mine))
            packs.append((linear, shared, shared))
        else:
            both = on_huge_pages([*mine, *theirs])
            packs.append((linear, both[:3], both[3:]))
    one_copy = packs[0][1] is packs[0][2]
    print(f"weights: {'one copy, read by both versions (the same packing)' if one_copy else 'a copy per version'}")
    for rows in args.rows:
        inputs = {linear.in_features: torch.randn(rows, linear.in_features, generator=generator).bfloat16()
                  for linear in linears}

        def projections(version: int, op) -> None:
            for linear, *packed in packs:
                op.linear(inputs[linear.in_features], *packed[version], linear.bias, other_isa if version else isa,
                          linear.out_features, linear.dtype)

        medians = interleaved({"ours": lambda: projections(0, ours), "other": lambda: projections(1, other)},
                              args.passes)
        print(json.dumps({"what": "projections", "rows": rows, "ours_ms": round(medians["ours"] * 1e3, 2),
                          "other_ms": round(medians["other"] * 1e3, 2),
                          "ratio": round(medians["ours"] / medians["other"], 3)}), flush=True)

    # Whole forwards, op by op (block.cpp calls our op by name), each linear on the version asked.
    runner.decoder.block_form = "op by op"
    use_other = [False]
    for linear in linears:
        padded = linear.out_features + (-linear.out_features % 16)
        theirs = other.quantize_pack(linear.dequantized(), padded)
        if same_bytes(theirs, ours.quantize_pack(linear.dequantized(), padded)):
            linear.other_packed = (linear.packed, linear.codes, linear.supers)  # already on 2 MB pages
            continue
        placed = on_huge_pages([*theirs, linear.packed.clone(), linear.codes.clone(), linear.supers.clone()])
        linear.other_packed, (linear.packed, linear.codes, linear.supers) = placed[:3], placed[3:]
    original = W4A8Linear.forward

    def forward(self, x, isa=None):
        if not use_other[0]:
            return original(self, x, isa)
        rows = x.reshape(-1, self.in_features)
        out = other.linear(rows, *self.other_packed, self.bias, other_isa if isa is None else isa,
                           self.out_features, self.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    W4A8Linear.forward = forward
    runner.reset()
    runner.forward(torch.randint(100, 20000, (1, 300), generator=generator), torch.arange(300)[None])
    with torch.inference_mode():
        for count in (1, 5, 9):
            tokens = torch.randint(100, 20000, (1, count), generator=generator)

            def step(version_is_other: bool) -> None:
                use_other[0] = version_is_other
                runner.forward(tokens, torch.arange(300, 300 + count)[None])
                runner.truncate([300])

            medians = interleaved({"ours": lambda: step(False), "other": lambda: step(True)}, args.passes)
            print(json.dumps({"what": "forward", "new_tokens": count, "ours_ms": round(medians["ours"] * 1e3, 2),
                              "other_ms": round(medians["other"] * 1e3, 2),
                              "ratio": round(medians["ours"] / medians["other"], 3)}), flush=True)
    W4A8Linear.forward = original


if __name__ == "__main__":
    main()
