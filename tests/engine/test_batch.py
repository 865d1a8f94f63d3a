"""The batched engine: each request's output is what it would be alone, and sampling stays lossless."""

from __future__ import annotations

import pytest
import torch

from conftest import make_model, make_native, make_peaked_model, run_all
from specdec.analysis.lossless import homogeneity_test
from specdec.engine import SpecEngine
from specdec.engine.batch import BatchEngine
from specdec.models.kv_cache import StaticKVCache
from specdec.proposers.lookahead import LookaheadOptions, LookaheadProposer
from specdec.proposers.registry import build_proposer
from specdec.proposers.suffix import SuffixOptions
from specdec.sampling import SamplingParams

from batching import PROMPTS, SLOTS, batched_engine, single_engine, tiny_pair


@pytest.fixture(scope="module")
def models():
    return tiny_pair()


@pytest.mark.parametrize("method", ["autoregressive", "draft", "ngram", "ngram+draft", "suffix", "lookahead", "copy",
                                    "copy+draft"])
def test_batched_greedy_equals_each_request_alone(models, tokenizer, method):
    single = single_engine(models, tokenizer, method)
    batched = batched_engine(models, tokenizer, method)
    lengths = [30, 7, 25, 40, 12, 33]  # requests finish at different steps, rows get packed
    params = SamplingParams(temperature=0)
    requests = {i: batched.make_request(p, params, max_new_tokens=n) for i, (p, n) in enumerate(zip(PROMPTS, lengths))}
    got = run_all(batched, requests)
    for i, (prompt, n) in enumerate(zip(PROMPTS, lengths)):
        alone = single.generate(prompt, params, max_new_tokens=n)
        assert got[i] == (alone.token_ids, alone.finish_reason), f"request {i}"


@pytest.mark.parametrize("method", ["draft", "ngram", "ngram+draft", "suffix", "lookahead", "copy", "copy+draft"])
def test_batched_seeded_sampling_equals_each_request_alone(models, tokenizer, method):
    """Each row draws from its own generator exactly what it would draw alone, mixed params in one batch."""
    single = single_engine(models, tokenizer, method)
    batched = batched_engine(models, tokenizer, method)
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0), SamplingParams(0.7, top_k=5,
              seed=2), SamplingParams(1.3, top_p=0.8, seed=3), SamplingParams(0.9, seed=4)]
    requests = {i: batched.make_request(PROMPTS[i], p, max_new_tokens=24) for i, p in enumerate(params)}
    got = run_all(batched, requests)
    for i, p in enumerate(params):
        alone = single.generate(PROMPTS[i], p, max_new_tokens=24)
        assert got[i] == (alone.token_ids, alone.finish_reason), f"request {i}"


def test_batched_sampling_is_lossless(models, tokenizer):
    """First two tokens of 300 seeded requests, batched draft speculation vs batched plain decoding."""
    outcomes = {}
    for method in ("draft", "autoregressive"):
        engine = batched_engine(models, tokenizer, method, k=3, slots=6)
        params = [SamplingParams(temperature=1.0, seed=1000 + i) for i in range(300)]
        requests = {i: engine.make_request("the cat", p, max_new_tokens=2, ignore_eos=True)
                    for i, p in enumerate(params)}
        outcomes[method] = [tuple(tokens) for tokens, _ in run_all(engine, requests).values()]
    result = homogeneity_test(outcomes["draft"], outcomes["autoregressive"])
    assert result.p_value > 1e-3, result


def test_batched_suffix_rows_share_one_cache_of_earlier_outputs(models, tokenizer):
    """Requests that finished teach the rows that run after them; output stays plain greedy. Rows draft
    trees (the target's sampled answers in the cache: several continuations compete), verified
    together in the step's forward."""
    target = make_native(models[0], batch_size=SLOTS)
    options = SuffixOptions(cache_requests=64, spec_factor=4, min_token_prob=0.05)
    proposer = build_proposer("suffix", slots=SLOTS, suffix=options)
    sampler = SpecEngine(make_native(models[0]), None, tokenizer)
    for seed in range(6):
        for prompt in PROMPTS[:SLOTS]:
            sampled = sampler.generate(prompt, SamplingParams(temperature=0.9, seed=seed), max_new_tokens=12)
            proposer.rows[0].cache.add(sampled.token_ids)
    with_trees, propose = [], proposer.propose

    def recording_propose(contexts, max_ks):
        proposal = propose(contexts, max_ks)
        with_trees.append(proposal.trees is not None)
        return proposal

    proposer.propose = recording_propose
    engine = BatchEngine(target, proposer, tokenizer, k=4)
    plain = SpecEngine(make_native(models[0]), None, tokenizer)
    params, accepted = SamplingParams(temperature=0), []
    for _ in range(2):
        requests = {i: engine.make_request(p, params, max_new_tokens=24) for i, p in enumerate(PROMPTS[:SLOTS])}
        waiting, drafted = list(requests.items()), 0
        while waiting or engine.running:
            while waiting and engine.free_slots:
                engine.add(*waiting.pop(0))
            drafted += sum(update.accepted for update in engine.step())
        accepted.append(drafted)
    for prompt in PROMPTS[:SLOTS]:  # and what the rows wrote is plain greedy output
        request = engine.make_request(prompt, params, max_new_tokens=24)
        engine.add("again", request)
        tokens = []
        while engine.running:
            tokens += [t for update in engine.step() for t in update.token_ids]
        assert tokens == plain.generate(prompt, params, max_new_tokens=24).token_ids
    assert accepted[1] > accepted[0]
    assert any(with_trees)


def test_stop_strings_and_ignore_eos(tokenizer):
    engine = batched_engine((make_model(seed=0), make_model(seed=1, layers=1)), tokenizer, "draft")  # they write text
    params = SamplingParams(temperature=0)
    free = engine.make_request(PROMPTS[0], params, max_new_tokens=40, ignore_eos=True)
    tokens, reason = run_all(engine, {0: free})[0]
    assert reason == "length" and len(tokens) == 40
    text = tokenizer.decode(tokens)
    stop = text[15:17]
    cut = engine.make_request(PROMPTS[0], params, max_new_tokens=40, stop=[stop], ignore_eos=True)
    engine.add("cut", cut)
    while engine.running:
        engine.step()
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(stop)]
    eos = engine.make_request(PROMPTS[0], params, max_new_tokens=40, stop=[stop])
    assert eos.eos_token_ids == engine.eos_token_ids and not free.eos_token_ids


def test_remove_frees_the_row_and_others_go_on(models, tokenizer):
    engine = batched_engine(models, tokenizer, "draft")
    params = SamplingParams(temperature=0)
    alone = single_engine(models, tokenizer, "draft").generate(PROMPTS[2], params, max_new_tokens=30)
    for handle, prompt in enumerate(PROMPTS[:3]):
        engine.add(handle, engine.make_request(prompt, params, max_new_tokens=30))
    tokens = [t for u in engine.step() if u.handle == 2 for t in u.token_ids]
    assert engine.remove(0) and not engine.remove(0)
    assert engine.free_slots == 1 and engine.handles() == [2, 1]  # the last row moved into row 0
    while 2 in engine.handles():
        tokens += [t for u in engine.step() if u.handle == 2 for t in u.token_ids]
    assert tokens == alone.token_ids  # the moved row's caches came along intact


def test_context_limit_finishes_with_length(tokenizer):
    model = make_model(seed=0)
    engine = BatchEngine(make_native(model, batch_size=2, max_context=40), None, tokenizer, k=2)
    request = engine.make_request("x" * 30, SamplingParams(temperature=0), max_new_tokens=100, ignore_eos=True)
    engine.add(0, request)
    while engine.running:
        engine.step()
    assert request.finish_reason == "length" and len(request.prompt_ids) + len(request.generated) == 40
    with pytest.raises(ValueError, match="context window"):
        engine.make_request("x" * 45, max_new_tokens=4)


def test_bad_arguments_are_clear_errors(models, tokenizer):
    with pytest.raises(ValueError, match="k"):
        BatchEngine(make_native(models[0], batch_size=2), None, tokenizer, k=0)
    engine = batched_engine(models, tokenizer, "autoregressive", slots=1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.make_request("hi", max_new_tokens=0)
    with pytest.raises(ValueError, match="empty"):
        engine.make_request("", max_new_tokens=3)
    engine.add(0, engine.make_request("hi", max_new_tokens=3))
    with pytest.raises(RuntimeError, match="no free row"):
        engine.add(1, engine.make_request("hi", max_new_tokens=3))
    with pytest.raises(ValueError, match="unknown method"):
        build_proposer("no-such-method", slots=2)
    with pytest.raises(ValueError, match="needs a trained eagle head"):
        build_proposer("eagle", slots=2)
    with pytest.raises(ValueError, match="needs a draft model"):
        build_proposer("ngram+draft", slots=2)


@pytest.mark.parametrize("k", [4, "auto"])
def test_batched_lookahead_rows_guess_for_themselves_and_equal_each_alone(tokenizer, k):
    """Lookahead decoding in the batched engine: every row's Jacobi window rides in the step's one
    forward next to the other rows' drafts and windows. On a peaked target the rows' own guesses are
    accepted, greedy rows give plain greedy output and seeded rows draw what they draw alone (fixed k;
    with -k auto the step's k depends on timings, so only greedy equality is asserted)."""
    model = make_peaked_model(seed=3)
    options = LookaheadOptions(window=3, ngram=3, guesses=3)
    target = make_native(model, batch_size=SLOTS)
    batched = BatchEngine(target, build_proposer("lookahead", slots=SLOTS, lookahead=options), tokenizer, k=k)
    greedy, seeded = SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=7)
    params = [greedy, seeded, greedy, seeded, greedy] if k == 4 else [greedy] * 5
    prompts = ["abc abc abc abc", "the cat the cat the", "xyz xy", "hello hello hello", "the quick brown fox"]
    lengths = [40, 30, 25, 35, 20]
    requests = {i: batched.make_request(prompts[i], p, max_new_tokens=n)
                for i, (p, n) in enumerate(zip(params, lengths))}
    accepted = 0
    waiting, got = list(requests.items()), {i: [] for i in requests}
    while waiting or batched.running:
        while waiting and batched.free_slots:
            batched.add(*waiting.pop(0))
        for update in batched.step():
            got[update.handle] += update.token_ids
            accepted += update.accepted
    single = SpecEngine(make_native(model), LookaheadProposer(options), tokenizer, k=4)
    plain = SpecEngine(make_native(model), None, tokenizer)
    for i, (prompt, p, n) in enumerate(zip(prompts, params, lengths)):
        reference = (single if not p.greedy else plain).generate(prompt, p, max_new_tokens=n)
        assert got[i] == reference.token_ids, f"request {i}"
    if k == 4:
        assert accepted > 10  # the rows' own Jacobi guesses were verified and kept


@pytest.mark.parametrize("seed,context,options,k,prompts", [
    (3, 40, LookaheadOptions(), 4, ["abc abc abc abc", "hello hello hello"]),
    (0, 37, LookaheadOptions(window=4, ngram=4, guesses=5), 6, ["hello hello hello"]),
], ids=["window", "tree"])
def test_batched_lookahead_runs_to_the_end_of_the_context(tokenizer, seed, context, options, k, prompts):
    """The fullest row's cache bounds the step: near the context's end the windows stay out of the
    forward and trees keep the nodes that fit; every row reaches the context's last token with plain
    greedy's output."""
    model, params = make_peaked_model(seed=seed), SamplingParams(temperature=0)
    engine = BatchEngine(make_native(model, batch_size=2, max_context=context),
                         build_proposer("lookahead", slots=2, lookahead=options), tokenizer, k=k)
    requests = {i: engine.make_request(p, params, max_new_tokens=100, ignore_eos=True) for i, p in enumerate(prompts)}
    got = run_all(engine, requests)
    plain = SpecEngine(make_native(model, max_context=context), None, tokenizer, eos_token_ids=frozenset())
    for i, prompt in enumerate(prompts):
        assert got[i] == (plain.generate(prompt, params, max_new_tokens=100).token_ids, "length")


def test_cache_rows_write_only_their_rows():
    cache = StaticKVCache(num_layers=1, batch_size=3, num_kv_heads=1, head_dim=2, max_capacity=8,
                          dtype=torch.float32, device=torch.device("cpu"), initial_capacity=4)
    block = cache.rows(1, 3)
    block.write(0, torch.ones(2, 1, 2, 2), torch.ones(2, 1, 2, 2))
    block.advance(2)
    assert cache.seq_lens == [0, 2, 2]
    assert cache.keys[0, 0].abs().sum() == 0 and cache.keys[0, 1:, :, :2].eq(1).all()
    cache.move_row(2, 0)
    assert cache.seq_lens == [2, 2, 2] and cache.keys[0, 0, :, :2].eq(1).all()
    with pytest.raises(ValueError, match="outside"):
        cache.rows(2, 4)


def test_speculation_pauses_above_spec_max_batch_and_resumes_exactly(models, tokenizer):
    """With 3 rows running and spec_max_batch=1 the steps are plain, and the draft prefills nothing;
    as rows finish the last one is drafted for again (the draft catches up on its whole context first).
    The output never changes."""
    target, draft = make_native(models[0], batch_size=SLOTS), make_native(models[1], batch_size=SLOTS)
    engine = BatchEngine(target, build_proposer("draft", slots=SLOTS, draft_runner=draft), tokenizer, k=3,
                         spec_max_batch=1)
    params = SamplingParams(temperature=0)
    lengths = [10, 20, 45]
    for i, n in enumerate(lengths):
        engine.add(i, engine.make_request(PROMPTS[i], params, max_new_tokens=n))
    out = {i: [] for i in range(len(lengths))}
    drafted_while_crowded, drafted_alone = 0, 0
    while engine.running:
        crowded = engine.running > 1
        for update in engine.step():
            out[update.handle] += update.token_ids
            if crowded:
                drafted_while_crowded += update.drafted
            else:
                drafted_alone += update.drafted
        if crowded and engine.running == len(lengths):
            assert draft.row_lengths() == [0, 0, 0]  # nobody was drafted for: no draft prefill either
    assert drafted_while_crowded == 0 and drafted_alone > 0
    single = single_engine(models, tokenizer, "draft")
    for i, n in enumerate(lengths):
        assert out[i] == single.generate(PROMPTS[i], params, max_new_tokens=n).token_ids
    with pytest.raises(ValueError, match="spec_max_batch"):
        BatchEngine(target, None, tokenizer, spec_max_batch=0)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_batched_ngram_then_draft_mixes_copied_and_drafted_rows_in_one_step(models, tokenizer, temperature):
    """Rows whose context repeats copy; the others draft with the model, together; each row's tokens
    are what NgramThenDraftProposer writes for it alone."""
    prompts = ["xq", "the the the the the", "zv", "abcabcabcabc", "kw", "no no no no"]
    single = single_engine(models, tokenizer, "ngram+draft")
    batched = batched_engine(models, tokenizer, "ngram+draft")
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(len(prompts))]
    got = run_all(batched, {i: batched.make_request(p, params[i], max_new_tokens=30) for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        alone = single.generate(prompt, params[i], max_new_tokens=30)
        assert got[i] == (alone.token_ids, alone.finish_reason), f"request {i}"
    assert batched.proposer.steps_mixed > 0
