"""Prompt caching across requests (SpecEngine.reuse_prefix): a prompt that starts like the last
request's prompt and answer prefills only the rest, and every output is what a fresh prefill
gives, greedy and seeded, plain and speculative."""

from __future__ import annotations

import pytest

from conftest import make_model, make_native
from specdec.engine import SpecEngine
from specdec.models.hf import HFRunner
from specdec.proposers import NgramProposer
from specdec.sampling import SamplingParams

SYSTEM = "you are terse. answer in one line.\n"
QUESTIONS = ["abc abc abc, what next?", "abc abc abc, and then?", "why? because."]


@pytest.fixture(scope="module")
def model():
    return make_model(seed=5, random_bias=True)


def _engine(model, tokenizer, method, reuse, runner=None):
    proposer = NgramProposer() if method == "ngram" else None
    return SpecEngine(runner or make_native(model), proposer, tokenizer, k=4, eos_token_ids=frozenset(),
                      reuse_prefix=reuse)


@pytest.mark.parametrize("method", ["plain", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_reused_prefixes_give_what_a_fresh_prefill_gives(model, tokenizer, method, temperature):
    reusing, fresh = _engine(model, tokenizer, method, True), _engine(model, tokenizer, method, False)
    assert reusing.reuse_prefix and not fresh.reuse_prefix
    history: list[int] = []
    prompts = [SYSTEM + question for question in QUESTIONS]
    reused = []
    for turn, prompt in enumerate(prompts + [None]):
        if prompt is None:  # a second turn: the conversation so far, answer included, then more
            prompt = history + tokenizer.encode("\nand now?")
        params = SamplingParams(temperature=temperature, seed=turn)
        got = reusing.generate(prompt, params, max_new_tokens=25)
        expected = fresh.generate(prompt, params, max_new_tokens=25)
        assert got.token_ids == expected.token_ids, f"turn {turn}"
        reused.append(got.stats.prompt_tokens_reused)
        assert expected.stats.prompt_tokens_reused == 0
        history = got.prompt_token_ids + got.token_ids
    assert reused[0] == 0
    assert all(count >= len(SYSTEM) for count in reused[1:3])  # the shared system prompt, at least
    assert reused[3] > len(prompts[2])  # the whole last prompt and some of its answer


def test_a_runner_used_by_another_engine_in_between_is_prefilled_afresh(model, tokenizer):
    runner = make_native(model)
    first, other = _engine(model, tokenizer, "ngram", True, runner), _engine(model, tokenizer, "plain", True, runner)
    fresh = _engine(model, tokenizer, "ngram", False)
    params = SamplingParams(temperature=0)
    first.generate(SYSTEM + QUESTIONS[0], params, max_new_tokens=20)
    other.generate("zzz zzz zzz zzz zzz zzz zzz zzz zzz zzz zzz zzz zzz zzz zzz zzz zzz zzz zzz zzz zzz zzz"
                   "zzz zzz zzz zzz zzz zzz zzz", params, max_new_tokens=20)
    got = first.generate(SYSTEM + QUESTIONS[1], params, max_new_tokens=20)
    assert got.stats.prompt_tokens_reused == 0
    assert got.token_ids == fresh.generate(SYSTEM + QUESTIONS[1], params, max_new_tokens=20).token_ids


def test_the_same_prompt_again_reads_nothing_new(model, tokenizer):
    engine = _engine(model, tokenizer, "plain", True)
    params = SamplingParams(temperature=0)
    once = engine.generate(SYSTEM + QUESTIONS[0], params, max_new_tokens=10)
    again = engine.generate(SYSTEM + QUESTIONS[0], params, max_new_tokens=10)
    assert again.token_ids == once.token_ids
    assert again.stats.prompt_tokens_reused == again.stats.prompt_tokens - 1


def test_forgetting_earlier_requests_drops_the_cached_prompt(model, tokenizer):
    engine = _engine(model, tokenizer, "plain", True)
    params = SamplingParams(temperature=0)
    engine.generate(SYSTEM + QUESTIONS[0], params, max_new_tokens=10)
    engine.forget_earlier_requests()  # the bench's requests alone
    assert engine.generate(SYSTEM + QUESTIONS[1], params, max_new_tokens=10).stats.prompt_tokens_reused == 0


def test_no_reuse_where_it_is_not_exact_or_a_head_needs_every_feature(model, tokenizer):
    assert not SpecEngine(HFRunner(model), None, tokenizer).reuse_prefix  # transformers: no chunking invariance

    class ReadsFeatures(NgramProposer):
        reads_target_hidden = True
        target_layers = ()

    assert not SpecEngine(make_native(model), ReadsFeatures(), tokenizer).reuse_prefix
    safe = make_native(model)
    safe.one_token_per_call = True  # the invariance probe failed here
    assert not SpecEngine(safe, None, tokenizer).reuse_prefix
