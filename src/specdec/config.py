"""SpecConfig: everything that decides how one speculative engine is built, in one typed value.

Built once at the edge (the CLI's options, `specdec.load(...)`'s keywords, the server's
command line) and handed to `specdec.factory`, which is the one place an engine is made
from it. Nothing below the command modules reads the parsed command line; this plays the
part of vLLM's SpeculativeConfig.

A config is frozen and checked when built, so a typo (K < 1, an unknown method, an
n-gram minimum above its maximum) is a ValueError before any model loads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from specdec.models.native.linear import QUANTIZATIONS
from specdec.option_fields import is_int
from specdec.proposers.draft_model import DEFAULT_CONFIDENCE
from specdec.proposers.head_methods import HeadOptions
from specdec.proposers.ngram import NgramOptions
from specdec.proposers.registry import (AUTO_METHOD, METHODS, OPTION_GROUPS, check_method, head_kind,
                                        needs_draft_model, resolve_method)

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")  # models/loader.py
BACKENDS = ("auto", "native", "hf")


@dataclass(frozen=True)
class SpecConfig:
    """How to build one engine: the models, the method and its knobs.

    method "auto" and draft None are settled by `resolved()` for the device the engine runs
    on (copy on a CPU, ngram on CUDA; a named draft means ngram+draft with it under k "auto", whose
    controller picks each step's source, and the draft alone with a fixed k).
    k: tokens drafted per step (>= 1) or "auto" (each step's k from measured costs and the
    request's acceptance, at most max_k).
    options: the methods' options, each an instance of an options dataclass its method's entry names
    (NgramOptions(max=4), SuffixOptions(...), CopyOptions(...), HeadOptions(...), a plug-in's): at most
    one per group; a group not given keeps its defaults (option(NgramOptions) reads either).
    """

    target: str = DEFAULT_TARGET
    method: str = AUTO_METHOD
    k: int | str = "auto"
    draft: str | None = None
    max_k: int = 8
    draft_confidence: float = DEFAULT_CONFIDENCE  # with k auto the draft model stops below this probability
    draft_k: int | None = None  # ngram+draft: at most this many draft-model tokens (None: k)
    device: str = "auto"
    dtype: str = "auto"
    backend: str = "auto"
    quantize: str = "auto"
    draft_quantize: str = "auto"
    draft_vocab: int | None = None  # the draft's head scores only this many frequent tokens
    options: tuple = ()

    def __post_init__(self) -> None:
        if self.method != AUTO_METHOD:
            check_method(self.method)
        if self.k != "auto" and (not is_int(self.k) or self.k < 1):
            raise ValueError(f"k must be an integer >= 1 or 'auto', got {self.k!r}")
        if not is_int(self.max_k) or self.max_k < 1:
            raise ValueError(f"max_k must be an integer >= 1, got {self.max_k!r}")
        if not 0.0 <= self.draft_confidence < 1.0:
            raise ValueError(f"the draft confidence threshold must lie in [0, 1), got {self.draft_confidence!r}")
        if self.draft_k is not None and (not is_int(self.draft_k) or self.draft_k < 1):
            raise ValueError(f"draft_k must be an integer >= 1 or None, got {self.draft_k!r}")
        if self.draft_vocab is not None and (not is_int(self.draft_vocab) or self.draft_vocab < 1):
            raise ValueError(f"draft_vocab must be an integer >= 1 or None, got {self.draft_vocab!r}")
        for name, value, choices in (("quantize", self.quantize, ("auto", *QUANTIZATIONS)),
                                     ("draft_quantize", self.draft_quantize, ("auto", *QUANTIZATIONS)),
                                     ("backend", self.backend, BACKENDS), ("dtype", self.dtype, DTYPES)):
            if value not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
        object.__setattr__(self, "options", _checked_options(self.options))

    def resolved(self, device_type: str | None = None) -> SpecConfig:
        """The config with method auto and the draft default settled for the device.

        device_type: "cpu", "cuda", ...; None resolves --device (auto = cuda if available)."""
        method, draft = self.method, self.draft
        if method == AUTO_METHOD:
            if draft is not None:  # ngram+draft >= draft in every bench category (benchmarks/RESULTS.md,
                method = "ngram+draft" if self.k == "auto" else "draft"  # "ngram+draft: each row's source")
            else:
                if device_type is None:
                    from specdec.models.loader import resolve_device

                    device_type = resolve_device(self.device).type
                method = resolve_method(method, device_type)
        if draft is None and needs_draft_model(method):
            draft = DEFAULT_DRAFT
        return dataclasses.replace(self, method=method, draft=draft)

    def with_method(self, method: str, k: int | str | None = None, tree_size: int | str | None = None) -> SpecConfig:
        """The same models and options with another method (and k, tree size): bench's grid, verify's baseline."""
        config = dataclasses.replace(self, method=method, k=self.k if k is None else k)
        if tree_size is None:
            return config
        return config.with_options(dataclasses.replace(self.option(HeadOptions), tree_size=tree_size))

    def option(self, kind: type):
        """The options of `kind` (an options dataclass: NgramOptions, HeadOptions, ...): as given, else its
        defaults."""
        return next((given for given in self.options if isinstance(given, kind)), None) or kind()

    def method_options(self) -> dict[str, object]:
        """Every option group -> its options, given or default: registry.build_proposer's keywords."""
        return {group: self.option(kind) for group, kind in OPTION_GROUPS.items()}

    def with_options(self, *options) -> SpecConfig:
        """The same config with these options replacing those of their groups."""
        groups = {type(given).GROUP for given in options}
        kept = tuple(given for given in self.options if type(given).GROUP not in groups)
        return dataclasses.replace(self, options=kept + tuple(options))

    @property
    def needs_draft_model(self) -> bool:
        return self.method != AUTO_METHOD and needs_draft_model(self.method)

    @property
    def head_kind(self) -> str | None:
        """The trained head the method loads ("eagle", "eagle3", "medusa"), or None."""
        return None if self.method == AUTO_METHOD else head_kind(self.method)

    def summary(self) -> str:
        """One line for logs: method, k and what drafts."""
        drafter = f"draft {self.draft}" if self.needs_draft_model else (
            f"{self.head_kind} head" if self.head_kind else "no draft model")
        return f"{self.target} | {self.method} ({drafter}) | k={self.k}"


def option_groups() -> dict[str, type]:
    """SpecConfig's option groups, name -> options dataclass (NgramOptions, SuffixOptions, ...): those
    the methods' entries name in MethodEntry.options."""
    return dict(OPTION_GROUPS)


def _checked_options(options) -> tuple:
    """options as a tuple, each an instance of an option group's dataclass, one per group; in one order
    (by group) and without those equal to their defaults, so equal configs compare equal."""
    if not isinstance(options, (tuple, list)):
        raise ValueError(f"options must be a tuple of options dataclasses (NgramOptions(...), ...), got {options!r}")
    seen = set()
    for given in options:
        group = getattr(type(given), "GROUP", None)
        if OPTION_GROUPS.get(group) is not type(given):
            raise ValueError(f"options holds {given!r}, which no method reads; the options dataclasses are: "
                             f"{', '.join(kind.__name__ for kind in OPTION_GROUPS.values())}")
        if group in seen:
            raise ValueError(f"options holds two {type(given).__name__}s: give one per group")
        seen.add(group)
    return tuple(sorted((given for given in options if given != type(given)()), key=lambda given: type(given).GROUP))


__all__ = ["DEFAULT_DRAFT", "DEFAULT_TARGET", "HeadOptions", "METHODS", "NgramOptions", "SpecConfig"]
