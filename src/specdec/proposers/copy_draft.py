"""copy+draft: scored copying and the draft model, each row's step drafted by the one whose expected
tokens per second is highest (issue 60, item 3: one default that picks per request).

Scored copying (scored_copy.py) prices its own best draft: (1 + expected accepted) / cost(forward),
in 1-token steps, from a fitted score and the machine's measured verification costs. The draft
model's price is measured as it runs: over a row's recent draft-model steps, the tokens accepted
and drafted and the seconds the draft model took (its catch-up included), so

    draft rate = (1 + accepted) / (cost(1 + drafted) + draft seconds / a 1-token step's seconds)

and a step goes to the source with the highest rate, or to neither where plain decoding's
1 / cost(1) is higher. ngram+draft (hybrid.py) picks between lookup and draft with rates per
source too, but its lookup's rate is an average per match length; here the copy's is its own
estimate for this very step's candidate, so a step with a long confident copy and a step with a
weak one are told apart.

A draft model's step costs far more when it first reads a window of the context than when it is
warm (it read this request before, and what it missed since fits a window), so each row keeps two
records: warm steps and cold ones. A draft model that fell further behind than a window starts its
row afresh on the last DRAFT_CONTEXT_WINDOW tokens rather than reading them all: its cold step
costs one bounded forward more. A source that is never chosen is never measured again, so where copying offers
nothing the draft model is probed now and then: after `probe_after` steps without it, the wait
doubling while its warm steps lose (at most `probe_cap`), back to `probe_after` when they pay. A
cold probe warms it; its warm steps then run for as long as their rate wins.

Each row's step is drafted by exactly one source: copies are point masses (probs None), the draft
model's tokens carry its distribution, and the engine's rejection sampler is exact for both, so
greedy output is plain greedy output and sampled output has the target's distribution. Which
source drafts follows measured times, so a seeded sampled run may draw differently from one run to
the next (each run exact); copy alone with a fixed cost table (--copy-costs) is reproducible.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.proposers.base import DraftProposal, ProposeContext
from specdec.proposers.batched import BatchProposer, RowwiseProposer, pad_proposals, row_of
from specdec.proposers.draft_model import DEFAULT_CONFIDENCE, DraftModelProposer, DraftOptions, draft_model_for
from specdec.proposers.entry import Build, MethodEntry
from specdec.proposers.hybrid import DRAFT_CONTEXT_WINDOW
from specdec.proposers.scored_copy import CopyOptions, CopyPlan, scored_copy_maker
from specdec.proposers.step_costs import StepCosts

PROBE_AFTER = 8  # steps without the draft model before it is probed again where copying offers nothing
PROBE_CAP = 256  # the longest wait between probes of a draft model that keeps losing


@dataclass
class DraftRecord:
    """Exponentially weighted means over a source's recent draft steps (the first 1 / weight steps
    averaged plainly, so the first step does not decide alone)."""

    accepted: float = 0.0
    drafted: float = 0.0
    seconds: float = 0.0
    steps: int = 0
    weight: float = 0.2  # the newest step's share once warm

    def add(self, accepted: int, drafted: int, seconds: float) -> None:
        self.steps += 1
        share = max(1.0 / self.steps, self.weight)
        self.accepted += share * (accepted - self.accepted)
        self.drafted += share * (drafted - self.drafted)
        self.seconds += share * (seconds - self.seconds)

    def rate(self, step_costs: StepCosts, forward_cost: float | None = None) -> float | None:
        """Expected tokens per 1-token step's time of drafting with this source; None: not known yet
        (never measured, or no 1-token step timed to price its seconds by). forward_cost: a fixed
        price of one draft forward in target steps (its measured seconds otherwise)."""
        if not self.steps:
            return None
        drafting = self._steps_of_drafting(step_costs, forward_cost)
        if drafting is None:
            return None
        return (1.0 + self.accepted) / (step_costs.cost(1 + round(self.drafted)) + drafting)

    def _steps_of_drafting(self, step_costs: StepCosts, forward_cost: float | None) -> float | None:
        if forward_cost is not None:  # a draft step runs one forward per drafted token (the first catches up)
            return forward_cost * self.drafted
        step_s = step_costs.step_seconds()
        return self.seconds / step_s if step_s else None


@dataclass
class _RowState:
    warm: DraftRecord  # this request's draft steps with a short backlog (seeded from the engine's)
    cold: DraftRecord  # ... and those that read a fresh window first
    since_draft: int = 0  # steps since the draft model last drafted for this row
    probe_after: int = PROBE_AFTER
    warm_now: bool = False  # whether this step's draft read a short backlog


def _seeded(engine: DraftRecord) -> DraftRecord:
    """A new request's record: the engine's means, weighted as one step."""
    return DraftRecord(engine.accepted, engine.drafted, engine.seconds, min(engine.steps, 1))


class CopyThenDraftProposer(BatchProposer):
    """copy: a RowwiseProposer of ScoredCopyProposers (one per row, one shared StepCosts); draft: the
    draft model with one cache row per row; draft_max_k caps its tokens per step."""

    sizes_own_drafts = True  # every row's length is chosen here (scored copying's or the draft's own stop)

    def __init__(self, copy: RowwiseProposer, draft: DraftModelProposer, draft_max_k: int | None = None,
                 probe_after: int = PROBE_AFTER, probe_cap: int = PROBE_CAP, forward_cost: float | None = None,
                 learn_across_requests: bool = True) -> None:
        """forward_cost: a fixed price of one draft forward in target steps, so the choices follow no
        timing (a seeded sampled run then repeats its draws); None: the measured seconds.
        learn_across_requests: a new request starts from every earlier draft step's rate (False: from
        nothing, so a row's choices depend on its own request alone, as a batch-invariance test needs)."""
        if len(copy.rows) != draft.slots:
            raise ValueError(f"copy has {len(copy.rows)} rows, the draft model {draft.slots}")
        if draft_max_k is not None and (isinstance(draft_max_k, bool) or not isinstance(draft_max_k, int)
                                        or draft_max_k < 1):
            raise ValueError(f"draft_max_k must be an integer >= 1 or None, got {draft_max_k!r}")
        self.copy, self.draft, self.draft_max_k = copy, draft, draft_max_k
        self.step_costs = copy.step_costs
        self.probe_after, self.probe_cap = probe_after, probe_cap
        self.forward_cost, self.learn_across_requests = forward_cost, learn_across_requests
        self.engine_warm = DraftRecord()  # every row's warm steps: a new request's start
        self._rows = [self._fresh_row() for _ in copy.rows]
        self._by_draft: list[bool] = []  # rows the draft model drafts this step
        self._by_copy: list[bool] = []  # rows scored copying drafts this step
        self._draft_seconds = 0.0
        self._draft_counts: list[int] = []  # tokens the draft model drafted per row this step
        self.steps_by_copy = self.steps_by_draft = 0  # row-steps
        self.draft_probes = 0  # row-steps drafted by a draft model not measured yet, or one due a probe

    def _fresh_row(self) -> _RowState:
        if not self.learn_across_requests:
            return _RowState(DraftRecord(), DraftRecord(), probe_after=self.probe_after)
        # The cold record starts empty: each request's draft model reads its window at the first step
        # copying offers nothing, as ngram+draft's does; a cold step after that waits for its probe.
        return _RowState(_seeded(self.engine_warm), DraftRecord(), probe_after=self.probe_after)

    def start_row(self, row: int) -> None:
        self.copy.start_row(row)
        self.draft.start_row(row)
        self._rows[row] = self._fresh_row()

    def set_row_tenant(self, row: int, tenant: str | None) -> None:
        self.copy.set_row_tenant(row, tenant)

    def propose(self, contexts: Sequence[ProposeContext], max_ks: Sequence[int]) -> DraftProposal:
        plans = [self.copy.rows[b].plan(ctx, max_k) if max_k >= 1 else None
                 for b, (ctx, max_k) in enumerate(zip(contexts, max_ks))]
        self._by_draft = [max_k >= 1 and self._draft_wins(b, plan, ctx.token_ids.shape[1])
                          for b, (plan, ctx, max_k) in enumerate(zip(plans, contexts, max_ks))]
        self._by_copy = [plan is not None and not by_draft and plan.judged is not None
                         for plan, by_draft in zip(plans, self._by_draft)]
        device = contexts[0].token_ids.device
        rows = [self.copy.rows[b].take(plan) if plan is not None and not by_draft else DraftProposal.empty(1, device)
                for b, (plan, by_draft) in enumerate(zip(plans, self._by_draft))]
        for b, by_draft in enumerate(self._by_draft):
            if by_draft:
                self.copy.rows[b].skip()
        self.steps_by_copy += sum(self._by_copy)
        self.steps_by_draft += sum(self._by_draft)
        if any(self._by_draft):
            drafted = self._draft_rows(contexts, max_ks)
            rows = [row_of(drafted, b) if by_draft else row for b, (row, by_draft) in enumerate(zip(rows, self._by_draft))]
        return pad_proposals(rows, contexts[0].vocab_size, device)

    def _draft_wins(self, b: int, plan: CopyPlan, context_len: int) -> bool:
        """Whether row b's step goes to the draft model: its measured rate beats copying's expected one
        (which is at least plain decoding's). Its rate is the warm one where its backlog is short, the
        cold one (a fresh window to read first) otherwise. Where copying offers nothing, a draft model
        not measured yet is tried, and one that loses is probed after a wait: a cold probe warms it,
        and its warm steps then run while they win."""
        state = self._rows[b]
        state.since_draft += 1
        state.warm_now = self.draft.unread_tokens(b, context_len) <= DRAFT_CONTEXT_WINDOW and self.draft.has_read(b)
        rate = (state.warm if state.warm_now else state.cold).rate(self.step_costs, self.forward_cost)
        if rate is not None and rate > plan.rate:
            return True
        if plan.judged is not None:  # copying drafts
            return False
        probe = rate is None or state.since_draft > state.probe_after
        self.draft_probes += probe
        return probe

    def _draft_rows(self, contexts: Sequence[ProposeContext], max_ks: Sequence[int]) -> DraftProposal:
        """The draft model's proposal for the rows it drafts (the others ask it for 0 tokens)."""
        for b, by_draft in enumerate(self._by_draft):  # (_draft_wins judged each row's backlog)
            if by_draft and not self._rows[b].warm_now and self.draft.has_read(b):
                self.draft.start_row(b)  # far behind: read only the last window, in one forward
        draft_ks = [min(max_k, self.draft_max_k or max_k) if by_draft else 0
                    for max_k, by_draft in zip(max_ks, self._by_draft)]
        started = time.perf_counter()
        drafted = self.draft.propose(contexts, draft_ks)
        self._draft_seconds = time.perf_counter() - started  # the rows' one call: each row is charged all of it
        self._draft_counts = drafted.num_tokens.tolist()
        return drafted

    def on_verified(self, num_accepted: torch.Tensor) -> None:
        accepted = num_accepted.reshape(-1)
        for b, by_copy in enumerate(self._by_copy):
            if by_copy:
                self.copy.rows[b].on_verified(accepted[b:b + 1])
        if not any(self._by_draft):
            return
        for b, by_draft in enumerate(self._by_draft):
            if by_draft:
                self._learn(b, int(accepted[b]))
        kept = accepted.clone()
        kept[~torch.tensor(self._by_draft[:len(kept)], dtype=torch.bool)] = 0  # copied rows catch up next time
        self.draft.on_verified(kept)

    def _learn(self, b: int, accepted: int) -> None:
        state = self._rows[b]
        drafted = self._draft_counts[b]
        for record in (state.warm, self.engine_warm) if state.warm_now else (state.cold,):
            record.add(accepted, drafted, self._draft_seconds)
        state.since_draft = 0
        if state.warm_now:  # a probe's worth is its warm steps' rate: wait longer while they lose
            paid = (state.warm.rate(self.step_costs, self.forward_cost) or 0.0) >= 1.0 / self.step_costs.cost(1)
            state.probe_after = self.probe_after if paid else min(2 * state.probe_after, self.probe_cap)

    def unread_tokens(self, row: int, context_len: int) -> int:
        return 0  # the draft model's catch-up is bounded (a fresh window) and priced in its measured seconds

    def end_row(self, row: int, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        self.copy.end_row(row, prompt_ids, output_ids)

    def move_row(self, source: int, destination: int) -> None:
        self.copy.move_row(source, destination)
        self.draft.move_row(source, destination)
        self._rows[destination] = self._rows[source]

    def forget_earlier_requests(self) -> None:
        self.copy.forget_earlier_requests()



def _build(build: Build) -> BatchProposer:
    # It sizes its own steps whatever k is: its draft model always stops where unsure.
    confidence = DEFAULT_CONFIDENCE if build.draft_confidence is None else build.draft_confidence
    draft = draft_model_for(build, confidence, DRAFT_CONTEXT_WINDOW)
    copy = RowwiseProposer(scored_copy_maker(build.option(CopyOptions)), build.slots)
    return CopyThenDraftProposer(copy, draft, build.draft_k)


METHOD_ENTRIES = (
    MethodEntry("copy+draft", "scored copying and the draft model: each step drafted by the one whose expected "
                "tokens per second is higher (copying's fitted score, the draft model's measured rate and time)",
                _build, needs_draft_model=True, options=(CopyOptions, DraftOptions)),
)
