"""w4a8: 4-bit weights times per-row int8 activations, on specdec's own CPU kernel (kernels/w4a8.cpp).

Verification reads every weight once for k+1 tokens, so what a quantized target
needs is few bytes per weight *and* a cost that stays flat as rows are added.
PyTorch's 4-bit CPU kernel dequantizes per row (5 rows cost several times one row:
docs/history.md, "4-bit targets on specdec's own kernel, attention in one call: w4a8
(issue 19, second part)"), so this kernel unpacks each 64-byte block of nibbles once and
feeds it to every row with integer dot products (VNNI's vpdpbusd, or vpmaddubsw on AVX2 and
AVX-512, which cannot saturate on 4-bit x 8-bit products). The integer sums are
exact and the float part has a fixed order per output, so the result does not
depend on the row count (batch invariance by construction) nor on the
instruction set: every path, the scalar reference included, gives the same bits.

The weights are GGUF Q4_K-like: groups of 32 inputs, w ~= q * scale + min with q in 0..15,
where scale = d * sc and min = dmin * mn; sc and mn are 8-bit codes per group, d and dmin fp16 per
super-block of 8 groups (256 inputs). 4.625 bits per weight: 7.5% fewer bytes than fp16 scale and min
per group (GGUF's Q4_1, 5 bits, this module's earlier format), which a memory-bound step reads as
time. Each group's codes are the best of their 9 neighbours by squared error: the embedded models
came as GGUF Q4_K_M, and the search finds the grids they were quantized on (less weight error than
the old format on the 1.5B target: benchmarks/RESULTS.md, "w4a8 weights in Q4_K-style codes: fewer
bytes, less error (issues 20 and 21, step cost)").

The kernel is compiled on first use (kernels/__init__.py) into the cache directory.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
from torch import nn

from specdec.models.cpu_features import effective_isa
from specdec.models.native import kernels

GROUP_SIZE = 32  # inputs per (scale, min) code pair: GGUF's Q4 block
SUPER_GROUPS = 8  # groups per (d, dmin) super-block: 256 inputs, as GGUF's Q4_K
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


class Quantized(NamedTuple):
    """A [N, K] weight in w4a8's codes: w ~= q * (d * sc) + dmin * mn, per group of 32 (sc, mn) and
    per super-block of 8 groups (d, dmin)."""

    q: torch.Tensor  # uint8 [N, K], 0..15
    scale_codes: torch.Tensor  # uint8 [N, K/32], 1..255
    min_codes: torch.Tensor  # int8 [N, K/32]
    scale_steps: torch.Tensor  # fp16 [N, S], S = ceil(K/256): d
    min_steps: torch.Tensor  # fp16 [N, S]: dmin

    def group_scales_and_mins(self) -> tuple[torch.Tensor, torch.Tensor]:  # fp32 [N, K/32] each, exact
        groups = self.scale_codes.shape[1]
        return (_per_group(self.scale_steps, groups) * self.scale_codes.float(),
                _per_group(self.min_steps, groups) * self.min_codes.float())


def _per_group(steps: torch.Tensor, groups: int) -> torch.Tensor:  # fp16 [N, S] -> fp32 [N, G]: each group's step
    return steps.float().repeat_interleave(SUPER_GROUPS, dim=1)[:, :groups]


def _group_error(diff: torch.Tensor) -> torch.Tensor:  # [N, G, 32] -> [N, G], in group_error's (w4a8.cpp) order
    err = diff * diff
    partial = err[..., :GROUP_SIZE // 2] + err[..., GROUP_SIZE // 2:]
    total = partial[..., 0]
    for lane in range(1, GROUP_SIZE // 2):
        total = total + partial[..., lane]
    return total


def quantize_weight(weight: torch.Tensor) -> Quantized:
    """[N, K] float -> w4a8's codes, by kernels/w4a8.cpp's quantize_pack law (which gives the same bytes):

    per group (32 inputs): low, high = min, max; per super-block (8 groups) dmin = fp16(max |low| / 127);
    mn = round(low / dmin), min = dmin * mn; need = (high - min) / 15; per super-block d = fp16(max need / 255);
    sc = round(need / d) in 1..255; then per group the codes (sc + i, mn + j), i, j in (0, -1, 1), whose
    levels q = round((w - min) / scale) in 0..15 (scale = d * sc, min = dmin * mn) leave the smallest
    squared error. Each rounding is to the nearest (half to even) against the rounded values before
    it, so q * scale + min is the weight the kernel really multiplies by.
    """
    out_features, in_features = weight.shape
    groups = in_features // GROUP_SIZE
    supers = -(-groups // SUPER_GROUPS)
    values = weight.float().reshape(out_features, groups, GROUP_SIZE)
    low, high = values.amin(dim=-1), values.amax(dim=-1)

    def largest_per_super(per_group: torch.Tensor) -> torch.Tensor:  # [N, G] >= 0 -> [N, S]
        padded = nn.functional.pad(per_group, (0, supers * SUPER_GROUPS - groups))
        return padded.reshape(out_features, supers, SUPER_GROUPS).amax(dim=-1)

    min_steps = (largest_per_super(low.abs()) / 127.0).clamp_min(2.0 ** -24).half()
    group_min_step = _per_group(min_steps, groups)
    nearest_mn = torch.round(low / group_min_step).clamp(-128, 127)
    need = ((high - group_min_step * nearest_mn) / 15.0).clamp_min(0.0)
    scale_steps = (largest_per_super(need) / 255.0).clamp_min(2.0 ** -24).half()
    group_scale_step = _per_group(scale_steps, groups)
    nearest_sc = torch.round(need / group_scale_step).clamp(1, 255)
    best = None
    for scale_shift, min_shift in itertools.product((0, -1, 1), repeat=2):
        scale_codes = (nearest_sc + scale_shift).clamp(1, 255)
        min_codes = (nearest_mn + min_shift).clamp(-128, 127)
        scales = (group_scale_step * scale_codes)[..., None]
        mins = (group_min_step * min_codes)[..., None]
        q = torch.round((values - mins) / scales).clamp(0, 15)
        error = _group_error(values - (q * scales + mins))
        if best is None:
            best = (error, q, scale_codes, min_codes)
        else:
            better = error < best[0]  # the first of equals stays
            best = (torch.where(better, error, best[0]), torch.where(better[..., None], q, best[1]),
                    torch.where(better, scale_codes, best[2]), torch.where(better, min_codes, best[3]))
    _, q, scale_codes, min_codes = best
    return Quantized(q.to(torch.uint8).reshape(out_features, in_features), scale_codes.to(torch.uint8),
                     min_codes.to(torch.int8), scale_steps, min_steps)


def pack(quantized: Quantized) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's layout (see w4a8.cpp): packed [N/16, K/32, 4, 64]; codes uint8 [N/16, K/32, 32]
    (16 scale codes, then 16 min codes' int8 bits); supers fp16 [N/16, S, 32] (16 d, then 16 dmin)."""
    q = quantized.q
    out_features, in_features = q.shape
    blocks, groups = out_features // BLOCK_OUTPUTS, in_features // GROUP_SIZE
    # k = 32 g + 8 c + 4 half + i  ->  [block, group, chunk, lane, i], low nibble half 0, high nibble half 1.
    q = q.reshape(blocks, BLOCK_OUTPUTS, groups, 4, 2, 4).permute(0, 2, 3, 1, 4, 5)
    packed = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(blocks, groups, 4, 64).contiguous()

    def per_block(scale_part: torch.Tensor, min_part: torch.Tensor) -> torch.Tensor:  # [N, X] twice -> [N/16, X, 32]
        both = torch.stack([scale_part, min_part], dim=1)  # [N, 2, X]
        return both.reshape(blocks, BLOCK_OUTPUTS, 2, -1).permute(0, 3, 2, 1).reshape(blocks, -1, 2 * BLOCK_OUTPUTS)

    codes = per_block(quantized.scale_codes, quantized.min_codes.view(torch.uint8)).contiguous()
    supers = per_block(quantized.scale_steps, quantized.min_steps).contiguous()
    return packed, codes, supers


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
        packed, codes, supers = torch.ops.specdec_w4a8.quantize_pack(weight, self.out_features + padded)
        self.register_buffer("packed", packed)
        self.register_buffer("codes", codes)
        self.register_buffer("supers", supers)
        self.register_buffer("bias", None if bias is None else nn.functional.pad(bias.float(), (0, padded)))
        self.dtype = dtype
        self.path = isa_path()

    def unpacked(self) -> Quantized:  # pack's inverse, over the padded outputs
        q_lo, q_hi = self.packed & 0x0F, self.packed >> 4  # [B, G, 4, 64]
        blocks, groups = self.packed.shape[:2]
        lanes = lambda t: t.reshape(blocks, groups, 4, BLOCK_OUTPUTS, 4)  # noqa: E731
        q = torch.stack([lanes(q_lo), lanes(q_hi)], dim=4)  # [B, G, c, lane, half, i]
        q = q.permute(0, 3, 1, 2, 4, 5).reshape(blocks * BLOCK_OUTPUTS, groups * GROUP_SIZE)

        def per_output(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [B, X, 32] -> 2 x [N, X]
            both = codes.reshape(blocks, -1, 2, BLOCK_OUTPUTS).permute(2, 0, 3, 1)
            return both[0].reshape(blocks * BLOCK_OUTPUTS, -1), both[1].reshape(blocks * BLOCK_OUTPUTS, -1)

        scale_codes, min_codes = per_output(self.codes)
        scale_steps, min_steps = per_output(self.supers)
        return Quantized(q, scale_codes, min_codes.view(torch.int8), scale_steps, min_steps)

    def dequantized(self) -> torch.Tensor:  # [N, K], for tests and quality reports
        quantized = self.unpacked()
        scales, mins = quantized.group_scales_and_mins()
        q = quantized.q.float().reshape(scales.shape[0], -1, GROUP_SIZE)
        weight = q * scales[..., None] + mins[..., None]
        return weight.reshape(-1, self.in_features)[:self.out_features]

    def forward(self, x: torch.Tensor, isa: int | None = None) -> torch.Tensor:  # [..., K] -> [..., N]
        # The kernel reads bf16 or fp32 rows as they are and writes only the real outputs in self.dtype,
        # rounded as .to(self.dtype) would round its fp32 result: two copies a call fewer.
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.specdec_w4a8.linear(rows, self.packed, self.codes, self.supers, self.bias,
                                            ISA_PATHS[self.path] if isa is None else isa,
                                            self.out_features, self.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)
