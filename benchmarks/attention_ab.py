"""The working tree's attention kernel against another version of kernels/attention.cpp, in one process.

As kernel_ab.py for w4a8 (whose build_other and interleaved it uses): these VMs' speed moves by
a third within minutes, so two versions are only compared interleaved in one process. This builds
the other version under its own op namespace and times both on the 1.5B target's attention shape
(12 query heads over 2 KV heads, head size 128, 800 cached tokens unless --context) at 1..16 new
tokens, fp32 and bf16 caches, and checks that both give the same bits.

    git show 9683873:src/specdec/models/native/kernels/attention.cpp > /tmp/attention_before.cpp
    python benchmarks/attention_ab.py /tmp/attention_before.cpp [--context 800] [--passes 40]
    python benchmarks/attention_ab.py /tmp/attention_before.cpp --forwards   # whole forwards too

--forwards also times whole forwards of the embedded w4a8 target (op by op from Python, since
kernels/block.cpp calls the attention op by name), the same cache, each version interleaved.

Both versions must share the op's signature: blocked(query, keys, values, bias, block).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kernel_ab import build_other, interleaved  # benchmarks/kernel_ab.py
from specdec.models.native import kernels
from specdec.models.native.attention import KEY_BLOCK, block_bias, round_up

KV_HEADS, GROUPS, HEAD_DIM = 2, 6, 128  # Qwen2.5-Coder-1.5B


def inputs(rows: int, context: int, dtype: torch.dtype, generator: torch.Generator):
    """A chain of `rows` new tokens after `context` cached ones, laid out as the decoder calls the op
    (attention.py's chain_attention): a KV head's query groups x tokens as the rows of one sequence."""
    slots = round_up(context + rows)
    query = torch.randn(1, KV_HEADS, 1, GROUPS * rows, HEAD_DIM, generator=generator)
    keys = torch.randn(1, KV_HEADS, 1, slots, HEAD_DIM, generator=generator).to(dtype)
    values = torch.randn(1, KV_HEADS, 1, slots, HEAD_DIM, generator=generator).to(dtype)
    positions = torch.arange(context, context + rows).repeat(GROUPS)
    visible = torch.arange(slots)[None, :] <= positions[:, None]
    return query, keys, values, block_bias(visible[None, None, None])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("other", type=Path, help="another version of kernels/attention.cpp")
    parser.add_argument("--context", type=int, default=800)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 3, 5, 9, 16])
    parser.add_argument("--passes", type=int, default=40)
    parser.add_argument("--forwards", action="store_true", help="also whole forwards of the embedded target")
    args = parser.parse_args()
    if kernels.load() is not None:
        raise SystemExit(f"specdec's kernels do not build here: {kernels.load()}")
    ours, other = torch.ops.specdec_attention.blocked, build_other(args.other, "specdec_attention").blocked
    generator = torch.Generator().manual_seed(0)
    print(f"ms per call (median of {args.passes}, interleaved), {args.context} cached tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"{'cache':9s} {'rows':>4s} {'this tree':>10s} {'other':>10s} {'tree/other':>10s}  same bits")
    for dtype in (torch.float32, torch.bfloat16):
        for rows in args.rows:
            tensors = inputs(rows, args.context, dtype, generator)
            same = torch.equal(ours(*tensors, KEY_BLOCK), other(*tensors, KEY_BLOCK))
            medians = interleaved({"ours": lambda: ours(*tensors, KEY_BLOCK),
                                   "other": lambda: other(*tensors, KEY_BLOCK)}, args.passes)
            mine, theirs = medians["ours"] * 1e3, medians["other"] * 1e3
            print(f"{str(dtype).split('.')[-1]:9s} {rows:4d} {mine:10.3f} {theirs:10.3f} {mine / theirs:10.2f}  {same}")
    if args.forwards:
        time_forwards(other, args.context, args.rows, max(args.passes // 4, 5))


def time_forwards(other, context: int, row_counts: list[int], passes: int) -> None:
    """Whole forwards of the embedded w4a8 target, op by op, with this tree's attention or the other's."""
    from specdec.models.loader import load_model
    from specdec.models.native import attention

    runner = load_model("qwen2.5-coder-1.5b", quantize="w4a8", progress=False).runner
    runner.decoder.block_form = "op by op"  # block.cpp would call this tree's op by name
    original = attention.blocked_attention
    use_other = [False]

    def blocked(query, keys, values, bias):
        if use_other[0]:
            return other(query, keys, values, bias, KEY_BLOCK)
        return original(query, keys, values, bias)

    attention.blocked_attention = blocked
    generator = torch.Generator().manual_seed(1)
    runner.forward(torch.randint(100, 20000, (1, context), generator=generator), torch.arange(context)[None],
                   last_n_logits=1)
    print(f"\nwhole forwards after {context} cached tokens, ms (median of {passes}, interleaved)")
    print(f"{'tokens':>6} {'this tree':>10} {'other':>10} {'tree/other':>10}  same logits")
    with torch.inference_mode():
        for rows in row_counts:
            tokens = torch.randint(100, 20000, (1, rows), generator=generator)

            def forward(version_is_other: bool) -> torch.Tensor:
                use_other[0] = version_is_other
                logits = runner.forward(tokens, torch.arange(context, context + rows)[None]).logits
                runner.truncate([context])
                return logits

            same = torch.equal(forward(False), forward(True))
            medians = interleaved({"ours": lambda: forward(False), "other": lambda: forward(True)}, passes)
            mine, theirs = medians["ours"] * 1e3, medians["other"] * 1e3
            print(f"{rows:6d} {mine:10.1f} {theirs:10.1f} {mine / theirs:10.2f}  {same}")
    attention.blocked_attention = original


if __name__ == "__main__":
    main()
