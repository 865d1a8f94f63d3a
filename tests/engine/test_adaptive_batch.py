"""-k auto over a batch (engine/adaptive.py, the controller SpecEngine uses over one row): the step's k
follows measured costs and every row's acceptance, and never changes what a row writes."""

from __future__ import annotations

import pytest

from conftest import make_model, make_native, run_all
from specdec.analysis.lossless import homogeneity_test
from specdec.engine import SpecEngine
from specdec.engine.batch import BatchEngine
from specdec.engine.adaptive import AdaptiveK
from specdec.models.hf import HFRunner
from specdec.proposers.batched import RowwiseProposer
from specdec.proposers.registry import build_proposer
from specdec.sampling import SamplingParams

from batching import PROMPTS
from test_adaptive import AlwaysWrong


def _costs(controller: AdaptiveK, handles: str, plain_s: float, per_token_s: float, accepted: list[int],
           per_position_s: float = 0.0) -> None:
    """Plain steps and steps of 4 drafts per row, each row accepting its `accepted` of them; the
    forward costs plain_s plus per_token_s for each row's extra token."""
    rows = len(handles)
    for handle in handles:
        controller.start_row(handle)
    for _ in range(10):
        controller.record(list(handles), [0] * rows, [0] * rows, [0] * rows, draft_s=0.0, tokens=rows, verify_s=plain_s)
        controller.record(list(handles), [4] * rows, [4] * rows, accepted, draft_s=per_position_s * 4, tokens=rows * 5,
                          verify_s=plain_s + per_token_s * rows * 4)


def test_cheap_verification_and_good_acceptance_draft_the_most():
    controller = AdaptiveK(max_k=8)
    _costs(controller, "ab", plain_s=0.1, per_token_s=0.001, accepted=[4, 4])  # a GPU-like step: tokens almost free
    assert controller.choose(["a", "b"], [8, 8]) == [8, 8]
    assert controller.choose(["a", "b"], [8, 2]) == [8, 2]  # a row's cap (its remaining tokens) holds
    controller.start_row("c")  # a newcomer starts slowly, beside rows drafting 8
    assert controller.choose(["a", "b", "c"], [8, 8, 8]) == [8, 8, 2]


def test_dear_verification_or_poor_acceptance_decode_plainly_then_probe():
    controller = AdaptiveK(max_k=8, explore_every=3)
    # A CPU with a full batch (a token ~ half a step), and no draft ever accepted.
    _costs(controller, "abcd", plain_s=0.1, per_token_s=0.05, accepted=[0] * 4)
    choices = [controller.choose(list("abcd"), [8] * 4) for _ in range(3)]
    assert choices[:2] == [[0] * 4, [0] * 4] and choices[2] == [1] * 4  # the third step probes with one draft
    # The probe brought nothing back: the next one waits twice as long (6 steps), then 12.
    probes = []
    for step in range(1, 19):
        if controller.choose(list("abcd"), [8] * 4) == [1] * 4:
            probes.append(step)
            controller.record(list("abcd"), [1] * 4, [1] * 4, [0] * 4, draft_s=0.01, tokens=8, verify_s=0.3)
    assert probes == [6, 18]
    controller.start_row("e")  # a newcomer beside running rows does not start the probing over
    wait = next(step for step in range(1, 40) if controller.choose(list("abcde"), [8] * 5) == [1] * 5)
    assert wait == 24


def test_rows_that_seldom_propose_count_as_plain_rows_that_pay_the_widest():
    """Four rows whose drafts are mostly accepted, a token costing a tenth of a plain step: drafting pays
    where every row proposes each step, not where each proposes one step in five (an n-gram that seldom
    finds a match), since the rows without a proposal commit one token and still pay the widest row."""
    always, seldom = AdaptiveK(max_k=8), AdaptiveK(max_k=8)
    for controller in (always, seldom):
        _costs(controller, "abcd", plain_s=0.1, per_token_s=0.01, accepted=[3] * 4)
    for _ in range(10):
        for proposing in (True, False, False, False, False):
            drafted = [4 if proposing else 0] * 4
            seldom.record(list("abcd"), [4] * 4, drafted, [3 if proposing else 0] * 4,
                          draft_s=0.004 if proposing else 0.0, tokens=20 if proposing else 4,
                          verify_s=0.26 if proposing else 0.1)
    assert always.choose(list("abcd"), [8] * 4)[0] >= 2
    assert seldom.choose(list("abcd"), [8] * 4) == [0] * 4


def test_acceptance_and_costs_pick_a_middle_k():
    """alpha 0.8, a draft token costing a fifth of a step: Leviathan et al.'s optimum is a few tokens."""
    controller = AdaptiveK(max_k=8)
    _costs(controller, "a", plain_s=0.1, per_token_s=0.02, accepted=[3])
    k = controller.choose(["a"], [8])[0]
    assert 2 <= k <= 6
    controller.start_row("new")
    assert controller.choose(["new"], [8])[0] >= 1  # a new request starts from the engine's rates
    assert AdaptiveK(max_k=4).choose(["a", "b"], [4, 4]) == [0, 0]  # no plain step measured yet: measure one


def test_a_lookahead_window_counts_as_verified_tokens():
    """The same costs and acceptance, but every drafting row also carries a 16-token Jacobi window:
    drafting then costs at least 0.42 s a step for at most ~4.3 tokens, against 10 tokens/s plain."""
    controller = AdaptiveK(max_k=8, extra_tokens=16)
    _costs(controller, "a", plain_s=0.1, per_token_s=0.02, accepted=[3])
    assert controller.choose(["a"], [8]) == [0]


@pytest.fixture(scope="module")
def models():
    return make_model(seed=0, random_bias=True), make_model(seed=1, layers=1, random_bias=True)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_auto_k_keeps_greedy_output_equal_to_each_request_alone(models, tokenizer, method):
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
    measured = {tokens for tokens, _ in engine.adaptive._verify_s.samples}  # the forwards' sizes
    assert len(measured) >= 3 and engine.adaptive._drafted_steps  # plain and drafting steps: k varied


def test_auto_k_sampling_over_a_batch_is_lossless(models, tokenizer):
    outcomes = {}
    for method in ("draft", "autoregressive"):
        target, draft = make_native(models[0], batch_size=6), make_native(models[1], batch_size=6)
        engine = BatchEngine(target, build_proposer(method, slots=6, draft_runner=draft), tokenizer,
                             k="auto" if method == "draft" else 1, max_k=4)
        requests = {i: engine.make_request("the cat", SamplingParams(temperature=1.0, seed=500 + i),
                                           max_new_tokens=3, ignore_eos=True) for i in range(240)}
        outcomes[method] = [tuple(tokens[:2]) for tokens, _ in run_all(engine, requests).values()]
    assert homogeneity_test(outcomes["draft"], outcomes["autoregressive"]).p_value > 1e-3


class CpuLikeTimings(AdaptiveK):
    """The real controller, fed fixed times: a forward costs 0.1 s plus 0.01 s a token, a draft 1 ms a token."""

    def record(self, handles, asked, drafted, accepted, *, draft_s, tokens, verify_s, caught_up=0, sources=None):
        super().record(handles, asked, drafted, accepted, draft_s=0.001 * max(drafted), tokens=tokens,
                       verify_s=0.1 + 0.01 * tokens, caught_up=caught_up, sources=sources)


def test_auto_k_over_a_batch_backs_off_when_every_draft_fails(models, tokenizer):
    """Two rows whose drafts the target never accepts: after the slow start the rows are asked to draft
    only in one-token probes (the controller's choice reaches the proposer), and every output is the
    plain one."""
    hf = HFRunner(models[0])
    wrong = [AlwaysWrong(hf), AlwaysWrong(hf)]
    rows = iter(wrong)
    engine = BatchEngine(make_native(models[0], batch_size=2), RowwiseProposer(lambda: next(rows), 2), tokenizer,
                         k="auto", max_k=8, eos_token_ids=frozenset())
    engine.adaptive = CpuLikeTimings(max_k=8)  # fixed step times: tiny models' timings are noise
    plain = SpecEngine(make_native(models[0]), None, tokenizer, eos_token_ids=frozenset())
    params = SamplingParams(temperature=0)
    requests = {i: engine.make_request(prompt, params, max_new_tokens=40) for i, prompt in enumerate(PROMPTS[:2])}
    got = run_all(engine, requests)
    for i, prompt in enumerate(PROMPTS[:2]):
        assert got[i][0] == plain.generate(prompt, params, max_new_tokens=40).token_ids
    for proposer in wrong:  # slow start: k 2 until a step's drafts are all accepted; then one-token probes
        assert proposer.asked and proposer.asked == sorted(proposer.asked, reverse=True) <= [2] * 12
    asked = [k for proposer in wrong for k in proposer.asked]
    assert 1 in asked and len(asked) <= 12  # the probes, after 8 then 16 plain steps
