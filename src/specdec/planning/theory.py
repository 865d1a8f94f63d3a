"""Closed forms of speculative decoding (Leviathan et al. 2022, arXiv 2211.17192, section 3).

alpha: the expected acceptance rate of one drafted token, E[sum_x min(p(x), q(x))]
(Definition 3.1; beta is its per-position value, alpha its expectation).
k (gamma in the paper): drafted tokens per loop. c: the cost of one draft
step relative to one target step (section 3.4).

Worked example (Leviathan et al., section 3, and the issue's seed tables):
>>> round(expected_tokens_per_loop(0.8, 4), 3)
3.362
>>> round(walltime_speedup(0.7, 4, 0.01), 3)
2.666
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def _check(alpha: float, k: int, c: float = 0.0) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    if c < 0:
        raise ValueError(f"c (draft cost / target cost) must be >= 0, got {c}")


def expected_tokens_per_loop(alpha: float, k: int) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha): mean tokens one loop emits (Leviathan et al., Equation 1).

    The accepted prefix length is a capped geometric variable; the +1 is the
    target's own recovered or bonus token. At alpha = 1 every draft is accepted: k + 1.
    """
    _check(alpha, k)
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def walltime_speedup(alpha: float, k: int, c: float) -> float:
    """(1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)): expected speedup over plain decoding (Theorem 3.8).

    One loop costs k draft steps and one target step, k c + 1 target-step units.
    """
    _check(alpha, k, c)
    return expected_tokens_per_loop(alpha, k) / (k * c + 1.0)


def arithmetic_operations_factor(alpha: float, k: int, c_ops: float) -> float:
    """(1 - alpha)(k c_ops + k + 1) / (1 - alpha^(k+1)): expected arithmetic work relative to plain decoding
    (Theorem 3.11); c_ops = draft operations per token / target operations per token. The target
    scores k + 1 positions per loop, so speculation trades extra operations for fewer serial steps."""
    _check(alpha, k, c_ops)
    return (k * c_ops + k + 1.0) / expected_tokens_per_loop(alpha, k)


def optimal_k(alpha: float, c: float, max_k: int = 32) -> int:
    """The k in 1..max_k with the largest walltime_speedup (Leviathan et al., Figure 3); ties -> smaller k."""
    return max(range(1, max_k + 1), key=lambda k: (walltime_speedup(alpha, k, c), -k))


def predicted_tokens_per_s(alpha: float, k: int, draft_step_s: float, verify_s: float) -> float:
    """expected_tokens_per_loop(alpha, k) / (k draft_step_s + verify_s): tokens per second of one loop.

    verify_s is the target's forward over k + 1 tokens. With verify_s equal to one
    plain target step this is walltime_speedup(alpha, k, draft_step_s / verify_s)
    divided by that step's time, so both have the same argmax over k; measuring
    verify_s per k adds what Theorem 3.8 leaves out: on a CPU (or a busy GPU)
    scoring k + 1 tokens costs more than scoring one.
    """
    _check(alpha, k)
    if draft_step_s < 0 or verify_s <= 0:
        raise ValueError(f"need draft_step_s >= 0 and verify_s > 0, got {draft_step_s}, {verify_s}")
    return expected_tokens_per_loop(alpha, k) / (k * draft_step_s + verify_s)


def expected_tokens_from_rates(rates: Sequence[float]) -> float:
    """1 + sum_i prod_{j <= i} rates[j]: Equation 1 with one acceptance rate per draft position.

    rates[j] = P(draft j accepted | drafts 0..j-1 accepted). Real acceptance is
    bursty (a draft that got the first tokens right tends to get the next ones
    right), so these conditional rates grow with j where Leviathan et al. assume
    one i.i.d. alpha; with every rate equal to alpha this is expected_tokens_per_loop:
    >>> round(expected_tokens_from_rates([0.8] * 4), 3) == round(expected_tokens_per_loop(0.8, 4), 3)
    True
    """
    total, survive = 1.0, 1.0
    for rate in rates:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"acceptance rates must lie in [0, 1], got {rate}")
        survive *= rate
        total += survive
    return total


def best_k(rates: float | Sequence[float], draft_step_s: float, verify_s: Callable[[int], float],
           max_k: int, min_k: int = 1) -> int:
    """argmax over k in min_k..max_k of predicted tokens/s, expected tokens / (k draft_step_s + verify_s(k)).

    min_k = 0 lets "do not draft" win (1 token per verify_s(0), plain decoding) where
    drafting cannot pay: a slow draft, low acceptance, or verification that costs
    nearly k + 1 steps.

    rates: one alpha (Leviathan et al.'s i.i.d. model) or a conditional rate per
    draft position (expected_tokens_from_rates; at least max_k of them).
    verify_s(k) = the target's time for k + 1 tokens. Ties go to the smaller k.
    With one alpha and a constant verify_s this is optimal_k:
    >>> best_k(0.8, 0.05, lambda k: 1.0, 16) == optimal_k(0.8, 0.05, 16)
    True
    """
    rates = [rates] * max_k if isinstance(rates, (int, float)) else list(rates)
    if len(rates) < max_k:
        raise ValueError(f"need an acceptance rate for each of the {max_k} draft positions, got {len(rates)}")
    if draft_step_s < 0:
        raise ValueError(f"draft_step_s must be >= 0, got {draft_step_s}")

    def tokens_per_s(k: int) -> float:
        return expected_tokens_from_rates(rates[:k]) / (k * draft_step_s + verify_s(k))

    return max(range(min_k, max_k + 1), key=lambda k: (tokens_per_s(k), -k))


def speedup_from_step_times(tokens_per_loop: float, k: int, draft_step_s: float, target_step_s: float) -> float:
    """Speedup from measured quantities: tokens per loop x one target step / (k draft steps + one target step).

    For example (the seed document's worked example, in any one unit of time): 0.8125
    accepted per position of k + 1 = 5, a target step of 73.3 and a draft step of 11.9:
    >>> round(speedup_from_step_times(0.8125 * 5, 4, 11.9, 73.3), 2)
    2.46
    """
    if tokens_per_loop < 1 or draft_step_s < 0 or target_step_s <= 0:
        raise ValueError("need tokens_per_loop >= 1, draft_step_s >= 0 and target_step_s > 0")
    return tokens_per_loop * target_step_s / (k * draft_step_s + target_step_s)


# ---- acceptance rates of distributions (tensors in, tensors out) -------------------------------


def acceptance_rate(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """beta = sum_x min(p(x), q(x)) over the last dim: [..., V] -> [...] (Leviathan et al., Definition 3.1).

    The probability that modified rejection sampling accepts a token drawn from q;
    alpha is its mean over positions. Point masses (temperature 0) give 1 where
    the argmaxes agree and 0 where they differ.
    >>> import torch
    >>> float(acceptance_rate(torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.2, 0.2, 0.6])))
    0.4000000059604645
    """
    return torch.minimum(target_probs.float(), draft_probs.float()).sum(dim=-1)


def lenient_acceptance_rate(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                            lenience: float) -> torch.Tensor:
    """sum_x min(q(x), p(x) / l): the acceptance rate of the lenient rule, [..., V] -> [...].

    Leviathan et al., Appendix A.5: multiplying q by a lenience factor 0 < l <= 1
    before comparing it with p accepts x with probability min(1, p(x) / (l q(x))),
    so beta_l = E_{x~q}[min(1, p / (l q))] = sum_x min(q(x), p(x) / l). l = 1 is
    the exact rule (= acceptance_rate); l -> 0 accepts every draft. Lossy for l < 1:
    the output no longer follows the target's distribution.
    >>> import torch
    >>> float(lenient_acceptance_rate(torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.2, 0.2, 0.6]), 0.5))
    0.4000000059604645
    >>> float(lenient_acceptance_rate(torch.tensor([0.6, 0.4]), torch.tensor([0.2, 0.8]), 0.5))
    1.0
    """
    if not 0.0 < lenience <= 1.0:
        raise ValueError(f"lenience must lie in (0, 1], got {lenience}")
    return torch.minimum(draft_probs.float(), target_probs.float() / lenience).sum(dim=-1)
