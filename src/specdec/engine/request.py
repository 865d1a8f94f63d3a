"""Per-request state: committed tokens, and where generation must stop.

The verifier may accept a whole draft in one go; this is where EOS, stop
strings and max_new_tokens cut it, token by token, so that nothing past them
is ever emitted, whichever step they fall in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.sampling.params import SamplingParams


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    tokenizer: object | None = None  # needed for text and stop strings
    generated: list[int] = field(default_factory=list)
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
