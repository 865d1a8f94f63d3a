"""The HTTP endpoints (listed in server/app.py's docstring) and the shapes of their responses.

Each endpoint is a module-level function, registered by add_routes; it finds the app's ServerState
through its request (server/state.py) and shares a generation request's path (server/generation.py).
The endpoint functions carry comments rather than docstrings: FastAPI would publish a docstring as
the operation's description in /openapi.json.
"""

from __future__ import annotations

import time
import uuid
from functools import partial

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from specdec.engine.batch import RowUpdate
from specdec.engine.request import chat_template_ids
from specdec.server.generation import (FINISH_REASONS, Chunk, check_prompt_chars, check_request, checked_ids, encode,
                                       event_stream, final_updates, logprobs_of, submit, usage_fields)
from specdec.server.protocol import ERROR_RESPONSES, APIError, ChatCompletionRequest, CompletionRequest
from specdec.server.scheduler import Job
from specdec.server.state import ServedModel, state_of

GENERATION_RESPONSES = {200: {"description": "the completion; with stream=true, server-sent events of chunks "
                                           "ending in `data: [DONE]`",
                            "content": {"application/json": {}, "text/event-stream": {}}}, **ERROR_RESPONSES}


def add_routes(app: FastAPI) -> None:
    """The endpoints, in the order /openapi.json lists them; registered on the app itself, as plain routes."""
    app.get("/health")(health)
    app.get("/v1/models")(models)
    app.get("/metrics", response_class=PlainTextResponse)(prometheus)
    app.post("/v1/completions", responses=GENERATION_RESPONSES)(completions)
    app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)(chat_completions)


# ---- plain endpoints ----------------------------------------------------------------------------

async def health(http_request: HTTPRequest):
    # 200 while the engine thread runs, else 503 with the reason the engine broke, for load balancers.
    scheduler = state_of(http_request).scheduler
    body = {"status": "ok" if scheduler.alive else "unavailable", "running": scheduler.engine.running}
    if scheduler.broken is not None:
        body["error"] = scheduler.broken
    return JSONResponse(body, status_code=200 if scheduler.alive else 503)


async def models(http_request: HTTPRequest):
    # The one served model, with its speculative setup, so a client can tell a lossy server from an exact one.
    served = state_of(http_request).served
    return {"object": "list", "data": [{
        "id": served.name, "object": "model", "created": served.created, "owned_by": "specdec",
        "max_model_len": served.max_context, "speculative": served.speculative_setup,
    }]}


async def prometheus(http_request: HTTPRequest):
    metrics = state_of(http_request).metrics
    return Response(metrics.render(), media_type=metrics.content_type)


# ---- /v1/completions ----------------------------------------------------------------------------

async def completions(body: CompletionRequest, http_request: HTTPRequest):
    # A text or token-id prompt; checked, tokenized, queued as n jobs, then streamed or answered whole.
    state = state_of(http_request)
    check_request(state, body)
    prompt = body.prompt_input
    check_prompt_chars(state, len(prompt) if isinstance(prompt, str) else 0, "prompt")
    ids = await encode(state, partial(checked_ids, state.served, prompt), "prompt")
    jobs = submit(state, body, ids, "completions", default_max_tokens=16,  # OpenAI's default for completions
                  tenant=state.tenant_of(http_request))
    chunk = partial(completion_chunk, state.served, f"cmpl-{uuid.uuid4().hex}")
    if body.stream:
        return event_stream(state, jobs, body, chunk, first=None)
    finals = await final_updates(state, jobs, http_request)
    return completion_body(state.served, body, jobs, finals, chunk)


def completion_chunk(served: ServedModel, response_id: str, text: str, finish: str | None,
                     logprobs: list | None = None, index: int = 0) -> dict:
    """One text_completion object with one choice: a streamed chunk, or the frame of the whole answer."""
    choice = {"index": index, "text": text, "logprobs": None if logprobs is None else
              completion_logprobs(logprobs, served.tokenizer), "finish_reason": finish}
    return {"id": response_id, "object": "text_completion", "created": int(time.time()),
            "model": served.name, "choices": [choice]}


def completion_body(served: ServedModel, body: CompletionRequest, jobs: list[Job], finals: list[RowUpdate],
                    chunk: Chunk) -> dict:
    """The whole (non-streamed) completion: every choice, usage and `speculative`."""
    choices = []
    for index, (job, final) in enumerate(zip(jobs, finals)):
        choice = chunk(job.request.text, FINISH_REASONS[final.finish_reason], logprobs_of(job),
                       index)["choices"][0]
        if body.return_token_ids:
            choice["token_ids"] = list(job.request.generated)
        choices.append(choice)
    return {**chunk("", None), "choices": choices, **usage_fields(served, jobs, finals)}


# ---- /v1/chat/completions -----------------------------------------------------------------------

async def chat_completions(body: ChatCompletionRequest, http_request: HTTPRequest):
    # Messages through the model's chat template, then the same path as /v1/completions.
    state = state_of(http_request)
    served = state.served
    if not getattr(served.tokenizer, "chat_template", None):
        raise APIError(400, f"{served.name} has no chat template; use /v1/completions", param="messages")
    check_request(state, body)
    messages = [message.as_template_message() for message in body.messages]
    check_prompt_chars(state, sum(len(message["content"]) for message in messages), "messages")
    ids = await encode(state, partial(chat_prompt_ids, served, messages), "messages")
    if body.max_completion_tokens is not None:
        body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
    jobs = submit(state, body, ids, "chat", default_max_tokens=served.default_max_tokens,
                  tenant=state.tenant_of(http_request))
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    if body.stream:
        return event_stream(state, jobs, body, partial(chat_chunk, served, response_id),
                            first={"role": "assistant", "content": ""})
    finals = await final_updates(state, jobs, http_request)
    return chat_body(served, body, response_id, jobs, finals)


def chat_prompt_ids(served: ServedModel, messages: list[dict]) -> list[int]:
    """The messages through the chat template, checked as any prompt (runs on the tokenizing thread)."""
    return checked_ids(served, chat_template_ids(served.tokenizer, messages))


def chat_chunk(served: ServedModel, response_id: str, text: str | None, finish: str | None,
               logprobs: list | None = None, index: int = 0) -> dict:
    """One chat.completion.chunk with one choice's delta (text None: an empty delta)."""
    delta = {} if text is None else {"content": text}
    choice = {"index": index, "delta": delta, "finish_reason": finish}
    if logprobs is not None:
        choice["logprobs"] = chat_logprobs(logprobs, served.tokenizer)
    return {"id": response_id, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": served.name, "choices": [choice]}


def chat_body(served: ServedModel, body: ChatCompletionRequest, response_id: str, jobs: list[Job],
              finals: list[RowUpdate]) -> dict:
    """The whole (non-streamed) chat.completion: every choice's message, usage and `speculative`."""
    choices = []
    for index, (job, final) in enumerate(zip(jobs, finals)):
        logprobs = logprobs_of(job)
        choice = {"index": index, "message": {"role": "assistant", "content": job.request.text},
                  "finish_reason": FINISH_REASONS[final.finish_reason],
                  "logprobs": None if logprobs is None else chat_logprobs(logprobs, served.tokenizer)}
        if body.return_token_ids:  # vLLM's extension, where vLLM puts them
            choice["token_ids"] = list(job.request.generated)
        choices.append(choice)
    ids = {"prompt_token_ids": list(jobs[0].request.prompt_ids)} if body.return_token_ids else {}
    return {"id": response_id, "object": "chat.completion", "created": int(time.time()), "model": served.name,
            "choices": choices, **usage_fields(served, jobs, finals), **ids}


# ---- log-probabilities, as each endpoint spells them ----------------------------------------------

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
