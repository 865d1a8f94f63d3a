"""Each request's own method and k in one batch (engine/request.py's Speculation, proposers/per_request.py):
whatever its neighbours use, a request's output is the one it gets alone."""

from __future__ import annotations

import pytest

from conftest import make_native, run_all
from specdec.config import SpecConfig
from specdec.engine import SpecEngine
from specdec.engine.batch import BatchEngine
from specdec.engine.request import Speculation
from specdec.factory import batch_proposer_for
from specdec.proposers.scored_copy import CopyOptions
from specdec.sampling import SamplingParams

from batching import NO_CACHE, PROMPTS, single_engine, tiny_pair

SLOTS = 4
OTHERS = ("autoregressive", "ngram", "suffix", "copy")


@pytest.fixture(scope="module")
def models():
    return tiny_pair()


def mixed_engine(models, tokenizer, method="draft", k: int | str = 3, others=OTHERS):
    target, draft = make_native(models[0], batch_size=SLOTS), make_native(models[1], batch_size=SLOTS)
    config = SpecConfig(method=method, k=k, options=(NO_CACHE, CopyOptions(corpus_tokens=0)))
    proposer = batch_proposer_for(config, slots=SLOTS, draft_runner=draft, request_methods=(method, *others))
    return BatchEngine(target, proposer, tokenizer, k=k)


ASKED = [Speculation("ngram", 2), Speculation(), Speculation("copy"), Speculation("autoregressive"),
         Speculation(None, 0), Speculation("suffix", "auto"), Speculation("draft", 5), Speculation("ngram", "auto")]


@pytest.mark.parametrize("k", [3, "auto"])
def test_greedy_rows_of_every_method_equal_plain_decoding(models, tokenizer, k):
    """Eight requests over four rows: rows change method as requests finish and the batch is packed."""
    engine = mixed_engine(models, tokenizer, k=k)
    plain = SpecEngine(make_native(models[0]), None, tokenizer)
    params = SamplingParams(temperature=0)
    lengths = [30, 7, 25, 40, 12, 33, 18, 22]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(ASKED))]
    requests = {i: engine.make_request(prompt, params, max_new_tokens=n, speculation=asked)
                for i, (prompt, n, asked) in enumerate(zip(prompts, lengths, ASKED))}
    got = run_all(engine, requests)
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        alone = plain.generate(prompt, params, max_new_tokens=n)
        assert got[i] == (alone.token_ids, alone.finish_reason), f"request {i}: {ASKED[i]}"


def test_seeded_rows_draw_what_their_method_draws_alone(models, tokenizer):
    """A row's random numbers follow its own drafts: each request equals its method and k run alone."""
    engine = mixed_engine(models, tokenizer, k=3)
    cases = [("ngram", 2, SamplingParams(temperature=1.0, seed=1)), ("draft", 3, SamplingParams(0.8, seed=2)),
             ("copy", 4, SamplingParams(1.2, top_k=5, seed=3)), ("suffix", 3, SamplingParams(0.9, seed=4))]
    requests = {i: engine.make_request(PROMPTS[i], params, max_new_tokens=24, speculation=Speculation(method, k))
                for i, (method, k, params) in enumerate(cases)}
    got = run_all(engine, requests)
    for i, (method, k, params) in enumerate(cases):
        alone = single_engine(models, tokenizer, method, k=k).generate(PROMPTS[i], params, max_new_tokens=24)
        assert got[i] == (alone.token_ids, alone.finish_reason), f"request {i}: {method}, k={k}"


def test_rows_draft_by_their_own_method(models, tokenizer):
    """k 0 and autoregressive draft nothing, a method nobody asked for is never built, and a fixed k
    bounds every step's drafts."""
    engine = mixed_engine(models, tokenizer, k=3)
    asked = {0: Speculation("ngram", 1), 1: Speculation(None, 0), 2: Speculation("autoregressive", 5)}
    requests = {i: engine.make_request(PROMPTS[2], SamplingParams(temperature=0), max_new_tokens=20,
                                       speculation=speculation) for i, speculation in asked.items()}
    for handle, request in requests.items():
        engine.add(handle, request)
    drafted = {handle: [] for handle in requests}
    while engine.running:
        for update in engine.step():
            drafted[update.handle].append(update.drafted)
    assert max(drafted[0]) == 1 and sum(drafted[0]) > 0
    assert sum(drafted[1]) == 0 and sum(drafted[2]) == 0
    assert set(engine.proposer.built_methods) == {"draft", "ngram", "autoregressive"}


def test_a_request_is_refused_what_is_not_loaded(models, tokenizer):
    engine = mixed_engine(models, tokenizer, k=3, others=("ngram",))
    assert engine.request_methods == ("draft", "ngram")
    with pytest.raises(ValueError, match=r"'copy' is not loaded.*loaded: draft, ngram"):
        engine.make_request("a", speculation=Speculation("copy"))
    with pytest.raises(ValueError, match="at most 8"):
        engine.make_request("a", speculation=Speculation("ngram", 9))
    for bad in (-1, 1.5, True, "fast"):
        with pytest.raises(ValueError, match="k must be an integer >= 0"):
            Speculation("ngram", bad)
    alone = BatchEngine(make_native(models[0], batch_size=SLOTS), None, tokenizer, k=3)
    with pytest.raises(ValueError, match="cannot choose another"):
        alone.make_request("a", speculation=Speculation("ngram"))
    assert alone.make_request("a", speculation=Speculation(None, 2)).speculation.k == 2


def test_a_head_or_lookahead_runs_alone():
    with pytest.raises(ValueError, match="cannot choose ngram beside lookahead"):
        batch_proposer_for(SpecConfig(method="lookahead"), slots=2, request_methods=("lookahead", "ngram"))
