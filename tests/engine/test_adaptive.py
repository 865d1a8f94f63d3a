"""Adaptive k (`-k auto`): the controller's choices, and that adaptivity never changes what is emitted."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import VOCAB_SIZE, make_model, make_native
from specdec.analysis.lossless import distribution_tests
from specdec.engine import SpecEngine
from specdec.engine.adaptive import AdaptiveK
from specdec.planning.costs import RecentTimes
from specdec.planning.theory import best_k
from specdec.models.hf import HFRunner
from specdec.proposers import DraftModelProposer, DraftProposal, NgramProposer, NgramThenDraftProposer
from specdec.proposers.base import PROPOSER, ProposeContext, Proposer, Source
from specdec.proposers.hybrid import DRAFT, DRAFT_CONTEXT_WINDOW
from specdec.proposers.batched import BatchProposer, as_batch
from specdec.proposers.registry import build_proposer
from specdec.proposers.stop_rules import ConfidenceStop
from specdec.sampling import SamplingParams

PROMPT = "the quick brown fox"


# ---- the controller on synthetic measurements -------------------------------------------------


def _next(controller: AdaptiveK, handle: str = "a", **options) -> int:
    """The controller's k for one row (SpecEngine's request) with nothing but max_k capping it."""
    return controller.choose([handle], [controller.max_k], **{key: [value] for key, value in options.items()})[0]


def _record(controller: AdaptiveK, drafted: int, accepted: int, draft_s: float, verify_s: float,
            handle: str = "a", caught_up: int = 0) -> None:
    controller.record([handle], [drafted], [drafted], [accepted], draft_s=draft_s, tokens=drafted + 1,
                      verify_s=verify_s, caught_up=caught_up)


def _started(controller: AdaptiveK, handle: str = "a", plain_s: float = 0.1) -> AdaptiveK:
    """A request begins, and its first step is plain (as both engines make it): the plain cost is measured."""
    controller.start_row(handle)
    _record(controller, 0, 0, 0.0, plain_s, handle)
    return controller


def _feed(controller: AdaptiveK, steps: int, accept: float, draft_s: float, verify_s_per_token: float,
          verify_s_fixed: float, handle: str = "a") -> list[int]:
    """Run `steps` synthetic steps: each draft is accepted with probability `accept` while the
    ones before it were (Leviathan et al.'s i.i.d. model), from a seeded generator."""
    rng = random.Random(0)
    chosen = []
    for _ in range(steps):
        k = _next(controller, handle)
        chosen.append(k)
        accepted = 0
        while accepted < k and rng.random() < accept:
            accepted += 1
        _record(controller, k, accepted, draft_s * k, verify_s_fixed + verify_s_per_token * (k + 1), handle)
    return chosen


def test_every_draft_accepted_and_a_cheap_draft_drives_k_to_its_maximum():
    controller = _started(AdaptiveK(max_k=8))
    chosen = _feed(controller, 30, accept=1.0, draft_s=0.001, verify_s_per_token=0.0, verify_s_fixed=0.1)
    assert chosen[:3] == [2, 4, 8]  # slow start: 2, doubling after each step whose drafts were all accepted
    assert chosen[-5:] == [8] * 5


def test_a_slow_first_plain_step_does_not_keep_a_useless_draft_going():
    """The first plain step is the only x = 1 sample until drafting stops, so if a neighbour slowed
    it 10x, every later drafted step looked cheaper than a plain one and a draft that was never
    accepted was asked for one token at every step (test_auto_k_backs_off_when_every_draft_fails
    failed so under CI's load). A larger x's cost now caps a smaller x's: the controller backs off."""
    controller = _started(AdaptiveK(max_k=8), plain_s=0.030)  # steps really take 2-3 ms
    chosen = _feed(controller, 30, accept=0.0, draft_s=0.001, verify_s_per_token=0.0005, verify_s_fixed=0.002)
    assert 0 in chosen[:8] and chosen.count(0) >= 20


def test_a_cost_is_never_above_a_larger_widths():
    times = RecentTimes(32)
    for x, seconds in [(1, 0.030), (2, 0.002), (2, 0.003), (2, 0.002), (5, 0.004), (9, 0.010), (9, 0.011)]:
        times.add(x, seconds)
    cost = times.predictor()
    assert cost(1) == cost(2) == 0.002  # x = 1's single slow sample lowered to x = 2's median
    assert cost(5) == 0.004 and cost(9) == pytest.approx(0.0105)  # the medians of the others, as they were


def test_every_draft_rejected_stops_drafting_but_keeps_exploring():
    """No draft is ever accepted: drafting costs time and buys nothing, so the controller
    decodes plainly (k = 0) and probes with one drafted token after explore_every plain steps,
    each failed probe doubling the gap up to max_explore_every."""
    controller = _started(AdaptiveK(max_k=8, explore_every=4, max_explore_every=16))
    chosen = _feed(controller, 80, accept=0.0, draft_s=0.01, verify_s_per_token=0.001, verify_s_fixed=0.1)
    assert chosen[:3] == [2, 2, 2]  # slow start: no draft accepted, so the cap stays at 2
    first_plain = chosen.index(0)
    probes = [i for i, k in enumerate(chosen) if i > first_plain and k > 0]
    assert all(chosen[i] == 1 for i in probes)
    assert [b - a for a, b in zip(probes, probes[1:])][:3] == [8, 16, 16]  # gaps 8, 16, then capped at 16
    controller.start_row("a")  # a new request (in SpecEngine's one row) probes at the first gap again
    assert [_next(controller) for _ in range(4)] == [0, 0, 0, 1]


def test_plain_decoding_is_chosen_only_where_no_k_pays():
    """A good but slow draft: alpha 0.9 pays at a draft step of 0.02 s (k > 0), not at 0.3 s
    (a draft token costing three plain steps), whatever the acceptance."""
    fast, slow = _started(AdaptiveK(max_k=8)), _started(AdaptiveK(max_k=8))
    fast_k = _feed(fast, 40, accept=0.9, draft_s=0.02, verify_s_per_token=0.0, verify_s_fixed=0.1)
    slow_k = _feed(slow, 40, accept=0.9, draft_s=0.3, verify_s_per_token=0.0, verify_s_fixed=0.1)
    assert min(fast_k[-10:]) >= 3
    assert slow_k[-16:].count(0) >= 15


def test_a_verify_cost_that_grows_with_k_keeps_k_small():
    """Same acceptance (alpha 0.8), but verifying costs as much per token as a plain step: every
    drafted token buys fewer than one expected token per token of verification, so the controller
    decodes plainly (k = 0, probing with one token now and then). With verification flat in k,
    Theorem 3.8's optimum for alpha 0.8, c 0.1 is k = 3 or 4."""
    flat, steep = _started(AdaptiveK(max_k=8)), _started(AdaptiveK(max_k=8), plain_s=0.1)
    flat_k = _feed(flat, 60, accept=0.8, draft_s=0.01, verify_s_per_token=0.0, verify_s_fixed=0.1)
    steep_k = _feed(steep, 60, accept=0.8, draft_s=0.01, verify_s_per_token=0.1, verify_s_fixed=0.0)
    assert set(steep_k[-16:]) <= {0, 1} and steep_k[-16:].count(0) >= 15  # 1: a probe
    assert min(flat_k[-10:]) >= 3


@pytest.mark.parametrize("accept, per_token_s", [(0.9, 0.0), (0.8, 0.01), (0.6, 0.03), (0.3, 0.05)])
def test_one_row_that_always_proposes_gets_planning_best_k(accept, per_token_s):
    """The batch objective at one row whose proposer always drafts is Leviathan et al.'s, as
    planning/theory.py's best_k computes it from the same rates and measured costs."""
    controller = _started(AdaptiveK(max_k=8, ramp_start=8))
    _feed(controller, 40, accept=accept, draft_s=0.005, verify_s_per_token=per_token_s, verify_s_fixed=0.1)
    draft, verify = controller._draft_s["proposer"].predictor(), controller._verify_s.predictor()
    expected = best_k(controller.rates("a"), 0.0, lambda k: max((draft(k) if k else 0.0) + verify(k + 1), 1e-9),
                      8, min_k=0)
    chosen = _next(controller)
    assert chosen == expected or (expected == 0 and chosen == 1)  # after a plain streak, 1 is a probe


def test_a_new_request_starts_from_what_earlier_requests_measured():
    controller = _started(AdaptiveK(max_k=6))
    _feed(controller, 30, accept=1.0, draft_s=0.001, verify_s_per_token=0.0, verify_s_fixed=0.1)
    controller.forget("a")
    controller.start_row("b")
    assert min(controller.rates("b")) > 0.95  # the engine-wide rates carry over (shrunk, so never quite 1)
    assert _next(controller, "b") == 2  # but the request starts slowly
    _record(controller, 2, 2, 0.002, 0.1, "b")
    assert _next(controller, "b") == 4
    _record(controller, 4, 4, 0.004, 0.1, "b")
    assert _next(controller, "b") == 6


def _measured(accept: float) -> AdaptiveK:
    """A controller after 30 steps of one request (draft 0.02 s a token, plain step 0.1 s) and one
    catch-up of 64 tokens in 0.32 s (5 ms a token)."""
    controller = AdaptiveK(max_k=8)
    controller.start_row("a")
    _record(controller, 0, 0, 0.32, 0.1, caught_up=64)
    _feed(controller, 30, accept=accept, draft_s=0.02, verify_s_per_token=0.0, verify_s_fixed=0.1)
    return controller


def test_a_catch_up_that_drafting_cannot_pay_back_is_not_begun():
    """Reading 256 prompt tokens costs 1.28 s. With alpha 0.9 drafting saves more than that over 128
    tokens; with alpha 0.3 it saves ~2 ms a token (0.3 s over 128): that request decodes plainly,
    exploration included, and the next request weighs its own catch-up afresh."""
    good, poor = _measured(0.9), _measured(0.3)
    for controller in (good, poor):
        controller.start_row("b")
    assert _next(good, "b", unread=256, remaining=128) > 0
    assert _next(poor, "b", unread=0, remaining=128) > 0  # nothing to read: drafting pays
    assert _next(poor, "b", unread=256, remaining=128) == 0
    assert [_next(poor, "b") for _ in range(20)] == [0] * 20  # the request stays plain: no exploring
    poor.start_row("c")
    assert _next(poor, "c", unread=256, remaining=100_000) > 0  # a long answer pays it back


def test_the_catch_up_is_weighed_only_before_a_request_drafts():
    """Once a request has drafted, what the proposer has not read is a normal step's catch-up, part of
    its measured draft time: 64 unread tokens with 1 token left would be vetoed at the start."""
    drafted, fresh = _measured(0.5), _measured(0.5)
    fresh.start_row("b")
    assert _next(drafted, unread=64, remaining=1) > 0
    assert _next(fresh, "b", unread=64, remaining=1) == 0


def _poor_request_then_plain(controller: AdaptiveK) -> None:
    """Request "a": its drafts are all rejected, so it decodes plainly; each probe's draft reads the
    tokens committed since the last one (5 ms a token) before drafting its one token (10 ms)."""
    _started(controller)
    for k in (2, 1, 2, 1):
        _record(controller, k, 0, 0.01 * k, 0.1)
    since = 0
    for _ in range(60):
        k = _next(controller)
        since += 1
        _record(controller, k, 0, 0.01 * k + 0.005 * since * (k > 0), 0.1, caught_up=since * (k > 0))
        since *= k == 0
    controller.forget("a")


def test_a_probes_backlog_is_not_counted_as_drafting_cost():
    """After a plain streak a probe's draft first reads what was committed meanwhile (8-64 tokens,
    0.05-0.33 s here) before its one 10 ms draft. That is the price of leaving plain decoding, not
    of drafting: counted as drafting, it made a draft token look 5-30x dearer, and request "b",
    whose first probe is accepted, stayed plain (on the real pair, a math answer after a
    translation: 0.97x plain instead of 1.5x)."""
    controller = AdaptiveK(max_k=8)
    _poor_request_then_plain(controller)
    assert controller._draft_s["proposer"].predictor()(1) == pytest.approx(0.01)
    seconds_per_token = sum(s for _, s in controller._catch_up) / sum(n for n, _ in controller._catch_up)
    assert seconds_per_token == pytest.approx(0.005)
    controller.start_row("b")
    since = 0
    while (k := _next(controller, "b")) == 0:
        since += 1
    assert k == 1  # a probe
    _record(controller, 1, 1, 0.01 + 0.005 * (since + 1), 0.1, "b", caught_up=since + 1)
    assert _next(controller, "b") >= 1  # accepted: drafting pays at 10 ms a draft token


def test_a_probe_that_only_read_a_backlog_probes_again_at_once():
    """A draft model far behind reads one chunk and drafts nothing: the probe has told nothing about
    acceptance, so the next step probes again instead of waiting out another doubled gap."""
    controller = _started(AdaptiveK(max_k=8, explore_every=4))
    for _ in range(3):
        _record(controller, 2, 0, 0.02, 0.1)
    plain = 0
    while (k := _next(controller)) == 0 and plain < 30:
        _record(controller, 0, 0, 0.0, 0.1)
        plain += 1
    assert k == 1 and plain == 3  # a probe: the explore_every-th choice of a plain streak
    controller.record(["a"], [1], [0], [0], draft_s=0.3, tokens=1, verify_s=0.1, caught_up=64)  # read only
    assert _next(controller) == 1


def test_deeper_positions_follow_the_requests_own_rate():
    """Earlier requests' drafts failed at position 0, so the engine never judged position 1. A request
    whose first drafts are all accepted expects its second to be as well (acceptance is bursty), not
    the engine's poor rate: it drafts two tokens after a few steps, as a fresh engine would."""
    controller = AdaptiveK(max_k=8)
    _poor_request_then_plain(controller)
    assert controller._engine_rates[PROPOSER].tried[1] == 0
    controller.start_row("b")
    for _ in range(5):
        controller._record_acceptance(controller._row("b"), PROPOSER, 1, 1)
    rates = controller.rates("b")
    assert rates[0] > 0.75 and rates[1] > 0.75 * rates[0]
    fresh = AdaptiveK(max_k=8)
    fresh.start_row("b")
    for _ in range(5):
        fresh._record_acceptance(fresh._row("b"), PROPOSER, 1, 1)
    assert rates[1] / rates[0] == pytest.approx(fresh.rates("b")[1] / fresh.rates("b")[0], rel=0.25)


@pytest.mark.parametrize("lookup, lookup_accept, expected", [(Source("ngram", 1), 0.1, "draft"),
                                                               (Source("ngram", 3), 0.95, "ngram")])
def test_a_row_offered_two_sources_drafts_from_the_one_that_pays(lookup, lookup_accept, expected):
    """ngram+draft under -k auto: each step the lookup's match (a weak 1-token one, or a 3-token one)
    and the draft model (accepted at 0.8, 10 ms a token) are offered; the row learns each source's
    rates and cost and takes the faster. Asking the lookup first (a fixed k's rule) would copy on
    every step."""
    controller = _started(AdaptiveK(max_k=8, ramp_start=8))
    rng, used = random.Random(0), []
    for _ in range(60):
        k = controller.choose(["a"], [8], sources=[(lookup, DRAFT)])[0]
        source = controller.sources[0]
        used.append(source.name)
        accept, per_token_s = (lookup_accept, 0.0001) if source == lookup else (0.8, 0.01)
        accepted = 0
        while accepted < k and rng.random() < accept:
            accepted += 1
        controller.record(["a"], [k], [k], [accepted], draft_s=per_token_s * k, tokens=k + 1,
                          verify_s=0.1 + 0.001 * k, sources=[source])
    assert used[:2] == ["ngram", "draft"]  # each source's cost is measured first
    assert used[-30:].count(expected) >= 28, used
    draft_s, lookup_s = (controller._draft_s[name].predictor() for name in ("draft", "ngram"))
    assert draft_s(2) > 10 * lookup_s(2)  # costs kept per source


def _both_sources_measured(lookup: Source, lookup_accepted: int, steps: int) -> AdaptiveK:
    """Request "a" after a catch-up of 64 tokens in 0.32 s (5 ms a token) and `steps` steps of 4 drafts,
    alternately from the draft model (all accepted, 10 ms a token) and from `lookup` (lookup_accepted
    of them accepted, 0.1 ms a token); a plain forward 0.1 s, one of 5 tokens 0.105 s."""
    controller = _started(AdaptiveK(max_k=8, ramp_start=8))
    controller.record(["a"], [0], [0], [0], draft_s=0.32, tokens=1, verify_s=0.1, caught_up=64)
    for step in range(steps):
        source = (DRAFT, lookup)[step % 2]
        accepted, per_token_s = (4, 0.01) if source == DRAFT else (lookup_accepted, 0.0001)
        controller.record(["a"], [4], [4], [accepted], draft_s=per_token_s * 4, tokens=5, verify_s=0.105,
                          sources=[source])
    return controller


def test_a_draft_models_prompt_is_read_only_where_it_beats_the_rows_other_source():
    """Request "a" measured the draft model (every draft accepted, 10 ms a token, its catch-up 5 ms a
    token) and one-token matches of the lookup (the first copied token accepted, the next rejected;
    free). Request "b" is offered both with 256 prompt tokens the draft has not read (1.28 s). Against
    plain decoding the draft would repay that over 24 tokens; against the lookup it saves ~35 ms a
    token, which only a longer answer repays: a short one copies instead (not a plain step), a long one
    reads the prompt and drafts."""
    lookup = Source("ngram", 1)
    controller = _both_sources_measured(lookup, lookup_accepted=1, steps=40)
    controller.forget("a")
    for remaining, expected in ((24, lookup), (1000, DRAFT)):
        controller.start_row("b")
        k = controller.choose(["b"], [8], [256], [remaining], [(lookup, DRAFT)])[0]
        assert k > 0 and controller.sources[0] == expected, (remaining, k, controller.sources)


def test_going_back_to_the_draft_model_counts_what_it_must_read_first():
    """A row that drafted from both sources: the draft model (every draft accepted, 10 ms a token) is
    faster than a 2-token match (two of four copied tokens accepted, free) when it is in step, but
    after 40 tokens the lookup committed it must read them first (5 ms a token): then the copy wins."""
    lookup = Source("ngram", 2)
    controller = _both_sources_measured(lookup, lookup_accepted=2, steps=20)
    for unread, expected in ((2, DRAFT), (40, lookup), (2, DRAFT)):
        assert controller.choose(["a"], [8], [unread], [100], [(lookup, DRAFT)])[0] > 0
        assert controller.sources[0] == expected, (unread, controller.sources)


def test_ngram_then_draft_offers_the_lookups_match_and_the_draft_model(draft_runner):
    """sources() says which match the lookup holds; use_sources() routes a row to the draft model
    even where the lookup matched."""
    hybrid = NgramThenDraftProposer(NgramProposer(3, 1), DraftModelProposer(draft_runner))
    context = [5, 9, 12, 5, 9]
    assert hybrid.sources(0, context) == (Source("ngram", 2), DRAFT)
    assert hybrid.sources(0, [5, 9, 12]) == (DRAFT,)
    ctx = ProposeContext(torch.tensor([context]), SamplingParams(), None, VOCAB_SIZE)
    hybrid.use_sources([Source("ngram", 2)])
    assert hybrid.propose([ctx], [3]).token_ids.tolist() == [[12, 5, 9]]  # copied
    hybrid.on_verified(torch.tensor([0]))
    hybrid.use_sources([DRAFT])
    alone = DraftModelProposer(HFRunner(make_model(seed=1, layers=1))).propose([ctx], [3]).token_ids.tolist()
    assert hybrid.propose([ctx], [3]).token_ids.tolist() == alone != [[12, 5, 9]]  # the draft model's guesses
    assert hybrid.steps_by_ngram == 1 and hybrid.steps_by_draft == 1


def test_ngram_then_draft_under_auto_k_drafts_from_the_source_accepted_more(target_runner, tokenizer):
    """A 34-token vocabulary: the lookup finds a match nearly every step, and some of its copies are
    rejected; the draft model is the target itself (every draft accepted), and both cost the same here.
    -k auto learns that and drafts with the model, where the lookup-first rule of a fixed k copied.
    Greedy output stays plain's."""
    prompt = PROMPT + " the quick brown"
    reference = SpecEngine(target_runner, None, tokenizer).generate(prompt, max_new_tokens=60)
    hybrid = NgramThenDraftProposer(NgramProposer(3, 1), DraftModelProposer(HFRunner(make_model(seed=0))))
    engine = SpecEngine(target_runner, hybrid, tokenizer, k="auto", max_k=6)
    engine.adaptive = CheapDraftTimings(max_k=6)
    out = engine.generate(prompt, max_new_tokens=60)
    assert out.token_ids == reference.token_ids
    assert hybrid.steps_by_draft > 2 * hybrid.steps_by_ngram, (hybrid.steps_by_draft, hybrid.steps_by_ngram)
    fixed = NgramThenDraftProposer(NgramProposer(3, 1), DraftModelProposer(HFRunner(make_model(seed=0))))
    assert SpecEngine(target_runner, fixed, tokenizer, k=4).generate(prompt, max_new_tokens=60).token_ids == \
        reference.token_ids
    assert fixed.steps_by_ngram > fixed.steps_by_draft  # the lookup first: it nearly always matches


@pytest.mark.parametrize("bad", [0, -2, 2.5, True])
def test_bad_max_k_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="max_k"):
        AdaptiveK(max_k=bad)


@pytest.mark.parametrize("k", ["Auto", "4", None])
def test_the_engine_takes_an_integer_or_auto(target_runner, k):
    with pytest.raises(ValueError, match="auto"):
        SpecEngine(target_runner, None, None, k=k)


# ---- the proposers' own adaptivity ---------------------------------------------------------------


def _context(tokens: list[int], params: SamplingParams) -> ProposeContext:
    generator = torch.Generator().manual_seed(0) if not params.greedy else None
    return ProposeContext(torch.tensor([tokens]), params, generator, VOCAB_SIZE)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=1.0)])
def test_the_draft_stops_at_its_first_unsure_token(params):
    """A tiny random model is never 99% sure: with that threshold every proposal is one token long,
    with threshold 0 it always runs to max_k."""
    def first_proposal(proposer):
        return proposer.propose([_context([3, 4, 5, 6], params)], [5])

    draft = HFRunner(make_model(seed=1, layers=1))
    unsure = first_proposal(DraftModelProposer(draft, confidence_threshold=0.99))
    assert int(unsure.num_tokens[0]) == 1 and unsure.token_ids.shape == (1, 1)
    assert unsure.probs is None or unsure.probs.shape == (1, 1, VOCAB_SIZE)
    sure = DraftModelProposer(HFRunner(make_model(seed=1, layers=1)), confidence_threshold=0.0)
    assert int(first_proposal(sure).num_tokens[0]) == 5


@pytest.mark.parametrize("bad", [1.0, -0.1, 2])
def test_bad_confidence_threshold_is_a_clear_error(draft_runner, bad):
    with pytest.raises(ValueError, match="confidence"):
        DraftModelProposer(draft_runner, confidence_threshold=bad)


def test_ngram_proposal_length_follows_the_match_length():
    """ngram_max 3, max_k 6: a 3-token match proposes 6 tokens, a 1-token match ceil(6/3) = 2."""
    params = SamplingParams(temperature=0)
    long_match = [1, 2, 3, 10, 11, 12, 13, 14, 15, 16, 1, 2, 3]  # suffix [1, 2, 3] seen before
    short_match = [7, 20, 21, 22, 23, 24, 25, 26, 8, 9, 7]  # only [7] seen before
    for tokens, expected in ((long_match, 6), (short_match, 2)):
        proposer = NgramProposer(3, 1, follow_match=True)
        proposal = proposer.propose(_context(tokens, params), 6)
        assert int(proposal.num_tokens[0]) == expected
        fixed = NgramProposer(3, 1).propose(_context(tokens, params), 6)
        assert fixed.token_ids[0, :expected].tolist() == proposal.token_ids[0].tolist()


# ---- lossless with adaptive k ------------------------------------------------------------------


class AlwaysWrong(Proposer):
    """Drafts max_k tokens the greedy target never picks next (the argmax + 1), a worst case for k."""

    def __init__(self, target: HFRunner) -> None:
        self.target = target
        self.asked: list[int] = []

    def reset(self) -> None:
        pass

    def propose(self, ctx, max_k):
        self.asked.append(max_k)
        with torch.no_grad():
            nxt = int(self.target.model(ctx.token_ids).logits[0, -1].argmax())
        return DraftProposal(torch.tensor([[(nxt + 1) % VOCAB_SIZE] * max_k]), torch.tensor([max_k]), None)

    def on_verified(self, num_accepted):
        pass


AUTO_METHODS = {
    "draft": lambda draft: DraftModelProposer(draft, confidence_threshold=0.3),
    "perfect draft": lambda draft: DraftModelProposer(HFRunner(make_model(seed=0)), confidence_threshold=0.3),
    "ngram": lambda draft: NgramProposer(3, 1, follow_match=True),
    "ngram+draft": lambda draft: NgramThenDraftProposer(NgramProposer(3, 1, follow_match=True),
                                                         DraftModelProposer(draft, confidence_threshold=0.3)),
}


@pytest.mark.parametrize("method", list(AUTO_METHODS))
def test_auto_k_matches_plain_greedy(target_runner, draft_runner, tokenizer, method):
    reference = SpecEngine(target_runner, None, tokenizer).generate(PROMPT + " the quick", max_new_tokens=60)
    engine = SpecEngine(target_runner, AUTO_METHODS[method](draft_runner), tokenizer, k="auto", max_k=6)
    drafted = 0
    for _ in range(2):  # the second request starts from the first one's measurements
        out = engine.generate(PROMPT + " the quick", max_new_tokens=60)
        assert out.token_ids == reference.token_ids
        assert len(out.stats.drafted_per_position) <= 6
        drafted += out.stats.drafted_tokens
    # Over both: whether the second request drafts follows this machine's measured times (a loaded
    # machine may rightly find a tiny draft not worth its step), what the first one tried does not.
    assert drafted > 0


def test_auto_k_backs_off_when_every_draft_fails(target_runner, tokenizer):
    reference = SpecEngine(target_runner, None, tokenizer).generate(PROMPT, max_new_tokens=40)
    proposer = AlwaysWrong(target_runner)
    out = SpecEngine(target_runner, proposer, tokenizer, k="auto", max_k=8).generate(PROMPT, max_new_tokens=40)
    assert out.token_ids == reference.token_ids and out.stats.accepted_tokens == 0
    # After the first steps the draft is asked only to probe: one token, after 8 then 16 plain steps.
    assert proposer.asked[0] == 2 and proposer.asked[-2:] == [1, 1]
    assert len(proposer.asked) <= 6 and out.stats.target_forwards >= 30


def test_the_registry_builds_adaptive_proposers(draft_runner):
    draft = build_proposer("draft", draft_runner=draft_runner, draft_confidence=0.4, adaptive=True)
    assert draft.stop_rule == ConfidenceStop(0.4)
    fixed = build_proposer("draft", draft_runner=draft_runner, draft_confidence=0.4, adaptive=False)
    assert fixed.stop_rule is None  # a fixed k drafts exactly k
    assert build_proposer("ngram", adaptive=True).follow_match
    hybrid = build_proposer("ngram+draft", draft_runner=draft_runner, adaptive=True)
    assert not hybrid.ngram.rows[0].follow_match  # the controller sizes each match length by its own rates
    assert hybrid.draft.context_window == DRAFT_CONTEXT_WINDOW < draft.context_window  # a shorter prompt read
    with pytest.raises(ValueError, match="confidence"):
        build_proposer("draft", draft_runner=draft_runner, draft_confidence=1.5, adaptive=True)


class CountingProposer(BatchProposer):
    """Delegates to a proposer and records the k asked for and how many tokens each proposal holds."""

    def __init__(self, inner) -> None:
        self.inner, self.asked, self.lengths = as_batch(inner), [], []

    def start_row(self, row) -> None:
        self.inner.start_row(row)

    def propose(self, contexts, max_ks):
        proposal = self.inner.propose(contexts, max_ks)
        self.asked.append(max_ks[0])
        self.lengths.append(int(proposal.num_tokens[0]))
        return proposal

    def on_verified(self, num_accepted):
        self.inner.on_verified(num_accepted)


class CheapDraftTimings(AdaptiveK):
    """The real controller, fed fixed step times of a draft 100x cheaper than the target.

    Tiny test models cost the same per forward whatever their size (Python overhead), so
    with measured times k would sit at 1; fixed times make the test deterministic and keep
    k moving with the measured acceptance, which is the history-dependent part under test."""

    def record(self, handles, asked, drafted, accepted, *, draft_s, tokens, verify_s, caught_up=0, sources=None):
        super().record(handles, asked, drafted, accepted, draft_s=0.001 * max(drafted), tokens=tokens, verify_s=0.1,
                       caught_up=caught_up, sources=sources)


def test_auto_k_with_early_stopping_keeps_the_target_distribution():
    """Sampled at T=0.8: 1000 speculative draws with -k auto and a confidence threshold against
    1000 plain draws; the first token and the first two tokens must follow the same law.
    Both the chosen k and the proposals' lengths must really vary, or adaptivity is not tested."""
    params = SamplingParams(temperature=0.8)
    target = make_native(make_model(seed=0))
    draft = make_native(make_model(seed=1, layers=1))
    # A random 64-token model is nearly flat (mean probability 1/64): 0.015 stops about 2 drafts in 3.
    proposer = CountingProposer(DraftModelProposer(draft, confidence_threshold=0.015))
    spec = SpecEngine(target, proposer, None, k="auto", max_k=6, eos_token_ids=frozenset())
    spec.adaptive = CheapDraftTimings(max_k=6, ramp_start=6)  # no slow start: these requests are 2 tokens long
    plain = SpecEngine(target, None, None, eos_token_ids=frozenset())
    prompt = [5, 9, 12, 3, 7]
    spec_draws = list(spec.sample_continuations(prompt, params, 1000))
    plain_draws = list(plain.sample_continuations(prompt, params, 1000, seed=10_000))
    assert len(set(proposer.asked)) >= 3, proposer.asked  # k chosen from the acceptance history
    stopped = sum(n < k for n, k in zip(proposer.lengths, proposer.asked))
    assert 100 < stopped < len(proposer.lengths) - 100, stopped  # the draft stopped early, and not always
    tests = distribution_tests(spec_draws, plain_draws)
    assert all(t.dof >= 3 for t in tests)
    assert min(t.p_value for t in tests) > 1e-4, tests
