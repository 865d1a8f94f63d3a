"""Method name -> proposer. The only place a method string is read."""

from __future__ import annotations

from collections.abc import Callable

from specdec.models.runner import ModelRunner
from specdec.proposers.base import Proposer
from specdec.proposers.copy_draft import CopyThenDraftProposer
from specdec.proposers.batched import BatchProposer, RowwiseProposer
from specdec.proposers.draft_model import CONTEXT_WINDOW, DEFAULT_CONFIDENCE, DraftModelProposer
from specdec.proposers.hybrid import DRAFT_CONTEXT_WINDOW, NgramThenDraftProposer
from specdec.proposers.lookahead import LookaheadOptions, LookaheadProposer
from specdec.proposers.ngram import NgramProposer, check_ngram_args
from specdec.proposers.plugins import build_plugin, discover
from specdec.proposers.scored_copy import CopyOptions, ScoredCopyProposer, load_scorer
from specdec.proposers.suffix import SuffixCache, SuffixOptions, SuffixProposer

METHODS = {
    "autoregressive": "plain decoding of the target, one token per forward (Chen et al. Algorithm 1)",
    "draft": "a small draft model proposes k tokens, the target verifies them (Chen et al. Algorithm 2)",
    "ngram": "prompt lookup / LLMA: copy what followed the last n tokens earlier in the context; no draft model",
    "ngram+draft": "n-gram lookup first, the draft model when the lookup finds no match",
    "eagle": "an EAGLE head (one layer on the target's own hidden states, trained by `specdec train-head`) "
             "drafts a chain of k tokens",
    "eagle-tree": "EAGLE-2: the EAGLE head drafts a dynamic tree (--tree-size nodes, depth <= k), verified in one "
                  "target pass with a tree attention mask",
    "eagle3": "an EAGLE-3 head (reads the target's low, middle and high layers, trained on its own drafts by "
              "`specdec train-head --kind eagle3`, or a speculators/vLLM eagle3 directory) drafts a chain of k tokens",
    "eagle3-tree": "the EAGLE-3 head drafts EAGLE-2's dynamic tree, verified in one target pass",
    "medusa": "Medusa heads on the target's last hidden state draft a static tree (--tree-size nodes; 0 = a chain)",
    "lookahead": "lookahead decoding: the target itself guesses n-grams by Jacobi iteration over a window of "
                 "guesses, in the same forward that verifies earlier ones; no draft model (native backend)",
    "copy": "scored copying: every continuation this request and earlier ones offer, each token's acceptance "
            "estimated by a fitted score, the candidate and length with the most tokens per second under the "
            "machine's measured costs; no draft model",
    "copy+draft": "scored copying and the draft model: each step drafted by the one whose expected tokens per "
                  "second is higher (copying's fitted score, the draft model's measured rate and time)",
    "suffix": "suffix decoding: frequency-scored draft trees from suffix trees over this request and earlier "
              "requests' outputs (a cache shared across requests); no draft model",
}
PLUGINS = discover(set(METHODS))  # other packages' methods (the specdec.methods entry point, plugins.py)
METHODS.update({name: f"{method.description} (plug-in)" for name, method in PLUGINS.items()})
AUTO_METHOD = "auto"  # --method's default: resolved per device by default_method() before anything loads
_NEEDS_DRAFT_MODEL = {"draft", "ngram+draft", "copy+draft",
                      *(name for name, method in PLUGINS.items() if method.needs_draft_model)}
_HEAD_KIND = {"eagle": "eagle", "eagle-tree": "eagle", "eagle3": "eagle3", "eagle3-tree": "eagle3",
              "medusa": "medusa"}  # method -> trained head it loads
DEFAULT_TREE_SIZE = {"eagle-tree": 10, "eagle3-tree": 10, "medusa": 10}  # small: on a CPU each verified node costs time
# Methods a request may choose beside any server's own (per_request.py): they need no model but the
# target, read none of its features and add no tokens to its forward.
BESIDE_ANY_METHOD = ("autoregressive", "ngram", "suffix", "copy")


def request_methods_beside(method: str) -> tuple[str, ...]:
    """The methods a server running `method` lets a request choose besides it: BESIDE_ANY_METHOD,
    except beside a head (its rows' features would pile up unread in every other row) and lookahead
    decoding (its window's tokens are priced into every drafting row's forward), which run alone."""
    check_method(method)
    if head_kind(method) is not None or method == "lookahead":
        return ()
    return tuple(other for other in BESIDE_ANY_METHOD if other != method)


def head_kind(method: str) -> str | None:
    """The kind of trained head a method needs ("eagle", "medusa"), or None."""
    check_method(method)
    return _HEAD_KIND.get(method)


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
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")


def needs_draft_model(method: str) -> bool:
    check_method(method)
    return method in _NEEDS_DRAFT_MODEL


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
    """The proposer of `slots` rows (1: SpecEngine's; a server's slots: BatchEngine's); None means
    plain decoding: the engine then drafts nothing.

    A method that keeps state per request (n-gram, suffix, lookahead, the heads) gets one proposer
    per row (RowwiseProposer; suffix decoding's cache and a head's weights are shared by the rows);
    the draft model is batch-native (draft_runner: one cache row per slot).
    draft_k caps the draft model's tokens per step in ngram+draft (default: the engine's k).
    adaptive (`--k auto`): the draft model stops below draft_confidence, the n-gram
    proposal length follows the match length.
    """
    check_proposer_options(method, ngram_max=ngram_max, ngram_min=ngram_min, ngram_tie_break=ngram_tie_break,
                           draft_k=draft_k, draft_confidence=draft_confidence)
    if method == "autoregressive":
        return None
    if method in PLUGINS:
        return build_plugin(PLUGINS[method], slots, draft_runner)

    def per_row(make: Callable[[], Proposer]) -> Proposer | BatchProposer:
        return make() if slots == 1 else RowwiseProposer(make, slots)

    def ngram() -> NgramProposer:
        return NgramProposer(ngram_max, ngram_min, ngram_tie_break, follow_match=adaptive)

    if method == "ngram":
        return per_row(ngram)
    if method == "suffix":
        options = suffix or SuffixOptions()
        cache = suffix_cache if suffix_cache is not None else options.new_tenant_caches()
        return per_row(lambda: SuffixProposer(cache, options))
    if method == "lookahead":
        return per_row(lambda: LookaheadProposer(lookahead))
    if method == "copy":
        return per_row(_scored_copy_maker(copy))
    if head_kind(method) is not None:
        size = DEFAULT_TREE_SIZE.get(method, 0) if tree_size is None else tree_size
        if size == "auto" and slots > 1:
            raise ValueError("--tree-size auto weighs one request's verification costs; the server verifies many "
                             "rows in one forward: give it a number (--tree-size N)")
        first = _head_proposer(method, head, head_vocabulary, size, tree_topk)  # the clear errors, before copies
        return first if slots == 1 else RowwiseProposer(lambda: _head_proposer(method, head, head_vocabulary, size,
                                                                               tree_topk), slots)
    if draft_runner is None:
        raise ValueError(f"method {method!r} needs a draft model (--draft)")
    if getattr(draft_runner, "batch_size", 1) != slots:
        raise ValueError(f"the draft model needs one cache row per slot ({slots}): a native runner's "
                         "with_batch_size(slots)")
    # Under ngram+draft the draft reads a shorter window of the prompt (hybrid.py says why).
    window = CONTEXT_WINDOW if method == "draft" else DRAFT_CONTEXT_WINDOW
    confidence = draft_confidence if adaptive else None
    if method == "copy+draft":  # it sizes its own steps whatever k is: its draft model always stops where unsure
        confidence = DEFAULT_CONFIDENCE if draft_confidence is None else draft_confidence
    draft = DraftModelProposer(draft_runner, confidence, context_window=window)
    if method == "draft":
        return draft
    if method == "copy+draft":
        return CopyThenDraftProposer(RowwiseProposer(_scored_copy_maker(copy), slots), draft, draft_k)
    # The lookup's proposals stay max_k long: -k auto sizes each match length by its own rates (hybrid.py).
    return NgramThenDraftProposer(per_row(lambda: NgramProposer(ngram_max, ngram_min, ngram_tie_break)), draft, draft_k)


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
