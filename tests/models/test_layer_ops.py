"""kernels/layer_ops.cpp: RMSNorm and the q/k/v split with RoPE in one call each, against model.py's
PyTorch forms (the fallback where the kernels cannot be built), and row by row (batch invariance)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import make_model, make_native, results_under_caps, vector_path_caps
from specdec.models.native import kernels
from specdec.models.native.model import Rotary, rotate_half

pytestmark = pytest.mark.skipif(kernels.load() is not None, reason=f"no kernels here: {kernels.load()}")
DTYPES = [torch.float32, torch.bfloat16]


def rms_norm_in_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_rope_is_the_pytorch_ops_bit_for_bit(dtype):
    """Qwen2.5-1.5B's heads (12 query, 2 key/value, 128 dims), 2 rows x 5 tokens at scattered positions."""
    heads, kv_heads, dim, batch, steps = 12, 2, 128, 2, 5
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(batch, steps, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    cos, sin = Rotary(dim, 1e6, torch.device("cpu"))(torch.arange(batch * steps).reshape(batch, steps) * 37, dtype)
    query, key, value = torch.ops.specdec_layer.split_rope(qkv, cos, sin, heads, kv_heads, dim)

    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q = q.view(batch, steps, heads, dim).transpose(1, 2)
    k = k.view(batch, steps, kv_heads, dim).transpose(1, 2)
    assert torch.equal(query, q * cos + rotate_half(q) * sin)
    assert torch.equal(key, k * cos + rotate_half(k) * sin)
    assert torch.equal(value, v.view(batch, steps, kv_heads, dim).transpose(1, 2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_is_the_pytorch_law_and_row_invariant(dtype):
    generator = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 7, 1536, generator=generator) * torch.linspace(0.1, 20, 1536)).to(dtype)  # outlier channels
    weight = (torch.rand(1536, generator=generator) + 0.5).to(dtype)
    fused = torch.ops.specdec_layer.rms_norm(x, weight, 1e-6)
    assert fused.dtype == dtype and fused.shape == x.shape
    # Only the order of the sum of squares differs from PyTorch's mean: an ulp of the scale at most.
    tolerance = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(fused, rms_norm_in_torch(x, weight, 1e-6), **tolerance)
    rows = x.reshape(-1, 1536)
    for row in range(rows.shape[0]):  # each row alone: the same bits as in the batch
        assert torch.equal(torch.ops.specdec_layer.rms_norm(rows[row:row + 1], weight, 1e-6),
                           fused.reshape(-1, 1536)[row:row + 1])


SILU_SCRIPT = """
import sys, torch
from specdec.models.native import kernels
assert kernels.load() is None
generator = torch.Generator().manual_seed(4)
gate = torch.randn(3, 1000, generator=generator) * 6  # beyond the clamps, and every tail length below
gate[0, :8] = torch.tensor([0.0, -0.0, 87.5, -87.5, 200.0, -200.0, float("inf"), float("-inf")])
gate[0, 8] = float("nan")
up = torch.randn(3, 1000, generator=generator)
outs = []
for dtype in (torch.float32, torch.bfloat16):
    gate_up = torch.cat([gate, up], dim=-1).to(dtype)
    outs += [torch.ops.specdec_layer.silu_mul(gate_up)]
    outs += [torch.ops.specdec_layer.silu_mul(gate_up[:, list(range(n)) + list(range(1000, 1000 + n))])
             for n in (1, 7, 8, 15, 17, 33)]
torch.save(outs, sys.argv[1])
"""


def test_silu_mul_paths_give_the_scalar_bits_and_follow_silu(tmp_path):
    """kernels/layer_ops.cpp's silu(gate) * up: AVX-512 (16 lanes), AVX2 (8) and scalar paths (chosen by
    ONEDNN_MAX_CPU_ISA) the same bits, tails of every length included; within an ulp or so of
    silu(g) * u computed in float64 and rounded at the same two points; NaN stays NaN."""
    caps = vector_path_caps()
    results = results_under_caps(SILU_SCRIPT, tmp_path, caps)
    def bits(x: torch.Tensor) -> torch.Tensor:  # NaN included
        return x.view(torch.int32 if x.dtype == torch.float32 else torch.int16)

    assert len(results["generic"]) == 14
    for name in caps:
        assert all(torch.equal(bits(fast), bits(generic))
                   for fast, generic in zip(results[name], results["generic"], strict=True)), name

    generator = torch.Generator().manual_seed(4)
    gate = torch.randn(3, 1000, generator=generator) * 6
    up = torch.randn(3, 1000, generator=generator)
    for dtype, got in ((torch.float32, results["generic"][0]), (torch.bfloat16, results["generic"][7])):
        g, u = gate[1:].to(dtype), up[1:].to(dtype)
        silu = (g.double() * torch.sigmoid(g.double())).to(dtype)
        want = (silu.double() * u.double()).to(dtype)
        tolerance = dict(rtol=1e-6, atol=1e-30) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-30)
        torch.testing.assert_close(got[1:], want, **tolerance)
    edges = results["generic"][0][0, :9]
    up0 = up[0, :9]
    assert edges[0] == 0 and edges[1] == 0
    assert edges[2] == pytest.approx(87.5 * up0[2].item(), rel=1e-6) and abs(edges[3]) < 1e-30
    assert edges[4] == pytest.approx(200 * up0[4].item(), rel=1e-6) and abs(edges[5]) < 1e-30
    assert edges[6] == float("inf") * torch.sign(up0[6])  # silu(inf) = inf
    assert torch.isinf(edges[7]) and torch.isnan(edges[8])  # -inf / e^88: infinite, not silu's limit 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_row_invariant_and_the_mlp_calls_it(dtype):
    from specdec.models.native.model import MLP

    generator = torch.Generator().manual_seed(5)
    gate_up = torch.randn(4, 6, 2 * 300, generator=generator).to(dtype)
    fused = torch.ops.specdec_layer.silu_mul(gate_up)
    assert fused.shape == (4, 6, 300) and fused.dtype == dtype
    rows = gate_up.reshape(-1, 600)
    for row in range(rows.shape[0]):
        assert torch.equal(torch.ops.specdec_layer.silu_mul(rows[row:row + 1]), fused.reshape(-1, 300)[row:row + 1])
    mlp = MLP(torch.nn.Identity(), torch.nn.Identity())
    assert torch.equal(mlp(gate_up), fused)  # the op-by-op form takes the same law


def test_kernel_checks_refuse_mismatched_shapes():
    with pytest.raises(RuntimeError, match="rms_norm: weight"):
        torch.ops.specdec_layer.rms_norm(torch.randn(2, 8), torch.randn(9), 1e-6)
    with pytest.raises(RuntimeError, match="split_rope: qkv"):
        torch.ops.specdec_layer.split_rope(torch.randn(1, 2, 30), torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4),
                                           2, 1, 4)


def test_a_model_with_the_kernels_agrees_with_its_pytorch_fallback():
    """The same tiny model with and without specdec's kernels (SPECDEC_NO_KERNELS): the same greedy tokens."""
    script = ("import torch, sys; sys.path.insert(0, 'tests'); from conftest import make_model, make_native\n"
              "model = make_native(make_model(seed=3, hidden=64))\n"
              "ids = torch.randint(0, 60, (1, 24), generator=torch.Generator().manual_seed(2))\n"
              "logits = model.forward(ids, torch.arange(24)[None]).logits\n"
              "print(' '.join(map(str, logits.argmax(-1)[0].tolist())))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    outputs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=300,
                              env={**os.environ, **extra}) for extra in ({}, {"SPECDEC_NO_KERNELS": "1"})]
    for output in outputs:
        assert output.returncode == 0, output.stderr
    assert outputs[0].stdout.split() == outputs[1].stdout.split() and len(outputs[0].stdout.split()) == 24
    model = make_native(make_model(seed=3, hidden=64))
    in_process = model.forward(torch.randint(0, 60, (1, 24), generator=torch.Generator().manual_seed(2)),
                               torch.arange(24)[None]).logits
    assert in_process.argmax(-1)[0].tolist() == list(map(int, outputs[0].stdout.split()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_w4a8_blocks_in_one_call_give_the_op_by_op_bits(dtype, monkeypatch):
    """kernels/block.cpp against Block.forward's op-by-op form, and every block in one call
    against one call per block: a prefill, decode steps, chains of drafts, a second
    batch row of another length, and a forward over one cache row (CacheRows); the logits, and the
    features EAGLE-3 reads from layers 0, 2 and the last (capture_layers)."""
    from specdec.models.native.model import BLOCK_FORMS, ChainCall

    calls = []  # the blocks each C++ call ran
    real_call = ChainCall.__call__
    monkeypatch.setattr(ChainCall, "__call__", lambda self, *args: calls.append(len(self.norms) // 2)
                        or real_call(self, *args))
    model = make_model(seed=5, layers=3, hidden=64, random_bias=True)  # random q/k/v biases: Qwen2's
    outputs = {}
    for form in BLOCK_FORMS:
        runner = make_native(model, dtype=dtype, quantize="w4a8", batch_size=2)
        decoder = runner.decoder
        assert decoder.chain_call is not None
        decoder.block_form = form
        decoder.capture_layers((0, 2, 3))
        generator = torch.Generator().manual_seed(9)
        out = runner.forward(torch.randint(2, 30, (2, 37), generator=generator), torch.arange(37).expand(2, -1))
        results = [out.logits, out.hidden]
        for steps in (1, 4, 1, 9):
            start = runner.seq_len
            out = runner.forward(torch.randint(2, 30, (2, steps), generator=generator),
                                 torch.arange(start, start + steps).expand(2, -1))
            results += [out.logits, out.hidden]
        start = runner.cache.seq_lens[1]
        out = runner.forward(torch.randint(2, 30, (1, 3), generator=generator), torch.arange(start, start + 3)[None],
                             rows=slice(1, 2))
        outputs[form] = results + [out.logits, out.hidden]
    assert calls == [3] * 6 + [1] * 6 * 3  # every chain forward: one call for all blocks, then one a block
    for form in ("one call", "a call a block"):
        for fused, ops in zip(outputs[form], outputs["op by op"], strict=True):
            assert torch.equal(fused, ops)


def test_blocks_that_are_not_all_w4a8_run_op_by_op():
    runner = make_native(make_model(seed=5, layers=2, hidden=64), dtype=torch.float32, quantize="none")
    assert runner.decoder.chain_call is None


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, capsys):
    """A process killed while it held the kernels' build lock (every load takes it for a moment) left it
    behind, and the next load waited on it forever (seen after killing a server mid-start)."""
    lock = tmp_path / "lock"
    lock.touch()
    assert not kernels.clear_stale_lock(tmp_path) and lock.exists()  # a build may be running: wait for it
    old = lock.stat().st_mtime - kernels.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    assert kernels.clear_stale_lock(tmp_path) and not lock.exists()
    assert "stale kernel build lock" in capsys.readouterr().err
    assert not kernels.clear_stale_lock(tmp_path)  # nothing to remove
