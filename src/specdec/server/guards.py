"""What stands between a client and the routes: the API keys, the body's size and pace, and the
limits an operator sets (docs/security.md lists each with its flag).

Both middlewares are pure ASGI, not Starlette's BaseHTTPMiddleware (`@app.middleware("http")`):
behind that one a handler's `request.is_disconnected()` never sees the client leave (Starlette
discussion 2094, vLLM issue 10087), so with an API key a client that hung up kept its row until
max_tokens. Here the body is read once, bounded, and replayed; every later `receive()` goes to the
server's own, which reports the disconnect.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdec.server.protocol import APIError


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on what one request may cost the server; every one a flag of `specdec serve`.

    max_body_bytes:     a larger request body is refused with 413 before it is parsed (--max-body-mb).
    body_timeout_s:     a client that sends its body slower than this between two pieces gets 408
                        (--body-timeout); a slow sender otherwise holds a connection for free.
    max_prompt_chars:   a prompt (or all of a chat's message contents) longer than this is refused with
                        400 before tokenizing (--max-prompt-chars); None: 32 characters per token of the
                        context, more than any real text's tokens hold.
    max_tokens_cap:     max_tokens above this is refused with 400 (--max-tokens-cap); None: the context.
    deadline_s:         a request still running this long after it arrived fails with 504
                        (--request-deadline); None: no deadline.
    max_stop_chars:     each stop string's length (--max-stop-chars); their total is 4 times it.
    """

    max_body_bytes: int = 4 * 1024 * 1024
    body_timeout_s: float = 30.0
    max_prompt_chars: int | None = None
    max_tokens_cap: int | None = None
    deadline_s: float | None = 600.0
    max_stop_chars: int = 1000

    CHARS_PER_TOKEN_BOUND = 32  # max_prompt_chars' default, per token of the context

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_stop_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("max_prompt_chars", "max_tokens_cap"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
        if not _positive_seconds(self.body_timeout_s):
            raise ValueError(f"body_timeout_s must be a number of seconds > 0, got {self.body_timeout_s!r}")
        if self.deadline_s is not None and not _positive_seconds(self.deadline_s):
            raise ValueError(f"deadline_s must be a number of seconds > 0 or None, got {self.deadline_s!r}")

    def prompt_chars(self, max_context: int) -> int:
        return self.max_prompt_chars or self.CHARS_PER_TOKEN_BOUND * max_context


def _positive_seconds(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0


def tenant_of_key(key: str) -> str:
    """A client's tenant, named without its key (the key never reaches the engine or a log)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


Reject = Callable[[APIError], JSONResponse]


class RequireAPIKey:
    """Every path under `guarded` needs `Authorization: Bearer KEY` for one of `keys` (compared in
    constant time); others get 401. The matching key's tenant goes into scope["state"]["tenant"]: the
    prompt cache and suffix decoding's cache are shared only within a tenant (engine/batch.py)."""

    def __init__(self, app: ASGIApp, *, keys: Sequence[str], guarded: tuple[str, ...], reject: Reject) -> None:
        if not keys or any(not key for key in keys):
            raise ValueError("API keys must be non-empty strings")
        self.app, self.guarded, self.reject = app, guarded, reject
        self.expected = [(f"Bearer {key}".encode(), tenant_of_key(key)) for key in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.guarded):
            await self.app(scope, receive, send)
            return
        sent = dict(scope["headers"]).get(b"authorization", b"")
        tenant = None
        for expected, key_tenant in self.expected:  # every key compared: no early exit to time
            if hmac.compare_digest(sent, expected):
                tenant = key_tenant
        if tenant is None:
            response = self.reject(APIError(401, "missing or incorrect API key: send it as 'Authorization: Bearer KEY'",
                                            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


class BoundedBody:
    """Reads a request's body before the route does, at most `max_bytes` (413 past it, at once when
    Content-Length says so) and with at most `timeout_s` between two pieces (408), then replays it.

    After a 413 the rest of the body is read and dropped, up to DRAIN_FACTOR x max_bytes: a client
    still sending when the server closes gets a reset instead of its 413 (httpx reads the answer
    only once its body is sent). Dropping bytes costs the server no parsing and no memory."""

    DRAIN_FACTOR = 16

    def __init__(self, app: ASGIApp, *, max_bytes: int, timeout_s: float, reject: Reject) -> None:
        self.app, self.max_bytes, self.timeout_s, self.reject = app, max_bytes, timeout_s, reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(413, scope, receive, send)
            await self._drain(receive, more=True)
            return
        pieces, size, more = [], 0, True
        while more:
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except TimeoutError:
                await self._refuse(408, scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return  # gone before it finished sending: nothing to answer
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(413, scope, receive, send)
                await self._drain(receive, more=message.get("more_body", False))
                return
            pieces.append(message.get("body", b""))
            more = message.get("more_body", False)
        await self.app(scope, _replay(b"".join(pieces), receive), send)

    async def _drain(self, receive: Receive, more: bool) -> None:
        """Read and drop what the client still sends, within the drain budget and the body timeout."""
        dropped = 0
        while more and dropped <= self.DRAIN_FACTOR * self.max_bytes:
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except TimeoutError:
                return
            if message["type"] != "http.request":
                return
            dropped += len(message.get("body", b""))
            more = message.get("more_body", False)

    async def _refuse(self, status: int, scope: Scope, receive: Receive, send: Send) -> None:
        message = (f"the request body is larger than this server's limit of {self.max_bytes} bytes "
                   f"(specdec serve --max-body-mb)" if status == 413 else
                   f"the request body arrived too slowly (more than {self.timeout_s:g} s between two pieces; "
                   f"specdec serve --body-timeout)")
        code = "request_too_large" if status == 413 else "request_timeout"
        response = self.reject(APIError(status, message, code=code, headers={"Connection": "close"}))
        await response(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Callable[[], Awaitable[Message]]:
    """The body once, as one message; then the server's own receive (which reports the disconnect)."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
