"""Every copy candidate at each step of recorded greedy answers, with what each is worth: the data
for fitting the score that scored copying chooses by (issue 60, item 1).

Replay (analysis/replay.py) drives one proposer and learns what its one choice accepts; the copy
ceiling learns what the best choice would. Between the two lies the question this module asks:
given everything n-gram lookup and suffix decoding could copy at a step (the candidates and their
features: proposers/copy_candidates.py), which features tell the continuation that the answer will
follow, and how far?

The label is exact: at temperature 0 a point-mass draft is accepted as far as it agrees with the
answer, so a candidate's label is its common prefix with answer[p:].

The scorer is a logistic regression (or a regression tree, `fit_tree`) of the hazard "the depth-i
drafted token is accepted, given the ones before it were" on the features and i; `scored_chooser`
takes at each step what copy_candidates.choose_draft takes live. `walk` drives a chooser through an
answer as replay drives a proposer (replay._committed's accounting), so its speed compares with
replay's rows and the copy ceiling. Measured on the recorded runs: benchmarks/candidate_scorer.py,
its tables in benchmarks/results/candidates/ (MANIFEST.md there); `specdec replay --fit` fits the
scorer the package ships (or a user's own) the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

# _committed: the engine's count of a step's tokens, exactly as replay() counts them.
from specdec.analysis.replay import (MATCHED_CEILING, CostFn, RecordedTurn, ReplayRow, TurnSteps, _committed,
                                     cheapest_path, tally)
from specdec.proposers.copy_candidates import (FEATURES, HAZARD_FEATURES, PATH_FEATURES, SEPARATOR, SOURCES,
                                               LogisticScorer, StepCandidates, choose_draft, hazard_rows,
                                               path_features, step_candidates)

__all__ = ["FEATURES", "HAZARD_FEATURES", "PATH_FEATURES", "SOURCES", "LogisticScorer", "StepCandidates",
           "CopyOracles", "TurnCandidates", "TreeScorer", "best_offered", "collect", "fit_logistic", "fit_tree",
           "half_oracle_choosers", "hazard_rows", "matched_ceiling", "path_features", "scored_chooser",
           "step_candidates", "training_set", "walk"]


@dataclass
class TurnCandidates:
    turn: RecordedTurn
    steps: dict[int, StepCandidates]  # by answer position; a position with no candidate is absent


def collect(turns: Sequence[RecordedTurn], k: int, stream: bool, depth: int = 24,
            most: int = 64) -> list[TurnCandidates]:
    """Every answer position's candidates, with the context replay gives that position (prompt and
    answer so far; in a stream, also every earlier turn's prompt and answer, as the copy ceiling)."""
    result = []
    earlier_texts: list[tuple[Sequence[int], int]] = []
    previous_question = None
    for turn in turns:
        if not stream and turn.question_id != previous_question:
            earlier_texts = []
        previous_question = turn.question_id
        earlier = earlier_source = None
        if earlier_texts:
            earlier = np.concatenate([np.append(np.asarray(t, np.int64), SEPARATOR) for t, _ in earlier_texts])
            earlier_source = np.concatenate([np.full(len(t) + 1, s) for t, s in earlier_texts])
        full = np.asarray(turn.prompt_ids + turn.output_ids, np.int64)
        prompt_len = len(turn.prompt_ids)
        steps = {}
        for position in range(1, len(turn.output_ids)):
            found = step_candidates(position, full[:prompt_len + position], prompt_len, earlier, earlier_source,
                                    k, depth, most, answer_rest=turn.output_ids[position:])
            if found is not None:
                steps[position] = found
        result.append(TurnCandidates(turn, steps))
        earlier_texts += [(turn.prompt_ids, 2), (turn.output_ids, 3)]
    return result


def training_set(candidates: Sequence[TurnCandidates], k: int) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) for the hazard: each candidate's depths up to one past its accepted length (a depth
    after a rejection is never reached), y = 1 where the depth-i token is accepted."""
    xs, ys = [], []
    for turn in candidates:
        for step in turn.steps.values():
            x, candidate, depth = hazard_rows(step, k)
            reached = depth <= step.labels[candidate] + 1
            xs.append(x[reached])
            ys.append(depth[reached] <= step.labels[candidate[reached]])
    return np.concatenate(xs), np.concatenate(ys).astype(float)


def fit_scorer(runs: Sequence[tuple[Sequence[RecordedTurn], bool]], k: int) -> tuple[LogisticScorer, dict]:
    """The logistic hazard fitted on every step of recorded greedy answers (each run: its turns, and
    whether they were one stream), and what it was fitted on: what `specdec replay --fit` writes."""
    found = [tc for turns, stream in runs for tc in collect(turns, k, stream)]
    x, y = training_set(found, k)
    about = dict(k=k, turns=len(found), steps=sum(len(tc.steps) for tc in found), hazard_rows=len(y),
                 accepted_share=round(float(y.mean()), 4),
                 categories=sorted({tc.turn.category for tc in found}))
    return fit_logistic(x, y), about


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1e-3, iterations: int = 50) -> LogisticScorer:
    """Maximum likelihood with a small ridge on the standardised weights, by Newton's method (IRLS)."""
    mean, scale = x.mean(axis=0), x.std(axis=0)
    scale = np.where(scale > 0, scale, 1.0)
    design = np.hstack([np.ones((len(x), 1)), (x - mean) / scale])
    beta = np.zeros(design.shape[1])
    ridge = l2 * len(x) * np.eye(design.shape[1])
    ridge[0, 0] = 0.0
    for _ in range(iterations):
        p = 1.0 / (1.0 + np.exp(-np.clip(design @ beta, -40, 40)))
        gradient = design.T @ (y - p) - ridge @ beta
        hessian = (design * (p * (1 - p))[:, None]).T @ design + ridge
        step = np.linalg.solve(hessian + 1e-9 * np.eye(len(beta)), gradient)
        beta += step
        if np.abs(step).max() < 1e-8:
            break
    return LogisticScorer(mean, scale, beta[1:], float(beta[0]))


@dataclass(frozen=True)
class TreeScorer:
    """P(y = 1 | x) from a regression tree: nodes[i] = (feature, threshold, left, right) with
    feature -1 at a leaf, whose probability is threshold."""

    nodes: tuple[tuple[int, float, int, int], ...]

    def probability(self, x: np.ndarray) -> np.ndarray:
        out = np.empty(len(x))
        pending = [(0, np.arange(len(x)))]
        while pending:
            node, rows = pending.pop()
            feature, threshold, left, right = self.nodes[node]
            if feature < 0:
                out[rows] = threshold
                continue
            low = x[rows, feature] <= threshold
            pending += [(left, rows[low]), (right, rows[~low])]
        return out


def fit_tree(x: np.ndarray, y: np.ndarray, depth: int = 8, min_leaf: int = 200) -> TreeScorer:
    """A CART regression tree on y (squared error, i.e. Gini for 0/1), each leaf's probability
    smoothed by one success and one failure: the features' interactions that a logistic score,
    linear in them, cannot express (a long match matters only where the candidates agree, ...)."""
    nodes: list = []

    def grow(rows: np.ndarray, levels: int) -> int:
        index = len(nodes)
        nodes.append(None)
        labels = y[rows]
        probability = (labels.sum() + 1) / (len(labels) + 2)
        best = None
        if levels > 0 and len(rows) >= 2 * min_leaf:
            for feature in range(x.shape[1]):
                order = np.argsort(x[rows, feature], kind="stable")
                values, sorted_labels = x[rows[order], feature], labels[order]
                left_sum = np.cumsum(sorted_labels)[:-1]
                left_n = np.arange(1, len(rows))
                right_sum, right_n = labels.sum() - left_sum, len(rows) - left_n
                error = left_sum - left_sum ** 2 / left_n + right_sum - right_sum ** 2 / right_n
                valid = (values[:-1] != values[1:]) & (left_n >= min_leaf) & (right_n >= min_leaf)
                if valid.any():
                    i = int(np.where(valid, error, np.inf).argmin())
                    if best is None or error[i] < best[0]:
                        best = (error[i], feature, (values[i] + values[i + 1]) / 2)
        if best is None or best[0] >= labels.sum() - labels.sum() ** 2 / len(labels):
            nodes[index] = (-1, float(probability), -1, -1)
            return index
        _, feature, threshold = best
        low = x[rows, feature] <= threshold
        left = grow(rows[low], levels - 1)
        right = grow(rows[~low], levels - 1)
        nodes[index] = (feature, float(threshold), left, right)
        return index

    grow(np.arange(len(x)), depth)
    return TreeScorer(tuple(nodes))


Scorer = LogisticScorer | TreeScorer
Chooser = Callable[[StepCandidates, int], tuple[int, int]]  # (step, k) -> (candidate, tokens drafted); (-1, 0): none


def scored_chooser(scorer: Scorer, cost: CostFn) -> Chooser:
    """The candidate and length with the most expected tokens per unit cost: (1 + expected accepted)
    / cost(1 + d), against 1 / cost(1) for no draft (copy_candidates.choose_draft, as live)."""
    def choose(step: StepCandidates, k: int) -> tuple[int, int]:
        x, _, _ = hazard_rows(step, k)
        candidate, drafted, _ = choose_draft(step, scorer.probability(x), cost, k)
        return candidate, drafted

    return choose


def half_oracle_choosers(scorer: Scorer, cost: CostFn) -> dict[str, Chooser]:
    """Two choosers that know half the answer, to say where a scored chooser loses against the matched
    ceiling (which knows both halves): "its candidate, the accepted length" drafts the scorer's
    candidate exactly as far as the answer follows it, shorter or longer than the scorer would
    (nothing where the scorer drafts nothing, or the answer does not follow it);
    "its length, the best candidate" drafts the scorer's length from whichever candidate offering
    that many tokens the answer follows furthest. A live chooser can do no better than either with
    the other half fixed, so their speed bounds what a better length rule or a better choice of
    candidate alone could bring."""
    choose = scored_chooser(scorer, cost)

    def accepted_length(step: StepCandidates, k: int) -> tuple[int, int]:
        candidate, drafted = choose(step, k)
        accepted = min(int(step.labels[candidate]), k) if drafted else 0  # (a label never passes its offer)
        return (candidate, accepted) if accepted else (-1, 0)

    def best_candidate(step: StepCandidates, k: int) -> tuple[int, int]:
        _, drafted = choose(step, k)
        if not drafted:
            return -1, 0
        offering = np.flatnonzero(step.lengths >= drafted)
        return int(offering[np.argmax(step.labels[offering])]), drafted

    return {"its candidate, the accepted length": accepted_length, "its length, the best candidate": best_candidate}


def walk(turn: TurnCandidates, choose: Chooser, k: int, max_new_tokens: int | None = None) -> TurnSteps:
    """A turn's steps when each step drafts what `choose` picks among the offered candidates, counted
    as replay() counts a proposer's (the engine's cap on k included)."""
    steps = TurnSteps()
    answer = turn.turn.output_ids
    position = 1
    while position < len(answer):
        cap = k if max_new_tokens is None else min(k, max_new_tokens - position - 1)
        step = turn.steps.get(position)
        drafted, accepted = 0, 0
        if step is not None and cap >= 1:
            candidate, drafted = choose(step, cap)
            if drafted:
                if not 1 <= drafted <= min(int(step.lengths[candidate]), cap):
                    raise ValueError(f"the chooser drafted {drafted} tokens of a candidate offering "
                                     f"{int(step.lengths[candidate])} (cap {cap})")
                accepted = min(drafted, int(step.labels[candidate]))
        accepted, committed = _committed(accepted, len(answer) - position, turn.turn.ended_by_eos)
        steps.drafted.append(drafted)
        steps.accepted.append(accepted)
        position += committed
    return steps


def best_offered(turn: TurnCandidates, k: int) -> list[int]:
    """Per answer position (0 for the prefill's), the longest accepted length any candidate offers:
    the copy ceiling's copyable_lengths when the candidates cover what it copies."""
    row = [0] * len(turn.turn.output_ids)
    for position, step in turn.steps.items():
        row[position] = int(min(step.labels.max(), k))
    return row


def matched_ceiling(turn: TurnCandidates, k: int, cost: CostFn) -> tuple[float, TurnSteps]:
    """The matched ceiling's decode time and steps through a turn: the cheapest path when each step may
    take up to the longest accepted length any candidate offers there (best_offered)."""
    return cheapest_path(turn.turn, [(best_offered(turn, k), 0.0)], cost)


class CopyOracles:
    """replay_rows()'s oracles for --method copy (`specdec replay`): where its choice loses on a run.

    At each k: the matched ceiling (the best candidate at its accepted length, what no copy keyed on
    the context's tail beats) and the two half-oracles of half_oracle_choosers() with the scorer copy
    chooses by (without copy's online calibration): between copy's row and the matched ceiling, how
    much a better length rule and how much a better choice of candidate could each bring."""

    def __init__(self, scorer: Scorer, cost: CostFn, stream: bool, max_new_tokens: int | None = None) -> None:
        self.scorer, self.cost, self.stream, self.max_new_tokens = scorer, cost, stream, max_new_tokens

    def __call__(self, turns: Sequence[RecordedTurn], k: int, copies: list[list[int]]) -> list[ReplayRow]:
        found = collect(turns, k, self.stream)
        best = [matched_ceiling(tc, k, self.cost) for tc in found]
        rows = [ReplayRow(MATCHED_CEILING, k, tally(turns, [steps for _, steps in best], self.cost,
                                                 [time for time, _ in best]))]
        for name, choose in half_oracle_choosers(self.scorer, self.cost).items():
            steps = [walk(tc, choose, k, self.max_new_tokens) for tc in found]
            rows.append(ReplayRow(f"copy's score: {name}", k, tally(turns, steps, self.cost)))
        return rows
