"""One draw per row from a categorical distribution over a large vocabulary, in two levels.

Every sampled token goes through here: plain sampling, the recovered or bonus token that closes a
speculative step (rejection.py), a tree walk's last token (tree.py), a draft model's or a head's
proposals (warp.sample_from_probs).

Why not `torch.multinomial`: on a CPU it builds the whole cumulative distribution in float64 one
entry after another, a sizeable share of the target's 1-token step for each draw over the 151,936-token
vocabulary of the embedded models on a 2-core Zen 4 EPYC, and a draft model at T > 0 pays it for
every drafted token (benchmarks/RESULTS.md, "Sampling without torch.multinomial, top-p without
a sort"). Here the vocabulary is cut into blocks of BLOCK entries: the blocks' masses (float64 sums, which vectorize),
their cumulative sum, the block that holds the draw, then the cumulative sum of that one block.
Token i is drawn with probability p_i / sum(p) up to float64 rounding, as with multinomial's
float64 sums; the integer result is a fixed function of the row and its uniform, so a row gives the
same token alone or in any batch.

Device ops only, fixed shapes, no host syncs (rejection_sample's promise). The rows should hold
non-negative, finite probabilities with a positive sum (warp_logits' output). A row whose total is
not a positive finite number (all zeros: a row with no candidate; NaN or inf anywhere) draws -1,
never a token of the vocabulary: the engine refuses it (engine/step.py) rather than emit a token
the target did not choose.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

BLOCK = 1024  # entries per block: ~150 blocks for a 152K vocabulary, both cumulative sums short

Generators = torch.Generator | Sequence[torch.Generator] | None


def uniforms(shape: tuple[int, ...], generators: Generators, device: torch.device,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """U[0, 1) draws of `shape` ([rows, ...]): from one generator (or torch's default) in row order,
    or one generator per row, which keeps requests independent of batching."""
    if generators is None or isinstance(generators, torch.Generator):
        return torch.rand(shape, generator=generators, device=device, dtype=dtype)
    return torch.stack([torch.rand(shape[1:], generator=g, device=device, dtype=dtype) for g in generators])


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The inverse of each row's cumulative distribution at u: probs [B, V] (not necessarily
    normalized), u [B] in [0, 1) -> int64 [B], the first token whose cumulative mass exceeds
    u x the row's total. A token of probability 0 is never drawn; a row whose total is not
    positive and finite gives -1.

    >>> probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]] * 3)
    >>> draw(probs, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)).tolist()
    [0, 2, 3]
    """
    rows, vocab = probs.shape
    if u.shape != (rows,):
        raise ValueError(f"draw: one uniform per row, got {u.numel()} for {rows} rows")
    blocks = -(-vocab // BLOCK)
    padded = F.pad(probs.float(), (0, blocks * BLOCK - vocab)).view(rows, blocks, BLOCK)
    mass = padded.sum(-1, dtype=torch.float64)  # [B, blocks]
    cumulative = mass.cumsum(-1)
    point = (u.to(torch.float64) * cumulative[:, -1])[:, None]  # [B, 1]: below the total
    # The first block whose cumulative mass exceeds the point (an empty block never does: its mass
    # is the block before's), and the point's offset into it from the exact sum before it.
    block = torch.searchsorted(cumulative, point, right=True).clamp_max(blocks - 1)  # [B, 1]
    before = torch.where(block > 0, cumulative.gather(-1, (block - 1).clamp_min(0)), 0.0)
    chosen = padded.gather(1, block[:, :, None].expand(rows, 1, BLOCK))[:, 0]  # [B, BLOCK]
    within = torch.searchsorted(chosen.double().cumsum(-1), point - before, right=True)  # [B, 1]
    # The block's own sum may round below its mass in the outer sum: a point past its end takes the
    # block's last token of positive probability, never a zero or a padded one.
    positions = torch.arange(BLOCK, device=probs.device)
    last_positive = torch.where(chosen > 0, positions, -1).amax(-1, keepdim=True)
    token = (block * BLOCK + torch.minimum(within, last_positive))[:, 0]
    total = cumulative[:, -1]
    return torch.where(total.isfinite() & (total > 0), token, -1)


def sample_rows(probs: torch.Tensor, generators: Generators = None) -> torch.Tensor:
    """One draw from each row of probs [B, V] -> int64 [B]."""
    return draw(probs, uniforms((probs.shape[0],), generators, probs.device, torch.float64))
