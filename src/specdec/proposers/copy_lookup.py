"""Scored copying as the lookup of ngram+draft's machinery (hybrid.py): copy+draft.

`--method copy` chooses a candidate and its length by the fitted score alone. Beside a draft model the
choice between the two sources, and how deep to draft from either, is what -k auto's controller
(engine/adaptive.py) already makes for ngram+draft from measured rates: acceptance per (source,
detail) and draft position, each source's measured time. Here scored copying takes the n-gram
lookup's place in it. It offers, per step, the candidate its score ranks first (copy_candidates.
choose_draft under this machine's costs) and, as the source's detail, how many of that candidate's
tokens the score expects accepted, rounded (1 + round(E), at most MAX_DETAIL): the controller keeps
rates for each class, so a confident copy and a weak one are told apart by what they measured to
bring, not by what the score says, and the score needs no calibration of its own. It drafts that
candidate as deep as the controller asks. Where the score finds no copy worth a forward, it offers
none (detail 0) and the draft model alone is on offer.

Drafts are point masses (probs None), verified by the engine's exact rule like the n-gram lookup's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.proposers.base import DraftProposal, ProposeContext
from specdec.proposers.copy_candidates import choose_draft
from specdec.proposers.scored_copy import ScoredCopyProposer
from specdec.sampling.params import SamplingParams

MAX_DETAIL = 6  # classes of expected accepted tokens: 0-0.5, 0.5-1.5, ..., 4.5 and more
LOOKUP_K = 8  # how deep the score looks for a candidate's expected tokens
_GREEDY = SamplingParams(temperature=0.0)


class CopyLookup(ScoredCopyProposer):
    """One row's scored copying, offering its best candidate to -k auto's controller (hybrid.py)."""

    sizes_own_drafts = False  # the controller sizes the draft

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, calibrate=False, **kwargs)  # the controller's rates per class calibrate it
        self._offer: tuple[int, list[int]] | None = None  # (context length, the candidate's tokens)

    def match_length(self, token_ids: Sequence[int]) -> int:
        """The class of this step's best candidate (0: no copy worth drafting): hybrid.sources()."""
        ctx = ProposeContext(torch.tensor([list(token_ids)]), _GREEDY, None, 0)
        tokens, expected = self._best(ctx)
        self._offer = (len(token_ids), tokens)
        return 0 if not tokens else 1 + min(int(expected + 0.5), MAX_DETAIL - 1)

    def propose(self, ctx: ProposeContext, max_k: int) -> DraftProposal:
        if max_k < 1:
            return DraftProposal.empty(1, ctx.token_ids.device)
        offer = self._offer
        tokens = offer[1] if offer is not None and offer[0] == ctx.token_ids.shape[1] else self._best(ctx)[0]
        self._offer = None
        return DraftProposal.of_row(tokens[:max_k], None, ctx.token_ids.device)

    def _best(self, ctx: ProposeContext) -> tuple[list[int], float]:
        """The best-ranked candidate's tokens (up to LOOKUP_K) and the tokens of it the score expects
        accepted; ([], 0.0) where no copy is worth a forward."""
        scored = self._scored(ctx, LOOKUP_K)
        if scored.step is None:
            return [], 0.0
        candidate, drafted, _ = choose_draft(scored.step, scored.hazard, scored.cost, LOOKUP_K)
        if not drafted:
            return [], 0.0
        length = int(scored.step.lengths[candidate])
        survive = scored.hazard[scored.candidate_of_row == candidate][:length].cumprod()
        return scored.step.tokens[candidate, :length].tolist(), float(survive.sum())
