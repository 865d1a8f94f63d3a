"""analysis/replay.py: replayed acceptance, the copy ceiling and its cheapest path, cost tables."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.analysis.replay import (RecordedTurn, ReplayRow, Tally, accepted_length, ceiling_cost, ceiling_steps,
                                     cheapest_path, copyable_lengths, cost_table, draft_cost_table, replay, replay_json,
                                     replay_markdown, tally)
from specdec.proposers.registry import build_proposer
from specdec.proposers.suffix import SuffixOptions


def test_a_tree_is_accepted_along_its_longest_path_the_answer_continues():
    # root -> 5 (0) -> 6 (1) -> 9 (3); root -> 7 (2) -> 8 (4): the answer 7 8 3 takes the second branch.
    tokens, parents = [5, 6, 7, 9, 8], [-1, 0, -1, 1, 2]
    assert accepted_length(tokens, parents, [7, 8, 3]) == 2
    assert accepted_length(tokens, parents, [5, 6, 9, 1]) == 3
    assert accepted_length(tokens, parents, [5, 1]) == 1
    assert accepted_length(tokens, parents, [4]) == 0
    assert accepted_length([5, 6, 7], None, [5, 6, 1]) == 2  # a chain
    assert accepted_length([9, 6], [-1, 0], [5, 6]) == 0  # a child of a rejected node never counts


def _turn(prompt, answer, question="q", eos=False, category="c"):
    return RecordedTurn(category, question, tuple(prompt), tuple(answer), eos)


def test_the_copy_ceiling_copies_from_the_prompt_the_answer_and_earlier_requests():
    first = _turn([1, 2, 3, 4], [9, 1, 2, 3, 4, 7], "a")
    second = _turn([8], [8, 9, 1, 2, 5], "b")
    lengths = copyable_lengths([first, second], k=3, stream=True)
    # first: after 9, "1 2 3" (then "2 3 4", "3 4", "4") occur in the prompt, 7 nowhere.
    assert lengths[0] == [0, 3, 3, 2, 1, 0]
    # second: after 8, "9 1 2" is the first answer's, then its tails "1 2", "2"; 5 was never seen.
    assert lengths[1] == [0, 3, 2, 1, 0]
    assert copyable_lengths([first, second], k=3, stream=False)[1] == [0, 0, 0, 0, 0]
    steps = ceiling_steps(first, lengths[0])
    assert steps.accepted == [3, 0]  # 1 2 3 + the bonus 4, then 7
    assert ceiling_steps(_turn([1, 2], [5, 1, 2], eos=True), [0, 2, 1]).accepted == [2]  # the end drafted


def _streams():
    tokens = st.integers(min_value=0, max_value=5)
    turn = st.tuples(st.lists(tokens, min_size=1, max_size=12), st.lists(tokens, min_size=1, max_size=24),
                     st.booleans())
    return st.lists(turn, min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(_streams(), st.integers(min_value=1, max_value=6), st.booleans())
def test_no_copying_proposer_beats_the_ceiling(texts, k, stream):
    turns = [_turn(p, a, f"q{i}", eos) for i, (p, a, eos) in enumerate(texts)]
    lengths = copyable_lengths(turns, k, stream)
    oracle = [ceiling_steps(t, row) for t, row in zip(turns, lengths)]
    for method in ("ngram", "suffix"):
        proposer = build_proposer(method, suffix=SuffixOptions(max_depth=8))
        for turn, steps, best in zip(turns, replay(turns, proposer, k, stream), oracle):
            assert len(best.accepted) <= len(steps.accepted)
            # every step lands on answer tokens: accepted + bonus add up to the answer
            assert sum(a + 1 for a in steps.accepted) >= len(turn.output_ids) - 1


def _cheapest_by_enumeration(turn, lengths, cost):
    n = len(turn.output_ids)
    best = float("inf")
    for choices in itertools.product(range(max(lengths) + 1), repeat=n):
        position, total = 1, 0.0
        for take in choices:
            if position >= n:
                break
            if take > lengths[position]:
                total = float("inf")
                break
            remaining = n - position
            if turn.ended_by_eos and take >= remaining:  # the end of text drafted: no token after it
                accepted, committed = remaining, remaining
            else:
                accepted = min(take, remaining - 1)
                committed = accepted + 1
            total += cost(1 + accepted)
            position += committed
        if position >= n:
            best = min(best, total)
    return best


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=3), min_size=2, max_size=6), st.booleans(),
       st.floats(min_value=0.0, max_value=1.5))
def test_the_ceilings_cost_is_the_cheapest_path(lengths, eos, slope):
    lengths = [0] + lengths[1:]
    turn = _turn([0], list(range(len(lengths))), eos=eos)

    def cost(rows):
        return 1.0 + slope * (rows - 1) ** 1.3

    assert ceiling_cost(turn, lengths, cost) == pytest.approx(_cheapest_by_enumeration(turn, lengths, cost))
    greedy = ceiling_steps(turn, lengths)
    assert ceiling_cost(turn, lengths, cost) <= sum(cost(1 + a) for a in greedy.drafted) + 1e-9


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(min_value=0, max_value=3), st.integers(min_value=0, max_value=3)),
                min_size=2, max_size=6), st.booleans(), st.floats(min_value=0.0, max_value=0.8))
def test_the_cheapest_path_over_two_sources_picks_each_steps_cheaper_one(pairs, eos, per_token):
    """A draft model's tokens cost per_token each, a copy's nothing: the dynamic programme's time
    is the least over every way through the answer, each step from one source."""
    copies, drafts = [0] + [c for c, _ in pairs[1:]], [0] + [d for _, d in pairs[1:]]
    turn = _turn([0], list(range(len(copies))), eos=eos)

    def cost(rows):
        return 1.0 + 0.3 * (rows - 1)

    time, steps = cheapest_path(turn, [(copies, 0.0), (drafts, per_token)], cost)
    # by enumeration: a step may take up to the larger of the two; a take beyond the copy pays per token
    either = [max(c, d) for c, d in zip(copies, drafts)]

    best = float("inf")
    for choices in itertools.product(range(max(either) + 1), repeat=len(copies)):
        position, total = 1, 0.0
        for take in choices:
            if position >= len(copies):
                break
            if take > either[position]:
                total = float("inf")
                break
            remaining = len(copies) - position
            accepted, committed = ((remaining, remaining) if eos and take >= remaining
                                   else (min(take, remaining - 1), min(take, remaining - 1) + 1))
            total += cost(1 + accepted) + (0.0 if accepted <= copies[position] else accepted * per_token)
            position += committed
        if position >= len(copies):
            best = min(best, total)
    assert time == pytest.approx(best)
    assert sum(a + 1 for a in steps.accepted) >= len(copies) - 1


def test_tallies_count_the_prefill_as_bench_does():
    turn = _turn([1, 2, 3], [4, 1, 2, 3, 5])
    steps = ceiling_steps(turn, copyable_lengths([turn], 4, False)[0])
    totals = tally([turn], [steps], lambda rows: 1.0)
    # 5 tokens: the prefill's 4, then 1 2 3 (+5) in one step -> 2 forwards; decode 4 tokens in 1 step
    assert totals["c"].tau == pytest.approx(5 / 2) and totals["overall"].speedup == pytest.approx(4.0)


def test_cost_tables_interpolate_the_measured_ratios(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"cpu": "X", "isa": "AVX2", "results": [
        {"format": "m", "ratio": {"1": 1.0, "5": 1.4, "9": 2.2}}]}))
    cost, label = cost_table(path)
    assert cost(1) == 1.0 and cost(3) == pytest.approx(1.2) and cost(9) == pytest.approx(2.2)
    assert cost(13) == pytest.approx(3.0) and "AVX2" in label
    path.write_text(json.dumps({"results": [{"ratio": {"5": 1.4}}]}))
    with pytest.raises(ValueError, match="1-token step"):
        cost_table(path)
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a cost table"):
        cost_table(path)


def test_a_draft_entry_prices_the_draft_in_the_targets_steps(tmp_path):
    path = tmp_path / "costs.json"
    target = {"format": "m", "step_ms": {"1": 40.0, "5": 56.0}, "ratio": {"1": 1.0, "5": 1.4}}
    path.write_text(json.dumps({"results": [target]}))
    assert draft_cost_table(path) is None  # no draft timed: the caller decides
    path.write_text(json.dumps({"results": [target], "draft": {"format": "d", "step_ms": {"1": 10.0, "2": 10.4,
                                                                                            "64": 60.0}}}))
    draft_cost, label = draft_cost_table(path)
    assert draft_cost(1) == pytest.approx(0.25) and draft_cost(2) == pytest.approx(0.26)
    assert draft_cost(64) == pytest.approx(1.5) and "0.25 of a target step" in label
    path.write_text(json.dumps({"results": [{"ratio": {"1": 1.0, "5": 1.4}}], "draft": {"step_ms": {"1": 10.0}}}))
    with pytest.raises(ValueError, match="draft entry needs step_ms"):
        draft_cost_table(path)


def _row(label, k, speedups, bound=False):
    """A report row whose categories decode 12 tokens after the prefill's in 12 / speedup steps' time."""
    return ReplayRow(label, k, {c: Tally(turns=1, tokens=13, steps=4, drafted=6, time=12 / speedup)
                                for c, speedup in speedups.items()}, bound=bound)


def test_each_method_is_read_as_a_share_of_the_ceilings_at_its_k():
    report = [_row("ngram", 4, {"a": 1.5, "overall": 1.2}), _row("copy ceiling", 4, {"a": 3.0, "overall": 2.4}, True),
              _row("draft oracle", 4, {"a": 1.0, "overall": 1.0}, True),
              _row("ngram+draft oracle", 4, {"a": 5.0, "overall": 4.0}, True),
              _row("ngram", 8, {"a": 1.0, "overall": 1.0}), _row("copy ceiling", 8, {"a": 4.0, "overall": 2.0}, True)]
    rows = replay_json(report, "X")["rows"]
    assert rows[0]["categories"]["a"]["share_of"] == {"copy ceiling": pytest.approx(0.5),
                                                      "ngram+draft oracle": pytest.approx(0.3)}
    assert rows[4]["categories"]["overall"]["share_of"] == {"copy ceiling": pytest.approx(0.5)}  # no oracle at k=8
    assert all(c["share_of"] == {} for row in rows if row["bound"] for c in row["categories"].values())
    text = replay_markdown(report, "X")
    assert "share of the copy ceiling's / ngram+draft oracle's at the same k" in text
    assert "| ngram | 4 | 50% / 30% | 50% / 30% |" in text and "| ngram | 8 | 25% / - | 50% / - |" in text
    assert "| copy ceiling | 4 | 100%" not in text  # the bounds are the yardsticks, not rows of the share table
