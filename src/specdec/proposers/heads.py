"""Proposers over draft heads on the target's hidden states (models/heads/): EAGLE, Medusa and the
MLP speculator.

All read ctx.target_hidden: the engine hands over the target's features of
the committed tokens the proposer has not seen yet (the prompt after prefill,
then the root and the accepted drafts of each step, taken from the
verification forward itself, so they cost nothing extra).

EagleProposer drafts a chain (k tokens, greedy or sampled from the head's
warped distribution) or, with tree_size > 0, EAGLE-2's dynamic tree (Li et al.
2024, arXiv 2406.16858): expand the tree_topk most probable nodes of each
layer by the head's confidence (the product of its probabilities along the
path), then keep the tree_size most probable nodes overall. tree_size "auto": as
many of them as pay on this machine, step by step (proposers/tree_budget.py: the
nodes' path probabilities against the measured cost of verifying them).
MedusaProposer drafts Medusa's static tree (Cai et al. 2024, Section 2.1.2):
the paths whose product of measured top-i accuracies is largest.
MLPSpeculatorProposer drafts a chain, one MLP stage a token, from the last
committed token's predecessor's feature (Wertheimer et al. 2024).
Tree nodes are the head's top candidates, not draws, so their verification
treats them as point masses (sampling/tree.py: still lossless).
"""

from __future__ import annotations

import heapq
import math

import torch

from specdec.proposers.tree_budget import TreeBudget
from specdec.models.heads import EagleHead, FrozenVocabulary, HeadKVCache, MedusaHeads, MLPSpeculator
from specdec.models.heads.fms_speculator import FMSSpeculator
from specdec.models.native.attention import attention_mask
from specdec.proposers.base import DraftProposal, ProposeContext, Proposer
from specdec.proposers.stop_rules import ConfidenceStop
from specdec.sampling.warp import sample_from_probs, warp_logits


def _full_width(reduced_logits: torch.Tensor, vocab: FrozenVocabulary, vocab_size: int) -> torch.Tensor:
    """[..., N] over the head's vocabulary -> [..., V] with -inf outside it."""
    full = reduced_logits.new_full((*reduced_logits.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy_(-1, vocab.vocab_ids, reduced_logits)


def _chain_stops(rule: ConfidenceStop | None, logits: torch.Tensor, probs: torch.Tensor | None, token: torch.Tensor,
                 index: int) -> bool:
    """Whether a chain stops after the token just drafted (--head-confidence): greedy, its softmax over
    the head's vocabulary at the argmax; sampling, the warped law [1, V] at the drawn token."""
    if rule is None:
        return False
    if probs is None:
        chosen = torch.softmax(logits[0].float(), dim=-1)
        return rule.stops(chosen, int(chosen.argmax()), index, 1.0)[0]
    return rule.stops(probs[0], int(token[0]), index, 1.0)[0]


class EagleProposer(Proposer):
    """EAGLE (EagleHead) and EAGLE-3 (models/heads/eagle3.py: Eagle3Head) alike: both feed the
    committed tokens' target features, then their own outputs. EAGLE-3's head first fuses
    the target's layers (read_target) and normalises its output before the output matrix
    (to_output); EAGLE's does neither."""

    reads_target_hidden = True

    def __init__(self, head: EagleHead, vocab: FrozenVocabulary, *, tree_size: int | str = 0, tree_topk: int = 4,
                 max_tree_size: int = 64, stop_rule: ConfidenceStop | None = None) -> None:
        if tree_size != "auto" and (isinstance(tree_size, bool) or not isinstance(tree_size, int) or tree_size < 0):
            raise ValueError(f"tree_size must be an integer >= 0 (0 = a chain) or 'auto', got {tree_size!r}")
        if tree_topk < 1:
            raise ValueError(f"tree_topk must be >= 1, got {tree_topk}")
        # auto: the engine reports each one-row step's verification here (step.py's record_step_costs), and
        # the budget sizes the next tree.
        self.tree_budget = TreeBudget(max_tree_size) if tree_size == "auto" else None
        tree_size = max_tree_size if tree_size == "auto" else tree_size
        self.head, self.vocab = head, vocab
        self.target_layers = tuple(head.config.aux_layers)  # the target features it reads; () = the final ones
        self.tree_size, self.tree_topk = tree_size, tree_topk
        self.stop_rule = stop_rule  # a chain's early stop (-k auto, --head-confidence)
        self.dtype = next(head.parameters()).dtype
        self.reset()

    def reset(self) -> None:
        config = self.head.config
        self.cache = HeadKVCache(config.num_kv_heads, config.head_dim, self.dtype, self.vocab.embedding.device)
        self.committed = 0  # pairs (f_j, t_{j+1}) in the cache: always the target cache's length
        self.root_feature: torch.Tensor | None = None  # [1, 1, H] f^ for the last committed token

    def on_verified(self, num_accepted: torch.Tensor) -> None:
        pass  # propose() already cut the cache back; the next call feeds the accepted tokens' true features

    @torch.inference_mode()
    def propose(self, ctx: ProposeContext, max_k: int) -> DraftProposal:
        self._catch_up(ctx)
        if max_k < 1 or self.root_feature is None:
            return DraftProposal.empty(1, ctx.token_ids.device)
        try:
            if self.tree_size > 0:
                return self._draft_tree(ctx, max_k)
            return self._draft_chain(ctx, max_k)
        finally:
            self.cache.length = self.committed  # drafts never stay in the cache

    def _catch_up(self, ctx: ProposeContext) -> None:
        """Feed the pairs (f_j, t_{j+1}) of the newly committed tokens, with the target's true features."""
        hidden = ctx.target_hidden
        if hidden is None or hidden.shape[1] == 0:
            return
        start, count = self.committed, hidden.shape[1]
        context_len = ctx.token_ids.shape[1]
        if start + count != context_len - 1:
            raise RuntimeError(f"EAGLE head out of step: {start} + {count} features for {context_len} tokens")
        next_tokens = ctx.token_ids[:, start + 1: context_len].to(self.vocab.embedding.device)
        positions = torch.arange(start, start + count, device=next_tokens.device)[None]
        mask = attention_mask([start], count, start + count, None, next_tokens.device)
        predicted = self.head(self.head.read_target(hidden.to(self.dtype)), self.vocab.embed(next_tokens), positions,
                              cache=self.cache, mask=mask)
        self.committed = start + count
        self.root_feature = predicted[:, -1:]

    def _draft_chain(self, ctx: ProposeContext, max_k: int) -> DraftProposal:
        feature, position = self.root_feature, self.committed
        tokens, draft_probs = [], []
        for index in range(max_k):
            logits = self.vocab.logits(self.head.to_output(feature[:, -1]))  # [1, N]
            probs = None
            if ctx.params.greedy:
                token = self.vocab.to_target_ids(logits.argmax(dim=-1))  # [1]
            else:
                probs = warp_logits(_full_width(logits, self.vocab, ctx.vocab_size), ctx.params)  # [1, V]
                token = sample_from_probs(probs, ctx.generator)
                draft_probs.append(probs)
            tokens.append(int(token[0]))
            if _chain_stops(self.stop_rule, logits, probs, token, index):
                break
            if index + 1 < max_k:
                feature = self.head(feature, self.vocab.embed(token[None]), torch.tensor([[position]]),
                                    cache=self.cache)
                position += 1
        probs = torch.stack(draft_probs, dim=1) if draft_probs else None  # [1, k, V]
        return DraftProposal.of_row(tokens, None, ctx.token_ids.device, probs)

    def _draft_tree(self, ctx: ProposeContext, max_k: int) -> DraftProposal:
        """EAGLE-2: grow layer by layer from the root, expanding the tree_topk best nodes of each layer."""
        topk, device = self.tree_topk, self.vocab.embedding.device
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []  # log of the head's path probability
        depths: list[int] = []
        slots: dict[int, int] = {}  # expanded node -> its slot in the head cache

        def add_children(parent: int, feature: torch.Tensor, base: float) -> list[int]:
            log_probs = torch.log_softmax(self.vocab.logits(self.head.to_output(feature)), dim=-1)  # [N]
            best = torch.topk(log_probs, min(topk, log_probs.shape[-1]))
            added = []
            for value, reduced in zip(best.values.tolist(), best.indices.tolist()):
                added.append(len(tokens))
                tokens.append(int(self.vocab.vocab_ids[reduced]))
                parents.append(parent)
                scores.append(base + value)
                depths.append(1 if parent < 0 else depths[parent] + 1)
            return added

        layer = add_children(-1, self.root_feature[0, -1], 0.0)
        features = {-1: self.root_feature[0, -1]}  # node -> the feature its children come from
        for depth in range(2, max_k + 1):
            expand = sorted(layer, key=lambda node: -scores[node])[:topk]
            if self.tree_budget is not None and expand:  # --tree-size auto: stop where no deeper node can pay
                ranked = sorted(scores, reverse=True)
                if not self.tree_budget.worth_growing([math.exp(score) for score in ranked],
                                                      math.exp(scores[expand[0]])):
                    break
            # One head forward over the expanded nodes: pair (feature that drafted node, node's token).
            start = self.cache.length
            inputs = torch.stack([features[parents[node]] for node in expand])[None]  # [1, T, H]
            token_ids = torch.tensor([[tokens[node] for node in expand]], device=device)
            positions = torch.tensor([[self.committed + depth - 2] * len(expand)], device=device)
            for offset, node in enumerate(expand):
                slots[node] = start + offset
            mask = torch.zeros(1, 1, len(expand), start + len(expand), dtype=torch.bool, device=device)
            mask[..., : self.committed] = True
            for row, node in enumerate(expand):
                ancestor = node
                while ancestor >= 0:
                    mask[0, 0, row, slots[ancestor]] = True
                    ancestor = parents[ancestor]
            predicted = self.head(inputs, self.vocab.embed(token_ids), positions, cache=self.cache, mask=mask)
            layer = []
            for offset, node in enumerate(expand):
                features[node] = predicted[0, offset]
                layer += add_children(node, features[node], scores[node])
        return self._select(tokens, parents, scores, depths, ctx.token_ids.device)

    def _select(self, tokens, parents, scores, depths, device) -> DraftProposal:
        """The tree_size most probable nodes (a parent is at least as probable as its child),
        in topological order, most probable sibling first; with a tree budget, the first as
        many of them as it finds pay."""
        chosen: dict[int, None] = {}  # in the order added: best first, each after its parent
        for node in sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i])):
            if len(chosen) == self.tree_size:
                break
            if parents[node] < 0 or parents[node] in chosen:
                chosen[node] = None
        if self.tree_budget is not None:
            ranked = list(chosen)
            size = self.tree_budget.choose([math.exp(scores[node]) for node in ranked])
            chosen = dict.fromkeys(ranked[:size])
        order = sorted(chosen, key=lambda i: (depths[i], -scores[i]))
        index = {node: position for position, node in enumerate(order)}
        return DraftProposal.of_row([tokens[i] for i in order], [index.get(parents[i], -1) for i in order], device)


def medusa_tree(accuracies: list[list[float]], size: int, max_depth: int) -> list[tuple[int, ...]]:
    """Medusa's sparse tree: the `size` paths (i_1, .., i_d) of top-i choices with the largest
    expected acceptance prod_l acc[l][i_l], best first (Cai et al. 2024, Section 2.1.2).

    Best-first search: a child is never better than its parent, so the set is ancestor-closed.
    >>> medusa_tree([[.6, .2], [.4, .1]], 3, 2)   # [(0,), (0, 0), (1,)]: .6, .24, .2
    """
    depth_limit = min(max_depth, len(accuracies))
    heap = [(-accuracies[0][i], (i,)) for i in range(len(accuracies[0]))] if depth_limit else []
    heapq.heapify(heap)
    paths = []
    while heap and len(paths) < size:
        negative_value, path = heapq.heappop(heap)
        paths.append(path)
        if len(path) < depth_limit:
            for i, accuracy in enumerate(accuracies[len(path)]):
                heapq.heappush(heap, (negative_value * accuracy, path + (i,)))
    return paths


def default_accuracies(num_heads: int, topk: int = 8) -> list[list[float]]:
    """A prior when training measured none: deeper heads and lower ranks are right less often."""
    return [[0.6 * 0.7 ** depth * 0.5 ** rank for rank in range(topk)] for depth in range(num_heads)]


class MedusaProposer(Proposer):
    reads_target_hidden = True

    def __init__(self, heads: MedusaHeads, vocab: FrozenVocabulary, *, tree_size: int = 0,
                 accuracies: list[list[float]] | None = None) -> None:
        if tree_size < 0:
            raise ValueError(f"tree_size must be >= 0 (0 = a chain), got {tree_size}")
        self.heads, self.vocab, self.tree_size = heads, vocab, tree_size
        self.accuracies = accuracies or default_accuracies(heads.config.num_medusa_heads)
        self.dtype = next(heads.parameters()).dtype
        self.reset()

    def reset(self) -> None:
        self.last_feature: torch.Tensor | None = None  # [H] the target's feature of the last cached token

    def on_verified(self, num_accepted: torch.Tensor) -> None:
        pass

    @torch.inference_mode()
    def propose(self, ctx: ProposeContext, max_k: int) -> DraftProposal:
        if ctx.target_hidden is not None and ctx.target_hidden.shape[1]:
            self.last_feature = ctx.target_hidden[0, -1]
        depth = min(max_k, self.heads.config.num_medusa_heads)
        if depth < 1 or self.last_feature is None:
            return DraftProposal.empty(1, ctx.token_ids.device)
        # Head d predicts the token d steps past the root (the last committed token).
        logits = self.vocab.logits(self.heads(self.last_feature.to(self.dtype))[:depth])  # [depth, N]
        if self.tree_size == 0:  # a chain of each head's best guess
            return DraftProposal.of_row(self.vocab.to_target_ids(logits.argmax(dim=-1)).tolist(), None,
                                        ctx.token_ids.device)
        paths = medusa_tree(self.accuracies, self.tree_size, depth)
        width = max(path[-1] for path in paths) + 1
        ranked = self.vocab.to_target_ids(torch.topk(logits, width, dim=-1).indices).tolist()  # [depth, width]
        paths.sort(key=lambda path: (len(path), path))  # topological, best sibling first
        index = {path: position for position, path in enumerate(paths)}
        tokens = [ranked[len(path) - 1][path[-1]] for path in paths]
        parents = [index[path[:-1]] if len(path) > 1 else -1 for path in paths]
        return DraftProposal.of_row(tokens, parents, ctx.token_ids.device)


class MLPSpeculatorProposer(Proposer):
    """A chain of up to its stages' tokens: stage i reads the state and the token before it (the
    root, then its own drafts) and drafts greedily or, when sampling, from its warped law (whose
    probabilities go to the rejection sampler, as EAGLE's chain does).

    head: specdec's MLPSpeculator with vocab (the target's embedding, the head's own output rows;
    models/heads/loading.py), or a published fms-extras one (models/heads/fms_speculator.py:
    FMSSpeculator, its own embeddings and heads over the target's ids; vocab unused)."""

    reads_target_hidden = True

    def __init__(self, head: MLPSpeculator | FMSSpeculator, vocab: FrozenVocabulary | None = None, *,
                 stop_rule: ConfidenceStop | None = None) -> None:
        self.head, self.vocab, self.stop_rule = head, vocab, stop_rule  # stop_rule: -k auto's early stop
        self.published = isinstance(head, FMSSpeculator)
        if not self.published and vocab is None:
            raise ValueError("specdec's MLP speculator drafts through its vocabulary (load_head_for gives it)")
        self.dtype = next(head.parameters()).dtype
        self.stages = head.stages if self.published else head.config.mlp_stages
        self.device = next(head.parameters()).device
        self.reset()

    def reset(self) -> None:
        self.last_feature: torch.Tensor | None = None  # [1, H] the target's feature of the last cached token

    def on_verified(self, num_accepted: torch.Tensor) -> None:
        pass

    @torch.inference_mode()
    def propose(self, ctx: ProposeContext, max_k: int) -> DraftProposal:
        if ctx.target_hidden is not None and ctx.target_hidden.shape[1]:
            self.last_feature = ctx.target_hidden[0, -1:].to(self.dtype)
        depth = min(max_k, self.stages)
        if depth < 1 or self.last_feature is None:
            return DraftProposal.empty(1, ctx.token_ids.device)
        state, token = self.last_feature, ctx.token_ids[:, -1].to(self.device)  # f_j, t_{j+1}
        if self.published:
            if int(token[0]) >= self.head.vocab_size:  # a token of the target's its vocabulary lacks
                return DraftProposal.empty(1, ctx.token_ids.device)
            state = self.head.start(state)
        tokens, draft_probs = [], []
        for index in range(depth):
            state, logits = self._stage(index, state, token)  # logits [1, N]
            probs = None
            if ctx.params.greedy:
                token = logits.argmax(dim=-1)
                token = token if self.published else self.vocab.to_target_ids(token)
            else:
                probs = warp_logits(self._full_width(logits, ctx.vocab_size), ctx.params)  # [1, V]
                token = sample_from_probs(probs, ctx.generator).to(self.device)
                draft_probs.append(probs)
            tokens.append(int(token[0]))
            if _chain_stops(self.stop_rule, logits, probs, token, index):
                break
        probs = torch.stack(draft_probs, dim=1) if draft_probs else None  # [1, k, V]
        return DraftProposal.of_row(tokens, None, ctx.token_ids.device, probs)

    def _stage(self, index: int, state: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(s_{i+1}, stage i's logits over the head's vocabulary) from s_i and the token before."""
        if self.published:
            state = self.head.stage(index, state, token)
            return state, self.head.logits(index, state)
        state = self.head.stage(index, state, self.vocab.embed(token))
        return state, self.vocab.logits(state)

    def _full_width(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        if not self.published:
            return _full_width(logits, self.vocab, vocab_size)
        if logits.shape[-1] == vocab_size:
            return logits
        pad = logits.new_full((*logits.shape[:-1], vocab_size - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], dim=-1)
