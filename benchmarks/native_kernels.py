"""Which CPU kernel should a projection use? Median ms per call for 1..16 rows.

The fused gate/up projection of Qwen2.5-Coder-1.5B (17920 x 1536), the
largest matrix a decode step reads besides the head, in each weight format the
native backend offers. Decoding reads it with 1 row; verifying k drafts with
k+1 rows. Speculation pays when the 5- and 9-row columns stay close to the 1-row one.
Calls cycle through four copies of the matrix (more bytes than a CPU's last-level
cache), so the weights come from memory as in a real forward, not from cache.

  python benchmarks/native_kernels.py
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from specdec.models.native.linear import DenseLinear, make_linear, w8a8_available
from specdec.models.native.w4a8 import w4a8_available

ROWS = (1, 2, 5, 9, 16)
COPIES = 4


def time_call(fns, x, repeats: int = 40) -> float:
    for fn in fns:
        fn(x)
    times = []
    for i in range(repeats):
        fn = fns[i % len(fns)]
        started = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    torch.manual_seed(0)
    weight = torch.randn(17920, 1536) * 0.02
    cpu = torch.device("cpu")
    formats = {
        "fp32 (oneDNN packed)": (torch.float32, "none"),
        "bf16, F.linear (unpacked)": (torch.bfloat16, "unpacked"),
        "bf16 (oneDNN packed)": (torch.bfloat16, "none"),
        "int8 weights, bf16 act": (torch.bfloat16, "int8"),
        "int4 weights (g32), bf16 act": (torch.bfloat16, "int4"),
        "w8a8 (int8 weights and act)": (torch.bfloat16, "w8a8"),
        "w4a8 (4-bit weights, int8 act)": (torch.bfloat16, "w4a8"),
    }
    results = []
    print(f"{'format':<30}" + "".join(f"{f'{m} row' + ('s' if m > 1 else ''):>10}" for m in ROWS) + "  MB read")
    with torch.inference_mode():
        for name, (dtype, quantize) in formats.items():
            reason = {"w8a8": w8a8_available, "w4a8": w4a8_available}.get(quantize, lambda: None)()
            if reason is not None:
                print(f"{name:<30}skipped: {reason}")
                continue
            if quantize == "unpacked":
                linears = [DenseLinear((weight + i * 1e-3).to(dtype), None) for i in range(COPIES)]
            else:
                linears = [make_linear(weight + i * 1e-3, None, dtype=dtype, device=cpu, quantize=quantize)
                           for i in range(COPIES)]
            times = [time_call(linears, torch.randn(m, 1536).to(dtype)) for m in ROWS]
            bytes_per_weight = {"int8": 1, "int4": 0.5, "w8a8": 1, "w4a8": 5 / 8}.get(quantize, dtype.itemsize)
            megabytes = weight.numel() * bytes_per_weight / 1e6
            results.append(dict(format=name, ms=dict(zip(map(str, ROWS), times)), weight_mb=megabytes))
            print(f"{name:<30}" + "".join(f"{t:>10.2f}" for t in times) + f"{megabytes:>9.0f}", flush=True)
    Path("benchmarks/results").mkdir(parents=True, exist_ok=True)
    Path("benchmarks/results/native_kernels.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
