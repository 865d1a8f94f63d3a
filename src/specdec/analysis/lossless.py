"""Empirical losslessness checks a user can run on their own models (`specdec verify`).

Distribution check: from one prompt, draw many continuations through the
speculative engine and as many through plain decoding of the target, and test
whether the first token, and the first two tokens jointly, follow the same
distribution: Pearson's chi-square test of homogeneity on a 2 x m contingency
table (categories expected fewer than 5 times are pooled, the usual rule), with
the total-variation distance between the two empirical distributions. The
speculative side goes through the very code users run (proposal, target pass,
rejection sampling, rollback), so a bug in any of them shows up here.

Greedy check: at temperature 0, the speculative output equals plain decoding's,
token for token, over a set of prompts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HomogeneityTest:
    what: str  # "first token" | "first two tokens"
    samples: int  # per side
    categories: int  # after pooling
    chi2: float
    dof: int
    p_value: float
    total_variation: float  # 0.5 sum |f_spec - f_plain| over the unpooled outcomes


def chi2_survival(chi2: float, dof: int) -> float:
    """P(X >= chi2) for X ~ chi-square(dof) = Q(dof / 2, chi2 / 2), the regularized upper gamma."""
    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)))


def homogeneity_test(spec: list[Hashable], plain: list[Hashable], what: str = "",
                     min_expected: float = 5.0) -> HomogeneityTest:
    """Chi-square test that two samples come from one distribution.

    >>> t = homogeneity_test(["a"] * 50 + ["b"] * 50, ["a"] * 50 + ["b"] * 50)
    >>> round(t.chi2, 6), t.dof, round(t.p_value, 6)
    (0.0, 1, 1.0)
    >>> homogeneity_test(["a"] * 90 + ["b"] * 10, ["a"] * 10 + ["b"] * 90).p_value < 1e-6
    True
    """
    if not spec or not plain:
        raise ValueError("both samples must be non-empty")
    count_s, count_p = Counter(spec), Counter(plain)
    n_s, n_p = len(spec), len(plain)
    outcomes = sorted(set(count_s) | set(count_p), key=lambda o: -(count_s[o] + count_p[o]))
    total_variation = 0.5 * sum(abs(count_s[o] / n_s - count_p[o] / n_p) for o in outcomes)
    # Expected count of outcome o on the smaller side is (n_o) * min(n) / (n_s + n_p).
    share = min(n_s, n_p) / (n_s + n_p)
    kept = [o for o in outcomes if (count_s[o] + count_p[o]) * share >= min_expected]
    rows = [(count_s[o], count_p[o]) for o in kept]
    rest = (n_s - sum(a for a, _ in rows), n_p - sum(b for _, b in rows))  # the rare outcomes, pooled
    if sum(rest):
        if rows and sum(rest) * share < min_expected:  # too rare to stand alone: join the smallest kept one
            a, b = rows.pop()
            rest = (a + rest[0], b + rest[1])
        rows.append(rest)
    chi2 = 0.0
    for a, b in rows:
        n_o = a + b
        for observed, n_side in ((a, n_s), (b, n_p)):
            expected = n_o * n_side / (n_s + n_p)
            chi2 += (observed - expected) ** 2 / expected
    dof = len(rows) - 1
    return HomogeneityTest(what, min(n_s, n_p), len(rows), chi2, dof, chi2_survival(chi2, dof), total_variation)


def distribution_tests(spec_draws: list[list[int]], plain_draws: list[list[int]]) -> list[HomogeneityTest]:
    """The first token and the first two tokens, speculative vs plain."""
    return [
        homogeneity_test([d[0] for d in spec_draws], [d[0] for d in plain_draws], "first token"),
        homogeneity_test([tuple(d[:2]) for d in spec_draws], [tuple(d[:2]) for d in plain_draws],
                         "first two tokens"),
    ]


def verdict_lines(tests: list[tuple[str, HomogeneityTest]], threshold: float) -> tuple[list[str], bool]:
    """One printed line per (prompt, test), PASS/FAIL against the (Bonferroni) threshold, and
    whether any failed: what `specdec verify` prints, for local engines and for servers alike."""
    lines, failed = [], False
    for prompt, test in tests:
        ok = test.p_value >= threshold
        failed |= not ok
        verdict = ("PASS" if ok else "FAIL") if test.dof > 0 else "n/a "  # every outcome too rare to test
        lines.append(f"  {verdict}  {test.what:<17} chi2 {test.chi2:8.2f}  dof {test.dof:3d}  "
                     f"p {test.p_value:.3g}  TV {test.total_variation:.3f}  {prompt[:40]!r}")
    return lines, failed

