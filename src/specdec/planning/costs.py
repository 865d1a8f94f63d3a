"""Measured costs, summarised so that one-off slow steps do not count (adaptive k, tree budgets)."""

from __future__ import annotations

import math
import statistics
from collections import deque
import json
from collections.abc import Callable, Sequence
from pathlib import Path


class RecentTimes:
    """The last `window` (x, seconds) samples, summarised by medians so one-off slow steps do not count."""

    def __init__(self, window: int) -> None:
        self.samples: deque[tuple[float, float]] = deque(maxlen=window)

    def add(self, x: float, seconds: float) -> None:
        self.samples.append((x, seconds))

    def predictor(self) -> Callable[[float], float] | None:
        """seconds(x): the median of x's own samples where x was seen; elsewhere a straight
        line through the median of each seen x, weighted by how often it was seen.

        Measured points win because costs are not linear in x: on the embedded
        pair verifying 4 or 5 tokens costs about the same, 7 about 35% more. The
        line only extrapolates to untried x; one x seen so far gives a flat line.
        Its slope is never negative: verifying more tokens never costs less.
        For the same reason no x costs more than a larger x seen: a median above a
        larger x's is lowered to it. Why: -k auto's first plain step is one sample
        of x = 1, and once drafting is chosen no plain step comes to correct it; a
        first step slowed many times over by a neighbour made one drafted token look
        cheaper than none, so a draft that was never right kept being asked, step
        after step (tests/engine/test_adaptive.py; docs/history.md, "w4a8: tiles
        of 2 rows or more prefetch their weights (issue 38, item 1)").
        """
        by_x: dict[float, list[float]] = {}
        for x, y in self.samples:
            by_x.setdefault(x, []).append(y)
        if not by_x:
            return None
        medians = {x: statistics.median(ys) for x, ys in by_x.items()}
        cheapest_above = math.inf
        for x in sorted(medians, reverse=True):
            medians[x] = cheapest_above = min(medians[x], cheapest_above)
        weights = {x: len(ys) for x, ys in by_x.items()}
        total = sum(weights.values())
        mean_x = sum(x * weights[x] for x in medians) / total
        mean_y = sum(medians[x] * weights[x] for x in medians) / total
        spread = sum(weights[x] * (x - mean_x) ** 2 for x in medians)
        slope = sum(weights[x] * (x - mean_x) * (medians[x] - mean_y) for x in medians) / spread if spread else 0.0
        slope = max(slope, 0.0)
        return lambda x: medians[x] if x in medians else mean_y + slope * (x - mean_x)


def interpolated(points: Sequence[tuple[int, float]]) -> Callable[[int], float]:
    """A cost curve through measured (tokens, cost) points, ascending: linear between them, and
    beyond the last two along their line."""
    def cost(rows: int) -> float:
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if rows <= x1:
                return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = points[-2], points[-1]
        return y1 + (y1 - y0) * (rows - x1) / (x1 - x0)

    return cost


def cost_ratios(path: str | Path) -> tuple[list[tuple[int, float]], dict, dict]:
    """(points, the file, its first result) of a cost file (`specdec costs`, analysis/machine_costs.py):
    the measured ratio of an n-token forward to a 1-token step, ascending in n."""
    try:
        data = json.loads(Path(path).read_text())
        result = data["results"][0]
        points = sorted((int(rows), float(ratio)) for rows, ratio in result["ratio"].items())
    except OSError as error:
        raise ValueError(f"cannot read the cost table {path}: {error}") from error
    except (KeyError, IndexError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: not a cost table (no results[0].ratio; `specdec costs` writes one)") from error
    if len(points) < 2 or points[0][0] != 1:
        raise ValueError(f"{path}: needs the 1-token step and at least one longer forward")
    return points, data, result


def tree_cost_ratios(path: str | Path) -> list[tuple[int, float]] | None:
    """A cost file's tree forwards (its entry with "tree": true, `specdec costs --trees`) over the
    chain's 1-token step (its first result's), ascending in nodes + 1; None where it times no trees:
    a tree then costs what a chain of as many tokens does, as on a CPU, where a forward's cost
    follows its rows whatever their shape. On a GPU a tree's step gathers each node's keys and costs
    more than a chain's (benchmarks/RESULTS.md, "Trees on a GPU: the prefix read in place")."""
    _, data, chain = cost_ratios(path)
    trees = [result for result in data["results"] if result.get("tree")]
    if not trees:
        return None
    try:
        one = float(chain["step_ms"]["1"])  # a JSON file's keys are strings
        points = sorted((int(rows), float(ms) / one) for rows, ms in trees[0]["step_ms"].items())
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: a tree entry needs step_ms, and the first result the 1-token step's") from error
    return points

