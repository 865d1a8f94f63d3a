"""--tree-size auto (proposers/tree_budget.py): the tree's size follows the head's confidence and
the measured cost of verifying n tokens; it never changes what verification makes of the tree."""

from __future__ import annotations

import pytest

from specdec.proposers.tree_budget import TreeBudget


def _measured(budget: TreeBudget, cost_of, sizes=(1, 4, 8, 16)) -> None:
    """Verification of n tokens costs cost_of(n) seconds, measured at a few sizes."""
    for _ in range(3):
        for nodes in sizes:
            budget.choose([0.5] * nodes)
            budget._pending = None  # costs only: no calibration from these
            budget.record(verified_tokens=nodes + 1, verify_s=cost_of(nodes + 1), accepted=0)


def test_before_two_sizes_are_measured_it_alternates_between_a_start_size_and_half_of_it():
    budget = TreeBudget(max_nodes=64, start_nodes=8)
    sizes = []
    for _ in range(4):
        sizes.append(budget.choose([0.9] * 30))
        budget.record(verified_tokens=sizes[-1] + 1, verify_s=0.1, accepted=1)
    assert sizes[:2] == [8, 4]


def test_a_confident_head_on_cheap_verification_grows_the_tree():
    """Tokens almost free (a GPU): every node with a fair chance pays, up to twice the largest size seen."""
    budget = TreeBudget(max_nodes=64)
    _measured(budget, lambda n: 0.100 + 0.0005 * n)
    assert budget.choose([0.8] * 40) == 32  # doubling the largest measured size (16), no further


def test_dear_verification_keeps_only_the_nodes_likely_enough_to_pay():
    """A CPU: a token costs a fifth of a step (0.02 s on 0.1 s). Node i adds p_i tokens for 0.02 s, so it
    pays while p_i / 0.02 beats the tree's tokens per second without it: the 2nd node (0.6 / 0.02 = 30
    against 1.9 / 0.12 = 15.8) does, the 3rd (0.3 / 0.02 = 15 against 2.5 / 0.14 = 17.9) does not."""
    budget = TreeBudget(max_nodes=64)
    _measured(budget, lambda n: 0.1 + 0.02 * (n - 1))
    assert budget.choose([0.9, 0.6, 0.3, 0.1, 0.05, 0.02]) == 2
    assert budget.choose([0.05, 0.02, 0.01]) == 0  # nothing pays: plain decoding


def test_calibration_believes_an_over_confident_head_less():
    budget = TreeBudget(max_nodes=64)
    _measured(budget, lambda n: 0.1 + 0.02 * (n - 1))
    probs = [0.9, 0.6, 0.3, 0.25, 0.2, 0.1]
    before = budget.choose(probs)
    budget._pending = None
    for _ in range(20):  # predicted ~2 accepted per step, 0 came
        budget.choose([0.9, 0.6, 0.3])
        budget.record(verified_tokens=4, verify_s=0.16, accepted=0)
    assert budget.calibration() < 0.3
    assert budget.choose(probs) < before


def test_bad_budgets_are_clear_errors():
    with pytest.raises(ValueError, match="max_nodes"):
        TreeBudget(max_nodes=0)


def test_growing_stops_where_no_deeper_node_could_join_the_choice():
    """Costs as above: with 0.9 and 0.6 chosen, a node at 0.5 would pay (3.0 / 0.16 beats 2.5 / 0.14),
    one at 0.2 would not (2.7 / 0.16); before costs are measured, always grow."""
    assert TreeBudget(max_nodes=64).worth_growing([0.9, 0.6, 0.3], 0.01)
    budget = TreeBudget(max_nodes=64)
    _measured(budget, lambda n: 0.1 + 0.02 * (n - 1))
    assert budget.worth_growing([0.9, 0.6, 0.3], 0.5)
    assert not budget.worth_growing([0.9, 0.6, 0.3], 0.2)
