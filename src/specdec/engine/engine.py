"""SpecEngine: one request at a time (generate, stream), a BatchEngine of one row.

Every request runs through engine/batch.py's BatchEngine over one cache row: the same prefill,
prompt cache across requests (a prompt that starts like the last request's prompt and answer
prefills only the rest), first step plain, then engine/step.py's run_step until the request
finishes. What SpecEngine adds: the blocking and streaming calls of one request, the check that no
other engine used the target's cache in between (engines may share one target's weights and
cache), and sample_continuations for losslessness checks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

from specdec.engine.adaptive import AdaptiveK
from specdec.engine.batch import BatchEngine
from specdec.engine.metrics import RequestStats
from specdec.engine.request import Request, encode_prompt
from specdec.engine.step import Row, prefill, record_step_costs, run_adaptive_step
from specdec.models.runner import ModelRunner
from specdec.proposers.base import Proposer
from specdec.proposers.batched import BatchProposer
from specdec.sampling.params import SamplingParams


class GenerationError(RuntimeError):
    """The request failed on its own (e.g. the target's logits held no token to emit); nothing
    wrong was emitted before it."""


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

    Args:
        target: the model whose distribution the output keeps (a ModelRunner: models/native or the
            transformers runner).
        proposer: what drafts (a Proposer for one row or a BatchProposer); None = plain decoding.
        tokenizer: the target's (a transformers tokenizer); None where prompts come as ids and text
            is not needed.
        k: drafted tokens per step, an int >= 1, or "auto": an AdaptiveK (engine/adaptive.py) chooses
            each step's k in 0..max_k from the request's recent acceptance and the measured step costs.
        eos_token_ids: tokens that end a request (default: the tokenizer's).
        reuse_prefix: prompt caching across requests (BatchEngine's prompt_cache: exact wherever a
            forward in pieces equals one forward, the native runner's chunking invariance; not the
            transformers backend, nor proposers that read the target's features).
    """

    def __init__(self, target: ModelRunner, proposer: Proposer | BatchProposer | None = None,
                 tokenizer: object | None = None, *, k: int | str = 4, eos_token_ids: frozenset[int] | None = None,
                 max_k: int = 8, reuse_prefix: bool = True) -> None:
        self.engine = BatchEngine(target, proposer, tokenizer, k=k, eos_token_ids=eos_token_ids, max_k=max_k,
                                  prompt_cache=reuse_prefix)
        self.target, self.proposer, self.tokenizer, self.k = target, proposer, tokenizer, k
        self.eos_token_ids = self.engine.eos_token_ids
        self._cache_version = None  # the target's cache_version when the last request ended

    @property
    def reuse_prefix(self) -> bool:
        return self.engine.prompt_cache

    @reuse_prefix.setter
    def reuse_prefix(self, on: bool) -> None:
        self.engine.prompt_cache = on and self.engine.prompt_cache_possible
        if not on:
            self.engine.forget_prompt_cache()

    @property
    def adaptive(self) -> AdaptiveK | None:
        """-k auto's controller (None: a fixed k)."""
        return self.engine.adaptive

    @adaptive.setter
    def adaptive(self, controller: AdaptiveK | None) -> None:
        self.engine.adaptive = controller

    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Prompt text (optionally wrapped in the chat template) or ids -> ids, validated."""
        return encode_prompt(self.tokenizer, prompt, self.target.max_context, chat, self.target.vocab_size)

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                 max_new_tokens: int = 128, stop: Sequence[str] = (), chat: bool = False) -> GenerationResult:
        """Decode one request to its end.

        Args:
            prompt: text (tokenized here; with chat=True wrapped in the tokenizer's chat template first)
                or token ids; it must fit the target's context with max_new_tokens.
            params: the warp and randomness (temperature 0 = greedy; a seed makes a sampled run
                repeat); None = greedy.
            max_new_tokens: tokens to write at most; stop: strings that end the answer where they appear
                (not included in the text).
        Returns:
            GenerationResult: the text, its token ids, the prompt's ids, finish_reason ("eos", "stop" or
            "length") and the request's RequestStats (acceptance, tau, prefill and decode times).
        Raises:
            ValueError: bad input (a prompt longer than the context, max_new_tokens < 1, ids outside
                the vocabulary), before any forward; GenerationError: the request failed on its own.
        """
        request = self.engine.make_request(prompt, params, max_new_tokens=max_new_tokens, stop=stop, chat=chat)
        stats = RequestStats()
        for update in self._run(request):
            stats = update.stats
        return GenerationResult(text=request.text, token_ids=list(request.generated),
                                prompt_token_ids=request.prompt_ids, finish_reason=request.finish_reason or "length",
                                stats=stats)

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               max_new_tokens: int = 128, stop: Sequence[str] = (), chat: bool = False) -> Iterator[StreamChunk]:
        """Yield text and tokens as soon as each step verifies them; arguments as generate().

        Returns:
            An iterator of StreamChunk: each step's new text and token ids; the last chunk carries
            finish_reason and the request's RequestStats.
        """
        request = self.engine.make_request(prompt, params, max_new_tokens=max_new_tokens, stop=stop, chat=chat)
        for update in self._run(request):
            if update.finish_reason is not None:
                yield StreamChunk(update.text, update.token_ids, update.finish_reason, update.stats)
            elif update.token_ids or update.text:
                yield StreamChunk(update.text, update.token_ids)

    def _run(self, request: Request):
        """Prefill, then steps until the request finishes; yields each step's RowUpdate."""
        if getattr(self.target, "cache_version", None) != self._cache_version:
            self.engine.forget_prompt_cache()  # another engine wrote the target's cache since
        try:
            self.engine.add(0, request)
            while self.engine.running:
                for update in self.engine.step():
                    if update.error is not None:  # the request's own failure (engine/batch.py's _commit)
                        raise GenerationError(update.error)
                    yield update
        finally:
            if self.engine.running:  # given up mid-stream, or an error: nothing may stay running
                self.engine.clear()
            self._cache_version = getattr(self.target, "cache_version", None)

    def forget_earlier_requests(self) -> None:
        """Empty what was learned from earlier requests (the prompt cache, suffix decoding's cache),
        so the next request runs as if it were the first (the bench measures requests alone this way)."""
        self.engine.forget_earlier_requests()

    def sample_continuations(
        self, prompt: str | Sequence[int], params: SamplingParams, samples: int, *, min_tokens: int = 2,
        seed: int = 0, chat: bool = False,
    ) -> Iterator[list[int]]:
        """Draw `samples` continuations of one prompt, each at least min_tokens long, for losslessness checks.

        The prompt is prefilled once; each draw then runs ordinary steps (with its own
        generator, seeded seed + i), drafting from its first step, until min_tokens are out, and
        rolls everything back to the prompt. Speculative and plain engines yield identically
        distributed lists if and only if speculation is lossless; EOS and max_tokens cuts are
        ignored here, on purpose: they do not change which tokens are drafted or drawn.
        """
        engine, target = self.engine, self.target
        ids = self.encode(prompt, chat)
        prompt_row = Row(Request(ids, params, max_new_tokens=min_tokens), None, list(ids))
        target.truncate([0], rows=slice(0, 1))
        engine.forget_prompt_cache()  # its row is overwritten here
        if len(ids) > 1:
            prefill(target, prompt_row, 0, len(ids) - 1, 0, engine.features)
        for index in range(samples):
            step_params = replace(params, seed=seed + index)
            row = Row(Request(ids, step_params, max_new_tokens=min_tokens), step_params.make_generator(target.device),
                      list(ids), pending_hidden=prompt_row.pending_hidden)
            target.truncate([len(ids) - 1], rows=slice(0, 1))
            engine.start_row(0, 0)
            while len(row.tokens) - len(ids) < min_tokens:
                context_left = target.max_context - len(row.tokens)
                if context_left <= 1:
                    raise ValueError("the prompt leaves no room in the context for the sampled tokens")
                result = run_adaptive_step(target, engine.proposer, [row], [min(engine.k, context_left - 1)],
                                           engine.adaptive, [0])
                record_step_costs(engine.proposer, result)
                row.tokens += result.tokens[0]
            yield row.tokens[len(ids):]
