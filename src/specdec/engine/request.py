"""Per-request state: committed tokens, their text, and where generation must stop.

The verifier may accept a whole draft in one go; this is where EOS, stop
strings and max_new_tokens cut it, token by token, so that nothing past them
is ever emitted, whichever step they fall in.

The engine thread serves every client, so the per-token work here must not grow
with the answer: the text is detokenized incrementally (IncrementalText) and the
stop strings are searched for only in the new characters (StopStringMatcher),
so that a token costs the same at the 10th and the 10,000th position.
"""

from __future__ import annotations

import bisect
import functools
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


# Limits on a request's stop strings. OpenAI accepts up to 4 stop sequences; vLLM sets no limit.
# Real stop strings are short markers ("\n\n", "</answer>", "Observation:"), and 16 leaves room
# for tool and chat markers. Matching costs the same per character however long they are
# (StopStringMatcher), but each request builds a table as long as its stop strings, and a stop
# string of n characters makes the stream hold back up to n - 1 characters; 1,000 characters per
# string and 4,000 in all are far past any real marker and keep both small. The server checks the
# count in its request body too (server/protocol.py's MAX_STOP_STRINGS); an operator may pass
# other limits to check_generation_options.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1_000
MAX_STOP_CHARS_TOTAL = 4_000


def check_generation_options(max_new_tokens: int, stop: Sequence[str] | str, *,
                             max_stop_strings: int = MAX_STOP_STRINGS,
                             max_stop_string_chars: int = MAX_STOP_STRING_CHARS,
                             max_stop_chars_total: int = MAX_STOP_CHARS_TOTAL) -> tuple[str, ...]:
    """Validate max_new_tokens and stop strings (their count and lengths against the limits given);
    returns the stop strings as a tuple."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if isinstance(stop, str):
        stop = (stop,)
    stop = tuple(stop)
    if any(not isinstance(s, str) or not s for s in stop):
        raise ValueError("stop strings must be non-empty strings")
    if len(stop) > max_stop_strings:
        raise ValueError(f"at most {max_stop_strings} stop strings are allowed, got {len(stop)}")
    longest = max(stop, key=len, default="")
    if len(longest) > max_stop_string_chars:
        raise ValueError(f"a stop string may have at most {max_stop_string_chars} characters; "
                         f"stop string {stop.index(longest)} has {len(longest)}")
    total = sum(map(len, stop))
    if total > max_stop_chars_total:
        raise ValueError(f"the stop strings may have at most {max_stop_chars_total} characters in all, "
                         f"got {total}")
    return stop


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


REPLACEMENT_CHAR = "\ufffd"  # what an incomplete UTF-8 sequence decodes to, until its last byte comes


def decodes_piecewise(tokenizer) -> bool:
    """Whether decode(a + b) == decode(a) + decode(b) for this tokenizer whenever decode(a) ends on a
    whole character (not U+FFFD), so that an answer can be decoded a few tokens at a time.

    True for the Hugging Face tokenizers whose decoder joins the tokens' bytes and reads them as UTF-8
    (ByteLevel: GPT-2, Llama 3, Qwen, SmolLM) or joins their strings (Fuse), with no clean-up pass.
    False for the rest: SentencePiece's decoders strip the text's first space, WordPiece's join with
    spaces and its clean-up rewrites " ." as ".", so a token's text depends on what precedes it; those
    are decoded whole (IncrementalText)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return False
    from tokenizers import decoders  # transformers' own dependency; only a tokenizer that has a decoder gets here

    return isinstance(decoder, (decoders.ByteLevel, decoders.Fuse))


class IncrementalText:
    """tokenizer.decode(ids, skip_special_tokens=True) of a token list that grows at its end, at a
    cost linear in its length.

    New tokens are decoded together with the few before them that do not yet end on a whole
    character, the incremental detokenizing of HF's TextStreamer, vLLM and TGI's decode_token. Those
    also keep a window of earlier tokens as context, for SentencePiece's leading space; a piecewise
    decoder (decodes_piecewise) needs none, and only for those is the result exact, so any other
    tokenizer decodes the whole list at each call, as before.

    The text is the stable part and `pending`. The stable part begins the decode of every longer
    list. Pending is the text of the tokens after it, ending in U+FFFD: an incomplete UTF-8
    character, kept until a token ends one. (Where an answer is only U+FFFD characters, real or from
    bytes that are not UTF-8, they stay pending and are decoded again with each new token.) Not
    piecewise: the stable part is the whole decode less its trailing U+FFFD, and a later token may
    rewrite it; `kept` says how much of it the last call left unchanged.
    """

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.piecewise = decodes_piecewise(tokenizer)
        self._all_ids: list[int] = []  # not piecewise: the whole list, decoded at each call
        self._pending_ids: list[int] = []  # piecewise: the tokens after the last whole character
        self._pieces: list[str] = []  # the stable text, in pieces: appending one copies nothing
        self._piece_ends: list[int] = []  # where each piece ends in the stable text
        self.pending = ""
        self.kept = 0  # characters of the stable text before the last extend() that it left unchanged

    @property
    def stable_chars(self) -> int:
        return self._piece_ends[-1] if self._piece_ends else 0

    @property
    def text(self) -> str:
        """The whole text; joins the pieces once (their length), so read it at the end, not per token."""
        if len(self._pieces) > 1:
            self._pieces, self._piece_ends = ["".join(self._pieces)], [self.stable_chars]
        return (self._pieces[0] if self._pieces else "") + self.pending

    def text_from(self, start: int) -> str:
        """The text from character `start` on, at a cost of its length (and of the pieces it spans)."""
        stable_chars = self.stable_chars
        if start >= stable_chars:
            return self.pending[start - stable_chars:]
        first = bisect.bisect_right(self._piece_ends, start)  # the piece holding character `start`
        first_start = self._piece_ends[first] - len(self._pieces[first])
        return "".join(self._pieces[first:])[start - first_start:] + self.pending

    def extend(self, token_ids: Sequence[int]) -> None:
        if not token_ids:
            return
        stable_chars = self.stable_chars
        if self.piecewise:
            self._pending_ids += token_ids
            text = self._tokenizer.decode(self._pending_ids, skip_special_tokens=True)
            if text.endswith(REPLACEMENT_CHAR):
                self.pending = text
            else:  # it ends on a whole character: the tokens after it decode on their own
                self._pieces.append(text)
                self._piece_ends.append(stable_chars + len(text))
                self._pending_ids, self.pending = [], ""
            self.kept = stable_chars
            return
        self._all_ids += token_ids
        text = self._tokenizer.decode(self._all_ids, skip_special_tokens=True)
        stable, before = text.rstrip(REPLACEMENT_CHAR), self._pieces[0] if self._pieces else ""
        self.kept = stable_chars if stable.startswith(before) else common_prefix_length(before, stable, stable_chars)
        self._pieces, self._piece_ends = [stable], [len(stable)]
        self.pending = text[len(stable):]


@functools.lru_cache(maxsize=64)  # n choices of one request share their stop strings: built once
def _borders(stop: str) -> tuple[int, ...]:
    """borders[n]: the length of the longest proper prefix of stop[:n] that is also its suffix
    (Knuth-Morris-Pratt's failure function)."""
    borders, length = [0] * (len(stop) + 1), 0
    for i in range(1, len(stop)):
        while length and stop[i] != stop[length]:
            length = borders[length]
        if stop[i] == stop[length]:
            length += 1
        borders[i + 1] = length
    return tuple(borders)


class StopStringMatcher:
    """Finds the first stop string in a text that grows at its end, reading each character once.

    One Knuth-Morris-Pratt automaton per stop string (Knuth, Morris & Pratt, SIAM J. Comput. 1977):
    its state is the length of the longest end of the text read so far that begins the stop string.
    A new character costs O(1) amortized per stop string, however long the text and the stop strings,
    where searching the text again after each token cost its whole length. The state is also what
    text_delta must hold back: the end of the text that could still grow into a stop string.

    Only the stable text (IncrementalText) moves the states; the pending text, which a later token may
    change, is read from a copy of them each time.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._borders = [_borders(stop) for stop in self.stops]
        self._states = [0] * len(self.stops)
        self._longest = max(map(len, self.stops))
        self.checked = 0  # characters of the stable text that the states have read

    def find(self, text: IncrementalText) -> int | None:
        """Where the earliest stop string starts in the text, or None. A stop string that was in the
        text at the previous call was found then, so only those ending in the new text are looked for."""
        if text.kept < self.checked:
            # A whole decode rewrote the text from `kept` on. A state spans at most the last
            # (longest - 1) characters, so reading again from there, from empty states, rebuilds them.
            self.checked = max(0, text.kept - (self._longest - 1))
            self._states = [0] * len(self.stops)
        new = text.text_from(self.checked)
        new_stable = new[: text.stable_chars - self.checked]
        found = self._read(self._states, new_stable, self.checked)
        self.checked = text.stable_chars
        in_pending = self._read(list(self._states), text.pending, self.checked)
        return min((start for start in (found, in_pending) if start is not None), default=None)

    def holdback(self, after: str) -> int:
        """How many characters at the end of the text read so far followed by `after` could begin a
        stop string (`after`: pending text about to be shown)."""
        states = list(self._states)
        self._read(states, after, self.checked)
        return max(states)

    def _read(self, states: list[int], chars: str, offset: int) -> int | None:
        """Advance each stop string's state over chars (the text from character `offset`), in place.
        Returns where the earliest stop string completed in them starts, or None."""
        earliest, end = None, len(chars)
        for index, (stop, borders) in enumerate(zip(self.stops, self._borders)):
            state, position, length, first = states[index], 0, len(stop), stop[0]
            if state == length:  # found already (in the stable text before this pending text)
                continue
            while position < end:
                char = chars[position]
                if state == 0 and char != first:  # skip to where the stop string could begin, in C
                    position = chars.find(first, position + 1)
                    if position < 0:
                        break
                    char = chars[position]
                while state and stop[state] != char:
                    state = borders[state]
                if stop[state] == char:
                    state += 1
                    if state == length:
                        start = offset + position + 1 - length
                        earliest = start if earliest is None else min(earliest, start)
                        break
                position += 1
            states[index] = state
        return earliest


PLAIN_METHOD = "autoregressive"  # a request naming it decodes plainly (its k is 0)


@dataclass(frozen=True)
class Speculation:
    """What one request asks of speculation (the OpenAI body's `speculative` object; docs/server.md).

    method: one the engine has loaded (BatchEngine.request_methods), None: the engine's own;
    k: drafted tokens per step, an int >= 0 (0: plain decoding), "auto" (-k auto's controller
    chooses each step's), None: the engine's own k. Which tokens are drafted never changes what is
    emitted: verification keeps the target's output whatever the request chose."""

    method: str | None = None
    k: int | str | None = None

    def __post_init__(self) -> None:
        if self.method is not None and not isinstance(self.method, str):
            raise ValueError(f"the method must be a string, got {self.method!r}")
        if self.k not in (None, "auto") and (isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0):
            raise ValueError(f"k must be an integer >= 0 (0: plain decoding) or 'auto', got {self.k!r}")


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
    speculation: Speculation = field(default_factory=Speculation)  # the request's own method and k, if any
    _text: IncrementalText | None = field(default=None, init=False, repr=False)
    _stops: StopStringMatcher | None = field(default=None, init=False, repr=False)
    _cut_text: str | None = field(default=None, init=False, repr=False)  # the text, cut at a stop string
    _streamed_chars: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        if self.tokenizer is not None:
            self._text = IncrementalText(self.tokenizer)
            self._text.extend(self.generated)
        if self.stop:
            self._stops = StopStringMatcher(self.stop)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)

    @property
    def text(self) -> str:
        """The answer's text: decode(generated, skip_special_tokens=True), cut before a stop string."""
        if self._cut_text is not None:
            return self._cut_text
        return self._text.text if self._text is not None else ""

    def commit(self, new_ids: list[int]) -> list[int]:
        """Append verified tokens one at a time until a stop condition; return those kept."""
        kept: list[int] = []
        for token in new_ids:
            if self.finished:
                break
            self.generated.append(token)
            kept.append(token)
            if self._stops is not None:  # a stop string is looked for after each token: decode each
                self._text.extend([token])
            if token in self.eos_token_ids:
                self.finish_reason = "eos"
            elif self._cut_at_stop_string():
                self.finish_reason = "stop"
            elif self.remaining <= 0:
                self.finish_reason = "length"
        if self._text is not None and self._stops is None and kept:
            self._text.extend(kept)
        return kept

    def finish(self, reason: str) -> None:
        self.finish_reason = self.finish_reason or reason

    def text_delta(self) -> str:
        """New text since the last call that is safe to show.

        Held back while unfinished: an incomplete UTF-8 sequence (decoded as
        U+FFFD) and any tail that could still grow into a stop string.
        """
        if self._text is None:
            return ""
        if self.finished:
            text = self.text
            delta = text[self._streamed_chars:]
            self._streamed_chars = max(self._streamed_chars, len(text))
            return delta
        shown_pending = self._text.pending.rstrip(REPLACEMENT_CHAR)
        end = self._text.stable_chars + len(shown_pending)
        if self._stops is not None:
            end -= self._stops.holdback(shown_pending)
        if end <= self._streamed_chars:
            return ""
        delta = self._text.text_from(self._streamed_chars)[: end - self._streamed_chars]
        self._streamed_chars = end
        return delta

    def _cut_at_stop_string(self) -> bool:
        if self._stops is None:
            return False
        start = self._stops.find(self._text)
        if start is None:
            return False
        self._cut_text = self._text.text[:start]
        return True
