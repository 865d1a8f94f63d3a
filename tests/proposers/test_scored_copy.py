"""Scored copying (--method copy): the choice, its costs, its corpus, its scorer file, and greedy
output that is plain decoding's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import make_model, make_native
from specdec.engine import SpecEngine
from specdec.proposers.base import ProposeContext
from specdec.proposers.copy_candidates import (HAZARD_FEATURES, LogisticScorer, best_by_length, choose_draft, hazard_rows,
                                               load_scorer, shipped_scorer_data, step_candidates)
from specdec.proposers.copy_corpus import CopyCorpus, TenantCopyCorpora
from specdec.proposers.registry import build_proposer
from specdec.proposers.scored_copy import CopyOptions, ScoredCopyProposer
from specdec.proposers.step_costs import StepCosts
from specdec.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = ["abc abc abc abc, abc abc", "the quick brown fox jumps over the quick brown fox", "one two three"]


def constant(hazard: float) -> LogisticScorer:
    """A scorer whose every drafted token is accepted with probability `hazard`."""
    n = len(HAZARD_FEATURES)
    return LogisticScorer(np.zeros(n), np.ones(n), np.zeros(n), float(np.log(hazard / (1 - hazard))))


def propose(proposer, tokens, max_k=8):
    proposal = proposer.propose(ProposeContext(torch.tensor([tokens]), GREEDY, None, 100), max_k)
    return proposal.token_ids[0, :int(proposal.num_tokens[0])].tolist()


def test_the_cost_curve_decides_how_far_to_draft():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1]  # "1" occurred once: its continuation is 2..11
    flat = ScoredCopyProposer(constant(0.9), CopyCorpus(0), StepCosts(lambda n: 1.0, measured=False))
    assert propose(flat, tokens) == [2, 3, 4, 5, 6, 7, 8, 9]  # free tokens: draft all k
    steep = ScoredCopyProposer(constant(0.9), CopyCorpus(0), StepCosts(lambda n: float(n), measured=False))
    assert propose(steep, tokens) == []  # a token costs a step: (1 + 0.9) / 2 < 1, plain decoding wins
    middle = ScoredCopyProposer(constant(0.9), CopyCorpus(0), StepCosts(lambda n: 1 + 0.3 * (n - 1), measured=False))
    assert 1 <= len(propose(middle, tokens)) < 8


def test_choose_draft_is_the_best_rate_over_every_candidate_and_length():
    rng = np.random.default_rng(0)
    cost = lambda n: 1 + 0.15 * (n - 1) ** 1.2
    checked = 0
    for trial in range(40):
        context = rng.integers(0, 5, 80)
        step = step_candidates(0, context, 40, None, None, k=6)
        if step is None:
            continue
        x, candidate, depth = hazard_rows(step, 6)
        hazard = rng.random(len(x))
        best = (-1, 0, 1 / cost(1))
        by_length = np.zeros(7)  # the most expected accepted at each length (a shorter candidate: all of it)
        for c in range(len(step)):
            survive, expected = 1.0, 0.0
            for row in np.flatnonzero(candidate == c):
                survive *= hazard[row]
                expected += survive
                by_length[depth[row]:] = np.maximum(by_length[depth[row]:], expected)
                rate = (1 + expected) / cost(1 + depth[row])
                if rate > best[2]:
                    best = (c, int(depth[row]), rate)
        chosen = choose_draft(step, hazard, cost, 6)
        assert chosen[:2] == best[:2]
        expected, which = best_by_length(step, hazard, 6)
        np.testing.assert_allclose(expected, by_length)
        assert which[0] == -1 and all(0 <= c < len(step) for c in which[1:])
        checked += 1
    assert checked > 30


def test_a_batch_chooses_the_width_with_the_most_tokens_per_forward_cost(tokenizer):
    """ScoredCopyRows: the batch's forward is rows x width wide, so the rows choose one width W,
    maximising (B + sum of each row's best E(W - 1)) / cost(B x W); alone, a row drafts deeper."""
    from specdec.proposers.scored_copy import ScoredCopyRows

    costs = StepCosts(lambda n: 1 + 0.1 * (n - 1), measured=False)
    copying = torch.tensor([[5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 8, 9, 1, 2, 5, 6]])
    fresh = torch.tensor([[3, 4, 10, 11, 12, 13]])  # nothing to copy
    greedy = SamplingParams(temperature=0)
    make = lambda: ScoredCopyProposer(constant(0.9), CopyCorpus(0), costs)
    alone = make().propose(ProposeContext(copying, greedy, None, 64), 8)
    expected = [0.0] + [sum(0.9 ** i for i in range(1, d + 1)) for d in range(1, 9)]
    for rows, contexts in ((4, [copying] * 4), (4, [copying, fresh, fresh, fresh])):
        copies = sum(context is copying for context in contexts)
        rates = {w: (rows + copies * expected[min(w - 1, 7)]) / costs.cost(rows * w) for w in range(1, 10)}
        width = max(rates, key=lambda w: (rates[w], -w))
        batch = ScoredCopyRows(make, rows).propose([ProposeContext(c, greedy, None, 64) for c in contexts], [8] * rows)
        drafted = batch.num_tokens.tolist()
        assert drafted == [width - 1 if c is copying else 0 for c in contexts], (drafted, width)
        assert width - 1 < int(alone.num_tokens[0])
    one = ScoredCopyRows(make, 1).propose([ProposeContext(copying, greedy, None, 64)], [8])
    assert one.token_ids.tolist() == alone.token_ids.tolist()


def test_step_costs_follow_the_measured_times_once_two_sizes_are_seen():
    costs = StepCosts(prior=lambda n: 1 + 0.5 * (n - 1))
    assert costs.cost(5) == 3.0  # the prior
    for _ in range(3):
        costs.record(1, 0.010)
    assert costs.cost(5) == 3.0  # one size measured: still the prior
    for _ in range(3):
        costs.record(9, 0.012)
    assert costs.cost(9) == pytest.approx(1.2) and costs.cost(1) == 1.0
    fixed = StepCosts(prior=lambda n: 2.0, measured=False)
    fixed.record(1, 0.01), fixed.record(9, 0.5)
    assert fixed.cost(9) == 2.0


def test_trees_are_timed_apart_from_chains():
    """On a GPU a tree's step costs more than a chain's of as many tokens: its own times price it
    once measured; before that, and never below, a chain's of as many tokens."""
    costs = StepCosts(prior=lambda n: 1.0)
    for tokens, seconds in ((1, 0.007), (9, 0.007)):
        for _ in range(3):
            costs.record(tokens, seconds)
    assert costs.tree_cost(9) == pytest.approx(1.0)  # no tree measured: a chain's price
    for _ in range(3):
        costs.record(9, 0.0112, tree=True)
    assert costs.tree_cost(9) == pytest.approx(1.6) and costs.cost(9) == pytest.approx(1.0)
    cpu_like = StepCosts(prior=lambda n: 1.0)
    for tokens, seconds, tree in ((1, 0.010, False), (9, 0.020, False), (9, 0.019, True)):
        cpu_like.record(tokens, seconds, tree=tree)
    assert cpu_like.tree_cost(9) == pytest.approx(2.0)  # never below the chain's


def test_a_tree_is_drafted_only_where_it_beats_the_chain_at_its_price():
    # "5" was followed by 6 7 8 twice and by 6 9 4 once: the chain 6 7 8 is likelier.
    tokens = [1, 5, 6, 7, 8, 2, 5, 6, 9, 4, 3, 5, 6, 7, 8, 0, 5]
    shapes = {}
    for name, tree_price in (("cheap", 1.0), ("dear", 1.6)):
        costs = StepCosts(lambda n: 1.0, measured=False, tree_prior=lambda n, p=tree_price: p)
        proposer = ScoredCopyProposer(constant(0.7), CopyCorpus(0), costs, trees=True)
        proposal = proposer.propose(ProposeContext(torch.tensor([tokens]), GREEDY, None, 100), 3)
        shapes[name] = (proposal.tree(), proposal.token_ids[0, :int(proposal.num_tokens[0])].tolist())
    assert shapes["cheap"][0] is not None and {7, 9} <= set(shapes["cheap"][1])  # both branches
    assert shapes["dear"] == (None, [6, 7, 8])  # the chain alone
    # Measured costs: chains until a chain step of another size than plain's has priced them.
    costs = StepCosts(lambda n: 1.0)
    proposer = ScoredCopyProposer(constant(0.7), CopyCorpus(0), costs, trees=True)
    costs.record(1, 0.007)
    assert proposer.propose(ProposeContext(torch.tensor([tokens]), GREEDY, None, 100), 3).tree() is None
    costs.record(4, 0.007)
    assert proposer.propose(ProposeContext(torch.tensor([tokens]), GREEDY, None, 100), 3).tree() is not None


def test_earlier_requests_are_copied_from_within_a_tenant_only():
    corpora = TenantCopyCorpora()
    alice = ScoredCopyProposer(constant(0.9), corpora, StepCosts(lambda n: 1.0, measured=False))
    alice.start_tenant("alice")
    alice.end_request([50, 51], [7, 8, 9, 10, 11, 12])
    bob = ScoredCopyProposer(constant(0.9), corpora, StepCosts(lambda n: 1.0, measured=False))
    bob.start_tenant("bob")
    assert propose(bob, [30, 31, 7]) == []  # alice's answer is not bob's to copy
    alice.reset()
    assert propose(alice, [30, 31, 7]) == [8, 9, 10, 11, 12]
    alice.forget_earlier_requests()
    assert propose(alice, [30, 31, 7]) == []


def test_the_corpus_keeps_the_newest_texts_within_its_size():
    corpus = CopyCorpus(max_tokens=8)  # tokens, separators not counted
    corpus.add([1, 2, 3], [4, 5, 6])
    corpus.add([7, 8], [9])
    tokens, sources = corpus.joined()
    assert tokens.tolist() == [4, 5, 6, -1, 7, 8, -1, 9, -1]  # the oldest text (the first prompt) dropped
    assert sources.tolist() == [3, 3, 3, 3, 2, 2, 2, 3, 3]
    nothing = CopyCorpus(0)
    nothing.add([1, 2], [3])
    assert nothing.joined() == (None, None)  # 0 tokens: each request copies from itself only
    with pytest.raises(ValueError, match="corpus size"):
        CopyCorpus(-1)


def test_the_scorer_file_round_trips_and_bad_files_are_refused(tmp_path):
    scorer = load_scorer()  # the shipped one
    assert np.isfinite(scorer.weights).all() and len(scorer.weights) == len(HAZARD_FEATURES)
    assert shipped_scorer_data()["steps"] > 1000  # fitted on real recorded answers, and says so
    path = tmp_path / "scorer.json"
    path.write_text(scorer.to_json(k=8))
    again = LogisticScorer.load(path)
    np.testing.assert_array_equal(again.weights, scorer.weights)
    data = json.loads(path.read_text())
    del data["features"]["log depth"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="log depth"):
        LogisticScorer.load(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a copy scorer"):
        CopyOptions(scorer=str(path))
    with pytest.raises(ValueError, match="cannot read"):
        CopyOptions(scorer=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="cannot read the cost table"):
        CopyOptions(costs=str(tmp_path / "missing.json"))


@pytest.fixture(scope="module")
def target():
    return make_native(make_model(seed=0, random_bias=True))


@pytest.mark.parametrize("k", [4, "auto"])
def test_greedy_output_is_plain_decodings(target, tokenizer, k):
    plain = SpecEngine(target, None, tokenizer)
    engine = SpecEngine(target, build_proposer("copy"), tokenizer, k=k)
    drafted = 0
    for prompt in PROMPTS * 2:  # the second round also copies from the first's answers
        out = engine.generate(prompt, GREEDY, max_new_tokens=40)
        assert out.token_ids == plain.generate(prompt, GREEDY, max_new_tokens=40).token_ids
        drafted += out.stats.drafted_tokens
    assert drafted > 0


def test_a_seed_reproduces_a_sampled_answer_on_a_repeat(target, tokenizer):
    """The first answer joins the corpus and the engine measures its costs, yet the same seed gives
    the same sampled answer again: a seeded request drafts by fixed rules. Unseeded, the repeat
    copies from the corpus (its drafts differ, so its draws would too)."""
    engine = SpecEngine(target, build_proposer("copy"), tokenizer, k="auto")
    seeded = SamplingParams(temperature=0.8, seed=11)
    first = engine.generate(PROMPTS[2], seeded, max_new_tokens=40)
    again = engine.generate(PROMPTS[2], seeded, max_new_tokens=40)
    assert again.token_ids == first.token_ids and again.stats.drafted_tokens == first.stats.drafted_tokens
    assert len(engine.proposer.corpus) == 4  # both requests' prompts and answers were kept
    unseeded = engine.generate(PROMPTS[2], GREEDY, max_new_tokens=40)
    assert unseeded.stats.accepted_tokens > first.stats.accepted_tokens  # greedy copies from the corpus


def test_under_auto_k_it_is_asked_for_the_whole_k_and_measures_costs(target, tokenizer):
    proposer = build_proposer("copy")
    asked = []
    original = proposer.propose

    def recording(ctx, max_k):
        asked.append(max_k)
        return original(ctx, max_k)

    proposer.propose = recording
    SpecEngine(target, proposer, tokenizer, k="auto", max_k=6).generate(PROMPTS[0], GREEDY, max_new_tokens=30)
    assert asked and set(asked) <= {6, 5, 4, 3, 2, 1} and asked[0] == 6  # no slow start, no controller's k
    assert len(proposer.step_costs.times.samples) > 0  # the engine fed it one-row step times


def test_the_calibration_learns_a_requests_own_intercept():
    from specdec.proposers.scored_copy import Calibration

    failing, holding = Calibration(), Calibration()
    for _ in range(10):
        failing.drafted(np.array([2.0, 2.0, 2.0]))  # the score says 0.88 each; the first is rejected
        failing.verified(0)
        holding.drafted(np.array([-1.0, -1.0, -1.0]))  # the score says 0.27 each; all are accepted
        holding.verified(3)
    assert failing.offset < -1.5 and holding.offset > 1.0
    before = failing.offset
    failing.idle()  # a step without a draft teaches nothing: back towards the score
    assert before < failing.offset < 0
    failing.verified(2)  # no draft pending: nothing to learn
    assert failing.offset == pytest.approx(before * failing.relax)
    failing.reset()
    assert failing.offset == 0.0


def test_the_calibration_fits_its_last_window_of_judged_tokens():
    """Past twice its window (its arrays move down), the calibration fits exactly the last `window`
    judged tokens: the same Newton steps on a plain list of them agree."""
    from specdec.proposers.copy_candidates import sigmoid
    from specdec.proposers.scored_copy import Calibration

    rng = np.random.default_rng(7)
    calibration, rows, offset = Calibration(window=16), [], 0.0
    for _ in range(60):
        logits = rng.normal(0.0, 2.0, rng.integers(1, 7))
        accepted = int(rng.integers(0, len(logits) + 1))
        calibration.drafted(logits)
        calibration.verified(accepted)
        rows = (rows + [(z, float(i < accepted)) for i, z in enumerate(logits[:accepted + 1])])[-16:]
        z, y = np.array(rows).T
        for _ in range(3):
            p = sigmoid(z + offset)
            offset += (np.sum(y - p) - calibration.prior * offset) / (np.sum(p * (1 - p)) + calibration.prior)
        assert calibration.offset == pytest.approx(offset, abs=1e-9)


def test_a_request_whose_copies_fail_drafts_less():
    """A scorer that believes every copy (0.95) on text where each one fails: the calibration halves
    the drafts within a dozen steps, where the raw score keeps drafting all k."""
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1]
    lengths = {}
    for calibrate in (True, False):
        proposer = ScoredCopyProposer(constant(0.95), CopyCorpus(0), StepCosts(lambda n: 1 + 0.1 * (n - 1),
                                                                                measured=False), calibrate=calibrate)
        lengths[calibrate] = []
        for step in range(12):
            lengths[calibrate].append(len(propose(proposer, tokens)))
            proposer.on_verified(torch.tensor([0]))
    assert lengths[False] == [8] * 12
    assert lengths[True][0] == 8 and lengths[True][-1] <= 4
    assert all(a >= b for a, b in zip(lengths[True], lengths[True][1:]))


def test_a_tree_holds_both_continuations_where_verification_is_cheap():
    from specdec.proposers.copy_candidates import choose_tree

    # "5" was followed once by 6 7 8 and once by 6 9 4: a shared first token, then two branches.
    context = np.array([1, 5, 6, 7, 8, 2, 5, 6, 9, 4, 3, 5])
    step = step_candidates(0, context, 12, None, None, k=3)
    x, _, _ = hazard_rows(step, 3)
    hazard = np.full(len(x), 0.7)
    tokens, parents, expected = choose_tree(step, hazard, lambda n: 1.0, 3)
    paths = set()
    for node in range(len(tokens)):
        path, at = [], node
        while at >= 0:
            assert parents[at] < at  # topological: a parent comes first
            path.insert(0, tokens[at])
            at = parents[at]
        paths.add(tuple(path))
    assert {(6, 7, 8), (6, 9, 4)} <= paths and len(tokens) == 5  # the shared 6 is one node
    assert expected == pytest.approx(0.7 + 0.49 * 2 + 0.343 * 2)
    # Where every token costs a step, no tree (and no draft) pays.
    assert choose_tree(step, hazard, lambda n: float(n), 3) == ([], [], 0.0)


def test_tree_drafts_keep_greedy_output_plain(target, tokenizer):
    plain = SpecEngine(target, None, tokenizer)
    prompt = PROMPTS[1]
    answer = plain.generate(prompt, GREEDY, max_new_tokens=40).token_ids
    # Earlier requests wrote the answer's start, once going on as it does, once differently: the
    # candidates after that start diverge, and the tree holds both.
    corpus = CopyCorpus()
    corpus.add([], answer[:24])
    corpus.add([], answer[:6] + [(t + 1) % 100 for t in answer[6:16]])
    proposer = ScoredCopyProposer(constant(0.6), corpus, StepCosts(lambda n: 1.0, measured=False), trees=True)
    shapes = []
    original = proposer.propose

    def recording(ctx, max_k):
        proposal = original(ctx, max_k)
        shapes.append(proposal.tree())
        return proposal

    proposer.propose = recording
    out = SpecEngine(target, proposer, tokenizer, k=6).generate(prompt, GREEDY, max_new_tokens=40)
    assert out.token_ids == answer
    assert any(tree is not None for tree in shapes)  # some steps verified a branching tree
    assert out.stats.accepted_tokens >= 10
