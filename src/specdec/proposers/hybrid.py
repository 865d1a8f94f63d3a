"""ngram+draft: the n-gram proposer first, the draft model only for the rows it finds no match for.

Copying steps cost nothing to draft; free-text steps still get a model's guesses. Each row's step
is proposed by exactly one of the two, so verification is unchanged: n-gram drafts are point
masses (probs None), draft-model drafts carry their distribution, and rejection_sample is exact
for both. The rows that copied take k = 0 in the draft model's call, so their generators are
untouched, and the draft model only learns of copied steps at its next catch-up (draft_model.py
feeds the committed tokens a row has missed): each row proposes exactly what it would alone, and
nothing here has to keep the two in sync.

Under -k auto the lookup is asked first which match it holds (sources()), and the controller
(engine/adaptive.py) picks each row's source with rates of its own per source: the draft model, or an
n-gram match of length n (a 3-token suffix found again copies far better than one repeated token).
Ask the lookup first and take any match, as a fixed k does, and one-token matches, found almost
everywhere in a long context, keep the draft model from drafting on the text it would guess well.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.proposers.base import DraftProposal, ProposeContext, Proposer, Source
from specdec.proposers.batched import BatchProposer, as_batch, pad_proposals, row_of
from specdec.proposers.draft_model import DraftModelProposer, DraftOptions, draft_model_for
from specdec.proposers.entry import Build, MethodEntry
from specdec.proposers.ngram import NgramOptions, NgramProposer

DRAFT = Source("draft", reads_backlog=True)
# The draft model's window of the prompt under ngram+draft (the draft method's: CONTEXT_WINDOW, 256). Each
# request's draft first reads this much of its prompt, 64 tokens a step, before it can draft: 256 took
# four steps, several target steps' worth of time on the AMX Xeon, a cost the lookup never pays, in a
# request whose long context the lookup copies from anyway (benchmarks/RESULTS.md, "ngram+draft: each
# row's source chosen by -k auto (issue 38, item 5)").
DRAFT_CONTEXT_WINDOW = 64


class NgramThenDraftProposer(BatchProposer):
    """ngram: an n-gram Proposer (one row) or a RowwiseProposer of them (one per row of the draft's);
    draft_max_k caps the draft model's tokens per step (a model's guesses decay faster than copied spans)."""

    def __init__(self, ngram: Proposer | BatchProposer, draft: DraftModelProposer | BatchProposer,
                 draft_max_k: int | None = None) -> None:
        if draft_max_k is not None and (isinstance(draft_max_k, bool) or not isinstance(draft_max_k, int)
                                        or draft_max_k < 1):
            raise ValueError(f"draft_max_k must be an integer >= 1 or None, got {draft_max_k!r}")
        if isinstance(ngram, Proposer) and getattr(draft, "slots", 1) != 1:
            raise ValueError("one n-gram proposer serves one row: give a RowwiseProposer for a batch")
        self.ngram = as_batch(ngram)
        self.draft, self.draft_max_k = draft, draft_max_k
        self._copied: list[bool] = []  # rows whose step the n-gram lookup proposed
        self._assigned: list[bool] | None = None  # -k auto's choice for the next step: rows the lookup drafts
        self._drafted = False  # whether the draft model proposed this step (its on_verified is due)
        self.steps_by_ngram = self.steps_by_draft = 0  # row-steps each proposed
        self.steps_mixed = 0  # steps where some rows copied and others drafted with the model

    def start_row(self, row: int) -> None:
        self.ngram.start_row(row)
        self.draft.start_row(row)

    def set_row_tenant(self, row: int, tenant: str | None) -> None:
        self.ngram.set_row_tenant(row, tenant)

    def sources(self, row: int, token_ids: Sequence[int]) -> tuple[Source, ...] | None:
        lookup = getattr(self.ngram, "rows", [None])[row]
        if not hasattr(lookup, "match_length"):
            return None
        n = lookup.match_length(token_ids)
        return (Source("ngram", n), DRAFT) if n else (DRAFT,)

    def use_sources(self, sources: Sequence[Source]) -> None:
        self._assigned = [source.name == "ngram" for source in sources]

    def unread_tokens(self, row: int, context_len: int) -> int:
        return self.draft.unread_tokens(row, context_len)

    def propose(self, contexts: Sequence[ProposeContext], max_ks: Sequence[int]) -> DraftProposal:
        assigned, self._assigned = self._assigned, None
        if assigned is not None:  # -k auto chose each row's source: the lookup asks only its own rows
            copied = self.ngram.propose(contexts, [max_k if by_ngram else 0 for max_k, by_ngram in zip(max_ks, assigned)])
            self._copied = [by_ngram and max_k > 0 for max_k, by_ngram in zip(max_ks, assigned)]
        else:
            copied = self.ngram.propose(contexts, max_ks)
            self._copied = [bool(n > 0) for n in copied.num_tokens.tolist()]
        draft_ks = [0 if by_ngram else min(max_k, self.draft_max_k or max_k)
                    for by_ngram, max_k in zip(self._copied, max_ks)]
        self.steps_by_ngram += sum(self._copied)
        self.steps_by_draft += sum(k > 0 for k in draft_ks)
        self._drafted = max(draft_ks, default=0) >= 1
        if not self._drafted:
            return copied
        drafted = self.draft.propose(contexts, draft_ks)
        self.steps_mixed += any(self._copied)
        if not any(self._copied):
            return drafted
        device = contexts[0].token_ids.device
        rows = [row_of(copied if by_ngram else drafted, row) for row, by_ngram in enumerate(self._copied)]
        return pad_proposals(rows, contexts[0].vocab_size, device)

    def on_verified(self, num_accepted: torch.Tensor) -> None:
        self.ngram.on_verified(num_accepted)
        if self._drafted:  # a copied row's draft cache keeps its context only: it catches up next time
            accepted = num_accepted.reshape(-1).clone()
            accepted[torch.tensor(self._copied[:len(accepted)], dtype=torch.bool)] = 0
            self.draft.on_verified(accepted)

    def end_row(self, row: int, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        self.ngram.end_row(row, prompt_ids, output_ids)

    def move_row(self, source: int, destination: int) -> None:
        self.ngram.move_row(source, destination)
        self.draft.move_row(source, destination)



def _build(build: Build) -> BatchProposer:
    # The lookup's proposals stay max_k long: -k auto sizes each match length by its own rates.
    options = build.option(NgramOptions)
    lookup = build.per_row(lambda: NgramProposer(options.max, options.min, options.tie_break))
    return NgramThenDraftProposer(lookup, _draft(build), build.draft_k)


def _draft(build: Build) -> BatchProposer:
    """The draft model beside the lookup; beside a copying source it reads a shorter window of the
    prompt (DRAFT_CONTEXT_WINDOW says why). One with another tokenizer drafts for one request at a time."""
    confidence = build.draft_confidence if build.adaptive else None
    if build.draft_bridge is None:
        return draft_model_for(build, confidence, DRAFT_CONTEXT_WINDOW)
    from specdec.proposers.cross_vocabulary import CrossVocabularyDraftProposer

    if build.slots != 1:
        raise ValueError("a draft with another tokenizer drafts for one request at a time (generate, bench, "
                         "verify, specdec.load), not for a server's batch")
    return as_batch(CrossVocabularyDraftProposer(build.draft_runner, build.draft_bridge,
                                                 context_window=DRAFT_CONTEXT_WINDOW,
                                                 stop_rule=build.option(DraftOptions).rule(confidence)))


METHOD_ENTRIES = (
    MethodEntry("ngram+draft", "n-gram lookup first, the draft model when the lookup finds no match", _build,
                needs_draft_model=True, options=(NgramOptions, DraftOptions), replayable=True),
)
