"""The methods that draft with a trained head on the target's hidden states (EAGLE, EAGLE-2's trees,
EAGLE-3, Medusa, the MLP speculator): their options and entries. The proposers are in heads.py, imported when one is built
(they bring the heads' modules); the factory loads the head itself (factory.load_head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specdec.option_fields import is_int
from specdec.proposers.base import Proposer
from specdec.proposers.batched import BatchProposer
from specdec.proposers.entry import Build, MethodEntry
from specdec.proposers.stop_rules import ConfidenceStop

DEFAULT_TREE_SIZE = 10


@dataclass(frozen=True)
class HeadOptions:
    """Trained draft heads (eagle, eagle3, medusa and their trees).

    path: a checkpoint from `specdec train-head` or an EAGLE-3 speculators directory
    (None: the one trained for the target in the models' cache); tree_size: drafted nodes
    per step (None: the method's default; "auto": EAGLE-2 trees sized each step from the
    head's confidence and the measured verification costs); tree_topk: candidates per
    expanded node; confidence: under -k auto a chain stops after a token its head gave a probability
    below this (0: never). Its flags are cli_options.add_head_args' (bench takes lists of tree sizes)."""

    GROUP: ClassVar[str] = "head"
    TITLE: ClassVar[str] = "draft heads"
    path: str | None = None
    tree_size: int | str | None = None
    tree_topk: int = 4
    confidence: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.confidence < 1.0:
            raise ValueError(f"a head's confidence threshold must lie in [0, 1), got {self.confidence!r}")
        if self.tree_size not in (None, "auto") and (not is_int(self.tree_size) or self.tree_size < 0):
            raise ValueError(f"tree_size must be an integer >= 0, 'auto' or None, got {self.tree_size!r}")
        if not is_int(self.tree_topk) or self.tree_topk < 1:
            raise ValueError(f"tree_topk must be an integer >= 1, got {self.tree_topk!r}")


def _build(kind: str, tree: bool):
    """The builder of a head method: `kind` the head it needs, `tree` whether it drafts trees."""

    def build(build: Build) -> Proposer | BatchProposer:
        options = build.option(HeadOptions)
        size = (DEFAULT_TREE_SIZE if tree else 0) if options.tree_size is None else options.tree_size
        if size == "auto" and build.slots > 1:
            raise ValueError("--tree-size auto weighs one request's verification costs; the server verifies many "
                             "rows in one forward: give it a number (--tree-size N)")

        # Every row's proposer is made here (RowwiseProposer makes them all at once): a missing or
        # mismatched head is a clear error now.
        stop = ConfidenceStop(options.confidence) if build.adaptive and options.confidence > 0 else None
        return build.per_row(lambda: _head_proposer(build, kind, tree, size, options.tree_topk, stop))

    return build


def _head_proposer(build: Build, kind: str, tree: bool, tree_size: int | str, tree_topk: int,
                   stop: ConfidenceStop | None) -> Proposer:
    from specdec.proposers.heads import EagleProposer, MedusaProposer, MLPSpeculatorProposer

    head, vocabulary = build.loaded_head, build.head_vocabulary
    if head is None:
        raise ValueError(f"method {build.method!r} needs a trained {kind} head (specdec train-head)")
    if head.config.kind != kind:
        raise ValueError(f"method {build.method!r} needs a {kind} head; this checkpoint is {head.config.kind}")
    if kind == "mlp-speculator":  # a published one (fms-extras' layout) brings its own vocabulary
        return MLPSpeculatorProposer(head.module, vocabulary, stop_rule=stop)
    if vocabulary is None:
        raise ValueError(f"method {build.method!r} needs the target's vocabulary beside its {kind} head")
    if kind == "medusa":
        if tree_size == "auto":
            raise ValueError("--tree-size auto sizes EAGLE-2 trees (eagle-tree, eagle3-tree) from the head's "
                             "confidence; give medusa a number")
        return MedusaProposer(head.module, vocabulary, tree_size=tree_size, accuracies=head.config.accuracies or None)
    if not tree:
        return EagleProposer(head.module, vocabulary, stop_rule=stop)
    size = tree_size if tree_size == "auto" else max(tree_size, 1)
    return EagleProposer(head.module, vocabulary, tree_size=size, tree_topk=tree_topk)


def _entry(name: str, kind: str, tree: bool, description: str) -> MethodEntry:
    # A head's rows run alone: their features would pile up unread in another method's rows.
    return MethodEntry(name, description, _build(kind, tree), head_kind=kind,
                       default_tree_size=DEFAULT_TREE_SIZE if tree else None, options=(HeadOptions,), runs_alone=True)


METHOD_ENTRIES = (
    _entry("eagle", "eagle", False, "an EAGLE head (one layer on the target's own hidden states, trained by "
           "`specdec train-head`) drafts a chain of k tokens"),
    _entry("eagle-tree", "eagle", True, "EAGLE-2: the EAGLE head drafts a dynamic tree (--tree-size nodes, depth "
           "<= k), verified in one target pass with a tree attention mask"),
    _entry("eagle3", "eagle3", False, "an EAGLE-3 head (reads the target's low, middle and high layers, trained on "
           "its own drafts by `specdec train-head --kind eagle3`, or a speculators/vLLM eagle3 directory) drafts a "
           "chain of k tokens"),
    _entry("eagle3-tree", "eagle3", True, "the EAGLE-3 head drafts EAGLE-2's dynamic tree, verified in one target "
           "pass"),
    _entry("medusa", "medusa", True, "Medusa heads on the target's last hidden state draft a static tree "
           "(--tree-size nodes; 0 = a chain)"),
    _entry("mlp-speculator", "mlp-speculator", False, "the MLP speculator (Wertheimer et al. 2024; `specdec "
           "train-head --kind mlp-speculator`): one small MLP stage per drafted token on the target's last hidden "
           "state and the tokens drafted so far, a chain of up to its stages"),
)
