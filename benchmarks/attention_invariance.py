"""What batch-invariant attention costs: one decode step's attention, blocked vs unblocked.

One layer of Qwen2.5-1.5B's heads (12 query heads, 2 kv heads, head_dim 128), bf16,
T = 1 (a plain decode step) and T = 5 (verifying k=4 drafts), at several cached
lengths; median microseconds per call over repeats. "unblocked" is the two-matmul
form specdec used before (one softmax over the whole padded key range; its result
changes with the chunking), "blocked" is native/attention.py (fixed reduction order).

    python benchmarks/attention_invariance.py [--repeats 300]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.models.cpu_features import cpu_model, effective_isa
from specdec.models.native.attention import AttentionPlan, attention_mask, grouped_attention, round_up


def median_us(call, repeats: int) -> float:
    for _ in range(5):
        call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    heads, kv_heads, dim, dtype = 12, 2, 128, torch.bfloat16
    print(f"{cpu_model()} ({effective_isa()}), {torch.get_num_threads()} threads, bf16, median of {args.repeats}")
    print("| cached tokens | new tokens | unblocked us | blocked us | ratio |")
    print("|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for length in (128, 512, 2048, 4096):
        for steps in (1, 5):
            query = torch.randn(1, heads, steps, dim, generator=generator).to(dtype)
            keys = torch.randn(1, kv_heads, round_up(length + 64), dim, generator=generator).to(dtype)
            values = torch.randn(keys.shape, generator=generator).to(dtype)
            start = length - steps
            mask = attention_mask([start], steps, length, None, torch.device("cpu"))
            old = median_us(lambda: grouped_attention(query, keys[:, :, :length], values[:, :, :length], mask),
                            args.repeats)
            plan = AttentionPlan.build([start], steps, heads // kv_heads, None, torch.device("cpu"))
            new = median_us(lambda: plan.attend(query, keys[:, :, :plan.key_length], values[:, :, :plan.key_length]),
                            args.repeats)
            print(f"| {length} | {steps} | {old:.0f} | {new:.0f} | {new / old:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
