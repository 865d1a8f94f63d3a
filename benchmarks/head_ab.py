"""The working tree's w8a8 kernel against another version of kernels/w8a8.cpp, in one process.

The w4a8 target's output head (151936 x 1536, int8: 233 MB) is the largest matrix a step reads, and
verification runs it over every row: this times both versions on that shape with random weights at
1..17 rows, interleaved (these VMs' speed moves within minutes), and checks they give the same bits.

    git show HEAD~1:src/specdec/models/native/kernels/w8a8.cpp > /tmp/w8a8_before.cpp
    python benchmarks/head_ab.py /tmp/w8a8_before.cpp [--rows 1 5 9 17] [--passes 11]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kernel_ab import build_other, interleaved  # benchmarks/kernel_ab.py
from specdec.models.native import kernels
from specdec.models.native.w4a8 import ISA_PATHS, isa_path

VOCAB, HIDDEN = 151936, 1536  # Qwen2.5-Coder-1.5B's head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("other", type=Path, help="another version of kernels/w8a8.cpp")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 9, 17])
    parser.add_argument("--passes", type=int, default=11)
    args = parser.parse_args()
    if kernels.load() is not None:
        raise SystemExit(f"specdec's kernels do not build here: {kernels.load()}")
    if isa_path() != "avx512_vnni":
        raise SystemExit(f"w8a8 needs AVX512-VNNI; this process runs the {isa_path()} path")
    ours, other = torch.ops.specdec_w8a8, build_other(args.other, "specdec_w8a8")
    generator = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (VOCAB, HIDDEN), generator=generator, dtype=torch.int8)
    packed, wsum = ours.pack(weight, VOCAB)
    scales = torch.rand(VOCAB, generator=generator) / 100
    isa = ISA_PATHS["avx512_vnni"]
    weight_bytes = packed.numel()
    print(f"ms per call (median of {args.passes}, interleaved), {VOCAB} x {HIDDEN} int8, "
          f"{torch.get_num_threads()} threads")
    print(f"{'rows':>4s} {'this tree':>10s} {'other':>10s} {'tree/other':>10s} {'GB/s':>6s}  same bits")
    for rows in args.rows:
        x = torch.randn(rows, HIDDEN, generator=generator)
        same = torch.equal(ours.linear(x, packed, wsum, scales, None, isa), other.linear(x, packed, wsum, scales, None, isa))
        times = interleaved({"ours": lambda: ours.linear(x, packed, wsum, scales, None, isa),
                             "other": lambda: other.linear(x, packed, wsum, scales, None, isa)}, args.passes)
        print(f"{rows:4d} {1e3 * times['ours']:10.2f} {1e3 * times['other']:10.2f} "
              f"{times['ours'] / times['other']:10.2f} {weight_bytes / times['ours'] / 1e9:6.1f}  {same}")


if __name__ == "__main__":
    main()
