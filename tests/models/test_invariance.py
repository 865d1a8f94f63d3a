"""Batch invariance by construction, and the probe that checks it on the machine at hand.

The real-shape tests run `specdec doctor --synthetic` (one full-size Qwen2.5-1.5B
layer, random weights) in a subprocess under every oneDNN ISA cap this CPU
supports, so an AMX machine also checks what an AVX2 user gets; the terminal
summary says which caps ran.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import VOCAB_SIZE, make_model, make_native
from specdec.models.cpu_features import ISA_CAPS, supported_isa_caps
from specdec.models.native.attention import KEY_BLOCK, AttentionPlan, blocked_attention, block_bias
from specdec.models.native.invariance import CHUNKINGS, cheap_probe, probe_batched_rows, probe_chunkings, \
    probe_tree

CAPS_HERE = supported_isa_caps()


def reference_attention(query, keys, values, visible):
    """Plain softmax attention in float64: query [M, D], keys/values [S, D], visible [M, S]."""
    scores = (query.double() @ keys.double().T) * query.shape[-1] ** -0.5
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ values.double()


def test_blocked_attention_is_softmax_attention():
    generator = torch.Generator().manual_seed(0)
    rows, length, dim = 5, 3 * KEY_BLOCK, 32
    query, keys, values = (torch.randn(n, dim, generator=generator) for n in (rows, length, length))
    visible = torch.rand(rows, length, generator=generator) < 0.7
    visible[:, 0] = True
    got = blocked_attention(query[None, None, None], keys[None, None, None], values[None, None, None],
                            block_bias(visible[None, None, None]))[0, 0, 0]
    torch.testing.assert_close(got.double(), reference_attention(query, keys, values, visible), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_past_a_query_are_skipped_exactly(dtype):
    """The same query over its own blocks, and over extra all-masked blocks of padding (a longer
    forward): bit-identical, in fp32 as in bf16."""
    generator = torch.Generator().manual_seed(1)
    dim, length = 64, 2 * KEY_BLOCK + 5
    query = torch.randn(1, 1, 1, 3, dim, generator=generator).to(dtype)
    keys = torch.randn(1, 1, 1, 5 * KEY_BLOCK, dim, generator=generator).to(dtype)
    values = torch.randn(keys.shape, generator=generator).to(dtype)

    def attend(width):
        visible = (torch.arange(width) < length).expand(1, 1, 1, 3, width)
        return blocked_attention(query, keys[..., :width, :], values[..., :width, :], block_bias(visible))

    own = attend(3 * KEY_BLOCK)
    assert torch.equal(attend(4 * KEY_BLOCK), own)
    assert torch.equal(attend(5 * KEY_BLOCK), own)


def test_attention_plan_chunks_a_long_forward_without_changing_a_value():
    from specdec.models.native import attention

    generator = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, steps = 4, 2, 16, 40
    query = torch.randn(1, heads, steps, dim, generator=generator)
    keys = torch.randn(1, kv_heads, KEY_BLOCK, dim, generator=generator)
    values = torch.randn(keys.shape, generator=generator)
    whole = AttentionPlan.build([0], steps, 2, None, torch.device("cpu"))
    assert len(whole.chain) == 1
    expected = whole.attend(query, keys, values)
    saved = attention.QUERY_CHUNK
    attention.QUERY_CHUNK = 7  # 6 chunks of queries, each over only the key blocks it can see
    try:
        chunked = AttentionPlan.build([0], steps, 2, None, torch.device("cpu"))
        assert len(chunked.chain) == 6
        assert torch.equal(chunked.attend(query, keys, values), expected)
    finally:
        attention.QUERY_CHUNK = saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_model_chunkings_and_batched_rows_are_bit_identical(dtype):
    """The probe on a tiny model, fp32 included (exact, not within 1e-5), across a block boundary."""
    native = make_native(make_model(random_bias=True, seed=3, hidden=64), dtype=dtype)
    report = probe_chunkings(native, [5, KEY_BLOCK - 1, KEY_BLOCK, 2 * KEY_BLOCK + 1])
    report.extend(probe_batched_rows(native, KEY_BLOCK + 3))
    report.extend(probe_tree(native, KEY_BLOCK - 2))  # the tree's paths cross a block boundary
    # As `specdec doctor` runs them: contexts out of order (the cache starts again), and the tree
    # going on from the context the chunkings leave cached.
    report.extend(probe_chunkings(native, [KEY_BLOCK + 1, 7, KEY_BLOCK - 2], keep_last_context=True))
    assert native.cache.seq_lens == [KEY_BLOCK - 2]
    report.extend(probe_tree(native, KEY_BLOCK - 2, prefilled=True))
    # Hidden states at the 7 contexts, logits at each call's last context (the head is a projection:
    # probe_projections' row counts); 3 rows; 3 tree paths (leaves) twice.
    assert len(report.cases) == (7 + 2) * (len(CHUNKINGS) - 1) + 3 + 2 * 3
    assert sum(": logits" in case.name for case in report.cases) == 2 * (len(CHUNKINGS) - 1)
    assert report.ok, [case.name for case in report.failures]


class RowCountDependentLinear(torch.nn.Module):
    """A projection that rounds differently with the number of rows in the call, as a BLAS
    library's other kernel would: the probe must catch it and the runner must go safe."""

    def __init__(self, linear: torch.nn.Module) -> None:
        super().__init__()
        self.linear = linear
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        return self.linear(x) * (1.0 + 1e-3 * (rows > 2))


def test_a_failing_probe_switches_the_runner_to_one_token_per_call(capsys):
    from specdec.engine import SpecEngine
    from specdec.proposers import NgramProposer
    from specdec.sampling import SamplingParams
    from conftest import make_tokenizer

    model = make_model(random_bias=True, seed=4, hidden=64)
    healthy, broken = make_native(model), make_native(model)
    assert healthy.check_invariance() and not healthy.one_token_per_call
    broken.decoder.head = RowCountDependentLinear(broken.decoder.head)
    assert not broken.check_invariance()
    assert broken.one_token_per_call
    assert "verifying one token per call" in capsys.readouterr().err
    # Through the whole model, chunkings and ragged rows are exact again on the safe path.
    assert probe_chunkings(broken, [20]).extend(probe_batched_rows(broken, 20)).ok
    # The safe path: speculative output equals plain output although the kernel is not invariant.
    tokenizer, params = make_tokenizer(), SamplingParams(temperature=0)
    plain = SpecEngine(broken, None, tokenizer, eos_token_ids=frozenset()).generate("abc abc abc abc", params,
                                                                                     max_new_tokens=30)
    spec = SpecEngine(broken, NgramProposer(), tokenizer, k=4, eos_token_ids=frozenset()).generate(
        "abc abc abc abc", params, max_new_tokens=30)
    assert spec.token_ids == plain.token_ids and spec.stats.drafted_tokens > 0
    with pytest.raises(ValueError, match="tree verification is not exact"):
        broken.forward(torch.zeros(1, 2, dtype=torch.int64), torch.tensor([[40, 40]]),
                       among_new=torch.eye(2, dtype=torch.bool)[None])
    assert VOCAB_SIZE == broken.vocab_size


def test_cheap_probe_passes_on_this_machine():
    report = cheap_probe(make_native(make_model(random_bias=True, seed=5, hidden=64)).decoder)
    assert report.cases and report.ok


# fp32 under every cap (AVX2 machines run fp32); bf16 where it is the default (AVX-512 and newer);
# w8a8 weights (integer matmuls) where a cap has VNNI; w4a8 (specdec's kernel, which follows the cap)
# under every cap, in the dtype that cap's machines default to.
VNNI_CAPS = ("AVX512_CORE_VNNI", "AVX512_CORE_BF16", "AVX512_CORE_AMX")
CAP_DTYPES = ([(cap, "float32", "none") for cap in CAPS_HERE]
              + [(cap, "bfloat16", "none") for cap in CAPS_HERE if cap != "AVX2"]
              + [(cap, "bfloat16", "w8a8") for cap in CAPS_HERE if cap in VNNI_CAPS]
              + [(cap, "float32" if cap == "AVX2" else "bfloat16", "w4a8") for cap in CAPS_HERE])
CONTEXTS = [n for power in range(4, 13) for n in (2 ** power - 1, 2 ** power + 1)]  # 15, 17, ..., 4095, 4097

# Caps under which oneDNN runs the kernels of a lower cap for a dtype: its fp32 matmul has no
# VNNI, BF16 or AMX kernel (brg_matmul:avx512_core under all four AVX-512 caps), and its bf16 matmul
# none for VNNI (gemm:jit under AVX512_CORE and AVX512_CORE_VNNI); specdec's attention takes its
# avx512 path under every AVX-512 cap. Read off ONEDNN_VERBOSE on a Sapphire Rapids-class Xeon,
# torch 2.13. The full probe runs under the lower cap (the stand-in); under these, a test shows
# that the same kernels run, or runs the full probe where they do not (another oneDNN or CPU).
STAND_INS = {("AVX512_CORE_VNNI", "float32", "none"): "AVX512_CORE",
             ("AVX512_CORE_BF16", "float32", "none"): "AVX512_CORE",
             ("AVX512_CORE_AMX", "float32", "none"): "AVX512_CORE",
             ("AVX512_CORE_VNNI", "bfloat16", "none"): "AVX512_CORE"}
PROBED_IN_FULL = [case for case in CAP_DTYPES if case not in STAND_INS]
STOOD_IN_FOR = [case for case in CAP_DTYPES if case in STAND_INS]
KERNELS_UNDER_CAP = os.path.join(os.path.dirname(__file__), "kernels_under_cap.py")


def one_core_env(**variables) -> dict:
    env = dict(os.environ, **variables)
    if "PYTEST_XDIST_WORKER" in os.environ:  # one core per test process (`make test`): no oversubscription
        env["OMP_NUM_THREADS"] = "1"
    return env


def probe_in_full(report_path, cap, dtype, quantize) -> None:
    """`specdec doctor --synthetic` under ONEDNN_MAX_CPU_ISA=cap: every probe bit-identical."""
    result = subprocess.run([sys.executable, "-m", "specdec.cli", "doctor", "--synthetic", "--dtype", dtype,
                             "--quantize", quantize, "--contexts", ",".join(map(str, CONTEXTS)),
                             "--json", str(report_path)],
                            env=one_core_env(ONEDNN_MAX_CPU_ISA=cap), capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["facts"]["onednn_path_in_force"] == cap
    contexts = {int(case["name"].split("context ")[1].split(",")[0]) for case in report["cases"]
                if case["name"].startswith("model, context")}
    assert contexts == set(CONTEXTS)
    assert all(case["identical"] for case in report["cases"])


@functools.cache  # a stand-in's kernels, read once per test process
def kernels_under(cap, dtype, quantize) -> frozenset[str]:
    """The kernels the probe's calls run under cap (kernels_under_cap.py): oneDNN's exec lines
    without their times (engine, primitive, implementation, memory formats, shapes), and the line
    naming specdec's own kernel paths."""
    result = subprocess.run([sys.executable, KERNELS_UNDER_CAP, dtype, quantize],
                            env=one_core_env(ONEDNN_MAX_CPU_ISA=cap, ONEDNN_VERBOSE="1"),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    kernels = set()
    for line in result.stdout.splitlines():
        fields = line.split(",")
        if fields[0] == "onednn_verbose" and "exec" in fields:
            kernels.add(",".join(fields[fields.index("exec") + 1:-1]))
        elif line.startswith("specdec kernels: "):
            kernels.add(line)
    matmuls = [kernel for kernel in kernels if ",inner_product," in kernel or ",matmul," in kernel]
    assert len(matmuls) >= (10 if quantize == "none" else 1), "oneDNN's verbose lines were not read"
    assert sum(kernel.startswith("specdec kernels: ") for kernel in kernels) == 1
    return frozenset(kernels)


@pytest.mark.isa
@pytest.mark.parametrize("cap,dtype,quantize", PROBED_IN_FULL)
def test_real_shapes_are_batch_invariant_under_every_isa_cap(tmp_path, cap, dtype, quantize):
    """One full-size Qwen2.5-1.5B layer with random weights, under ONEDNN_MAX_CPU_ISA=cap: projections
    with 1..64 rows, chunkings of a 9-token window at contexts around every power of two up to 4k,
    ragged batched rows and a draft tree, all bit-identical."""
    probe_in_full(tmp_path / "doctor.json", cap, dtype, quantize)


@pytest.mark.isa
@pytest.mark.parametrize("cap,dtype,quantize", STOOD_IN_FOR)
def test_a_cap_stood_in_for_runs_the_kernels_its_stand_in_runs(tmp_path, cap, dtype, quantize):
    """The same oneDNN kernels on the same shapes and formats, and the same specdec kernel paths,
    as under the stand-in cap, whose full probe is the test above: the same bits. Where they
    differ, the full probe under this cap."""
    stand_in = STAND_INS[cap, dtype, quantize]
    if kernels_under(cap, dtype, quantize) != kernels_under(stand_in, dtype, quantize):
        probe_in_full(tmp_path / "doctor.json", cap, dtype, quantize)


def test_this_cpu_runs_at_least_the_avx2_path():
    assert set(CAPS_HERE) <= set(ISA_CAPS)
    assert "AVX2" in CAPS_HERE  # every x86-64 CPU these machines have; the tests above need one cap at least
