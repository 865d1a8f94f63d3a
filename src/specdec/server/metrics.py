"""Prometheus metrics of the server: traffic, latency, and what speculation did.

One registry per server (tests run several side by side). Names follow
Prometheus conventions (specdec_*_total counters, *_seconds histograms);
acceptance per draft position is exported both as counters (rate() them over
any window) and as a gauge over the server's lifetime, next to the mean
accepted length tau = tokens emitted per target forward.
"""

from __future__ import annotations

import threading

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

disable_created_metrics()  # no *_created series beside every counter: only clutter for this server

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, *, model: str, method: str, k: int, slots: int, max_queue: int) -> None:
        self.registry = registry = CollectorRegistry()
        self._lock = threading.Lock()  # the engine thread and the event loop both record
        Gauge("specdec_info", "The served model and method.", ["model", "method", "k"],
              registry=registry).labels(model, method, str(k)).set(1)
        Gauge("specdec_slots", "Requests the engine runs at once (rows of the batch).", registry=registry).set(slots)
        Gauge("specdec_queue_capacity", "Requests that may wait for a slot.", registry=registry).set(max_queue)
        self.running = Gauge("specdec_running_requests", "Requests in the batch now.", registry=registry)
        self.waiting = Gauge("specdec_waiting_requests", "Requests queued for a slot now.", registry=registry)
        self.requests = Counter("specdec_requests_total", "Finished requests by endpoint and outcome "
                                "(stop, length, cancelled, error).", ["endpoint", "outcome"], registry=registry)
        self.rejected = Counter("specdec_rejected_requests_total", "Requests answered with an error before "
                                "running (bad_request, not_found, queue_full, unavailable).", ["reason"],
                                registry=registry)
        self.prompt_tokens = Counter("specdec_prompt_tokens_total", "Prompt tokens received.", registry=registry)
        self.cached_prompt_tokens = Counter("specdec_prompt_tokens_cached_total", "Prompt tokens not prefilled: "
                                            "copied from a finished request's row (prompt cache) or a running "
                                            "twin's.", registry=registry)
        self.generation_tokens = Counter("specdec_generation_tokens_total", "Tokens generated.", registry=registry)
        self.time_to_first_token = Histogram("specdec_time_to_first_token_seconds", "Arrival to first token.",
                                             buckets=LATENCY_BUCKETS, registry=registry)
        self.inter_token_latency = Histogram("specdec_inter_token_latency_seconds", "Time per output token after "
                                             "the first (a step's gap over its tokens).", buckets=TOKEN_BUCKETS,
                                             registry=registry)
        self.request_latency = Histogram("specdec_request_latency_seconds", "Arrival to last token.",
                                         buckets=LATENCY_BUCKETS, registry=registry)
        self.queue_time = Histogram("specdec_queue_time_seconds", "Arrival to admission into the batch.",
                                    buckets=LATENCY_BUCKETS, registry=registry)
        self.step_time = Histogram("specdec_engine_step_seconds", "One batched speculative step.",
                                   buckets=LATENCY_BUCKETS, registry=registry)
        self.batch_rows = Histogram("specdec_engine_step_rows", "Requests in one step.",
                                    buckets=tuple(sorted({1, 2, 4, 8, 16, 32, 64, slots})), registry=registry)
        self.target_forwards = Counter("specdec_target_forwards_total", "Decode steps summed over requests "
                                       "(one target forward per request per step).", registry=registry)
        self.drafted = Counter("specdec_draft_tokens_total", "Draft tokens proposed.", registry=registry)
        self.accepted = Counter("specdec_accepted_tokens_total", "Draft tokens accepted.", registry=registry)
        self.drafted_at = Counter("specdec_draft_tokens_by_position_total", "Draft tokens proposed at draft "
                                  "position (0 = first).", ["position"], registry=registry)
        self.accepted_at = Counter("specdec_accepted_tokens_by_position_total", "Draft tokens accepted at draft "
                                   "position.", ["position"], registry=registry)
        self.acceptance_at = Gauge("specdec_acceptance_rate_by_position", "Accepted / proposed at draft position, "
                                   "since start.", ["position"], registry=registry)
        self.mean_accepted_length = Gauge("specdec_mean_accepted_length", "Tokens emitted per target forward "
                                          "(tau; 1.0 = plain decoding), since start.", registry=registry)
        self.acceptance_rate = Gauge("specdec_acceptance_rate", "Accepted / proposed draft tokens, since start.",
                                     registry=registry)
        self._totals = {"drafted": [], "accepted": [], "tokens": 0, "forwards": 0}

    def record_step(self, rows: int, time_s: float) -> None:
        self.step_time.observe(time_s)
        self.batch_rows.observe(rows)

    def record_tokens(self, drafted: int, accepted: int, emitted: int) -> None:
        """One request's share of one step."""
        with self._lock:
            totals = self._totals
            self.target_forwards.inc()
            self.generation_tokens.inc(emitted)
            self.drafted.inc(drafted)
            self.accepted.inc(accepted)
            totals["tokens"] += emitted
            totals["forwards"] += 1
            for name, upto, counter in (("drafted", drafted, self.drafted_at), ("accepted", accepted,
                                                                               self.accepted_at)):
                counts = totals[name]
                counts.extend([0] * (upto - len(counts)))
                for position in range(upto):
                    counts[position] += 1
                    counter.labels(str(position)).inc()
            for position, proposed in enumerate(totals["drafted"]):
                accepted_here = totals["accepted"][position] if position < len(totals["accepted"]) else 0
                self.acceptance_at.labels(str(position)).set(accepted_here / proposed)
            self.mean_accepted_length.set(totals["tokens"] / totals["forwards"])
            drafted_all = sum(totals["drafted"])
            self.acceptance_rate.set(sum(totals["accepted"]) / drafted_all if drafted_all else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
