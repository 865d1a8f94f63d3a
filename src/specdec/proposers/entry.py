"""How a method describes itself: a MethodEntry, declared in the method's own module as
`METHOD_ENTRIES`, and the Build its builder receives.

A method's module holds its proposer, its options dataclass (a GROUP name, a TITLE and flagged fields:
option_fields.py) and its entries; registry.py finds the entries, and SpecConfig, the command line's
option groups, the factory, bench, replay, the server and the README's table read them from there
(docs/architecture.md, "One entry per method"). Adding a method touches its module and its tests.

Nothing here imports a proposer, so every method module may import this one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from specdec.proposers.base import Proposer
from specdec.proposers.batched import BatchProposer, RowwiseProposer


@dataclass(frozen=True)
class Build:
    """What a method's proposer is built from (registry.build_proposer's arguments, checked).

    slots: rows served at once (1: SpecEngine; a server's slots: BatchEngine); draft_runner: the loaded
    draft model (one cache row per slot) or None; adaptive: k is "auto"; draft_k, draft_confidence:
    the draft model's cap and stopping threshold; loaded_head, head_vocabulary: a trained head and the
    target's frozen embedding and output head, for the head methods; options: option group -> options
    instance (each options dataclass's GROUP; a group not given reads its defaults); replay_cost: a
    replay's price of a forward of n tokens in steps (`specdec replay`: nothing is timed there, so a
    method that sizes its drafts by step costs takes this as its fixed curve), None in an engine;
    draft_bridge: the draft's vocabulary beside the target's where their tokenizers differ, else None."""

    method: str
    slots: int = 1
    draft_runner: object = None
    adaptive: bool = False
    draft_k: int | None = None
    draft_confidence: float | None = None
    loaded_head: object = None
    head_vocabulary: object = None
    options: Mapping[str, object] = field(default_factory=dict)
    replay_cost: Callable[[int], float] | None = None
    draft_bridge: object = None  # a draft with another tokenizer: its cross_vocabulary.VocabularyBridge

    def option(self, kind: type):
        """The options of `kind` (an options dataclass) this build was given, else its defaults."""
        given = self.options.get(kind.GROUP)
        return kind() if given is None else given

    def per_row(self, make: Callable[[], Proposer]) -> Proposer | BatchProposer:
        """One proposer for one slot; RowwiseProposer (one per row) for several."""
        return make() if self.slots == 1 else RowwiseProposer(make, self.slots)


# The order --method's help, the README's table and the entries list methods in: what each needs.
NEEDS_NOTHING, NEEDS_DRAFT, NEEDS_HEAD = 0, 1, 2


@dataclass(frozen=True)
class MethodEntry:
    """One method, described once.

    build(Build): its proposer (None: plain decoding); options: the options dataclasses it reads (each
    a group of SpecConfig.options and of the command line's flags, titled by the methods that read it);
    needs_draft_model / head_kind ("eagle", "eagle3", "medusa"): what must be loaded for it;
    default_tree_size: the nodes per step --tree-size sizes (None: it drafts chains); replayable:
    `specdec replay` drafts it from recorded answers; beside_any: a request may choose it beside any
    server's method (per_request.py); runs_alone: no request may choose another method beside it
    (its tokens ride in every row's forward); plugin: it came from another package (plugins.py)."""

    name: str
    description: str
    build: Callable[[Build], Proposer | BatchProposer | None]
    needs_draft_model: bool = False
    head_kind: str | None = None
    default_tree_size: int | None = None
    options: tuple[type, ...] = ()
    replayable: bool = False
    beside_any: bool = False
    runs_alone: bool = False
    plugin: bool = False

    @property
    def needs(self) -> int:
        """NEEDS_NOTHING, NEEDS_DRAFT or NEEDS_HEAD: where it sorts among the entries."""
        return NEEDS_HEAD if self.head_kind is not None else NEEDS_DRAFT if self.needs_draft_model else NEEDS_NOTHING
