"""Every continuation the copy sources could draft at each step of recorded greedy answers, with
what each is worth: the data for choosing among them by a learned score (issue 60, item 1).

Replay (analysis/replay.py) drives one proposer and learns what its one choice accepts; the copy
ceiling learns what the best choice would. Between the two lies the question this module asks:
given everything n-gram lookup (prompt lookup, Saxena 2023; LLMA, Yang et al. 2023, arXiv
2304.04487) and suffix decoding (Oliaro et al. 2024, arXiv 2411.04975) could copy at a step, which
features tell the continuation that the answer will follow, and how far?

A candidate is the continuation of one earlier occurrence of the context's tail: a start position
j in a text (this request's prompt and answer so far, and in a stream every earlier prompt and
answer) such that the tokens before j equal the context's last m >= 1 tokens. Every path either
proposer drafts is one: ngram copies what followed its longest matched n (n <= 3); a suffix tree's
path from its matched suffix's node is a substring of the texts it counts, so it is what followed
some occurrence of that suffix. Occurrences with the same continuation (its first k tokens) are one
candidate, its features taken from its best occurrence (the longest match, then the most recent).

Features (`FEATURES`), per candidate, and per draft depth in `hazard_rows`:
  match         m, the matched tail's length (capped at `depth`, suffix decoding's max depth)
  source        prompt / answer / earlier prompt / earlier answer (stream only), of the best occurrence
  recency       tokens back from the context's end to that occurrence's continuation
  occurrences   how many occurrences share this exact continuation
  frequency     among occurrences matching at least m tokens, the share whose next token is this
                candidate's: suffix decoding's count(child) / count(children) at the matched node
  support       how many occurrences match at least m tokens (the node's count)
  agreement     (per depth) among the candidates that agree with this one before depth i, the
                occurrence-weighted share that also agrees at depth i: several candidates agreeing
                on the next token, the frequency along the path
  agreement among longer matches   the same among candidates matched at least as long as this one
  branching     (per depth) how many different tokens the candidates agreeing before depth i offer
The label is exact: at temperature 0 a point-mass draft is accepted as far as it agrees with the
answer, so a candidate's label is its common prefix with answer[p:].

The scorer is a logistic regression (or a regression tree, `fit_tree`) of the hazard "the depth-i
drafted token is accepted, given the ones before it were" on the features and i; a candidate
drafted d tokens deep then expects sum_{i<=d} prod_{l<=i} h_l accepted tokens, and
`scored_chooser` takes, at each step, the candidate and length with the most tokens per unit of
verification cost, (1 + expected) / cost(1 + d), or no draft, 1 / cost(1). `walk` drives a chooser
through an answer as replay drives a proposer (replay._committed's accounting), so its speed
compares with replay's rows and the copy ceiling.
Measured on the recorded runs: benchmarks/candidate_scorer.py, its tables in
benchmarks/results/candidates/ (MANIFEST.md there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

# _committed: the engine's count of a step's tokens, exactly as replay() counts them.
from specdec.analysis.replay import CostFn, RecordedTurn, TurnSteps, _committed

SOURCES = ("prompt", "answer", "earlier prompt", "earlier answer")  # a candidate's source is an index here
FEATURES = ("log match", "log recency", "answer", "earlier prompt", "earlier answer", "log occurrences",
            "frequency", "log support", "log length")
PATH_FEATURES = ("agreement", "agreement among longer matches", "log branching")  # per depth
HAZARD_FEATURES = FEATURES + PATH_FEATURES + ("log depth", "depth 1")  # hazard_rows' columns
_SEPARATOR = -1  # between texts of the earlier corpus: no match or continuation crosses it


@dataclass
class StepCandidates:
    """The candidates at one answer position p (the context is the prompt and answer[:p])."""

    position: int
    tokens: np.ndarray  # [n, k] int64, each candidate's continuation, padded with -1
    lengths: np.ndarray  # [n] tokens offered (1..k)
    labels: np.ndarray  # [n] tokens of it the answer accepts (0..lengths)
    features: np.ndarray  # [n, len(FEATURES)] float
    path: np.ndarray  # [n, k, len(PATH_FEATURES)] float, per depth (see the module docstring)

    def __len__(self) -> int:
        return len(self.lengths)


@dataclass
class TurnCandidates:
    turn: RecordedTurn
    steps: dict[int, StepCandidates]  # by answer position; a position with no candidate is absent


def _occurrences(text: np.ndarray, context: np.ndarray, last_start: int, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, match lengths): each start j <= last_start of `text` whose preceding tokens equal the
    context's last m >= 1 (m capped at depth)."""
    if len(context) == 0 or last_start < 1:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.flatnonzero(text[:last_start] == context[-1]) + 1  # text[j - 1] == the last token
    lengths = np.ones(len(starts), np.int64)
    alive = np.arange(len(starts))
    for m in range(2, min(depth, len(context)) + 1):
        alive = alive[starts[alive] >= m]
        alive = alive[text[starts[alive] - m] == context[-m]]
        if not len(alive):
            break
        lengths[alive] = m
    return starts, lengths


def _continuation(text: np.ndarray, start: int, end: int, k: int) -> tuple[int, ...]:
    piece = text[start:min(start + k, end)]
    cut = np.flatnonzero(piece == _SEPARATOR)
    return tuple(int(t) for t in (piece[:cut[0]] if len(cut) else piece))


def step_candidates(position: int, context: np.ndarray, prompt_len: int, earlier: np.ndarray | None,
                    earlier_source: np.ndarray | None, answer_rest: Sequence[int], k: int, depth: int = 24,
                    most: int = 64) -> StepCandidates | None:
    """Every candidate at answer position `position` (None: there is none).

    context: [L] the prompt and the answer so far; earlier: the earlier texts joined by separators,
    earlier_source their index in SOURCES per token (2 or 3); answer_rest: the answer from here,
    for the labels. most: the longest-matched (then most recent) distinct continuations kept;
    frequency and support count every occurrence."""
    L = len(context)
    found = []  # (starts, match lengths, text, end of continuation, recency of each start, source of each)
    starts, lengths = _occurrences(context, context, L - 1, depth)  # a match is followed by a token
    found.append((starts, lengths, context, L, L - starts, np.where(starts < prompt_len, 0, 1)))
    if earlier is not None and len(earlier) > 1:
        e_starts, e_lengths = _occurrences(earlier, context, len(earlier) - 1, depth)
        keep = earlier[e_starts] != _SEPARATOR  # followed by a token of the same text
        e_starts, e_lengths = e_starts[keep], e_lengths[keep]
        found.append((e_starts, e_lengths, earlier, len(earlier), L + len(earlier) - e_starts,
                      earlier_source[e_starts]))
    all_lengths = np.concatenate([f[1] for f in found])
    if not len(all_lengths):
        return None
    all_next = np.concatenate([f[2][f[0]] for f in found])
    # Frequency and support at each match level (few distinct m per step).
    freq_at: dict[tuple[int, int], int] = {}
    support_at: dict[int, int] = {}
    for m in np.unique(all_lengths):
        at_least = all_next[all_lengths >= m]
        support_at[int(m)] = len(at_least)
        tokens, counts = np.unique(at_least, return_counts=True)
        freq_at.update({(int(m), int(t)): int(c) for t, c in zip(tokens, counts)})
    # Occurrences with the same continuation are one candidate: the best occurrence's features.
    recency = np.concatenate([f[4] for f in found])
    source = np.concatenate([f[5] for f in found])
    index = np.concatenate([np.full(len(f[0]), i) for i, f in enumerate(found)])
    flat_starts = np.concatenate([f[0] for f in found])
    order = np.lexsort((recency, -all_lengths))  # longest match first, then most recent
    best: dict[tuple[int, ...], list] = {}
    for i in order:
        text, end = found[index[i]][2], found[index[i]][3]
        continuation = _continuation(text, int(flat_starts[i]), end, k)
        if not continuation:
            continue
        entry = best.get(continuation)
        if entry is None:
            if len(best) < most:
                best[continuation] = [int(all_lengths[i]), int(recency[i]), int(source[i]), 1]
        else:
            entry[3] += 1
    if not best:
        return None
    n = len(best)
    tokens = np.full((n, k), -1, np.int64)
    lengths = np.zeros(n, np.int64)
    labels = np.zeros(n, np.int64)
    features = np.zeros((n, len(FEATURES)))
    weights = np.zeros(n)
    truth = np.asarray(answer_rest[:k], np.int64)
    for row, (continuation, (m, rec, src, occurrences)) in enumerate(best.items()):
        length = len(continuation)
        tokens[row, :length] = continuation
        lengths[row] = length
        agree = np.asarray(continuation[:len(truth)]) == truth[:length]
        labels[row] = int(np.argmin(agree)) if not agree.all() else len(agree)
        features[row] = (np.log(m), np.log(rec), src == 1, src == 2, src == 3, np.log(occurrences),
                         freq_at[(m, continuation[0])] / support_at[m], np.log(support_at[m]), np.log(length))
        weights[row] = occurrences
    return StepCandidates(position, tokens, lengths, labels, features, _path_features(tokens, weights, features[:, 0]))


def _path_features(tokens: np.ndarray, weights: np.ndarray, log_match: np.ndarray) -> np.ndarray:
    """[n, k, len(PATH_FEATURES)]: per candidate and depth, the occurrence-weighted share of the
    candidates agreeing before it (all of them; those matched at least as long) that agree at it,
    and how many different tokens those offer there (suffix decoding's children of the node)."""
    n, k = tokens.shape
    same = np.cumprod(tokens[:, None, :] == tokens[None, :, :], axis=2)  # [n, n, k] prefixes agree through i
    path = np.zeros((n, k, len(PATH_FEATURES)))
    for column, counted in enumerate((np.ones((n, n)), log_match[None, :] >= log_match[:, None])):
        through = np.einsum("cdi,cd,d->ci", same, counted, weights)  # weight agreeing through depth i
        before = np.concatenate([(counted * weights).sum(axis=1, keepdims=True), through[:, :-1]], axis=1)
        path[:, :, column] = np.where(before > 0, through / np.maximum(before, 1e-12), 0.0)
    rows = tokens.tolist()
    children: dict[tuple[int, ...], set[int]] = {}
    for row in rows:
        for i, token in enumerate(row):
            if token >= 0:
                children.setdefault(tuple(row[:i]), set()).add(token)
    for c, row in enumerate(rows):
        for i, token in enumerate(row):
            if token >= 0:
                path[c, i, 2] = np.log(len(children[tuple(row[:i])]))
    return path


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
            earlier = np.concatenate([np.append(np.asarray(t, np.int64), _SEPARATOR) for t, _ in earlier_texts])
            earlier_source = np.concatenate([np.full(len(t) + 1, s) for t, s in earlier_texts])
        full = np.asarray(turn.prompt_ids + turn.output_ids, np.int64)
        prompt_len = len(turn.prompt_ids)
        steps = {}
        for position in range(1, len(turn.output_ids)):
            found = step_candidates(position, full[:prompt_len + position], prompt_len, earlier, earlier_source,
                                    turn.output_ids[position:], k, depth, most)
            if found is not None:
                steps[position] = found
        result.append(TurnCandidates(turn, steps))
        earlier_texts += [(turn.prompt_ids, 2), (turn.output_ids, 3)]
    return result


def hazard_rows(step: StepCandidates, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, candidate, depth): one row per candidate and drafted depth i = 1..its length (at most k):
    its features, its path features at i, and the depth (log i, and whether i = 1)."""
    rows, candidate, depth = [], [], []
    for c in range(len(step)):
        for i in range(1, min(int(step.lengths[c]), k) + 1):
            rows.append(np.concatenate([step.features[c], step.path[c, i - 1], (np.log(i), i == 1)]))
            candidate.append(c)
            depth.append(i)
    return np.asarray(rows), np.asarray(candidate), np.asarray(depth)


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


@dataclass(frozen=True)
class LogisticScorer:
    """P(y = 1 | x) = sigmoid(bias + ((x - mean) / scale) . weights)."""

    mean: np.ndarray
    scale: np.ndarray
    weights: np.ndarray
    bias: float

    def probability(self, x: np.ndarray) -> np.ndarray:
        z = self.bias + ((x - self.mean) / self.scale) @ self.weights
        return 1.0 / (1.0 + np.exp(-np.clip(z, -40, 40)))


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
    / cost(1 + d), against 1 / cost(1) for no draft."""
    def choose(step: StepCandidates, k: int) -> tuple[int, int]:
        x, candidate, depth = hazard_rows(step, k)
        hazard = scorer.probability(x)
        best, best_rate = (-1, 0), 1.0 / cost(1)
        expected = 0.0
        for row in range(len(x)):
            survive = hazard[row] if depth[row] == 1 else survive * hazard[row]
            expected = survive if depth[row] == 1 else expected + survive
            rate = (1.0 + expected) / cost(1 + int(depth[row]))
            if rate > best_rate:
                best, best_rate = (int(candidate[row]), int(depth[row])), rate
        return best

    return choose


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
