"""The decode loop: greedy equality, losslessness end to end, stop conditions, bad input."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from conftest import VOCAB_SIZE, make_model
from specdec.engine import SpecEngine
from specdec.models.hf import HFRunner
from specdec.proposers import DraftModelProposer, DraftProposal, NgramProposer, NgramThenDraftProposer, Proposer
from specdec.proposers.batched import BatchProposer, as_batch
from specdec.sampling import SamplingParams, warp_logits

PROMPT = "the quick brown fox"


class ScriptedProposer(Proposer):
    """Drafts the reference continuation but breaks it at a chosen position.

    Step i proposes `accept_plan[i % len]` correct tokens followed by wrong
    ones, so every acceptance count 0..k is forced in turn.
    """

    def __init__(self, reference: list[int], prompt_len: int, k: int) -> None:
        self.reference, self.prompt_len, self.k = reference, prompt_len, k
        self.plan = itertools.cycle(range(k + 1))
        self.seen_accepted: list[int] = []

    def reset(self) -> None:
        pass

    def propose(self, ctx, max_k):
        done = ctx.token_ids.shape[1] - self.prompt_len
        truth = self.reference[done : done + max_k]
        n = len(truth)
        correct = min(next(self.plan), n)
        draft = truth[:correct] + [(t + 1) % VOCAB_SIZE for t in truth[correct:]]
        return DraftProposal(torch.tensor([draft]), torch.tensor([n]), None)

    def on_verified(self, num_accepted):
        self.seen_accepted.append(int(num_accepted[0]))


@pytest.fixture
def plain(target_runner, tokenizer):
    return SpecEngine(target_runner, None, tokenizer)


def test_perfect_draft_accepts_everything_and_matches_plain(plain, tokenizer):
    reference = plain.generate(PROMPT, max_new_tokens=40)
    same_model = HFRunner(make_model(seed=0))  # identical weights to the target
    engine = SpecEngine(plain.target, DraftModelProposer(same_model), tokenizer, k=4)
    out = engine.generate(PROMPT, max_new_tokens=40)
    assert out.token_ids == reference.token_ids and out.text == reference.text
    assert out.stats.acceptance_rate == 1.0
    # A plain first step (the draft reads nothing yet), then steps of 4 accepted + 1 bonus.
    assert out.stats.mean_accepted_length == pytest.approx(40 / 9)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_random_draft_matches_plain_greedy(plain, draft_runner, tokenizer, k):
    reference = plain.generate(PROMPT, max_new_tokens=50)
    engine = SpecEngine(plain.target, DraftModelProposer(draft_runner), tokenizer, k=k)
    out = engine.generate(PROMPT, max_new_tokens=50)
    assert out.token_ids == reference.token_ids
    assert out.stats.drafted_tokens > 0


@pytest.mark.parametrize("k", [2, 4])
def test_scripted_draft_forces_every_acceptance_count(plain, tokenizer, k):
    reference = plain.generate(PROMPT, max_new_tokens=60)
    prompt_len = len(reference.prompt_token_ids)
    proposer = ScriptedProposer(reference.token_ids, prompt_len, k)
    out = SpecEngine(plain.target, proposer, tokenizer, k=k).generate(PROMPT, max_new_tokens=60)
    assert out.token_ids == reference.token_ids
    assert set(range(k + 1)) <= set(proposer.seen_accepted)


def test_a_long_prompt_is_read_in_chunks_before_drafting(plain, tokenizer):
    """The draft reads a long prompt a chunk per step: the first steps are plain (the first
    token is not held up by the draft's prefill), then it drafts, and the output is plain's."""
    prompt = " ".join(["the quick brown fox jumps"] * 3)
    reference = plain.generate(prompt, max_new_tokens=30)
    prompt_len = len(reference.prompt_token_ids)
    draft = HFRunner(make_model(seed=0))  # the target's weights: every draft is accepted
    proposer = DraftModelProposer(draft, catch_up_chunk=8)
    engine = SpecEngine(plain.target, proposer, tokenizer, k=4)
    steps = list(engine.stream(prompt, max_new_tokens=30))
    out = engine.generate(prompt, max_new_tokens=30)
    assert out.token_ids == reference.token_ids
    plain_steps = (prompt_len - 1) // 8  # chunks read while more than 8 tokens were behind
    assert prompt_len > 3 * 8 and all(len(step.token_ids) == 1 for step in steps[:plain_steps])
    assert out.stats.drafted_tokens > 0 and out.stats.acceptance_rate == 1.0
    with pytest.raises(ValueError, match="catch_up_chunk"):
        DraftModelProposer(draft, catch_up_chunk=0)


def test_auto_k_learns_what_reading_the_prompt_costs(plain, tokenizer):
    """-k auto sees the draft's catch-up: unread_tokens counts the prompt's window, and the engine
    records each chunk's tokens with its time (the controller's decision on it: test_adaptive.py)."""
    prompt = " ".join(["the quick brown fox jumps"] * 3)
    reference = plain.generate(prompt, max_new_tokens=30)
    prompt_len = len(reference.prompt_token_ids)
    proposer = DraftModelProposer(HFRunner(make_model(seed=0)), catch_up_chunk=8, context_window=20)
    assert proposer.unread_tokens(0, prompt_len) == 20  # a fresh request: the prompt's last 20 tokens
    engine = SpecEngine(plain.target, proposer, tokenizer, k="auto")
    assert engine.generate(prompt, max_new_tokens=30).token_ids == reference.token_ids
    read = [tokens for tokens, _ in engine.adaptive._catch_up]
    # The prompt's window comes first, 8 + 8 (the last 4 tokens are read with the first draft).
    # Later plain steps chosen by the controller (timing-dependent) may leave the draft 8 behind
    # again: such catch-ups are recorded too, each at most one chunk.
    assert read[:2] == [8, 8] and all(tokens <= 8 for tokens in read)
    # The prompt's chunks drafted nothing: all their time is catch-up. A later catch-up read with a
    # draft (a probe after a plain streak) files only its time beyond the predicted drafting cost,
    # which on this tiny model can be nothing (adaptive.py's record()).
    seconds = [s for _, s in engine.adaptive._catch_up]
    assert seconds[0] > 0 and seconds[1] > 0 and all(s >= 0 for s in seconds)


def test_draft_cache_tracks_the_committed_tokens(plain, tokenizer):
    """After every step the draft's cache holds only committed tokens (prefix of the context)."""
    draft = HFRunner(make_model(seed=0))
    engine = SpecEngine(plain.target, DraftModelProposer(draft), tokenizer, k=3)
    out = engine.generate(PROMPT, max_new_tokens=30)
    committed = len(out.prompt_token_ids) + len(out.token_ids)
    assert draft.seq_len < committed
    assert plain.target.seq_len <= committed


def test_eos_inside_an_accepted_draft_stops_there(target_runner, tokenizer):
    reference = SpecEngine(target_runner, None, tokenizer).generate(PROMPT, max_new_tokens=30)
    eos = reference.token_ids[9]  # pretend the 10th greedy token is EOS
    perfect = DraftModelProposer(HFRunner(make_model(seed=0)))
    engine = SpecEngine(target_runner, perfect, tokenizer, k=4, eos_token_ids=frozenset({eos}))
    out = engine.generate(PROMPT, max_new_tokens=30)
    first = reference.token_ids.index(eos)
    assert out.token_ids == reference.token_ids[: first + 1]
    assert out.finish_reason == "eos"


def test_stop_string_inside_an_accepted_draft_cuts_text(target_runner, tokenizer):
    reference = SpecEngine(target_runner, None, tokenizer).generate(PROMPT, max_new_tokens=40)
    text = reference.text
    stop = text[12:14]
    perfect = DraftModelProposer(HFRunner(make_model(seed=0)))
    out = SpecEngine(target_runner, perfect, tokenizer, k=6).generate(PROMPT, max_new_tokens=40, stop=[stop])
    assert out.finish_reason == "stop"
    assert out.text == text[: text.find(stop)]
    assert stop not in out.text
    # The kept tokens end with the one that completed the stop string.
    assert tokenizer.decode(out.token_ids).find(stop) >= 0
    assert tokenizer.decode(out.token_ids[:-1]).find(stop) < 0


def test_max_new_tokens_is_exact(plain, draft_runner, tokenizer):
    engine = SpecEngine(plain.target, DraftModelProposer(draft_runner), tokenizer, k=6)
    for n in (1, 2, 7, 13):
        out = engine.generate(PROMPT, max_new_tokens=n)
        assert len(out.token_ids) == n and out.finish_reason == "length"


def test_stream_yields_the_same_text_and_tokens(plain, draft_runner, tokenizer):
    engine = SpecEngine(plain.target, DraftModelProposer(draft_runner), tokenizer, k=3)
    full = engine.generate(PROMPT, max_new_tokens=30)
    chunks = list(engine.stream(PROMPT, max_new_tokens=30))
    assert "".join(c.text for c in chunks) == full.text
    assert [t for c in chunks for t in c.token_ids] == full.token_ids
    assert chunks[-1].finish_reason == "length" and chunks[-1].stats.generated_tokens == 30
    assert len(chunks) > 1


def test_stream_never_shows_a_stop_string(target_runner, tokenizer):
    reference = SpecEngine(target_runner, None, tokenizer).generate(PROMPT, max_new_tokens=40)
    stop = reference.text[20:23]
    engine = SpecEngine(target_runner, None, tokenizer)
    shown = "".join(c.text for c in engine.stream(PROMPT, max_new_tokens=40, stop=[stop]))
    assert shown == reference.text[: reference.text.find(stop)]


def test_seeded_sampling_is_reproducible(plain, draft_runner, tokenizer):
    engine = SpecEngine(plain.target, DraftModelProposer(draft_runner), tokenizer, k=3)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=11)
    a = engine.generate(PROMPT, params, max_new_tokens=25)
    b = engine.generate(PROMPT, params, max_new_tokens=25)
    c = engine.generate(PROMPT, SamplingParams(temperature=1.0, top_p=0.95, seed=12), max_new_tokens=25)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def _joint_law_of_two_tokens(target: HFRunner, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """p(t1) * p(t2 | t1) of the warped target, enumerated: [V*V]."""
    with torch.no_grad():
        first = warp_logits(target.model(torch.tensor([prompt])).logits[0, -1], params)  # [V]
        prefixes = torch.tensor([prompt + [t] for t in range(VOCAB_SIZE)])
        second = warp_logits(target.model(prefixes).logits[:, -1], params)  # [V, V]
    return (first[:, None] * second).flatten().double()


def _copyable_prompt(target: HFRunner, params: SamplingParams) -> list[int]:
    """A prompt [3, b, 4, 3] whose n-gram draft "b" the target accepts about half the time,
    so both the accept and the reject path of a point-mass draft get exercised."""
    prompts = torch.tensor([[3, b, 4, 3] for b in range(VOCAB_SIZE)])
    with torch.no_grad():
        probs = warp_logits(target.model(prompts).logits[:, -1], params)  # [V, V]
    p_b = probs[torch.arange(VOCAB_SIZE), torch.arange(VOCAB_SIZE)]  # p(b | [3, b, 4, 3])
    b = int(torch.minimum(p_b, 1 - p_b).argmax())
    return [3, b, 4, 3]


class Counting(BatchProposer):
    """Passes through to a proposer, counting drafted and accepted tokens."""

    def __init__(self, inner) -> None:
        self.inner, self.drafted, self.accepted = as_batch(inner), 0, 0

    def start_row(self, row) -> None:
        self.inner.start_row(row)

    def propose(self, contexts, max_ks):
        proposal = self.inner.propose(contexts, max_ks)
        self.drafted += int(proposal.num_tokens.sum())
        return proposal

    def on_verified(self, num_accepted):
        self.accepted += int(num_accepted.sum())
        self.inner.on_verified(num_accepted)


PROPOSERS = {  # name -> (proposer factory, whether the first step copies from the prompt)
    "draft": (lambda draft: DraftModelProposer(draft), False),
    "ngram": (lambda draft: NgramProposer(), True),
    "ngram+draft falls back": (lambda draft: NgramThenDraftProposer(NgramProposer(), DraftModelProposer(draft)), False),
}


@pytest.mark.parametrize(
    "method, params",
    [
        ("draft", SamplingParams(temperature=0.8)),
        ("draft", SamplingParams(temperature=1.0, top_k=6)),
        ("ngram", SamplingParams(temperature=1.0, top_k=6)),
        ("ngram+draft falls back", SamplingParams(temperature=0.8)),
    ],
)
def test_speculative_sampling_is_lossless_end_to_end(params, method):
    """Two generated tokens, 2000 seeds: their joint law equals the warped target's.

    The exact law is enumerated from the target itself: p(t1) * p(t2 | t1).
    Draft-model drafts carry their distribution; n-gram drafts are point masses.
    """
    target = HFRunner(make_model(seed=7, hidden=16))
    draft = HFRunner(make_model(seed=8, layers=1, hidden=16))
    make_proposer, copies = PROPOSERS[method]
    prompt = _copyable_prompt(target, params) if copies else [3, 9, 4]
    joint = _joint_law_of_two_tokens(target, prompt, params)

    proposer = Counting(make_proposer(draft))
    engine = SpecEngine(target, proposer, None, k=2)
    counts = torch.zeros(VOCAB_SIZE * VOCAB_SIZE, dtype=torch.float64)
    runs = 2000
    # sample_continuations drafts from the very first token (generate() keeps a request's first
    # step plain, for its time to first token), so both tokens come out of speculative steps.
    for drawn in engine.sample_continuations(prompt, params, runs, min_tokens=2):
        counts[drawn[0] * VOCAB_SIZE + drawn[1]] += 1
    accepted, drafted = proposer.accepted, proposer.drafted
    assert 0 < accepted < drafted, "both acceptance and rejection must be exercised"
    assert counts[joint == 0].sum() == 0
    big = joint * runs >= 5
    rest = (joint > 0) & ~big  # rare pairs pooled into one cell, when there are any
    observed = torch.cat([counts[big], counts[rest].sum()[None]])
    expected = torch.cat([joint[big], joint[rest].sum()[None]]) * runs
    if not rest.any():
        observed, expected = observed[:-1], expected[:-1]
    expected = expected * observed.sum() / expected.sum()
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda e: e.generate(PROMPT, max_new_tokens=0), "max_new_tokens"),
        (lambda e: e.generate("", max_new_tokens=3), "empty"),
        (lambda e: e.generate("a" * 300, max_new_tokens=3), "context window"),
        (lambda e: e.generate(PROMPT, max_new_tokens=3, stop=[""]), "stop"),
    ],
)
def test_bad_requests_raise_value_error(plain, call, message):
    with pytest.raises(ValueError, match=message):
        call(plain)


@pytest.mark.parametrize("k", [0, -1, 2.5])
def test_k_below_one_is_rejected(target_runner, k):
    with pytest.raises(ValueError, match="k"):
        SpecEngine(target_runner, None, None, k=k)


def test_generation_stops_at_the_context_window(tokenizer):
    runner = HFRunner(make_model(seed=0))
    runner.max_context = 40
    prompt = "a" * 30
    out = SpecEngine(runner, DraftModelProposer(HFRunner(make_model(seed=1, layers=1))), tokenizer, k=4).generate(
        prompt, max_new_tokens=50
    )
    assert len(out.prompt_token_ids) + len(out.token_ids) == 40 and out.finish_reason == "length"
