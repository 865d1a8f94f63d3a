"""Lookahead decoding: the window's mask on a hand-worked example, the candidate tree, the
Jacobi window filling and sliding, greedy equality and losslessness on a tiny target."""

from __future__ import annotations

import pytest
import torch

from conftest import make_native, make_peaked_model
from specdec.analysis.lossless import distribution_tests
from specdec.engine import SpecEngine
from specdec.proposers.lookahead import LookaheadOptions, LookaheadProposer, lookahead_mask, merge_ngrams
from specdec.proposers.registry import build_proposer
from specdec.sampling import SamplingParams


def test_the_window_mask_matches_a_hand_worked_example():
    """W = 3, 2 levels: a0 a1 a2 at offsets 1 2 3, b0 b1 b2 at 2 3 4 (docstring)."""
    offsets, mask = lookahead_mask(3, 2)
    assert offsets == [1, 2, 3, 2, 3, 4]
    a0, a1, a2, b0, b1, b2 = range(6)
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for row, seen in {a0: [a0], a1: [a0, a1], a2: [a0, a1, a2],
                      b0: [a0, b0], b1: [a0, a1, b1], b2: [a0, a1, a2, b2]}.items():
        expected[row, seen] = True
    assert torch.equal(mask, expected)
    # Each token's visible tokens form a contiguous text ending at its own offset.
    for row in range(6):
        seen = sorted(offsets[col] for col in range(6) if mask[row, col])
        assert seen == list(range(1, offsets[row] + 1))


def test_candidates_merge_into_a_tree_with_shared_prefixes_once():
    tokens, parents = merge_ngrams([(5, 6), (5, 7), (8, 9)])
    assert tokens == [5, 6, 7, 8, 9] and parents == [-1, 0, 0, -1, 3]


@pytest.fixture(scope="module")
def target():
    return make_native(make_peaked_model(seed=3))


PROMPTS = ["abc abc abc abc", "the cat the cat the", "xyz xy", "hello hello hello"]


def test_the_window_fills_then_slides_and_collects_ngrams(target, tokenizer):
    proposer = LookaheadProposer(LookaheadOptions(window=3, ngram=3, guesses=2))
    engine = SpecEngine(target, proposer, tokenizer, k=4)
    engine.generate(PROMPTS[0], SamplingParams(temperature=0), max_new_tokens=3)  # the first step is plain
    assert len(proposer.levels) == 2 and all(len(level) == 3 for level in proposer.levels)
    engine.generate(PROMPTS[0], SamplingParams(temperature=0), max_new_tokens=12)
    assert len(proposer.levels) == 2  # full (N-1 levels): each step collects W n-grams and slides
    assert proposer.pool and all(len(ngram) == 2 for ngrams in proposer.pool.values() for ngram in ngrams)


@pytest.mark.parametrize("options", [LookaheadOptions(), LookaheadOptions(window=5, ngram=4, guesses=4)],
                         ids=["default", "wide"])
def test_greedy_with_lookahead_is_plain_greedy(target, tokenizer, options):
    spec = SpecEngine(target, LookaheadProposer(options), tokenizer, k=4)
    plain = SpecEngine(target, None, tokenizer)
    params, accepted = SamplingParams(temperature=0), 0
    for prompt in PROMPTS:
        result = spec.generate(prompt, params, max_new_tokens=40)
        assert result.token_ids == plain.generate(prompt, params, max_new_tokens=40).token_ids
        accepted += result.stats.accepted_tokens
    assert accepted > 10  # the target's own guesses were really used


@pytest.mark.parametrize("seed,context,prompt,options,k", [
    (3, 40, PROMPTS[0], LookaheadOptions(), 4),  # the window would pass the context's end
    (0, 37, PROMPTS[3], LookaheadOptions(window=4, ngram=4, guesses=5), 6),  # the pool's tree would (more nodes than k)
], ids=["window", "tree"])
def test_lookahead_runs_to_the_end_of_the_context(tokenizer, seed, context, prompt, options, k):
    """Near the context's end neither the window nor a wide tree of pool n-grams may fit the cache: the
    window stays out and the tree keeps the nodes that fit (both used to raise 'do not fit the model's
    context'); the output is plain greedy's to the last token."""
    model, params = make_peaked_model(seed=seed), SamplingParams(temperature=0)
    spec = SpecEngine(make_native(model, max_context=context), LookaheadProposer(options), tokenizer, k=k,
                      eos_token_ids=frozenset())
    plain = SpecEngine(make_native(model, max_context=context), None, tokenizer, eos_token_ids=frozenset())
    result = spec.generate(prompt, params, max_new_tokens=100)
    assert result.finish_reason == "length" and len(result.prompt_token_ids) + len(result.token_ids) == context
    assert result.token_ids == plain.generate(prompt, params, max_new_tokens=100).token_ids


def test_sampling_with_lookahead_keeps_the_target_distribution(target, tokenizer):
    params = SamplingParams(temperature=0.9)
    spec = SpecEngine(target, LookaheadProposer(LookaheadOptions(window=4, ngram=3, guesses=4)), tokenizer, k=3)
    plain = SpecEngine(target, None, tokenizer)
    spec_draws = list(spec.sample_continuations(PROMPTS[1], params, 1000, min_tokens=3))
    plain_draws = list(plain.sample_continuations(PROMPTS[1], params, 1000, min_tokens=3, seed=10_000))
    tests = distribution_tests(spec_draws, plain_draws)
    assert all(t.dof >= 3 for t in tests)
    assert min(t.p_value for t in tests) > 1e-4, tests


@pytest.mark.parametrize("options", [dict(window=0), dict(ngram=1), dict(guesses=0)])
def test_bad_options_are_clear_errors(options):
    with pytest.raises(ValueError, match="lookahead"):
        LookaheadOptions(**options)


def test_the_registry_builds_lookahead():
    proposer = build_proposer("lookahead", lookahead=LookaheadOptions(window=2))
    assert isinstance(proposer, LookaheadProposer) and proposer.options.window == 2
