"""analysis/roofline.py: a forward's measured cost next to its weight-read and arithmetic floors."""

import dataclasses

import pytest
import torch

from specdec.analysis.roofline import cost_curve, last_level_cache_bytes, measure_bandwidth, multiply_adds, weight_bytes
from specdec.models.native import NativeRunner, kernels
from specdec.models.native.invariance import QWEN2_5_1_5B_LAYER, random_decoder
from specdec.models.native.w4a8 import ISA_PATHS, isa_path

TINY = dataclasses.replace(QWEN2_5_1_5B_LAYER, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=False,
                           max_position_embeddings=256)


def test_weight_bytes_count_every_weight_once_but_the_embedding():
    decoder = random_decoder(TINY, dtype=torch.float32)
    hidden, inter, q, kv = 64, 128, 4 * 16, 2 * 16
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter + (q + 2 * kv) + 2 * hidden  # + biases, norms
    floats = 2 * per_layer + hidden + TINY.vocab_size * hidden + 16 // 2  # layers, final norm, head, RoPE frequencies
    assert weight_bytes(decoder) == 4 * floats


def test_multiply_adds_are_projections_per_row_plus_causal_attention():
    decoder = random_decoder(TINY, dtype=torch.float32)
    hidden, inter, q, kv = 64, 128, 4 * 16, 2 * 16
    per_layer = hidden * (q + 2 * kv) + q * hidden + 2 * hidden * inter + inter * hidden
    per_row = 2 * per_layer + hidden * TINY.vocab_size  # two layers, then the head
    attention = 2 * 2 * 4 * 16  # q.k and weights.v, per layer, head and key seen
    assert multiply_adds(decoder, 1, 0) == per_row + attention * 1
    assert multiply_adds(decoder, 3, 10) == 3 * per_row + attention * (11 + 12 + 13)


@pytest.mark.skipif(kernels.load() is not None, reason="specdec's CPU kernels cannot be compiled here")
def test_int8_peak_is_positive_on_every_vector_path_and_zero_without_one():
    assert torch.ops.specdec_w4a8.int8_peak(ISA_PATHS["scalar"]) == 0.0
    if isa_path() != "scalar":
        assert torch.ops.specdec_w4a8.int8_peak(ISA_PATHS[isa_path()]) > 1e9  # any x86 vector unit: > 1 G/s


@pytest.mark.parametrize("quantize", ["none", "w4a8"])
def test_cost_curve_measures_every_width_against_both_floors(quantize):
    if quantize == "w4a8" and kernels.load() is not None:
        pytest.skip("specdec's CPU kernels cannot be compiled here")
    decoder = random_decoder(TINY, dtype=torch.float32, quantize=quantize)
    runner = NativeRunner(decoder, max_context=256)
    curve = cost_curve(runner, context=40, tokens=(1, 5, 9), repeats=2)
    assert [row.tokens for row in curve.rows] == [1, 5, 9]
    assert curve.bandwidth > 0 and curve.peak > 0 and curve.weight_bytes == weight_bytes(decoder)
    assert ("int8" in curve.peak_kind) == (quantize == "w4a8" and isa_path() != "scalar")
    for row in curve.rows:
        assert row.seconds > 0
        assert row.weight_floor_s == pytest.approx(curve.weight_bytes / curve.bandwidth)
        assert row.arithmetic_floor_s == pytest.approx(multiply_adds(decoder, row.tokens, 40) / curve.peak)
        assert row.floor_s == max(row.weight_floor_s, row.arithmetic_floor_s)
    assert runner.cache.seq_lens == [0]  # left empty
    table = curve.table()
    assert "after 40 cached tokens" in table and table.count("\n") == 2 + 2


def test_cost_curve_drops_widths_past_the_context():
    runner = NativeRunner(random_decoder(TINY, dtype=torch.float32), max_context=48)
    curve = cost_curve(runner, context=40, tokens=(1, 5, 9), repeats=1)
    assert [row.tokens for row in curve.rows] == [1, 5]


def test_the_bandwidth_buffer_outgrows_the_last_level_cache(tmp_path, monkeypatch):
    """The weight floor's bandwidth must come from memory, not cache: four times the largest cache
    sysfs reports (VMs on 480 MB-L3 hosts report it), 256 MB at least."""
    for index, size in enumerate(["48K", "2048K", "491520K"]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert last_level_cache_bytes(tmp_path) == 491520 * 2**10
    assert last_level_cache_bytes(tmp_path / "absent") == 0
    import specdec.analysis.roofline as roofline

    allocated = []
    monkeypatch.setattr(roofline.huge_pages, "zeros",
                        lambda shape, dtype: allocated.append(shape[0] * dtype.itemsize) or torch.zeros(16))
    monkeypatch.setattr(roofline, "last_level_cache_bytes", lambda: 100 * 2**20)
    measure_bandwidth(repeats=1)
    monkeypatch.setattr(roofline, "last_level_cache_bytes", lambda: 0)
    measure_bandwidth(repeats=1)
    assert allocated == [400 * 2**20, 256 * 2**20]


def test_bandwidth_reads_the_weights_own_pages_where_they_are_large_enough(monkeypatch):
    """The weight floor reads the decoder's own weight mapping (its placement is the step's), and a
    buffer of its own only where that mapping is smaller than the probe must be."""
    import specdec.analysis.roofline as roofline

    timed = []
    monkeypatch.setattr(roofline, "median_seconds", lambda work, device, repeats: timed.append(work()) or 0.5)
    allocated = []
    monkeypatch.setattr(roofline.huge_pages, "zeros",
                        lambda shape, dtype: allocated.append(shape[0] * dtype.itemsize) or torch.zeros(16))
    pages = torch.zeros(2**20, dtype=torch.uint8)
    pages[-4] = 7
    assert measure_bandwidth(megabytes=1, pages=pages) == 2**20 / 0.5 and allocated == []
    assert [int(value) for value in timed] == [7]  # the int32 maximum over the pages' bytes: every byte read
    measure_bandwidth(megabytes=2, pages=pages)  # smaller than 2 MB: a buffer instead
    assert allocated == [2 * 2**20]

