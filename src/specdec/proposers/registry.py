"""Every method, described once (MethodEntry: its name, line of help, needs, tree size, option groups,
where it runs), and method name -> proposer. The only place a method string is read.

Shipped methods are entries here; another package's arrive through the `specdec.methods` entry point
(plugins.py) and become entries too, so --method, SpecConfig, the server, bench and the docs' table
know them alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specdec.models.runner import ModelRunner
from specdec.proposers.base import Proposer
from specdec.proposers.copy_draft import CopyThenDraftProposer
from specdec.proposers.batched import BatchProposer, RowwiseProposer
from specdec.proposers.draft_model import CONTEXT_WINDOW, DEFAULT_CONFIDENCE, DraftModelProposer
from specdec.proposers.hybrid import DRAFT_CONTEXT_WINDOW, NgramThenDraftProposer
from specdec.proposers.lookahead import LookaheadOptions, LookaheadProposer
from specdec.proposers.ngram import NgramProposer, check_ngram_args
from specdec.proposers.plugins import build_plugin, discover
from specdec.proposers.scored_copy import CopyOptions, ScoredCopyProposer, ScoredCopyRows, load_scorer
from specdec.proposers.suffix import SuffixCache, SuffixOptions, SuffixProposer


@dataclass(frozen=True)
class Build:
    """What a method's proposer is built from: build_proposer's arguments, checked."""

    method: str
    slots: int
    draft_runner: ModelRunner | None
    adaptive: bool
    ngram_max: int
    ngram_min: int
    ngram_tie_break: str
    draft_k: int | None
    draft_confidence: float | None
    head: object
    head_vocabulary: object
    tree_size: int | str | None
    tree_topk: int
    suffix: SuffixOptions | None
    suffix_cache: SuffixCache | None
    lookahead: LookaheadOptions | None
    copy: CopyOptions | None

    def per_row(self, make: Callable[[], Proposer]) -> Proposer | BatchProposer:
        """One proposer for one slot; RowwiseProposer (one per row) for several."""
        return make() if self.slots == 1 else RowwiseProposer(make, self.slots)


@dataclass(frozen=True)
class MethodEntry:
    """One method, described once: everything else that names methods (SpecConfig's checks, the CLI's
    --method and its option groups, the factory, bench's tree grid, replay, the server's per-request
    choices, the README's table: tests/proposers/test_registry.py) reads it from here.

    options: the SpecConfig option groups it reads ("ngram", "suffix", "copy", "lookahead", "head");
    default_tree_size: the nodes per step --tree-size sizes (None: it drafts chains); replayable:
    `specdec replay` drafts it from recorded answers; beside_any: a request may choose it beside any
    server's method (per_request.py)."""

    name: str
    description: str
    build: Callable[[Build], Proposer | BatchProposer | None]
    needs_draft_model: bool = False
    head_kind: str | None = None
    default_tree_size: int | None = None
    options: tuple[str, ...] = ()
    replayable: bool = False
    beside_any: bool = False
    plugin: bool = False


def _ngram(build: Build) -> Proposer | BatchProposer:
    return build.per_row(lambda: NgramProposer(build.ngram_max, build.ngram_min, build.ngram_tie_break,
                                               follow_match=build.adaptive))


def _suffix(build: Build) -> Proposer | BatchProposer:
    options = build.suffix or SuffixOptions()
    cache = build.suffix_cache if build.suffix_cache is not None else options.new_tenant_caches()
    return build.per_row(lambda: SuffixProposer(cache, options))


def _head(build: Build) -> Proposer | BatchProposer:
    size = (ENTRIES[build.method].default_tree_size or 0) if build.tree_size is None else build.tree_size
    if size == "auto" and build.slots > 1:
        raise ValueError("--tree-size auto weighs one request's verification costs; the server verifies many "
                         "rows in one forward: give it a number (--tree-size N)")

    def make() -> Proposer:
        return _head_proposer(build.method, build.head, build.head_vocabulary, size, build.tree_topk)

    first = make()  # the clear errors, before copies
    return first if build.slots == 1 else RowwiseProposer(make, build.slots)


def _draft_model(build: Build, confidence: float | None) -> DraftModelProposer:
    if build.draft_runner is None:
        raise ValueError(f"method {build.method!r} needs a draft model (--draft)")
    if getattr(build.draft_runner, "batch_size", 1) != build.slots:
        raise ValueError(f"the draft model needs one cache row per slot ({build.slots}): a native runner's "
                         "with_batch_size(slots)")
    # Beside a copying source the draft reads a shorter window of the prompt (hybrid.py says why).
    window = CONTEXT_WINDOW if build.method == "draft" else DRAFT_CONTEXT_WINDOW
    return DraftModelProposer(build.draft_runner, confidence, context_window=window)


def _draft(build: Build) -> DraftModelProposer:
    return _draft_model(build, build.draft_confidence if build.adaptive else None)


def _ngram_then_draft(build: Build) -> BatchProposer:
    draft = _draft_model(build, build.draft_confidence if build.adaptive else None)
    # The lookup's proposals stay max_k long: -k auto sizes each match length by its own rates (hybrid.py).
    lookup = build.per_row(lambda: NgramProposer(build.ngram_max, build.ngram_min, build.ngram_tie_break))
    return NgramThenDraftProposer(lookup, draft, build.draft_k)


def _copy_then_draft(build: Build) -> BatchProposer:
    # It sizes its own steps whatever k is: its draft model always stops where unsure.
    draft = _draft_model(build, DEFAULT_CONFIDENCE if build.draft_confidence is None else build.draft_confidence)
    return CopyThenDraftProposer(RowwiseProposer(_scored_copy_maker(build.copy), build.slots), draft, build.draft_k)


def _copy(build: Build) -> Proposer | BatchProposer:
    make = _scored_copy_maker(build.copy)
    return make() if build.slots == 1 else ScoredCopyRows(make, build.slots)


def _shipped() -> dict[str, MethodEntry]:
    entries = [
        MethodEntry("autoregressive", "plain decoding of the target, one token per forward (Chen et al. Algorithm 1)",
                    lambda build: None, beside_any=True),
        MethodEntry("draft", "a small draft model proposes k tokens, the target verifies them (Chen et al. "
                    "Algorithm 2)", _draft, needs_draft_model=True, replayable=True),
        MethodEntry("ngram", "prompt lookup / LLMA: copy what followed the last n tokens earlier in the context; "
                    "no draft model", _ngram, options=("ngram",), replayable=True, beside_any=True),
        MethodEntry("ngram+draft", "n-gram lookup first, the draft model when the lookup finds no match",
                    _ngram_then_draft, needs_draft_model=True, options=("ngram",), replayable=True),
        MethodEntry("eagle", "an EAGLE head (one layer on the target's own hidden states, trained by `specdec "
                    "train-head`) drafts a chain of k tokens", _head, head_kind="eagle", options=("head",)),
        MethodEntry("eagle-tree", "EAGLE-2: the EAGLE head drafts a dynamic tree (--tree-size nodes, depth <= k), "
                    "verified in one target pass with a tree attention mask", _head, head_kind="eagle",
                    default_tree_size=10, options=("head",)),
        MethodEntry("eagle3", "an EAGLE-3 head (reads the target's low, middle and high layers, trained on its own "
                    "drafts by `specdec train-head --kind eagle3`, or a speculators/vLLM eagle3 directory) drafts a "
                    "chain of k tokens", _head, head_kind="eagle3", options=("head",)),
        MethodEntry("eagle3-tree", "the EAGLE-3 head drafts EAGLE-2's dynamic tree, verified in one target pass",
                    _head, head_kind="eagle3", default_tree_size=10, options=("head",)),
        MethodEntry("medusa", "Medusa heads on the target's last hidden state draft a static tree (--tree-size "
                    "nodes; 0 = a chain)", _head, head_kind="medusa", default_tree_size=10, options=("head",)),
        MethodEntry("lookahead", "lookahead decoding: the target itself guesses n-grams by Jacobi iteration over a "
                    "window of guesses, in the same forward that verifies earlier ones; no draft model (native "
                    "backend)", lambda build: build.per_row(lambda: LookaheadProposer(build.lookahead)),
                    options=("lookahead",)),
        MethodEntry("copy", "scored copying: every continuation this request and earlier ones offer, each token's "
                    "acceptance estimated by a fitted score, the candidate and length with the most tokens per "
                    "second under the machine's measured costs; no draft model",
                    _copy, options=("copy",),
                    replayable=True, beside_any=True),
        MethodEntry("copy+draft", "scored copying and the draft model: each step drafted by the one whose expected "
                    "tokens per second is higher (copying's fitted score, the draft model's measured rate and time)",
                    _copy_then_draft, needs_draft_model=True, options=("copy",)),
        MethodEntry("suffix", "suffix decoding: frequency-scored draft trees from suffix trees over this request and "
                    "earlier requests' outputs (a cache shared across requests); no draft model", _suffix,
                    options=("suffix",), replayable=True, beside_any=True),
    ]
    return {method.name: method for method in entries}


ENTRIES = _shipped()
PLUGINS = discover(set(ENTRIES))  # other packages' methods (the specdec.methods entry point, plugins.py)
ENTRIES.update({name: MethodEntry(name, f"{plugin.description} (plug-in)",
                                  lambda build, plugin=plugin: build_plugin(plugin, build.slots, build.draft_runner),
                                  needs_draft_model=plugin.needs_draft_model, plugin=True,
                                  replayable=not plugin.needs_draft_model)
                for name, plugin in PLUGINS.items()})
METHODS = {name: method.description for name, method in ENTRIES.items()}  # name -> its line of --help
AUTO_METHOD = "auto"  # --method's default: resolved per device by default_method() before anything loads
# Methods a request may choose beside any server's own (per_request.py): they need no model but the
# target, read none of its features and add no tokens to its forward.
BESIDE_ANY_METHOD = tuple(name for name, entry in ENTRIES.items() if entry.beside_any)
DEFAULT_TREE_SIZE = {name: entry.default_tree_size for name, entry in ENTRIES.items()
                     if entry.default_tree_size is not None}
TREE_METHODS = tuple(DEFAULT_TREE_SIZE)  # the methods --tree-size sizes


def request_methods_beside(method: str) -> tuple[str, ...]:
    """The methods a server running `method` lets a request choose besides it: BESIDE_ANY_METHOD,
    except beside a head (its rows' features would pile up unread in every other row) and lookahead
    decoding (its window's tokens are priced into every drafting row's forward), which run alone."""
    check_method(method)
    if head_kind(method) is not None or method == "lookahead":
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


def methods_reading(options: str) -> tuple[str, ...]:
    """The methods that read one of SpecConfig's option groups ("ngram", "suffix", "copy", ...):
    what the CLI's group for it names."""
    return tuple(name for name, method in ENTRIES.items() if options in method.options)


def check_proposer_options(
    method: str, *, ngram_max: int = 3, ngram_min: int = 1, ngram_tie_break: str = "recent",
    draft_k: int | None = None, draft_confidence: float | None = None, suffix: SuffixOptions | None = None,
    lookahead: LookaheadOptions | None = None,
) -> None:
    """Validate before any model is loaded, so a typo costs no load time (SuffixOptions checks itself)."""
    check_method(method)
    check_ngram_args(ngram_max, ngram_min, ngram_tie_break)
    if draft_k is not None and (isinstance(draft_k, bool) or not isinstance(draft_k, int) or draft_k < 1):
        raise ValueError(f"draft_k must be an integer >= 1 or None, got {draft_k!r}")
    if draft_confidence is not None and not 0.0 <= draft_confidence < 1.0:
        raise ValueError(f"the draft confidence threshold must lie in [0, 1), got {draft_confidence!r}")


def build_proposer(
    method: str,
    *,
    slots: int = 1,
    draft_runner: ModelRunner | None = None,
    ngram_max: int = 3,
    ngram_min: int = 1,
    ngram_tie_break: str = "recent",
    draft_k: int | None = None,
    draft_confidence: float | None = None,
    adaptive: bool = False,
    head=None,  # models.heads.LoadedHead, for eagle / eagle-tree / medusa
    head_vocabulary=None,  # models.heads.FrozenVocabulary: the target's embedding and output head
    tree_size: int | None = None,
    tree_topk: int = 4,
    suffix: SuffixOptions | None = None,
    suffix_cache: SuffixCache | None = None,  # shared across engines and tenants; default: one per tenant
    lookahead: LookaheadOptions | None = None,
    copy: CopyOptions | None = None,
) -> Proposer | BatchProposer | None:
    """The proposer of `slots` rows (1: SpecEngine's; a server's slots: BatchEngine's), built by the
    method's entry (ENTRIES); None means plain decoding: the engine then drafts nothing.

    A method that keeps state per request (n-gram, suffix, lookahead, the heads) gets one proposer
    per row (RowwiseProposer; suffix decoding's cache and a head's weights are shared by the rows);
    the draft model is batch-native (draft_runner: one cache row per slot).
    draft_k caps the draft model's tokens per step in ngram+draft (default: the engine's k).
    adaptive (`--k auto`): the draft model stops below draft_confidence, the n-gram
    proposal length follows the match length.
    """
    check_proposer_options(method, ngram_max=ngram_max, ngram_min=ngram_min, ngram_tie_break=ngram_tie_break,
                           draft_k=draft_k, draft_confidence=draft_confidence)
    build = Build(method, slots, draft_runner, adaptive, ngram_max, ngram_min, ngram_tie_break, draft_k,
                  draft_confidence, head, head_vocabulary, tree_size, tree_topk, suffix, suffix_cache, lookahead, copy)
    return ENTRIES[method].build(build)


def _scored_copy_maker(copy: CopyOptions | None) -> Callable[[], ScoredCopyProposer]:
    """Scored copying's rows: one scorer, one cost curve and one corpus per tenant, shared by the rows."""
    options = copy or CopyOptions()
    scorer, costs, corpora = load_scorer(options.scorer), options.new_step_costs(), options.new_tenant_corpora()
    return lambda: ScoredCopyProposer(scorer, corpora, costs, trees=options.trees)


def _head_proposer(method: str, head, vocabulary, tree_size: int, tree_topk: int) -> Proposer:
    from specdec.proposers.heads import EagleProposer, MedusaProposer

    if head is None or vocabulary is None:
        raise ValueError(f"method {method!r} needs a trained {head_kind(method)} head (specdec train-head)")
    if head.config.kind != head_kind(method):
        raise ValueError(f"method {method!r} needs a {head_kind(method)} head; this checkpoint is {head.config.kind}")
    if method in ("eagle", "eagle3"):
        return EagleProposer(head.module, vocabulary)
    if method in ("eagle-tree", "eagle3-tree"):
        size = tree_size if tree_size == "auto" else max(tree_size, 1)
        return EagleProposer(head.module, vocabulary, tree_size=size, tree_topk=tree_topk)
    if tree_size == "auto":
        raise ValueError("--tree-size auto sizes EAGLE-2 trees (eagle-tree, eagle3-tree) from the head's confidence; "
                         "give medusa a number")
    return MedusaProposer(head.module, vocabulary, tree_size=tree_size, accuracies=head.config.accuracies or None)
