"""Goodput-driven k for the batched engine (engine/goodput.py): the choice follows measured costs and
each row's acceptance, and never changes what a row writes."""

from __future__ import annotations

import pytest

from conftest import make_model, make_native, run_all
from specdec.analysis.lossless import homogeneity_test
from specdec.engine import SpecEngine
from specdec.engine.batch import BatchEngine
from specdec.engine.goodput import GoodputK
from specdec.proposers.registry import build_proposer
from specdec.sampling import SamplingParams

from test_batch import PROMPTS


def _costs(controller: GoodputK, rows: int, plain_s: float, per_token_s: float, per_position_s: float = 0.0) -> None:
    for _ in range(5):
        controller.record_step(rows, rows, plain_s, 0, 0.0)
        controller.record_step(rows, rows * 5, plain_s + per_token_s * rows * 4, 4, per_position_s * 4)


def test_cheap_verification_and_good_acceptance_draft_the_most():
    controller = GoodputK(max_k=8)
    _costs(controller, rows=2, plain_s=0.1, per_token_s=0.001)  # a GPU-like step: tokens almost free
    for _ in range(10):
        controller.record_row("a", 4, 4)
        controller.record_row("b", 4, 3)
    assert controller.choose(["a", "b"], [8, 8]) == [8, 8]
    assert controller.choose(["a", "b"], [8, 2]) == [8, 2]  # a row's cap (its remaining tokens) holds


def test_dear_verification_or_poor_acceptance_decode_plainly_then_probe():
    controller = GoodputK(max_k=8, explore_every=3)
    _costs(controller, rows=4, plain_s=0.1, per_token_s=0.05)  # a CPU with a full batch: a token ~ half a step
    for _ in range(10):
        for handle in "abcd":
            controller.record_row(handle, 4, 0)
    choices = [controller.choose(list("abcd"), [8] * 4) for _ in range(3)]
    assert choices[:2] == [[0] * 4, [0] * 4] and choices[2] == [1] * 4  # the third step probes with one draft
    # The probe brought nothing back: the next one waits twice as long (6 steps), then 12.
    controller.record_step(4, 8, 0.15, 1, 0.01)  # the probe drafted (and, above, nothing was accepted)
    probes = []
    for step in range(1, 19):
        if controller.choose(list("abcd"), [8] * 4) == [1] * 4:
            probes.append(step)
            controller.record_step(4, 8, 0.15, 1, 0.01)
    assert probes == [6, 18]


def test_acceptance_and_costs_pick_a_middle_k():
    """alpha 0.8, a draft token costing a fifth of a step: Leviathan et al.'s optimum is a few tokens."""
    controller = GoodputK(max_k=8)
    _costs(controller, rows=1, plain_s=0.1, per_token_s=0.02)
    for _ in range(30):
        controller.record_row("a", 5, 4)
    k = controller.choose(["a"], [8])[0]
    assert 2 <= k <= 6
    assert controller.choose(["new"], [8])[0] >= 1  # a new request starts from the engine's rate
    assert GoodputK(max_k=4).choose(["a", "b"], [4, 4]) == [0, 0]  # no plain step measured yet: measure one


def test_a_lookahead_window_counts_as_verified_tokens():
    """The same costs and acceptance, but every drafting row also carries a 16-token Jacobi window:
    drafting then costs at least 0.42 s a step for at most ~4.3 tokens, against 10 tokens/s plain."""
    controller = GoodputK(max_k=8, extra_tokens=16)
    _costs(controller, rows=1, plain_s=0.1, per_token_s=0.02)
    for _ in range(30):
        controller.record_row("a", 5, 4)
    assert controller.choose(["a"], [8]) == [0]


@pytest.fixture(scope="module")
def models():
    return make_model(seed=0, random_bias=True), make_model(seed=1, layers=1, random_bias=True)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_goodput_k_keeps_greedy_output_equal_to_each_request_alone(models, tokenizer, method):
    target, draft = make_native(models[0], batch_size=3), make_native(models[1], batch_size=3)
    engine = BatchEngine(target, build_proposer(method, slots=3, draft_runner=draft), tokenizer, k="auto",
                         max_k=6)
    plain = SpecEngine(make_native(models[0]), None, tokenizer)
    params = SamplingParams(temperature=0)
    lengths = [30, 7, 25, 40, 12, 33]
    requests = {i: engine.make_request(p, params, max_new_tokens=n) for i, (p, n) in enumerate(zip(PROMPTS, lengths))}
    got = run_all(engine, requests)
    for i, (prompt, n) in enumerate(zip(PROMPTS, lengths)):
        alone = plain.generate(prompt, params, max_new_tokens=n)
        assert got[i] == (alone.token_ids, alone.finish_reason), f"request {i}"
    drafted = {update for update in engine.goodput._plain}  # batch sizes measured plain
    assert drafted and engine.goodput._per_token  # it measured both kinds of step, so k varied


def test_goodput_k_sampling_is_lossless(models, tokenizer):
    outcomes = {}
    for method in ("draft", "autoregressive"):
        target, draft = make_native(models[0], batch_size=6), make_native(models[1], batch_size=6)
        engine = BatchEngine(target, build_proposer(method, slots=6, draft_runner=draft), tokenizer,
                             k="auto" if method == "draft" else 1, max_k=4)
        requests = {i: engine.make_request("the cat", SamplingParams(temperature=1.0, seed=500 + i),
                                           max_new_tokens=3, ignore_eos=True) for i in range(240)}
        outcomes[method] = [tuple(tokens[:2]) for tokens, _ in run_all(engine, requests).values()]
    assert homogeneity_test(outcomes["draft"], outcomes["autoregressive"]).p_value > 1e-3
