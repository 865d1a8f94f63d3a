"""analysis/draft_oracle.py: a draft model's agreement with recorded answers, replayed and priced."""

from __future__ import annotations

import pytest
import torch

from conftest import make_model, make_native
from specdec.analysis.draft_oracle import CountingRunner, agreement_runs, draft_oracle, prompt_read_cost
from specdec.analysis.replay import RecordedTurn, replay, step_time
from specdec.proposers.draft_model import DraftModelProposer

VOCAB = 64  # conftest's tiny models


def _answer_with_detours(runner, prompt: list[int], length: int, detours: set[int]) -> list[int]:
    """The draft's own greedy continuation, except at `detours`, where the next best token is taken
    instead (and the continuation follows from there): runs of agreement of several lengths."""
    runner.reset()
    logits = runner.forward(torch.tensor([prompt]), torch.arange(len(prompt))[None]).logits[0, -1]
    answer = []
    for position in range(length):
        ranked = logits[:VOCAB].argsort(descending=True)
        token = int(ranked[1] if position in detours else ranked[0])
        answer.append(token)
        logits = runner.forward(torch.tensor([[token]]), torch.tensor([[len(prompt) + position]])).logits[0, -1]
    runner.reset()
    return answer


@pytest.fixture(scope="module")
def draft_and_turns():
    runner = make_native(make_model(seed=1, layers=1))
    generator = torch.Generator().manual_seed(0)
    turns = []
    for index, (prompt_length, detours) in enumerate(((150, {3, 9, 10, 20, 33}), (20, {1, 2, 16, 17, 18}))):
        prompt = torch.randint(2, VOCAB, (prompt_length,), generator=generator).tolist()
        answer = _answer_with_detours(runner, prompt, 40, detours)
        turns.append(RecordedTurn("c", f"q{index}", tuple(prompt), tuple(answer), False))
    return runner, turns


@pytest.mark.parametrize("window", [256, 100])
def test_agreement_runs_are_what_the_draft_proposer_gets_accepted(draft_and_turns, window):
    """Replaying the real DraftModelProposer at a fixed k accepts, at every step that drafted,
    exactly min(k, run) tokens: the teacher-forced guesses are the guesses it drafts (batch invariance)."""
    runner, turns = draft_and_turns
    runs = agreement_runs(turns, runner, window, VOCAB)
    assert all(row[0] == 0 and len(row) == 40 for row in runs)
    assert any(run >= 3 for row in runs for run in row) and any(run == 0 for row in runs for run in row[1:])
    counting = CountingRunner(runner)
    proposer = DraftModelProposer(counting, context_window=window)
    for turn, row, steps in zip(turns, runs, replay(turns, proposer, 3, stream=False, max_new_tokens=40,
                                                    vocab_size=VOCAB, forwards=counting)):
        position, checked = 1, 0
        for drafted, accepted in zip(steps.drafted, steps.accepted):
            if drafted:
                assert accepted == min(drafted, row[position]), (turn.question_id, position)
                checked += 1
            position += accepted + 1
        assert checked >= 5
    assert counting.reads and max(counting.reads) <= 65  # the window read in chunks, one row at a time


def test_the_oracle_costs_no_more_than_the_replayed_draft(draft_and_turns):
    runner, turns = draft_and_turns
    runs = agreement_runs(turns, runner, 256, VOCAB)

    def cost(rows):  # verification grows with its tokens, as on a CPU
        return 1.0 + 0.15 * (rows - 1)

    def draft_cost(tokens):
        return 0.3 + 0.01 * tokens

    for k in (1, 2, 4):
        counting = CountingRunner(runner)
        replayed = replay(turns, DraftModelProposer(counting), k, stream=False, max_new_tokens=40,
                          vocab_size=VOCAB, forwards=counting)
        for turn, row, steps in zip(turns, runs, replayed):
            time, best = draft_oracle(turn, row, k, cost, draft_cost, 256)
            assert time <= step_time(steps, cost, draft_cost) + 1e-9
            assert sum(a + 1 for a in best.accepted) == len(turn.output_ids) - 1  # it decodes the whole answer
            assert all(a <= min(k, row[p]) for a, p in zip(best.accepted, _positions(best.accepted)))
    # A draft dear enough is never worth drafting with: plain decoding, one step a token.
    time, best = draft_oracle(turns[0], runs[0], 4, cost, lambda tokens: 5.0, 256)
    assert time == pytest.approx(39.0) and not any(best.drafted)


def _positions(accepted):
    position = 1
    for a in accepted:
        yield position
        position += a + 1


def test_the_prompt_read_is_the_chunks_before_the_first_draft():
    def turn(prompt_length):
        return RecordedTurn("c", "q", tuple(range(prompt_length)), (1, 2), False)

    # unread at the first ask: the window and one answer token; chunks of 64 while more than 64 remain
    assert prompt_read_cost(turn(63), 256, lambda tokens: float(tokens)) == 0.0
    assert prompt_read_cost(turn(64), 256, lambda tokens: float(tokens)) == 64.0
    assert prompt_read_cost(turn(1000), 256, lambda tokens: 1.0) == 4.0  # 257 unread: 4 chunks, then 1 token
    assert prompt_read_cost(turn(1000), 64, lambda tokens: 1.0) == 1.0
