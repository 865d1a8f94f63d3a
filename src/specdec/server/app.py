"""The OpenAI-compatible HTTP API over a Scheduler; no decoding logic of its own.

    POST /v1/completions        text or token-id prompt; stream=true for server-sent events
    POST /v1/chat/completions   messages through the model's chat template
    GET  /v1/models             the one served model, with its speculative setup
    GET  /health                200 while the engine thread runs, else 503
    GET  /metrics               Prometheus text format (server/metrics.py)

With API keys (`specdec serve --api-key`, or $SPECDEC_API_KEY) every /v1 route, and
/metrics unless it is made public, answers 401 to a request without
`Authorization: Bearer KEY`; /health stays open for load balancers. Each key is a tenant: the
prompt cache and suffix decoding's cache are shared only within one (server/guards.py), and
every request is bounded (ServerLimits: body size and pace, prompt characters, max_tokens,
stop strings, a deadline). docs/security.md has the whole list.

Responses carry the usual `usage` and one extra object, `speculative`, with
what speculation did for that request (drafted and accepted tokens, mean
accepted length). Every error, from malformed JSON to a full queue, is an
OpenAI-style body {"error": {"message", "type", "param", "code"}} with a 4xx/5xx
status; no input can take the server down.

This module assembles the app from its parts: server/routes.py (the endpoints and their response
shapes), server/generation.py (a generation request's path: checks, tokenizing, queueing, waiting,
streaming) and server/state.py (ServerState, what they all read, and ServedModel).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.server.guards import BoundedBody, RequireAPIKey, ServerLimits
from specdec.server.protocol import APIError
from specdec.server.routes import add_routes
from specdec.server.scheduler import Scheduler
from specdec.server.state import ServedModel, ServerState, state_of

__all__ = ["ServedModel", "create_app"]


def create_app(scheduler: Scheduler, served: ServedModel, *, api_key: str | Sequence[str] | None = None,
               public_metrics: bool = False, limits: ServerLimits | None = None, shared_cache: bool = False,
               tenant_header: str | None = None) -> FastAPI:
    """api_key: one key or several, required on /v1 (and /metrics unless public_metrics) as
    `Authorization: Bearer KEY`; each key is a tenant. tenant_header: a header a trusted proxy sets,
    which splits a key's tenant further. shared_cache: one prompt cache and suffix cache for every
    client, tenants ignored (an operator's choice: it leaks, see docs/security.md)."""
    limits = limits or ServerLimits()
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    # Tokenizing and chat templates run here, off the event loop (a long prompt would freeze every stream),
    # one at a time and at a lower priority: the engine's threads need the cores more than a tokenizer.
    tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-tokenize",
                                    initializer=_lower_priority)
    state = ServerState(scheduler, served, limits, tokenizing, shared_cache=shared_cache,
                        tenant_header=tenant_header)

    app = FastAPI(title="specdec", summary="OpenAI-compatible speculative decoding server",
                  lifespan=partial(_serving, state))
    app.state.server = state  # what the routes read (server/state.py)
    app.state.scheduler = scheduler  # for operators and tests: the engine behind the routes
    _add_error_handlers(app)
    # Access and bounds: pure ASGI (server/guards.py), so disconnects still reach the handlers.
    app.add_middleware(BoundedBody, max_bytes=limits.max_body_bytes, timeout_s=limits.body_timeout_s,
                       reject=state.error_response)
    if keys:  # added last: the outermost, so a request without a key is refused before its body is read
        app.add_middleware(RequireAPIKey, keys=keys, reject=state.error_response,
                           guarded=("/v1/",) if public_metrics else ("/v1/", "/metrics"))
    add_routes(app)
    return app


@asynccontextmanager
async def _serving(state: ServerState, _app: FastAPI):
    """The engine's thread runs while the app serves; on shutdown it stops off the event loop (it
    joins a thread), and tokenizing still queued is dropped."""
    state.scheduler.start()
    yield
    await asyncio.to_thread(state.scheduler.stop)
    state.tokenizing.shutdown(wait=False, cancel_futures=True)


# ---- errors: always an OpenAI-style body ---------------------------------------------------------

def _add_error_handlers(app: FastAPI) -> None:
    """Whatever goes wrong, the client gets {"error": {...}} and the metrics count the refusal."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)


async def _api_error(http_request: HTTPRequest, error: APIError) -> JSONResponse:
    return state_of(http_request).error_response(error)


async def _invalid_request(http_request: HTTPRequest, error: RequestValidationError) -> JSONResponse:
    """FastAPI's validation error, as one message naming the first bad field."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    if first.get("type") == "json_invalid":
        message = f"the request body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])})"
    elif not where:
        message = "the request body must be a JSON object (Content-Type: application/json)"
    else:
        message = f"{where or 'body'}: {first['msg']}"
    return state_of(http_request).error_response(APIError(400, message, param=where or None))


async def _http_error(http_request: HTTPRequest, error: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (an unknown path: 404, a wrong method: 405) in the OpenAI shape."""
    return state_of(http_request).error_response(
        APIError(error.status_code, str(error.detail), type="invalid_request_error"))


async def _unexpected(http_request: HTTPRequest, error: Exception) -> JSONResponse:
    return state_of(http_request).error_response(APIError(500, f"internal error: {error}", type="server_error"))


def _lower_priority(niceness: int = 10) -> None:
    """Make the calling thread yield the CPU to the engine's (Linux keeps a nice value per thread;
    raising it needs no privilege). A 900,000-character prompt beside a stream: benchmarks/RESULTS.md,
    "Hostile requests beside a stream (issue 59)"."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError):  # not Linux, or not allowed: tokenize at the usual priority
        pass
