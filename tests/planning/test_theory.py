"""The closed forms of Leviathan et al. against their seed tables and direct simulation."""

import math
import random

import pytest
import torch

from specdec.planning.theory import (
    acceptance_rate,
    arithmetic_operations_factor,
    best_k,
    expected_tokens_from_rates,
    expected_tokens_per_loop,
    lenient_acceptance_rate,
    optimal_k,
    predicted_tokens_per_s,
    speedup_from_step_times,
    walltime_speedup,
)


@pytest.mark.parametrize("alpha,k,expected", [(0.8, 4, 3.361), (0.5, 3, 1.875), (0.1, 3, 1.111), (0.7, 9, 3.239),
                                              (0.3, 5, 1.428)])
def test_expected_tokens_table(alpha, k, expected):
    assert expected_tokens_per_loop(alpha, k) == pytest.approx(expected, abs=1.5e-3)


# The seed document's table of expected tokens per loop, alpha x k = 3..9, printed truncated to 3 decimals.
SEED_EXPECTED_TOKENS = {
    0.1: [1.111, 1.111, 1.111, 1.111, 1.111, 1.111, 1.111],
    0.3: [1.417, 1.425, 1.427, 1.428, 1.428, 1.428, 1.428],
    0.5: [1.875, 1.937, 1.968, 1.984, 1.992, 1.996, 1.998],
    0.7: [2.533, 2.773, 2.941, 3.058, 3.141, 3.198, 3.239],
    0.8: [2.952, 3.361, 3.689, 3.951, 4.161, 4.328, 4.463],
}


@pytest.mark.parametrize("alpha", sorted(SEED_EXPECTED_TOKENS))
def test_the_whole_seed_table_of_expected_tokens(alpha):
    got = [math.floor(expected_tokens_per_loop(alpha, k) * 1000 + 1e-9) / 1000 for k in range(3, 10)]
    assert got == SEED_EXPECTED_TOKENS[alpha]


def test_speedup_row_for_alpha_07_c_001():
    # alpha 0.7, c 0.01 over k = 1..8: rises to ~2.96 and flattens (Leviathan et al., Figure 3).
    got = [round(walltime_speedup(0.7, k, 0.01), 3) for k in range(1, 9)]
    assert got == [1.683, 2.147, 2.459, 2.666, 2.801, 2.886, 2.936, 2.962]


def test_speedup_table_and_worked_example():
    assert round(walltime_speedup(0.7, 4, 0.01), 3) == 2.666
    assert round(speedup_from_step_times(0.8125 * 5, 4, 11.9, 73.3), 2) == 2.46


def test_expected_tokens_matches_a_simulation_of_the_loop():
    rng = random.Random(0)
    alpha, k, loops = 0.7, 5, 100_000
    total = 0
    for _ in range(loops):
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        total += accepted + 1  # plus the recovered or bonus token
    assert total / loops == pytest.approx(expected_tokens_per_loop(alpha, k), rel=0.01)


def test_limits_and_optimal_k():
    assert expected_tokens_per_loop(1.0, 4) == 5.0
    assert expected_tokens_per_loop(0.0, 4) == 1.0
    assert arithmetic_operations_factor(0.0, 3, 0.0) == 4.0  # every loop scores 4 positions for one token
    assert optimal_k(0.9, 0.0) == 32  # free drafts: draft as far as allowed
    assert optimal_k(0.2, 0.5) == 1
    best = optimal_k(0.8, 0.05)
    assert all(walltime_speedup(0.8, best, 0.05) >= walltime_speedup(0.8, k, 0.05) for k in range(1, 33))


@pytest.mark.parametrize("args", [(1.5, 4), (0.5, 0), (0.5, 2.5)])
def test_bad_arguments_are_clear_errors(args):
    with pytest.raises(ValueError):
        expected_tokens_per_loop(*args)


def test_acceptance_rate_is_the_overlap_of_the_two_distributions():
    target = torch.tensor([[0.6, 0.3, 0.1], [1.0, 0.0, 0.0]])
    draft = torch.tensor([[0.2, 0.3, 0.5], [0.0, 1.0, 0.0]])
    assert acceptance_rate(target, draft).tolist() == pytest.approx([0.6, 0.0])
    # Symmetric, 1 for identical distributions, and = 1 - total variation distance.
    assert acceptance_rate(draft, target).tolist() == pytest.approx([0.6, 0.0])
    assert float(acceptance_rate(target[0], target[0])) == pytest.approx(1.0)
    assert float(acceptance_rate(target[0], draft[0])) == pytest.approx(1 - 0.5 * float((target[0] - draft[0]).abs().sum()))


def test_lenient_acceptance_rate_matches_a_simulation_of_the_lenient_rule():
    target = torch.tensor([0.5, 0.3, 0.15, 0.05])
    draft = torch.tensor([0.1, 0.2, 0.3, 0.4])
    assert float(lenient_acceptance_rate(target, draft, 1.0)) == pytest.approx(float(acceptance_rate(target, draft)))
    generator = torch.Generator().manual_seed(0)
    for lenience in (1.0, 0.5, 0.2):
        drawn = torch.multinomial(draft, 200_000, replacement=True, generator=generator)
        accept = torch.rand(drawn.shape, generator=generator) < (target[drawn] / (lenience * draft[drawn])).clamp(max=1)
        assert float(accept.float().mean()) == pytest.approx(float(lenient_acceptance_rate(target, draft, lenience)),
                                                             abs=0.005)
    rates = [float(lenient_acceptance_rate(target, draft, lenience)) for lenience in (1.0, 0.5, 0.2, 0.01)]
    assert rates == sorted(rates) and rates[-1] == pytest.approx(1.0)  # more lenient, more accepted
    with pytest.raises(ValueError, match="lenience"):
        lenient_acceptance_rate(target, draft, 0.0)


def test_expected_tokens_from_rates_is_equation_1_with_one_rate_per_position():
    assert expected_tokens_from_rates([0.8] * 4) == pytest.approx(expected_tokens_per_loop(0.8, 4))
    assert expected_tokens_from_rates([]) == 1.0
    # Bursty acceptance: 0.5 at the first draft, certain afterwards -> 1 + .5 + .5 + .5.
    assert expected_tokens_from_rates([0.5, 1.0, 1.0]) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="rates"):
        expected_tokens_from_rates([0.5, 1.2])


def test_best_k_is_optimal_k_with_a_flat_verify_cost_and_shrinks_when_verifying_costs_more():
    for alpha, c in ((0.8, 0.05), (0.6, 0.2), (0.9, 0.01), (0.3, 0.3)):
        assert best_k(alpha, c, lambda k: 1.0, 16) == optimal_k(alpha, c, 16)
    flat = best_k(0.8, 0.05, lambda k: 1.0, 16)
    steep = best_k(0.8, 0.05, lambda k: 1.0 + 0.2 * k, 16)
    assert steep < flat
    # The argmax really is the best predicted tokens/s among 1..max_k.
    costs = lambda k: 0.15 + 0.01 * k  # noqa: E731
    chosen = best_k(0.7, 0.03, costs, 8)
    speeds = [predicted_tokens_per_s(0.7, k, 0.03, costs(k)) for k in range(1, 9)]
    assert speeds[chosen - 1] == max(speeds)
    # Rising conditional rates (bursty acceptance) justify a longer draft than their first rate alone.
    assert best_k([0.6, 0.9, 0.95, 0.95, 0.95, 0.95], 0.03, costs, 6) > best_k(0.6, 0.03, costs, 6)


@pytest.mark.parametrize("call, message", [
    (lambda: best_k([0.5], 0.1, lambda k: 1.0, 3), "3 draft"),
    (lambda: best_k(0.5, -1, lambda k: 1.0, 3), "draft_s"),
    (lambda: predicted_tokens_per_s(0.5, 2, 0.1, 0), "verify_s"),
])
def test_bad_costs_and_rates_are_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()
