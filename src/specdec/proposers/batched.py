"""Proposers for a batch of running requests, one cache row per request (the server's engine).

Row b of every tensor belongs to the request running in row b of the target's
cache (engine/batch.py keeps the running rows packed at 0..B-1). Each row has
its own context, sampling params, generator and cap on drafts this step; the
proposal is padded to the longest row with -1 and num_tokens says how many
are real, so verification is ragged exactly as vLLM's is.

Two implementations:
  RowwiseProposer          any single-sequence Proposer, one instance per row
                           (n-gram lookup: its index is per request anyway)
  BatchedDraftModelProposer one draft model, one forward per drafted position
                           for every row at once
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specdec.models.native.runner import NativeRunner
from specdec.proposers.base import DraftProposal, ProposeContext, Proposer
from specdec.proposers.draft_model import CATCH_UP_CHUNK, CONTEXT_WINDOW, match_vocab
from specdec.sampling.warp import sample_from_probs, warp_logits


class BatchProposer:
    """Proposes for B running requests at once, row b for the request in the target's cache row b.

    Every hook the batched engine calls is declared here with a default that does nothing; an
    implementation overrides what it uses (see Proposer for the single-request interface)."""

    reads_target_hidden: bool = False  # as Proposer's
    target_layers: tuple[int, ...] = ()  # as Proposer's
    extra_verify_tokens: int = 0  # as Proposer's

    def start_row(self, row: int) -> None:
        """A new request now runs in row."""

    def propose(self, contexts: Sequence[ProposeContext], max_ks: Sequence[int]) -> DraftProposal:  # [B, k]
        raise NotImplementedError

    def on_verified(self, num_accepted: torch.Tensor) -> None:
        """[B] drafts accepted in rows 0..B-1."""

    def read_lookahead(self, row: int, logits: torch.Tensor) -> None:
        """The target's logits [m, V] at the lookahead tokens row's last proposal carried."""

    def end_row(self, row: int, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """The request in row finished (suffix decoding's shared cache learns its output)."""

    def move_row(self, source: int, destination: int) -> None:
        """Packing after a request left: source's state now belongs to destination."""


def pad_proposals(proposals: Sequence[DraftProposal], vocab_size: int, device: torch.device) -> DraftProposal:
    """Stack one-row proposals [1, k_b] into [B, max k_b], -1 padded.

    Rows without a distribution are point masses; when some other row has one,
    they get the one-hot q that None stands for (the same acceptance and residual).
    A row's tree (its parents) goes to row_parents; the engine verifies each row's own shape.
    A row's lookahead tokens go to row_lookahead; the engine appends them to that row's inputs.
    """
    if len(proposals) == 1:  # one row (SpecEngine): its own tensors, already [1, k]
        only = proposals[0]
        return DraftProposal(only.token_ids.to(device), only.num_tokens.to(device), only.probs,
                             row_parents=None if only.parents is None else (only.parents,),
                             row_lookahead=None if only.lookahead is None else (only.lookahead,))
    width = max((p.token_ids.shape[1] for p in proposals), default=0)
    batch = len(proposals)
    token_ids = torch.full((batch, width), -1, dtype=torch.int64, device=device)
    num_tokens = torch.zeros(batch, dtype=torch.int64, device=device)
    with_probs = any(p.probs is not None for p in proposals)
    probs = torch.zeros(batch, width, vocab_size, device=device) if with_probs else None
    for row, proposal in enumerate(proposals):
        k = proposal.token_ids.shape[1]
        token_ids[row, :k] = proposal.token_ids[0].to(device)
        num_tokens[row] = int(proposal.num_tokens[0])
        if probs is not None and k:
            probs[row, :k] = (proposal.probs[0].to(device) if proposal.probs is not None else
                              torch.nn.functional.one_hot(proposal.token_ids[0].clamp_min(0), vocab_size).float())
    trees = tuple(p.parents for p in proposals)
    lookaheads = tuple(p.lookahead for p in proposals)
    return DraftProposal(token_ids, num_tokens, probs,
                         row_parents=trees if any(parents is not None for parents in trees) else None,
                         row_lookahead=lookaheads if any(extra is not None for extra in lookaheads) else None)


class RowwiseProposer(BatchProposer):
    """One single-sequence proposer per row; propose() asks each row's in turn.

    A head proposer (EAGLE, EAGLE-3, Medusa) keeps its own small KV cache per row and shares
    the head's weights; like the single-sequence engine, the batched engine then hands each
    row the target's features of its newly committed tokens (ProposeContext.target_hidden)."""

    def __init__(self, make_proposer: Callable[[], Proposer], slots: int) -> None:
        self.rows: list[Proposer] = [make_proposer() for _ in range(slots)]
        self._proposed = [False] * slots  # whose proposal is being verified
        first = self.rows[0]
        self.reads_target_hidden = first.reads_target_hidden
        self.target_layers = tuple(first.target_layers)
        self.extra_verify_tokens = first.extra_verify_tokens

    def start_row(self, row: int) -> None:
        self.rows[row].reset()

    def propose(self, contexts: Sequence[ProposeContext], max_ks: Sequence[int]) -> DraftProposal:
        device = contexts[0].token_ids.device
        proposals = []
        for row, (ctx, max_k) in enumerate(zip(contexts, max_ks)):
            self._proposed[row] = max_k >= 1
            proposals.append(self.rows[row].propose(ctx, max_k) if max_k >= 1 else DraftProposal.empty(1, device))
        return pad_proposals(proposals, contexts[0].vocab_size, device)

    def on_verified(self, num_accepted: torch.Tensor) -> None:
        for row, accepted in enumerate(num_accepted.reshape(-1, 1)):
            if self._proposed[row]:
                self.rows[row].on_verified(accepted)

    def read_lookahead(self, row: int, logits: torch.Tensor) -> None:
        """The target's logits [m, V] at the lookahead tokens row's last proposal carried."""
        self.rows[row].read_lookahead(logits)

    def end_row(self, row: int, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """The request in row finished (suffix decoding's shared cache learns its output)."""
        self.rows[row].end_request(prompt_ids, output_ids)

    def move_row(self, source: int, destination: int) -> None:
        self.rows[source], self.rows[destination] = self.rows[destination], self.rows[source]
        self._proposed[destination] = self._proposed[source]


class BatchedDraftModelProposer(BatchProposer):
    """DraftModelProposer (Chen et al. 2023, Algorithm 2) for B rows in lockstep.

    Each row's draft cache holds its committed tokens except those the target
    closed the last step with; propose() first feeds those (1 or 2 per row) in
    one right-padded forward, reads each row's logits at its own last real token
    and cuts the padding off again. A row further behind (a new request, or one
    that ran while speculation was paused) is first brought to one token behind
    by a forward of its own, so nobody pays for its padding: the draft prefills
    a prompt only when it is first asked to draft for it. Then
    k single-token forwards over all rows draft k tokens; row b samples only its
    first max_ks[b] of them, from its own warp and generator, so it draws exactly
    the random numbers the single-sequence proposer would. Like it, a row reads
    only the prompt's last CONTEXT_WINDOW tokens, and reads a long prompt
    CATCH_UP_CHUNK tokens per step without drafting: each request's steps, and so
    its random draws, are those it would have alone.
    """

    def __init__(self, runner: NativeRunner, catch_up_chunk: int = CATCH_UP_CHUNK,
                 context_window: int | None = CONTEXT_WINDOW) -> None:
        self.runner = runner
        self.catch_up_chunk, self.context_window = catch_up_chunk, context_window
        slots = runner.batch_size
        self._proposal_start = [0] * slots  # context length when the last proposal was made
        self._fed_drafts = [0] * slots  # drafts of that proposal that sit in the cache
        self._skipped = [0] * slots  # leading context tokens the row's draft never reads

    def start_row(self, row: int) -> None:
        """Empty the row; the first propose() prefills it (never, if this request is never drafted for)."""
        self.runner.truncate([0], rows=slice(row, row + 1))
        self._proposal_start[row] = self._fed_drafts[row] = self._skipped[row] = 0

    def propose(self, contexts: Sequence[ProposeContext], max_ks: Sequence[int]) -> DraftProposal:
        device, batch = self.runner.device, len(contexts)
        rows = slice(0, batch)
        lengths = [ctx.token_ids.shape[1] for ctx in contexts]
        room = min(self.runner.max_context - length for length in lengths)  # every row writes k positions
        max_ks = [max(0, min(max_k, room)) for max_k in max_ks]
        if self.context_window is not None:  # a row's first proposal (empty cache): where its window starts
            for row, (length, cached) in enumerate(zip(lengths, self.runner.row_lengths(rows))):
                if max_ks[row] and cached == 0:
                    self._skipped[row] = max(0, length - self.context_window)
        # A row far behind reads one chunk alone and drafts nothing this step.
        seen = [n + skip for n, skip in zip(self.runner.row_lengths(rows), self._skipped)]
        for row, ctx in enumerate(contexts):
            if max_ks[row] and lengths[row] - seen[row] > self.catch_up_chunk:
                chunk = ctx.token_ids[:, seen[row]:seen[row] + self.catch_up_chunk].to(device)
                self.runner.forward(chunk, torch.arange(seen[row], seen[row] + self.catch_up_chunk,
                                                        device=device)[None],
                                    rows=slice(row, row + 1), last_n_logits=1)
                max_ks[row] = 0
        k = max(max_ks, default=0)
        if k < 1:
            return DraftProposal.empty(batch, device)

        # 1. Catch up: each row feeds the committed tokens it has not seen, padded on the right.
        #    A row drafting nothing this step and far behind (its first step, or reading a long
        #    prompt in chunks) is idle: it gets one padding token, cut off again, and keeps its cache.
        skipped = self._skipped[:batch]
        seen = [n + skip for n, skip in zip(self.runner.row_lengths(rows), skipped)]
        cached = [min(n, length - 1) for n, length in zip(seen, lengths)]
        self.runner.truncate([c - skip for c, skip in zip(cached, skipped)], rows=rows)  # guards the convention
        idle = [max_ks[row] == 0 and lengths[row] - cached[row] > 2 for row in range(batch)]
        for row, ctx in enumerate(contexts):
            if lengths[row] - cached[row] > 2 and not idle[row]:  # behind: alone up to one token short
                behind = ctx.token_ids[:, cached[row]:lengths[row] - 1].to(device)
                self.runner.forward(behind, torch.arange(cached[row], lengths[row] - 1, device=device)[None],
                                    rows=slice(row, row + 1), last_n_logits=1)
                cached[row] = lengths[row] - 1
        missing = [1 if idle[row] else lengths[row] - cached[row] for row in range(batch)]  # 1 or 2
        width = max(missing)
        inputs = torch.zeros(batch, width, dtype=torch.int64)
        for row, ctx in enumerate(contexts):
            if not idle[row]:
                inputs[row, :missing[row]] = ctx.token_ids[0, cached[row]:].cpu()
        positions = torch.tensor(cached)[:, None] + torch.arange(width)[None]
        logits = self.runner.forward(inputs.to(device), positions.to(device), rows=rows).logits  # [B, width, V]
        logits = logits[torch.arange(batch), torch.tensor(missing) - 1]  # [B, V] at each row's last real token
        valid = [cached[row] if idle[row] else lengths[row] for row in range(batch)]  # what each row's cache holds
        self.runner.truncate([n - skip for n, skip in zip(valid, skipped)], rows=rows)

        # 2. Draft k tokens per row, each row from its own warp and generator.
        draft_ids = torch.zeros(batch, k, dtype=torch.int64, device=device)
        sampled = any(not ctx.params.greedy for ctx in contexts)
        draft_probs = torch.zeros(batch, k, contexts[0].vocab_size, device=device) if sampled else None
        for i in range(k):
            logits = match_vocab(logits, contexts[0].vocab_size)  # [B, V]
            for row, ctx in enumerate(contexts):
                if i >= max_ks[row]:
                    continue  # padding: fed but never sampled, so the row's generator is untouched
                if ctx.params.greedy:
                    draft_ids[row, i] = logits[row].argmax()
                else:
                    probs = warp_logits(logits[row:row + 1], ctx.params)  # [1, V]
                    draft_ids[row, i] = sample_from_probs(probs, ctx.generator)[0]
                    draft_probs[row, i] = probs[0]
            if i + 1 < k:
                step_positions = torch.tensor(lengths, device=device)[:, None] + i
                logits = self.runner.forward(draft_ids[:, i:i + 1], step_positions, rows=rows).logits[:, -1]

        self._proposal_start[:batch] = valid
        self._fed_drafts[:batch] = [0 if idle[row] else k - 1 for row in range(batch)]
        num_tokens = torch.tensor(max_ks, dtype=torch.int64, device=device)
        token_ids = torch.where(torch.arange(k, device=device)[None] < num_tokens[:, None], draft_ids, -1)
        return DraftProposal(token_ids=token_ids, num_tokens=num_tokens, probs=draft_probs)

    def on_verified(self, num_accepted: torch.Tensor) -> None:
        # Keep each row's context plus the accepted drafts that were fed; drop the rest.
        accepted = num_accepted.reshape(-1).tolist()
        keep = [start + min(a, fed) - skip for start, a, fed, skip
                in zip(self._proposal_start, accepted, self._fed_drafts, self._skipped)]
        self.runner.truncate(keep, rows=slice(0, len(keep)))

    def move_row(self, source: int, destination: int) -> None:
        self.runner.move_row(source, destination)
        self._proposal_start[destination] = self._proposal_start[source]
        self._fed_drafts[destination] = self._fed_drafts[source]
        self._skipped[destination] = self._skipped[source]


def _row_of(proposal: DraftProposal, row: int) -> DraftProposal:
    """Row `row` of a batched proposal, trimmed to its real tokens."""
    count = int(proposal.num_tokens[row])
    return DraftProposal(proposal.token_ids[row:row + 1, :count], proposal.num_tokens[row:row + 1],
                         None if proposal.probs is None else proposal.probs[row:row + 1, :count])


class BatchedNgramThenDraftProposer(BatchProposer):
    """ngram+draft (proposers/hybrid.py) for B rows: each row's n-gram lookup first; the rows it finds
    nothing for draft with the draft model, together, in one BatchedDraftModelProposer call (the rows
    that copied take k = 0 there, so their generators are untouched). As in the single-sequence
    hybrid, the draft model only learns of copied steps at its next catch-up, so each row proposes
    exactly what it would alone."""

    def __init__(self, ngram: RowwiseProposer, draft: BatchedDraftModelProposer, draft_max_k: int | None = None) -> None:
        self.ngram, self.draft, self.draft_max_k = ngram, draft, draft_max_k
        self._copied: list[bool] = []  # rows whose step the n-gram lookup proposed
        self._drafted = False  # whether the draft model proposed this step (its on_verified is due)
        self.steps_mixed = 0  # steps where some rows copied and others drafted with the model

    def start_row(self, row: int) -> None:
        self.ngram.start_row(row)
        self.draft.start_row(row)

    def propose(self, contexts: Sequence[ProposeContext], max_ks: Sequence[int]) -> DraftProposal:
        copied = self.ngram.propose(contexts, max_ks)
        self._copied = [bool(n > 0) for n in copied.num_tokens.tolist()]
        draft_ks = [0 if by_ngram else min(max_k, self.draft_max_k or max_k)
                    for by_ngram, max_k in zip(self._copied, max_ks)]
        self._drafted = max(draft_ks, default=0) >= 1
        if not self._drafted:
            return copied
        drafted = self.draft.propose(contexts, draft_ks)
        self.steps_mixed += any(self._copied)
        device = contexts[0].token_ids.device
        return pad_proposals([_row_of(copied if by_ngram else drafted, row) for row, by_ngram in enumerate(self._copied)],
                             contexts[0].vocab_size, device)

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
