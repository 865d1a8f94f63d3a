"""ngram+draft: the n-gram proposer first, the draft model only when it finds no match.

Copying steps cost nothing to draft; free-text steps still get a model's
guesses. Each step is proposed by exactly one of the two, so verification is
unchanged: n-gram drafts are point masses (probs None), draft-model drafts
carry their distribution, and rejection_sample is exact for both.

The draft model does not see the steps the n-gram proposer handled; its next
propose() feeds the committed tokens it has missed in one catch-up forward
(DraftModelProposer step 1), so nothing here has to keep the two in sync.
"""

from __future__ import annotations

import torch

from specdec.proposers.base import DraftProposal, ProposeContext, Proposer


class NgramThenDraftProposer(Proposer):
    def __init__(self, ngram: Proposer, draft: Proposer, draft_max_k: int | None = None) -> None:
        if draft_max_k is not None and (isinstance(draft_max_k, bool) or not isinstance(draft_max_k, int)
                                        or draft_max_k < 1):
            raise ValueError(f"draft_max_k must be an integer >= 1 or None, got {draft_max_k!r}")
        self.ngram, self.draft = ngram, draft
        self.draft_max_k = draft_max_k  # a model's guesses decay faster than copied spans
        self._last: Proposer | None = None  # who proposed the step being verified
        self.steps_by_ngram = 0
        self.steps_by_draft = 0

    def reset(self) -> None:
        self.ngram.reset()
        self.draft.reset()
        self._last = None
        self.steps_by_ngram = self.steps_by_draft = 0

    def propose(self, ctx: ProposeContext, max_k: int) -> DraftProposal:
        proposal = self.ngram.propose(ctx, max_k)
        if int(proposal.num_tokens[0]) > 0:
            self._last = self.ngram
            self.steps_by_ngram += 1
            return proposal
        self._last = self.draft
        self.steps_by_draft += 1
        return self.draft.propose(ctx, min(max_k, self.draft_max_k or max_k))

    def on_verified(self, num_accepted: torch.Tensor) -> None:
        if self._last is not None:
            self._last.on_verified(num_accepted)
