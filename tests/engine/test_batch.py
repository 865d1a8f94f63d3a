"""The batched engine: each request's output is what it would be alone, and sampling stays lossless."""

from __future__ import annotations

import pytest
import torch

from conftest import make_model, make_native, make_peaked_model, run_all
from specdec.analysis.lossless import homogeneity_test
from specdec.engine import SpecEngine
from specdec.engine.batch import BatchEngine
from specdec.models.kv_cache import StaticKVCache
from specdec.proposers import DraftModelProposer, NgramProposer
from specdec.proposers.hybrid import NgramThenDraftProposer
from specdec.proposers.lookahead import LookaheadOptions, LookaheadProposer
from specdec.proposers.registry import build_proposer
from specdec.proposers.suffix import SuffixOptions, SuffixProposer
from specdec.sampling import SamplingParams

PROMPTS = ["the quick brown fox", "a", "hello hello hello hello", "abc abc abc, abc abc", "why? because.",
           "one two three four five six seven"]
SLOTS = 3
NO_CACHE = SuffixOptions(cache_requests=0)


@pytest.fixture(scope="module")
def models():
    return make_model(seed=0, random_bias=True), make_model(seed=1, layers=1, random_bias=True)


def _single(models, tokenizer, method, k=3):
    target, draft = make_native(models[0]), make_native(models[1])
    proposer = {"autoregressive": None, "draft": DraftModelProposer(draft), "ngram": NgramProposer(),
                # Trees, as the batched engine drafts them; no cache of earlier outputs, whose contents
                # depend on the order requests finish in (the server's cache: its own test).
                "suffix": SuffixProposer(options=NO_CACHE), "lookahead": LookaheadProposer(),
                "ngram+draft": NgramThenDraftProposer(NgramProposer(), DraftModelProposer(draft))}[method]
    return SpecEngine(target, proposer, tokenizer, k=k)


def _batched(models, tokenizer, method, k=3, slots=SLOTS):
    target, draft = make_native(models[0], batch_size=slots), make_native(models[1], batch_size=slots)
    proposer = build_proposer(method, slots=slots, draft_runner=draft, suffix=NO_CACHE)
    return BatchEngine(target, proposer, tokenizer, k=k)


@pytest.mark.parametrize("method", ["autoregressive", "draft", "ngram", "ngram+draft", "suffix", "lookahead"])
def test_batched_greedy_equals_each_request_alone(models, tokenizer, method):
    single = _single(models, tokenizer, method)
    batched = _batched(models, tokenizer, method)
    lengths = [30, 7, 25, 40, 12, 33]  # requests finish at different steps, rows get packed
    params = SamplingParams(temperature=0)
    requests = {i: batched.make_request(p, params, max_new_tokens=n) for i, (p, n) in enumerate(zip(PROMPTS, lengths))}
    got = run_all(batched, requests)
    for i, (prompt, n) in enumerate(zip(PROMPTS, lengths)):
        alone = single.generate(prompt, params, max_new_tokens=n)
        assert got[i] == (alone.token_ids, alone.finish_reason), f"request {i}"


@pytest.mark.parametrize("method", ["draft", "ngram", "ngram+draft", "suffix", "lookahead"])
def test_batched_seeded_sampling_equals_each_request_alone(models, tokenizer, method):
    """Each row draws from its own generator exactly what it would draw alone, mixed params in one batch."""
    single = _single(models, tokenizer, method)
    batched = _batched(models, tokenizer, method)
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
        engine = _batched(models, tokenizer, method, k=3, slots=6)
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
        with_trees.append(proposal.row_parents is not None)
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
    engine = _batched((make_model(seed=0), make_model(seed=1, layers=1)), tokenizer, "draft")  # they write text
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
    engine = _batched(models, tokenizer, "draft")
    params = SamplingParams(temperature=0)
    alone = _single(models, tokenizer, "draft").generate(PROMPTS[2], params, max_new_tokens=30)
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
    engine = _batched(models, tokenizer, "autoregressive", slots=1)
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
    single = _single(models, tokenizer, "draft")
    for i, n in enumerate(lengths):
        assert out[i] == single.generate(PROMPTS[i], params, max_new_tokens=n).token_ids
    with pytest.raises(ValueError, match="spec_max_batch"):
        BatchEngine(target, None, tokenizer, spec_max_batch=0)


def test_long_prompts_read_in_chunks_and_windows_match_each_request_alone(models, tokenizer):
    """Prompts longer than the draft's window and chunk: each row skips the same leading tokens and
    reads the same chunks per step as alone, so seeded sampling draws exactly what it draws alone."""
    from specdec.proposers.draft_model import DraftModelProposer

    prompts = [" ".join(["the quick brown fox"] * 5), "a b c " * 12, "hello", "one two three four " * 6]
    single = SpecEngine(make_native(models[0]), DraftModelProposer(make_native(models[1]), catch_up_chunk=8,
                                                                   context_window=24), tokenizer, k=3)
    target, draft = make_native(models[0], batch_size=SLOTS), make_native(models[1], batch_size=SLOTS)
    batched = BatchEngine(target, DraftModelProposer(draft, catch_up_chunk=8, context_window=24),
                          tokenizer, k=3)
    params = [SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0), SamplingParams(0.8, seed=6),
              SamplingParams(temperature=0)]
    requests = {i: batched.make_request(p, q, max_new_tokens=20) for i, (p, q) in enumerate(zip(prompts, params))}
    got = run_all(batched, requests)
    drafted = 0
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        alone = single.generate(prompt, p, max_new_tokens=20)
        assert len(alone.prompt_token_ids) > 24 or i == 2  # longer than the window and than a chunk
        assert got[i] == (alone.token_ids, alone.finish_reason), f"request {i}"
        drafted += alone.stats.drafted_tokens
    assert drafted > 0


@pytest.mark.parametrize("method", ["autoregressive", "draft"])
def test_requests_with_one_prompt_share_its_prefill_and_still_equal_each_alone(models, tokenizer, method):
    """n > 1 samples of one prompt (and repeated requests): the second and later rows copy the running
    twin's prefill instead of recomputing it, even after the twin has generated, and every request's
    tokens are still exactly what it writes alone."""
    single = _single(models, tokenizer, method)
    batched = _batched(models, tokenizer, method)
    prompt = "one two three four five six seven"
    params = [SamplingParams(temperature=1.0, seed=7 + i) for i in range(3)] + [SamplingParams(temperature=0)]
    lengths = [40, 12, 20, 20]
    requests = {i: batched.make_request(prompt, p, max_new_tokens=n) for i, (p, n) in enumerate(zip(params, lengths))}
    got = run_all(batched, requests)  # 3 slots: the fourth joins once row 1 is free, its twin 0 mid-answer
    for i, (p, n) in enumerate(zip(params, lengths)):
        alone = single.generate(prompt, p, max_new_tokens=n)
        assert got[i] == (alone.token_ids, alone.finish_reason), f"request {i}"
    assert batched.shared_prefills == 3
    assert len({tuple(tokens) for tokens, _ in got.values()}) > 1  # distinct seeds, distinct samples


def _batched_chunked(models, tokenizer, method, chunk, slots=SLOTS):
    target, draft = make_native(models[0], batch_size=slots), make_native(models[1], batch_size=slots)
    proposer = build_proposer(method, slots=slots, draft_runner=draft, suffix=NO_CACHE)
    return BatchEngine(target, proposer, tokenizer, k=3, prefill_chunk=chunk)


@pytest.mark.parametrize("method", ["autoregressive", "draft"])
def test_chunked_prefill_equals_whole_prefill_bit_for_bit(models, tokenizer, method):
    """Prompts prefilled 4 tokens per step, interleaved with the other rows' decode steps: the cache
    entries equal one whole prefill's bit for bit, and every request writes what it writes alone."""
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3), SamplingParams(0.7, seed=4),
              SamplingParams(temperature=0), SamplingParams(0.9, top_k=5, seed=5), SamplingParams(temperature=0)]
    single = _single(models, tokenizer, method)
    chunked = _batched_chunked(models, tokenizer, method, chunk=4)
    requests = {i: chunked.make_request(PROMPTS[i] * 3, p, max_new_tokens=15) for i, p in enumerate(params)}
    got = run_all(chunked, requests)
    for i, p in enumerate(params):
        alone = single.generate(PROMPTS[i] * 3, p, max_new_tokens=15)
        assert got[i] == (alone.token_ids, alone.finish_reason), f"request {i}"

    whole = make_native(models[0])
    prompt = chunked.make_request(PROMPTS[6 - 1] * 3, params[0]).prompt_ids
    whole.forward(torch.tensor([prompt[:-1]]), torch.arange(len(prompt) - 1)[None])
    engine = _batched_chunked(models, tokenizer, "autoregressive", chunk=4, slots=1)
    engine.add("p", engine.make_request(prompt, params[0]))
    while engine._prefilling:
        engine.step()
    n = len(prompt) - 1
    assert torch.equal(engine.target.cache.keys[:, 0, :, :n], whole.cache.keys[:, 0, :, :n])
    assert torch.equal(engine.target.cache.values[:, 0, :, :n], whole.cache.values[:, 0, :, :n])


def test_a_long_prompt_no_longer_stalls_running_streams(models, tokenizer):
    """While a 100-token prompt is prefilled 8 tokens per step, the running request gets a token every
    step; without chunking the newcomer's whole prefill happens before any of them."""
    engine = _batched_chunked(models, tokenizer, "autoregressive", chunk=8)
    engine.add("running", engine.make_request("hello", SamplingParams(temperature=0), max_new_tokens=60,
                                              ignore_eos=True))
    engine.step()
    engine.add("long", engine.make_request("x" * 100, SamplingParams(temperature=0), max_new_tokens=4))
    steps_while_prefilling = 0
    while engine._prefilling:
        updates = engine.step()
        # "long" joins the step in which its prefill completes
        assert [update.handle for update in updates if update.token_ids][0] == "running"
        steps_while_prefilling += 1
    assert steps_while_prefilling >= 100 // 8
    with pytest.raises(ValueError, match="prefill_chunk"):
        BatchEngine(make_native(models[0]), None, tokenizer, prefill_chunk=0)


def test_short_prompts_are_prefilled_first_and_a_long_one_is_overtaken_at_most_slots_times(models, tokenizer):
    """Chunked prefill takes the shortest prompt not yet begun first: two short questions admitted after
    a long document start decoding before it, and each writes what it writes alone. A prompt is
    overtaken at most `slots` times (here 4), so a stream of short ones cannot starve it."""
    engine = _batched_chunked(models, tokenizer, "autoregressive", chunk=8, slots=4)
    plain = _single(models, tokenizer, "autoregressive")
    params = SamplingParams(temperature=0)
    engine.add("running", engine.make_request("hello", params, max_new_tokens=40, ignore_eos=True))
    engine.step()
    prompts = {"long": "x y " * 40, "short": "why?", "shorter": "a"}
    for handle, prompt in prompts.items():
        engine.add(handle, engine.make_request(prompt, params, max_new_tokens=6))
    first_token, out, step = {}, {handle: [] for handle in prompts}, 0
    while engine.running:
        step += 1
        for update in engine.step():
            if update.handle in out and update.token_ids:
                first_token.setdefault(update.handle, step)
                out[update.handle] += update.token_ids
    assert first_token["shorter"] <= first_token["short"] < first_token["long"]
    for handle, prompt in prompts.items():
        assert out[handle] == plain.generate(prompt, params, max_new_tokens=6).token_ids

    bounded = _batched_chunked(models, tokenizer, "autoregressive", chunk=8, slots=3)
    bounded.add("long", bounded.make_request("x y " * 40, params, max_new_tokens=2))
    bounded.add("a", bounded.make_request("a", params, max_new_tokens=2))
    assert [running.handle for running in bounded._prefilling] == ["a", "long"]
    bounded._prefilling[-1].overtaken = 3  # as if rows had freed up for 3 shorter prompts before
    bounded.add("b", bounded.make_request("b", params, max_new_tokens=2))
    assert [running.handle for running in bounded._prefilling] == ["a", "long", "b"]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_batched_ngram_then_draft_mixes_copied_and_drafted_rows_in_one_step(models, tokenizer, temperature):
    """Rows whose context repeats copy; the others draft with the model, together; each row's tokens
    are what NgramThenDraftProposer writes for it alone."""
    prompts = ["xq", "the the the the the", "zv", "abcabcabcabc", "kw", "no no no no"]
    single = _single(models, tokenizer, "ngram+draft")
    batched = _batched(models, tokenizer, "ngram+draft")
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(len(prompts))]
    got = run_all(batched, {i: batched.make_request(p, params[i], max_new_tokens=30) for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        alone = single.generate(prompt, params[i], max_new_tokens=30)
        assert got[i] == (alone.token_ids, alone.finish_reason), f"request {i}"
    assert batched.proposer.steps_mixed > 0


def _run_collecting_stats(engine, requests: dict) -> dict:
    """run_all that also keeps each request's final stats: handle -> (tokens, finish reason, stats)."""
    waiting, out, finals = list(requests.items()), {handle: [] for handle in requests}, {}
    while waiting or engine.running:
        while waiting and engine.free_slots:
            engine.add(*waiting.pop(0))
        for update in engine.step():
            out[update.handle] += update.token_ids
            if update.finish_reason:
                finals[update.handle] = (update.finish_reason, update.stats)
    return {handle: (out[handle], *finals[handle]) for handle in requests}


def assert_parked_rows_hold_their_tokens(engine: BatchEngine, model) -> None:
    """Every parked row's entries are, bit for bit, those of a fresh prefill of the tokens it is parked with."""
    fresh = make_native(model)
    cache = engine.target.cache
    for row, tokens in engine._parked.items():
        fresh.reset()
        fresh.forward(torch.tensor([tokens]), torch.arange(len(tokens))[None])
        assert cache.seq_lens[row] >= len(tokens)
        assert torch.equal(cache.keys[:, row, :, :len(tokens)], fresh.cache.keys[:, 0, :, :len(tokens)]), row
        assert torch.equal(cache.values[:, row, :, :len(tokens)], fresh.cache.values[:, 0, :, :len(tokens)]), row


@pytest.mark.parametrize("method", ["autoregressive", "draft", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_next_turns_reuse_finished_rows_and_still_equal_each_request_alone(models, tokenizer, method, temperature):
    """Prompt caching across requests: each second-turn prompt is a first-turn prompt, its answer and
    more text, so its row starts as a copy of the finished request's (kept in a free row) and only the
    rest is prefilled; an unrelated prompt reuses nothing. Every request still writes exactly what it
    writes alone in a fresh engine, greedy and sampled."""
    single = _single(models, tokenizer, method)
    single.reuse_prefix = False  # alone means alone: a fresh prefill for every request
    batched = _batched(models, tokenizer, method)
    assert batched.prompt_cache

    def params(i):
        return SamplingParams(temperature=temperature, seed=11 + i)

    first = {i: batched.make_request(prompt, params(i), max_new_tokens=n)
             for i, (prompt, n) in enumerate(zip(PROMPTS[:3], [24, 9, 30]))}
    first_got = _run_collecting_stats(batched, first)
    assert len(batched._parked) == 3  # all three, though each finished with every slot taken
    assert_parked_rows_hold_their_tokens(batched, models[0])
    extra = tokenizer.encode(" and then? more", add_special_tokens=False)
    second_prompts = {10 + i: list(first[i].prompt_ids) + first_got[i][0] + extra for i in (0, 2)}
    second_prompts[20] = tokenizer.encode(PROMPTS[4], add_special_tokens=False)  # shares nothing
    second = {handle: batched.make_request(ids, params(handle), max_new_tokens=20)
              for handle, ids in second_prompts.items()}
    got = _run_collecting_stats(batched, second)
    assert_parked_rows_hold_their_tokens(batched, models[0])
    for handle, request in {**first, **second}.items():
        tokens, reason, stats = (first_got | got)[handle]
        alone = single.generate(request.prompt_ids, params(handle), max_new_tokens=request.max_new_tokens)
        assert (tokens, reason) == (alone.token_ids, alone.finish_reason), f"request {handle}"
    for handle in (10, 12):  # the first turn's prompt and answer came from the parked row
        assert got[handle][2].prompt_tokens_reused >= len(second_prompts[handle]) - len(extra) - 1
    assert got[20][2].prompt_tokens_reused == 0
    assert batched.reused_prompt_tokens == got[10][2].prompt_tokens_reused + got[12][2].prompt_tokens_reused


def test_prompt_cache_off_prefills_every_prompt(models, tokenizer):
    target = make_native(models[0], batch_size=SLOTS)
    engine = BatchEngine(target, None, tokenizer, k=3, prompt_cache=False)
    first = engine.make_request(PROMPTS[5], SamplingParams(temperature=0), max_new_tokens=10)
    answer = _run_collecting_stats(engine, {0: first})[0][0]
    again = engine.make_request(list(first.prompt_ids) + answer, SamplingParams(temperature=0), max_new_tokens=5)
    assert _run_collecting_stats(engine, {1: again})[1][2].prompt_tokens_reused == 0
    assert engine.reused_prompt_tokens == 0


def test_parked_rows_move_out_of_the_way_and_serve_the_turns_that_continue_them(models, tokenizer):
    """Two conversations and a short unrelated request through 3 slots, so a parked row is moved aside
    by a request that reuses nothing (rounds 1 and 4), swapped into the newcomer's row (2, 3, 6), used in
    place (3) and copied into a free row (5); every turn still writes exactly what it writes alone."""
    single = _single(models, tokenizer, "ngram")
    single.reuse_prefix = False
    batched = _batched(models, tokenizer, "ngram")
    greedy = SamplingParams(temperature=0)
    history = {"a": tokenizer.encode(PROMPTS[0], add_special_tokens=False),
               "b": tokenizer.encode(PROMPTS[5], add_special_tokens=False),
               "x": tokenizer.encode("x?", add_special_tokens=False)}  # with 3 new tokens, too short to park
    turn = tokenizer.encode(" then?", add_special_tokens=False)
    rounds = [["a"], ["b"], ["a"], ["b", "a"], ["x"], ["a"], ["b"]]
    reused = {}
    for number, names in enumerate(rounds):
        requests = {name: batched.make_request(history[name], greedy, max_new_tokens=3 if name == "x" else 8 + number)
                    for name in names}
        got = _run_collecting_stats(batched, requests)
        assert_parked_rows_hold_their_tokens(batched, models[0])
        for name, request in requests.items():
            tokens, reason, stats = got[name]
            alone = single.generate(request.prompt_ids, greedy, max_new_tokens=request.max_new_tokens)
            assert (tokens, reason) == (alone.token_ids, alone.finish_reason), f"round {number}, {name}"
            if name != "x":
                reused[(number, name)] = stats.prompt_tokens_reused
                history[name] = list(request.prompt_ids) + tokens + turn
    assert [count > 0 for _, count in sorted(reused.items())] == [False, False, True, True, True, True, True]
