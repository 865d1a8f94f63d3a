"""Scored copying (`--method copy`): every continuation the context and earlier requests offer,
each drafted token's chance of acceptance estimated by a fitted score, and the candidate and
length with the most expected tokens per second under this machine's measured costs.

Prompt lookup (ngram.py) copies the most recent occurrence of the last n <= 3 tokens; suffix
decoding (suffix.py) the most frequent path below the longest suffix match. Replaying recorded
answers showed both usually had the right continuation among their candidates and chose the wrong
one, or the wrong length (docs/architecture.md, "Scored copying"). Here the choice is learned:

  candidates   copy_candidates.step_candidates: every earlier occurrence of the context's tail in
               this request's prompt and answer so far, and in this tenant's earlier prompts and
               answers (copy_corpus.CopyCorpus), one candidate per distinct continuation, with its features.
  score        a logistic hazard per drafted depth (copy_candidates.LogisticScorer), fitted on
               recorded greedy answers by `specdec replay --fit`; the package ships one
               (data/copy_scorer.json, which says what it was fitted on).
  choice       copy_candidates.choose_draft: the candidate and length maximising
               (1 + expected accepted) / cost(1 + drafted), or no draft. cost is step_costs.StepCosts: the
               engine's measured verification times (one-row steps), a prior curve until two
               forward sizes are measured.
  calibration  Calibration: the request's own intercept on the score's logit, fitted online from its
               verified drafts (the score was fitted on other text).

Drafts are point masses (probs None), chains: verification is the engine's exact rule, so greedy
output is plain greedy output and sampled output has the target's distribution. The proposer
sizes its own drafts (sizes_own_drafts): under `-k auto` the engine gives it the whole k and does
not second-guess the length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from specdec.option_fields import flagged, non_negative_int
from specdec.planning.costs import cost_ratios, interpolated, tree_cost_ratios
from specdec.proposers.base import DraftProposal, ProposeContext, Proposer, chain_or_tree, committed_since
from specdec.proposers.batched import RowwiseProposer, pad_proposals
from specdec.proposers.copy_candidates import (DEFAULT_DEPTH, DEFAULT_MOST, CostFn, LogisticScorer, StepCandidates,
                                               best_by_length, choose_draft, choose_tree, hazard_rows, load_scorer,
                                               sigmoid, step_candidates)
from specdec.proposers.copy_corpus import DEFAULT_CORPUS_TOKENS, CopyCorpus, TenantCopyCorpora, check_corpus_tokens
from specdec.proposers.entry import Build, MethodEntry
from specdec.proposers.step_costs import StepCosts


@dataclass(frozen=True)
class CopyOptions:
    """--method copy's knobs, checked when built (before any model loads): the scorer file is read.
    Each field is its own flag."""

    GROUP: ClassVar[str] = "copy"
    TITLE: ClassVar[str] = "scored copying"
    scorer: str | None = flagged(
        None, "the fitted score it chooses by, as `specdec replay RUN --fit FILE` writes it from your own "
        "recorded answers (default: the one that ships, fitted on the repository's bench runs)", parse=str,
        metavar="FILE")
    corpus_tokens: int = flagged(
        DEFAULT_CORPUS_TOKENS, "earlier requests' prompts and answers it also copies from, per tenant, newest kept "
        f"(default: {DEFAULT_CORPUS_TOKENS}; 0 = each request copies from itself only)", parse=non_negative_int,
        metavar="N")
    costs: str | None = flagged(
        None, "choose draft lengths by this `specdec costs` table instead of the engine's measured step times: a "
        "seeded sampled run then drafts, hence draws, the same every time (a table written with --trees also "
        "prices --copy-trees' trees)", parse=str, metavar="FILE")
    trees: bool = flagged(
        False, "verify a tree of the candidates that diverge after a shared prefix, as large as the cost curve pays "
        "for (native backend); pays where many tokens verify for about one's cost (a GPU), barely on a CPU "
        "(benchmarks/RESULTS.md, \"Trees of copies\"); a tree only where it beats the best chain at its own "
        "measured cost")

    def __post_init__(self) -> None:
        check_corpus_tokens(self.corpus_tokens)
        if self.scorer is not None:
            load_scorer(self.scorer)  # a clear error now, not after loading a model
        if self.costs is not None:
            cost_ratios(self.costs)

    def new_step_costs(self) -> StepCosts:
        if self.costs is None:
            return StepCosts()
        trees = tree_cost_ratios(self.costs)
        return StepCosts(interpolated(cost_ratios(self.costs)[0]), measured=False,
                         tree_prior=None if trees is None else interpolated(trees))

    def new_tenant_corpora(self) -> TenantCopyCorpora:
        return TenantCopyCorpora(self.corpus_tokens)


class Calibration:
    """A request's own intercept on the scorer's logit, fitted online: the shipped score was fitted
    on other text, and a request whose copies keep failing (free prose, arithmetic) or keep holding
    (an edit of a file) says so within a few steps. A random intercept of the logistic model, its
    maximum a posteriori estimate under a N(0, 1 / prior) prior by Newton's method over the last
    `window` verified drafted tokens (y = 1 accepted, 0 the first rejected; later ones were never
    judged). A step that drafts nothing teaches nothing, so the intercept relaxes towards 0 by
    `relax` at each one, and a request that stopped drafting tries again."""

    def __init__(self, window: int = 256, prior: float = 4.0, relax: float = 0.95) -> None:
        self.window, self.prior, self.relax = window, prior, relax
        self.reset()

    def reset(self) -> None:
        self.offset = 0.0
        # The judged tokens' logits and outcomes, oldest first, the last `window` of them in use:
        # contiguous arrays, moved down when full, so each fit reads them without a copy.
        self._logits, self._outcomes = np.zeros(2 * self.window), np.zeros(2 * self.window)
        self._judged = 0
        self._pending: np.ndarray | None = None  # the drafted tokens' logits, until verified

    def drafted(self, logits: np.ndarray) -> None:
        """The scorer's logits (without the intercept) of the tokens just drafted."""
        self._pending = logits

    def idle(self) -> None:
        """A step that drafted nothing."""
        self._pending = None
        self.offset *= self.relax

    def verified(self, accepted: int) -> None:
        if self._pending is None:
            return
        judged = self._pending[:accepted + 1]  # the accepted ones, then the first rejected (if any)
        outcomes = (np.arange(len(judged)) < accepted)[-self.window:]
        judged, self._pending = judged[-self.window:], None
        if self._judged + len(judged) > len(self._logits):
            kept = self.window - len(judged)
            for rows in (self._logits, self._outcomes):
                rows[:kept] = rows[self._judged - kept:self._judged]
            self._judged = kept
        end = self._judged + len(judged)
        self._logits[self._judged:end] = judged
        self._outcomes[self._judged:end] = outcomes
        self._judged = end
        z = self._logits[max(0, end - self.window):end]
        accepted_sum = self._outcomes[max(0, end - self.window):end].sum()
        offset = self.offset
        for _ in range(3):  # sum(y - p) and sum(p (1 - p)) in two reductions of p
            p = sigmoid(z + offset)
            p_sum = p.sum()
            offset += (accepted_sum - p_sum - self.prior * offset) / (p_sum - p @ p + self.prior)
        self.offset = float(offset)


@dataclass(frozen=True)
class CopyPlan:
    """What scored copying would draft at a step (ScoredCopyProposer.plan).

    proposal: the one-row draft (empty: none); rate: its expected tokens per unit of step time,
    (1 + expected accepted) / cost(forward), 1 / cost(1) for no draft; judged: the scorer's logits
    of the tokens the calibration will judge, None where nothing is drafted; expected: the drafted
    tokens expected to be accepted."""

    proposal: DraftProposal
    rate: float
    judged: np.ndarray | None
    expected: float = 0.0


class ScoredCopyRows(RowwiseProposer):
    """Scored copying for a server's rows, choosing one width for the batch's forward.

    The batched step's forward is rectangular: every row is verified B x W tokens wide, W the widest
    row's drafts + 1 (engine/step.py), so a row's padding is computed anyway and one row's long guess
    lengthens every row. A row alone weighs (1 + E_d) / cost(1 + d); the rows together choose the W
    with the most expected tokens per unit of the batch's forward cost,

        (B + sum_b E_b(W - 1)) / cost_batch(B x W),

    E_b(d) the most a copy of d tokens of row b is expected to have accepted (best_by_length; a row's
    cap bounds its d), and each row then drafts its best copy of up to W - 1 tokens. The batch's cost
    is measured on its own steps (StepCosts.batch_cost). A seeded sampled row drafts what it would
    alone (its draws must not depend on its neighbours), and the width is at least its forward."""

    def propose(self, contexts: Sequence[ProposeContext], max_ks: Sequence[int]) -> DraftProposal:
        device, batch = contexts[0].token_ids.device, len(contexts)
        offers = [self.rows[b].by_length(ctx, max_k) if max_k >= 1 else None
                  for b, (ctx, max_k) in enumerate(zip(contexts, max_ks))]
        least = max((offer.least_width for offer in offers if offer is not None), default=1)
        cost = self.step_costs.batch_cost()
        width, best = 1, -1.0
        for candidate in range(least, max(max_ks, default=0) + 2):
            gain = batch + sum(offer.expected[min(candidate - 1, len(offer.expected) - 1)]
                               for offer in offers if offer is not None)
            rate = gain / cost(batch * candidate)
            if rate > best:  # ties: the narrower forward
                width, best = candidate, rate
        proposals = []
        for b, offer in enumerate(offers):
            self._proposed[b] = offer is not None
            proposals.append(DraftProposal.empty(1, device) if offer is None else
                             self.rows[b].take(offer.plan(min(width - 1, len(offer.expected) - 1))))
        return pad_proposals(proposals, contexts[0].vocab_size, device)


@dataclass(frozen=True)
class Scored:
    """Every candidate at one step with the scorer's view of it (ScoredCopyProposer._scored).

    cost: the curve this row's choice prices by; fixed: a seeded sampled request, which drafts by
    fixed rules (its own text, the fixed cost curve): which tokens are drafted decides which random
    numbers the verification draws, and earlier requests and measured times change between calls, so
    its seed could not reproduce its answer otherwise. step None: nothing can be copied; else logits
    and hazard per hazard_rows row, and each row's candidate."""

    cost: CostFn
    fixed: bool
    device: torch.device
    step: StepCandidates | None = None
    logits: np.ndarray | None = None
    hazard: np.ndarray | None = None
    candidate_of_row: np.ndarray | None = None


@dataclass(frozen=True)
class LengthOffer:
    """A row's best copy at every draft length d = 0..max_k (ScoredCopyRows): expected[d] accepted
    tokens, plan(d) its CopyPlan; least_width: the forward it needs at least (a seeded row's own)."""

    expected: np.ndarray
    plan: Callable[[int], CopyPlan]
    least_width: int = 1


class ScoredCopyProposer(Proposer):
    """Scored copying as a Proposer (one request at a time).

    >>> proposer = ScoredCopyProposer()                      # the shipped scorer, a corpus of its own
    >>> engine = SpecEngine(target_runner, proposer, tokenizer, k="auto")

    The engine feeds step_costs its one-row verification times; end_request adds the finished
    request's prompt and answer to the corpus (its tenant's, start_tenant).
    """

    sizes_own_drafts = True

    def __init__(self, scorer: LogisticScorer | None = None, corpus: CopyCorpus | TenantCopyCorpora | None = None,
                 step_costs: StepCosts | None = None, depth: int = DEFAULT_DEPTH, most: int = DEFAULT_MOST,
                 calibrate: bool = True, trees: bool = False) -> None:
        """trees: draft a tree of the diverging candidates where the cost curve pays for it
        (copy_candidates.choose_tree) instead of one candidate's chain."""
        self.scorer = scorer or load_scorer()
        self.corpora = corpus if isinstance(corpus, TenantCopyCorpora) else None
        self.corpus = corpus if isinstance(corpus, CopyCorpus) else (
            CopyCorpus() if corpus is None else corpus.for_tenant(None))
        self.step_costs = step_costs or StepCosts()
        self.depth, self.most, self.trees = depth, most, trees
        self.calibration = Calibration() if calibrate else None
        self.reset()

    def start_tenant(self, tenant: str | None) -> None:
        if self.corpora is not None:
            self.corpus = self.corpora.for_tenant(tenant)

    def reset(self) -> None:
        self._tokens = np.zeros(256, np.int64)
        self._length = 0
        self._prompt_len: int | None = None
        if self.calibration is not None:
            self.calibration.reset()

    def end_request(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        self.corpus.add(prompt_ids, output_ids)

    def forget_earlier_requests(self) -> None:
        self.corpus.clear()
        if self.corpora is not None:
            self.corpora.clear()
            self.corpus = self.corpora.for_tenant(None)
        self.reset()

    def propose(self, ctx: ProposeContext, max_k: int) -> DraftProposal:
        return self.take(self.plan(ctx, max_k))

    def _scored(self, ctx: ProposeContext, max_k: int) -> Scored:
        """Every candidate at this step, scored (Scored.step None where nothing can be copied)."""
        self._catch_up(ctx.token_ids)
        fixed = ctx.params.seed is not None and not ctx.params.greedy
        scored = Scored(self.step_costs.prior if fixed else self.step_costs.cost, fixed, ctx.token_ids.device)
        if max_k < 1 or self._length < 2:
            return scored
        context = self._tokens[:self._length]
        earlier, earlier_source = (None, None) if fixed else self.corpus.joined()
        step = step_candidates(self._length - self._prompt_len, context, self._prompt_len, earlier, earlier_source,
                               max_k, self.depth, self.most)
        if step is None:
            return scored
        x, candidate_of_row, _ = hazard_rows(step, max_k)
        logits = self.scorer.logit(x)
        offset = self.calibration.offset if self.calibration is not None else 0.0
        return dataclasses.replace(scored, step=step, logits=logits, hazard=sigmoid(logits + offset),
                                   candidate_of_row=candidate_of_row)

    def by_length(self, ctx: ProposeContext, max_k: int) -> LengthOffer:
        """This row's best copy at every length, for ScoredCopyRows (a seeded row: its own plan at any)."""
        scored = self._scored(ctx, max_k)
        if scored.fixed or scored.step is None:
            plan = self._choose(scored, max_k)
            forward = 1 + int(plan.proposal.num_tokens[0])
            return LengthOffer(np.full(max_k + 1, plan.expected), lambda d: plan, forward)
        expected, candidates = best_by_length(scored.step, scored.hazard, max_k)

        def plan(d: int) -> CopyPlan:
            if d < 1:
                return self._nothing(scored)
            chosen = int(candidates[d])
            return self._chain(scored, chosen, int(min(scored.step.lengths[chosen], d)), float(expected[d]))

        return LengthOffer(expected, plan)

    def plan(self, ctx: ProposeContext, max_k: int) -> CopyPlan:
        """What copying would draft this step and the tokens per unit of step time it expects: the
        choice, not yet made (copy+draft weighs it against the draft model's). Follow it with
        take(plan), or with skip() where another source drafts the step."""
        return self._choose(self._scored(ctx, max_k), max_k)

    def _choose(self, scored: Scored, max_k: int) -> CopyPlan:
        """The candidate and length of the best rate in a step of this row's own (or no draft)."""
        step, cost = scored.step, scored.cost
        if step is None:
            return self._nothing(scored)
        candidate, drafted, in_chain = choose_draft(step, scored.hazard, cost, max_k)
        if not drafted:
            return self._nothing(scored)
        chain = self._chain(scored, candidate, drafted, in_chain)
        if self.trees and self.step_costs.chains_known and not scored.fixed:  # a tree where it beats the chain
            tokens, parents, in_tree = choose_tree(step, scored.hazard, self.step_costs.tree_cost, max_k)
            tree = chain_or_tree(parents) if tokens else None
            tree_rate = (1 + in_tree) / self.step_costs.tree_cost(1 + len(tokens)) if tree is not None else 0.0
            if tree_rate > chain.rate:  # the calibration judges a tree along the best chain, its main path
                return CopyPlan(DraftProposal.of_row(tokens, tree, scored.device), tree_rate, chain.judged, in_tree)
        return chain

    @staticmethod
    def _nothing(scored: Scored) -> CopyPlan:
        return CopyPlan(DraftProposal.empty(1, scored.device), 1.0 / scored.cost(1), None)

    @staticmethod
    def _chain(scored: Scored, candidate: int, drafted: int, expected: float) -> CopyPlan:
        """A point-mass chain, the candidate's first `drafted` tokens expected to bring `expected`
        accepted ones, priced on the row's own cost curve, with the scorer's logits of them (what the
        calibration judges)."""
        chain = scored.step.tokens[candidate, :drafted].tolist()
        judged = scored.logits[scored.candidate_of_row == candidate][:drafted]
        return CopyPlan(DraftProposal.of_row(chain, None, scored.device), (1 + expected) / scored.cost(1 + drafted),
                        judged, expected)

    def take(self, plan: CopyPlan) -> DraftProposal:
        """Draft what plan holds (the calibration then learns from its verification)."""
        if plan.judged is None:
            self.skip()
        elif self.calibration is not None:
            self.calibration.drafted(plan.judged)
        return plan.proposal

    def skip(self) -> None:
        """This step copied nothing (another source drafted it, or nothing did)."""
        if self.calibration is not None:
            self.calibration.idle()

    def on_verified(self, num_accepted: torch.Tensor) -> None:
        if self.calibration is not None:
            self.calibration.verified(int(num_accepted[0]))

    def _catch_up(self, token_ids: torch.Tensor) -> None:
        new = committed_since(self._tokens[:self._length], token_ids)
        if new is None:  # another request
            self.reset()
            new = token_ids[0].tolist()
        if self._prompt_len is None:  # the first look at a request: its prompt and the prefill's token
            self._prompt_len = max(len(new) - 1, 0)
        if self._length + len(new) > len(self._tokens):
            grown = np.zeros(2 * (self._length + len(new)), np.int64)
            grown[:self._length] = self._tokens[:self._length]
            self._tokens = grown
        self._tokens[self._length:self._length + len(new)] = new
        self._length += len(new)


def scored_copy_maker(options: CopyOptions, replay_cost: CostFn | None = None) -> Callable[[], ScoredCopyProposer]:
    """Scored copying's rows: one scorer, one cost curve and one corpus per tenant, shared by the rows.
    replay_cost: the replay's fixed cost curve (Build.replay_cost) in place of measured step times."""
    scorer, corpora = load_scorer(options.scorer), options.new_tenant_corpora()
    costs = options.new_step_costs() if replay_cost is None else StepCosts(replay_cost, measured=False)
    return lambda: ScoredCopyProposer(scorer, corpora, costs, trees=options.trees)


def _build(build: Build) -> Proposer | ScoredCopyRows:
    make = scored_copy_maker(build.option(CopyOptions), build.replay_cost)
    return make() if build.slots == 1 else ScoredCopyRows(make, build.slots)


METHOD_ENTRIES = (
    MethodEntry("copy", "scored copying: every continuation this request and earlier ones offer, each token's "
                "acceptance estimated by a fitted score, the candidate and length with the most tokens per "
                "second under the machine's measured costs; no draft model", _build, options=(CopyOptions,),
                replayable=True, beside_any=True),
)
