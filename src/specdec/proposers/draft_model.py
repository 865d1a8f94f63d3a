"""A small language model as the proposer (Chen et al. 2023, Algorithm 2), for one row or many.

Row b of the draft's cache belongs to the request in row b of the target's (one row for SpecEngine,
a server's slots for BatchEngine). Each row samples its drafts autoregressively from its own warped
distribution, with its own generator, so it draws exactly the random numbers it would draw alone;
one draft forward per drafted position serves every row at once. After verification each row's
cache is cut back to its accepted prefix. A cache never holds the token that closed a step (the
recovered or bonus token, and when all k were accepted also its own k-th draft, which it sampled
but never fed), so the next propose() first feeds whatever committed tokens a row has not seen:
usually one, two after a full acceptance, in one right-padded forward whose logits at each row's
last real token give its first draft.

The draft's prefill is the one cost of speculation that plain decoding does not have (on the
embedded pair ~40% of the target's prefill time), so it is kept out of the way:
- a request's first step is plain (the engines do not ask the proposer), so the first token comes
  as soon as plain decoding's;
- a long prompt is read in chunks of CATCH_UP_CHUNK tokens, one per step, drafting nothing for
  that row until it has caught up (those steps are plain);
- a row reads only the prompt's last CONTEXT_WINDOW tokens (the positions stay the true ones). A
  draft's context changes only how good its guesses are, never the output; what a long document
  adds, copying from it, is the n-gram proposer's strength (ngram+draft).
In a batch, a row further behind than two tokens (a new request, one that ran while speculation
was paused, one whose steps the n-gram lookup proposed) first reads alone up to one token short,
so no other row pays for its padding.

With a confidence threshold (`--k auto`; transformers' assistant_confidence_threshold) a row stops
after the first token it drew with a probability below the threshold: its later guesses would
mostly be rejected and each costs a draft forward and a verified position. A learned rule
(proposers/stop_rules.py) stops where the chance the whole chain is accepted falls low. Where to
stop depends only on the draft's own distribution and draws, never on the target, so verification
stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from specdec.option_fields import flagged
from specdec.models.runner import ModelRunner
from specdec.proposers.base import DraftProposal, ProposeContext, Proposer
from specdec.proposers.batched import BatchProposer
from specdec.proposers.entry import Build, MethodEntry
from specdec.proposers.stop_rules import STOP_RULES, ConfidenceStop, LearnedStop, stop_rule_named
from specdec.sampling.warp import sample_from_probs, warp_logits


def match_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Pad (with -inf) or cut the draft's logits [..., V_draft] to the target's width.

    Same-tokenizer pairs often differ only in padding rows of the embedding
    (e.g. a 151,936-row head over a 151,665-token vocabulary).
    """
    width = logits.shape[-1]
    if width == vocab_size:
        return logits
    if width > vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - width), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


CATCH_UP_CHUNK = 64  # prompt tokens the draft reads per step while it is behind
CONTEXT_WINDOW = 256  # the draft reads at most this many of the prompt's last tokens
DEFAULT_CONFIDENCE = 0.4  # -k auto's stop: below this probability a drafted token ends the row's draft


@dataclass(frozen=True)
class DraftOptions:
    """Where the draft model's chain stops under -k auto (proposers/stop_rules.py)."""

    GROUP: ClassVar[str] = "draft"
    TITLE: ClassVar[str] = "the draft model's chain"
    stop: str = flagged("threshold", "where -k auto stops the draft model's chain: threshold (after a token drawn "
                        "below --draft-confidence; the default), learned (the chance the whole chain is "
                        "accepted, estimated from the draft's distribution, falls low: the rule that ships, "
                        "fitted for the 0.5B Qwen2.5-Coder draft; docs/adaptive-k.md) or FILE, a rule "
                        "benchmarks/draft_stop_rule.py wrote", parse=str, metavar="threshold|learned|FILE")

    def __post_init__(self) -> None:
        if self.stop not in STOP_RULES:
            stop_rule_named(self.stop, DEFAULT_CONFIDENCE)  # a clear error now, not when the model has loaded

    def rule(self, confidence: float | None) -> ConfidenceStop | LearnedStop | None:
        """The stop rule -k auto uses (confidence: --draft-confidence; None: no early stop, a fixed k)."""
        return None if confidence is None else stop_rule_named(self.stop, confidence)


class DraftModelProposer(BatchProposer):
    """runner: the draft model, one cache row per row of the target's (any ModelRunner for one row;
    the native runner's with_batch_size(n) for a batch)."""

    def __init__(self, runner: ModelRunner, confidence_threshold: float | None = None,
                 catch_up_chunk: int = CATCH_UP_CHUNK, context_window: int | None = CONTEXT_WINDOW,
                 stop_rule: ConfidenceStop | LearnedStop | None = None) -> None:
        if catch_up_chunk < 1:
            raise ValueError(f"catch_up_chunk must be >= 1, got {catch_up_chunk!r}")
        if context_window is not None and context_window < 1:
            raise ValueError(f"context_window must be >= 1 or None, got {context_window!r}")
        if confidence_threshold is not None and not 0.0 <= confidence_threshold < 1.0:
            raise ValueError(f"confidence_threshold must lie in [0, 1) or be None, got {confidence_threshold!r}")
        self.runner = runner
        # Where a row's chain stops early (proposers/stop_rules.py): the learned rule where given, else the threshold.
        self.stop_rule = stop_rule or (None if confidence_threshold is None else ConfidenceStop(confidence_threshold))
        self.catch_up_chunk, self.context_window = catch_up_chunk, context_window
        self.slots = runner.batch_size
        self._proposal_start = [0] * self.slots  # context length when the row's last proposal was made
        self._fed_drafts = [0] * self.slots  # drafts of that proposal that sit in the row's cache
        self._skipped = [0] * self.slots  # leading context tokens the row's draft never reads

    @property
    def confidence_threshold(self) -> float | None:
        """The threshold a ConfidenceStop rule stops below (None: a learned rule, or a fixed k)."""
        return self.stop_rule.threshold if isinstance(self.stop_rule, ConfidenceStop) else None

    def start_row(self, row: int) -> None:
        """Empty the row; the first propose() prefills it (never, if this request is never drafted for)."""
        self.runner.truncate([0], rows=slice(row, row + 1))
        self._proposal_start[row] = self._fed_drafts[row] = self._skipped[row] = 0

    def unread_tokens(self, row: int, context_len: int) -> int:
        """Committed tokens the row's draft has not read: what its next proposals feed before they can
        draft; at a request's start, the prompt's last context_window tokens."""
        cached = self._row_length(row)
        skipped = self._skipped[row] if cached else self._window_skip(context_len)
        return max(0, context_len - cached - skipped)

    def has_read(self, row: int) -> bool:
        """Whether the row's draft has read any of its request (a fresh row reads its window first)."""
        return self._row_length(row) > 0

    def _window_skip(self, context_len: int) -> int:  # leading tokens a fresh request's draft never reads
        return 0 if self.context_window is None else max(0, context_len - self.context_window)

    def _row_length(self, row: int) -> int:
        return self.runner.row_lengths(slice(row, row + 1))[0]

    def propose(self, contexts: Sequence[ProposeContext], max_ks: Sequence[int]) -> DraftProposal:
        device, batch = self.runner.device, len(contexts)
        rows = slice(0, batch)
        lengths = [ctx.token_ids.shape[1] for ctx in contexts]
        room = min(self.runner.max_context - length for length in lengths)  # every row writes k positions
        max_ks = [max(0, min(max_k, room)) for max_k in max_ks]
        for row, length in enumerate(lengths):  # a row's first proposal (empty cache): where its window starts
            if max_ks[row] and self._row_length(row) == 0:
                self._skipped[row] = self._window_skip(length)
        # A row far behind reads one chunk alone and drafts nothing this step.
        seen = [n + skip for n, skip in zip(self.runner.row_lengths(rows), self._skipped)]
        for row, ctx in enumerate(contexts):
            if max_ks[row] and lengths[row] - seen[row] > self.catch_up_chunk:
                self._read(ctx, row, seen[row], seen[row] + self.catch_up_chunk)
                max_ks[row] = 0
        k = max(max_ks, default=0)
        if k < 1:
            return DraftProposal.empty(batch, device)

        # 1. Catch up: each row feeds the committed tokens it has not seen, padded on the right.
        #    A row drafting nothing this step and far behind (its first step, or reading a long
        #    prompt in chunks) is idle: it gets one padding token, cut off again, and keeps its cache.
        skipped = self._skipped[:batch]
        seen = [n + skip for n, skip in zip(self.runner.row_lengths(rows), skipped)]
        cached = [min(n, length - 1) for n, length in zip(seen, lengths)]
        self.runner.truncate([c - skip for c, skip in zip(cached, skipped)], rows=rows)  # guards the convention
        idle = [max_ks[row] == 0 and lengths[row] - cached[row] > 2 for row in range(batch)]
        for row, ctx in enumerate(contexts):
            if batch > 1 and lengths[row] - cached[row] > 2 and not idle[row]:  # behind: alone, up to one short
                self._read(ctx, row, cached[row], lengths[row] - 1)
                cached[row] = lengths[row] - 1
        missing = [1 if idle[row] else lengths[row] - cached[row] for row in range(batch)]
        width = max(missing)
        inputs = torch.zeros(batch, width, dtype=torch.int64)
        for row, ctx in enumerate(contexts):
            if not idle[row]:
                inputs[row, :missing[row]] = ctx.token_ids[0, cached[row]:].cpu()
        positions = torch.tensor(cached)[:, None] + torch.arange(width)[None]
        # One row: only its last position's logits (a catch-up after copied steps may feed many tokens).
        logits = self.runner.forward(inputs.to(device), positions.to(device), rows=rows,
                                     last_n_logits=1 if batch == 1 else None).logits
        logits = logits[torch.arange(batch), torch.tensor(missing) - 1 if batch > 1 else -1]  # [B, V]
        valid = [cached[row] if idle[row] else lengths[row] for row in range(batch)]  # what each row's cache holds
        self.runner.truncate([n - skip for n, skip in zip(valid, skipped)], rows=rows)

        # 2. Draft up to max_ks[b] tokens per row, each row from its own warp and generator.
        # Per row: its drafted tokens, lowered where the row stops early, and the stop rule's running state.
        drafted, survival = list(max_ks), [1.0] * batch
        draft_ids = torch.zeros(batch, k, dtype=torch.int64, device=device)
        sampled = any(not ctx.params.greedy for ctx in contexts)
        draft_probs = torch.zeros(batch, k, contexts[0].vocab_size, device=device) if sampled else None
        fed = 0  # draft forwards: drafts 0..fed-1 of every drafting row sit in its cache
        for i in range(k):
            logits = match_vocab(logits, contexts[0].vocab_size)  # [B, V]
            for row, ctx in enumerate(contexts):
                if i >= drafted[row]:
                    continue  # padding: fed but never sampled, so the row's generator is untouched
                if ctx.params.greedy:
                    token, probs = logits[row].argmax(), None  # point mass: greedy_verify needs no probs
                else:
                    probs = warp_logits(logits[row:row + 1], ctx.params)  # [1, V]
                    token = sample_from_probs(probs, ctx.generator)[0]
                    draft_probs[row, i] = probs[0]
                draft_ids[row, i] = token
                stop, survival[row] = self._stops(logits[row], probs, token, i, survival[row])
                if stop:
                    drafted[row] = i + 1
            if i + 1 >= max(drafted):
                break
            step_positions = torch.tensor(lengths, device=device)[:, None] + i
            logits = self.runner.forward(draft_ids[:, i:i + 1], step_positions, rows=rows).logits[:, -1]
            fed += 1

        self._proposal_start[:batch] = valid
        self._fed_drafts[:batch] = [0 if idle[row] else fed for row in range(batch)]
        width = max(drafted)
        num_tokens = torch.tensor(drafted, dtype=torch.int64, device=device)
        real = torch.arange(width, device=device)[None] < num_tokens[:, None]
        token_ids = torch.where(real, draft_ids[:, :width], -1)
        return DraftProposal(token_ids, num_tokens, None if draft_probs is None else draft_probs[:, :width])

    def _read(self, ctx: ProposeContext, row: int, start: int, stop: int) -> None:
        """Feed the row's committed tokens start..stop-1 (its own forward; only the cache matters)."""
        device = self.runner.device
        self.runner.forward(ctx.token_ids[:, start:stop].to(device), torch.arange(start, stop, device=device)[None],
                            rows=slice(row, row + 1), last_n_logits=1)

    def _stops(self, logits: torch.Tensor, probs: torch.Tensor | None, token: torch.Tensor, position: int,
               survival: float) -> tuple[bool, float]:
        """The stop rule on the token just drafted: the distribution it was drawn from (sampling: the warped
        probs [1, V]; greedy: the softmax of logits [V]) -> (stop after it, the rule's running state)."""
        if self.stop_rule is None:
            return False, survival
        drawn_from = torch.softmax(logits.float(), dim=-1) if probs is None else probs[0]
        return self.stop_rule.stops(drawn_from, int(token), position, survival)

    def on_verified(self, num_accepted: torch.Tensor) -> None:
        # Keep each row's context plus the accepted drafts that were fed; drop the rest.
        accepted = num_accepted.reshape(-1).tolist()
        keep = [start + min(a, fed) - skip for start, a, fed, skip
                in zip(self._proposal_start, accepted, self._fed_drafts, self._skipped)]
        self.runner.truncate(keep, rows=slice(0, len(keep)))

    def move_row(self, source: int, destination: int) -> None:
        self.runner.move_row(source, destination)
        self._proposal_start[destination] = self._proposal_start[source]
        self._fed_drafts[destination] = self._fed_drafts[source]
        self._skipped[destination] = self._skipped[source]


def draft_model_for(build: Build, confidence: float | None, context_window: int = CONTEXT_WINDOW) -> DraftModelProposer:
    """The loaded draft model as a proposer of build's rows (a clear error where none is loaded)."""
    if build.draft_runner is None:
        raise ValueError(f"method {build.method!r} needs a draft model (--draft)")
    if build.draft_bridge is not None:
        raise ValueError(f"method {build.method!r} needs a draft with the target's tokenizer; one with another "
                         "tokenizer drafts with --method draft or ngram+draft")
    if getattr(build.draft_runner, "batch_size", 1) != build.slots:
        raise ValueError(f"the draft model needs one cache row per slot ({build.slots}): a native runner's "
                         "with_batch_size(slots)")
    return DraftModelProposer(build.draft_runner, context_window=context_window,
                              stop_rule=build.option(DraftOptions).rule(confidence))


def _build(build: Build) -> Proposer | DraftModelProposer:
    confidence = build.draft_confidence if build.adaptive else None
    if build.draft_bridge is None:
        return draft_model_for(build, confidence)
    from specdec.proposers.cross_vocabulary import CrossVocabularyDraftProposer

    if build.slots != 1:
        raise ValueError("a draft with another tokenizer drafts for one request at a time (generate, bench, "
                         "verify, specdec.load), not for a server's batch")
    return CrossVocabularyDraftProposer(build.draft_runner, build.draft_bridge,
                                        stop_rule=build.option(DraftOptions).rule(confidence))


METHOD_ENTRIES = (
    MethodEntry("draft", "a small draft model proposes k tokens, the target verifies them (Chen et al. "
                "Algorithm 2); one with another tokenizer drafts the tokens both spell the same (Timor et al. "
                "2025)", _build, needs_draft_model=True, options=(DraftOptions,), replayable=True),
)
