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
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.engine.batch import RowUpdate
from specdec.engine.metrics import RequestStats
from specdec.engine.request import chat_template_ids, encode_prompt
from specdec.sampling.params import SamplingParams
from specdec.server.guards import BoundedBody, RequireAPIKey, ServerLimits
from specdec.server.protocol import (ERROR_RESPONSES, APIError, ChatCompletionRequest, CompletionRequest,
                                     SamplingRequest)
from specdec.server.scheduler import EngineStopped, Job, JobFailed, QueueFull, Scheduler

DISCONNECT_POLL_S = 0.5  # how often a waiting non-streaming handler checks that its client is still there
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # engine -> OpenAI
GENERATION_RESPONSES = {200: {"description": "the completion; with stream=true, server-sent events of chunks "
                                           "ending in `data: [DONE]`",
                            "content": {"application/json": {}, "text/event-stream": {}}}, **ERROR_RESPONSES}
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

    @property
    def speculative_setup(self) -> dict:
        """method and k; a lossy server also names its lenience, so no client mistakes it for exact."""
        lossy = {"lenience": self.lenience, "lossy": True} if self.lenience != 1.0 else {}
        return {"method": self.method, "k": self.k, **lossy}


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _emitted_text(tokenizer, token_id: int) -> str:
    """An emitted token as the choice's text spells it: special tokens (the end of sequence that
    stopped it) as "", so the tokens join into the text and text_offset points into it. The
    alternatives keep their own spelling (_token_text): "<eos>" there says that stopping was likely."""
    return tokenizer.decode([token_id], skip_special_tokens=True)


def completion_logprobs(items: list, tokenizer) -> dict:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs (a dict per token) and
    text_offset (each token's start in the choice's text)."""
    tokens = [_emitted_text(tokenizer, item.token_id) for item in items]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": [item.logprob for item in items],
            "top_logprobs": [{_token_text(tokenizer, t): lp for t, lp in item.top} for item in items],
            "text_offset": offsets}


def chat_logprobs(items: list, tokenizer) -> dict:
    """The chat shape: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    def entry(token_id: int, logprob: float, spell=_token_text) -> dict:
        text = spell(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(item.token_id, item.logprob, _emitted_text),
                         "top_logprobs": [entry(t, lp) for t, lp in item.top]} for item in items]}


def create_app(scheduler: Scheduler, served: ServedModel, *, api_key: str | Sequence[str] | None = None,
               public_metrics: bool = False, limits: ServerLimits | None = None, shared_cache: bool = False,
               tenant_header: str | None = None) -> FastAPI:
    """api_key: one key or several, required on /v1 (and /metrics unless public_metrics) as
    `Authorization: Bearer KEY`; each key is a tenant. tenant_header: a header a trusted proxy sets,
    which splits a key's tenant further. shared_cache: one prompt cache and suffix cache for every
    client, tenants ignored (an operator's choice: it leaks, see docs/security.md)."""
    metrics = scheduler.metrics
    limits = limits or ServerLimits()
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    # Tokenizing and chat templates run here, off the event loop (a long prompt would freeze every stream),
    # one at a time and at a lower priority: the engine's threads need the cores more than a tokenizer.
    tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-tokenize",
                                    initializer=_lower_priority)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.stop)
        tokenizing.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="specdec", summary="OpenAI-compatible speculative decoding server", lifespan=lifespan)
    app.state.scheduler = scheduler  # for operators and tests: the engine behind the routes

    # ---- errors: always an OpenAI-style body ----------------------------------------------------

    def error_response(error: APIError) -> JSONResponse:
        metrics.rejected.labels(REJECTION_REASONS.get(error.status, "error")).inc()
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(APIError)
    async def api_error(_request, error: APIError):
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request, error: RequestValidationError):
        first = error.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])})"
        elif not where:
            message = "the request body must be a JSON object (Content-Type: application/json)"
        else:
            message = f"{where or 'body'}: {first['msg']}"
        return error_response(APIError(400, message, param=where or None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, error: StarletteHTTPException):
        return error_response(APIError(error.status_code, str(error.detail), type="invalid_request_error"))

    @app.exception_handler(Exception)
    async def unexpected(_request, error: Exception):
        return error_response(APIError(500, f"internal error: {error}", type="server_error"))

    # ---- access and bounds: pure ASGI (server/guards.py), so disconnects still reach the handlers ----

    app.add_middleware(BoundedBody, max_bytes=limits.max_body_bytes, timeout_s=limits.body_timeout_s,
                       reject=error_response)
    if keys:  # added last: the outermost, so a request without a key is refused before its body is read
        app.add_middleware(RequireAPIKey, keys=keys, reject=error_response,
                           guarded=("/v1/",) if public_metrics else ("/v1/", "/metrics"))

    def tenant_of(http_request: HTTPRequest) -> str | None:
        """Whose caches a request may share: its key's tenant, split by the trusted header if set."""
        if shared_cache:
            return None
        tenant = http_request.scope.get("state", {}).get("tenant", "")
        if tenant_header:
            tenant = f"{tenant}/{http_request.headers.get(tenant_header, '')}"
        return tenant or None

    # ---- plain endpoints --------------------------------------------------------------------

    @app.get("/health")
    async def health():
        body = {"status": "ok" if scheduler.alive else "unavailable", "running": scheduler.engine.running}
        if scheduler.broken is not None:
            body["error"] = scheduler.broken
        return JSONResponse(body, status_code=200 if scheduler.alive else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": served.name, "object": "model", "created": served.created, "owned_by": "specdec",
            "max_model_len": served.max_context, "speculative": served.speculative_setup,
        }]}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    # ---- generation -------------------------------------------------------------------------

    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, http_request: HTTPRequest):
        _check_request(body)
        prompt = body.prompt_input
        _check_prompt_chars(len(prompt) if isinstance(prompt, str) else 0, "prompt")
        ids = await _encode(lambda: _checked(prompt), "prompt")
        jobs = _submit(body, ids, "completions", default_max_tokens=16,  # OpenAI's default for completions
                       tenant=tenant_of(http_request))
        response_id = f"cmpl-{uuid.uuid4().hex}"

        def chunk(text: str, finish: str | None, logprobs: list | None = None, index: int = 0) -> dict:
            choice = {"index": index, "text": text, "logprobs": None if logprobs is None else
                      completion_logprobs(logprobs, served.tokenizer), "finish_reason": finish}
            return {"id": response_id, "object": "text_completion", "created": int(time.time()),
                    "model": served.name, "choices": [choice]}

        if body.stream:
            return _event_stream(jobs, body, chunk, first=None)
        finals = await _final_updates(jobs, http_request)
        choices = []
        for index, (job, final) in enumerate(zip(jobs, finals)):
            choice = chunk(job.request.text, FINISH_REASONS[final.finish_reason], _logprobs_of(job),
                           index)["choices"][0]
            if body.return_token_ids:
                choice["token_ids"] = list(job.request.generated)
            choices.append(choice)
        return {**chunk("", None), "choices": choices, **_usage_fields(jobs, finals)}

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, http_request: HTTPRequest):
        if not getattr(served.tokenizer, "chat_template", None):
            raise APIError(400, f"{served.name} has no chat template; use /v1/completions", param="messages")
        _check_request(body)
        messages = [message.as_template_message() for message in body.messages]
        _check_prompt_chars(sum(len(message["content"]) for message in messages), "messages")
        ids = await _encode(lambda: _checked(chat_template_ids(served.tokenizer, messages)), "messages")
        if body.max_completion_tokens is not None:
            body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
        jobs = _submit(body, ids, "chat", default_max_tokens=served.default_max_tokens,
                       tenant=tenant_of(http_request))
        response_id = f"chatcmpl-{uuid.uuid4().hex}"

        def chunk(text: str | None, finish: str | None, logprobs: list | None = None, index: int = 0) -> dict:
            delta = {} if text is None else {"content": text}
            choice = {"index": index, "delta": delta, "finish_reason": finish}
            if logprobs is not None:
                choice["logprobs"] = chat_logprobs(logprobs, served.tokenizer)
            return {"id": response_id, "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": served.name, "choices": [choice]}

        if body.stream:
            return _event_stream(jobs, body, chunk, first={"role": "assistant", "content": ""})
        finals = await _final_updates(jobs, http_request)
        choices = []
        for index, (job, final) in enumerate(zip(jobs, finals)):
            logprobs = _logprobs_of(job)
            choice = {"index": index, "message": {"role": "assistant", "content": job.request.text},
                      "finish_reason": FINISH_REASONS[final.finish_reason],
                      "logprobs": None if logprobs is None else chat_logprobs(logprobs, served.tokenizer)}
            if body.return_token_ids:  # vLLM's extension, where vLLM puts them
                choice["token_ids"] = list(job.request.generated)
            choices.append(choice)
        ids = {"prompt_token_ids": list(jobs[0].request.prompt_ids)} if body.return_token_ids else {}
        return {"id": response_id, "object": "chat.completion", "created": int(time.time()), "model": served.name,
                "choices": choices, **_usage_fields(jobs, finals), **ids}

    # ---- helpers (closures over scheduler and served) ---------------------------------------

    def _checked(prompt: str | list[int]) -> list[int]:
        return encode_prompt(served.tokenizer, prompt, served.max_context, vocab_size=served.vocab_size)

    def _check_request(body: SamplingRequest) -> None:
        """What can be refused before any work: the model's name, unsupported options, the limits."""
        if body.model != served.name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {served.name!r}",
                           param="model", code="model_not_found")
        unsupported = body.unsupported()
        if unsupported:
            raise APIError(400, f"not supported by specdec: {', '.join(unsupported)}", code="unsupported")
        wanted = body.max_completion_tokens if isinstance(body, ChatCompletionRequest) and \
            body.max_completion_tokens is not None else body.max_tokens
        if limits.max_tokens_cap is not None and wanted is not None and wanted > limits.max_tokens_cap:
            raise APIError(400, f"max_tokens is {wanted}; this server allows at most {limits.max_tokens_cap} "
                                f"(specdec serve --max-tokens-cap)", param="max_tokens")
        stops = body.stop_strings
        longest, total = max((len(stop) for stop in stops), default=0), sum(len(stop) for stop in stops)
        if longest > limits.max_stop_chars or total > 4 * limits.max_stop_chars:
            raise APIError(400, f"stop strings may be at most {limits.max_stop_chars} characters each and "
                                f"{4 * limits.max_stop_chars} in all (got {longest} and {total}; specdec serve "
                                f"--max-stop-chars)", param="stop")

    def _check_prompt_chars(chars: int, param: str) -> None:
        bound = limits.prompt_chars(served.max_context)
        if chars > bound:
            raise APIError(400, f"the {param} has {chars} characters; this server reads at most {bound} "
                                f"(specdec serve --max-prompt-chars)", param=param, code="context_length_exceeded")

    async def _encode(encode, param: str) -> list[int]:
        try:
            return await asyncio.get_running_loop().run_in_executor(tokenizing, encode)
        except ValueError as error:
            code = "context_length_exceeded" if "context" in str(error) else None
            raise APIError(400, str(error), param=param, code=code) from None
        except Exception as error:  # noqa: BLE001 - e.g. a chat template that rejects the messages
            raise APIError(400, f"could not encode the {param}: {error}", param=param) from None

    def _submit(body: SamplingRequest, ids: list[int], endpoint: str, default_max_tokens: int,
                tenant: str | None) -> list[Job]:
        logprob_count = body.logprob_count()
        room = served.max_context - len(ids)
        if limits.max_tokens_cap is not None:
            default_max_tokens = min(default_max_tokens, limits.max_tokens_cap)
        max_tokens = body.max_tokens if body.max_tokens is not None else min(default_max_tokens, room)
        if max_tokens > room:
            raise APIError(400, f"this model's context is {served.max_context} tokens; the prompt has {len(ids)} "
                                f"and max_tokens asks for {max_tokens} more", param="max_tokens",
                           code="context_length_exceeded")
        try:
            # n samples: one request each, seeds seed, seed + 1, ... (as vLLM), one shared prefill (engine/batch.py)
            requests = [scheduler.engine.make_request(
                ids, SamplingParams(temperature=body.temperature, top_k=max(body.top_k, 0), top_p=body.top_p,
                                    min_p=body.min_p, seed=None if body.seed is None else body.seed + index,
                                    lenience=served.lenience),
                max_new_tokens=max_tokens, stop=body.stop_strings, ignore_eos=body.ignore_eos,
                logprobs=logprob_count, max_stop_chars=limits.max_stop_chars) for index in range(body.n)]
        except ValueError as error:
            raise APIError(400, str(error)) from None
        jobs: list[Job] = []
        try:
            for request in requests:
                jobs.append(scheduler.submit(request, endpoint, tenant=tenant, deadline_s=limits.deadline_s))
            return jobs
        except QueueFull as error:
            raise APIError(429, f"the server is at capacity ({error}); retry shortly", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"}) from None
        except EngineStopped as error:
            raise APIError(503, str(error), type="server_error", code="unavailable") from None
        finally:
            if len(jobs) < len(requests):  # refused part-way: the samples already queued go too
                for job in jobs:
                    scheduler.cancel(job)

    async def _updates(job: Job, http_request: HTTPRequest | None) -> AsyncIterator[RowUpdate]:
        """The job's updates until it finishes; polls for a vanished client when given its request."""
        checked = time.monotonic()
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                event = None
            # Updates may arrive every few ms, so the check goes by the clock, not by timeouts.
            if http_request is not None and time.monotonic() - checked >= DISCONNECT_POLL_S:
                checked = time.monotonic()
                if await http_request.is_disconnected():
                    scheduler.cancel(job)
                    raise asyncio.CancelledError
            if event is None:
                continue
            if isinstance(event, JobFailed):
                raise APIError(event.status, event.message, type="server_error", code=event.code)
            yield event
            if event.finish_reason is not None:
                return

    async def _final_update(job: Job, http_request: HTTPRequest) -> RowUpdate:
        try:
            async for update in _updates(job, http_request):
                if update.finish_reason is not None:
                    return update
        finally:
            scheduler.cancel(job)  # a no-op once finished; frees the row if the handler was cancelled
        raise APIError(500, "generation ended without a result", type="server_error")

    async def _final_updates(jobs: list[Job], http_request: HTTPRequest) -> list[RowUpdate]:
        try:
            return list(await asyncio.gather(*(_final_update(job, http_request) for job in jobs)))
        finally:
            for job in jobs:  # one failed: the others stop too
                scheduler.cancel(job)

    def _logprobs_of(job: Job) -> list | None:
        return job.request.token_logprobs if job.request.logprobs is not None else None

    def _event_stream(jobs: list[Job], body: SamplingRequest, chunk, first: dict | None) -> StreamingResponse:
        """Server-sent events of every choice, interleaved as their tokens come (each chunk names its
        choice's index), a closing chunk per choice, then usage when asked and [DONE]."""
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        async def pump(index: int, job: Job, merged: asyncio.Queue) -> None:
            try:
                async for update in _updates(job, None):
                    await merged.put((index, update))
            except APIError as error:
                await merged.put((index, error))
            finally:
                await merged.put((index, None))

        async def events() -> AsyncIterator[str]:
            merged: asyncio.Queue = asyncio.Queue()
            tasks = [asyncio.create_task(pump(index, job, merged)) for index, job in enumerate(jobs)]
            finals: dict[int, RowUpdate] = {}
            pending = {index: [] for index in range(len(jobs))}  # log-probabilities of text still held back
            try:
                if first is not None:  # chat: the role comes first
                    for index in range(len(jobs)):
                        opening = chunk(None, None, None, index)
                        opening["choices"][0]["delta"] = first
                        yield _sse(opening)
                # Starlette cancels this generator when the client disconnects (ASGI 2.3).
                open_choices = len(jobs)
                while open_choices:
                    index, item = await merged.get()
                    if item is None:
                        open_choices -= 1
                        continue
                    if isinstance(item, APIError):
                        yield _sse(item.body())
                        break
                    job, update = jobs[index], item
                    pending[index] += update.logprobs or []
                    wanted = pending[index] if job.request.logprobs is not None else None
                    if update.text:
                        yield _sse(chunk(update.text, None, wanted, index))
                        pending[index] = []
                        wanted = [] if wanted is not None else None
                    if update.finish_reason is None:
                        continue
                    finals[index] = update
                    closing = chunk(None if first is not None else "", FINISH_REASONS[update.finish_reason],
                                    wanted if wanted else None, index)
                    closing["speculative"] = _speculative([update.stats])
                    yield _sse(closing)
                if include_usage and len(finals) == len(jobs):
                    yield _sse({**chunk("", None), "choices": [],
                                **_usage_fields(jobs, [finals[index] for index in range(len(jobs))])})
            finally:
                for task in tasks:
                    task.cancel()
                for job in jobs:
                    scheduler.cancel(job)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _usage_fields(jobs: list[Job], finals: list[RowUpdate]) -> dict:
        """usage (the prompt once, every choice's tokens) and `speculative` (over all choices)."""
        prompt = len(jobs[0].request.prompt_ids)
        completion = sum(len(job.request.generated) for job in jobs)
        # OpenAI's field for prompt tokens served from a cache (here: a finished request's row, or a twin's).
        cached = max(final.stats.prompt_tokens_reused for final in finals)
        return {"usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                          "prompt_tokens_details": {"cached_tokens": cached}},
                "speculative": _speculative([final.stats for final in finals])}

    def _speculative(all_stats: list[RequestStats]) -> dict:
        """What speculation did: one choice's stats, or the sums (and rates of the sums) over n choices."""
        if len(all_stats) == 1:
            stats = all_stats[0]
        else:
            stats = RequestStats()
            for choice in all_stats:
                stats.merge(choice)
        return {
            **served.speculative_setup,
            "drafted_tokens": stats.drafted_tokens, "accepted_tokens": stats.accepted_tokens,
            "acceptance_rate": round(stats.acceptance_rate, 4),
            "mean_accepted_length": round(stats.mean_accepted_length, 4),
            "target_forwards": stats.target_forwards,
            "acceptance_per_position": [round(rate, 4) for rate in stats.acceptance_per_position],
            "prefill_s": round(stats.prefill_time_s, 4), "decode_s": round(stats.decode_time_s, 4),
        }

    return app


def _lower_priority(niceness: int = 10) -> None:
    """Make the calling thread yield the CPU to the engine's (Linux keeps a nice value per thread;
    raising it needs no privilege). A 900,000-character prompt beside a stream: benchmarks/RESULTS.md,
    "Hostile requests beside a stream (issue 59)"."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError):  # not Linux, or not allowed: tokenize at the usual priority
        pass


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
