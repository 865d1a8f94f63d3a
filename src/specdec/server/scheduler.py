"""The bridge between HTTP handlers (asyncio) and the BatchEngine (one thread).

The engine runs in its own thread, so the event loop stays free to accept
connections and stream while a step computes (torch releases the GIL). Handlers
submit() a Job and read its updates from an asyncio queue the engine thread
fills through loop.call_soon_threadsafe. Between steps the thread admits
waiting jobs into free rows, drops cancelled ones (their clients went away)
and those past their deadline, and steps the batch. The waiting queue is bounded:
past max_queue, submit() raises QueueFull and the handler answers 429 instead of
letting memory and latency grow without limit.

The engine thread never dies of an error: a failure that is one request's own fails that request
(engine/batch.py's RowUpdate.error); any other exception fails the requests holding rows, with a 500,
and the thread serves on from an empty batch. Only when that recovery itself fails, or
MAX_CONSECUTIVE_FAILURES iterations in a row fail, is the engine taken as broken: every job fails,
submit() refuses (503), and /health says 503 with the reason.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from specdec.engine.batch import BatchEngine, RowUpdate
from specdec.engine.request import Request
from specdec.server.metrics import ServerMetrics

log = logging.getLogger("specdec.server")


class QueueFull(Exception):
    pass


class EngineStopped(Exception):
    pass


@dataclass(frozen=True)
class JobFailed:
    """Delivered instead of an update when the engine could not finish the job."""

    message: str
    status: int = 500
    code: str | None = None


@dataclass(eq=False)
class Job:
    request: Request
    loop: asyncio.AbstractEventLoop
    endpoint: str = "completions"
    id: int = 0
    submitted: float = field(default_factory=time.perf_counter)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # RowUpdate | JobFailed
    cancelled: bool = False  # set by the event loop; read by the engine thread between steps
    last_token_at: float | None = None  # None until the first token
    tenant: str | None = None  # whose cached prompts and outputs it may share (server/guards.py)
    deadline: float | None = None  # perf_counter time past which it fails with 504; None: never

    def deliver(self, event: RowUpdate | JobFailed) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class Scheduler:
    def __init__(self, engine: BatchEngine, metrics: ServerMetrics, *, max_queue: int = 64) -> None:
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        self.engine, self.metrics, self.max_queue = engine, metrics, max_queue
        self._waiting: deque[Job] = deque()
        self._running: dict[int, Job] = {}
        self._wake = threading.Condition()
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.broken: str | None = None  # why the engine cannot serve any more (recovery failed)

    # ---- event-loop side ----------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping and self.broken is None

    def submit(self, request: Request, endpoint: str, *, tenant: str | None = None,
               deadline_s: float | None = None) -> Job:
        """Queue a validated request; raises QueueFull or EngineStopped. deadline_s: it fails with 504
        if still running that long from now."""
        job = Job(request, asyncio.get_running_loop(), endpoint, tenant=tenant)
        if deadline_s is not None:
            job.deadline = job.submitted + deadline_s
        with self._wake:
            if not self.alive:
                raise EngineStopped(f"the engine is broken ({self.broken}); the server must be restarted"
                                    if self.broken else "the engine is not running")
            # Free rows count as room too: a burst up to slots + max_queue is taken.
            if len(self._waiting) >= self.max_queue + self.engine.free_slots:
                raise QueueFull(f"{len(self._running)} requests running and {len(self._waiting)} waiting")
            job.id = next(self._ids)
            self._waiting.append(job)
            self.metrics.waiting.set(len(self._waiting))
            self._wake.notify()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: the engine thread frees its row before the next step."""
        with self._wake:
            job.cancelled = True
            self._wake.notify()

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="specdec-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- engine thread ------------------------------------------------------------------------

    MAX_CONSECUTIVE_FAILURES = 3

    def _serve(self) -> None:
        failures = 0
        while True:
            try:
                if not self._serve_once():
                    break
                failures = 0
            except Exception as error:  # noqa: BLE001 - the thread must outlive any one failure
                failures += 1
                log.exception("engine thread: unexpected error")
                if failures >= self.MAX_CONSECUTIVE_FAILURES:
                    self._break(f"{failures} failures in a row, the last: {error}")
                    return
                if not self._recover(error):
                    self._break(f"{error}, and emptying the batch after it failed too")
                    return
        for job in [*self._running.values(), *self._waiting]:
            job.deliver(JobFailed("the server is shutting down", 503))

    def _serve_once(self) -> bool:
        """One iteration: drop cancelled and expired jobs, admit, step. False: stop."""
        with self._wake:
            while not self._stopping and not self._waiting and not self._running:
                self._wake.wait()
            if self._stopping:
                return False
            self._drop_cancelled()
            admit = self._take_admissible()
        for job in admit:  # prefill outside the lock: submit() must not wait for it
            self._admit(job)
        if self.engine.running:
            self._step()
        return True

    def _recover(self, error: Exception) -> bool:
        """Fail the jobs holding rows (their state is unknown after the error) and empty the batch;
        waiting jobs keep their place. False if even that fails."""
        try:
            self.engine.clear()
        except Exception:  # noqa: BLE001
            log.exception("engine thread: recovery failed")
            return False
        for job in self._running.values():  # every job holding a row (or admitted, unknown to the engine)
            job.deliver(JobFailed(f"generation failed: {error}"))
            self._finish(job, "error")
        self._running.clear()
        self.metrics.running.set(0)
        return True

    def _break(self, reason: str) -> None:
        """The engine cannot serve: every job fails, submit() refuses, /health says why."""
        with self._wake:
            self.broken = reason
            jobs = [*self._running.values(), *self._waiting]
            self._running.clear()
            self._waiting.clear()
        for job in jobs:
            job.deliver(JobFailed(f"the engine is broken ({reason}); the server must be restarted", 503,
                                  "unavailable"))

    def _take_admissible(self) -> list[Job]:
        admit = []
        while self._waiting and len(admit) < self.engine.free_slots:
            admit.append(self._waiting.popleft())
        self.metrics.waiting.set(len(self._waiting))
        return admit

    def _drop_cancelled(self) -> None:
        """Drop the jobs whose clients left, and those past their deadline (told so with a 504)."""
        now = time.perf_counter()
        for job in [job for job in self._waiting if self._leaving(job, now)]:
            self._waiting.remove(job)
            self._drop(job)
        for handle, job in list(self._running.items()):
            if self._leaving(job, now):
                self.engine.remove(handle)
                del self._running[handle]
                self._drop(job)
        self.metrics.running.set(len(self._running))

    @staticmethod
    def _leaving(job: Job, now: float) -> bool:
        return job.cancelled or (job.deadline is not None and now >= job.deadline)

    def _drop(self, job: Job) -> None:
        if job.cancelled:  # its client is gone: nobody to tell
            self._finish(job, "cancelled")
            return
        job.deliver(JobFailed(f"the request ran past this server's deadline of {job.deadline - job.submitted:g} s "
                              f"(specdec serve --request-deadline)", 504, "deadline_exceeded"))
        self._finish(job, "deadline")

    def _admit(self, job: Job) -> None:
        self.metrics.queue_time.observe(time.perf_counter() - job.submitted)
        reused_before = self.engine.reused_prompt_tokens
        try:
            self.engine.add(job.id, job.request, tenant=job.tenant)
        except Exception as error:  # noqa: BLE001 - one bad request must not stop the server
            log.exception("prefill failed")
            job.deliver(JobFailed(f"prefill failed: {error}"))
            self._finish(job, "error")
            return
        self.metrics.prompt_tokens.inc(len(job.request.prompt_ids))
        self.metrics.cached_prompt_tokens.inc(self.engine.reused_prompt_tokens - reused_before)
        self._running[job.id] = job
        self.metrics.running.set(len(self._running))

    def _step(self) -> None:
        try:
            updates = self.engine.step()
        except Exception as error:  # noqa: BLE001 - fail this batch, keep serving
            log.exception("engine step failed")
            if not self._recover(error):
                raise  # the engine thread's guard (_serve) takes the engine as broken
            return
        self.metrics.record_step(self.engine.last_step.rows, self.engine.last_step.time_s)
        now = time.perf_counter()
        for update in updates:
            job = self._running[update.handle]
            if update.error is not None:  # this request's own failure: the others run on
                del self._running[update.handle]
                log.error("request %s failed: %s", job.id, update.error)
                job.deliver(JobFailed(f"generation failed: {update.error}"))
                self._finish(job, "error")
                continue
            self._record_latency(job, len(update.token_ids), now)
            self.metrics.record_tokens(update.drafted, update.accepted, len(update.token_ids))
            job.deliver(update)
            if update.finish_reason is not None:
                del self._running[update.handle]
                self._finish(job, "length" if update.finish_reason == "length" else "stop")
        self.metrics.running.set(len(self._running))

    def _record_latency(self, job: Job, tokens: int, now: float) -> None:
        if not tokens:
            return
        if job.last_token_at is None:
            self.metrics.time_to_first_token.observe(now - job.submitted)
        else:
            for _ in range(tokens):
                self.metrics.inter_token_latency.observe((now - job.last_token_at) / tokens)
        job.last_token_at = now

    def _finish(self, job: Job, outcome: str) -> None:
        self.metrics.requests.labels(job.endpoint, outcome).inc()
        if outcome in ("stop", "length"):
            self.metrics.request_latency.observe(time.perf_counter() - job.submitted)
