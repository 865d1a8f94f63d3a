"""Captured steps (models/native/captured.py): fixed-shape forwards whose inputs go through static
buffers, recorded once as CUDA graphs and replayed.

A CPU cannot record a CUDA graph, so here a step "replays" by recomputing from its buffers into
the output tensors of its first run, which is what a replayed graph does. Everything around the
graph is then the code that runs on a GPU: the buffers, the key buckets, the slot writes, the
step cache and its invalidation, the clones. A forgotten input copy would replay stale buffers
and fail these equalities. The recording itself is checked on a GPU (benchmarks/cuda_check.py).
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_model, make_native
from replaying import replaying, replays  # noqa: F401 - replaying is a fixture
from specdec.models.kv_cache import SlotRows, StaticKVCache
from specdec.models.native import captured
from specdec.models.native.captured import FixedSteps, StaticStep, key_bucket
from specdec.sampling.tree import tree_attention_mask

STEP = 16


@pytest.fixture(scope="module")
def model():
    return make_model(seed=7, random_bias=True)


def test_key_buckets_are_powers_of_two_within_the_cache():
    assert [key_bucket(n, 10_000) for n in (1, 256, 257, 1000, 4096, 4097)] == [256, 256, 512, 1024, 4096, 8192]
    assert key_bucket(4097, 5000) == 5056  # the cache's largest capacity, in whole key blocks


def test_slot_writes_put_keys_where_cache_rows_do():
    shape = dict(num_layers=2, batch_size=3, num_kv_heads=2, head_dim=4, max_capacity=64,
                 dtype=torch.float32, device=torch.device("cpu"), initial_capacity=64)
    by_rows, by_slots = StaticKVCache(**shape), StaticKVCache(**shape)
    for cache in (by_rows, by_slots):
        cache.seq_lens = [5, 0, 9]
    keys, values = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
    by_rows.rows(1, 3).write(1, keys, values)
    SlotRows(by_slots, 1, 3, torch.tensor([[0, 1, 2], [9, 10, 11]])).write(1, keys, values)
    assert torch.equal(by_rows.keys, by_slots.keys) and torch.equal(by_rows.values, by_slots.values)
    assert by_slots.keys[1, 2, :, 9:12].abs().sum() > 0


def test_replayed_chain_and_tree_steps_equal_the_unpadded_forward(model, replaying):
    """A prefill in pieces, chain steps, a rollback and a tree, replayed: the logits of an unpadded runner."""
    plain, replayed = make_native(model), replaying(make_native(model, step_tokens=STEP))
    ids = torch.randint(2, 30, (1, 60), generator=torch.Generator().manual_seed(1))
    tree = tree_attention_mask([(i - 1) // 2 - 1 for i in range(1, 7)])[None]
    results = []
    for runner in (plain, replayed):
        got = [runner.forward(ids[:, :40], torch.arange(40)[None], last_n_logits=1).logits]
        for start in (40, 43, 45):
            got.append(runner.forward(ids[:, start:start + 3], torch.arange(start, start + 3)[None]).logits)
            runner.truncate([start + 2 if start == 43 else start + 3])
        start = runner.seq_len
        got.append(runner.forward(ids[:, 50:57], start + tree.sum(-1) - 1, among_new=tree).logits)
        runner.truncate([start + 1])
        got.append(runner.forward(ids[:, 57:58], torch.tensor([[start + 1]])).logits)
        results.append(got)
    assert all(torch.equal(a, b) for a, b in zip(results[1], results[0]))
    assert replayed.fixed_steps.recorded == 2 and replays(replayed) == 6  # one chain and one tree step


def test_a_cache_that_grows_drops_its_recorded_steps(model, replaying):
    plain, replayed = make_native(model), replaying(make_native(model, step_tokens=STEP, initial_cache_len=64))
    ids = torch.randint(2, 30, (1, 250), generator=torch.Generator().manual_seed(2))
    expected = plain.forward(ids, torch.arange(250)[None]).logits
    first = replayed.forward(ids[:, :200], torch.arange(200)[None]).logits
    storage = replayed.cache.keys
    second = replayed.forward(ids[:, 200:], torch.arange(200, 250)[None]).logits
    assert replayed.cache.keys is not storage  # past 256 slots with the padding: the storage grew
    assert torch.equal(torch.cat([first, second], dim=1), expected)
    # Back under 256 slots: the 256-slot step again, which must read the new storage, not the old.
    for runner in (plain, replayed):
        runner.truncate([150])
    again = [runner.forward(ids[:, 150:153], torch.arange(150, 153)[None]).logits for runner in (plain, replayed)]
    assert torch.equal(again[1], again[0])


def test_recorded_steps_are_bounded(model, replaying, monkeypatch):
    monkeypatch.setattr(captured, "MAX_STEPS", 2)
    runner = replaying(make_native(model, step_tokens=STEP, batch_size=3))
    for rows in (slice(0, 1), slice(1, 2), slice(0, 3), slice(2, 3)):
        count = len(range(*rows.indices(3)))
        runner.forward(torch.full((count, 2), 5), torch.arange(2).repeat(count, 1), rows=rows)
    assert len(runner.fixed_steps.steps) == 2 and runner.fixed_steps.recorded == 4
    assert [key[:2] for key in runner.fixed_steps.steps] == [(0, 3), (2, 1)]  # (first row, rows), newest last


def test_a_failed_recording_says_so_and_runs_eagerly(model, monkeypatch, capsys):
    def fail(step, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(StaticStep, "record", fail)
    plain, runner = make_native(model), make_native(model, step_tokens=STEP)
    runner.fixed_steps = FixedSteps(runner.decoder, runner.cache, capture=True)
    ids, positions = torch.arange(3, 12)[None], torch.arange(9)[None]
    assert torch.equal(runner.forward(ids, positions).logits, plain.forward(ids, positions).logits)
    assert not runner.fixed_steps.capture and "recording a CUDA graph failed" in capsys.readouterr().err


def test_cuda_graphs_are_off_on_cpus_and_refused_there(model):
    assert not make_native(model, step_tokens=STEP).cuda_graphs
    with pytest.raises(ValueError, match="CUDA graphs"):
        make_native(model, step_tokens=STEP, cuda_graphs=True)


def test_a_swapped_head_gets_steps_of_its_own(model, replaying):
    """The chunking probe swaps the head (invariance.hidden_only); a graph recorded with one head
    must never replay for the other."""
    from specdec.models.native.invariance import hidden_only

    plain, replayed = make_native(model), replaying(make_native(model, step_tokens=STEP))
    ids = torch.arange(3, 12)[None]
    with hidden_only(replayed.decoder):
        assert replayed.forward(ids[:, :4], torch.arange(4)[None]).logits.shape[-1] == 1
    replayed.truncate([0])
    expected = plain.forward(ids[:, :4], torch.arange(4)[None]).logits
    assert torch.equal(replayed.forward(ids[:, :4], torch.arange(4)[None]).logits, expected)
    assert replayed.fixed_steps.recorded == 2
