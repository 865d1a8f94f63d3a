"""The closed forms of Leviathan et al. against their seed tables and direct simulation."""

import random

import pytest

from specdec.analysis.theory import (
    arithmetic_operations_factor,
    expected_tokens_per_loop,
    optimal_k,
    speedup_from_step_times,
    walltime_speedup,
)


@pytest.mark.parametrize("alpha,k,expected", [(0.8, 4, 3.361), (0.5, 3, 1.875), (0.1, 3, 1.111), (0.7, 9, 3.239),
                                              (0.3, 5, 1.428)])
def test_expected_tokens_table(alpha, k, expected):
    assert expected_tokens_per_loop(alpha, k) == pytest.approx(expected, abs=1.5e-3)


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
