"""The engine with n-gram drafts: greedy equality, no-match steps, the ngram+draft hybrid."""

from __future__ import annotations

import pytest

from conftest import make_model
from specdec.engine import SpecEngine
from specdec.models.hf import HFRunner
from specdec.proposers import DraftModelProposer, NgramProposer, NgramThenDraftProposer
from specdec.proposers.ngram import NgramOptions
from specdec.proposers.registry import build_proposer

# Repetitive text: its own continuation is partly a copy, so lookups find matches.
PROMPT = "the cat sat on the mat. the cat sat on the"


class ForwardLog:
    """A real runner that also records how many tokens each forward was given."""

    def __init__(self, runner: HFRunner) -> None:
        self.runner = runner
        self.widths: list[int] = []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def forward(self, token_ids, positions, **kwargs):
        self.widths.append(token_ids.shape[1])
        return self.runner.forward(token_ids, positions, **kwargs)


@pytest.fixture
def reference(target_runner, tokenizer):
    return SpecEngine(target_runner, None, tokenizer).generate(PROMPT, max_new_tokens=60)


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("ngram_max, ngram_min", [(3, 1), (4, 2), (1, 1)])
def test_ngram_matches_plain_greedy(target_runner, tokenizer, reference, k, ngram_max, ngram_min):
    engine = SpecEngine(target_runner, NgramProposer(ngram_max, ngram_min), tokenizer, k=k)
    out = engine.generate(PROMPT, max_new_tokens=60)
    assert out.token_ids == reference.token_ids and out.text == reference.text
    assert out.stats.drafted_tokens > 0


def test_ngram_copies_a_repetitive_continuation(target_runner, tokenizer):
    """The tiny target falls into a loop; once it does, every draft is a copy and is accepted."""
    plain = SpecEngine(target_runner, None, tokenizer).generate(PROMPT, max_new_tokens=120)
    out = SpecEngine(target_runner, NgramProposer(), tokenizer, k=6).generate(PROMPT, max_new_tokens=120)
    assert out.token_ids == plain.token_ids
    assert out.stats.accepted_tokens > 0
    assert out.stats.target_forwards < 120


def test_a_step_without_a_match_is_a_plain_decode_step(tokenizer):
    """No match: the target forward sees exactly one token, as in plain decoding."""
    target = ForwardLog(HFRunner(make_model(seed=0)))
    proposer = NgramProposer(ngram_max=3, ngram_min=3)  # strict: most steps find nothing
    out = SpecEngine(target, proposer, tokenizer, k=5).generate("abcdefgh", max_new_tokens=40)
    decode_widths = target.widths[1:]  # the first forward is the prefill
    assert len(decode_widths) == out.stats.target_forwards
    assert 1 in decode_widths and any(w > 1 for w in decode_widths)  # both kinds of step happened
    assert sum(w - 1 for w in decode_widths) == out.stats.drafted_tokens


def test_hybrid_matches_plain_greedy_and_uses_both_proposers(target_runner, tokenizer, reference):
    draft = HFRunner(make_model(seed=1, layers=1))
    hybrid = NgramThenDraftProposer(NgramProposer(3, 3), DraftModelProposer(draft), draft_max_k=2)
    out = SpecEngine(target_runner, hybrid, tokenizer, k=6).generate(PROMPT, max_new_tokens=60)
    assert out.token_ids == reference.token_ids
    assert hybrid.steps_by_ngram > 0 and hybrid.steps_by_draft > 0
    committed = len(out.prompt_token_ids) + len(out.token_ids)
    assert draft.seq_len < committed  # the draft's cache never holds an uncommitted token


@pytest.mark.parametrize("method", ["ngram", "ngram+draft"])
def test_registry_builds_ngram_methods(method, draft_runner):
    proposer = build_proposer(method, draft_runner=draft_runner, ngram=NgramOptions(4, 2))
    assert proposer is not None and hasattr(proposer, "propose")


def test_registry_rejects_bad_ngram_options(draft_runner):
    with pytest.raises(ValueError, match="ngram_min"):
        build_proposer("ngram", ngram=NgramOptions(2, 3))
    with pytest.raises(ValueError, match="draft model"):
        build_proposer("ngram+draft")
    with pytest.raises(ValueError, match="draft_k"):
        build_proposer("ngram+draft", draft_runner=draft_runner, draft_k=0)
