"""The native decoder against transformers on the same weights, and its static cache."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import VOCAB_SIZE, make_model, make_native, make_tokenizer
from specdec.engine import SpecEngine
from specdec.models.hf import HFRunner
from specdec.models.loader import auto_quantization, load_model
from specdec.models.native import DecoderConfig, UnsupportedModelError
from specdec.models.native.linear import (Int4Linear, Int8Linear, W8A8Linear, head_quantization, make_linear,
                                          w8a8_available)
from specdec.models.native.w4a8 import isa_path
from specdec.models.native.attention import attention_mask
from specdec.sampling import SamplingParams

FAMILIES = [("qwen2", {}), ("llama", {}), ("llama", {"tie_word_embeddings": True, "head_dim": 16})]


def _ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB_SIZE, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family,extra", FAMILIES)
def test_native_logits_match_transformers(family, extra):
    model = make_model(random_bias=True, seed=11, family=family, **extra)
    native, reference = make_native(model), HFRunner(model)
    ids, positions = _ids(20), torch.arange(20)[None]
    expected = reference.forward(ids, positions).logits
    got = native.forward(ids, positions).logits
    assert got.shape == expected.shape == (1, 20, VOCAB_SIZE)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # ...and one token at a time through the cache.
    native.reset()
    stepwise = torch.cat([native.forward(ids[:, i:i + 1], positions[:, i:i + 1]).logits for i in range(20)], dim=1)
    torch.testing.assert_close(stepwise, expected, atol=1e-4, rtol=1e-4)


def test_greedy_generation_identical_to_transformers_in_fp32():
    model = make_model(random_bias=True, seed=12)
    tokenizer = make_tokenizer()
    params = SamplingParams(temperature=0.0)
    hf = SpecEngine(HFRunner(model), None, tokenizer).generate("hello there", params, max_new_tokens=40)
    native = SpecEngine(make_native(model), None, tokenizer).generate("hello there", params, max_new_tokens=40)
    assert native.token_ids == hf.token_ids
    assert len(native.token_ids) > 5


def test_truncate_then_reforward_equals_fresh_run():
    native = make_native(make_model(random_bias=True, seed=13))
    ids, wrong = _ids(10, seed=1), _ids(4, seed=2)
    native.forward(ids[:, :6], torch.arange(6)[None])
    native.forward(wrong, torch.arange(6, 10)[None])  # a rejected draft
    native.truncate(torch.tensor([6]))
    assert native.seq_len == 6
    again = native.forward(ids[:, 6:], torch.arange(6, 10)[None]).logits
    native.reset()
    fresh = native.forward(ids, torch.arange(10)[None]).logits[:, 6:]
    torch.testing.assert_close(again, fresh, atol=1e-5, rtol=1e-5)


def test_cache_grows_past_its_initial_capacity():
    native = make_native(make_model(random_bias=True, seed=14), initial_cache_len=8)  # a 30-token run must grow it twice
    ids = _ids(30, seed=3)
    parts = [native.forward(ids[:, i:i + 5], torch.arange(i, i + 5)[None]).logits for i in range(0, 30, 5)]
    native.reset()
    fresh = native.forward(ids, torch.arange(30)[None]).logits
    assert native.cache.capacity >= 30
    torch.testing.assert_close(torch.cat(parts, dim=1), fresh, atol=1e-5, rtol=1e-5)


def test_context_overflow_is_a_clear_error():
    native = make_native(make_model(random_bias=True, seed=14))
    with pytest.raises(ValueError, match="context of 256"):
        native.forward(torch.zeros(1, 300, dtype=torch.int64), torch.arange(300)[None])


def test_tree_mask_forward_equals_each_branch_run_alone():
    """Two branches after a shared prefix, fed in one forward with an ancestor mask."""
    native = make_native(make_model(random_bias=True, seed=15))
    prefix, branch_a, branch_b = _ids(6, seed=4), _ids(3, seed=5), _ids(2, seed=6)
    native.forward(prefix, torch.arange(6)[None])
    tokens = torch.cat([branch_a, branch_b], dim=1)  # [1, 5]
    positions = torch.tensor([[6, 7, 8, 6, 7]])  # both branches start right after the prefix
    among_new = torch.tensor([[1, 0, 0, 0, 0],
                              [1, 1, 0, 0, 0],
                              [1, 1, 1, 0, 0],
                              [0, 0, 0, 1, 0],
                              [0, 0, 0, 1, 1]], dtype=torch.bool)[None]
    tree = native.forward(tokens, positions, among_new=among_new).logits
    for branch, columns in ((branch_a, slice(0, 3)), (branch_b, slice(3, 5))):
        native.reset()
        alone = native.forward(torch.cat([prefix, branch], dim=1), torch.arange(6 + branch.shape[1])[None]).logits
        torch.testing.assert_close(tree[:, columns], alone[:, 6:], atol=1e-5, rtol=1e-5)


def test_attention_mask_worked_example():
    # Row 0 has 2 cached tokens, row 1 has 1; both feed 2 new tokens (S = 4).
    mask = attention_mask([2, 1], 2, 4, None, torch.device("cpu"))[:, 0].int().tolist()
    assert mask == [[[1, 1, 1, 0], [1, 1, 1, 1]],
                    [[1, 1, 0, 0], [1, 1, 1, 0]]]
    assert attention_mask([5], 1, 6, None, torch.device("cpu")) is None


def test_batch_rows_of_different_lengths_match_single_rows():
    model = make_model(random_bias=True, seed=16)
    batch = make_native(model, batch_size=2)
    single = make_native(model)
    long_ids, short_ids = _ids(7, seed=7), _ids(4, seed=8)
    batch.forward(torch.cat([long_ids, torch.cat([short_ids, short_ids[:, :3]], dim=1)]),
                  torch.arange(7).expand(2, 7))
    batch.truncate(torch.tensor([7, 4]))  # row 1 really has 4 tokens
    step = _ids(2, seed=9).expand(2, 2)
    got = batch.forward(step, torch.stack([torch.arange(7, 9), torch.arange(4, 6)])).logits
    for row, ids in enumerate((long_ids, short_ids)):
        single.reset()
        expected = single.forward(torch.cat([ids, step[:1]], dim=1), torch.arange(ids.shape[1] + 2)[None]).logits
        torch.testing.assert_close(got[row], expected[0, -2:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_equals_its_dequantized_weight(dtype):
    weight, x = torch.randn(48, 64), torch.randn(5, 64)
    linear = Int8Linear(weight, torch.randn(48), dtype)
    expected = x @ linear.dequantized().T + linear.bias.float()
    torch.testing.assert_close(linear(x.to(dtype)).float(), expected, atol=0.1 if dtype == torch.bfloat16 else 1e-4,
                               rtol=0.02 if dtype == torch.bfloat16 else 1e-4)
    # Half a quantization step; a bf16 scale (8 mantissa bits) can add up to another half at |q| = 127.
    steps = 0.5 if dtype == torch.float32 else 1.0
    assert (linear.dequantized() - weight).abs().max() <= weight.abs().max() / 127 * steps + 1e-6


def test_int4_linear_is_close_to_the_weight():
    weight, x = torch.randn(48, 64), torch.randn(5, 64)
    linear = Int4Linear(weight, None, group_size=32)
    # Asymmetric 4-bit: error at most half a step of (max - min) / 15 per group.
    step = (weight.reshape(48, 2, 32).amax(-1) - weight.reshape(48, 2, 32).amin(-1)) / 15
    error = (linear.dequantized() - weight).abs().reshape(48, 2, 32).amax(-1)
    assert (error <= step / 2 * 1.02 + 0.02).all()
    torch.testing.assert_close(linear(x.to(torch.bfloat16)).float(), x @ linear.dequantized().T, atol=0.15, rtol=0.03)


W8A8_HERE = w8a8_available() is None  # VNNI/AMX; elsewhere w8a8 must refuse clearly (tested below)
QUANTIZATIONS_HERE = ["int8", "int4", "w4a8"] + (["w8a8"] if W8A8_HERE else [])


def test_bf16_projections_stay_in_calls_of_32_rows_where_amx_is_in_force(monkeypatch):
    """oneDNN's bf16 matmul rounds 33+ rows unlike fewer where AMX is in force (the isa tests
    show it on AMX CPUs): such calls are split into blocks of 32, a 1-row block fed twice."""
    from specdec.models.native import linear as linear_module

    monkeypatch.setattr(linear_module, "effective_isa", lambda: "AVX512_CORE_AMX")
    assert linear_module.row_block_for(torch.bfloat16) == 32
    assert linear_module.row_block_for(torch.float32) is None
    monkeypatch.setattr(linear_module, "effective_isa", lambda: "AVX512_CORE_BF16")
    assert linear_module.row_block_for(torch.bfloat16) is None
    calls = []

    def project(rows):
        calls.append(rows.shape[0])
        return rows[:, :3] * 2

    x = torch.randn(2, 33, 8)  # 66 rows: 32 + 32 + 2
    assert torch.equal(linear_module.batch_invariant(x, 3, project, 32), x[..., :3] * 2) and calls == [32, 32, 2]
    calls.clear()
    assert torch.equal(linear_module.batch_invariant(x[0], 3, project, 32), x[0, :, :3] * 2) and calls == [32, 2]


def w8a8_reference(weight, bias, x):
    """The w8a8 law in float64: per-channel int8 weights, per-row int8 activations, exact sums."""
    weight, x = weight.double(), x.double()
    scales = weight.abs().amax(1).clamp_min(1e-8) / 127
    row_scales = x.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    sums = torch.round(x / row_scales) @ torch.round(weight / scales[:, None]).clamp(-127, 127).T
    return sums * row_scales * scales + (0 if bias is None else bias.double())


def test_w8a8_linear_is_its_integer_law_and_row_invariant():
    if not W8A8_HERE:
        with pytest.raises(ValueError, match="VNNI or AMX"):
            make_linear(torch.randn(48, 64), None, dtype=torch.float32, device=torch.device("cpu"), quantize="w8a8")
        return
    generator = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(200, 96, generator=generator), torch.randn(200, generator=generator)
    x = torch.randn(17, 96, generator=generator) * torch.linspace(0.01, 30, 96)  # outlier channels, as in LLMs
    linear = W8A8Linear(weight, bias, torch.float32)
    got = linear(x)
    torch.testing.assert_close(got.double(), w8a8_reference(weight, bias, x), atol=1e-3, rtol=1e-5)
    # Integer sums: a row's output cannot depend on how many rows share the call.
    for rows in (1, 2, 5, 9, 16):
        assert torch.equal(linear(x[:rows]), got[:rows]), rows
    assert torch.equal(linear(x[None, 3:4]), got[None, 3:4])
    bf16 = W8A8Linear(weight, bias, torch.bfloat16)
    assert bf16(x.bfloat16()).dtype == torch.bfloat16
    assert (linear.dequantized() - weight).abs().max() <= weight.abs().max() / 127 * 0.5 + 1e-5


def same_as_onednn(ours: torch.Tensor, onednn: torch.Tensor) -> None:
    """The same bits as oneDNN's VNNI path (measured on Zen 4). Its AMX path, not measured here, may
    round its epilogue its own way: there, within one float rounding of each product."""
    from specdec.models.cpu_features import effective_isa

    if effective_isa() == "AVX512_CORE_AMX":
        torch.testing.assert_close(ours, onednn, rtol=3e-7, atol=1e-30)
    else:
        assert torch.equal(ours, onednn)


@pytest.mark.skipif(not W8A8_HERE, reason="w8a8 needs VNNI or AMX; the test above checks the refusal")
def test_w8a8_specdec_kernel_gives_onednn_bits_on_every_path():
    """kernels/w8a8.cpp against oneDNN's qlinear: the same integer sums, the same two roundings.
    Outputs not a multiple of 16 (200: padded), 1..17 rows, a bias, and the largest sums (every
    weight and activation at +-127, where a u8 x s8 pair would saturate vpmaddubsw's int16)."""
    from specdec.models.native.linear import W8A8_VNNI_PATH

    generator = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(200, 96, generator=generator), torch.randn(200, generator=generator)
    x = torch.randn(17, 96, generator=generator) * torch.linspace(0.01, 30, 96)
    ours, onednn = (W8A8Linear(weight, bias, torch.float32, kernel=kernel) for kernel in ("specdec", "onednn"))
    assert ours.own_kernel and not onednn.own_kernel
    for rows in (1, 2, 5, 9, 17):
        same_as_onednn(ours(x[:rows]), onednn(x[:rows]))
    scalar = torch.ops.specdec_w8a8.linear(x, ours.packed_weight, ours.weight_sums, ours.scales, ours.bias, 0)
    assert torch.equal(scalar[:, :200], ours(x)) and W8A8_VNNI_PATH != 0
    extremes = torch.tensor([1.0, -1.0]).repeat(48)  # [96]: every |weight| and |activation| quantizes to 127
    for sign in (1, -1):
        big_ours, big_onednn = (W8A8Linear(extremes.expand(32, 96) * sign, None, torch.float32, kernel=kernel)
                                for kernel in ("specdec", "onednn"))
        rows = torch.stack([extremes, -extremes, extremes.abs()])
        same_as_onednn(big_ours(rows), big_onednn(rows))
        assert big_ours(rows)[0, 0].item() == pytest.approx(96.0 * sign)


def test_w8a8_refuses_cuda_and_paths_that_saturate():
    with pytest.raises(ValueError, match="CPU"):
        make_linear(torch.randn(8, 8), None, dtype=torch.float32, device=torch.device("cuda"), quantize="w8a8")
    script = ("import torch; from specdec.models.native.linear import make_linear\n"
              "try:\n    make_linear(torch.randn(8, 32), None, dtype=torch.float32, device=torch.device('cpu'), "
              "quantize='w8a8')\nexcept ValueError as error:\n    print(error)")
    for cap in ("AVX2", "AVX512_CORE"):  # no VNNI: vpmaddubsw saturates int16 pairs
        result = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, ONEDNN_MAX_CPU_ISA=cap),
                                capture_output=True, text=True, timeout=120)
        assert "VNNI or AMX" in result.stdout, result.stdout + result.stderr


def test_auto_quantization_picks_the_fastest_exact_format_here():
    cpu = torch.device("cpu")
    assert auto_quantization("hf", cpu, torch.float32, "target") == "none"
    assert auto_quantization("native", torch.device("cuda"), torch.bfloat16, "target") == "none"
    fast_path = isa_path() != "scalar"  # any x86 CPU with AVX2: specdec's w4a8 kernel, exact on every path
    for dtype in (torch.float32, torch.bfloat16):
        for role in ("draft", "target"):
            if fast_path:
                assert auto_quantization("native", cpu, dtype, role) == "w4a8"
    if not fast_path:
        assert auto_quantization("native", cpu, torch.bfloat16, "draft") == "int4"
        assert auto_quantization("native", cpu, torch.bfloat16, "target") == ("w8a8" if W8A8_HERE else "none")
    script = ("import torch; from specdec.models.loader import auto_quantization\n"
              "print(auto_quantization('native', torch.device('cpu'), torch.float32, 'target'))")
    capped = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2"),
                            capture_output=True, text=True, timeout=120)
    # An AVX2-only CPU (no exact int8 x int8 in oneDNN) still gets 4-bit weights from specdec's kernel.
    assert capped.stdout.strip() == ("w4a8" if fast_path else "none"), capped.stderr


@pytest.mark.parametrize("quantize", QUANTIZATIONS_HERE)
def test_quantized_model_mostly_agrees_with_fp32(quantize):
    model = make_model(random_bias=True, seed=17, hidden=64)
    ids, positions = _ids(40, seed=10), torch.arange(40)[None]
    exact = make_native(model).forward(ids, positions).logits
    quantized = make_native(model, dtype=torch.bfloat16, quantize=quantize).forward(ids, positions).logits
    agreement = (quantized.argmax(-1) == exact.argmax(-1)).float().mean()
    # A random model's logits are near ties, so each 4-bit part costs agreement: 8-bit weights, 4-bit
    # weights with an 8-bit head (w4a8 on VNNI CPUs), 4-bit everywhere (int4; w4a8 where no exact 8-bit
    # head runs, e.g. AVX2). The real models' quality is measured in benchmarks/native_quality.py.
    four_bit_head = quantize == "int4" or head_quantization(quantize) == "w4a8"
    assert agreement >= (0.75 if four_bit_head else 0.85 if quantize == "w4a8" else 0.9)


def test_reduced_head_scores_only_its_rows():
    model = make_model(random_bias=True, seed=18)
    rows = torch.tensor([1, 5, 9, 20, 33])
    ids, positions = _ids(6, seed=11), torch.arange(6)[None]
    full = make_native(model).forward(ids, positions).logits
    reduced = make_native(model, head_rows=rows).forward(ids, positions).logits
    assert reduced.shape == full.shape
    torch.testing.assert_close(reduced[..., rows], full[..., rows], atol=1e-5, rtol=1e-5)
    others = torch.ones(VOCAB_SIZE, dtype=torch.bool)
    others[rows] = False
    assert torch.isneginf(reduced[..., others]).all()


@pytest.mark.parametrize("change,reason", [
    ({"model_type": "gpt2"}, "gpt2"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "yarn"),
    ({"hidden_act": "gelu"}, "gelu"),
])
def test_unsupported_configs_name_the_reason(change, reason):
    config = make_model(random_bias=True, seed=0).config.to_dict() | change
    with pytest.raises(UnsupportedModelError, match=reason):
        DecoderConfig.from_hf(config)


def test_loader_picks_native_and_falls_back_to_transformers(tmp_path, capsys):
    model, tokenizer = make_model(random_bias=True, seed=19), make_tokenizer()
    supported = tmp_path / "qwen"
    model.save_pretrained(supported)
    tokenizer.save_pretrained(supported)
    loaded = load_model(str(supported), device="cpu", dtype="float32", progress=False)
    assert loaded.backend == "native"
    assert loaded.eos_token_ids == frozenset({1})
    ids = _ids(8, seed=12)
    torch.testing.assert_close(loaded.runner.forward(ids, torch.arange(8)[None]).logits,
                               HFRunner(model).forward(ids, torch.arange(8)[None]).logits, atol=1e-4, rtol=1e-4)

    config = json.loads((supported / "config.json").read_text())
    (supported / "config.json").write_text(json.dumps(config | {"use_sliding_window": True, "sliding_window": 4}))
    fallback = load_model(str(supported), device="cpu", dtype="float32", progress=False)
    assert fallback.backend == "hf"
    assert "using the transformers backend" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--backend native cannot run"):
        load_model(str(supported), backend="native", progress=False)
    with pytest.raises(ValueError, match="backend must be one of"):
        load_model(str(supported), backend="tensorrt", progress=False)


def test_frequent_token_ids_keeps_specials_then_most_frequent():
    from specdec.models.native.reduced_vocab import frequent_token_ids

    tokenizer = make_tokenizer()
    ids = frequent_token_ids(tokenizer, 5, VOCAB_SIZE, texts=["aaaa bbb cc", "a b"])
    expected = {tokenizer.convert_tokens_to_ids(c) for c in "ab "} | set(tokenizer.all_special_ids)
    assert ids.tolist() == sorted(expected)  # <unk>, <eos>, then a (5), b (4), space (3)
    assert frequent_token_ids(tokenizer, VOCAB_SIZE, VOCAB_SIZE).tolist() == list(range(VOCAB_SIZE))
    with pytest.raises(ValueError, match=">= 1"):
        frequent_token_ids(tokenizer, 0, VOCAB_SIZE)


def test_reduced_vocabulary_draft_keeps_greedy_output_exact():
    from specdec.proposers import DraftModelProposer

    tokenizer, params = make_tokenizer(), SamplingParams(temperature=0.0)
    no_eos = frozenset()  # run all 30 tokens
    target = make_native(make_model(random_bias=True, seed=20))
    plain = SpecEngine(target, None, tokenizer, eos_token_ids=no_eos).generate("the cat sat", params,
                                                                               max_new_tokens=30)
    # The draft (same weights) cannot score the target's most frequent token, so it must miss some.
    missing = max(set(plain.token_ids), key=plain.token_ids.count)
    rows = torch.tensor([i for i in range(VOCAB_SIZE) if i != missing])
    draft = make_native(make_model(random_bias=True, seed=20), head_rows=rows)
    spec = SpecEngine(target, DraftModelProposer(draft), tokenizer, k=4, eos_token_ids=no_eos).generate(
        "the cat sat", params, max_new_tokens=30)
    assert spec.token_ids == plain.token_ids
    assert 0 < spec.stats.accepted_tokens < spec.stats.drafted_tokens


@pytest.mark.parametrize("dtype,quantize", [(torch.float32, "none"), (torch.bfloat16, "none"),
                                            (torch.bfloat16, "int8"), (torch.bfloat16, "int4"),
                                            (torch.float32, "w4a8"), (torch.bfloat16, "w4a8")]
                         + [(dtype, "w8a8") for dtype in (torch.float32, torch.bfloat16) if W8A8_HERE])
def test_one_token_steps_are_bit_identical_to_a_multi_token_forward(dtype, quantize):
    """Batch invariance: what lets speculative greedy output equal plain greedy output in bf16 too."""
    model = make_model(random_bias=True, seed=21, hidden=64)
    native = make_native(model, dtype=dtype, quantize=quantize)
    ids, positions = _ids(16, seed=13), torch.arange(16)[None]

    def logits_in_chunks(sizes):
        native.reset()
        native.forward(ids[:, :7], positions[:, :7])
        out, start = [], 7
        for size in sizes:
            out.append(native.forward(ids[:, start:start + size], positions[:, start:start + size]).logits)
            start += size
        return torch.cat(out, dim=1)

    together = logits_in_chunks([9])
    # Exact in fp32 too: attention's reduction order is fixed per query (native/attention.py).
    for chunks in ([1] * 9, [2, 5, 1, 1], [3, 3, 3], [5, 4]):
        assert torch.equal(logits_in_chunks(chunks), together), chunks


@pytest.mark.parametrize("dtype,quantize", [(torch.float32, "none"), (torch.bfloat16, "none"),
                                            (torch.bfloat16, "int4"), (torch.bfloat16, "w4a8")]
                         + [(torch.bfloat16, "w8a8")] * W8A8_HERE)
def test_a_ragged_batch_computes_only_its_real_tokens_and_equals_the_padded_one(dtype, quantize):
    """Packing (model.py): rows of 1, 5 and 3 real tokens in a [3, 5] forward. The real tokens' logits
    and features are bit for bit those of the padded forward (and so of each row alone); the padding's
    are zeros; the real tokens' cache entries are the same."""
    model = make_model(random_bias=True, seed=22, hidden=64)
    ids = _ids(3 * 12, seed=5).reshape(3, 12)
    valid = torch.arange(5)[None] < torch.tensor([1, 5, 3])[:, None]
    outputs = {}
    for ragged in (False, True):
        native = make_native(model, dtype=dtype, quantize=quantize, batch_size=3)
        native.forward(ids[:, :7], torch.arange(7).repeat(3, 1))
        out = native.forward(ids[:, 7:], torch.arange(7, 12).repeat(3, 1), valid=valid if ragged else None)
        native.truncate([7 + n for n in valid.sum(dim=1).tolist()])
        outputs[ragged] = out, native.cache
    (padded, padded_cache), (packed, packed_cache) = outputs[False], outputs[True]
    assert torch.equal(packed.logits[valid], padded.logits[valid])
    assert torch.equal(packed.hidden[valid], padded.hidden[valid])
    assert not packed.logits[~valid].any()
    for row, length in enumerate([8, 12, 10]):
        assert torch.equal(packed_cache.keys[:, row, :, :length], padded_cache.keys[:, row, :, :length])


def test_rows_move_and_trees_roll_back_after_the_cache_grew_under_inference_mode():
    """A row that outgrows the cache reallocates it inside forward (inference mode); the batched
    engine's move_row, swap_rows (its prompt cache parking a finished row) and a tree's keep_path
    then copy into that storage from outside it. This failed on a real server ("Inplace update to
    inference tensor outside InferenceMode"): move_row first, swap_rows at 4 clients on 2026-11-28."""
    runner = make_native(make_model(seed=0), batch_size=2, initial_cache_len=16)
    first_capacity = runner.cache.capacity
    tokens = torch.randint(0, VOCAB_SIZE, (2, 200), generator=torch.Generator().manual_seed(0))
    runner.forward(tokens, torch.arange(200).expand(2, -1))
    assert first_capacity < 200 <= runner.cache.capacity  # grown inside forward
    runner.truncate([150, 200], rows=slice(0, 2))
    row_1 = runner.cache.keys[:, 1, :, :200].clone()
    runner.swap_rows(0, 1)
    assert torch.equal(runner.cache.keys[:, 0, :, :200], row_1) and runner.row_lengths(slice(0, 2)) == [200, 150]
    runner.move_row(0, 1)
    assert torch.equal(runner.cache.keys[:, 0, :, :200], runner.cache.keys[:, 1, :, :200])
    single = make_native(make_model(seed=0), initial_cache_len=16)
    single.forward(tokens[:1], torch.arange(200)[None])
    single.keep_path(190, [2, 5])
    assert single.seq_len == 193
