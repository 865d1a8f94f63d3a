"""SpecEngine: one request at a time (prefill, generate, stream), a one-row client of the step.

Every step is engine/step.py's run_step over one row, the code BatchEngine runs over many: propose,
one target forward over [last_token, *draft], verify, roll back, then commit_row cuts at EOS /
stop string / max_new_tokens. What is SpecEngine's own: the prompt cache across requests
(reuse_prefix) and the request's first step being plain. `-k auto` is the same controller
BatchEngine uses (engine/adaptive.py), over one row.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from specdec.engine.adaptive import AdaptiveK
from specdec.engine.metrics import RequestStats
from specdec.engine.request import Request, check_generation_options, common_prefix_length, encode_prompt
from specdec.engine.step import Row, StepResult, commit_row, queue_hidden, run_adaptive_step, select_target_features
from specdec.models.loader import eos_ids_of
from specdec.models.runner import ModelRunner
from specdec.proposers.base import Proposer
from specdec.proposers.batched import BatchProposer, as_batch
from specdec.sampling.params import SamplingParams


@dataclass
class StreamChunk:
    text: str  # new text since the previous chunk
    token_ids: list[int]  # tokens committed in this step
    finish_reason: str | None = None  # set on the last chunk: "eos" | "stop" | "length"
    stats: RequestStats | None = None  # set on the last chunk


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    stats: RequestStats = field(default_factory=RequestStats)


class SpecEngine:
    """Speculative decoding of one target with one proposer (None = plain decoding).

    >>> engine = SpecEngine(target_runner, DraftModelProposer(draft_runner), tokenizer, k=4)
    >>> engine.generate("def fib(n):", SamplingParams(temperature=0), max_new_tokens=64).text

    k="auto" lets an AdaptiveK (engine/adaptive.py) choose each step's k in
    0..max_k from the request's recent acceptance and the measured step costs.
    """

    def __init__(
        self,
        target: ModelRunner,
        proposer: Proposer | BatchProposer | None = None,
        tokenizer: object | None = None,
        *,
        k: int | str = 4,
        eos_token_ids: frozenset[int] | None = None,
        max_k: int = 8,
        reuse_prefix: bool = True,
    ) -> None:
        if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"k (draft tokens per step) must be an integer >= 1 or 'auto', got {k!r}")
        self.target = target
        self.proposer = proposer
        # The step's view of it: a batch of one row (a single-sequence Proposer, through a RowwiseProposer).
        self._rows_proposer = as_batch(proposer)
        self.tokenizer = tokenizer
        self.k = k
        self.adaptive = AdaptiveK.for_proposer(max_k, proposer) if k == "auto" else None
        self._k_cap = max_k if k == "auto" else k  # the most a step drafts
        self.eos_token_ids = eos_ids_of(tokenizer) if eos_token_ids is None else frozenset(eos_token_ids)
        self._keeps_hidden = proposer is not None and proposer.reads_target_hidden
        # Prompt caching across requests (what llama-server's cache_prompt and vLLM's prefix caching
        # do): the target's cache still holds the last request's prompt and answer, so a prompt that
        # starts the same (a system prompt, a tool schema, the conversation so far) prefills only
        # the rest. Exact wherever a forward in pieces equals one forward (the native runner's
        # chunking invariance; not the transformers backend). Heads need the target's features of
        # every prompt token, so they prefill afresh.
        self.reuse_prefix = (reuse_prefix and not self._keeps_hidden
                             and bool(getattr(target, "exact_prefix_reuse", False)))
        self._cached: tuple[int, list[int]] | None = None  # (the runner's cache_version, the ids cached)

    # ---- input edge -------------------------------------------------------------------------

    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Prompt text (optionally wrapped in the chat template) or ids -> ids, validated."""
        return encode_prompt(self.tokenizer, prompt, self.target.max_context, chat, self.target.vocab_size)

    # ---- API --------------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        max_new_tokens: int = 128,
        stop: Sequence[str] = (),
        chat: bool = False,
    ) -> GenerationResult:
        request = self._make_request(prompt, params, max_new_tokens, stop, chat)
        stats = RequestStats()
        for _ in self._run(request, stats):
            pass
        return GenerationResult(
            text=request.text,
            token_ids=list(request.generated),
            prompt_token_ids=request.prompt_ids,
            finish_reason=request.finish_reason or "length",
            stats=stats,
        )

    def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        max_new_tokens: int = 128,
        stop: Sequence[str] = (),
        chat: bool = False,
    ) -> Iterator[StreamChunk]:
        """Yield text and tokens as soon as each step verifies them."""
        request = self._make_request(prompt, params, max_new_tokens, stop, chat)
        stats = RequestStats()
        for kept in self._run(request, stats):
            text = request.text_delta() if self.tokenizer is not None else ""
            if request.finished:
                yield StreamChunk(text, kept, request.finish_reason, stats)
                return
            if kept or text:
                yield StreamChunk(text, kept)

    def sample_continuations(
        self, prompt: str | Sequence[int], params: SamplingParams, samples: int, *, min_tokens: int = 2,
        seed: int = 0, chat: bool = False,
    ) -> Iterator[list[int]]:
        """Draw `samples` continuations of one prompt, each at least min_tokens long, for losslessness checks.

        The prompt is prefilled once; each draw then runs ordinary steps (with its own
        generator, seeded seed + i) until min_tokens are out, and rolls everything back
        to the prompt. Speculative and plain engines yield identically distributed
        lists if and only if speculation is lossless; EOS and max_tokens cuts are
        ignored here, on purpose: they do not change which tokens are drawn.
        """
        ids = self.encode(prompt, chat)
        prompt_row = Row(Request(ids, params, max_new_tokens=min_tokens), None, list(ids))
        self._prefill(prompt_row)
        for index in range(samples):
            step_params = replace(params, seed=seed + index)
            generator = step_params.make_generator(self.target.device)
            row = Row(Request(ids, step_params, max_new_tokens=min_tokens), generator, list(ids),
                      pending_hidden=prompt_row.pending_hidden)
            self.target.truncate(torch.tensor([len(ids) - 1]))
            self._start_request()
            while len(row.tokens) - len(ids) < min_tokens:
                context_left = self.target.max_context - len(row.tokens)
                if context_left <= 1:
                    raise ValueError("the prompt leaves no room in the context for the sampled tokens")
                row.tokens += self._step(row, min(self._k_cap, context_left - 1)).tokens[0]
            yield row.tokens[len(ids):]

    # ---- the loop ---------------------------------------------------------------------------

    def _make_request(self, prompt, params, max_new_tokens, stop, chat) -> Request:
        stop = check_generation_options(max_new_tokens, stop)
        return Request(
            prompt_ids=self.encode(prompt, chat),
            params=params or SamplingParams(),
            max_new_tokens=max_new_tokens,
            eos_token_ids=self.eos_token_ids,
            stop=stop,
            tokenizer=self.tokenizer,
        )

    def _run(self, request: Request, stats: RequestStats) -> Iterator[list[int]]:
        """Prefill, then steps until the request finishes; yields the tokens of each step."""
        row = Row(request, request.params.make_generator(self.target.device), list(request.prompt_ids), stats)
        stats.prompt_tokens = len(row.tokens)
        started = request_started = time.perf_counter()
        self._start_request()
        stats.prompt_tokens_reused = self._prefill(row)
        stats.prefill_time_s = time.perf_counter() - started

        started = time.perf_counter()
        while not request.finished:
            # At most remaining-1 drafts: a step emits num_accepted + 1 tokens. The first step is
            # plain, so the first token comes as soon as plain decoding's (time to first token):
            # a proposer's own prefill (a draft model reading the prompt) starts at the second.
            context_left = self.target.max_context - len(row.tokens)
            first_step = stats.target_forwards == 0
            max_k = 0 if first_step else min(self._k_cap, request.remaining - 1, context_left - 1)
            kept = commit_row(row, self._step(row, max_k), 0, self.target.max_context)
            stats.decode_time_s = time.perf_counter() - started
            if kept and not stats.first_token_s:
                stats.first_token_s = time.perf_counter() - request_started
            yield kept
        if self.proposer is not None:  # what was written (suffix decoding's cache learns across requests)
            self._rows_proposer.end_row(0, request.prompt_ids, request.generated)
        if self.reuse_prefix:  # the cache holds the committed tokens' keys up to its length
            cached = min(self.target.seq_len, len(row.tokens))
            self._cached = (self.target.cache_version, row.tokens[:cached])

    def forget_earlier_requests(self) -> None:
        """Empty what the proposer learned from earlier requests (suffix decoding's cache), so the
        next request runs as if it were the first (the bench measures requests alone this way)."""
        self._cached = None
        if self.proposer is not None:
            self._rows_proposer.forget_earlier_requests()

    def _start_request(self) -> None:
        if self.proposer is not None:
            self._rows_proposer.start_row(0)
        if self.adaptive is not None:
            self.adaptive.start_row(0)

    def _prefill(self, row: Row) -> int:
        """A target cache holding every token but the last, which opens the first step; returns how
        many of them the last request left cached (reuse_prefix), which are not read again."""
        reused = self._reusable_prefix(row.tokens)
        if reused:
            self.target.truncate([reused])
        else:
            self.target.reset()
        self._cached = None
        if self._keeps_hidden:
            select_target_features(self.target, self.proposer.target_layers)
        if len(row.tokens) - 1 > reused:
            device = self.target.device
            ids = torch.tensor([row.tokens[reused:-1]], dtype=torch.int64, device=device)
            positions = torch.arange(reused, len(row.tokens) - 1, device=device)[None]
            output = self.target.forward(ids, positions, last_n_logits=1)
            if self._keeps_hidden:
                queue_hidden(row, output.hidden)
        return reused

    def _reusable_prefix(self, tokens: list[int]) -> int:
        """Leading prompt tokens (all but the last) whose keys the target's cache holds from the
        last request, untouched since: the common prefix of the two token lists."""
        if not self.reuse_prefix or self._cached is None or self._cached[0] != self.target.cache_version:
            return 0
        return common_prefix_length(self._cached[1], tokens, len(tokens) - 1)

    def _step(self, row: Row, max_k: int) -> StepResult:
        """The shared step over this one row (k at most max_k, chosen by -k auto's controller); then a
        tree budget learns from it."""
        result = run_adaptive_step(self.target, self._rows_proposer, [row], [max_k], self.adaptive, [0])
        if result.trees[0] is not None and self._rows_proposer.tree_budget is not None:  # --tree-size auto
            self._rows_proposer.tree_budget.record(verified_tokens=result.width + 1, verify_s=result.verify_s,
                                             accepted=result.accepted[0])
        return result
