"""SpecConfig -> loaded models, proposer, engine: the one factory every entry point uses.

The CLI (generate, demo, bench, analyze, verify, serve, train-head), the Python API
(`specdec.load`) and the server all come through here, so one config builds the same
engine whichever door a user takes; the scripts in benchmarks/ do too (public_engines.py
there), so a measured row is a user's engine. Checks that cost no model load (the method's
options, a head's checkpoint on disk) run before anything is loaded.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from specdec.config import DEFAULT_DRAFT, HeadOptions, SpecConfig
from specdec.engine import SpecEngine
from specdec.proposers.base import Proposer
from specdec.proposers.batched import BatchProposer
from specdec.proposers.per_request import PerRequestMethods
from specdec.proposers.registry import build_proposer, check_proposer_options, check_request_methods

Log = Callable[[str], None]


def log_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def check_before_loading(config: SpecConfig) -> None:
    """Everything about the method that can fail without a model: its options and its head's file."""
    check_proposer_options(config.method, **proposer_options(config))
    if config.head_kind is not None:
        from specdec.models.heads import locate_head

        locate_head(config.target, config.head_kind, config.option(HeadOptions).path)


def load_models(config: SpecConfig, *, need_draft: bool | None = None, log: Log = log_to_stderr,
                progress: bool = True):
    """(target, draft or None) as models.loader.LoadedModel. need_draft: default, the method's need;
    an unnamed draft is the default draft."""
    from specdec.models.loader import load_model

    if need_draft is None:
        need_draft = config.needs_draft_model
    log(f"loading target {config.target} ...")
    shared = dict(device=config.device, dtype=config.dtype, backend=config.backend, progress=progress)
    target = load_model(config.target, **shared, quantize=config.quantize)
    log(f"  {target.describe()} from {target.path} in {target.load_time_s:.1f}s")
    draft = None
    if need_draft:
        draft = load_draft(config, log=log, progress=progress)
        pair_draft(target, draft, log=log)
    return target, draft


def pair_draft(target, draft, *, log: Log = log_to_stderr) -> None:
    """Where the draft's tokenizer differs from the target's, give the draft the VocabularyBridge it
    drafts through (proposers/cross_vocabulary.py), and say so."""
    from specdec.models.loader import same_vocabulary

    if draft.bridge is not None or same_vocabulary(target.tokenizer, draft.tokenizer):
        return
    from specdec.proposers.cross_vocabulary import VocabularyBridge

    draft.bridge = VocabularyBridge.between(draft.tokenizer, target.tokenizer, draft.runner.vocab_size,
                                            target.runner.vocab_size)
    log(f"  the draft's tokenizer differs from the target's: it drafts the {draft.bridge.shared} tokens both "
        "spell the same (exact, greedy and sampled)")


def load_draft(config: SpecConfig, *, log: Log = log_to_stderr, progress: bool = True):
    """The draft model alone, as load_models loads it (an unnamed draft is the default draft): for
    callers that share one draft among targets of several formats (benchmarks/)."""
    from specdec.models.loader import load_model

    name = config.draft or DEFAULT_DRAFT
    log(f"loading draft {name} ...")
    draft = load_model(name, device=config.device, dtype=config.dtype, backend=config.backend, progress=progress,
                       quantize=config.draft_quantize, head_vocab=config.draft_vocab, role="draft")
    log(f"  {draft.describe()} from {draft.path} in {draft.load_time_s:.1f}s")
    return draft


def proposer_for(config: SpecConfig, target, draft=None, *,
                 heads: dict | None = None) -> Proposer | BatchProposer | None:
    """The method's proposer over loaded models (None: plain decoding).

    heads: a dict shared across calls so that a grid of k values loads each head once."""
    return build_proposer(config.method, draft_runner=draft.runner if draft is not None else None,
                          draft_bridge=draft.bridge if draft is not None else None,
                          adaptive=config.k == "auto", **proposer_options(config),
                          **_head_arguments(config, target, heads))


def engine_for(config: SpecConfig, target, draft=None, *, heads: dict | None = None) -> SpecEngine:
    """A SpecEngine over already loaded models (bench's grid and verify share one target)."""
    return SpecEngine(target.runner, proposer_for(config, target, draft, heads=heads), target.tokenizer,
                      k=config.k, eos_token_ids=target.eos_token_ids, max_k=config.max_k)


def plain_engine(target) -> SpecEngine:
    """Plain decoding of the same loaded target: the baseline every comparison uses."""
    return SpecEngine(target.runner, None, target.tokenizer, k=1, eos_token_ids=target.eos_token_ids)


def load_engine(config: SpecConfig, *, log: Log = log_to_stderr, progress: bool = True):
    """(engine, target LoadedModel, draft LoadedModel or None) for a resolved config."""
    check_before_loading(config)
    target, draft = load_models(config, log=log, progress=progress)
    return engine_for(config, target, draft), target, draft


def batch_proposer_for(config: SpecConfig, *, slots: int, draft_runner=None, head=None,
                       request_methods: Sequence[str] = ()):
    """The batched engine's proposer (engine/batch.py; the server): draft_runner is a native
    runner with one cache row per slot; head: (LoadedHead, FrozenVocabulary) from load_head,
    for a head method. None: plain decoding. request_methods: other methods a request may choose
    (registry.check_request_methods): then a PerRequestMethods over the config's method and them,
    each built when a request first names it."""
    loaded, vocabulary = head if head is not None else (None, None)

    def build(method: str):
        return build_proposer(method, slots=slots, draft_runner=draft_runner, adaptive=config.k == "auto",
                              **proposer_options(config), loaded_head=loaded, head_vocabulary=vocabulary)

    if not request_methods:
        return build(config.method)
    check_request_methods(config.method, request_methods)
    builders = {method: (lambda method=method: build(method)) for method in (config.method, *request_methods)}
    return PerRequestMethods(config.method, builders, slots)


def load_head(config: SpecConfig, target):
    """(LoadedHead, FrozenVocabulary) of a head method for a loaded target, or None."""
    if config.head_kind is None:
        return None
    from specdec.models.heads import load_head_for

    return load_head_for(target, config.head_kind, config.option(HeadOptions).path)


def proposer_options(config: SpecConfig) -> dict:
    """build_proposer's draft-model keywords and every option group's options (proposers/registry.py)."""
    return dict(draft_k=config.draft_k, draft_confidence=config.draft_confidence, **config.method_options())


def _head_arguments(config: SpecConfig, target, heads: dict | None) -> dict:
    """build_proposer's head keywords for a method that drafts with a trained head (else none)."""
    kind = config.head_kind
    if kind is None:
        return {}
    heads = {} if heads is None else heads
    key = (kind, config.option(HeadOptions).path)
    if key not in heads:
        heads[key] = load_head(config, target)
    head, vocabulary = heads[key]
    return dict(loaded_head=head, head_vocabulary=vocabulary)
