"""Proposers for a batch of running requests, one cache row per request (the server's engine).

Row b of every tensor belongs to the request running in row b of the target's
cache (engine/batch.py keeps the running rows packed at 0..B-1). Each row has
its own context, sampling params, generator and cap on drafts this step; the
proposal is padded to the longest row with -1 and num_tokens says how many
are real, so verification is ragged exactly as vLLM's is.

RowwiseProposer makes any single-sequence Proposer batch-native, one instance per row (an
n-gram index is per request anyway); SpecEngine sees its proposer through one with one row.
The draft model (draft_model.py) and ngram+draft (hybrid.py) are batch-native themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specdec.proposers.base import DraftProposal, ProposeContext, Proposer, Source


class BatchProposer:
    """Proposes for B running requests at once, row b for the request in the target's cache row b.

    Every hook the batched engine calls is declared here with a default that does nothing; an
    implementation overrides what it uses (see Proposer for the single-request interface)."""

    reads_target_hidden: bool = False  # as Proposer's
    target_layers: tuple[int, ...] = ()  # as Proposer's
    extra_verify_tokens: int = 0  # as Proposer's
    tree_budget = None  # as Proposer's (one request: SpecEngine records its tree steps into it)
    sizes_own_drafts: bool = False  # as Proposer's
    step_costs = None  # as Proposer's (one-row steps are recorded into it)
    methods: tuple[str, ...] = ()  # what a request may name (set_row_method); (): only the proposer's own

    def sizes_own_drafts_of(self, row: int) -> bool:
        """Whether row's drafts are sized by the proposer itself (-k auto's controller then gives it its
        whole cap); rows differ where requests chose their methods (per_request.py)."""
        return self.sizes_own_drafts

    def set_row_method(self, row: int, method: str | None) -> None:
        """The request about to start in row asked for method (called before start_row); None: the
        proposer's own. Only a proposer of several methods (per_request.py) offers another."""
        if method is not None:
            raise ValueError(f"method {method!r} is not loaded here")

    def start_row(self, row: int) -> None:
        """A new request now runs in row."""

    def set_row_tenant(self, row: int, tenant: str | None) -> None:
        """The request about to start in row is tenant's (called before start_row): it may learn only
        from that tenant's earlier requests (Proposer.start_tenant). Nothing shared: nothing to do."""

    def propose(self, contexts: Sequence[ProposeContext], max_ks: Sequence[int]) -> DraftProposal:
        """Guess the next tokens of every row of the batch at once.

        Args:
            contexts: row b's ProposeContext (its committed tokens [1, L_b], params, generator).
            max_ks: row b's most tokens (or tree nodes) to draft; 0: the row drafts nothing this step.
        Returns:
            DraftProposal with token_ids [B, k] int64 padded with -1 (k the widest row's), num_tokens
            [B], probs [B, k, V] or None (point masses), and trees[b] where row b drafts a tree.
        """
        raise NotImplementedError

    def on_verified(self, num_accepted: torch.Tensor) -> None:
        """[B] drafts accepted in rows 0..B-1."""

    def unread_tokens(self, row: int, context_len: int) -> int:
        """Committed tokens of row's request it has not read yet (Proposer.unread_tokens)."""
        return 0

    def sources(self, row: int, token_ids: Sequence[int]) -> tuple[Source, ...] | None:
        """A composite proposer (ngram+draft): the sources that could draft row's next step, given
        its committed tokens, its preferred first, for -k auto to choose from. None: one source."""
        return None

    def use_sources(self, sources: Sequence[Source]) -> None:
        """-k auto chose each row's source for the next propose() (one of what sources() offered)."""

    def read_lookahead(self, row: int, logits: torch.Tensor) -> None:
        """The target's logits [m, V] at the lookahead tokens row's last proposal carried."""

    def end_row(self, row: int, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """The request in row finished (suffix decoding's shared cache learns its output)."""

    def move_row(self, source: int, destination: int) -> None:
        """Packing after a request left: source's state now belongs to destination."""

    def forget_earlier_requests(self) -> None:
        """Empty what it learned from earlier requests (Proposer.forget_earlier_requests)."""


def pad_proposals(proposals: Sequence[DraftProposal], vocab_size: int, device: torch.device) -> DraftProposal:
    """Stack one-row proposals [1, k_b] into [B, max k_b], -1 padded.

    Rows without a distribution are point masses; when some other row has one,
    they get the one-hot q that None stands for (the same acceptance and residual).
    Each row keeps its tree and its lookahead tokens (DraftProposal.trees, .lookaheads).
    """
    if len(proposals) == 1:  # one row (SpecEngine): its own tensors, already [1, k]
        only = proposals[0]
        return DraftProposal(only.token_ids.to(device), only.num_tokens.to(device), only.probs, only.trees,
                             only.lookaheads)
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
    trees = tuple(p.tree() for p in proposals)
    lookaheads = tuple(p.lookahead() for p in proposals)
    return DraftProposal(token_ids, num_tokens, probs,
                         trees=trees if any(tree is not None for tree in trees) else None,
                         lookaheads=lookaheads if any(extra is not None for extra in lookaheads) else None)


def row_of(proposal: DraftProposal, row: int) -> DraftProposal:
    """Row `row` of a batched proposal [B, k], trimmed to its real tokens: [1, k_row], with its tree
    and lookahead tokens."""
    count = int(proposal.num_tokens[row])
    tree, lookahead = proposal.tree(row), proposal.lookahead(row)
    return DraftProposal(proposal.token_ids[row:row + 1, :count], proposal.num_tokens[row:row + 1],
                         None if proposal.probs is None else proposal.probs[row:row + 1, :count],
                         trees=None if tree is None else (tree,), lookaheads=None if lookahead is None else (lookahead,))


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
        self.tree_budget = first.tree_budget
        self.sizes_own_drafts, self.step_costs = first.sizes_own_drafts, first.step_costs

    def start_row(self, row: int) -> None:
        self.rows[row].reset()

    def set_row_tenant(self, row: int, tenant: str | None) -> None:
        self.rows[row].start_tenant(tenant)

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

    def unread_tokens(self, row: int, context_len: int) -> int:
        return self.rows[row].unread_tokens(context_len)

    def read_lookahead(self, row: int, logits: torch.Tensor) -> None:
        """The target's logits [m, V] at the lookahead tokens row's last proposal carried."""
        self.rows[row].read_lookahead(logits)

    def end_row(self, row: int, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """The request in row finished (suffix decoding's shared cache learns its output)."""
        self.rows[row].end_request(prompt_ids, output_ids)

    def move_row(self, source: int, destination: int) -> None:
        self.rows[source], self.rows[destination] = self.rows[destination], self.rows[source]
        self._proposed[destination] = self._proposed[source]

    def forget_earlier_requests(self) -> None:
        for proposer in self.rows:
            proposer.forget_earlier_requests()


def as_batch(proposer: Proposer | BatchProposer | None) -> BatchProposer | None:
    """What the step calls: a BatchProposer as it is, a single-sequence Proposer as a batch of one row."""
    return RowwiseProposer(lambda: proposer, 1) if isinstance(proposer, Proposer) else proposer
