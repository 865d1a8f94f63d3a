"""Per-request state: committed tokens, and where generation must stop.

The verifier may accept a whole draft in one go; this is where EOS, stop
strings and max_new_tokens cut it, token by token, so that nothing past them
is ever emitted, whichever step they fall in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec.sampling.params import SamplingParams
from specdec.sampling.warp import warp_logits


def chat_template_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The tokenizer's chat template over messages, ending with the assistant's turn opened."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in transformers 5


def encode_prompt(tokenizer, prompt: str | Sequence[int], max_context: int, chat: bool = False,
                  vocab_size: int | None = None) -> list[int]:
    """Prompt text (optionally wrapped in the chat template) or ids -> ids, validated against the
    context (and, for ids, against the vocabulary: an id past the embedding would crash the forward)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
        if chat:
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError("--chat: this tokenizer has no chat template")
            ids = chat_template_ids(tokenizer, [{"role": "user", "content": prompt}])
        else:
            ids = tokenizer(prompt)["input_ids"]
    else:
        ids = [int(t) for t in prompt]
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in ids):
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            raise ValueError(f"token id {bad} is outside the model's vocabulary (0..{vocab_size - 1})")
    if not ids:
        raise ValueError("the prompt is empty")
    if len(ids) >= max_context:
        raise ValueError(
            f"the prompt has {len(ids)} tokens but the target's context window is "
            f"{max_context} tokens; shorten the prompt"
        )
    return list(ids)


def check_generation_options(max_new_tokens: int, stop: Sequence[str] | str) -> tuple[str, ...]:
    """Validate max_new_tokens and stop strings; returns the stop strings as a tuple."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if isinstance(stop, str):
        stop = (stop,)
    if any(not isinstance(s, str) or not s for s in stop):
        raise ValueError("stop strings must be non-empty strings")
    return tuple(stop)


def common_prefix_length(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """How many leading tokens a and b share, at most limit (both engines' prompt caches)."""
    length, limit = 0, min(limit, len(a), len(b))
    while length < limit and a[length] == b[length]:
        length += 1
    return length


@dataclass(frozen=True)
class TokenLogprob:
    """One committed token's log-probability under the target, and the `top` most likely
    alternatives at its position, as (token id, log-probability), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, token_ids: list[int], params: SamplingParams, top: int) -> list[TokenLogprob]:
    """Log-probabilities of token_ids[j] at logits[j] ([n, V]) under the distribution the request samples
    from: the target's warped distribution (temperature, top-k, top-p, min-p) when it samples; at
    temperature 0 the unwarped softmax, since the warped one is a point mass (vLLM and OpenAI report
    the same). Speculation does not change these: they are the target's, at the committed positions."""
    if not token_ids:
        return []
    logits = logits[: len(token_ids)].float()
    logprobs = torch.log_softmax(logits, dim=-1) if params.greedy else torch.log(warp_logits(logits, params))
    chosen = logprobs.gather(-1, torch.tensor(token_ids, device=logits.device)[:, None])[:, 0].tolist()
    alternatives = [[]] * len(token_ids)
    if top > 0:
        values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]), dim=-1)
        alternatives = [[(i, v) for i, v in zip(row_ids, row_values) if v != float("-inf")]  # filtered out: none
                        for row_ids, row_values in zip(ids.tolist(), values.tolist())]
    return [TokenLogprob(token, value, tuple(alts)) for token, value, alts in zip(token_ids, chosen, alternatives)]


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    tokenizer: object | None = None  # needed for text and stop strings
    generated: list[int] = field(default_factory=list)
    logprobs: int | None = None  # None: none; N >= 0: each token's log-probability and its N top alternatives
    token_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per generated token, when asked
    finish_reason: str | None = None  # "eos" | "stop" | "length"
    text: str = ""
    _streamed_chars: int = 0

    def __post_init__(self) -> None:
        if self.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)

    def commit(self, new_ids: list[int]) -> list[int]:
        """Append verified tokens one at a time until a stop condition; return those kept."""
        kept: list[int] = []
        for token in new_ids:
            if self.finished:
                break
            self.generated.append(token)
            kept.append(token)
            if token in self.eos_token_ids:
                self.finish_reason = "eos"
            elif self._cut_at_stop_string():
                self.finish_reason = "stop"
            elif self.remaining <= 0:
                self.finish_reason = "length"
        if self.tokenizer is not None and self.finish_reason != "stop":
            self.text = self._decode()
        return kept

    def finish(self, reason: str) -> None:
        self.finish_reason = self.finish_reason or reason

    def text_delta(self) -> str:
        """New text since the last call that is safe to show.

        Held back while unfinished: an incomplete UTF-8 sequence (decoded as
        U+FFFD) and any tail that could still grow into a stop string.
        """
        end = len(self.text)
        if not self.finished:
            while end > self._streamed_chars and self.text[end - 1] == "\ufffd":
                end -= 1
            for stop in self.stop:
                for n in range(min(len(stop) - 1, end), 0, -1):
                    if self.text[:end].endswith(stop[:n]):
                        end -= n
                        break
        end = max(end, self._streamed_chars)
        delta = self.text[self._streamed_chars : end]
        self._streamed_chars = end
        return delta

    def _decode(self) -> str:
        return self.tokenizer.decode(self.generated, skip_special_tokens=True)

    def _cut_at_stop_string(self) -> bool:
        if not self.stop:
            return False
        full = self._decode()
        # Only the tail can hold a new match: text before it was checked already.
        start = max(0, len(self.text) - max(len(s) for s in self.stop))
        hits = [i for i in (full.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = full[: min(hits)]
            return True
        self.text = full
        return False
