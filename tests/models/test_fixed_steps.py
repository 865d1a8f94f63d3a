"""NativeRunner.step_tokens: every forward in calls of one fixed width (what CUDA runs by default).

CPU kernels are batch-invariant by themselves, so here a padded runner must give exactly what an
unpadded one gives: any difference is the padding leaking (a real token seeing a padding token, a
logit or cache entry of the padding kept, a position shifted). On a GPU the same rule is what
makes the kernels' shapes fixed (see NativeRunner); benchmarks/cuda_check.py checks it there.
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_model, make_native, make_peaked_model, run_all
from replaying import replaying, replays  # noqa: F401 - replaying is a fixture
from specdec.engine import SpecEngine
from specdec.engine.batch import BatchEngine
from specdec.models.native.runner import CUDA_STEP_TOKENS, NativeRunner
from specdec.proposers import DraftModelProposer, NgramProposer
from specdec.proposers.lookahead import LookaheadOptions, LookaheadProposer
from specdec.proposers.registry import build_proposer
from specdec.sampling import SamplingParams
from specdec.sampling.tree import tree_attention_mask

STEP = 16


@pytest.fixture(scope="module")
def model():
    return make_model(seed=7, random_bias=True)


def _tree(nodes: int) -> torch.Tensor:
    """[1, n, n] ancestor mask of a tree where node i's parent is (i - 1) // 2 (node 0 the root)."""
    return tree_attention_mask([(i - 1) // 2 - 1 for i in range(1, nodes)])[None]  # drafts' parents; -1: the root


def test_cpu_runners_do_not_pad_and_cuda_runners_do(model):
    assert make_native(model).step_tokens is None
    assert CUDA_STEP_TOKENS == 64
    with pytest.raises(ValueError, match="step_tokens must be"):
        make_native(model, step_tokens=0)


@pytest.mark.parametrize("prompt_len,new", [(5, 1), (40, 5), (16, 16), (3, 37)])
def test_padded_chain_forwards_equal_unpadded_ones(model, prompt_len, new):
    """A prefill (chunked when longer than a step) then one chain forward: same logits, hidden and
    cache lengths; the next forward still sees exactly the kept entries."""
    plain, padded = make_native(model), make_native(model, step_tokens=STEP)
    generator = torch.Generator().manual_seed(prompt_len)
    ids = torch.randint(2, 30, (1, prompt_len + new + 1), generator=generator)
    outputs = []
    for runner in (plain, padded):
        first = runner.forward(ids[:, :prompt_len], torch.arange(prompt_len)[None], last_n_logits=1)
        step = runner.forward(ids[:, prompt_len:prompt_len + new], torch.arange(prompt_len, prompt_len + new)[None])
        runner.truncate([prompt_len + new - 1])  # a rejected last token, as verification rolls back
        after = runner.forward(ids[:, prompt_len + new - 1:prompt_len + new + 1],
                               torch.arange(prompt_len + new - 1, prompt_len + new + 1)[None])
        outputs.append((first.logits, step.logits, step.hidden, after.logits, runner.seq_len))
    for got, expected in zip(outputs[1], outputs[0]):
        assert (got == expected) if isinstance(got, int) else torch.equal(got, expected)
    assert outputs[1][0].shape[1] == 1 and outputs[1][1].shape[1] == new


@pytest.mark.parametrize("nodes", [7, STEP, 2 * STEP - 3])  # within one step, a full step, padded to two
def test_padded_tree_forwards_equal_unpadded_ones(model, nodes):
    plain, padded = make_native(model), make_native(model, step_tokens=STEP)
    ids = torch.arange(3, 3 + 20)[None]
    tree_ids = torch.randint(2, 30, (1, nodes), generator=torch.Generator().manual_seed(nodes))
    mask = _tree(nodes)
    positions = 20 + mask.sum(-1) - 1
    results = []
    for runner in (plain, padded):
        runner.forward(ids, torch.arange(20)[None], last_n_logits=1)
        results.append(runner.forward(tree_ids, positions, among_new=mask).logits)
        assert runner.seq_len == 20 + nodes
    assert torch.equal(results[1], results[0])


def test_padding_needs_no_room_past_the_context_and_overflow_is_a_clear_error(model):
    runner = make_native(model, max_context=40, step_tokens=STEP)
    runner.forward(torch.arange(2, 38)[None], torch.arange(36)[None], last_n_logits=1)
    runner.forward(torch.tensor([[5, 6, 7, 8]]), torch.arange(36, 40)[None])  # the context's last 4 slots
    assert runner.seq_len == 40
    with pytest.raises(ValueError, match="41 tokens do not fit the model's context of 40 tokens"):
        runner.forward(torch.tensor([[5]]), torch.tensor([[40]]))


@pytest.mark.parametrize("method,replayed", [("draft", False), ("ngram", False), ("lookahead", False),
                                             ("draft", True), ("lookahead", True)])
def test_speculative_greedy_on_a_padded_runner_equals_plain_greedy(model, tokenizer, replaying, method, replayed):
    """Eager fixed steps, and recorded ones replayed (models/native/captured.py, as on CUDA)."""
    record = replaying if replayed else (lambda runner: runner)
    plain = SpecEngine(make_native(model), None, tokenizer, eos_token_ids=frozenset())
    padded = record(make_native(model, step_tokens=STEP))
    proposer = {"draft": DraftModelProposer(record(make_native(make_model(seed=8, layers=1), step_tokens=STEP))),
                "ngram": NgramProposer(), "lookahead": LookaheadProposer(LookaheadOptions(window=5, guesses=4))}[method]
    params = SamplingParams(temperature=0)
    for prompt in ("abc abc abc abc", "the quick brown fox jumps over the lazy dog"):
        expected = plain.generate(prompt, params, max_new_tokens=40).token_ids
        out = SpecEngine(padded, proposer, tokenizer, k=4, eos_token_ids=frozenset()).generate(
            prompt, params, max_new_tokens=40)
        assert out.token_ids == expected and out.stats.drafted_tokens > 0
    assert not replayed or replays(padded) > 10


@pytest.mark.parametrize("replayed", [False, True])
def test_batched_rows_on_padded_runners_equal_each_alone(tokenizer, replaying, replayed):
    model, params = make_peaked_model(seed=3), SamplingParams(temperature=0)
    prompts = ["abc abc abc abc", "hello hello hello", "one two one two"]
    target = make_native(model, batch_size=3, step_tokens=STEP)
    if replayed:
        replaying(target)
    engine = BatchEngine(target, build_proposer("ngram", slots=3), tokenizer, k=4)
    requests = {i: engine.make_request(p, params, max_new_tokens=30, ignore_eos=True) for i, p in enumerate(prompts)}
    got = run_all(engine, requests)
    plain = SpecEngine(make_native(model), None, tokenizer, eos_token_ids=frozenset())
    for i, prompt in enumerate(prompts):
        assert got[i] == (plain.generate(prompt, params, max_new_tokens=30).token_ids, "length")
    assert not replayed or replays(target) > 0


def test_with_batch_size_keeps_the_step(model):
    runner = make_native(model, step_tokens=STEP)
    assert runner.with_batch_size(3).step_tokens == STEP
    assert isinstance(runner.with_batch_size(3), NativeRunner)


def test_the_probes_check_a_fixed_step_runner_at_its_own_shapes(model):
    from specdec.models.native.invariance import cheap_probe, probe_projections

    runner = make_native(model, step_tokens=STEP)
    report = probe_projections(runner.decoder, step=STEP)
    assert [case.name.split(", ")[1] for case in report.cases[:5]] == [
        f"{STEP * b} rows vs blocks of {STEP}" for b in (1, 2, 3, 4, 8)]
    assert report.ok
    assert cheap_probe(runner.decoder, step=STEP).ok and runner.check_invariance()


def test_gpu_projections_run_each_rows_block_alone():
    """DenseLinear's GPU path (row_block = the runner's step): a batched step's GEMMs never see
    more rows than one row's step, so cuBLAS's kernel choice cannot depend on the batch."""
    from specdec.models.native.linear import in_row_blocks

    weight, calls = torch.randn(6, 8), []

    def project(rows):
        calls.append(rows.shape[0])
        return rows @ weight.T

    x = torch.randn(3, 16, 8)
    out = in_row_blocks(x, 6, STEP, project)
    assert calls == [STEP] * 3 and out.shape == (3, 16, 6)
    assert torch.equal(out, torch.cat([project(row) for row in x]).reshape(3, 16, 6))
    calls.clear()
    assert torch.equal(in_row_blocks(x, 6, None, project), (x.reshape(-1, 8) @ weight.T).reshape(3, 16, 6))
    assert calls == [48]
