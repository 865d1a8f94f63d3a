"""N-gram matching: the rule (table tests), the index (== brute force), the proposer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.proposers import NgramIndex, NgramProposer, ProposeContext, find_match
from specdec.proposers.ngram import NgramMatch
from specdec.sampling import SamplingParams


def letters(text: str) -> list[int]:
    return [ord(c) for c in text.replace(" ", "")]


def spelled(match: NgramMatch | None) -> str | None:
    return None if match is None else "".join(chr(t) for t in match.token_ids)


def both(text: str, max_k: int, ngram_max: int = 3, ngram_min: int = 1) -> str | None:
    """find_match and NgramIndex.lookup must agree; return the proposal spelled out."""
    tokens = letters(text)
    brute = find_match(tokens, max_k=max_k, ngram_max=ngram_max, ngram_min=ngram_min)
    index = NgramIndex(ngram_max, ngram_min)
    index.extend(tokens)
    assert index.lookup(max_k) == brute
    return spelled(brute)


# context, max_k, ngram_max, ngram_min, expected proposal
TABLE = [
    pytest.param("a b c d", 3, 3, 1, None, id="no match: every token is new"),
    pytest.param("a", 3, 3, 1, None, id="a single token cannot match"),
    pytest.param("a b c d x b c e b c", 2, 3, 1, "eb", id="docstring: two matches, both full, most recent wins"),
    pytest.param("a b c d x b c e b c", 4, 3, 1, "dxbc", id="docstring: the match offering more tokens wins"),
    pytest.param("b x y z a b a b", 5, 3, 1, "ab", id="longest n wins: n=2 offers 2 tokens, n=1 would offer 5"),
    pytest.param("a b c x b c y c", 3, 3, 1, "xbc", id="several n=1 matches: the one offering more tokens"),
    pytest.param("x y z a b x y", 2, 3, 1, "za", id="n=2 match, n=3 absent"),
    pytest.param("a b z a b", 9, 3, 1, "zab", id="k longer than what follows: proposal is cut short"),
    pytest.param("q a a", 4, 3, 1, "a", id="match at the very end: continuation is the suffix token itself"),
    pytest.param("a a a a", 5, 3, 1, "a", id="overlapping run: n=3 matches at 0-2, one token follows"),
    pytest.param("a b c a b", 3, 3, 3, None, id="only n=2 matches but ngram_min=3"),
    pytest.param("a b", 3, 3, 2, None, id="context too short for ngram_min"),
    pytest.param("c d a b c d", 4, 1, 1, "abcd", id="ngram_max=1: unigram lookup"),
]


@pytest.mark.parametrize("context, max_k, ngram_max, ngram_min, expected", TABLE)
def test_matching_rule_table(context, max_k, ngram_max, ngram_min, expected):
    assert both(context, max_k, ngram_max, ngram_min) == expected


def test_never_proposes_the_trivial_self_match():
    # "a b" occurs only at the end: no earlier occurrence, so n=2 must not match;
    # n=1 "b" also occurs only at the end; nothing to propose.
    assert both("x a b", 3) is None


def test_zero_max_k_proposes_nothing():
    assert find_match(letters("a b a b"), max_k=0) is None


def test_random_tie_break_uses_the_generator_and_only_full_length_ties():
    tokens = letters("a x a y a z a w a")  # "a" followed by x, y, z, w; each offers 2+ tokens
    seen = set()
    for seed in range(40):
        match = find_match(tokens, max_k=2, tie_break="random", generator=torch.Generator().manual_seed(seed))
        seen.add(spelled(match))
        index = NgramIndex(3, 1)
        index.extend(tokens)
        again = index.lookup(2, "random", torch.Generator().manual_seed(seed))
        assert again == match
    assert seen == {"xa", "ya", "za", "wa"}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(ngram_max=0), "ngram_max"),
        (dict(ngram_min=0), "ngram_min"),
        (dict(ngram_max=2, ngram_min=3), "exceed"),
        (dict(tie_break="oldest"), "tie_break"),
        (dict(ngram_max=2.5), "ngram_max"),
    ],
)
def test_bad_ngram_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NgramProposer(**kwargs)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=120),
    cuts=st.lists(st.integers(1, 15), min_size=1, max_size=30),
    ngram_min=st.integers(1, 3),
    extra=st.integers(0, 2),
    max_k=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_index_equals_brute_force_on_random_streams(tokens, cuts, ngram_min, extra, max_k, seed):
    """Fed in random chunks, the index answers exactly like a full rescan after every chunk."""
    ngram_max = ngram_min + extra
    index = NgramIndex(ngram_max, ngram_min)
    done = 0
    chunks = iter(cuts * (len(tokens) // len(cuts) + 1))
    while done < len(tokens):
        step = next(chunks)
        index.extend(tokens[done : done + step])
        done = min(done + step, len(tokens))
        prefix = tokens[:done]
        assert index.tokens == prefix
        for tie_break in ("recent", "random"):
            expected = find_match(prefix, max_k=max_k, ngram_max=ngram_max, ngram_min=ngram_min,
                                  tie_break=tie_break, generator=torch.Generator().manual_seed(seed))
            got = index.lookup(max_k, tie_break, torch.Generator().manual_seed(seed))
            assert got == expected


def context(tokens: list[int]) -> ProposeContext:
    return ProposeContext(torch.tensor([tokens]), SamplingParams(), None, vocab_size=128)


def test_proposer_drafts_a_point_mass_and_indexes_only_committed_tokens():
    proposer = NgramProposer(ngram_max=2, ngram_min=1)
    tokens = letters("a b c d a b")
    proposal = proposer.propose(context(tokens), max_k=3)
    assert proposal.token_ids.tolist() == [letters("cda")] and proposal.num_tokens.tolist() == [3]
    assert proposal.probs is None
    proposer.on_verified(torch.tensor([1]))  # "c" accepted, then the target said "x"
    committed = tokens + letters("c x")
    proposal = proposer.propose(context(committed), max_k=3)
    assert proposer.index.tokens == committed  # never the rejected "d a"
    assert proposal.num_tokens.tolist() == [0]  # "x" is new: no draft, a plain step


def test_proposer_restarts_its_index_for_a_new_context():
    proposer = NgramProposer()
    proposer.propose(context(letters("a b c a b")), max_k=2)
    proposal = proposer.propose(context(letters("x y z x y q r")), max_k=2)  # same length, other tokens
    assert proposer.index.tokens == letters("x y z x y q r")
    assert proposal.num_tokens.tolist() == [0]
    proposal = proposer.propose(context(letters("x y x")), max_k=2)  # shorter: new request
    assert proposer.index.tokens == letters("x y x") and proposal.token_ids.tolist() == [letters("yx")]
