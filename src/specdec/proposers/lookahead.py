"""Lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding", arXiv 2402.02057): the target drafts for itself, with no draft model, by
Jacobi iteration in the same forward that verifies.

Each step's target forward carries, next to the root (the last committed token):
  verification branch  up to G n-grams from the pool that start with the root token, merged
                       into a tree (shared prefixes once), verified exactly as point masses
                       (sampling/tree.py): greedy output is plain greedy output, sampled output
                       follows the target's distribution;
  lookahead branch     a window of W columns and N-1 levels of guessed tokens. Level 0 is a run
                       of W guesses at offsets 1..W after the root; the token of level l in
                       column i sits at offset 1 + i + l and sees the root, level 0's columns
                       0..i and levels 1..l of its own column: one contiguous guessed text.
                       The target's greedy next token after the top level of each column is a
                       new guess one position further (a Jacobi update of that column).
When the window holds N-1 levels, each column with its new guess is an N-gram the target
itself produced; it goes into the pool under its first token, the oldest level is dropped and
the new guesses become the top level. The two branches never see each other (the paper's
mask), so the verified logits are those of a plain step.

The lookahead tokens ride along as DraftProposal.lookaheads; the engine appends them after the
drafts, hands their logits to read_lookahead() and never keeps their cache entries. A wide
window pays where a forward over ~30 tokens costs about one over 1 (GPUs); on a CPU each token
costs, so the defaults are small (W=4, N=3, G=3: 8 + at most 6 tokens per step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from specdec.option_fields import flagged, positive_int

from specdec.proposers.base import DraftProposal, LookaheadInputs, ProposeContext, Proposer, chain_or_tree
from specdec.proposers.entry import Build, MethodEntry

DEFAULT_WINDOW = 4
DEFAULT_NGRAM = 3
DEFAULT_GUESSES = 3
POOL_PER_TOKEN = 16  # n-grams kept per first token, most recent first


@dataclass(frozen=True)
class LookaheadOptions:
    """--method lookahead's knobs; each field is its own flag."""

    GROUP: ClassVar[str] = "lookahead"
    TITLE: ClassVar[str] = "lookahead decoding"
    window: int = flagged(DEFAULT_WINDOW, "columns of the Jacobi window the target guesses ahead on "
                          f"(default: {DEFAULT_WINDOW})", parse=positive_int, metavar="W")
    ngram: int = flagged(DEFAULT_NGRAM, "length of the n-grams collected from the window, >= 2; N-1 levels of W "
                         f"guesses ride along each step (default: {DEFAULT_NGRAM})", parse=positive_int, metavar="N")
    guesses: int = flagged(DEFAULT_GUESSES, "pool n-grams verified per step, as a tree (default: "
                           f"{DEFAULT_GUESSES}). Every token costs: (N-1) x W + up to G x (N-1) tokens join each "
                           "target forward", parse=positive_int, metavar="G")

    def __post_init__(self) -> None:
        for name, low in (("window", 1), ("ngram", 2), ("guesses", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"lookahead {name} must be an integer >= {low}, got {value!r}")


def lookahead_mask(window: int, levels: int) -> tuple[list[int], torch.Tensor]:
    """(offsets from the root, [n, n] bool mask among the window's tokens), tokens in level-major
    order (level 0's W tokens first). Token (l, i) sees (0, j) for j <= i and (m, i) for 1 <= m <= l.

    Worked example, W = 3, 2 levels: tokens a0 a1 a2 (level 0), b0 b1 b2 (level 1):
        offsets  a0 1, a1 2, a2 3, b0 2, b1 3, b2 4
        b1 sees a0 a1 b1 (the text a0 a1 b1 at offsets 1 2 3); b2 sees a0 a1 a2 b2.
    """
    count = window * levels
    mask = torch.zeros(count, count, dtype=torch.bool)
    offsets = []
    for level in range(levels):
        for column in range(window):
            row = level * window + column
            offsets.append(1 + column + level)
            mask[row, :column + 1] = True  # level 0, columns 0..i
            for upper in range(1, level + 1):
                mask[row, upper * window + column] = True
    return offsets, mask


def merge_ngrams(ngrams: list[tuple[int, ...]]) -> tuple[list[int], list[int]]:
    """Candidate continuations -> a tree (tokens, parents; -1 = the root), shared prefixes once,
    siblings in the candidates' order."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for ngram in ngrams:
        parent = -1
        for token in ngram:
            node = children.get((parent, token))
            if node is None:
                node = children[(parent, token)] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = node
    return tokens, parents


class LookaheadProposer(Proposer):
    """Lookahead decoding as a Proposer (native backend: it needs the tree mask).

    >>> engine = SpecEngine(target_runner, LookaheadProposer(), tokenizer, k=4)
    """

    def __init__(self, options: LookaheadOptions | None = None) -> None:
        self.options = options or LookaheadOptions()
        self.reset()

    @property
    def extra_verify_tokens(self) -> int:
        """The most lookahead tokens a proposal adds to the verify forward (a full window)."""
        return self.options.window * (self.options.ngram - 1)

    def reset(self) -> None:
        self.pool: dict[int, list[tuple[int, ...]]] = {}
        self.levels: list[list[int]] = []  # levels[l][i]; [] until the first proposal
        self._offered_levels = 0  # how many levels the last proposal carried (0: none)

    def propose(self, ctx: ProposeContext, max_k: int) -> DraftProposal:
        device = ctx.token_ids.device
        if not self.levels:
            self.levels = [self._initial_guesses(ctx.token_ids[0])]
        root = int(ctx.token_ids[0, -1])
        candidates = list(dict.fromkeys(ngram[:max_k] for ngram in self.pool.get(root, ())))
        tokens, parents = merge_ngrams(candidates[: self.options.guesses])
        offsets, mask = lookahead_mask(self.options.window, len(self.levels))
        self._offered_levels = len(self.levels)
        lookahead = LookaheadInputs(
            token_ids=torch.tensor([[t for level in self.levels for t in level]], dtype=torch.int64, device=device),
            offsets=torch.tensor(offsets, device=device), mask=mask.to(device))
        return DraftProposal.of_row(tokens, chain_or_tree(parents), device, lookahead=lookahead)  # point masses

    def read_lookahead(self, logits: torch.Tensor) -> None:
        """The target's logits [n, V] at the lookahead tokens of the last proposal: the Jacobi update."""
        window = self.options.window
        top = self._offered_levels - 1
        guesses = logits[top * window:(top + 1) * window].argmax(dim=-1).tolist()  # one per column
        if self._offered_levels == self.options.ngram - 1:  # a full window: collect, then slide
            for column in range(window):
                ngram = tuple(level[column] for level in self.levels) + (guesses[column],)
                known = self.pool.setdefault(ngram[0], [])
                if ngram[1:] in known:
                    known.remove(ngram[1:])
                known.insert(0, ngram[1:])
                del known[POOL_PER_TOKEN:]
            self.levels = self.levels[1:]
        self.levels.append(guesses)

    def on_verified(self, num_accepted: torch.Tensor) -> None:
        pass  # the pool keeps what the target produced, accepted or not

    def _initial_guesses(self, context: torch.Tensor) -> list[int]:
        """Level 0 of a new request: W tokens spread over the context (the paper draws them from
        the prompt at random; spread evenly here, so runs are reproducible)."""
        length = context.shape[0]
        picks = torch.linspace(0, length - 1, self.options.window).round().long()
        return context[picks].tolist()


def _build(build: Build) -> Proposer:
    options = build.option(LookaheadOptions)
    return build.per_row(lambda: LookaheadProposer(options))


METHOD_ENTRIES = (
    # It runs alone: its window's tokens join every drafting row's forward and are priced into each.
    MethodEntry("lookahead", "lookahead decoding: the target itself guesses n-grams by Jacobi iteration over a "
                "window of guesses, in the same forward that verifies earlier ones; no draft model (native "
                "backend)", _build, options=(LookaheadOptions,), runs_alone=True),
)
