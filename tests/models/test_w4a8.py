"""w4a8 (models/native/w4a8.py, kernels/w4a8.cpp): the packed layout, the integer law, and the same
bits on every instruction-set path and at every row count."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from specdec.models.cpu_features import cpu_flags
from specdec.models.native.linear import make_linear
from specdec.models.native.w4a8 import (GROUP_SIZE, ISA_PATHS, Quantized, W4A8Linear, isa_path, pack,
                                        quantize_weight)

FLAGS = cpu_flags()
PATHS_HERE = ["scalar"] + [name for name, needed in (("avx2", {"avx2", "fma", "f16c"}),
                                                     ("avx512", {"avx512f", "avx512bw", "avx512vl"}),
                                                     ("avx512_vnni", {"avx512f", "avx512bw", "avx512_vnni"}))
                           if needed <= FLAGS]


def w4a8_reference(linear: W4A8Linear, x: torch.Tensor) -> torch.Tensor:
    """The w4a8 law in float64: the dequantized 4-bit weights times per-row int8 activations."""
    x = x.double()
    row_scales = (x.abs().amax(1, keepdim=True).float().clamp_min(1e-12) / 127).double()
    xq = torch.round(x / row_scales)
    bias = 0 if linear.bias is None else linear.bias[:linear.out_features].double()
    return (xq @ linear.dequantized().double().T) * row_scales + bias


def test_packed_layout_matches_the_documented_example():
    """Byte lane*4+i of chunk c of group g in block b: low nibble q[16b+lane, 32g+8c+i], high 32g+8c+4+i;
    codes[b, g] = 16 scale codes then 16 min codes, supers[b, s] = 16 d then 16 dmin."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (32, 576), generator=generator, dtype=torch.uint8)  # 18 groups: 3 super-blocks
    scale_codes = torch.randint(1, 256, (32, 18), generator=generator, dtype=torch.uint8)
    min_codes = torch.randint(-128, 128, (32, 18), generator=generator, dtype=torch.int8)
    d, dmin = torch.rand(32, 3).half(), torch.rand(32, 3).half()
    packed, codes, supers = pack(Quantized(q, scale_codes, min_codes, d, dmin))
    assert packed.shape == (2, 18, 4, 64) and codes.shape == (2, 18, 32) and supers.shape == (2, 3, 32)
    for b, g, c, lane, i in [(0, 0, 0, 0, 0), (1, 17, 3, 15, 3), (1, 8, 2, 7, 1), (0, 9, 1, 9, 2)]:
        byte = int(packed[b, g, c, lane * 4 + i])
        assert byte & 0x0F == q[16 * b + lane, 32 * g + 8 * c + i]
        assert byte >> 4 == q[16 * b + lane, 32 * g + 8 * c + 4 + i]
    assert codes[1, 0, 5] == scale_codes[21, 0] and codes[0, 17, 16 + 15].view(torch.int8) == min_codes[15, 17]
    assert supers[1, 2, 3] == d[19, 2] and supers[0, 1, 16 + 4] == dmin[4, 1]


def test_quantized_weights_sit_on_16_levels_that_span_each_group():
    """Each group's 16 levels span it (up to its codes' rounding and search), every weight lands on a
    level, and the searched codes never leave more squared error than the nearest codes would."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 608, generator=generator) * torch.linspace(0.01, 3, 608)  # 19 groups: a partial super-block
    weight[7, 256:512] *= 1e-3  # a super-block of small weights: steps of its own
    linear = W4A8Linear(weight, None, torch.float32)
    quantized = quantize_weight(weight)
    scales, mins = quantized.group_scales_and_mins()
    groups = weight.reshape(48, 19, GROUP_SIZE)
    low, high = groups.amin(-1), groups.amax(-1)
    ideal = (high - low) / 15
    d, dmin = (steps.float().repeat_interleave(8, dim=1)[:, :19] for steps in quantized[3:])
    # d = the super-block's largest step / 255: the nearest scale code is within d / 2 (d where it
    # clamps to 1) of the step its rounded min needs, the search moves it by one code at most.
    assert ((scales - ideal).abs() <= 2 * d + dmin / 10 + 1e-7).all()
    assert ((scales - ideal).abs() <= 0.01 * ideal.amax(-1, keepdim=True)).all()
    assert ((mins - low).abs() <= 1.5 * dmin + 1e-7).all()
    dequantized = linear.dequantized().reshape(48, 19, GROUP_SIZE)
    levels = (dequantized - mins[..., None]) / scales[..., None]
    assert torch.allclose(levels, levels.round(), atol=1e-3) and levels.round().min() == 0 and levels.round().max() == 15
    nearest_mins = dmin * torch.round(low / dmin)
    nearest_scales = d * torch.round(((high - nearest_mins) / 15).clamp_min(0) / d).clamp(1, 255)
    nearest = (torch.round((groups - nearest_mins[..., None]) / nearest_scales[..., None]).clamp(0, 15)
               * nearest_scales[..., None] + nearest_mins[..., None])
    searched_error = ((dequantized - groups) ** 2).sum(-1)
    assert (searched_error <= ((nearest - groups) ** 2).sum(-1) * (1 + 1e-5)).all()
    assert (searched_error < ((nearest - groups) ** 2).sum(-1) * 0.999).float().mean() > 0.2  # the search pays
    assert quantized.q.max() <= 15 and (quantized.q == 15).any() and (quantized.q == 0).any()


def test_w4a8_loses_less_than_the_fp16_scale_per_group_format():
    """The 8-bit codes with their search against the earlier format (fp16 scale and min per group
    of 32, 5 bits per weight, min/max rounding): less squared error in 7.5% fewer bytes."""
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(64, 1536, generator=generator) * 0.02 * (1 + torch.rand(1536, generator=generator))
    groups = weight.reshape(64, -1, GROUP_SIZE)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale, minimum = ((high - low) / 15).half().float(), low.half().float()
    fp16_format = torch.round((groups - minimum) / scale).clamp(0, 15) * scale + minimum
    ours = W4A8Linear(weight, None, torch.float32).dequantized().reshape(groups.shape)
    ratio = ((ours - groups) ** 2).mean() / ((fp16_format - groups) ** 2).mean()
    assert ratio < 0.97, ratio


@pytest.mark.parametrize("inputs", [96, 608])  # one partial super-block; 19 groups: two whole and a partial one
def test_w4a8_is_its_integer_law_on_every_path_with_the_same_bits(inputs):
    generator = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(200, inputs, generator=generator), torch.randn(200, generator=generator)  # 200: padded
    x = torch.randn(21, inputs, generator=generator) * torch.linspace(0.01, 30, inputs)  # outlier channels, as in LLMs
    linear = W4A8Linear(weight, bias, torch.float32)
    outputs = {name: linear(x, ISA_PATHS[name]) for name in PATHS_HERE}
    reference = outputs["scalar"]
    assert reference.shape == (21, 200)
    torch.testing.assert_close(reference.double(), w4a8_reference(linear, x), atol=1e-3, rtol=1e-5)
    for name, out in outputs.items():
        assert torch.equal(out, reference), name  # exact integers, one float order: identical bits


def test_subnormal_steps_and_every_code_give_the_same_bits_on_every_path():
    """Tiny weights (fp16 steps below 2^-14, widened by F16C and by the scalar path alike), and codes
    at their bounds (scale code 1 and 255, min code -128 and 127)."""
    generator = torch.Generator().manual_seed(13)
    weight = torch.randn(32, 320, generator=generator) * 1e-6
    linear = W4A8Linear(weight, None, torch.float32)
    assert (linear.supers.float().abs() < 2.0 ** -14).any()
    x = torch.randn(5, 320, generator=generator)
    codes = torch.randint(0, 256, linear.codes.shape, generator=generator, dtype=torch.uint8)
    codes[0, 0, :2], codes[0, 0, 16:18] = torch.tensor([1, 255]), torch.tensor([-128, 127]).to(torch.int8).view(torch.uint8)
    codes[..., :16] = codes[..., :16].clamp_min(1)
    for candidate in (linear.codes.clone(), codes):
        linear.codes.copy_(candidate)
        reference = linear(x, ISA_PATHS["scalar"])
        torch.testing.assert_close(reference.double(), w4a8_reference(linear, x), atol=1e-9, rtol=1e-5)
        for name in PATHS_HERE:
            assert torch.equal(linear(x, ISA_PATHS[name]), reference), name


def test_activation_ties_and_zero_rows_quantize_alike_on_every_path():
    """Row scale 1 (max |x| = 127): x / s lands exactly on halves, which round to even on every
    path (the vector quantizer's roundscale as the scalar nearbyint); an all-zero row as well."""
    halves = torch.arange(-63, 64, dtype=torch.float32)[:96] + 0.5  # -62.5 .. 32.5
    ties = torch.cat([torch.tensor([127.0]), halves[:95]])
    x = torch.stack([ties, -ties, torch.zeros(96), ties.flip(0)])
    linear = W4A8Linear(torch.randn(32, 96, generator=torch.Generator().manual_seed(8)), None, torch.float32)
    reference = linear(x, ISA_PATHS["scalar"])
    torch.testing.assert_close(reference.double(), w4a8_reference(linear, x), atol=1e-3, rtol=1e-5)
    assert torch.equal(reference[2], torch.zeros(32))
    for name in PATHS_HERE:
        assert torch.equal(linear(x, ISA_PATHS[name]), reference), name


@pytest.mark.parametrize("sign", [1, -1])
def test_the_largest_group_sums_stay_exact_on_every_path(sign):
    """Every weight at q = 15 and every activation at +-127: a group's sum is 32 * 15 * 127 = 60960,
    past int16, with the AVX2 path's int16 partial sums at their bound (8 pair sums of 3810 = 30480)."""
    q = torch.full((16, 64), 15, dtype=torch.uint8)
    linear = W4A8Linear(torch.randn(16, 64), None, torch.float32)
    packed, codes, supers = pack(Quantized(q, torch.ones(16, 2, dtype=torch.uint8), torch.zeros(16, 2, dtype=torch.int8),
                                           torch.ones(16, 1).half(), torch.ones(16, 1).half()))
    linear.packed.copy_(packed)
    linear.codes.copy_(codes)
    linear.supers.copy_(supers)
    x = torch.full((3, 64), 127.0 * sign)  # row scale 1: xq = +-127
    for name in PATHS_HERE:
        assert torch.equal(linear(x, ISA_PATHS[name]), torch.full((3, 16), 2 * 60960.0 * sign)), name


@pytest.mark.parametrize("path", PATHS_HERE)
def test_a_row_gives_the_same_bits_whatever_shares_its_call(path):
    """Batch invariance by construction: 1..21 rows, every tile size and remainder of every path
    (7 blocks of 16 outputs: tiles of 4, 2 and 1 blocks, however the threads split them), with the
    weights unpacked once per call (over 5 rows) or per tile (5 rows or fewer), over three super-blocks."""
    generator = torch.Generator().manual_seed(4)
    linear = W4A8Linear(torch.randn(112, 608, generator=generator), None, torch.float32)
    x = torch.randn(21, 608, generator=generator)
    together = linear(x, ISA_PATHS[path])
    for rows in range(1, 22):
        assert torch.equal(linear(x[:rows], ISA_PATHS[path]), together[:rows]), rows
    for row in range(21):
        assert torch.equal(linear(x[row:row + 1], ISA_PATHS[path]), together[row:row + 1]), row


def test_real_shapes_on_the_fast_path_match_the_reference_path():
    """The 1.5B target's gate/up shape: the path in force gives the scalar reference's bits at 1, 9, 16 rows."""
    generator = torch.Generator().manual_seed(5)
    linear = W4A8Linear(torch.randn(2048, 1536, generator=generator) * 0.02, None, torch.bfloat16)
    x = torch.randn(16, 1536, generator=generator).bfloat16()
    fast = linear(x)
    assert fast.dtype == torch.bfloat16
    assert torch.equal(fast, linear(x, ISA_PATHS["scalar"]))
    assert torch.equal(linear(x[:1]), fast[:1]) and torch.equal(linear(x[:9]), fast[:9])


def test_w4a8_refuses_cuda_and_shapes_it_cannot_pack():
    with pytest.raises(ValueError, match="CPU"):
        make_linear(torch.randn(16, 32), None, dtype=torch.float32, device=torch.device("cuda"), quantize="w4a8")
    with pytest.raises(ValueError, match="divisible by 32"):
        make_linear(torch.randn(16, 48), None, dtype=torch.float32, device=torch.device("cpu"), quantize="w4a8")
    linear = W4A8Linear(torch.randn(16, 32), None, torch.float32)
    with pytest.raises(RuntimeError, match="x has 64 inputs"):
        torch.ops.specdec_w4a8.linear(torch.randn(2, 64), linear.packed, linear.codes, linear.supers, None, 0)


def test_the_kernel_path_follows_the_onednn_cap():
    """ONEDNN_MAX_CPU_ISA caps specdec's kernel as it caps PyTorch's, so one machine runs every path."""
    assert isa_path() in ISA_PATHS
    script = "from specdec.models.native.w4a8 import isa_path; print(isa_path())"
    expected = {"AVX2": "avx2", "AVX512_CORE": "avx512", "AVX512_CORE_VNNI": "avx512_vnni"}
    for cap, path in expected.items():
        if path not in PATHS_HERE:
            continue
        result = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, ONEDNN_MAX_CPU_ISA=cap),
                                capture_output=True, text=True, timeout=120)
        assert result.stdout.strip() == path, result.stdout + result.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_packs_the_same_bytes_as_the_python_reference(dtype):
    """W4A8Linear packs in C++ (quantize_pack); quantize_weight + pack are the documented law."""
    generator = torch.Generator().manual_seed(6)
    weight = (torch.randn(40, 608, generator=generator) * torch.linspace(0.001, 4, 608)).to(dtype)  # 40: padded
    weight[3, :32] = 0.5  # a constant group
    weight[4, :256] = -0.25  # a super-block of constant groups: the smallest steps
    weight[5, :32] = torch.tensor([0.0, 15.0] + [i + 0.5 for i in range(15)] + [7.0] * 15)  # ties
    weight[6, 512:] = 1e-7  # the partial last super-block, tiny: subnormal fp16 steps
    linear = W4A8Linear(weight, None, torch.float32)
    padded = torch.nn.functional.pad(weight.float(), (0, 0, 0, 8))
    packed, codes, supers = pack(quantize_weight(padded))
    assert torch.equal(linear.packed, packed)
    assert torch.equal(linear.codes, codes) and torch.equal(linear.supers, supers)
    assert torch.equal(linear.unpacked().q, quantize_weight(padded).q)


@pytest.mark.parametrize("path", PATHS_HERE)
def test_the_kernel_reads_bf16_and_writes_bf16_as_the_fp32_call_rounded_by_torch(path):
    """W4A8Linear hands the kernel bf16 rows as they are and takes bf16 out of its store, only the
    real outputs (here 200 of 13 blocks): the bits of .float() -> fp32 kernel -> slice -> .to(bfloat16)."""
    generator = torch.Generator().manual_seed(12)
    linear = W4A8Linear(torch.randn(200, 96, generator=generator), torch.randn(200, generator=generator),
                        torch.bfloat16)
    x = (torch.randn(9, 96, generator=generator) * torch.linspace(0.01, 30, 96)).bfloat16()
    fp32 = torch.ops.specdec_w4a8.linear(x.float(), linear.packed, linear.codes, linear.supers, linear.bias,
                                         ISA_PATHS[path])
    assert fp32.shape == (9, 208)
    out = linear(x, ISA_PATHS[path])
    assert out.dtype == torch.bfloat16 and out.shape == (9, 200)
    assert torch.equal(out.view(torch.int16), fp32[:, :200].to(torch.bfloat16).view(torch.int16))
    bf16_in = torch.ops.specdec_w4a8.linear(x, linear.packed, linear.codes, linear.supers, linear.bias, ISA_PATHS[path])
    assert torch.equal(bf16_in, fp32)
