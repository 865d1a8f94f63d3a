"""N-gram drafting: prompt lookup decoding (Saxena 2023) and LLMA (Yang et al. 2023,
"Inference with Reference", arXiv 2304.04487), with no draft model at all.

Text that copies its input (code edits, summaries, retrieval answers, multi-turn
chat) repeats spans of the context. Find the last n tokens earlier in the
context and propose what followed them. The draft is a point mass
(DraftProposal.probs = None): under sampling each drafted token is accepted
with probability target_prob[token] and the residual excludes it
(rejection_sample), so the output distribution stays exactly the target's.

Three parts, each usable alone:
  find_match      the pure rule, a rescan of the whole context (the reference)
  NgramIndex      the same rule in O(1) per lookup: a hash map from n-gram to
                  the positions that follow it, extended as tokens are committed
  NgramProposer   the Proposer: keeps the index in step with committed tokens
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from specdec.option_fields import flagged, positive_int

from specdec.proposers.base import DraftProposal, ProposeContext, Proposer, committed_since
from specdec.proposers.entry import Build, MethodEntry

TIE_BREAKS = ("recent", "random")


@dataclass(frozen=True)
class NgramOptions:
    """Prompt lookup (--method ngram, ngram+draft): the longest suffix tried first, the shortest that
    still counts, and which of equally long continuations to copy. Each field is its own flag."""

    GROUP: ClassVar[str] = "ngram"
    TITLE: ClassVar[str] = "n-gram lookup"
    max: int = flagged(3, "longest suffix to look up; tried first (default: 3)", parse=positive_int)
    min: int = flagged(1, "shortest suffix that still counts as a match (default: 1)", parse=positive_int)
    tie_break: str = flagged("recent", "among equally long continuations: the most recent match, or one drawn "
                             "with the request's seed (default: recent)", parse=str, choices=TIE_BREAKS)

    def __post_init__(self) -> None:
        check_ngram_args(self.max, self.min, self.tie_break)


@dataclass(frozen=True)
class NgramMatch:
    n: int  # length of the matched suffix
    start: int  # position of the first proposed token in the context
    token_ids: list[int]  # the proposed continuation, 1..max_k tokens


def check_ngram_args(ngram_max: int, ngram_min: int, tie_break: str = "recent") -> None:
    for name, value in (("ngram_max", ngram_max), ("ngram_min", ngram_min)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if ngram_min > ngram_max:
        raise ValueError(f"ngram_min ({ngram_min}) must not exceed ngram_max ({ngram_max})")
    if tie_break not in TIE_BREAKS:
        raise ValueError(f"tie_break must be one of {', '.join(TIE_BREAKS)}, got {tie_break!r}")


def _pick(positions: list[int], count: int, context_len: int, max_k: int, tie_break: str,
          generator: torch.Generator | None) -> int:
    """Among continuation starts positions[:count] (ascending, all < context_len), the one
    offering the most tokens.

    A start p offers min(max_k, context_len - p) tokens, so every p <= context_len - max_k
    offers the full max_k (ties: the most recent, or one at random); when none does, the
    earliest offers the most and is unique.
    """
    full = bisect.bisect_right(positions, context_len - max_k, 0, count)  # positions[:full] offer max_k
    if full == 0:
        return positions[0]
    if tie_break == "recent":
        return positions[full - 1]
    device = generator.device if generator is not None else "cpu"  # a CUDA request's generator lives on CUDA
    return positions[int(torch.randint(full, (1,), generator=generator, device=device))]


def find_match(
    token_ids: Sequence[int] | np.ndarray,
    *,
    max_k: int,
    ngram_max: int = 3,
    ngram_min: int = 1,
    tie_break: str = "recent",
    generator: torch.Generator | None = None,
) -> NgramMatch | None:
    """Propose up to max_k tokens by finding the context's last n tokens earlier in it.

    Rules:
      1. the longest n first, from ngram_max down to ngram_min; the first n that
         matches anywhere decides (a shorter n is never tried once a longer one matched);
      2. among the matches of that n, the continuation that offers the most
         tokens (up to max_k); ties go to the most recent match, or to one drawn
         with the request's generator when tie_break="random";
      3. the suffix never matches itself at the end of the context (a match must
         be followed by at least one token).

    Worked example (tokens spelled as letters), ngram_max=3, ngram_min=1, max_k=2:

        position  0 1 2 3 4 5 6 7 8 9
        context   a b c d x b c e b c
                                 ^^^^^ suffix
        n=3 "e b c": not found earlier.
        n=2 "b c": found at 1-2 (followed by "d x") and 5-6 (followed by "e b").
        Both offer 2 tokens; the most recent wins: proposal "e b" (start=7).
        With max_k=4, the first offers "d x b c" (4) and the second "e b c" (3):
        proposal "d x b c" (start=3).

    This rescans the whole context (O(L) per call); NgramIndex.lookup gives the
    same answer in O(1) and is what the proposer uses. Returns None for no match.
    """
    check_ngram_args(ngram_max, ngram_min, tie_break)
    if max_k < 1:
        return None
    tokens = np.asarray(token_ids, dtype=np.int64)
    context_len = len(tokens)
    for n in range(min(ngram_max, context_len - 1), ngram_min - 1, -1):
        suffix = tokens[context_len - n:]
        # Windows of tokens[:L-1] start at 0..L-1-n, so each is followed by a token
        # and the suffix itself (start L-n) is excluded.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: context_len - 1], n)  # [L-n, n]
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if len(starts):
            positions = (starts + n).tolist()  # where each continuation begins, ascending
            start = _pick(positions, len(positions), context_len, max_k, tie_break, generator)
            return NgramMatch(n, start, tokens[start : start + max_k].tolist())
    return None


class NgramIndex:
    """find_match in O(1) per lookup, for a context that only ever grows.

    For every n in [ngram_min, ngram_max] a dict maps each n-gram to the
    ascending list of positions that follow its occurrences. Appending a token
    adds one position per n (O(ngram_max)); a lookup is one dict access per n
    plus a binary search over that n-gram's occurrences, never a scan of the
    context. The caller feeds only committed tokens, so there is nothing to
    roll back when drafts are rejected.
    """

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1) -> None:
        check_ngram_args(ngram_max, ngram_min)
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.tokens: list[int] = []
        self._follows: dict[int, dict[tuple[int, ...], list[int]]] = {
            n: {} for n in range(ngram_min, ngram_max + 1)
        }

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, token_ids: Sequence[int]) -> None:
        tokens = self.tokens
        for token in token_ids:
            tokens.append(int(token))
            end = len(tokens)
            # Register every n-gram that ends here. Its "next position" is `end`,
            # which holds no token yet: that is the self-match lookup() skips.
            for n, follows in self._follows.items():
                if end >= n:
                    follows.setdefault(tuple(tokens[end - n:]), []).append(end)

    def lookup(self, max_k: int, tie_break: str = "recent",
               generator: torch.Generator | None = None) -> NgramMatch | None:
        """The same answer as find_match(self.tokens, ...) with this index's n range."""
        found = self._longest() if max_k >= 1 else None
        if found is None:
            return None
        n, positions = found
        tokens, context_len = self.tokens, len(self.tokens)
        # The last entry is the suffix's own (== context_len): search the ones before it.
        start = _pick(positions, len(positions) - 1, context_len, max_k, tie_break, generator)
        return NgramMatch(n, start, tokens[start : start + max_k])

    def match_length(self) -> int:
        """n of the match lookup() would find now (0: none), without drawing any random number."""
        found = self._longest()
        return 0 if found is None else found[0]

    def _longest(self) -> tuple[int, list[int]] | None:
        """The longest n whose suffix occurred earlier, with the positions following its occurrences."""
        tokens = self.tokens
        context_len = len(tokens)
        for n in range(min(self.ngram_max, context_len - 1), self.ngram_min - 1, -1):
            positions = self._follows[n].get(tuple(tokens[context_len - n:]))
            if positions is not None and len(positions) >= 2:  # not only the suffix itself
                return n, positions
        return None


class NgramProposer(Proposer):
    """Prompt lookup / LLMA as a Proposer: point-mass drafts from an NgramIndex.

    >>> proposer = NgramProposer(ngram_max=3, ngram_min=1)
    >>> engine = SpecEngine(target_runner, proposer, tokenizer, k=8)

    With no match the proposal is empty and the engine's step is a plain decode
    step: one target forward over one token, nothing else.

    follow_match (`--k auto`): the proposal length follows the matched suffix's
    length n, ceil(max_k * n / ngram_max) tokens: a 3-token suffix found again is
    strong evidence of copying, a single repeated token (", ", "the") is weak, and
    every proposed token costs a verified position. Lossless either way: only how
    many tokens are proposed changes.
    """

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1, tie_break: str = "recent",
                 follow_match: bool = False) -> None:
        check_ngram_args(ngram_max, ngram_min, tie_break)
        self.ngram_max, self.ngram_min, self.tie_break = ngram_max, ngram_min, tie_break
        self.follow_match = follow_match
        self.index = NgramIndex(ngram_max, ngram_min)

    def reset(self) -> None:
        self.index = NgramIndex(self.ngram_max, self.ngram_min)

    def propose(self, ctx: ProposeContext, max_k: int) -> DraftProposal:
        device = ctx.token_ids.device
        self._catch_up(ctx.token_ids)
        match = self.index.lookup(max_k, self.tie_break, ctx.generator)
        if match is None:
            return DraftProposal.empty(1, device)
        token_ids = match.token_ids
        if self.follow_match:
            token_ids = token_ids[: -(-max_k * match.n // self.ngram_max)]  # ceil(max_k * n / ngram_max)
        return DraftProposal(
            token_ids=torch.tensor([token_ids], dtype=torch.int64, device=device),  # [1, k]
            num_tokens=torch.tensor([len(token_ids)], dtype=torch.int64, device=device),  # [1]
            probs=None,  # point mass
        )

    def match_length(self, token_ids: Sequence[int]) -> int:
        """n of the match the next propose() would copy from, given the committed tokens (0: none):
        ngram+draft's choice of source under -k auto (hybrid.py)."""
        seen = self.index.tokens
        if len(seen) > len(token_ids) or (seen and token_ids[len(seen) - 1] != seen[-1]):  # another request
            self.reset()
        self.index.extend(token_ids[len(self.index.tokens):])
        return self.index.match_length()

    def on_verified(self, num_accepted: torch.Tensor) -> None:
        pass  # the index holds committed tokens only; accepted ones arrive with the next context

    def _catch_up(self, token_ids: torch.Tensor) -> None:
        """Index the committed tokens [1, L] not seen yet."""
        new = committed_since(self.index.tokens, token_ids)
        if new is None:  # another request
            self.reset()
            new = token_ids[0].tolist()
        self.index.extend(new)


def _build(build: Build) -> Proposer:
    options = build.option(NgramOptions)
    return build.per_row(lambda: NgramProposer(options.max, options.min, options.tie_break,
                                               follow_match=build.adaptive))


METHOD_ENTRIES = (
    MethodEntry("ngram", "prompt lookup / LLMA: copy what followed the last n tokens earlier in the context; "
                "no draft model", _build, options=(NgramOptions,), replayable=True, beside_any=True),
)
