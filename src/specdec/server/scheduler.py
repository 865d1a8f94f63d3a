"""The bridge between HTTP handlers (asyncio) and the BatchEngine (one thread).

The engine runs in its own thread, so the event loop stays free to accept
connections and stream while a step computes (torch releases the GIL). Handlers
submit() a Job and read its updates from an asyncio queue the engine thread
fills through loop.call_soon_threadsafe. Between steps the thread admits
waiting jobs into free rows, drops cancelled ones (their clients went away),
and steps the batch. The waiting queue is bounded: past max_queue, submit()
raises QueueFull and the handler answers 429 instead of letting memory and
latency grow without limit.
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

    # ---- event-loop side ----------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def submit(self, request: Request, endpoint: str) -> Job:
        """Queue a validated request; raises QueueFull or EngineStopped."""
        job = Job(request, asyncio.get_running_loop(), endpoint)
        with self._wake:
            if not self.alive:
                raise EngineStopped("the engine is not running")
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

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._waiting and not self._running:
                    self._wake.wait()
                if self._stopping:
                    break
                self._drop_cancelled()
                admit = self._take_admissible()
            for job in admit:  # prefill outside the lock: submit() must not wait for it
                self._admit(job)
            if self.engine.running:
                self._step()
        for job in [*self._running.values(), *self._waiting]:
            job.deliver(JobFailed("the server is shutting down", 503))

    def _take_admissible(self) -> list[Job]:
        admit = []
        while self._waiting and len(admit) < self.engine.free_slots:
            admit.append(self._waiting.popleft())
        self.metrics.waiting.set(len(self._waiting))
        return admit

    def _drop_cancelled(self) -> None:
        for job in [job for job in self._waiting if job.cancelled]:
            self._waiting.remove(job)
            self._finish(job, "cancelled")
        for handle, job in list(self._running.items()):
            if job.cancelled:
                self.engine.remove(handle)
                del self._running[handle]
                self._finish(job, "cancelled")
        self.metrics.running.set(len(self._running))

    def _admit(self, job: Job) -> None:
        self.metrics.queue_time.observe(time.perf_counter() - job.submitted)
        reused_before = self.engine.reused_prompt_tokens
        try:
            self.engine.add(job.id, job.request)
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
            for handle in self.engine.clear():
                job = self._running.pop(handle)
                job.deliver(JobFailed(f"generation failed: {error}"))
                self._finish(job, "error")
            self.metrics.running.set(0)
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
