"""What the server's handlers share: the served model's description and one ServerState per app.

create_app builds the state once and keeps it on app.state.server; routes, exception handlers and
the generation helpers take it as an argument (or read it from the request with state_of), so each
is a plain named function that a reader and a test can find, not a closure inside create_app.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from specdec.engine.request import PLAIN_METHOD, Speculation
from specdec.server.guards import ServerLimits
from specdec.server.metrics import ServerMetrics
from specdec.server.protocol import APIError
from specdec.server.scheduler import Scheduler

# An error's status -> the `reason` label of specdec_rejected_requests_total; anything else is "error".
REJECTION_REASONS = {400: "bad_request", 401: "unauthorized", 404: "not_found", 408: "body_timeout",
                     413: "too_large", 429: "queue_full", 503: "unavailable"}


@dataclass(frozen=True)
class ServedModel:
    name: str  # what clients pass as "model"
    tokenizer: object
    max_context: int
    vocab_size: int  # ids a prompt may hold
    method: str
    k: int | str  # "auto": each step's k from measured costs and each row's acceptance
    default_max_tokens: int = 256  # chat requests without max_tokens (capped by the context)
    created: int = 0
    lenience: float = 1.0  # every request's; < 1 is LOSSY (sampling/params.py), and says so in `speculative`
    request_methods: tuple[str, ...] = ()  # what a request's `speculative` object may name, the server's own first
    max_k: int = 8  # the largest k a request may ask for

    @property
    def speculative_setup(self) -> dict:
        """method and k, what requests may choose; a lossy server also names its lenience, so no client
        mistakes it for exact."""
        lossy = {"lenience": self.lenience, "lossy": True} if self.lenience != 1.0 else {}
        return {"method": self.method, "k": self.k, "methods": list(self.request_methods), "max_k": self.max_k,
                **lossy}

    def ran(self, speculation: Speculation) -> dict:
        """A response's method and k: what the request asked for, the server's own where it asked nothing;
        a lossy server's lenience."""
        lossy = {"lenience": self.lenience, "lossy": True} if self.lenience != 1.0 else {}
        method = self.method if speculation.method is None else speculation.method
        k = 0 if method == PLAIN_METHOD else (self.k if speculation.k is None else speculation.k)
        return {"method": method, "k": k, **lossy}


@dataclass(frozen=True)
class ServerState:
    """Everything create_app's arguments decide, for the handlers: the engine behind the scheduler,
    the model it serves, the request bounds, and how requests map to cache-sharing tenants.
    tokenizing: the one low-priority thread that tokenizes prompts off the event loop (server/app.py)."""

    scheduler: Scheduler
    served: ServedModel
    limits: ServerLimits
    tokenizing: ThreadPoolExecutor
    shared_cache: bool = False  # one prompt cache and suffix cache for every client (docs/security.md)
    tenant_header: str | None = None  # set by a trusted proxy; splits a key's tenant further

    @property
    def metrics(self) -> ServerMetrics:
        return self.scheduler.metrics

    def error_response(self, error: APIError) -> JSONResponse:
        """Every refusal, from a route or a guard: counted by its reason, answered in the OpenAI error shape."""
        self.metrics.rejected.labels(REJECTION_REASONS.get(error.status, "error")).inc()
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    def tenant_of(self, http_request: HTTPRequest) -> str | None:
        """Whose caches a request may share: its key's tenant, split by the trusted header if set."""
        if self.shared_cache:
            return None
        tenant = http_request.scope.get("state", {}).get("tenant", "")
        if self.tenant_header:
            tenant = f"{tenant}/{http_request.headers.get(self.tenant_header, '')}"
        return tenant or None


def state_of(http_request: HTTPRequest) -> ServerState:
    """The state of the app that received the request (create_app put it there)."""
    return http_request.app.state.server
