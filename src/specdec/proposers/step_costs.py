"""What a step costs on this machine, for choosing how much to draft: StepCosts (a forward of n tokens
over a 1-token step, measured by the engine as it runs) and the prior it starts from (the shipped
scorer file's cost curve). Scored copying and copy+draft price their choices by it.
"""

from __future__ import annotations

import statistics
from collections import deque

from specdec.planning.costs import RecentTimes, interpolated
from specdec.proposers.copy_candidates import CostFn, shipped_scorer_data


def prior_cost() -> CostFn:
    """The cost curve assumed until the engine has measured its own: the shipped file's (a forward
    of n tokens over a 1-token step)."""
    ratio = shipped_scorer_data()["cost prior"]["ratio"]
    return interpolated(sorted((int(n), float(r)) for n, r in ratio.items()))


class StepCosts:
    """Verification cost over a 1-token step, by tokens in the forward: the engine's own medians
    (planning/costs.RecentTimes, fed one-row steps by engine/step.py's record_step_costs) once
    forwards of two sizes were measured, the prior before; measured=False: the prior always (a
    fixed table). One per engine: every row shares it.

    Trees are timed apart (tree_cost): on a CPU a forward costs what its rows do whatever their
    shape, but on a GPU a tree's step gathers each node's keys and costs more than a chain's of as
    many tokens (benchmarks/RESULTS.md, "Trees on a GPU: the prefix read in place"). Until a tree
    step is measured (or where the fixed table times none), a tree costs the chain curve's price."""

    def __init__(self, prior: CostFn | None = None, window: int = 64, measured: bool = True,
                 tree_prior: CostFn | None = None) -> None:
        self.prior = prior or prior_cost()
        self.tree_prior = tree_prior
        self.times = RecentTimes(window)
        self.tree_times = RecentTimes(window)
        self.batch_times = RecentTimes(window)  # steps of several rows, by the forward's tokens
        self.measured = measured
        self._one_token: deque[float] = deque(maxlen=window)  # 1-token steps' seconds, kept even for a fixed table
        self._curves: tuple[CostFn, CostFn | None] | None = (self.prior, tree_prior)  # rebuilt after a record

    def record(self, tokens: int, seconds: float, tree: bool = False) -> None:
        if tokens == 1:
            self._one_token.append(seconds)
        if self.measured:
            (self.tree_times if tree else self.times).add(tokens, seconds)
            self._curves = None

    def cost(self, tokens: int) -> float:
        return self._current()[0](tokens)

    def record_batch(self, tokens: int, seconds: float) -> None:
        """A step of several rows: its forward's tokens (rows x width) and its time."""
        if self.measured:
            self.batch_times.add(tokens, seconds)

    def batch_cost(self) -> CostFn:
        """The cost of a several-row forward by its tokens, in any one unit (a batch compares widths
        of the same rows): its measured times once two sizes were seen, else the chain curve. A
        batch's forward reads every row's context, so it costs more than one row's of as many tokens."""
        if len({x for x, _ in self.batch_times.samples}) >= 2:
            seconds = self.batch_times.predictor()
            return lambda tokens: max(seconds(tokens), 1e-9)
        return self.cost

    def step_seconds(self) -> float | None:
        """A 1-token step's time on this machine (the median of the recent ones), None before one was
        timed: what prices another source's seconds (a draft model's) in steps."""
        return statistics.median(self._one_token) if self._one_token else None

    def tree_cost(self, tokens: int) -> float:
        """A tree forward of `tokens` (nodes and the root) over a chain's 1-token step; never below
        a chain's of as many tokens."""
        chain, tree = self._current()
        return chain(tokens) if tree is None else max(tree(tokens), chain(tokens))

    def _current(self) -> tuple[CostFn, CostFn | None]:
        if self._curves is None:  # a choice asks for many sizes: the medians once per recorded step
            self._curves = self._measured_curves() or (self.prior, self.tree_prior)
        return self._curves

    @property
    def chains_known(self) -> bool:
        """Whether chains are priced by this machine's times (or a fixed table): until then a tree
        is not drafted, since its price is judged against the chain's and a chain step of another
        size than plain's is what measures that (trees winning from the first step would leave
        both shapes priced by the prior, another machine's curve, for good)."""
        return not self.measured or len({x for x, _ in self.times.samples}) >= 2

    def _measured_curves(self) -> tuple[CostFn, CostFn | None] | None:
        if not self.chains_known:
            return None
        seconds = self.times.predictor()
        one = seconds(1)
        if one <= 0:
            return None
        tree_seconds = self.tree_times.predictor()
        tree = self.tree_prior if tree_seconds is None else (lambda tokens: tree_seconds(tokens) / one)
        return (lambda tokens: max(seconds(tokens) / one, 1.0)), tree
