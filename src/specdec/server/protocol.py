"""The OpenAI API's request and response bodies, as far as specdec serves them.

Requests are validated strictly (a string is not a number, a bool is not an
integer) so that a client's mistake is a 400 naming the field, never a guess.
Unknown fields are ignored, as OpenAI does; known options specdec cannot honour
(penalties, logit_bias, echo, best_of, ...) are refused by name rather than silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20  # OpenAI's limit (engine/batch.py enforces it too)
MAX_CHOICES = 16  # n: each choice takes a row of the batch while it runs


class APIError(Exception):
    """An error with an HTTP status and an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """What every 4xx/5xx answer carries (OpenAI's shape)."""

    error: ErrorDetail


ERROR_RESPONSES = {status: {"model": ErrorBody, "description": description} for status, description in (
    (400, "invalid request: malformed JSON, a field of the wrong type or out of range, a prompt too long"),
    (401, "the server has an API key and the request did not send it (Authorization: Bearer KEY)"),
    (404, "the model is not the one this server serves"),
    (408, "the request body arrived too slowly (specdec serve --body-timeout)"),
    (413, "the request body is larger than the server's limit (specdec serve --max-body-mb)"),
    (429, "the queue is full; retry after the Retry-After header's seconds"),
    (500, "this request failed on its own (e.g. the model's logits held no token to emit); others go on"),
    (503, "the engine is not running (starting, shutting down, or broken: /health says why)"),
    (504, "the request ran past the server's deadline (specdec serve --request-deadline)"),
)}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class SpeculativeOptions(BaseModel):
    """specdec's extension: this request's own speculation (docs/server.md). method: one the server
    loaded (GET /v1/models lists them under speculative.methods), k: drafted tokens per step, 0 for
    plain decoding, or "auto". Either may be left out: the server's own. The output is the same
    whichever is chosen (exact verification); only its speed changes."""

    model_config = ConfigDict(strict=True, extra="forbid")
    method: Annotated[str, Field(min_length=1)] | None = None
    k: Annotated[int, Field(ge=0)] | Literal["auto"] | None = None


class SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0  # 0 or -1 = off (vLLM's extension)
    min_p: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0  # vLLM's extension
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1  # samples of one prompt, sharing its prefill
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens tokens whatever comes (benchmarks)
    return_token_ids: bool = False  # vLLM's extension: each choice also carries its token ids (not streamed)
    speculative: SpeculativeOptions | None = None  # specdec's extension: this request's method and k
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def logprob_count(self) -> int | None:
        """None: no log-probabilities; N: each token's and its N most likely alternatives."""
        return None

    def unsupported(self) -> list[str]:
        """Options asked for that specdec does not implement (each would change the output)."""
        asked = []
        if self.presence_penalty or self.frequency_penalty:
            asked.append("presence_penalty / frequency_penalty")
        if self.logit_bias:
            asked.append("logit_bias")
        return asked

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingRequest):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)] | \
        Annotated[list[str], Field(min_length=1, max_length=1)]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # legacy: N top alternatives
    best_of: int | None = None
    suffix: str | None = None

    def logprob_count(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> list[str]:
        asked = super().unsupported()
        if self.echo:
            asked.append("echo")
        if self.best_of not in (None, 1):
            asked.append("best_of")
        if self.suffix:
            asked.append("suffix")
        return asked

    @property
    def prompt_input(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_template_message(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # needs logprobs: true
    tools: list[dict] | None = None

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> list[str]:
        asked = super().unsupported()
        if self.tools:
            asked.append("tools")
        return asked
