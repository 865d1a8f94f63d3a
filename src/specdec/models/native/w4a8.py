"""w4a8: 4-bit weights times per-row int8 activations, on specdec's own CPU kernel (kernels/w4a8.cpp).

Verification reads every weight once for k+1 tokens, so what a quantized target
needs is few bytes per weight *and* a cost that stays flat as rows are added.
PyTorch's 4-bit CPU kernel dequantizes per row (5 rows cost 3x one row), so
this kernel unpacks each 64-byte block of nibbles once and feeds it to every
row with integer dot products (VNNI's vpdpbusd, or vpmaddubsw on AVX2 and
AVX-512, which cannot saturate on 4-bit x 8-bit products). The integer sums are
exact and the float part has a fixed order per output, so the result does not
depend on the row count (batch invariance by construction) nor on the
instruction set: every path, the scalar reference included, gives the same bits.

The weights are GGUF Q4_1-like: groups of 32 inputs, w ~= q * scale + min with
q in 0..15 and fp16 scale and min (5 bits per weight in all).

The kernel is compiled on first use (kernels/__init__.py) into the cache directory.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.models.cpu_features import effective_isa
from specdec.models.native import kernels

GROUP_SIZE = 32  # inputs per (scale, min): GGUF's Q4 block
BLOCK_OUTPUTS = 16  # outputs per packed block: one AVX-512 register of int32 sums

# The kernel's instruction-set paths (w4a8.cpp's Isa enum), and the oneDNN cap that selects each:
# the same ONEDNN_MAX_CPU_ISA that caps PyTorch's kernels caps this one, so one machine tests all.
ISA_PATHS = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512_vnni": 3}
_PATH_FOR_CAP = {"AVX2": "avx2", "AVX512_CORE": "avx512", "AVX512_CORE_VNNI": "avx512_vnni",
                 "AVX512_CORE_BF16": "avx512_vnni", "AVX512_CORE_AMX": "avx512_vnni"}


def isa_path() -> str:
    """The kernel path this process takes: the CPU's best, lowered to ONEDNN_MAX_CPU_ISA."""
    return _PATH_FOR_CAP.get(effective_isa() or "", "scalar")


def w4a8_available() -> str | None:
    """None where the w4a8 kernel runs here, else why not (for a clear error)."""
    return kernels.load()


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q uint8 [N, K] in 0..15, scales fp16 [N, K/32], mins fp16 [N, K/32]).

    Asymmetric round-to-nearest per group (GGUF's Q4_1): scale and min are rounded to
    fp16 first and q is computed against the rounded values, so q * scale + min is the
    weight the kernel really multiplies by.
    """
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15.0).clamp_min(2.0 ** -14).half()
    mins = low.half()
    q = torch.round((groups - mins.float()[..., None]) / scales.float()[..., None]).clamp(0, 15)
    return q.to(torch.uint8).reshape(out_features, in_features), scales, mins


def pack(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's layout (see w4a8.cpp): packed [N/16, K/32, 4, 64], scales and mins [N/16, K/32, 16]."""
    out_features, in_features = q.shape
    blocks, groups = out_features // BLOCK_OUTPUTS, in_features // GROUP_SIZE
    # k = 32 g + 8 c + 4 half + i  ->  [block, group, chunk, lane, i], low nibble half 0, high nibble half 1.
    q = q.reshape(blocks, BLOCK_OUTPUTS, groups, 4, 2, 4).permute(0, 2, 3, 1, 4, 5)
    packed = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(blocks, groups, 4, 64).contiguous()

    def per_block(values: torch.Tensor) -> torch.Tensor:
        return values.reshape(blocks, BLOCK_OUTPUTS, groups).transpose(1, 2).contiguous()

    return packed, per_block(scales), per_block(mins)


class W4A8Linear(nn.Module):
    """One projection in w4a8 (see the module docstring): exact and batch-invariant on every path.

    path: the instruction-set path this process runs (isa_path()); forward(x, isa) may run another
    (the tests compare them all)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        if (reason := w4a8_available()) is not None:
            raise ValueError(reason)
        self.out_features, self.in_features = weight.shape
        if self.in_features % GROUP_SIZE:
            raise ValueError(f"w4a8 needs in_features ({self.in_features}) divisible by {GROUP_SIZE}")
        padded = -self.out_features % BLOCK_OUTPUTS  # whole 16-output blocks; the extra outputs are sliced off
        # quantize_weight + pack in one C++ pass (the same bytes; tests compare them).
        packed, block_scales, block_mins = torch.ops.specdec_w4a8.quantize_pack(weight, self.out_features + padded)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", block_scales)
        self.register_buffer("mins", block_mins)
        self.register_buffer("bias", None if bias is None else nn.functional.pad(bias.float(), (0, padded)))
        self.dtype = dtype
        self.path = isa_path()

    def dequantized(self) -> torch.Tensor:  # [N, K], for tests and quality reports
        q_lo, q_hi = self.packed & 0x0F, self.packed >> 4  # [B, G, 4, 64]
        blocks, groups = self.packed.shape[:2]
        lanes = lambda t: t.reshape(blocks, groups, 4, BLOCK_OUTPUTS, 4)  # noqa: E731
        q = torch.stack([lanes(q_lo), lanes(q_hi)], dim=4)  # [B, G, c, lane, half, i]
        q = q.permute(0, 3, 1, 2, 4, 5).reshape(blocks * BLOCK_OUTPUTS, groups, GROUP_SIZE).float()
        per_output = lambda t: t.transpose(1, 2).reshape(-1, groups, 1).float()  # noqa: E731
        weight = q * per_output(self.scales) + per_output(self.mins)
        return weight.reshape(-1, self.in_features)[:self.out_features]

    def forward(self, x: torch.Tensor, isa: int | None = None) -> torch.Tensor:  # [..., K] -> [..., N]
        # The kernel reads bf16 or fp32 rows as they are and writes only the real outputs in self.dtype,
        # rounded as .to(self.dtype) would round its fp32 result: two copies a call fewer.
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.specdec_w4a8.linear(rows, self.packed, self.scales, self.mins, self.bias,
                                            ISA_PATHS[self.path] if isa is None else isa,
                                            self.out_features, self.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)
