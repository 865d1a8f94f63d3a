"""Suffix decoding: the tries (== brute-force substring counts), the cursor (== a walk from the
root), the cache's bound and eviction, the draft tree on a worked example, and the proposer
(lossless, learns across requests)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_native, make_peaked_model
from specdec.analysis.lossless import distribution_tests
from specdec.engine import SpecEngine
from specdec.proposers.base import ProposeContext
from specdec.proposers.registry import build_proposer
from specdec.proposers.suffix import SuffixCache, SuffixOptions, SuffixProposer, SuffixTrie, _Cursor, speculate
from specdec.sampling import SamplingParams


def substring_counts(texts: list[list[int]], max_depth: int) -> Counter:
    counts = Counter()
    for text in texts:
        for start in range(len(text)):
            for end in range(start + 1, min(start + max_depth, len(text)) + 1):
                counts[tuple(text[start:end])] += 1
    return counts


def trie_counts(trie: SuffixTrie) -> Counter:
    counts = Counter(trie.counts())
    assert all(count > 0 for count in counts.values())  # nodes that reach 0 are unlinked
    return counts


def holding(texts: list[list[int]], max_depth: int) -> SuffixTrie:
    trie = SuffixTrie(max_depth)
    for text in texts:
        trie.add(text)
    return trie


texts = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=30), min_size=1, max_size=4)


@given(texts, st.integers(2, 6))
@settings(max_examples=60, deadline=None)
def test_tries_count_every_substring_up_to_max_depth(texts, max_depth):
    added = holding(texts, max_depth)
    built = added.node_count()  # before counts() builds every implicit chain
    assert trie_counts(added) == substring_counts(texts, max_depth)
    assert built <= added.node_count() == len(trie_counts(added)) + 1
    grown = SuffixTrie(max_depth)  # one growing text, in pieces
    joined = [token for text in texts for token in text]
    for text in texts:
        grown.extend(text)
    assert trie_counts(grown) == substring_counts([joined], max_depth)


@given(texts, st.integers(2, 6))
@settings(max_examples=60, deadline=None)
def test_removing_a_text_leaves_the_others_counts(texts, max_depth):
    trie = holding(texts, max_depth)
    trie.remove(texts[0])
    assert trie_counts(trie) == substring_counts(texts[1:], max_depth)
    assert trie.node_count() == len(trie_counts(trie)) + 1


@given(st.lists(st.integers(0, 3), max_size=30), st.lists(st.integers(0, 3), min_size=1, max_size=40),
       st.integers(2, 6))
@settings(max_examples=60, deadline=None)
def test_cursors_hold_the_node_of_every_suffix_that_occurs(history, context, max_depth):
    trie = SuffixTrie(max_depth)
    trie.add(history)
    cursor = _Cursor(trie)
    local = SuffixTrie(max_depth)
    for token in context:
        cursor.extend([token])
        local.extend([token])
    lengths = range(min(len(context), max_depth - 1) + 1)
    expected = [(m, trie.find(context[len(context) - m:]) if m else trie.root) for m in lengths]
    assert cursor.matches == [(m, node) for m, node in expected if node is not None]
    assert local._open == [local.find(context[len(context) - m:]) if m else local.root for m in lengths]


def test_the_cache_keeps_the_last_requests_only():
    cache = SuffixCache(max_requests=2, max_depth=4)
    for output in ([1, 2, 3], [4, 5], [6, 7, 8]):
        cache.add(output)
    assert len(cache) == 2 and list(cache.outputs) == [[4, 5], [6, 7, 8]]
    assert trie_counts(cache.trie) == substring_counts([[4, 5], [6, 7, 8]], 4)
    empty = SuffixCache(max_requests=0)
    empty.add([1, 2])
    assert len(empty) == 0 and not empty.trie.root.children


def test_the_draft_tree_is_best_first_by_frequency():
    """History "a b c a b c a b d a b": after "a b", c followed 2 times of 3 and d once.
        root(after "a b") ─┬─ c (2/3) ── a (2/3) ── b (2/3)
                           └─ d (1/3) ── a (1/3)
    With 4 nodes: c .67, a .67, b .67, then d .33 (ties in probability: the earlier pushed)."""
    a, b, c, d = 1, 2, 3, 4
    trie = SuffixTrie(max_depth=8)
    trie.add([a, b, c, a, b, c, a, b, d, a, b])
    node = trie.find([a, b])
    draft = speculate(node, match_len=2, max_tokens=4, min_token_prob=0.1)
    assert draft.token_ids == [c, a, b, d]
    assert draft.parents == [-1, 0, 1, -1]
    assert draft.probs == pytest.approx([2 / 3, 2 / 3, 2 / 3, 1 / 3])
    # A minimum probability above 1/3 drops d; a budget of 2 stops after "c a".
    assert speculate(node, 2, 8, 0.5).token_ids[:3] == [c, a, b] and d not in speculate(node, 2, 8, 0.5).token_ids
    assert speculate(node, 2, 2, 0.1).token_ids == [c, a]


def _ctx(tokens: list[int]) -> ProposeContext:
    return ProposeContext(torch.tensor([tokens]), SamplingParams(temperature=0), None, 64)


def test_the_proposer_drafts_from_earlier_requests_and_follows_the_match_length():
    cache = SuffixCache(max_requests=4, max_depth=8)
    proposer = SuffixProposer(cache, SuffixOptions(max_depth=8, spec_factor=1.0))
    assert proposer.propose(_ctx([9, 10, 11]), 8).num_tokens.item() == 0  # nothing seen yet
    proposer.end_request([9], [20, 21, 22, 23, 24, 25])
    proposer.reset()
    short = proposer.propose(_ctx([9, 10, 20]), 8)  # "20" matched: 1 token earns 1 draft
    assert short.token_ids.tolist() == [[21]] and short.tree() is None
    proposer.reset()
    longer = proposer.propose(_ctx([9, 20, 21, 22]), 8)  # "20 21 22" matched: 3 drafts
    assert longer.token_ids.tolist() == [[23, 24, 25]]
    assert proposer.propose(_ctx([9, 20, 21, 22]), 2).token_ids.tolist() == [[23, 24]]  # capped by k


def test_competing_continuations_make_a_tree_and_chains_when_batched():
    cache = SuffixCache(max_requests=4, max_depth=8)
    for output in ([5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 9, 9]):
        cache.add(output)
    tree = SuffixProposer(cache, SuffixOptions(max_depth=8, spec_factor=2.0)).propose(_ctx([1, 5, 6]), 8)
    assert tree.token_ids.tolist() == [[7, 8, 9, 9]] and tree.tree() == (-1, 0, -1, 2)
    chain = SuffixProposer(cache, SuffixOptions(max_depth=8, spec_factor=2.0), trees=False).propose(_ctx([1, 5, 6]), 8)
    assert chain.token_ids.tolist() == [[7, 8]] and chain.tree() is None


@pytest.mark.parametrize("options", [dict(cache_requests=-1), dict(max_depth=1), dict(spec_factor=0),
                                     dict(min_token_prob=1.5)])
def test_bad_options_are_clear_errors(options):
    with pytest.raises(ValueError, match="suffix"):
        SuffixOptions(**options)


@pytest.fixture(scope="module")
def target():
    return make_native(make_peaked_model(seed=3))


PROMPTS = ["abc abc abc abc", "the cat the cat the", "xyz xy", "hello hello hello"]


@pytest.mark.parametrize("trees", [True, False], ids=["tree", "chain"])
def test_greedy_with_suffix_is_plain_greedy_and_learns_across_requests(target, tokenizer, trees):
    spec = SpecEngine(target, SuffixProposer(SuffixCache(16), trees=trees), tokenizer, k=6)
    plain = SpecEngine(target, None, tokenizer)
    params, accepted = SamplingParams(temperature=0), []
    for _ in range(2):  # the second round drafts from the first round's outputs
        round_accepted = 0
        for prompt in PROMPTS:
            result = spec.generate(prompt, params, max_new_tokens=30)
            assert result.token_ids == plain.generate(prompt, params, max_new_tokens=30).token_ids
            round_accepted += result.stats.accepted_tokens
        accepted.append(round_accepted)
    assert accepted[1] > accepted[0] > 0


@pytest.mark.parametrize("trees", [True, False], ids=["tree", "chain"])
def test_sampling_with_suffix_keeps_the_target_distribution(target, tokenizer, trees):
    params = SamplingParams(temperature=0.9)
    cache = SuffixCache(8)
    # Long drafts from short matches and a low floor: about a third of the drafts are trees.
    options = SuffixOptions(spec_factor=4, min_token_prob=0.05)
    spec = SpecEngine(target, SuffixProposer(cache, options, trees=trees), tokenizer, k=4)
    plain = SpecEngine(target, None, tokenizer)
    for seed in range(12):  # the target's own samples of this prompt: competing continuations, so siblings
        cache.add(plain.generate(PROMPTS[1], replace(params, seed=seed), max_new_tokens=12).token_ids)
    spec_draws = list(spec.sample_continuations(PROMPTS[1], params, 1000, min_tokens=3))
    plain_draws = list(plain.sample_continuations(PROMPTS[1], params, 1000, min_tokens=3, seed=10_000))
    tests = distribution_tests(spec_draws, plain_draws)
    assert all(t.dof >= 3 for t in tests)
    assert min(t.p_value for t in tests) > 1e-4, tests


def test_the_registry_builds_suffix():
    proposer = build_proposer("suffix", suffix=SuffixOptions(cache_requests=3, max_depth=5))
    assert isinstance(proposer, SuffixProposer) and proposer.cache.max_requests == 3
