"""Every method's entry, found in the method's own module, and method name -> proposer: the only place
a method string is read.

A module of specdec/proposers that declares `METHOD_ENTRIES` (MethodEntry, entry.py) ships those
methods; another package's arrive through the `specdec.methods` entry point (plugins.py) and become
entries too, so --method, SpecConfig, the server, bench, replay and the docs' table know them alike.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Sequence

import specdec.proposers
from specdec.models.runner import ModelRunner
from specdec.option_fields import is_int
from specdec.proposers.batched import BatchProposer
from specdec.proposers.base import Proposer
from specdec.proposers.entry import Build, MethodEntry
from specdec.proposers.plugins import discover, plugin_entry

PLAIN = MethodEntry("autoregressive", "plain decoding of the target, one token per forward (Chen et al. "
                    "Algorithm 1)", lambda build: None, beside_any=True)


def _shipped() -> dict[str, MethodEntry]:
    """Every METHOD_ENTRIES of specdec/proposers' modules, plain decoding first, then by what each needs
    (nothing, a draft model, a head) and name."""
    found = []
    for module in pkgutil.iter_modules(specdec.proposers.__path__):
        if module.name != "registry":
            found += vars(importlib.import_module(f"specdec.proposers.{module.name}")).get("METHOD_ENTRIES", ())
    entries = [PLAIN, *sorted(found, key=lambda method: (method.needs, method.name))]
    names = [method.name for method in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"two shipped entries share a method name: {sorted(names)}")
    return {method.name: method for method in entries}


ENTRIES = _shipped()
PLUGINS = discover(set(ENTRIES))  # other packages' methods (the specdec.methods entry point, plugins.py)
ENTRIES.update({name: plugin_entry(plugin) for name, plugin in PLUGINS.items()})
METHODS = {name: method.description for name, method in ENTRIES.items()}  # name -> its line of --help
AUTO_METHOD = "auto"  # --method's default: resolved per device by default_method() before anything loads
# Methods a request may choose beside any server's own (per_request.py): they need no model but the
# target, read none of its features and add no tokens to its forward.
BESIDE_ANY_METHOD = tuple(name for name, entry in ENTRIES.items() if entry.beside_any)
RUNS_ALONE = tuple(name for name, entry in ENTRIES.items() if entry.runs_alone)  # beside none of them
DEFAULT_TREE_SIZE = {name: entry.default_tree_size for name, entry in ENTRIES.items()
                     if entry.default_tree_size is not None}
TREE_METHODS = tuple(DEFAULT_TREE_SIZE)  # the methods --tree-size sizes


def _option_groups() -> dict[str, type]:
    groups: dict[str, type] = {}
    for method in ENTRIES.values():
        for kind in method.options:
            if groups.setdefault(kind.GROUP, kind) is not kind:
                raise ValueError(f"two options dataclasses claim the group {kind.GROUP!r}: "
                                 f"{groups[kind.GROUP].__name__} and {kind.__name__} ({method.name})")
    return groups


# Option group -> its options dataclass: SpecConfig.options' groups and the command line's.
OPTION_GROUPS = _option_groups()


def request_methods_beside(method: str) -> tuple[str, ...]:
    """The methods a server running `method` lets a request choose besides it: BESIDE_ANY_METHOD,
    except beside a method whose entry says it runs alone (a head, lookahead decoding)."""
    if entry(method).runs_alone:
        return ()
    return tuple(other for other in BESIDE_ANY_METHOD if other != method)


def check_request_methods(method: str, requested: Sequence[str]) -> tuple[str, ...]:
    """The methods a request may choose on a server running `method`, as asked: each a known method,
    and `method` itself or one request_methods_beside allows (else a ValueError naming those)."""
    allowed = request_methods_beside(method)
    for name in requested:
        check_method(name)
    refused = [name for name in requested if name not in allowed and name != method]
    if refused:
        raise ValueError(f"a request cannot choose {', '.join(refused)} beside {method}; "
                         f"it may choose: {', '.join(allowed) or 'nothing (this method runs alone)'}")
    return tuple(requested)


def entry(method: str) -> MethodEntry:
    """The method's one description (an unknown name: a ValueError listing the known ones)."""
    check_method(method)
    return ENTRIES[method]


def head_kind(method: str) -> str | None:
    """The kind of trained head a method needs ("eagle", "medusa"), or None."""
    return entry(method).head_kind


def default_method(device_type: str) -> str:
    """What `--method auto` runs: the fastest lossless method measured on that kind of device.

    CPU: copy (scored copying) with -k auto. It finds every continuation prompt lookup finds and
    more (earlier requests' prompts and answers, longer matches), and chooses among them by a
    fitted score and the machine's measured costs; in the interleaved runs and the peer runs it
    was ahead of prompt lookup (ngram, the default before it) on the copying tasks and level with
    it on free text (benchmarks/RESULTS.md, "The default on a CPU: scored copying (issue 60,
    item 3)"). Like ngram it loads no draft model, and ngram stayed ahead of the draft model with
    -k auto, whose step costs a large share of the target's (docs/history.md, "An AVX2-only
    CPU: w4a8 that counts its multiplies, attention that keeps the cores busy, a controller that
    counts the draft's prefill (issue 19, third part)").

    CUDA: ngram. On an H100 specdec's steps are bound by kernel launches, not by the GPU:
    the 0.5B draft's step costs as much as the 1.5B target's, so drafting k tokens costs k
    target steps, and even a draft whose every token is accepted (the target drafting for
    itself) barely beat plain decoding, while a 64-token verification costs what one token
    does, which ngram needs (docs/history.md, "Exact on a GPU: one step shape on CUDA
    (exactness, first GPU lease)"). Scored copying has not been compared with it live on a GPU.
    """
    return "copy" if device_type == "cpu" else "ngram"


def resolve_method(method: str, device_type: str) -> str:
    """A method name as given (`auto` included) -> the method that runs on that device."""
    return default_method(device_type) if method == AUTO_METHOD else method


def check_method(method: str) -> None:
    if method not in ENTRIES:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(ENTRIES)}")


def needs_draft_model(method: str) -> bool:
    return entry(method).needs_draft_model


def methods_reading(options: type) -> tuple[str, ...]:
    """The methods that read an options dataclass (NgramOptions, SuffixOptions, ...): what the CLI's
    group for it names."""
    return tuple(name for name, method in ENTRIES.items() if options in method.options)


def check_proposer_options(method: str, *, draft_k: int | None = None, draft_confidence: float | None = None,
                           **options) -> None:
    """Validate before any model is loaded, so a typo costs no load time: the method, the draft model's
    knobs, and each options group (group name -> an instance of its dataclass, which checked itself)."""
    check_method(method)
    if draft_k is not None and (not is_int(draft_k) or draft_k < 1):
        raise ValueError(f"draft_k must be an integer >= 1 or None, got {draft_k!r}")
    if draft_confidence is not None and not 0.0 <= draft_confidence < 1.0:
        raise ValueError(f"the draft confidence threshold must lie in [0, 1), got {draft_confidence!r}")
    for group, value in options.items():
        if group not in OPTION_GROUPS:
            raise TypeError(f"unknown option group {group!r}; the methods read: {', '.join(OPTION_GROUPS)}")
        if not isinstance(value, OPTION_GROUPS[group]):
            raise ValueError(f"{group} must be a {OPTION_GROUPS[group].__name__}, got {value!r}")


def build_proposer(
    method: str,
    *,
    slots: int = 1,
    draft_runner: ModelRunner | None = None,
    adaptive: bool = False,
    draft_k: int | None = None,
    draft_confidence: float | None = None,
    loaded_head=None,  # models.heads.LoadedHead, for the head methods
    head_vocabulary=None,  # models.heads.FrozenVocabulary: the target's embedding and output head
    replay_cost=None,  # `specdec replay`'s price of an n-token forward, in steps (Build.replay_cost)
    draft_bridge=None,  # a draft with another tokenizer: its VocabularyBridge (proposers/cross_vocabulary.py)
    **options,
) -> Proposer | BatchProposer | None:
    """The proposer of `slots` rows (1: SpecEngine's; a server's slots: BatchEngine's), built by the
    method's entry (ENTRIES); None means plain decoding: the engine then drafts nothing.

    options: option group -> options (suffix=SuffixOptions(...), ngram=NgramOptions(...), head=
    HeadOptions(...), ...; a group not given reads its defaults). A method that keeps state per
    request (n-gram, suffix, lookahead, the heads) gets one proposer per row (RowwiseProposer; suffix
    decoding's cache and a head's weights are shared by the rows); the draft model is batch-native
    (draft_runner: one cache row per slot). draft_k caps the draft model's tokens per step beside a
    copying source (default: the engine's k). adaptive (`-k auto`): the draft model stops below
    draft_confidence, the n-gram proposal length follows the match length.
    """
    check_proposer_options(method, draft_k=draft_k, draft_confidence=draft_confidence, **options)
    build = Build(method, slots, draft_runner, adaptive, draft_k, draft_confidence, loaded_head, head_vocabulary,
                  options, replay_cost, draft_bridge)
    return ENTRIES[method].build(build)
