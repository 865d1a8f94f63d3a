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


def candidate_logits(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Any model's logits as a row the sampler can trust: (shifted [..., V] float32, has_candidate [..., 1]).

    shifted is logits minus the row's largest, so every entry is <= 0 and the top is 0: dividing by
    any temperature the params allow cannot overflow to +inf, and the softmax's sum is >= 1. What a
    broken forward may hand over is settled here, the same way for the draft and the target:
      - NaN never wins: it counts as -inf (no probability);
      - a row holding +inf: those entries are its only candidates, equally likely (the limit of a
        logit growing without bound; greedy takes the first, as torch.argmax does);
      - a row with no entry above -inf has no candidate (has_candidate False): warp_logits gives it
        no probability at all, and the draw that reads it returns -1, which the engine refuses
        (engine/step.py) instead of emitting a token the target never chose.
    """
    clean = _nan_as_minus_inf(logits.float())
    top = clean.amax(dim=-1, keepdim=True)  # [..., 1]
    # x - top is NaN exactly where x = top = +inf: those are the candidates, at 0; finite x under a
    # +inf top become -inf. A row without candidates (top -inf) turns all NaN, masked by the caller.
    shifted = (clean - top).nan_to_num(nan=0.0, posinf=0.0, neginf=float("-inf"))
    return shifted, top > float("-inf")


def _nan_as_minus_inf(logits: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf, infinities kept (nan_to_num would otherwise clip them to the largest finite)."""
    return logits.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Temperature 0: argmax over [..., V] (first index on ties, as torch.argmax) -> int64 [...],
    with NaN counting as -inf; -1 for a row with no candidate (candidate_logits)."""
    clean = _nan_as_minus_inf(logits)
    ids = clean.argmax(dim=-1)  # a +inf is the largest: its first one wins
    return torch.where(clean.gather(-1, ids[..., None])[..., 0] > float("-inf"), ids, -1)


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn raw logits into the sampling distribution the request asked for.

    logits: [..., V] any float dtype. Returns float32 probs [..., V], rows sum to 1, except a row
    with no candidate (all NaN or -inf; candidate_logits), which is all zeros.

    Order (as in vLLM and transformers): temperature, then top-k, then top-p,
    then min-p, each a mask on the previous distribution, renormalised at the end.
    Temperature 0 is greedy: a point mass on the argmax (first index on ties,
    matching torch.argmax and therefore plain greedy decoding).

    Example: logits [2., 1., 0.], temperature 1, top_k 2
      softmax -> [0.665, 0.245, 0.090]; top-2 keeps the first two
      -> [0.731, 0.269, 0.0]
    """
    if params.greedy:  # the point mass on greedy_tokens' choice; none for a row without a candidate
        ids = greedy_tokens(logits.float())
        return torch.nn.functional.one_hot(ids.clamp_min(0), logits.shape[-1]).float() * (ids >= 0)[..., None]

    shifted, has_candidate = candidate_logits(logits)

    # <= 0, the top at 0: no overflow (params' temperature floor). A temperature past float32's range
    # would read as inf, and -inf / inf is NaN: its largest finite value flattens the row just the same.
    logits = shifted / min(params.temperature, torch.finfo(torch.float32).max)
    vocab_size = logits.shape[-1]
    if 0 < params.top_k < vocab_size:
        kth_largest = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)

    if params.top_p < 1.0:
        probs = probs.masked_fill(outside_nucleus(probs, params.top_p), 0.0)

    if params.min_p > 0.0:
        threshold = params.min_p * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)

    return torch.where(has_candidate, probs / probs.sum(dim=-1, keepdim=True), 0.0)


# Candidates for the top-p nucleus: the largest 256 probabilities, then 4096, then the whole row sorted.
NUCLEUS_CANDIDATES = (256, 4096)


def outside_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] bool: the tokens top-p drops. Sorted by probability, largest first, a token stays
    while the mass strictly before it is below top_p, so the kept set is the smallest prefix
    reaching top_p (the top token always stays).

    Why candidates: sorting a row of the embedded models' 151,936 probabilities is slow on a CPU,
    and every warped row paid it (each verified position, each drafted token): on a 2-core Zen 4
    EPYC top_p = 0.9 at 5 rows cost more than the forward it followed. The largest 256, found for a
    small fraction of a sort's cost, nearly always hold the nucleus of a language model's
    distribution; a row whose candidates hold less than top_p tries 4096, then the whole row.
    Within the candidates the sums are the whole sort's, prefix for prefix, so the kept set is the
    same (benchmarks/RESULTS.md, "Sampling without torch.multinomial, top-p without a sort"). On
    CUDA, where the sort is cheap, the whole row is sorted at once (no host sync to find the rows
    that need more).
    """
    flat = probs.reshape(-1, probs.shape[-1])
    vocab = flat.shape[-1]
    widths = [width for width in NUCLEUS_CANDIDATES if width < vocab and not flat.is_cuda] + [vocab]
    drop = torch.ones_like(flat, dtype=torch.bool)
    pending = torch.arange(flat.shape[0], device=flat.device)
    for width in widths:
        values, index = torch.topk(flat[pending], width, dim=-1)  # largest first
        cumulative = values.cumsum(dim=-1)
        kept = cumulative - values < top_p
        if width < vocab:  # rows whose candidates reach top_p are done; the others widen
            done = cumulative[:, -1] >= top_p
            rows, index, kept, pending = pending[done], index[done], kept[done], pending[~done]
        else:
            rows, pending = pending, pending[:0]
        drop[rows] = drop[rows].scatter(-1, index, ~kept)
        if not len(pending):
            break
    return drop.reshape(probs.shape)


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row. probs: [..., V] -> int64 [...]."""
    return sample_rows(probs.reshape(-1, probs.shape[-1]), generator).reshape(probs.shape[:-1])
