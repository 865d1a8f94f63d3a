"""A draft model on recorded greedy answers: how far its guesses agree, and the most it can bring.

At temperature 0 a draft model's chain drafted at answer position p is accepted exactly as far as
its greedy guesses agree with the answer, and while they agree the draft's context *is* the
answer's prefix. So the draft's guess at every position given the true prefix, which one
teacher-forced forward over the prompt's window and the answer gives, tells how far a chain
drafted at any position would be accepted (`agreement_runs`), with no target model: the native
decoder's forward gives the same logits whether it reads a text at once or a token at a time
(batch invariance, docs/architecture.md), so these are the guesses the draft makes when it drafts.

From them, `draft_oracle` prices the best any k controller could do with this draft on one machine
(`specdec costs --draft`: the target's forwards and the draft's): each step drafts exactly as
many tokens as will be accepted, from the draft or, for ngram+draft, from whichever of the draft
and the copy ceiling's longest seen continuation (analysis/replay.py) is cheaper. It pays each
drafted token one draft forward and the prompt's window read once where it drafts at all, and
nothing else: no catch-up after copied steps, no rejected guess, no confidence threshold, and
drafts from the first decode step on. So no chain of this draft's greedy guesses, with any k rule,
decodes faster on that machine (where a longer forward never costs less); trees of its top-2
guesses could, and are not priced here.

`CountingRunner` notes the tokens of each forward the real DraftModelProposer runs in a replay
(analysis/replay.py's replay()), so a replayed fixed-k run is priced by what it read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdec.analysis.replay import (NGRAM_DRAFT_ORACLE, CostFn, RecordedTurn, ReplayRow, TurnSteps, cheapest_path,
                                     tally)
from specdec.proposers.draft_model import CATCH_UP_CHUNK, CONTEXT_WINDOW, match_vocab
from specdec.proposers.hybrid import DRAFT_CONTEXT_WINDOW
from specdec.proposers.stop_rules import distribution_features

CHUNK = 128  # tokens per teacher-forced forward: bounds the logits held at once ([CHUNK, V] floats)


class CountingRunner:
    """A model runner that notes how many tokens each forward() read (one row); the rest is the runner's."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.reads: list[int] = []

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, **kwargs):
        self.reads.append(int(token_ids.shape[1]))
        return self.runner.forward(token_ids, positions, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.runner, name)


@dataclass
class TurnGuesses:
    """The draft's greedy guess at each answer position p, given the true prefix: agree[p] whether it is
    answer[p] (p = 0, the prefill's token, False), and features[p] its stop features at chain position 0
    (proposers/stop_rules.py: the guess's probability, the second highest, the entropy)."""

    agree: list[bool]
    features: np.ndarray  # [len(answer), 3]


def draft_guesses(turns: Sequence[RecordedTurn], runner, window: int | None, vocab_size: int) -> list[TurnGuesses]:
    """Per turn, the draft's guesses as DraftModelProposer reads the text: the prompt's last `window`
    tokens at their true positions, then answer[:p]."""
    found = []
    for turn in turns:
        prompt, answer = turn.prompt_ids, turn.output_ids
        skip = 0 if window is None else max(0, len(prompt) - window)
        text = list(prompt[skip:]) + list(answer[:-1])
        guesses: list[int] = []  # guesses[i]: the draft's next token after text[:i + 1]
        features = []
        runner.truncate([0], rows=slice(0, 1))
        with torch.inference_mode():
            for start in range(0, len(text), CHUNK):
                chunk = torch.tensor([text[start:start + CHUNK]], device=runner.device)
                positions = skip + start + torch.arange(chunk.shape[1], device=runner.device)[None]
                logits = match_vocab(runner.forward(chunk, positions, rows=slice(0, 1)).logits[0], vocab_size)
                guesses += logits.argmax(dim=-1).tolist()
                features.append(distribution_features(torch.softmax(logits.float(), dim=-1)).cpu())
        first = len(prompt) - skip - 1  # guesses[first + p] is the guess for answer[p]
        agree = [False] + [guesses[first + p] == answer[p] for p in range(1, len(answer))]
        found.append(TurnGuesses(agree, torch.cat(features)[first:first + len(answer)].numpy()))
    runner.truncate([0], rows=slice(0, 1))
    return found


def agreement_runs(turns: Sequence[RecordedTurn], runner, window: int | None, vocab_size: int) -> list[list[int]]:
    """Per turn and answer position p: how many answer tokens from p on the draft guesses in a row,
    each given the true prefix (draft_guesses). Position 0, the prefill's token, is 0."""
    runs = []
    for guessed in draft_guesses(turns, runner, window, vocab_size):
        row = [0] * (len(guessed.agree) + 1)
        for p in range(len(guessed.agree) - 1, 0, -1):
            row[p] = row[p + 1] + 1 if guessed.agree[p] else 0
        runs.append(row[:len(guessed.agree)])
    return runs


def prompt_read_cost(turn: RecordedTurn, window: int | None, draft_cost: CostFn) -> float:
    """The least the draft's reading of a request's prompt window costs (in target steps).

    DraftModelProposer, asked first after the plain first step (the window and one answer token
    unread), reads CATCH_UP_CHUNK tokens a step while more than that are unread; the rest it reads
    in the forward that gives its first draft, which the oracle prices as a drafted token."""
    unread = (len(turn.prompt_ids) if window is None else min(window, len(turn.prompt_ids))) + 1
    chunks = -(-max(0, unread - CATCH_UP_CHUNK) // CATCH_UP_CHUNK)
    return chunks * draft_cost(CATCH_UP_CHUNK)


def draft_oracle(turn: RecordedTurn, runs: Sequence[int], k: int, cost: CostFn, draft_cost: CostFn | None,
                 window: int | None, copies: Sequence[int] | None = None) -> tuple[float, TurnSteps]:
    """The cheapest decode of this answer (time in target steps, and its steps) by an oracle that
    drafts at most k tokens a step, each step exactly as many as will be accepted, from the draft
    model (runs: agreement_runs) or, where copies (the copy ceiling's lengths) are given, from
    the longest seen continuation too. It pays the draft's prompt read once if it drafts at all."""
    per_token = 0.0 if draft_cost is None else draft_cost(1)
    drafted = [min(run, k) for run in runs]
    copy_source = [([min(n, k) for n in copies], 0.0)] if copies is not None else [([0] * len(runs), 0.0)]
    without_draft = cheapest_path(turn, copy_source, cost)
    with_draft = cheapest_path(turn, [(drafted, per_token), *copy_source], cost)
    read = 0.0 if draft_cost is None else prompt_read_cost(turn, window, draft_cost)
    if with_draft[0] + read < without_draft[0]:
        return with_draft[0] + read, with_draft[1]
    return without_draft


class DraftOracles:
    """replay_rows()'s oracles for one loaded draft: at each k, the draft oracle (the draft method's
    prompt window) and the ngram+draft oracle (the hybrid's shorter window, and the copy ceiling)."""

    def __init__(self, runner, vocab_size: int, cost: CostFn, draft_cost: CostFn | None) -> None:
        self.runner, self.vocab_size, self.cost, self.draft_cost = runner, vocab_size, cost, draft_cost
        self._runs: dict[int | None, list[list[int]]] = {}  # per window, computed once for every k

    def __call__(self, turns: Sequence[RecordedTurn], k: int, copies: list[list[int]]) -> list[ReplayRow]:
        rows = []
        for label, window, with_copies in (("draft oracle", CONTEXT_WINDOW, False),
                                           (NGRAM_DRAFT_ORACLE, DRAFT_CONTEXT_WINDOW, True)):
            if window not in self._runs:
                self._runs[window] = agreement_runs(turns, self.runner, window, self.vocab_size)
            best = [draft_oracle(turn, runs, k, self.cost, self.draft_cost, window, copy if with_copies else None)
                    for turn, runs, copy in zip(turns, self._runs[window], copies)]
            rows.append(ReplayRow(label, k, tally(turns, [steps for _, steps in best], self.cost,
                                                  [time for time, _ in best])))
        return rows
