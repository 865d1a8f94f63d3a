"""What the batched engine's tests share (test_batch.py, test_batch_prefill.py): prompts, the
tiny pair, and each method's engine alone and batched."""

from __future__ import annotations

from conftest import make_model, make_native
from specdec.engine import SpecEngine
from specdec.engine.batch import BatchEngine
from specdec.proposers import DraftModelProposer, NgramProposer
from specdec.proposers.batched import RowwiseProposer
from specdec.proposers.copy_draft import CopyThenDraftProposer
from specdec.proposers.hybrid import DRAFT_CONTEXT_WINDOW, NgramThenDraftProposer
from specdec.proposers.lookahead import LookaheadProposer
from specdec.proposers.registry import build_proposer
from specdec.proposers.copy_corpus import CopyCorpus
from specdec.proposers.scored_copy import CopyOptions, ScoredCopyProposer
from specdec.proposers.step_costs import StepCosts
from specdec.proposers.suffix import SuffixOptions, SuffixProposer

PROMPTS = ["the quick brown fox", "a", "hello hello hello hello", "abc abc abc, abc abc", "why? because.",
           "one two three four five six seven"]
SLOTS = 3
NO_CACHE = SuffixOptions(cache_requests=0)
DRAFT_FORWARD_COST = 0.3  # copy+draft's fixed price of a draft forward: choices that follow no timing


def tiny_pair():
    """A target and a one-layer draft, tiny and random (conftest.make_model): each test module's
    `models` fixture."""
    return make_model(seed=0, random_bias=True), make_model(seed=1, layers=1, random_bias=True)


def single_engine(models, tokenizer, method, k=3):
    target, draft = make_native(models[0]), make_native(models[1])
    proposer = {"autoregressive": None, "draft": DraftModelProposer(draft), "ngram": NgramProposer(),
                # Trees, as the batched engine drafts them; no cache of earlier outputs, whose contents
                # depend on the order requests finish in (the server's cache: its own test).
                "suffix": SuffixProposer(options=NO_CACHE), "lookahead": LookaheadProposer(),
                # Fixed costs: draft lengths that do not follow the machine's timings, so seeded draws repeat.
                "copy": ScoredCopyProposer(corpus=CopyCorpus(0), step_costs=StepCosts(measured=False)),
                "ngram+draft": NgramThenDraftProposer(NgramProposer(), DraftModelProposer(draft)),
                "copy+draft": None}[method]
    if method == "copy+draft":  # as batched_engine builds it, one row
        costs = StepCosts(measured=False)
        copy = RowwiseProposer(lambda: ScoredCopyProposer(corpus=CopyCorpus(0), step_costs=costs), 1)
        proposer = CopyThenDraftProposer(copy, DraftModelProposer(draft, 0.4, context_window=DRAFT_CONTEXT_WINDOW),
                                         forward_cost=DRAFT_FORWARD_COST, learn_across_requests=False)
    return SpecEngine(target, proposer, tokenizer, k=k)


def batched_engine(models, tokenizer, method, k=3, slots=SLOTS):
    target, draft = make_native(models[0], batch_size=slots), make_native(models[1], batch_size=slots)
    proposer = build_proposer(method, slots=slots, draft_runner=draft, suffix=NO_CACHE,
                              copy=CopyOptions(corpus_tokens=0))
    if method in ("copy", "copy+draft"):
        proposer.step_costs.measured = False  # as single_engine's
    if method == "copy+draft":
        proposer.forward_cost, proposer.learn_across_requests = DRAFT_FORWARD_COST, False
    return BatchEngine(target, proposer, tokenizer, k=k)
