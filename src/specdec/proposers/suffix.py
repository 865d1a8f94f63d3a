"""Suffix decoding (Oliaro et al. 2024, "SuffixDecoding: Extreme Speculative Decoding for
Emerging AI Applications", arXiv 2411.04975; vLLM's `method: "suffix"` via Arctic Inference):
model-free drafting from suffix trees over the request and over earlier requests' outputs.

Agentic and repetitive workloads (multi-turn edits of one file, tool calls with the same JSON
schema, SQL over one schema) repeat long spans, both within a request and across requests.
Prompt lookup (ngram.py) finds the last few tokens once in this request's context and copies
what followed one occurrence. Suffix decoding counts every continuation of every occurrence:

  SuffixTrie       every substring of length <= max_depth of the texts it holds, as a trie
                   whose nodes count their occurrences. A request's own trie grows by one
                   token in O(max_depth) (`extend`); the global trie over earlier requests'
                   outputs adds and removes whole texts (`add`, `remove`).
  SuffixCache      the global trie, bounded to the outputs of the last `max_requests`
                   requests: the oldest is removed (its counts subtracted) when one more
                   arrives. One cache is shared by every request of an engine or a server.
  SuffixProposer   the Proposer. It keeps, for the request's context, the trie node of each
                   of its suffixes of length < max_depth in both tries (`_Cursor`), updated
                   in O(max_depth) per committed token, so a lookup never walks the history:
                   its cost does not grow with the context or the cache.

A draft is a tree (`speculate`). From the node of a suffix of length m, children are scored by
frequency: a node's probability is its parent's times count(child) / count(all children), the
estimate that the target continues that way. Nodes are taken best first while their probability
is at least min_token_prob, up to min(max_k, ceil(spec_factor * m)) nodes: a long match is
strong evidence of repetition and earns a long speculation (the paper's adaptive length). Every
matched suffix length of both tries proposes a tree; the one with the largest sum of node
probabilities (its expected accepted tokens under the frequency model) is drafted.

Drafts are point masses (probs None): siblings are tried in order and a rejected token leaves
the residual (sampling/tree.py), so the output distribution is exactly the target's, and greedy
output is plain greedy output. A tree with no branching is returned as a chain.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from specdec.option_fields import flagged, non_negative_int, positive_float, positive_int, probability

from specdec.proposers.base import DraftProposal, ProposeContext, Proposer, chain_or_tree, committed_since
from specdec.proposers.entry import Build, MethodEntry
from specdec.proposers.tenants import PerTenant

DEFAULT_MAX_DEPTH = 24  # vLLM's suffix_decoding_max_tree_depth
# The cache's trie is Python objects with path-compressed leaves: about 1 KB per cached output
# token at depth 24 (25 MB for 100 outputs of 256 tokens, benchmarks/suffix_microbench.py; 5 KB
# before the compression), so the default holds fewer requests than vLLM's 10,000 (C++ there).
DEFAULT_CACHE_REQUESTS = 500
DEFAULT_SPEC_FACTOR = 1.0  # vLLM's suffix_decoding_max_spec_factor
DEFAULT_MIN_TOKEN_PROB = 0.1  # vLLM's suffix_decoding_min_token_prob


@dataclass(frozen=True)
class SuffixOptions:
    """--method suffix's knobs, checked when built (before any model loads); each field is its own flag."""

    GROUP: ClassVar[str] = "suffix"
    TITLE: ClassVar[str] = "suffix decoding"
    cache_requests: int = flagged(
        DEFAULT_CACHE_REQUESTS, "earlier requests whose outputs the shared suffix cache keeps, oldest evicted "
        f"first (default: {DEFAULT_CACHE_REQUESTS}; 0 = each request drafts from itself only). Memory: about 1 KB "
        "per cached token (25 MB for 100 answers of 256 tokens)", parse=non_negative_int, metavar="N")
    max_depth: int = flagged(DEFAULT_MAX_DEPTH, "longest substring counted, hence the longest suffix matched "
                             f"(default: {DEFAULT_MAX_DEPTH}, vLLM's)", parse=positive_int, metavar="D")
    spec_factor: float = flagged(
        DEFAULT_SPEC_FACTOR, "draft at most ceil(F x the matched suffix's length) tokens, and at most k "
        f"(default: {DEFAULT_SPEC_FACTOR}, vLLM's): long matches earn long drafts", parse=positive_float, metavar="F")
    min_token_prob: float = flagged(
        DEFAULT_MIN_TOKEN_PROB, "draft no token whose estimated probability (the product of its path's "
        f"continuation frequencies) is below P (default: {DEFAULT_MIN_TOKEN_PROB}, vLLM's)", parse=probability,
        metavar="P", name="min-prob")

    def __post_init__(self) -> None:
        for name, low in (("cache_requests", 0), ("max_depth", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"suffix {name.replace('_', ' ')} must be an integer >= {low}, got {value!r}")
        if not self.spec_factor > 0:
            raise ValueError(f"the suffix spec factor must be > 0, got {self.spec_factor!r}")
        if not 0 <= self.min_token_prob <= 1:
            raise ValueError(f"the suffix minimum token probability must lie in [0, 1], got {self.min_token_prob!r}")

    def new_cache(self) -> SuffixCache:
        return SuffixCache(self.cache_requests, self.max_depth)

    def new_tenant_caches(self) -> TenantSuffixCaches:
        return TenantSuffixCaches(self.cache_requests, self.max_depth)


class _Node:
    """A trie node. `tail` = (tokens, start, end) stands for a chain of descendants seen once,
    tokens[start:end], each with count 1, not yet built (a path-compressed leaf): a text added
    to the cache creates one node per suffix where it leaves the known paths, not max_depth."""

    __slots__ = ("count", "children", "tail")

    def __init__(self, count: int = 0, tail: tuple[list[int], int, int] | None = None) -> None:
        self.count = count
        self.children: dict[int, _Node] = {}
        self.tail = tail

    def kids(self) -> dict[int, _Node]:
        """The children, the first node of an implicit chain built on demand."""
        if self.tail is not None:
            tokens, start, end = self.tail
            self.tail = None
            # A tail stands for one occurrence (any second one expands it on the way through).
            self.children[tokens[start]] = _Node(1, (tokens, start + 1, end) if start + 1 < end else None)
        return self.children


class SuffixTrie:
    """Occurrence counts of every substring of length <= max_depth of the texts held.

    The node reached from the root by tokens s counts the occurrences of s; its children are
    the tokens that followed s, each counted. Adding a text of length n walks n x max_depth
    steps at most, but builds a node only until each suffix leaves the paths already known (the
    rest stays an implicit chain, _Node.tail); removing it unlinks the nodes whose count reaches 0.
    """

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH) -> None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 2:
            raise ValueError(f"max_depth must be an integer >= 2, got {max_depth!r}")
        self.max_depth = max_depth
        self.root = _Node()
        # extend(): the node of each suffix of the text of length 0..max_depth-1 (index = length).
        self._open: list[_Node] = [self.root]

    def add(self, token_ids: Sequence[int]) -> None:
        tokens = [int(t) for t in token_ids]
        for start in range(len(tokens)):
            node, end = self.root, min(start + self.max_depth, len(tokens))
            for position in range(start, end):
                child = node.kids().get(tokens[position])
                if child is None:  # the suffix leaves the known paths: the rest is a chain seen once
                    node.children[tokens[position]] = _Node(1, (tokens, position + 1, end)
                                                            if position + 1 < end else None)
                    break
                child.count += 1
                node = child

    def remove(self, token_ids: Sequence[int]) -> None:
        """Subtract a text added before (the cache's eviction)."""
        tokens = [int(t) for t in token_ids]
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start: start + self.max_depth]:
                child = node.kids().get(token)
                if child is None:
                    raise ValueError("removing a text that was not added")
                child.count -= 1
                if child.count == 0:
                    del node.children[token]
                    break  # everything below counted only this text's occurrences
                node = child

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append tokens to the one growing text this trie holds (a request's context):
        O(max_depth) per token, the suffixes ending at each new token counted."""
        for token in token_ids:
            token = int(token)
            grown = [self.root]
            for node in self._open:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += 1
                grown.append(child)
            self._open = grown[: self.max_depth]

    def find(self, pattern: Sequence[int]) -> _Node | None:
        """The node of `pattern` (a walk from the root), or None where it never occurred."""
        node = self.root
        for token in pattern:
            node = node.kids().get(int(token))
            if node is None:
                return None
        return node

    def counts(self) -> dict[tuple[int, ...], int]:
        """Every substring held and its count (implicit chains included): for tests and debugging."""
        counts, stack = {}, [((), self.root)]
        while stack:
            path, node = stack.pop()
            for token, child in node.kids().items():
                counts[path + (token,)] = child.count
                stack.append((path + (token,), child))
        return counts

    def node_count(self) -> int:
        """Nodes built (implicit chains not), the root included: what the trie costs in memory."""
        total, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            total += 1
            stack.extend(node.children.values())
        return total


class SuffixCache:
    """The global trie over the outputs of the last `max_requests` requests (oldest evicted)."""

    def __init__(self, max_requests: int = DEFAULT_CACHE_REQUESTS, max_depth: int = DEFAULT_MAX_DEPTH) -> None:
        self.max_requests = max_requests
        self.trie = SuffixTrie(max_depth)
        self.outputs: deque[list[int]] = deque()

    def __len__(self) -> int:
        return len(self.outputs)

    def clear(self) -> None:
        self.trie = SuffixTrie(self.trie.max_depth)
        self.outputs.clear()

    def add(self, output_ids: Sequence[int]) -> None:
        if self.max_requests == 0 or not output_ids:
            return
        output = [int(t) for t in output_ids]
        self.trie.add(output)
        self.outputs.append(output)
        while len(self.outputs) > self.max_requests:
            self.trie.remove(self.outputs.popleft())


class TenantSuffixCaches(PerTenant[SuffixCache]):
    """One SuffixCache per tenant (proposers/tenants.py)."""

    def __init__(self, max_requests: int = DEFAULT_CACHE_REQUESTS, max_depth: int = DEFAULT_MAX_DEPTH) -> None:
        super().__init__(lambda: SuffixCache(max_requests, max_depth))
        self.max_requests, self.max_depth = max_requests, max_depth


@dataclass(frozen=True)
class SuffixDraft:
    token_ids: list[int]
    parents: list[int]  # -1 = the root (the last committed token); topological, siblings best first
    probs: list[float]  # each node's estimated probability of being reached and accepted
    match_len: int

    @property
    def score(self) -> float:  # expected accepted tokens under the frequency model
        return sum(self.probs)


def speculate(node: _Node, match_len: int, max_tokens: int, min_token_prob: float) -> SuffixDraft:
    """The best-first tree of at most max_tokens nodes under `node` (a matched suffix's node)."""
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    frontier: list[tuple[float, int, int, int, _Node]] = []  # (-probability, tie-break, parent, token, node)
    order = 0

    def push_children(of: _Node, parent: int, probability: float) -> None:
        nonlocal order
        children = of.kids()
        total = sum(child.count for child in children.values())
        for token, child in children.items():
            p = probability * child.count / total
            if p >= min_token_prob:
                heapq.heappush(frontier, (-p, order, parent, token, child))
                order += 1

    push_children(node, -1, 1.0)
    while frontier and len(tokens) < max_tokens:
        negative, _, parent, token, child = heapq.heappop(frontier)
        tokens.append(token)
        parents.append(parent)
        probs.append(-negative)
        push_children(child, len(tokens) - 1, -negative)
    return SuffixDraft(tokens, parents, probs, match_len)


class _Cursor:
    """The nodes, in a trie that does not change while the request runs (the global one), of
    the context's suffixes of length 0..max_depth-1 that occur there; O(max_depth) per token."""

    def __init__(self, trie: SuffixTrie) -> None:
        self.trie = trie
        self.matches: list[tuple[int, _Node]] = [(0, trie.root)]  # (suffix length, node)

    def extend(self, token_ids: Sequence[int]) -> None:
        depth = self.trie.max_depth
        for token in token_ids:
            token = int(token)
            grown = [(0, self.trie.root)]
            for length, node in self.matches:
                child = node.kids().get(token)
                if child is not None and length + 1 < depth:
                    grown.append((length + 1, child))
            self.matches = grown


class SuffixProposer(Proposer):
    """Suffix decoding as a Proposer: point-mass draft trees from this request's trie and the
    shared cache of earlier outputs.

    >>> cache = SuffixCache(max_requests=500)
    >>> engine = SpecEngine(target_runner, SuffixProposer(cache), tokenizer, k=16)

    The engine calls end_request(prompt_ids, output_ids) when a request finishes; its output
    then joins the cache. trees=False drafts the best tree's most likely path as a chain.
    """

    def __init__(self, cache: SuffixCache | TenantSuffixCaches | None = None, options: SuffixOptions | None = None,
                 trees: bool = True) -> None:
        """cache: one SuffixCache that every request shares, or TenantSuffixCaches (each request its
        tenant's: start_tenant); None: a new SuffixCache from the options."""
        self.options = options or SuffixOptions()
        self.caches = cache if isinstance(cache, TenantSuffixCaches) else None
        self.cache = cache if isinstance(cache, SuffixCache) else (
            self.options.new_cache() if cache is None else cache.for_tenant(None))
        depth = self.cache.trie.max_depth
        if depth != self.options.max_depth:
            raise ValueError(f"the suffix cache counts substrings up to {depth} tokens, "
                             f"the options ask for {self.options.max_depth}")
        self.trees = trees
        self.reset()

    def start_tenant(self, tenant: str | None) -> None:
        if self.caches is not None:
            self.cache = self.caches.for_tenant(tenant)

    def reset(self) -> None:
        self.local = SuffixTrie(self.options.max_depth)
        self.cursor = _Cursor(self.cache.trie)
        self.seen: list[int] = []

    def end_request(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        self.cache.add(output_ids)

    def forget_earlier_requests(self) -> None:
        self.cache.clear()
        if self.caches is not None:
            self.caches.clear()
            self.cache = self.caches.for_tenant(None)
        self.reset()

    def propose(self, ctx: ProposeContext, max_k: int) -> DraftProposal:
        device = ctx.token_ids.device
        self._catch_up(ctx.token_ids)
        draft = self.best_draft(max_k)
        if draft is None or not draft.token_ids:
            return DraftProposal.empty(1, device)
        tokens, parents = (draft.token_ids, draft.parents) if self.trees else _best_path(draft)
        return DraftProposal.of_row(tokens, chain_or_tree(parents), device)  # point masses

    def best_draft(self, max_k: int) -> SuffixDraft | None:
        """The highest-scoring tree over every matched suffix length of both tries."""
        if max_k < 1:
            return None
        best = None
        local = self.local._open  # local[m]: the node of the context's suffix of length m
        candidates = [(m, local[m]) for m in range(1, len(local))] + [m for m in self.cursor.matches if m[0] > 0]
        for match_len, node in candidates:
            if not node.kids():
                continue
            budget = min(max_k, math.ceil(self.options.spec_factor * match_len))
            draft = speculate(node, match_len, budget, self.options.min_token_prob)
            if draft.token_ids and (best is None or (draft.score, draft.match_len) > (best.score, best.match_len)):
                best = draft
        return best

    def on_verified(self, num_accepted: torch.Tensor) -> None:
        pass  # both tries hold committed tokens only; accepted ones arrive with the next context

    def _catch_up(self, token_ids: torch.Tensor) -> None:
        new = committed_since(self.seen, token_ids)
        if new is None:  # another request (sample_continuations' draws)
            self.reset()
            new = token_ids[0].tolist()
        self.seen += new
        self.local.extend(new)
        self.cursor.extend(new)


def _best_path(draft: SuffixDraft) -> tuple[list[int], list[int]]:
    """The chain to the tree's most probable deepest-first path: from the root, always the
    first (most likely) child."""
    first_child: dict[int, int] = {}
    for index, parent in enumerate(draft.parents):
        first_child.setdefault(parent, index)
    path, node = [], -1
    while node in first_child:
        node = first_child[node]
        path.append(draft.token_ids[node])
    return path, list(range(-1, len(path) - 1))


def _build(build: Build) -> Proposer:
    options = build.option(SuffixOptions)
    cache = options.new_tenant_caches()  # one per tenant, shared by the rows
    return build.per_row(lambda: SuffixProposer(cache, options))


METHOD_ENTRIES = (
    MethodEntry("suffix", "suffix decoding: frequency-scored draft trees from suffix trees over this request and "
                "earlier requests' outputs (a cache shared across requests); no draft model", _build,
                options=(SuffixOptions,), replayable=True, beside_any=True),
)
