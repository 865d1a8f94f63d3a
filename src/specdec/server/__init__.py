"""OpenAI-compatible HTTP API over the batched engine; no decoding logic of its own.

    app = build_server(target_runner, tokenizer, name="qwen2.5-coder-1.5b",
                       config=SpecConfig(method="draft", k=4), draft_runner=draft_runner, slots=8)
    uvicorn.run(app, host="127.0.0.1", port=8000)
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from fastapi import FastAPI

from specdec.config import SpecConfig
from specdec.engine.batch import BatchEngine
from specdec.models.loader import eos_ids_of
from specdec.proposers.registry import check_method, request_methods_beside
from specdec.server.app import create_app
from specdec.server.guards import ServerLimits
from specdec.server.metrics import ServerMetrics
from specdec.server.scheduler import Scheduler
from specdec.server.state import ServedModel

__all__ = ["ServerLimits", "build_server"]


def build_server(target_runner, tokenizer, *, name: str, config: SpecConfig, draft_runner=None,
                 slots: int = 8, max_queue: int = 64, eos_token_ids: frozenset[int] | None = None,
                 max_context: int | None = None, default_max_tokens: int = 256,
                 spec_max_batch: int | None = None, lenience: float = 1.0,
                 api_key: str | list[str] | None = None,
                 public_metrics: bool = False, prefill_chunk: int | None = None, head=None,
                 prompt_cache: bool = True, limits: ServerLimits | None = None, shared_cache: bool = False,
                 tenant_header: str | None = None, request_methods: Sequence[str] | None = None) -> FastAPI:
    """The app for one target (a NativeRunner; its weights are shared, its cache is not) and the method
    and options of `config` (a resolved SpecConfig; k a fixed integer: the batched engine drafts fixed k).

    slots: requests decoded together (rows of the batch); max_queue: requests that may wait
    for a row before the server answers 429; max_context: cap on prompt + completion tokens;
    spec_max_batch: draft only while at most this many requests run (None: always);
    with --method suffix all requests share one cache of earlier outputs;
    lenience: every request's (sampling/params.py); below 1 the server is LOSSY, and its /v1/models
    and each response's `speculative` block say so; head: (LoadedHead, FrozenVocabulary) for an
    eagle / eagle3 / medusa method (factory.load_head); prompt_cache: a finished request's cache row
    stays in a free slot, and a later prompt that begins with its tokens prefills only the rest
    (engine/batch.py; exact, and reported as usage.prompt_tokens_details.cached_tokens).
    api_key: one key or several (each a tenant: the prompt cache and suffix decoding's cache are shared
    only within one, unless shared_cache); tenant_header: a header a trusted proxy sets, splitting
    tenants further; limits: ServerLimits (server/guards.py), each a flag of `specdec serve`.
    request_methods: the methods a request's `speculative` object may name besides config's (None:
    every one registry.request_methods_beside allows; (): only config's own).
    """
    from specdec.factory import batch_proposer_for

    method, k = config.method, config.k
    check_method(method)
    if isinstance(lenience, bool) or not isinstance(lenience, (int, float)) or not 0 < lenience <= 1:
        raise ValueError(f"lenience must be in (0, 1] (1 = exact, < 1 = lossy), got {lenience!r}")
    for label, value in (("slots", slots), ("k", 1 if k == "auto" else k), ("default_max_tokens", default_max_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be an integer >= 1, got {value!r}")
    if k == "auto":  # goodput decides per step, batch size included: no blanket switch-off
        spec_max_batch = None
    if not hasattr(target_runner, "with_batch_size"):
        raise ValueError("serving needs the native backend (Qwen2 / Llama family): the transformers backend "
                         "runs one sequence at a time")
    target = target_runner.with_batch_size(slots, max_context=max_context)
    draft = None
    if draft_runner is not None and config.needs_draft_model:
        if not hasattr(draft_runner, "with_batch_size"):
            raise ValueError("serving with a draft model needs the draft on the native backend too")
        draft = draft_runner.with_batch_size(slots, max_context=target.max_context)
    others = request_methods_beside(method) if request_methods is None else tuple(request_methods)
    proposer = batch_proposer_for(config, slots=slots, draft_runner=draft, head=head,
                                  request_methods=(method, *(other for other in others if other != method)))
    eos = eos_ids_of(tokenizer) if eos_token_ids is None else eos_token_ids
    engine = BatchEngine(target, proposer, tokenizer, k=k, eos_token_ids=eos, spec_max_batch=spec_max_batch,
                         prefill_chunk=prefill_chunk, max_k=config.max_k, prompt_cache=prompt_cache)
    metrics = ServerMetrics(model=name, method=method, k=k, slots=slots, max_queue=max_queue)
    scheduler = Scheduler(engine, metrics, max_queue=max_queue)
    served = ServedModel(name, tokenizer, target.max_context, target.vocab_size, method, k, default_max_tokens,
                         int(time.time()), float(lenience), engine.request_methods, config.max_k)
    return create_app(scheduler, served, api_key=api_key, public_metrics=public_metrics, limits=limits,
                      shared_cache=shared_cache, tenant_header=tenant_header)
