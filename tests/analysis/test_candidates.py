import numpy as np
import pytest

from specdec.analysis import candidates as cand
from specdec.analysis.replay import RecordedTurn, accepted_length, copyable_lengths, flat_cost
from specdec.proposers.ngram import find_match


def turn(prompt, answer, qid="q", category="c", eos=False):
    return RecordedTurn(category, qid, tuple(prompt), tuple(answer), eos)


def offered(step):
    return [tuple(step.tokens[c, :step.lengths[c]].tolist()) for c in range(len(step))]


def test_candidates_include_what_the_ceiling_takes():
    # prompt: 1 2 3 4 5 6; the answer copies "3 4 5 6" after writing 9 2.
    t = turn([1, 2, 3, 4, 5, 6, 7], [9, 2, 3, 4, 5, 6, 8])
    [found] = cand.collect([t], k=4, stream=False)
    step = found.steps[2]  # context ends "... 9 2": the occurrence of 2 in the prompt offers 3 4 5 6
    assert (3, 4, 5, 6) in offered(step)
    assert step.labels[offered(step).index((3, 4, 5, 6))] == 4
    ceiling = copyable_lengths([t], 4, stream=False)[0]
    assert cand.best_offered(found, 4)[2:] == ceiling[2:]
    # At position 1 the ceiling copies "2 3 4 5" from the prompt, but no tail of "... 7 9" occurs
    # before it: no copy keyed on the context's tail offers it (the "matched ceiling" is lower).
    assert ceiling[1] == 4 and 1 not in found.steps


def test_every_occurrence_of_the_tail_is_offered_with_its_exact_label():
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 4, 60).tolist()
    answer = rng.integers(0, 4, 40).tolist()
    k = 5
    [found] = cand.collect([turn(prompt, answer)], k=k, stream=False, most=10_000)
    for position in range(1, len(answer)):
        context = prompt + answer[:position]
        expected = {tuple(context[j:j + k]) for j in range(1, len(context)) if context[j - 1] == context[-1]}
        step = found.steps[position]
        assert set(offered(step)) == expected
        for c, tokens in enumerate(offered(step)):
            assert step.labels[c] == accepted_length(tokens, None, answer[position:])
        # ngram's own proposal (n <= 3, most recent) is among them
        match = find_match(context, max_k=k)
        assert tuple(match.token_ids) in expected


def test_a_stream_offers_earlier_answers_and_marks_their_source():
    first = turn([1, 2], [5, 6, 7, 8, 9], qid="a")
    second = turn([3, 4], [5, 6, 7, 8, 9], qid="b")
    _, found = cand.collect([first, second], k=4, stream=True)
    step = found.steps[1]  # context "3 4 5": the earlier answer continues "6 7 8 9"
    row = offered(step).index((6, 7, 8, 9))
    assert step.labels[row] == 4
    assert step.features[row, cand.FEATURES.index("earlier answer")] == 1
    _, alone = cand.collect([first, second], k=4, stream=False)
    assert 1 not in alone.steps  # without a stream nothing before "5" was seen


def test_the_fit_recovers_a_known_logistic_relation():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40_000, 3)) * [1.0, 2.0, 0.5] + [0.0, 1.0, -1.0]
    beta, bias = np.array([1.5, -0.7, 2.0]), 0.3
    y = (rng.random(len(x)) < 1 / (1 + np.exp(-(bias + x @ beta)))).astype(float)
    fit = cand.fit_logistic(x, y, l2=0.0)
    np.testing.assert_allclose(fit.weights / fit.scale, beta, atol=0.08)
    np.testing.assert_allclose(fit.bias - (fit.mean / fit.scale) @ fit.weights, bias, atol=0.08)


def test_scored_choices_draft_only_what_was_offered():
    rng = np.random.default_rng(2)
    turns = [turn(rng.integers(0, 5, 50).tolist(), rng.integers(0, 5, 30).tolist(), qid=str(i)) for i in range(4)]
    found = cand.collect(turns, k=6, stream=True)
    scorer = cand.fit_logistic(*cand.training_set(found, 6))
    choose = cand.scored_chooser(scorer, lambda rows: 1.0 + 0.05 * rows)
    seen = []

    def recording(step, cap):
        candidate, drafted = choose(step, cap)
        seen.append((step, candidate, drafted, cap))
        return candidate, drafted

    for tc in found:
        steps = cand.walk(tc, recording, 6, max_new_tokens=28)
        assert sum(a + 1 for a in steps.accepted) == len(tc.turn.output_ids) - 1
    assert any(drafted for _, _, drafted, _ in seen)
    for step, candidate, drafted, cap in seen:
        assert 0 <= drafted <= cap
        if drafted:
            assert 0 <= candidate < len(step) and drafted <= step.lengths[candidate]


def test_walk_refuses_a_draft_that_was_not_offered():
    [found] = cand.collect([turn([1, 2, 3], [9, 1, 2, 3])], k=4, stream=False)
    with pytest.raises(ValueError, match="offering"):
        cand.walk(found, lambda step, cap: (0, int(step.lengths[0]) + 1), 4)


def test_walk_counts_steps_as_replay_does():
    t = turn([1, 2, 3, 4, 5, 6, 7], [9, 2, 3, 4, 5, 6, 8])
    [found] = cand.collect([t], k=4, stream=False)
    longest = lambda step, cap: (int(np.argmax(step.labels)), max(1, min(int(step.labels.max()), cap)))
    steps = cand.walk(found, longest, 4)
    assert steps.accepted[0] == 0 and steps.accepted[1] == 4  # "2" is guessed wrong, then "3 4 5 6" copied
    assert flat_cost(3) == 1.0


def test_the_tree_finds_an_interaction():
    rng = np.random.default_rng(3)
    x = rng.random((20_000, 2))
    y = ((x[:, 0] > 0.3) & (x[:, 1] > 0.6)).astype(float)  # accepted only where both hold
    tree = cand.fit_tree(x, y, depth=2, min_leaf=50)
    corners = np.array([[0.1, 0.1], [0.9, 0.9], [0.1, 0.9], [0.9, 0.1]])
    np.testing.assert_allclose(tree.probability(corners), [0, 1, 0, 0], atol=0.01)


@pytest.mark.parametrize("eos", [False, True])
def test_walking_ngrams_own_choice_among_the_candidates_is_its_replay(eos):
    from specdec.analysis.replay import replay
    from specdec.proposers.ngram import NgramProposer

    rng = np.random.default_rng(4)
    turns = [turn(rng.integers(0, 6, 40).tolist(), rng.integers(0, 6, 50).tolist(), qid=str(i), eos=eos)
             for i in range(3)]
    k, cap = 5, 45
    expected = replay(turns, NgramProposer(3, 1), k, stream=False, max_new_tokens=cap)
    for t, tc, steps in zip(turns, cand.collect(turns, k, stream=False, most=10_000), expected):
        def ngram(step, width, t=t):
            match = find_match(list(t.prompt_ids + t.output_ids[:step.position]), max_k=width)
            d = len(match.token_ids)  # under the cap, a prefix of a k-token candidate
            return [tokens[:d] for tokens in offered(step)].index(tuple(match.token_ids)), d

        walked = cand.walk(tc, ngram, k, max_new_tokens=cap)
        assert walked.accepted == steps.accepted and walked.drafted == steps.drafted


def test_walking_suffix_decodings_chain_among_the_candidates_is_its_replay():
    import torch

    from specdec.analysis.replay import replay
    from specdec.proposers.base import ProposeContext
    from specdec.proposers.suffix import SuffixProposer
    from specdec.sampling.params import SamplingParams

    rng = np.random.default_rng(5)
    turns = [turn(rng.integers(0, 6, 30).tolist(), rng.integers(0, 6, 40).tolist(), qid=str(i)) for i in range(3)]
    k = 6
    expected = replay(turns, SuffixProposer(trees=False), k, stream=True)
    probe = SuffixProposer(trees=False)
    for t, tc, steps in zip(turns, cand.collect(turns, k, stream=True, most=10_000), expected):
        def suffix(step, width, t=t):
            context = torch.tensor([list(t.prompt_ids + t.output_ids[:step.position])])
            proposal = probe.propose(ProposeContext(context, SamplingParams(temperature=0.0), None, 6), width)
            tokens = tuple(proposal.token_ids[0, :int(proposal.num_tokens[0])].tolist())
            if not tokens:
                return -1, 0
            return [c[:len(tokens)] for c in offered(step)].index(tokens), len(tokens)

        walked = cand.walk(tc, suffix, k)
        assert walked.accepted == steps.accepted and walked.drafted == steps.drafted
        probe.end_request(list(t.prompt_ids), list(t.output_ids))


def test_each_distinct_continuation_is_found_once_at_its_first_occurrence():
    from specdec.proposers.copy_candidates import _first_of_each_row

    rows = np.random.default_rng(3).integers(-1, 3, (200, 4))  # padding (-1) sorts as bytes, not as numbers
    first, count = _first_of_each_row(rows)
    _, expected_first, expected_count = np.unique(rows, axis=0, return_index=True, return_counts=True)
    assert sorted(zip(first.tolist(), count.tolist())) == sorted(zip(expected_first.tolist(), expected_count.tolist()))


def test_path_features_count_agreement_and_branching_along_the_path():
    tokens = np.array([[1, 2, 3], [1, 2, 4], [1, 5, 6]])
    path = cand.path_features(tokens, np.array([1.0, 1.0, 2.0]), np.log([2.0, 1.0, 1.0]))
    np.testing.assert_allclose(path[0, :, 0], [1.0, 2 / 4, 1 / 2])  # weighted by occurrences
    np.testing.assert_allclose(path[0, :, 1], [1.0, 1.0, 1.0])  # only itself matched as long
    np.testing.assert_allclose(path[1, :, 1], [1.0, 2 / 4, 1 / 2])
    np.testing.assert_allclose(np.exp(path[0, :, 2]), [1, 2, 2])  # tokens offered after 1 / 1 2


@pytest.mark.parametrize("stream", [False, True])
def test_the_live_proposer_drafts_what_the_offline_chooser_chooses(stream):
    """--method copy replayed (without its online calibration, which the walk lacks) equals the
    analysis' walk with the same scorer and costs: the fit measured offline is what runs."""
    from specdec.analysis.replay import replay
    from specdec.proposers.scored_copy import ScoredCopyProposer
    from specdec.proposers.step_costs import StepCosts

    rng = np.random.default_rng(6)
    turns = [turn(rng.integers(0, 6, 30).tolist(), rng.integers(0, 6, 40).tolist(), qid=str(i)) for i in range(4)]
    k, cost = 6, (lambda rows: 1.0 + 0.12 * (rows - 1))
    found = cand.collect(turns, k, stream)
    scorer = cand.fit_logistic(*cand.training_set(found, k))
    proposer = ScoredCopyProposer(scorer, step_costs=StepCosts(cost, measured=False), calibrate=False)
    live = replay(turns, proposer, k, stream)
    for tc, steps in zip(found, live):
        walked = cand.walk(tc, cand.scored_chooser(scorer, cost), k)
        assert walked.accepted == steps.accepted and walked.drafted == steps.drafted
    assert sum(sum(s.drafted) for s in live) > 0


def test_half_oracles_sit_between_the_scored_chooser_and_the_matched_ceiling():
    """Knowing where the chosen candidate stops wastes no drafted token; knowing the best candidate
    at the scorer's length never accepts fewer than the scorer's own; neither beats the matched
    ceiling's cheapest path (both draft only what some candidate offers)."""
    from specdec.analysis.replay import step_time

    rng = np.random.default_rng(11)
    turns = [turn(rng.integers(0, 5, 40).tolist(), rng.integers(0, 5, 60).tolist(), qid=str(i)) for i in range(6)]
    k, cost = 6, (lambda rows: 1.0 + 0.1 * (rows - 1))
    found = cand.collect(turns, k, stream=True)
    scorer = cand.fit_logistic(*cand.training_set(found, k))
    halves = cand.half_oracle_choosers(scorer, cost)
    scored_time = oracle_time = ceiling_time = 0.0
    for tc in found:
        scored = cand.walk(tc, cand.scored_chooser(scorer, cost), k)
        exact = cand.walk(tc, halves["its candidate, the accepted length"], k)
        # It stops exactly where the answer leaves the candidate (but at the answer's last token, which
        # the step writes itself: replay counts a draft of it as not accepted).
        assert exact.drafted[:-1] == exact.accepted[:-1]
        for position, step in tc.steps.items():  # the best candidate at the scorer's length accepts the most
            candidate, drafted = cand.scored_chooser(scorer, cost)(step, k)
            best, same = halves["its length, the best candidate"](step, k)
            assert same == drafted
            if drafted:
                assert min(step.labels[best], drafted) >= min(step.labels[candidate], drafted)
        scored_time += step_time(scored, cost)
        oracle_time += step_time(exact, cost)
        ceiling_time += cand.matched_ceiling(tc, k, cost)[0]
    assert ceiling_time <= oracle_time < scored_time
