"""Benchmarks' engines, built as a user's are: through specdec's factory (src/specdec/factory.py) from a
SpecConfig, so a benchmark row is what `specdec.load(config=...)` (or `specdec generate` with the
same flags) gives. Each model loads once per weight format, shared by the configurations that differ
only in method, k or the method's options.

    from public_engines import build_engines   # benchmarks/ on sys.path, as a script there has it
    engines = build_engines({"ngram": SpecConfig(method="ngram", k="auto", quantize="w4a8")})
"""

from __future__ import annotations

from specdec.config import DEFAULT_DRAFT, SpecConfig
from specdec.engine import SpecEngine
from specdec.factory import Log, check_before_loading, engine_for, load_models, log_to_stderr

_TARGET_FIELDS = ("target", "device", "dtype", "backend", "quantize")  # what loading a target reads
_DRAFT_FIELDS = ("device", "dtype", "backend", "draft_quantize", "draft_vocab")  # and a draft, besides its name


class SharedModels:
    """Loaded models (models.loader.LoadedModel), keyed by the SpecConfig fields their loading reads."""

    def __init__(self, log: Log = log_to_stderr, progress: bool = False) -> None:
        self.log, self.progress = log, progress
        self.targets: dict[tuple, object] = {}
        self.drafts: dict[tuple, object] = {}
        self._paired: set[tuple] = set()  # (target key, draft key) whose vocabularies were compared

    def target(self, config: SpecConfig):
        key = tuple(getattr(config, name) for name in _TARGET_FIELDS)
        if key not in self.targets:
            self.targets[key], _ = load_models(config, need_draft=False, log=self.log, progress=self.progress)
        return self.targets[key]

    def draft(self, config: SpecConfig):
        """The method's draft model, None where the method drafts without one."""
        if not config.needs_draft_model:
            return None
        key = (config.draft or DEFAULT_DRAFT, *(getattr(config, name) for name in _DRAFT_FIELDS))
        if key not in self.drafts:
            from specdec.factory import load_draft  # here: a tree older than it still runs draft-free scripts

            self.drafts[key] = load_draft(config, log=self.log, progress=self.progress)
        pair = (tuple(getattr(config, name) for name in _TARGET_FIELDS), key)
        if pair not in self._paired:  # as load_models pairs the two it loads together
            try:
                from specdec.factory import pair_draft
            except ImportError:  # a tree older than it (engine_ab): a draft had to share the target's tokenizer
                from specdec.models.loader import check_same_vocabulary

                check_same_vocabulary(self.target(config).tokenizer, self.drafts[key].tokenizer)
            else:
                pair_draft(self.target(config), self.drafts[key], log=self.log)
            self._paired.add(pair)
        return self.drafts[key]

    def engine(self, config: SpecConfig) -> SpecEngine:
        """factory.engine_for over the shared models: the engine specdec.load builds for this config."""
        return engine_for(config, self.target(config), self.draft(config))


def build_engines(configs: dict[str, SpecConfig], models: SharedModels | None = None) -> dict[str, SpecEngine]:
    """label -> the engine of each config, resolved as specdec.load resolves it (method auto, the default
    draft); every config is checked before any model loads."""
    resolved = {label: config.resolved() for label, config in configs.items()}
    for config in resolved.values():
        check_before_loading(config)
    models = models or SharedModels()
    return {label: models.engine(config) for label, config in resolved.items()}
