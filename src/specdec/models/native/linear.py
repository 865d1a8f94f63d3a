"""Weight formats for the native decoder's projections: dense, int8 and int4 weight-only, w8a8, w4a8.

Decoding one token reads every weight once, so on a CPU its time is the bytes
of weights over the memory bandwidth (Leviathan et al. 2022, section 3.4, for
why verification of k+1 tokens then costs about the same as one). Fewer bytes
per weight is the lever: bf16 halves fp32, int8 halves bf16, int4 halves int8.
Activations stay in the compute dtype (weight-only quantization), using
PyTorch's own CPU kernels: `_weight_int8pack_mm` (per-output-channel scales,
as in gpt-fast) and `_weight_int4pack_mm_for_cpu` (group-wise asymmetric
scales, the "tinygemm" layout of torchao).

Weight-only kernels dequantize per row of activations, so their cost grows
with every row (verifying k+1 tokens costs nearly k+1 steps). "w8a8"
quantizes the activations too and multiplies in integers (oneDNN's VNNI/AMX
kernels, the path of PyTorch's x86 inductor quantization): nine rows cost little
more than one, and exact integer sums need no care for batch invariance. Both per
projection: docs/history.md, "Against llama.cpp on the same CPU: w8a8 targets,
the draft's prefill, peers.py (issue 19, first part)". "w4a8" (w4a8.py) does the same
with 4-bit weights on specdec's own kernel, exact on every x86 path.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.models.cpu_features import effective_isa, int8_dot_exact, onednn_bf16_usable
from specdec.models.native import kernels

QUANTIZATIONS = ("none", "int8", "int4", "w8a8", "w4a8")
INT4_GROUP_SIZE = 32  # the GGUF Q4 block size the embedded models were quantized with
W8A8_VNNI_PATH = 3  # kernels/w8a8.cpp's VNNI path (0: its scalar reference, the same bits)


# oneDNN's bf16 matmul changes kernels at 33 rows where AMX is in force: 33..64 rows of a projection
# rounded unlike each row alone, 1..32 alike; the other caps, and fp32, round alike at any count
# (benchmarks/RESULTS.md, "bf16 on AMX: oneDNN changes kernels at 33 rows").
AMX_BF16_ROW_BLOCK = 32


def row_block_for(dtype: torch.dtype) -> int | None:
    """The most rows one CPU matmul call may take and still round every row alike (None: any)."""
    return AMX_BF16_ROW_BLOCK if dtype == torch.bfloat16 and effective_isa() == "AVX512_CORE_AMX" else None


def batch_invariant(x: torch.Tensor, out_features: int, project, row_block: int | None = None) -> torch.Tensor:
    """project(rows) with a single row fed twice, so one row rounds exactly like several, and in
    calls of at most row_block rows (row_block_for), so no call takes the kernel of larger ones.

    BLAS and oneDNN take a gemv path for one row whose rounding differs (by an
    ulp) from their multi-row path, and bf16 grows that into different greedy
    tokens: plain decoding would not be bit-identical to verification of the same
    positions. Two copies of the row cost the same as one on a memory-bound step.
    """
    rows = x.reshape(-1, x.shape[-1])
    if row_block is not None:  # blocks of at most row_block rows, each as below
        return in_row_blocks(x, out_features, row_block, lambda part: batch_invariant(part, out_features, project))
    single = rows.shape[0] == 1
    out = project(rows.expand(2, -1) if single else rows)
    return (out[:1] if single else out).reshape(*x.shape[:-1], out_features)


def in_row_blocks(x: torch.Tensor, out_features: int, block: int | None, project) -> torch.Tensor:
    """project(rows) called on each block of `block` rows alone (all rows at once where block is None)."""
    rows = x.reshape(-1, x.shape[-1])
    if block is None or rows.shape[0] <= block:
        return project(rows).reshape(*x.shape[:-1], out_features)
    return torch.cat([project(part) for part in rows.split(block)]).reshape(*x.shape[:-1], out_features)


class DenseLinear(nn.Module):
    """F.linear on the weight as loaded; batch-invariant on CPUs (batch_invariant) and, on a GPU,
    when row_block is set: each block of row_block rows in a call of its own.

    cuBLAS chooses its GEMM kernel by row count, and kernels round differently: on an H100
    (benchmarks/cuda_check.py) the 8960 -> 1536 down projection gave other bf16 values for
    64 rows in a call of 128 than in a call of 64. A fixed-step runner (NativeRunner.step_tokens)
    calls with step x rows-of-the-batch rows; row_block = step makes every GEMM a 64-row one, so
    a request's logits do not depend on how many others share the step. The price is one weight
    read per row of the batch, which a launch-bound step on a GPU does not feel.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:  # [N, K], [N]
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.row_block: int | None = None
        self.cpu_row_block = row_block_for(weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if x.device.type == "cpu":
            return batch_invariant(x, self.weight.shape[0], lambda rows: nn.functional.linear(rows, self.weight,
                                                                                               self.bias),
                                   self.cpu_row_block)
        return in_row_blocks(x, self.weight.shape[0], self.row_block,
                             lambda rows: nn.functional.linear(rows, self.weight, self.bias))


PACKED_ROWS_HINT = 9  # oneDNN picks the packed layout for this many rows: k=8 verification


def can_pack_for_cpu(device: torch.device, dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16 and not onednn_bf16_usable():
        return False  # oneDNN's bf16 reorder needs AVX-512 (or a cap that allows it); F.linear still works
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """fp32 or bf16 weights reordered once into oneDNN's blocked layout (what inductor's CPU backend does).

    On a 2-core AVX512-BF16 EPYC it costs less than F.linear on the same bf16 weight,
    which reorders it on every call, and about the same from 1 to 9 rows (the 17920 x 1536
    gate/up matrix, `python benchmarks/native_kernels.py`; docs/history.md, "Against
    llama.cpp on the same CPU: w8a8 targets, the draft's prefill, peers.py (issue 19, first
    part)"). A flat cost from 1 to 9 rows is what makes verifying k drafts nearly free.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_ROWS_HINT)
        self.register_buffer("bias", bias)
        self.row_block = row_block_for(weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Batch invariance (see batch_invariant): oneDNN's 1-row path rounds unlike its 2..9-row
        # path, and two rows cost the same as one here (see the table above).
        return batch_invariant(x, self.out_features, lambda rows: torch.ops.mkldnn._linear_pointwise(
            rows, self.packed_weight, self.bias, "none", [], ""), self.row_block)


class Int8Linear(nn.Module):
    """w[n, :] ~= weight_int8[n, :] * scales[n]: symmetric, one scale per output channel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        weight = weight.float()
        scales = weight.abs().amax(dim=1).clamp_min(1e-8) / 127.0  # [N]
        self.register_buffer("weight_int8", torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        self.out_features, self.in_features = weight.shape

    def dequantized(self) -> torch.Tensor:  # [N, K], for tests and quality reports
        return self.weight_int8.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch._weight_int8pack_mm(rows, self.weight_int8, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    """Group-wise asymmetric 4-bit: w ~= (q - 8) * scale + zero, one (scale, zero) per group of K.

    The layout torch._weight_int4pack_mm_for_cpu expects (torchao's tinygemm
    convention); it needs bf16 activations and K divisible by the group size.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int = INT4_GROUP_SIZE) -> None:
        super().__init__()
        out_features, in_features = weight.shape
        if in_features % group_size:
            raise ValueError(f"int4 needs in_features ({in_features}) divisible by the group size {group_size}")
        groups = weight.float().reshape(out_features, in_features // group_size, group_size)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [N, G]
        scales = ((high - low) / 15.0).clamp_min(1e-8)
        zeros = low + scales * 8.0
        q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
        q = q.reshape(out_features, in_features)
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q, 1))
        # [G, N, 2]: per group and output channel, (scale, zero).
        self.register_buffer("scales_and_zeros", torch.stack([scales, zeros], dim=-1).transpose(0, 1)
                             .contiguous().to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.to(torch.bfloat16))
        self.group_size = group_size
        self.out_features, self.in_features = out_features, in_features

    def dequantized(self) -> torch.Tensor:  # [N, K]
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return self.forward(eye).float().T.contiguous() - (0 if self.bias is None else self.bias.float()[:, None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class W8A8Linear(nn.Module):
    """int8 weights (symmetric, one scale per output channel) times int8 activations (one scale per
    row, computed on the fly), accumulated exactly in int32.

    y[m, n] = row_scale[m] * scale[n] * sum_k xq[m, k] * wq[n, k], with xq = round(x / row_scale)
    in [-127, 127] (SmoothQuant's per-token dynamic activations, Xiao et al. 2023, arXiv
    2211.10438, without the smoothing).

    Two kernels give the same bits on VNNI CPUs (tests compare them): specdec's own (kernels/w8a8.cpp),
    used wherever it compiles, and oneDNN's qlinear otherwise, with the activations as u8 and
    zero point 128 (its s8 x s8 path is a reference loop, orders of magnitude slower). Ours
    streams the w4a8 target's output head, the largest matrix a step reads, faster than
    oneDNN's qlinear on a 2-core Zen 4 (`python benchmarks/native_kernels.py --head`;
    docs/history.md, "Faster CPU steps with the same bits: w4a8 tiles, the output head,
    activation quantization (issues 20 and 21)").

    Batch invariance by construction: an integer sum has no rounding, so its order (the kernel,
    the row count) cannot change it; what is rounded (the row scale, the two products) is
    elementwise. Needs VNNI or AMX (cpu_features.int8_dot_exact): older paths saturate.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 kernel: str = "auto") -> None:
        """kernel: "specdec" (kernels/w8a8.cpp), "onednn", or "auto" = specdec's where it compiles."""
        super().__init__()
        if kernel not in ("auto", "specdec", "onednn"):
            raise ValueError(f"kernel must be auto, specdec or onednn, got {kernel!r}")
        weight = weight.float()
        self.out_features, self.in_features = weight.shape
        scales = weight.abs().amax(dim=1).clamp_min(1e-8) / 127.0  # [N]
        weight_int8 = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)  # [N, K]
        self.register_buffer("bias", None if bias is None else bias.float())
        self.dtype = dtype
        reason = kernels.load() if kernel != "onednn" else "not asked for"  # compiles on first use
        if kernel == "specdec" and (reason is not None or self.in_features % 4):
            raise ValueError(f"specdec's w8a8 kernel cannot run here: {reason or 'in_features must be a multiple of 4'}")
        self.own_kernel = reason is None and self.in_features % 4 == 0
        # VNNI where it runs (make_linear builds w8a8 only there); the scalar reference otherwise.
        self.kernel_path = W8A8_VNNI_PATH if int8_dot_exact() else 0
        if self.own_kernel:  # whole 16-output blocks; the extra outputs are sliced off
            padded = self.out_features + (-self.out_features % 16)
            packed, weight_sums = torch.ops.specdec_w8a8.pack(weight_int8, padded)
            self.register_buffer("packed_weight", packed)
            self.register_buffer("weight_sums", weight_sums)
            self.register_buffer("scales", nn.functional.pad(scales, (0, padded - self.out_features)))
            if self.bias is not None:
                self.bias = nn.functional.pad(self.bias, (0, padded - self.out_features))
        else:
            self.register_buffer("packed_weight", torch.ops.onednn.qlinear_prepack(
                weight_int8, [PACKED_ROWS_HINT, self.in_features]))
            self.register_buffer("scales", scales)
            self.register_buffer("zero_points", torch.zeros(self.out_features, dtype=torch.long))

    def dequantized(self) -> torch.Tensor:  # [N, K], for tests: a one-hot row quantizes exactly
        return self._scaled_sums(torch.eye(self.in_features)).T

    def _scaled_sums(self, rows: torch.Tensor, *, bias: bool = False) -> torch.Tensor:  # [M, K] fp32 -> [M, N] fp32
        if self.own_kernel:
            out = torch.ops.specdec_w8a8.linear(rows, self.packed_weight, self.weight_sums, self.scales,
                                                self.bias if bias else None, self.kernel_path)
            return out[:, :self.out_features] if out.shape[1] != self.out_features else out
        row_scales = rows.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127.0  # [M, 1]
        unsigned = torch.round(rows / row_scales).add_(128.0).to(torch.uint8)  # [M, K], zero point 128
        sums = torch.ops.onednn.qlinear_pointwise(unsigned, 1.0, 128, self.packed_weight, self.scales,
                                                  self.zero_points, None, 1.0, 0, torch.float32, "none", [], "")
        out = sums * row_scales
        return out + self.bias if bias and self.bias is not None else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        out = self._scaled_sums(x.reshape(-1, self.in_features).float(), bias=True)
        return out.to(self.dtype).reshape(*x.shape[:-1], self.out_features)


def w8a8_available() -> str | None:
    """None where w8a8 runs exactly here, else why not (for a clear error)."""
    if not hasattr(torch.ops.onednn, "qlinear_pointwise"):
        return "this PyTorch build has no oneDNN quantized linear (torch.ops.onednn.qlinear_pointwise)"
    if not int8_dot_exact():
        return ("w8a8 needs a CPU with AVX512-VNNI or AMX (not capped below it by "
                "ONEDNN_MAX_CPU_ISA): older int8 paths saturate. Use --quantize int8 or int4 here")
    return None


def head_quantization(quantize: str) -> str:
    """The output head's format for a model whose projections are in `quantize`.

    A 4-bit output head costs more quality than any other 4-bit matrix (GGUF's Q4_K_M keeps
    it in 6 bits), so w4a8 models keep theirs in w8a8 where that runs exactly (VNNI/AMX).
    """
    if quantize == "w4a8" and w8a8_available() is None:
        return "w8a8"
    return quantize


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, *, dtype: torch.dtype, device: torch.device,
                quantize: str = "none") -> nn.Module:
    """One projection [N, K] in the requested format, on `device`."""
    if quantize == "int8":
        return Int8Linear(weight.to(device), None if bias is None else bias.to(device), dtype)
    if quantize == "w8a8":
        if device.type != "cpu":
            raise ValueError("w8a8 uses oneDNN's CPU kernels; on CUDA use --quantize none or int8")
        if (reason := w8a8_available()) is not None:
            raise ValueError(reason)
        return W8A8Linear(weight, bias, dtype)
    if quantize == "w4a8":
        if device.type != "cpu":
            raise ValueError("w4a8 is specdec's CPU kernel; on CUDA use --quantize none or int8")
        from specdec.models.native.w4a8 import W4A8Linear  # compiles the kernel on first use

        return W4A8Linear(weight, bias, dtype)
    if quantize == "int4":
        if device.type != "cpu":
            raise ValueError("int4 weights use PyTorch's CPU kernel; on CUDA use --quantize none or int8")
        return Int4Linear(weight, bias)
    if quantize != "none":
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZATIONS)}, got {quantize!r}")
    weight = weight.to(device=device, dtype=dtype)
    bias = None if bias is None else bias.to(device=device, dtype=dtype)
    return PackedLinear(weight, bias) if can_pack_for_cpu(device, dtype) else DenseLinear(weight, bias)
