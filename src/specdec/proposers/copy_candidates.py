"""Every continuation the copy sources offer at a step, the features that say how far each will be
accepted, and the choice among them: the core of scored copying (proposers/scored_copy.py) and of
its offline analysis (analysis/candidates.py, which fits the score on recorded answers).

n-gram lookup (prompt lookup, Saxena 2023; LLMA, Yang et al. 2023, arXiv 2304.04487) and suffix
decoding (Oliaro et al. 2024, arXiv 2411.04975) each find earlier occurrences of the context's tail
and copy what followed one of them by a fixed rule. Replaying recorded answers showed the right
continuation is usually among the occurrences and the rule picks the wrong one or the wrong length
(docs/architecture.md, "Scored copying"). So here every occurrence is a candidate:

A candidate is the continuation of one earlier occurrence of the context's tail: a start position
j in a text (this request's prompt and answer so far; earlier requests' prompts and answers) such
that the tokens before j equal the context's last m >= 1 tokens. Every path either proposer drafts
is one: ngram copies what followed its longest matched n (n <= 3); a suffix tree's path from its
matched suffix's node is a substring of the texts it counts. Occurrences with the same continuation
(its first k tokens) are one candidate, its features taken from its best occurrence (the longest
match, then the most recent).

Features (`FEATURES`), per candidate, and per draft depth (`PATH_FEATURES`):
  match         m, the matched tail's length (capped at `depth`, suffix decoding's max depth)
  source        prompt / answer / earlier prompt / earlier answer, of the best occurrence
  recency       tokens back from the context's end to that occurrence's continuation
  occurrences   how many occurrences share this exact continuation
  frequency     among occurrences matching at least m tokens, the share whose next token is this
                candidate's: suffix decoding's count(child) / count(children) at the matched node
  support       how many occurrences match at least m tokens (the node's count)
  agreement     (per depth) among the candidates that agree with this one before depth i, the
                occurrence-weighted share that also agrees at depth i: the frequency along the path
  agreement among longer matches   the same among candidates matched at least as long as this one
  branching     (per depth) how many different tokens the candidates agreeing before depth i offer

A scorer (`LogisticScorer`) estimates the hazard h_i = P(the depth-i token is accepted | the ones
before it were); a candidate drafted d deep then expects E_d = sum_{i<=d} prod_{l<=i} h_l accepted
tokens, and `choose_draft` takes the candidate and length with the most tokens per unit of
verification cost, (1 + E_d) / cost(1 + d), or no draft at all, 1 / cost(1): the machine's cost
curve decides how far a guess is worth verifying.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

SOURCES = ("prompt", "answer", "earlier prompt", "earlier answer")  # a candidate's source is an index here
FEATURES = ("log match", "log recency", "answer", "earlier prompt", "earlier answer", "log occurrences",
            "frequency", "log support", "log length")
PATH_FEATURES = ("agreement", "agreement among longer matches", "log branching")  # per depth
HAZARD_FEATURES = FEATURES + PATH_FEATURES + ("log depth", "depth 1")  # hazard_rows' columns
SEPARATOR = -1  # between texts of the earlier corpus: no match or continuation crosses it
DEFAULT_DEPTH = 24  # the longest tail matched (suffix decoding's max depth)
DEFAULT_MOST = 64  # distinct continuations kept per step, longest-matched then most recent

CostFn = Callable[[int], float]  # tokens in a verification forward -> its time in 1-token steps


@dataclass
class StepCandidates:
    """The candidates at one step: the context is the prompt and the answer so far."""

    position: int  # in the answer
    tokens: np.ndarray  # [n, k] int64, each candidate's continuation, padded with -1
    lengths: np.ndarray  # [n] tokens offered (1..k)
    labels: np.ndarray | None  # [n] tokens of it the answer accepts (0..lengths); None: the answer is unknown
    features: np.ndarray  # [n, len(FEATURES)] float
    path: np.ndarray  # [n, k, len(PATH_FEATURES)] float, per depth (see the module docstring)

    def __len__(self) -> int:
        return len(self.lengths)


def occurrences(text: np.ndarray, context: np.ndarray, last_start: int, depth: int) -> tuple[np.ndarray, np.ndarray]:
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


def _continuations(text: np.ndarray, starts: np.ndarray, end: int, k: int) -> np.ndarray:
    """[len(starts), k]: text[j:j + k] for each start j, cut at `end` and at the first SEPARATOR,
    padded with SEPARATOR."""
    at = starts[:, None] + np.arange(k)[None, :]  # gathered, not padded: no copy of the text per step
    windows = np.where(at < end, text[np.minimum(at, end - 1)], SEPARATOR)
    return np.where(np.cumsum(windows == SEPARATOR, axis=1) > 0, SEPARATOR, windows)


def step_candidates(position: int, context: np.ndarray, prompt_len: int, earlier: np.ndarray | None,
                    earlier_source: np.ndarray | None, k: int, depth: int = DEFAULT_DEPTH, most: int = DEFAULT_MOST,
                    answer_rest: Sequence[int] | None = None) -> StepCandidates | None:
    """Every candidate after `context` (None: there is none).

    context: [L] the prompt and the answer so far (position = L - prompt_len); earlier: the earlier
    texts joined by SEPARATORs, earlier_source their index in SOURCES per token (2 or 3); answer_rest:
    the answer from here, for the labels (analysis only). most: the longest-matched (then most
    recent) distinct continuations kept; frequency and support count every occurrence."""
    L = len(context)
    found = []  # (starts, match lengths, text, end of continuation, recency of each start, source of each)
    starts, lengths = occurrences(context, context, L - 1, depth)  # a match is followed by a token
    found.append((starts, lengths, context, L, L - starts, np.where(starts < prompt_len, 0, 1)))
    if earlier is not None and len(earlier) > 1:
        e_starts, e_lengths = occurrences(earlier, context, len(earlier) - 1, depth)
        keep = earlier[e_starts] != SEPARATOR  # followed by a token of the same text
        e_starts, e_lengths = e_starts[keep], e_lengths[keep]
        found.append((e_starts, e_lengths, earlier, len(earlier), L + len(earlier) - e_starts,
                      earlier_source[e_starts]))
    all_lengths = np.concatenate([f[1] for f in found])
    if not len(all_lengths):
        return None
    all_next = np.concatenate([f[2][f[0]] for f in found])
    # Occurrences with the same continuation are one candidate: the best occurrence's features.
    recency = np.concatenate([f[4] for f in found])
    source = np.concatenate([f[5] for f in found])
    windows = np.concatenate([_continuations(f[2], f[0], f[3], k) for f in found])  # [N, k], -1 padded
    order = np.lexsort((recency, -all_lengths))  # longest match first, then most recent
    first, shared = _first_of_each_row(windows[order])
    keep = np.argsort(first, kind="stable")[:most]  # the `most` best, in the order above
    best = order[first[keep]]  # each candidate's best occurrence
    tokens = windows[best]  # [n, k], padded with SEPARATOR (-1)
    lengths = (tokens != SEPARATOR).sum(axis=1)
    m, repeats = all_lengths[best], shared[keep]
    # Support and frequency count every occurrence matched at least as long as the candidate's best.
    matched = all_lengths[None, :] >= m[:, None]  # [n, N]
    support = matched.sum(axis=1).astype(np.float64)
    frequency = (matched & (all_next[None, :] == tokens[:, :1])).sum(axis=1) / support
    src = source[best]
    features = np.empty((len(best), len(FEATURES)))
    features[:, 0], features[:, 1] = np.log(m), np.log(recency[best])
    features[:, 2:5] = src[:, None] == np.arange(1, 4)[None, :]
    features[:, 5], features[:, 6], features[:, 7], features[:, 8] = (np.log(repeats), frequency, np.log(support),
                                                                      np.log(lengths))
    labels = None
    if answer_rest is not None:  # the common prefix with the answer (padding never matches a token)
        truth = np.asarray(answer_rest[:k], np.int64)
        labels = np.cumprod(tokens[:, :len(truth)] == truth[None, :], axis=1).sum(axis=1).astype(np.int64)
    return StepCandidates(position, tokens, lengths.astype(np.int64), labels, features,
                          path_features(tokens, repeats.astype(np.float64), features[:, 0]))


def _first_of_each_row(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first, count) of each distinct row of `rows` [N, k]: the index of its first occurrence, and
    how many there are, in no particular order. One sort of the rows as byte strings: numpy's
    np.unique(axis=0) sorts the same way with a fixed cost several times larger (candidates are
    usually few, and this runs at every step)."""
    as_bytes = np.ascontiguousarray(rows).view(np.dtype((np.void, rows.dtype.itemsize * rows.shape[1]))).ravel()
    _, first, count = np.unique(as_bytes, return_index=True, return_counts=True)  # a stable sort: the first
    return first, count


def path_features(tokens: np.ndarray, weights: np.ndarray, log_match: np.ndarray) -> np.ndarray:
    """[n, k, len(PATH_FEATURES)]: per candidate and depth, the occurrence-weighted share of the
    candidates agreeing before it (all of them; those matched at least as long) that agree at it,
    and how many different tokens those offer there (suffix decoding's children of the node).
    Weights are occurrence counts, so every sum is of integers: exact in any order."""
    n, k = tokens.shape
    same = np.logical_and.accumulate(tokens[:, None, :] == tokens[None, :, :], axis=2)  # [c, d, i]: agree through i
    agree = same.transpose(0, 2, 1).astype(np.float64)  # [c, i, d]
    counted = np.stack([np.broadcast_to(weights, (n, n)),  # [column, c, d]: d's weight as counted for c
                        np.where(log_match[None, :] >= log_match[:, None], weights[None, :], 0.0)])
    through = np.einsum("cid,pcd->pci", agree, counted)  # [column, c, i]: weight agreeing through depth i
    before = np.concatenate([counted.sum(axis=2)[:, :, None], through[:, :, :-1]], axis=2)
    path = np.zeros((n, k, len(PATH_FEATURES)))
    path[:, :, :2] = np.where(before > 0, through / np.maximum(before, 1e-12), 0.0).transpose(1, 2, 0)
    # Distinct tokens at depth i among the candidates agreeing with c before i: the candidates d there
    # that are the first (lowest index) to offer their path through i. Whether d is first does not
    # depend on c: a d' agreeing with d through i agrees with c before i too.
    first = (np.argmax(same, axis=1) == np.arange(n)[:, None]) & (tokens >= 0)  # [d, i]
    branching = np.empty((n, k))
    branching[:, 0] = first[:, 0].sum()  # before depth 1 every candidate agrees
    branching[:, 1:] = np.einsum("cid,di->ci", agree[:, :-1], first[:, 1:].astype(np.float64))
    path[:, :, 2] = np.where(tokens >= 0, np.log(np.maximum(branching, 1.0)), 0.0)
    return path


def hazard_rows(step: StepCandidates, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, candidate, depth): one row per candidate and drafted depth i = 1..its length (at most k),
    candidate by candidate, depths ascending: its features, its path features at i, and the depth
    (log i, and whether i = 1)."""
    width = min(k, step.tokens.shape[1])
    valid = np.arange(1, width + 1)[None, :] <= step.lengths[:, None]
    candidate, at = np.nonzero(valid)  # row-major: candidate by candidate, depths ascending
    x = np.empty((len(candidate), len(HAZARD_FEATURES)))
    x[:, :len(FEATURES)] = step.features[candidate]
    x[:, len(FEATURES):-2] = step.path[candidate, at]
    x[:, -2], x[:, -1] = np.log(at + 1), at == 0
    return x, candidate, at + 1


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -40, 40)))


@dataclass(frozen=True)
class LogisticScorer:
    """P(y = 1 | x) = sigmoid(bias + ((x - mean) / scale) . weights), over HAZARD_FEATURES."""

    mean: np.ndarray
    scale: np.ndarray
    weights: np.ndarray
    bias: float

    def logit(self, x: np.ndarray) -> np.ndarray:
        return self.bias + ((x - self.mean) / self.scale) @ self.weights

    def probability(self, x: np.ndarray) -> np.ndarray:
        return sigmoid(self.logit(x))

    def to_json(self, **about) -> str:
        """The scorer as data (what ships in the package, what `specdec replay --fit` writes), with
        `about`: where it was fitted."""
        columns = {name: dict(mean=float(m), scale=float(s), weight=float(w))
                   for name, m, s, w in zip(HAZARD_FEATURES, self.mean, self.scale, self.weights)}
        return json.dumps(dict(kind="logistic hazard", features=columns, bias=self.bias, **about), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "the scorer") -> LogisticScorer:
        try:
            data = json.loads(text)
            columns = data["features"]
            missing = [name for name in HAZARD_FEATURES if name not in columns]
            if data.get("kind") != "logistic hazard" or missing:
                raise ValueError(f"missing features {missing}" if missing else f"kind {data.get('kind')!r}")
            values = np.array([[float(columns[name][key]) for key in ("mean", "scale", "weight")]
                               for name in HAZARD_FEATURES])
            bias = float(data["bias"])
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{source} is not a copy scorer (`specdec replay --fit` writes one): {error}") from error
        if not np.isfinite(values).all() or not np.isfinite(bias) or (values[:, 1] <= 0).any():
            raise ValueError(f"{source} holds a non-finite value or a scale <= 0")
        return cls(values[:, 0], values[:, 1], values[:, 2], bias)

    @classmethod
    def load(cls, path: str | Path) -> LogisticScorer:
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise ValueError(f"cannot read the copy scorer {path}: {error}") from error
        return cls.from_json(text, str(path))


_SHIPPED = "copy_scorer.json"


@functools.cache
def _shipped_text() -> str:
    return resources.files("specdec.data").joinpath(_SHIPPED).read_text()


def shipped_scorer_data() -> dict:
    """The scorer and cost prior that ship with specdec (data/copy_scorer.json; read once)."""
    return json.loads(_shipped_text())


def load_scorer(path: str | Path | None = None) -> LogisticScorer:
    """A scorer written by `specdec replay --fit` (None: the one that ships)."""
    if path is None:
        return LogisticScorer.from_json(_shipped_text(), "the shipped copy scorer")
    return LogisticScorer.load(path)


def survival(step: StepCandidates, hazard: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(valid [n, w], survive [n, w]), w = min(k, the longest offer): whether candidate c offers a
    depth-i token, and the chance its first i tokens are all accepted, prod_{l<=i} h_l (flat past its
    length). hazard: the scorer's probability for each of hazard_rows(step, k)'s rows."""
    n, width = len(step), min(k, step.tokens.shape[1])
    valid = np.arange(1, width + 1)[None, :] <= step.lengths[:, None]
    grid = np.zeros((n, width))
    grid[valid] = hazard
    return valid, np.cumprod(grid, axis=1)


def choose_draft(step: StepCandidates, hazard: np.ndarray, cost: CostFn, k: int) -> tuple[int, int, float]:
    """(candidate, tokens to draft, expected accepted) with the most expected tokens per unit of
    cost, (1 + E_d) / cost(1 + d), against no draft's 1 / cost(1): (-1, 0, 0.0). hazard: the
    scorer's probability for each of hazard_rows(step, k)'s rows. Ties go to the earlier candidate
    (the longer match, the more recent) and the shorter draft."""
    valid, survive = survival(step, hazard, k)
    width = valid.shape[1]
    expected = np.cumsum(survive, axis=1)  # [n, width]: E_d
    costs = np.array([cost(1 + d) for d in range(1, width + 1)])
    rate = np.where(valid, (1.0 + expected) / costs[None, :], -np.inf)
    best = int(np.argmax(rate))  # the first maximum, row-major
    candidate, drafted = divmod(best, width)
    if not rate.flat[best] > 1.0 / cost(1):
        return -1, 0, 0.0
    return candidate, drafted + 1, float(expected[candidate, drafted])


def best_by_length(step: StepCandidates, hazard: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(expected [k + 1], candidate [k + 1]): for each length d = 0..k the most accepted tokens any
    candidate is expected to bring when drafted d deep (a shorter one: its whole length), and which
    candidate (the first of equals; -1 at d = 0). For rows verified in one forward of a common width
    (scored_copy.ScoredCopyRows): a row drafts as deep as the width, its padding computed anyway."""
    valid, survive = survival(step, hazard, k)
    width = valid.shape[1]
    expected = np.cumsum(survive, axis=1)  # [n, width]: E_d, flat past a candidate's length
    best = np.zeros(k + 1)
    candidate = np.full(k + 1, -1)
    candidate[1:width + 1] = np.argmax(expected, axis=0)
    best[1:width + 1] = expected[candidate[1:width + 1], np.arange(width)]
    best[width + 1:], candidate[width + 1:] = best[width], candidate[width]
    return best, candidate


def choose_tree(step: StepCandidates, hazard: np.ndarray, cost: CostFn, k: int,
                max_nodes: int = 64) -> tuple[list[int], list[int], float]:
    """(tokens, parents, expected accepted): a tree of copies, when candidates diverge after a shared
    prefix (issue 60, item 2). Every prefix of a candidate (at most k deep) is a node; its chance of
    being accepted is estimated as the highest survival, prod_{l<=i} h_l, of the candidates through
    it, so a parent never scores below its child. As EAGLE-2 grows its tree (Li et al. 2024, arXiv
    2406.16858), nodes are taken best first (parents before children), and the tree's size N is the
    one maximising (1 + sum of the first N nodes' chances) / cost(1 + N), N = 0 (no draft) included:
    a branch joins only where the machine's cost curve pays for it. parents: -1 = the root."""
    valid, survive = survival(step, hazard, k)
    n, width = valid.shape
    chance: dict[tuple[int, ...], float] = {}
    for c in range(n):
        row = step.tokens[c].tolist()
        for i in range(int(min(step.lengths[c], width))):
            key = tuple(row[:i + 1])
            chance[key] = max(chance.get(key, 0.0), float(survive[c, i]))
    order = sorted(chance, key=lambda key: (-chance[key], len(key)))[:max_nodes]
    gains = np.cumsum([chance[key] for key in order])
    rates = (1.0 + gains) / np.array([cost(2 + i) for i in range(len(order))])
    if not len(order) or not rates.max() > 1.0 / cost(1):
        return [], [], 0.0
    size = int(np.argmax(rates)) + 1
    index = {key: i for i, key in enumerate(order[:size])}
    tokens = [key[-1] for key in order[:size]]
    parents = [index[key[:-1]] if len(key) > 1 else -1 for key in order[:size]]
    return tokens, parents, float(gains[size - 1])
