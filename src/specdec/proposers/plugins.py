"""Proposers from other packages: a method registered under the `specdec.methods` entry point runs
wherever a shipped method does (generate, serve, bench, verify, specdec.load), with no fork.

vLLM takes a user's proposer as a `custom_class`, SGLang through a plugin registry; here a package
declares, in its pyproject.toml,

    [project.entry-points."specdec.methods"]
    toy = "my_package.toy:METHOD"

where METHOD is a PluginMethod (a name, a line of help and a function that makes the proposer), or,
for a method with options of its own, a MethodEntry (entry.py) as the shipped methods declare theirs:
its options dataclass's flagged fields then become command-line flags and a SpecConfig option group
(docs/methods.md, "Write your own proposer", has both).
Entry points are read once, when specdec.proposers.registry is imported. Exactness is the engine's:
a plug-in only proposes; the engine verifies every draft with the same rule as for a shipped method.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points

from specdec.models.runner import ModelRunner
from specdec.proposers.base import Proposer
from specdec.proposers.batched import BatchProposer, RowwiseProposer
from specdec.proposers.entry import MethodEntry

ENTRY_POINT_GROUP = "specdec.methods"


@dataclass(frozen=True)
class PluginMethod:
    """One method from another package.

    name: what --method and method= take; description: one line for --help;
    make(draft_runner): a new proposer, called once per row (a Proposer: one request at a time) or
    once per engine (a BatchProposer: every row at once); draft_runner is the loaded draft model
    where needs_draft_model, else None."""

    name: str
    description: str
    make: Callable[[ModelRunner | None], Proposer | BatchProposer]
    needs_draft_model: bool = False


def discover(shipped: set[str]) -> dict[str, PluginMethod | MethodEntry]:
    """Every installed plug-in method by name. A broken or clashing plug-in raises a clear error
    naming its entry point: it must not silently change what a method name means."""
    found: dict[str, PluginMethod | MethodEntry] = {}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point {point.name!r} ({point.value}) in group {ENTRY_POINT_GROUP!r}"
        try:
            method = point.load()
        except Exception as error:  # any import failure of someone else's package
            raise ImportError(f"cannot load the specdec method plug-in {where}: {error}") from error
        if not isinstance(method, (PluginMethod, MethodEntry)):
            raise TypeError(f"{where} must name a specdec.proposers.plugins.PluginMethod or a "
                            f"specdec.proposers.entry.MethodEntry, got {type(method).__name__}")
        if method.name in shipped or method.name in found or method.name == "auto":
            raise ValueError(f"{where}: method name {method.name!r} is already taken")
        found[method.name] = method
    return found


def plugin_entry(method: PluginMethod | MethodEntry) -> MethodEntry:
    """The registry's entry for a plug-in: a MethodEntry as given (marked a plug-in), or a PluginMethod's;
    a model-free plug-in is replayable."""
    if isinstance(method, MethodEntry):
        return dataclasses.replace(method, description=f"{method.description} (plug-in)", plugin=True)
    return MethodEntry(method.name, f"{method.description} (plug-in)",
                       lambda build: build_plugin(method, build.slots, build.draft_runner),
                       needs_draft_model=method.needs_draft_model, plugin=True, replayable=not method.needs_draft_model)


def build_plugin(method: PluginMethod, slots: int, draft_runner: ModelRunner | None) -> Proposer | BatchProposer:
    """The plug-in's proposer for `slots` rows: its Proposer once per row (RowwiseProposer), or its
    BatchProposer as it is (it must then serve `slots` rows itself)."""
    if method.needs_draft_model and draft_runner is None:
        raise ValueError(f"method {method.name!r} needs a draft model (--draft)")
    first = method.make(draft_runner)
    if isinstance(first, BatchProposer):
        return first
    if not isinstance(first, Proposer):
        raise TypeError(f"method {method.name!r} made a {type(first).__name__}, not a Proposer or BatchProposer")
    # As the registry builds the heads' rows: the first made for its clear errors, then one per row.
    return first if slots == 1 else RowwiseProposer(lambda: method.make(draft_runner), slots)
