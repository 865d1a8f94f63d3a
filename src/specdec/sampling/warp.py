"""logits -> probabilities, with exactly the same warp for draft and target.

Speculative sampling is lossless with respect to whatever distribution the
verifier is given (Chen et al. 2023, Algorithm 2). Users ask for a *warped*
target (temperature, top-k, top-p, min-p), so the target's logits are warped
here before verification, and the draft's logits go through the very same
function so that the draft proposes from the distribution it claims to.
"""

from __future__ import annotations

import torch

from specdec.sampling.categorical import sample_rows
from specdec.sampling.params import SamplingParams


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn raw logits into the sampling distribution the request asked for.

    logits: [..., V] any float dtype. Returns float32 probs [..., V], rows sum to 1.

    Order (as in vLLM and transformers): temperature, then top-k, then top-p,
    then min-p, each a mask on the previous distribution, renormalised at the end.
    Temperature 0 is greedy: a point mass on the argmax (first index on ties,
    matching torch.argmax and therefore plain greedy decoding).

    Example: logits [2., 1., 0.], temperature 1, top_k 2
      softmax -> [0.665, 0.245, 0.090]; top-2 keeps the first two
      -> [0.731, 0.269, 0.0]
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()

    logits = logits / params.temperature
    vocab_size = logits.shape[-1]
    if 0 < params.top_k < vocab_size:
        kth_largest = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)

    if params.top_p < 1.0:
        sorted_probs, sorted_idx = torch.sort(probs, dim=-1, descending=True)
        # Keep a token while the mass strictly before it is below top_p, so the
        # kept set is the smallest prefix reaching top_p (the top token always stays).
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)

    if params.min_p > 0.0:
        threshold = params.min_p * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)

    return probs / probs.sum(dim=-1, keepdim=True)


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row. probs: [..., V] -> int64 [...]."""
    return sample_rows(probs.reshape(-1, probs.shape[-1]), generator).reshape(probs.shape[:-1])
