"""One generation request's path through the server, shared by /v1/completions and /v1/chat/completions:
refuse what can be refused before any work, tokenize off the event loop, queue one job per sample,
then wait for the final updates or stream them as server-sent events, cancelling every job whose
client has gone. Each function takes the app's ServerState (server/state.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from specdec.engine.batch import RowUpdate
from specdec.engine.metrics import RequestStats
from specdec.engine.request import Speculation, encode_prompt
from specdec.sampling.params import SamplingParams
from specdec.server.protocol import APIError, ChatCompletionRequest, SamplingRequest, SpeculativeOptions
from specdec.server.scheduler import EngineStopped, Job, JobFailed, QueueFull
from specdec.server.state import ServedModel, ServerState

DISCONNECT_POLL_S = 0.5  # how often a waiting non-streaming handler checks that its client is still there
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # engine -> OpenAI

# An endpoint's chunk: (text, finish_reason, log-probabilities, choice index) -> one response object.
Chunk = Callable[..., dict]


# ---- before any work --------------------------------------------------------------------------

def check_request(state: ServerState, body: SamplingRequest) -> None:
    """What can be refused before any work: the model's name, unsupported options, the limits."""
    served, limits = state.served, state.limits
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


def check_prompt_chars(state: ServerState, chars: int, param: str) -> None:
    """Refuse a prompt too long to be worth tokenizing, before the tokenizer spends time on it."""
    bound = state.limits.prompt_chars(state.served.max_context)
    if chars > bound:
        raise APIError(400, f"the {param} has {chars} characters; this server reads at most {bound} "
                            f"(specdec serve --max-prompt-chars)", param=param, code="context_length_exceeded")


def checked_ids(served: ServedModel, prompt: str | list[int]) -> list[int]:
    """The prompt's token ids, refused (ValueError) past the context or outside the vocabulary."""
    return encode_prompt(served.tokenizer, prompt, served.max_context, vocab_size=served.vocab_size)


async def encode(state: ServerState, encode_ids: Callable[[], list[int]], param: str) -> list[int]:
    """Run encode_ids on the tokenizing thread: a long prompt must not freeze every other stream."""
    try:
        return await asyncio.get_running_loop().run_in_executor(state.tokenizing, encode_ids)
    except ValueError as error:
        code = "context_length_exceeded" if "context" in str(error) else None
        raise APIError(400, str(error), param=param, code=code) from None
    except Exception as error:  # noqa: BLE001 - e.g. a chat template that rejects the messages
        raise APIError(400, f"could not encode the {param}: {error}", param=param) from None


# ---- queueing ---------------------------------------------------------------------------------

def submit(state: ServerState, body: SamplingRequest, ids: list[int], endpoint: str, default_max_tokens: int,
           tenant: str | None) -> list[Job]:
    """One queued job per sample (body.n), all or none: a refusal part-way cancels those already queued."""
    scheduler, served, limits = state.scheduler, state.served, state.limits
    logprob_count = body.logprob_count()
    room = served.max_context - len(ids)
    if limits.max_tokens_cap is not None:
        default_max_tokens = min(default_max_tokens, limits.max_tokens_cap)
    max_tokens = body.max_tokens if body.max_tokens is not None else min(default_max_tokens, room)
    if max_tokens > room:
        raise APIError(400, f"this model's context is {served.max_context} tokens; the prompt has {len(ids)} "
                            f"and max_tokens asks for {max_tokens} more", param="max_tokens",
                       code="context_length_exceeded")
    asked = body.speculative or SpeculativeOptions()
    try:
        speculation = scheduler.engine.check_speculation(Speculation(asked.method, asked.k))
    except ValueError as error:
        raise APIError(400, str(error), param="speculative") from None
    try:
        # n samples: one request each, seeds seed, seed + 1, ... (as vLLM), one shared prefill (engine/batch.py)
        requests = [scheduler.engine.make_request(
            ids, SamplingParams(temperature=body.temperature, top_k=max(body.top_k, 0), top_p=body.top_p,
                                min_p=body.min_p, seed=None if body.seed is None else body.seed + index,
                                lenience=served.lenience),
            max_new_tokens=max_tokens, stop=body.stop_strings, ignore_eos=body.ignore_eos,
            logprobs=logprob_count, max_stop_chars=limits.max_stop_chars, speculation=speculation)
            for index in range(body.n)]
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


# ---- waiting for the engine -------------------------------------------------------------------

async def updates(state: ServerState, job: Job, http_request: HTTPRequest | None) -> AsyncIterator[RowUpdate]:
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
                state.scheduler.cancel(job)
                raise asyncio.CancelledError
        if event is None:
            continue
        if isinstance(event, JobFailed):
            raise APIError(event.status, event.message, type="server_error", code=event.code)
        yield event
        if event.finish_reason is not None:
            return


async def final_update(state: ServerState, job: Job, http_request: HTTPRequest) -> RowUpdate:
    """The job's last update, for a whole (non-streamed) response."""
    try:
        async for update in updates(state, job, http_request):
            if update.finish_reason is not None:
                return update
    finally:
        state.scheduler.cancel(job)  # a no-op once finished; frees the row if the handler was cancelled
    raise APIError(500, "generation ended without a result", type="server_error")


async def final_updates(state: ServerState, jobs: list[Job], http_request: HTTPRequest) -> list[RowUpdate]:
    """Every sample's last update, in order; one failing stops the others."""
    try:
        return list(await asyncio.gather(*(final_update(state, job, http_request) for job in jobs)))
    finally:
        for job in jobs:  # one failed: the others stop too
            state.scheduler.cancel(job)


def logprobs_of(job: Job) -> list | None:
    """The job's log-probabilities, or None when its request did not ask for them."""
    return job.request.token_logprobs if job.request.logprobs is not None else None


# ---- streaming --------------------------------------------------------------------------------

def event_stream(state: ServerState, jobs: list[Job], body: SamplingRequest, chunk: Chunk,
                 first: dict | None) -> StreamingResponse:
    """Server-sent events of every choice, interleaved as their tokens come (each chunk names its
    choice's index), a closing chunk per choice, then usage when asked and [DONE]."""
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return StreamingResponse(_events(state, jobs, chunk, first, include_usage), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _pump(state: ServerState, index: int, job: Job, merged: asyncio.Queue) -> None:
    """One choice's updates into the merged queue, then None; an error goes in as the item."""
    try:
        async for update in updates(state, job, None):
            await merged.put((index, update))
    except APIError as error:
        await merged.put((index, error))
    finally:
        await merged.put((index, None))


async def _events(state: ServerState, jobs: list[Job], chunk: Chunk, first: dict | None,
                  include_usage: bool) -> AsyncIterator[str]:
    """The stream's events; first: the chat delta that opens each choice (None for completions)."""
    merged: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(state, index, job, merged)) for index, job in enumerate(jobs)]
    finals: dict[int, RowUpdate] = {}
    pending = {index: [] for index in range(len(jobs))}  # log-probabilities of text still held back
    try:
        if first is not None:  # chat: the role comes first
            for index in range(len(jobs)):
                opening = chunk(None, None, None, index)
                opening["choices"][0]["delta"] = first
                yield sse(opening)
        # Starlette cancels this generator when the client disconnects (ASGI 2.3).
        open_choices = len(jobs)
        while open_choices:
            index, item = await merged.get()
            if item is None:
                open_choices -= 1
                continue
            if isinstance(item, APIError):
                yield sse(item.body())
                break
            job, update = jobs[index], item
            pending[index] += update.logprobs or []
            wanted = pending[index] if job.request.logprobs is not None else None
            if update.text:
                yield sse(chunk(update.text, None, wanted, index))
                pending[index] = []
                wanted = [] if wanted is not None else None
            if update.finish_reason is None:
                continue
            finals[index] = update
            closing = chunk(None if first is not None else "", FINISH_REASONS[update.finish_reason],
                            wanted if wanted else None, index)
            closing["speculative"] = speculative(state.served, [update.stats], job.request.speculation)
            yield sse(closing)
        if include_usage and len(finals) == len(jobs):
            yield sse({**chunk("", None), "choices": [],
                       **usage_fields(state.served, jobs, [finals[index] for index in range(len(jobs))])})
    finally:
        for task in tasks:
            task.cancel()
        for job in jobs:
            state.scheduler.cancel(job)
    yield "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


# ---- what speculation did ---------------------------------------------------------------------

def usage_fields(served: ServedModel, jobs: list[Job], finals: list[RowUpdate]) -> dict:
    """usage (the prompt once, every choice's tokens) and `speculative` (over all choices)."""
    prompt = len(jobs[0].request.prompt_ids)
    completion = sum(len(job.request.generated) for job in jobs)
    # OpenAI's field for prompt tokens served from a cache (here: a finished request's row, or a twin's).
    cached = max(final.stats.prompt_tokens_reused for final in finals)
    return {"usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": cached}},
            "speculative": speculative(served, [final.stats for final in finals], jobs[0].request.speculation)}


def speculative(served: ServedModel, all_stats: list[RequestStats], speculation: Speculation) -> dict:
    """What speculation did: the method and k the request ran with, and one choice's stats, or the sums
    (and rates of the sums) over n choices."""
    if len(all_stats) == 1:
        stats = all_stats[0]
    else:
        stats = RequestStats()
        for choice in all_stats:
            stats.merge(choice)
    return {
        **served.ran(speculation),
        "drafted_tokens": stats.drafted_tokens, "accepted_tokens": stats.accepted_tokens,
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "mean_accepted_length": round(stats.mean_accepted_length, 4),
        "target_forwards": stats.target_forwards,
        "acceptance_per_position": [round(rate, 4) for rate in stats.acceptance_per_position],
        "prefill_s": round(stats.prefill_time_s, 4), "decode_s": round(stats.decode_time_s, 4),
    }
