"""copy+draft: each step drafted by scored copying or the draft model, whichever expects more tokens
per unit of step time; greedy output stays plain output whatever is chosen."""

from __future__ import annotations

import pytest
import torch

from conftest import make_model
from specdec.engine import SpecEngine
from specdec.models.hf import HFRunner
from specdec.proposers.base import ProposeContext
from specdec.proposers.batched import RowwiseProposer
from specdec.proposers.copy_draft import CopyThenDraftProposer, DraftRecord
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.hybrid import DRAFT_CONTEXT_WINDOW
from specdec.proposers.registry import build_proposer
from specdec.proposers.copy_corpus import CopyCorpus
from specdec.proposers.scored_copy import ScoredCopyProposer
from specdec.proposers.step_costs import StepCosts
from specdec.proposers.stop_rules import ConfidenceStop
from specdec.sampling import SamplingParams

REPETITIVE = "the cat sat on the mat. the cat sat on the"
FREE = "abcdefgh ijk"


def copy_then_draft(draft_model, forward_cost: float | None) -> CopyThenDraftProposer:
    costs = StepCosts(measured=False)
    copy = RowwiseProposer(lambda: ScoredCopyProposer(corpus=CopyCorpus(0), step_costs=costs), 1)
    draft = DraftModelProposer(HFRunner(draft_model), 0.4, context_window=DRAFT_CONTEXT_WINDOW)
    return CopyThenDraftProposer(copy, draft, forward_cost=forward_cost)


@pytest.mark.parametrize("prompt", [REPETITIVE, FREE])
def test_greedy_output_is_plain_output(target_runner, tokenizer, prompt):
    plain = SpecEngine(target_runner, None, tokenizer).generate(prompt, max_new_tokens=60)
    proposer = copy_then_draft(make_model(seed=1, layers=1), forward_cost=None)
    out = SpecEngine(target_runner, proposer, tokenizer, k=6).generate(prompt, max_new_tokens=60)
    assert out.token_ids == plain.token_ids
    assert proposer.steps_by_draft > 0  # the first step where copying offers nothing probes the draft model
    committed = len(out.prompt_token_ids) + len(out.token_ids)
    assert proposer.draft.runner.seq_len < committed  # the draft's cache never holds an uncommitted token


def test_a_draft_that_guesses_well_and_cheaply_drafts_most_steps(target_runner, tokenizer):
    """The target drafting for itself is always right: at a tenth of a step per forward it wins
    every step where copying offers less."""
    proposer = copy_then_draft(make_model(seed=0), forward_cost=0.1)
    plain = SpecEngine(target_runner, None, tokenizer).generate(FREE, max_new_tokens=60)
    out = SpecEngine(target_runner, proposer, tokenizer, k=4).generate(FREE, max_new_tokens=60)
    assert out.token_ids == plain.token_ids
    assert proposer.steps_by_draft > proposer.draft_probes  # chosen on its measured rate, not only probed
    assert out.stats.target_forwards <= 20


def test_a_draft_that_loses_is_only_probed_ever_more_rarely(target_runner, tokenizer):
    """Another random model guesses badly, and a forward priced as a whole step never pays: each
    probe (a cold step, then a warm one to measure) is followed by a wait twice the last."""
    proposer = copy_then_draft(make_model(seed=7, layers=1), forward_cost=1.0)
    out = SpecEngine(target_runner, proposer, tokenizer, k=4).generate(FREE, max_new_tokens=120)
    assert len(out.token_ids) >= 60  # (the tiny target's EOS is rare)
    assert 1 <= proposer.draft_probes <= 4  # waits of 8, 16, 32, 64 steps after the first tries
    assert proposer.steps_by_draft <= 2 * proposer.draft_probes + 2
    assert proposer._rows[0].probe_after > 8


def test_a_draft_far_behind_reads_a_fresh_window_and_drafts_at_once(tokenizer):
    """After many copied steps the draft model would read its backlog a chunk per step, drafting
    nothing; copy+draft starts its row afresh on the last window instead."""
    proposer = copy_then_draft(make_model(seed=1, layers=1), forward_cost=0.01)
    winning = DraftRecord(accepted=3.0, drafted=3.0, seconds=0.0, steps=1)
    proposer._rows[0].warm = proposer._rows[0].cold = winning  # the draft model wins every step

    def propose(length: int):
        ids = torch.randint(0, tokenizer.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        ctx = ProposeContext(ids, SamplingParams(temperature=0), None, 64)
        return proposer.propose([ctx], [3])

    first = propose(100)
    assert proposer._by_draft == [True] and int(first.num_tokens[0]) >= 1
    proposer.on_verified(torch.tensor([0]))
    second = propose(100 + 2 * DRAFT_CONTEXT_WINDOW)  # far behind: more than a chunk unread
    assert proposer._by_draft == [True] and int(second.num_tokens[0]) >= 1
    assert proposer.draft.runner.seq_len <= DRAFT_CONTEXT_WINDOW + 3


def test_the_rate_prices_the_draft_models_forwards():
    record = DraftRecord()
    costs = StepCosts(measured=False)
    assert record.rate(costs, 0.1) is None  # never measured
    record.add(accepted=2, drafted=3, seconds=0.0)
    assert record.rate(costs, 0.1) == pytest.approx(3 / (costs.cost(4) + 0.3))
    assert record.rate(costs) is None  # no 1-token step timed yet to price measured seconds by
    costs.record(1, 0.02)
    record.add(accepted=2, drafted=3, seconds=0.01)
    assert record.rate(costs) == pytest.approx(3 / (costs.cost(4) + record.seconds / 0.02))


def test_the_registry_builds_it_only_with_a_draft_model():
    with pytest.raises(ValueError, match="needs a draft model"):
        build_proposer("copy+draft")
    proposer = build_proposer("copy+draft", draft_runner=HFRunner(make_model(seed=1, layers=1)))
    assert isinstance(proposer, CopyThenDraftProposer) and proposer.sizes_own_drafts
    assert proposer.draft.stop_rule == ConfidenceStop(0.4)  # it sizes its own steps, whatever k
