"""A reference speculative decoder: the algorithm of docs/architecture.md in plain Python, for reading.

Speculative sampling (Leviathan et al. 2023, arXiv 2211.17192, Algorithm 1; Chen et al. 2023, arXiv
2302.01318, Algorithm 2): a draft proposes x_1..x_k, x_j drawn from q_j; the target gives p_j at
every position; x_j is accepted with probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection
the step ends with a *recovered* token drawn from norm(max(0, p_j - q_j)), and when all k are
accepted with a *bonus* token drawn from p_{k+1}. Every emitted token is distributed exactly as p.
A draft tree (SpecInfer, Miao et al. 2023, arXiv 2305.09781, Algorithm 2) is the same walk with
siblings: a rejected child's q leaves the residual, and the next sibling is tried against what is
left. A point-mass draft (a copy: n-gram, suffix, an EAGLE tree's top-k) has q = onehot(x).
Greedy is this very rule with p a point mass on the target's argmax, where every draw is decided.

Nothing here is cached, batched or vectorised: the target gives one distribution at a time, over
the whole context. The engine (engine/step.py with sampling/rejection.py and sampling/tree.py) must
emit the same tokens from the same random draws, which tests/sampling/test_reference.py checks.
The draws come from the request's one generator, in the engine's order:
  1. a draft model's drafts: one float64 uniform each (an inverse-CDF draw, sampling/categorical.py);
  2. a chain: all k float32 uniforms at once (rejection_sample), used or not; a tree: one per child tried;
  3. the token that closes the step: one float64 uniform.
(The engine skips the draws of greedy steps; their outcome is fixed anyway.) Ratios are taken in
float32 as in rejection_sample (tree.py takes them in float64) and the inverse CDF sums in float64:
where the vectorised code rounds differently, the two disagree only for a uniform on that last bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from specdec.sampling.params import SamplingParams
from specdec.sampling.warp import warp_logits

Model = Callable[[list[int]], torch.Tensor]  # token ids [L] -> raw logits [V] of the token after them


@dataclass(frozen=True)
class Draft:
    token_ids: list[int]  # [n] drafted tokens: a chain, or a tree's nodes in topological order
    parents: list[int] | None = None  # [n] node i's parent (-1: the last committed token); None: a chain
    probs: torch.Tensor | None = None  # [n, V] the distribution node i was drawn from; None: point masses


class Step(NamedTuple):
    tokens: list[int]  # emitted: the accepted drafts, then the recovered or bonus token
    drafted: int
    accepted: int


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from probs [V] (not necessarily normalised): the first whose cumulative mass exceeds u x total."""
    cumulative = probs.double().cumsum(0)  # [V]
    u = torch.rand((), dtype=torch.float64, generator=generator)
    return int(torch.searchsorted(cumulative, u * cumulative[-1], right=True))


def draft_with_model(draft_model: Model, tokens: list[int], k: int, params: SamplingParams,
                     generator: torch.Generator | None) -> Draft:
    """k tokens, one at a time, from the draft model's warped distribution (greedy: its argmax, a point mass).

    Args:
        draft_model: context ids -> the draft's raw logits [V] after them; tokens: the context [L].
        k: tokens to draft; params: the request's warp (the target's); generator: the request's.
    Returns:
        Draft: token_ids [k], probs [k, V] (None when greedy).
    """
    drafted, probs = [], []
    for _ in range(k):
        logits = draft_model(tokens + drafted)  # [V]
        if params.greedy:
            drafted.append(int(logits.argmax()))
        else:
            probs.append(warp_logits(logits, params))  # q_j [V]
            drafted.append(draw(probs[-1], generator))
    return Draft(drafted, None, torch.stack(probs) if probs else None)


def verify(target: Model, tokens: list[int], draft: Draft, params: SamplingParams,
           generator: torch.Generator | None) -> Step:
    """One step's verification, walking from the last committed token down the accepted drafts.

    Example: p = [.5, .3, .2] at the root, point-mass siblings 0 then 1: child 0 is accepted
    w.p. .5; else the residual is [0, .6, .4] and child 1 is accepted w.p. .6; else token 2.

    Args:
        target: context ids -> the target's raw logits [V] after them; tokens: the context [L].
        draft: the proposal (chain or tree); params, generator: the request's.
    Returns:
        Step: the emitted tokens (accepted drafts + one recovered or bonus token), drafted, accepted.
    """
    n, chain = len(draft.token_ids), draft.parents is None
    parents = list(range(-1, n - 1)) if chain else draft.parents
    chain_uniforms = torch.rand(n, generator=generator) if chain else None  # [n]: drawn at once, used or not
    path: list[int] = []
    while True:
        node = path[-1] if path else -1
        residual = warp_logits(target(tokens + [draft.token_ids[i] for i in path]), params)  # p here [V]
        for child in (i for i in range(n) if parents[i] == node):  # siblings, most likely first
            x = draft.token_ids[child]
            q = torch.nn.functional.one_hot(torch.tensor(x), len(residual)).float() if draft.probs is None \
                else draft.probs[child].float()  # [V]
            u = chain_uniforms[child] if chain else torch.rand((), generator=generator)
            if u < min(1.0, float(residual[x] / q[x])):  # accepted: walk on to the child
                path.append(child)
                break
            leftover = (residual - q).clamp_min(0.0)  # rejected: the mass the target wants beyond q
            residual = leftover / leftover.sum()
        else:  # no child accepted (or none to try): the step closes with a token drawn from the residual
            return Step([draft.token_ids[i] for i in path] + [draw(residual, generator)], n, len(path))


def speculative_decode(target: Model, propose: Callable[[list[int], int, torch.Generator | None], Draft],
                       prompt: Sequence[int], params: SamplingParams, generator: torch.Generator | None, *,
                       k: int, max_new_tokens: int) -> list[Step]:
    """Decode max_new_tokens tokens after prompt, one speculative step at a time.

    The engine's schedule (engine/batch.py): the first step drafts nothing, and no step drafts
    past max_new_tokens - 1, so its own last token is the target's. No EOS or stop strings: those
    cut committed tokens (step 6), they never change a draw.

    Args:
        target: context ids -> the target's raw logits [V]; propose: (context, k, generator) -> a
            Draft of at most k tokens (draft_with_model, or a copy); prompt: ids [L];
        params, generator: the request's warp and randomness; k: drafts per step at most.
    Returns:
        One Step per target pass: the tokens emitted (the last step's cut at max_new_tokens).
    """
    tokens, steps = list(prompt), []
    while len(tokens) - len(prompt) < max_new_tokens:
        remaining = max_new_tokens - (len(tokens) - len(prompt))
        k_now = min(k, remaining - 1) if steps else 0
        draft = propose(tokens, k_now, generator) if k_now >= 1 else Draft([])
        step = verify(target, tokens, draft, params, generator)
        steps.append(step._replace(tokens=step.tokens[:remaining]))
        tokens += steps[-1].tokens
    return steps
