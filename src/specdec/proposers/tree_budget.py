"""Tree size per step (`--tree-size auto`): how many of the head's best nodes to verify.

EAGLE-2 (Li et al. 2024, arXiv 2406.16858, Section 4) grows a draft tree by the
head's confidence, the product of its probabilities along a node's path, which
the paper shows approximates the chance the node is accepted. Then the expected
number of accepted drafts of a tree is the sum of its nodes' path probabilities,
and the best nodes to verify are the most confident ones: exactly the order in
which the proposer adds them. What EAGLE-2 fixes by hand is how many: 60 on a GPU,
where 60 more tokens in a forward cost almost nothing. On a CPU every node is a
token of compute (8 nodes cost more than a one-token step, 64 nodes several times it:
docs/history.md, "Tree verification cost on an AVX512-BF16 CPU (issue 20)"), so the
right size depends on the machine and on how confident the head is, step by step.

TreeBudget chooses it as adaptive k (engine/adaptive.py) chooses a chain's length:

  value     N nodes commit 1 + c x (p_1 + ... + p_N) tokens, p_i the i-th best
            node's path probability and c a calibration (below), for verify(N + 1)
            seconds; the step's N maximises their ratio (N = 0: plain decoding).
            The head's time is spent before the choice and does not depend on it.
  costs     verify(n) is measured: the median seconds of verifying n tokens where n
            was seen, a straight line through those medians elsewhere (RecentTimes).
            Until two sizes are measured the budget alternates between start_nodes
            and half of it, and it never more than doubles the largest size measured
            so far, so the line is only stretched a little past what was seen.
  calibration  c = accepted drafts / predicted ones over recent steps (decayed), so a
            head that is over-confident on this text is believed less. It starts at 1.

It only chooses how many of the proposer's nodes are verified, never how they are
verified, so trees stay exactly as lossless as with a fixed size (tests pin it).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

from specdec.planning.costs import RecentTimes


class TreeBudget:
    """One per proposer (a request at a time): choose() before verification, record() after.

    >>> budget = TreeBudget(max_nodes=32)
    >>> n = budget.choose([0.9, 0.6, 0.3, 0.1])      # the nodes' path probabilities, best first
    >>> budget.record(verified_tokens=n + 1, verify_s=0.05, accepted=2)
    """

    def __init__(self, max_nodes: int = 64, *, start_nodes: int = 8, cost_window: int = 32,
                 decay: float = 0.9, prior_weight: float = 2.0) -> None:
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
            raise ValueError(f"max_nodes must be an integer >= 1, got {max_nodes!r}")
        self.max_nodes = max_nodes
        self.start_nodes = max(1, min(start_nodes, max_nodes))
        self.decay = decay
        self._verify_s = RecentTimes(cost_window)
        self._predicted = self._accepted = prior_weight  # decayed sums: c starts at 1
        self._pending: float | None = None  # this step's uncalibrated prediction, until record()
        self._probes = 0

    def calibration(self) -> float:
        return self._accepted / self._predicted

    def choose(self, path_probs: Sequence[float]) -> int:
        """How many of the candidates to verify. path_probs: each candidate's path probability, in
        the order the proposer adds them (best first; every prefix holds its nodes' ancestors)."""
        limit = min(len(path_probs), self.max_nodes)
        cumulative = list(accumulate(path_probs[:limit], initial=0.0))  # [0, p_1, p_1 + p_2, ...]
        best = self._best(cumulative)
        if best is None:  # measure two sizes before trusting a line through them
            self._probes += 1
            n = min(limit, self.start_nodes if self._probes % 2 else max(1, self.start_nodes // 2))
        else:
            n = best
        self._pending = cumulative[n]
        return n

    def worth_growing(self, path_probs: Sequence[float], best_new: float) -> bool:
        """Whether growing the tree can still pay: could a node of path probability best_new join
        the best choice among path_probs (best first)? The proposer stops expanding once not, since
        a node's children are never more probable than itself: a head that is unsure this step
        costs one layer of drafting instead of the tree's depth. True until costs are measured.
        (A heuristic on when to stop drafting: choose() still decides among what was drafted.)"""
        cumulative = list(accumulate(path_probs[:self.max_nodes], initial=0.0))
        n = self._best(cumulative)
        if n is None:
            return True
        if n == self.max_nodes:
            return False
        verify, c = self._verify_s.predictor(), self.calibration()
        return (1 + c * (cumulative[n] + best_new)) / max(verify(n + 2), 1e-9) > \
            (1 + c * cumulative[n]) / max(verify(n + 1), 1e-9)

    def _best(self, cumulative: list[float]) -> int | None:
        """The node count maximising expected tokens per second of verification; None before two
        sizes are measured. cumulative[m]: the first m candidates' summed path probabilities."""
        sizes = sorted({int(x) - 1 for x, _ in self._verify_s.samples})  # node counts measured so far
        if len(sizes) < 2:
            return None
        verify = self._verify_s.predictor()
        c = self.calibration()
        reach = min(len(cumulative) - 1, 2 * max(sizes))
        return max(range(reach + 1), key=lambda m: (1 + c * cumulative[m]) / max(verify(m + 1), 1e-9))

    def record(self, *, verified_tokens: int, verify_s: float, accepted: int) -> None:
        """The step's verification: verified_tokens (the root and the chosen nodes) took verify_s and
        accepted that many drafts."""
        self._verify_s.add(float(verified_tokens), verify_s)
        if self._pending is not None:
            self._predicted = self._predicted * self.decay + self._pending
            self._accepted = self._accepted * self.decay + accepted
            self._pending = None
