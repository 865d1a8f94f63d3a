"""Token trees: the attention mask and positions that verify a tree in one pass, and
verification along the tree (greedy, lossless sampling, Medusa's lossy typical acceptance).

A tree of n drafted tokens hangs under the *root*, the last committed token,
which opens the step (engine/step.py's cache convention). It is given by `parents`:
parents[i] is the index of node i's parent among the drafted nodes, or -1 for
the root, with every parent listed before its children (topological order).
Siblings are the candidates for the same position, most likely first.

The target scores the root and all n nodes in one forward (SpecInfer, Miao et
al. 2023, arXiv 2305.09781; Medusa, Cai et al. 2024, arXiv 2401.10774): input
j = 0 is the root, input j = i + 1 is node i; each input sees the cached
prefix, itself and its ancestors (tree_attention_mask), at position
prefix + depth (tree_depths). Its logits are then the target's distribution
for the children of that node, exactly as if its path alone had been fed.

Example: parents [-1, -1, 0, 0, 2] is
    root ─┬─ 0 ─┬─ 2 ── 4
          │     └─ 3
          └─ 1
with depths [1, 1, 2, 2, 3] (root 0) and paths root-0-2-4, root-0-3, root-1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.sampling.categorical import sample_rows


def check_parents(parents: Sequence[int]) -> None:
    for index, parent in enumerate(parents):
        if not -1 <= parent < index:
            raise ValueError(f"tree node {index} has parent {parent}; parents must be -1 (the root) "
                             f"or an earlier node (topological order)")


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each drafted node (the root's children are at depth 1)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def tree_children(parents: Sequence[int]) -> list[list[int]]:
    """children[j] for input j (0 = the root, i + 1 = node i), in sibling order."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for index, parent in enumerate(parents):
        children[parent + 1].append(index)
    return children


def tree_attention_mask(parents: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """[n+1, n+1] bool over the root and the nodes: input j sees input i iff i is j or an ancestor of j.

    For parents [-1, 0, -1] (root-0-1 and root-2):
        root [1 0 0 0]
        0    [1 1 0 0]
        1    [1 1 1 0]
        2    [1 0 0 1]
    A chain (parents [-1, 0, 1, ...]) gives the causal mask.
    """
    size = len(parents) + 1
    mask = torch.eye(size, dtype=torch.bool)
    mask[:, 0] = True
    for index, parent in enumerate(parents):
        mask[index + 1] |= mask[parent + 1]
    return mask.to(device)


def tree_paths(parents: Sequence[int]) -> list[list[int]]:
    """Every root-to-leaf path, as node indices, leaves in index order."""
    children = tree_children(parents)
    paths = []
    for node in range(len(parents)):
        if not children[node + 1]:
            path = [node]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            paths.append(path[::-1])
    return paths


@dataclass(frozen=True)
class TreeVerifyResult:
    path: list[int]  # accepted node indices, root to deepest
    output_ids: list[int]  # the accepted nodes' tokens, then one recovered or bonus token

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def greedy_verify_tree(
    token_ids: Sequence[int],  # [n] the drafted tokens
    parents: Sequence[int],  # [n]
    target_token_ids: Sequence[int],  # [n+1] argmax of the target at the root and at each node
) -> TreeVerifyResult:
    """Temperature 0: from the root, follow the child that equals the target's argmax.

    The walk ends at a node none of whose children is the argmax; the argmax
    there is the step's last token. The output is exactly what plain greedy
    decoding would emit, and the longest path any chain verification of a
    single root-to-leaf path would accept (tests check both).
    """
    children = tree_children(parents)
    path: list[int] = []
    node = -1
    while True:
        wanted = target_token_ids[node + 1]
        match = next((child for child in children[node + 1] if token_ids[child] == wanted >= 0), None)
        if match is None:  # wanted -1 (no candidate: warp.greedy_tokens) goes out for the engine to refuse
            return TreeVerifyResult(path, [token_ids[i] for i in path] + [int(wanted)])
        path.append(match)
        node = match


def sample_verify_tree(
    token_ids: Sequence[int],  # [n]
    parents: Sequence[int],  # [n]
    draft_probs: torch.Tensor | None,  # [n, V]: the distribution node i was drawn from; None = point masses
    target_probs: torch.Tensor,  # [n+1, V] warped target distribution at the root and at each node
    generator: torch.Generator | None = None,
) -> TreeVerifyResult:
    """Lossless verification along a tree: recursive rejection over siblings.

    At a node with residual r (first the target's p there), each child x_c is
    tried in sibling order: accepted with probability min(1, r(x_c) / q_c(x_c)),
    and the walk moves to it; when rejected, r <- norm((r - q_c)+) and the next
    sibling is tried (SpecInfer's multi-step speculative sampling, Miao et al.
    2023, Algorithm 2). When no child is accepted the step's last token is
    drawn from r. Each emitted token is then distributed exactly as p.

    Children chosen deterministically (a head's top-k, draft_probs None) are
    point masses q_c = onehot(x_c): x_c is accepted with probability r(x_c),
    and a rejection removes x_c from the residual, so the next sibling is tried
    against p renormalised without it (EAGLE's tree sampling). Sampled siblings
    (i.i.d. from one q, duplicates allowed) give each its q_c = q.

    Worked example, V = 3, p = [.5, .3, .2] at the root, point-mass children 0 then 1:
      child 0 accepted w.p. .5; else r = [0, .6, .4], child 1 accepted w.p. .6,
      else the last token is drawn from [0, 0, 1]. Token 0 comes out w.p. .5,
      token 1 w.p. .5 * .6 = .3, token 2 w.p. .5 * .4 = .2: exactly p.
    """
    children = tree_children(parents)
    path: list[int] = []
    node = -1
    while True:
        residual = target_probs[node + 1].float()  # [V]
        moved = False
        for child in children[node + 1]:
            token = token_ids[child]
            if not 0 <= token < residual.shape[-1]:  # a broken draft's id: never accepted, r unchanged
                continue
            target_r = float(residual[token])
            if draft_probs is None:  # q = onehot(token): accept w.p. r(token); (r - q)+ is r without token
                accept, draft = target_r, None
            else:
                draft = draft_probs[child].float()
                draft_q = float(draft[token])
                accept = 1.0 if draft_q <= 0 and target_r > 0 else min(1.0, target_r / max(draft_q, 1e-30))
                if not math.isfinite(draft_q):  # NaN or inf in q: min(1, r / NaN) would read 1 in Python
                    accept = 0.0
            if float(torch.rand((), generator=generator, device=residual.device)) < accept:
                path.append(child)
                node, moved = child, True
                break
            if draft is None:
                leftover = residual.clone()
                leftover[token] = 0.0
            else:
                leftover = (residual - draft).clamp_min(0.0)
            mass = float(leftover.sum())
            # A zero leftover means r == q there, where rejection has probability 0 (round-off guard);
            # a non-finite one (a broken q) leaves r as it was.
            if math.isfinite(mass) and mass > 0:
                residual = leftover / mass
        if not moved:
            final = int(sample_rows(residual[None], generator)[0])
            return TreeVerifyResult(path, [token_ids[i] for i in path] + [final])


def typical_verify_tree(
    token_ids: Sequence[int],  # [n]
    parents: Sequence[int],  # [n]
    target_probs: torch.Tensor,  # [n+1, V] warped target distribution
    generator: torch.Generator | None = None,
    *,
    threshold: float = 0.09,
    alpha: float = 0.3,
) -> TreeVerifyResult:
    """LOSSY typical acceptance (Medusa, Cai et al. 2024, Section 2.3.1): a child x is
    accepted when p(x) > min(threshold, alpha * exp(-H(p))), the first such child
    in sibling order; the last token is drawn from p at the node where the walk stops.

    Output follows neither the target's distribution nor its greedy output; it
    keeps plausible tokens under a confident target and accepts more when the
    target is unsure (high entropy). Defaults are Medusa's (epsilon 0.09, delta 0.3).
    """
    children = tree_children(parents)
    probs = target_probs.float()
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(dim=-1)  # [n+1]
    cutoff = torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy)).tolist()
    path: list[int] = []
    node = -1
    while True:
        row = probs[node + 1]
        match = next((c for c in children[node + 1]
                      if 0 <= token_ids[c] < row.shape[-1] and float(row[token_ids[c]]) > cutoff[node + 1]), None)
        if match is None:
            final = int(sample_rows(row[None], generator)[0])
            return TreeVerifyResult(path, [token_ids[i] for i in path] + [final])
        path.append(match)
        node = match
