"""Each request's own method in one batch: the OpenAI body's `speculative` object (docs/server.md).

A server loads one method with what it needs (a draft model, a head) and, beside it, the methods
that need nothing but the target (registry.BESIDE_ANY_METHOD: plain decoding, n-gram lookup,
suffix decoding, scored copying). A request may name any of them; its row is then drafted by that
method's proposer, and every row still shares one verification forward, as rows with different k
do. Verification is the engine's exact rule whoever drafted, so each request's greedy output is
plain greedy output and its sampled output has the target's distribution, whatever its neighbours
use.

Each method's proposer is a BatchProposer over every slot, built the first time a request names
the method (one nobody asks for costs nothing); it drafts only its own rows (the others get
max_k 0). Row bookkeeping (a new request, a tenant, a row moved by packing, a finished request)
reaches every built proposer, so a proposer's per-row state is reset wherever a row changes hands,
and the corpora shared across requests (suffix decoding's cache, scored copying's earlier texts)
learn every finished request, whichever method wrote it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specdec.proposers.base import DraftProposal, ProposeContext, Source
from specdec.proposers.batched import BatchProposer, pad_proposals, row_of

Build = Callable[[], BatchProposer | None]  # a method's proposer over every slot; None: plain decoding


class PerRequestMethods(BatchProposer):
    """Rows of several methods in one batch.

    >>> proposer = PerRequestMethods("copy", {"copy": build_copy, "ngram": build_ngram}, slots=8)
    >>> proposer.set_row_method(3, "ngram")   # before the request in row 3 starts (BatchEngine.start_row)

    default: the server's own method, what a row runs unless its request names another; builders:
    every method a request may name (default included) -> a function building its proposer.
    The engine-wide hooks (the target's features, tokens added to the forward, the tree budget) are
    the default method's: the others need none (registry.BESIDE_ANY_METHOD).
    """

    def __init__(self, default: str, builders: dict[str, Build], slots: int) -> None:
        if default not in builders:
            raise ValueError(f"the default method {default!r} must be one of the builders")
        self.default, self._builders, self.slots = default, dict(builders), slots
        self._built: dict[str, BatchProposer | None] = {}
        self._row_method = [default] * slots
        self._asked: list[str] = []  # the methods whose proposers drafted the step being verified
        main = self._proposer(default)
        if main is not None:
            self.reads_target_hidden, self.target_layers = main.reads_target_hidden, tuple(main.target_layers)
            self.extra_verify_tokens, self.tree_budget = main.extra_verify_tokens, main.tree_budget
            self.sizes_own_drafts = main.sizes_own_drafts
        self.step_costs = self._step_costs()

    @property
    def methods(self) -> tuple[str, ...]:
        """What a request may name, the default first."""
        return (self.default, *(name for name in self._builders if name != self.default))

    @property
    def built_methods(self) -> tuple[str, ...]:
        """The methods whose proposers exist: the default, and each one a request has named."""
        return tuple(self._built)

    def _proposer(self, method: str) -> BatchProposer | None:
        if method not in self._built:
            self._built[method] = self._builders[method]()
            self.step_costs = self._step_costs()
        return self._built[method]

    def _step_costs(self):
        """One-row steps' costs go to the first built proposer that sizes its drafts by them (scored
        copying's StepCosts, shared by its rows): the engine records into a single one."""
        return next((p.step_costs for p in self._each() if p.step_costs is not None), None)

    def _each(self) -> list[BatchProposer]:
        return [proposer for proposer in self._built.values() if proposer is not None]

    def set_row_method(self, row: int, method: str | None) -> None:
        method = self.default if method is None else method
        if method not in self._builders:
            raise ValueError(f"method {method!r} is not loaded here; choose one of: {', '.join(self.methods)}")
        self._proposer(method)  # built before the row starts, so its start_row reaches it
        self._row_method[row] = method

    def row_method(self, row: int) -> str:
        return self._row_method[row]

    def sizes_own_drafts_of(self, row: int) -> bool:
        proposer = self._built[self._row_method[row]]
        return proposer is not None and proposer.sizes_own_drafts

    # ---- rows change hands: every built proposer hears it ----------------------------------------

    def start_row(self, row: int) -> None:
        for proposer in self._each():
            proposer.start_row(row)

    def set_row_tenant(self, row: int, tenant: str | None) -> None:
        for proposer in self._each():
            proposer.set_row_tenant(row, tenant)

    def end_row(self, row: int, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        for proposer in self._each():
            proposer.end_row(row, prompt_ids, output_ids)

    def move_row(self, source: int, destination: int) -> None:
        for proposer in self._each():
            proposer.move_row(source, destination)
        self._row_method[destination] = self._row_method[source]

    def forget_earlier_requests(self) -> None:
        for proposer in self._each():
            proposer.forget_earlier_requests()

    # ---- a row's own method ---------------------------------------------------------------------

    def unread_tokens(self, row: int, context_len: int) -> int:
        proposer = self._built[self._row_method[row]]
        return 0 if proposer is None else proposer.unread_tokens(row, context_len)

    def sources(self, row: int, token_ids: Sequence[int]) -> tuple[Source, ...] | None:
        """The row's method's own sources (ngram+draft's), else the method as one source: -k auto then
        keeps each method's acceptance apart. The default's single source stays None, so a batch of
        default rows is chosen for exactly as without this proposer."""
        method = self._row_method[row]
        proposer = self._built[method]
        offered = None if proposer is None else proposer.sources(row, token_ids)
        if offered is not None or method == self.default:
            return offered
        return (Source(method, reads_backlog=True),)

    def use_sources(self, sources: Sequence[Source]) -> None:
        for proposer in self._each():
            proposer.use_sources(sources)

    def read_lookahead(self, row: int, logits: torch.Tensor) -> None:
        proposer = self._built[self._row_method[row]]
        if proposer is not None:
            proposer.read_lookahead(row, logits)

    def propose(self, contexts: Sequence[ProposeContext], max_ks: Sequence[int]) -> DraftProposal:
        """Each method's proposer drafts its own rows (the others' max_k 0); row b of the result is
        row b of its method's proposal."""
        device = contexts[0].token_ids.device
        rows = [DraftProposal.empty(1, device) for _ in contexts]
        self._asked = []
        for method, proposer in self._built.items():
            mine = [max_k if self._row_method[b] == method else 0 for b, max_k in enumerate(max_ks)]
            if proposer is None or not any(mine):
                continue
            self._asked.append(method)
            drafted = proposer.propose(contexts, mine)
            for b, max_k in enumerate(mine):
                if max_k:
                    rows[b] = row_of(drafted, b)
        if len(self._asked) == 1:  # one method drafted: its proposal is already the batch's (the rest empty)
            return drafted
        return pad_proposals(rows, contexts[0].vocab_size, device)

    def on_verified(self, num_accepted: torch.Tensor) -> None:
        for method in self._asked:
            self._built[method].on_verified(num_accepted)
        self._asked = []
