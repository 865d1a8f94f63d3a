"""The batched engine's prefill: prompts read in chunks between other rows' steps, one prompt's
prefill shared by its samples, and finished rows kept for the next turn (the prompt cache); every
request still writes exactly what it writes alone."""

from __future__ import annotations

import pytest
import torch

from batching import NO_CACHE, PROMPTS, SLOTS, batched_engine, single_engine, tiny_pair
from conftest import make_native, run_all
from specdec.engine import SpecEngine
from specdec.engine.batch import BatchEngine
from specdec.proposers.registry import build_proposer
from specdec.sampling import SamplingParams


@pytest.fixture(scope="module")
def models():
    return tiny_pair()


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
    single = single_engine(models, tokenizer, method)
    batched = batched_engine(models, tokenizer, method)
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
    single = single_engine(models, tokenizer, method)
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
    plain = single_engine(models, tokenizer, "autoregressive")
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
    for row, (_tenant, tokens) in engine._parked.items():
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
    single = single_engine(models, tokenizer, method)
    single.reuse_prefix = False  # alone means alone: a fresh prefill for every request
    batched = batched_engine(models, tokenizer, method)
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
    single = single_engine(models, tokenizer, "ngram")
    single.reuse_prefix = False
    batched = batched_engine(models, tokenizer, "ngram")
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
