"""The w4a8 kernel's arithmetic rate on weights already in cache, against this core's int8 peak.

A forward's projections are bounded by two floors: the bytes over the memory bandwidth, and the
multiply-adds over the int8 peak (`specdec doctor`). This measures the second one's distance for
the kernel alone: one thread runs a kernel's block loop (kernels/w4a8.cpp's blocks_avx512 or
block_avx2, no PyTorch call around it) over weights small enough to stay in L1 or L2, and prints
multiply-adds per second next to the peak of the same instructions (w4a8.cpp's int8_peak).

    python benchmarks/w4a8_tile_cycles.py                      # the tree's kernel, this CPU's path
    python benchmarks/w4a8_tile_cycles.py --path avx2          # the AVX2 path on an AVX-512 CPU
    python benchmarks/w4a8_tile_cycles.py --source /tmp/w4a8_before.cpp

The source must have the tree's block-loop signatures (blocks_avx512<kVnni>(p, b0, count) and
block_avx2(p, b, m0, rows)). A kernel at a fraction f of the peak here is at its port bound when its
instructions per multiply-add, counted in objdump, explain f (docs/history.md, "w4a8: the
tile at its port bound").
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from kernel_ab import build_other  # benchmarks/kernel_ab.py
from specdec.models.native import kernels
from specdec.models.native.w4a8 import ISA_PATHS, isa_path

KERNEL = Path(__file__).resolve().parents[1] / "src/specdec/models/native/kernels/w4a8.cpp"

TIMING = r"""
#include <chrono>
namespace {
// Seconds per call of the block loop over M rows and `sets` blocks of 64 outputs x K inputs.
double time_blocks(int64_t isa, int64_t M, int64_t K, int64_t sets, int64_t reps) {
  const int64_t N = sets * 64, groups = K / 32, blocks = N / 16;
  std::vector<int8_t> xq(K * M, 3);
  std::vector<float> xsum(M * groups, 96.f), xscale(M, 1.f), out(M * N);
  std::vector<uint8_t> packed(blocks * groups * 256, 0x35), codes(blocks * groups * 32, 9);
  std::vector<uint16_t> supers(blocks * ((groups + 7) / 8) * 32, 0x3c00);  // fp16 1.0
  const Problem p{xq.data(), xsum.data(), xscale.data(), packed.data(), codes.data(), supers.data(),
                  nullptr, out.data(), false, N, M, N, K};
  auto run = [&] {
    if (isa == kAvx2) {
      for (int64_t b = 0; b < blocks; ++b) block_avx2(p, b, 0, M);
    } else {
      blocks_avx512<true>(p, 0, blocks);
    }
  };
  run();
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < reps; ++i) run();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / reps;
}
}  // namespace
TORCH_LIBRARY_FRAGMENT(NAMESPACE, m) { m.def("time_blocks(int isa, int M, int K, int sets, int reps) -> float"); }
TORCH_LIBRARY_IMPL(NAMESPACE, CompositeExplicitAutograd, m) { m.impl("time_blocks", &time_blocks); }
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, default=KERNEL, help="a w4a8.cpp (default: the tree's)")
    parser.add_argument("--path", choices=["avx2", "avx512_vnni"], default=None,
                        help="the kernel path (default: this CPU's, avx2 where it lacks VNNI)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 9, 17, 33])
    parser.add_argument("--repeats", type=int, default=5, help="timings per cell; the median is printed")
    args = parser.parse_args()
    if (reason := kernels.load()) is not None:
        raise SystemExit(reason)
    path = args.path or ("avx512_vnni" if isa_path() == "avx512_vnni" else "avx2")
    if path == "avx512_vnni" and isa_path() != "avx512_vnni":
        raise SystemExit("this CPU (or its ONEDNN_MAX_CPU_ISA cap) has no AVX512-VNNI path")
    isa = ISA_PATHS[path]
    ops = build_other(args.source, extra=TIMING)
    torch.set_num_threads(1)
    peak = max(torch.ops.specdec_w4a8.int8_peak(isa) for _ in range(3))
    print(f"path {path}, one thread: int8 peak {peak / 1e9:.0f} G multiply-adds/s")
    print("| weights | " + " | ".join(f"{rows} rows" for rows in args.rows) + " |")
    print("|---|" + "---:|" * len(args.rows))
    for inputs, sets, where in ((256, 1, "8 KB (L1)"), (1536, 1, "48 KB"), (1536, 16, "768 KB (L2)")):
        cells = []
        for rows in args.rows:
            macs = rows * sets * 64 * inputs
            reps = max(3, int(4e8 / macs / 50))
            seconds = statistics.median(ops.time_blocks(isa, rows, inputs, sets, reps) for _ in range(args.repeats))
            cells.append(f"{macs / seconds / 1e9:.0f} G ({macs / seconds / peak:.0%})")
        print(f"| {where} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
