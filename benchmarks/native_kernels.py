"""Which CPU kernel should a projection use? Median ms per call for 1..9 rows.

The fused gate/up projection of Qwen2.5-Coder-1.5B (17920 x 1536), the
largest matrix a decode step reads besides the head, in each weight format the
native backend offers. Decoding reads it with 1 row; verifying k drafts with
k+1 rows. Speculation pays when the 5- and 9-row columns stay close to the 1-row one.

  python benchmarks/native_kernels.py
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from specdec.models.native.linear import DenseLinear, make_linear

ROWS = (1, 2, 5, 9)


def time_call(fn, x, repeats: int = 30) -> float:
    for _ in range(3):
        fn(x)
    times = []
    for _ in range(repeats):
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
    }
    results = []
    print(f"{'format':<30}" + "".join(f"{f'{m} row' + ('s' if m > 1 else ''):>10}" for m in ROWS) + "  MB read")
    with torch.inference_mode():
        for name, (dtype, quantize) in formats.items():
            if quantize == "unpacked":
                linear = DenseLinear(weight.to(dtype), None)
            else:
                linear = make_linear(weight, None, dtype=dtype, device=cpu, quantize=quantize)
            times = [time_call(linear, torch.randn(m, 1536).to(dtype)) for m in ROWS]
            megabytes = weight.numel() * {"int8": 1, "int4": 0.5}.get(quantize, dtype.itemsize) / 1e6
            results.append(dict(format=name, ms=dict(zip(map(str, ROWS), times)), weight_mb=megabytes))
            print(f"{name:<30}" + "".join(f"{t:>10.2f}" for t in times) + f"{megabytes:>9.0f}", flush=True)
    Path("benchmarks/results").mkdir(parents=True, exist_ok=True)
    Path("benchmarks/results/native_kernels.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
