"""Verification of drafted tokens: lossless rejection sampling and greedy matching.

Modified rejection sampling (Leviathan et al. 2022, arXiv 2211.17192, Algorithm 1;
Chen et al. 2023, arXiv 2302.01318, Algorithm 2): draft token x_j drawn from
q_j is accepted with probability min(1, p_j(x_j) / q_j(x_j)); at the first
rejection a *recovered* token is drawn from the residual norm((p_j - q_j)+);
if all k drafts are accepted a *bonus* token is drawn from p_{k+1}. Every
emitted token is then distributed exactly as p, whatever q is.

Lenience (Leviathan et al., Appendix A.5) trades that exactness for speed: with
0 < l < 1, x_j is accepted with probability min(1, p_j(x_j) / (l q_j(x_j))), and
at temperature 0 whenever p_j(x_j) >= l max_x p_j(x). l = 1 is the exact rule;
any l < 1 is LOSSY: the output no longer follows the target's distribution
(greedy: no longer equals its greedy output). planning/theory.py has the
expected acceptance rate, lenient_acceptance_rate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.sampling.categorical import Generators, sample_rows, uniforms
from specdec.sampling.warp import candidate_logits


@dataclass(frozen=True)
class VerifyResult:
    output_ids: torch.Tensor  # [B, k+1] int64: accepted drafts, then one recovered/bonus token, then -1
    num_accepted: torch.Tensor  # [B] int64: accepted draft tokens (emitted = num_accepted + 1)


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """[B, k] bool -> [B] length of the all-True prefix of each row."""
    return mask.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def acceptance_probs(
    draft_token_ids: torch.Tensor,  # [B, k] int64, padded with -1
    draft_probs: torch.Tensor | None,  # [B, k, V]; None = point mass
    target_probs: torch.Tensor,  # [B, k+1, V] (or [B, k, V])
    lenience: float = 1.0,
) -> torch.Tensor:
    """min(1, p_j(x_j) / (l q_j(x_j))) for each draft position: [B, k] float32.

    A point-mass draft has q_j(x_j) = 1, so x_j is accepted w.p. p_j(x_j) (/ l).
    q_j(x_j) = 0 cannot be drafted; it is treated as "accept iff p > 0".
    lenience l = 1 is the exact rule; l < 1 is lossy (module docstring).
    """
    k, vocab = draft_token_ids.shape[1], target_probs.shape[-1]
    in_vocab = (draft_token_ids >= 0) & (draft_token_ids < vocab)  # [B, k]
    safe_ids = torch.where(in_vocab, draft_token_ids, 0)[..., None]  # [B, k, 1]
    target_p = target_probs[:, :k].float().gather(-1, safe_ids).squeeze(-1) / lenience  # [B, k]
    usable = in_vocab  # [B, k]
    if draft_probs is None:
        ratio = target_p
    else:
        draft_q = draft_probs.float().gather(-1, safe_ids).squeeze(-1)  # [B, k]
        ratio = torch.where(draft_q > 0, target_p / draft_q.clamp_min(1e-30), (target_p > 0).float())
        usable = usable & draft_q.isfinite()
    # An id outside the vocabulary (a broken draft's -1), a non-finite q or a NaN ratio is never
    # accepted: the step then closes with a token drawn from the target (recovery_probs).
    return torch.where(usable & ~ratio.isnan(), ratio, 0.0).clamp_max(1.0)


def recovery_probs(
    num_accepted: torch.Tensor,  # [B] int64
    num_draft: torch.Tensor,  # [B] int64
    draft_token_ids: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor | None,  # [B, k, V]; None = point mass
    target_probs: torch.Tensor,  # [B, k+1, V]
) -> torch.Tensor:
    """Distribution of the token that closes the step: [B, V] float32.

    At the first rejected position a it is norm((p_a - q_a)+) (the *recovered*
    token); when every draft was accepted (a == num_draft) q_a is taken as 0 and
    the same formula gives p_{k+1} (the *bonus* token).
    """
    batch, k = draft_token_ids.shape
    rows = torch.arange(batch, device=target_probs.device)
    final_target = target_probs[rows, num_accepted].float()  # [B, V]
    if k == 0:
        return final_target
    reject_pos = num_accepted.clamp_max(k - 1)
    if draft_probs is None:
        final_draft = torch.nn.functional.one_hot(draft_token_ids.clamp_min(0)[rows, reject_pos], final_target.shape[-1])
    else:
        final_draft = draft_probs[rows, reject_pos]
    rejected = (num_accepted < num_draft)[:, None]  # [B, 1]
    residual = (final_target - final_draft.float() * rejected).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    # A zero residual means p == q there, where rejection has probability 0: the fallback to p only
    # guards against round-off. A non-finite one (NaN or inf in a broken draft's q) says nothing
    # about p - q: the token is drawn from p, as if nothing had been drafted there.
    usable = mass.isfinite() & (mass > 0)
    return torch.where(usable, residual / mass.clamp_min(1e-30), final_target)


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [B, k] int64, padded with -1
    num_draft: torch.Tensor,  # [B] int64, 0 means "no draft" (plain sampling)
    draft_probs: torch.Tensor | None,  # [B, k, V] warped draft distribution; None = point mass
    target_probs: torch.Tensor,  # [B, k+1, V] warped target distribution
    *,
    generator: Generators = None,
    lenience: float = 1.0,
) -> VerifyResult:
    """Lossless verification of one speculative step, vectorised over k (lossy when lenience < 1).

    Worked example (B=1, k=2, V=3), drafts [2, 0]:
      q_0 = [.2, .2, .6], p_0 = [.1, .6, .3]: x_0=2 is accepted w.p. min(1, .3/.6) = .5.
      Say u_0 = .7 >= .5 -> rejected, num_accepted = 0, and the recovered token is
      drawn from norm((p_0 - q_0)+) = norm([0, .4, 0]) = token 1.
      output_ids = [[1, -1, -1]].
    Over all draws, the first emitted token is 0 w.p. .2*.5 = .1, 1 w.p.
    .2*1 + (1-.6)*1 = .6, and 2 w.p. .6*.5 = .3: exactly p_0 (tests enumerate this).

    A point-mass draft (draft_probs None; n-gram proposals) has q = onehot(x),
    so x is accepted w.p. p(x) and the residual is p with x removed.
    Pure: no host syncs; randomness only through `generator` (one, or one per row).

    lenience l < 1 (LOSSY) only raises the acceptance probability to
    min(1, p/(l q)); a rejection still draws from norm((p - q)+), which holds
    exactly the tokens where the target wants more mass than the draft gave.
    """
    batch, k = draft_token_ids.shape
    device = target_probs.device
    is_drafted = torch.arange(k, device=device)[None, :] < num_draft[:, None]  # [B, k]

    # 1. Accept x_j iff u_j < min(1, p_j(x_j) / q_j(x_j)); keep the accepted prefix.
    uniform = uniforms((batch, k), generator, device)  # [B, k]
    accepted = (uniform < acceptance_probs(draft_token_ids, draft_probs, target_probs, lenience)) & is_drafted
    num_accepted = _leading_true(accepted)  # [B]

    # 2. One recovered (or bonus) token closes the step.
    final_probs = recovery_probs(num_accepted, num_draft, draft_token_ids, draft_probs, target_probs)
    final_token = sample_rows(final_probs, generator)  # [B]

    # 3. Assemble [accepted drafts..., final token, -1...].
    out_positions = torch.arange(k + 1, device=device)[None, :]
    padded_drafts = torch.cat([draft_token_ids, draft_token_ids.new_full((batch, 1), -1)], dim=1)
    output_ids = torch.where(out_positions < num_accepted[:, None], padded_drafts, -1)
    output_ids = torch.where(out_positions == num_accepted[:, None], final_token[:, None], output_ids)
    return VerifyResult(output_ids=output_ids, num_accepted=num_accepted)


def greedy_verify(
    draft_token_ids: torch.Tensor,  # [B, k] int64, padded with -1
    num_draft: torch.Tensor,  # [B] int64
    target_token_ids: torch.Tensor,  # [B, k+1] int64: argmax of the target logits at each position
) -> VerifyResult:
    """Temperature-0 verification: accept the longest prefix where draft == target argmax.

    Example: drafts [5, 7, 9], target argmax [5, 7, 3, 8] -> 2 accepted,
    output [5, 7, 3, -1]. Equal, token for token, to plain greedy decoding.
    This is rejection_sample with one-hot target probs, without touching V.
    """
    k = draft_token_ids.shape[1]
    positions = torch.arange(k, device=draft_token_ids.device)
    matches = ((draft_token_ids == target_token_ids[:, :k]) & (target_token_ids[:, :k] >= 0)
               & (positions[None, :] < num_draft[:, None]))
    num_accepted = _leading_true(matches)
    out_positions = torch.arange(k + 1, device=draft_token_ids.device)[None, :]
    output_ids = torch.where(out_positions <= num_accepted[:, None], target_token_ids, -1)
    return VerifyResult(output_ids=output_ids, num_accepted=num_accepted)


def lenient_greedy_verify(
    draft_token_ids: torch.Tensor,  # [B, k] int64, padded with -1
    num_draft: torch.Tensor,  # [B] int64
    target_logits: torch.Tensor,  # [B, k+1, V] raw
    lenience: float,
) -> VerifyResult:
    """LOSSY temperature-0 verification (Leviathan et al., Appendix A.5): accept x_j while
    p_j(x_j) >= l * max_x p_j(x), with p = softmax of the raw target logits.

    The token that closes the step is still the target's argmax. l = 1 accepts only
    (ties with) the argmax, i.e. greedy_verify; smaller l accepts the draft's
    near-misses. Example, l = 0.5: p_0 = [.5, .3, .2], draft 1 -> .3 >= .25, accepted.
    """
    k = draft_token_ids.shape[1]
    shifted, has_candidate = candidate_logits(target_logits)  # NaN and inf settled (warp.py)
    target_probs = torch.softmax(shifted, dim=-1)  # [B, k+1, V]
    top_p, top_ids = target_probs.max(dim=-1)  # [B, k+1]
    top_ids = torch.where(has_candidate[..., 0], top_ids, -1)
    draft_p = target_probs[:, :k].gather(-1, draft_token_ids.clamp_min(0)[..., None]).squeeze(-1)  # [B, k]
    positions = torch.arange(k, device=draft_token_ids.device)
    accepted = (draft_p >= lenience * top_p[:, :k]) & (positions[None, :] < num_draft[:, None])
    num_accepted = _leading_true(accepted)
    out_positions = torch.arange(k + 1, device=draft_token_ids.device)[None, :]
    padded_drafts = torch.cat([draft_token_ids, draft_token_ids.new_full((draft_token_ids.shape[0], 1), -1)], dim=1)
    output_ids = torch.where(out_positions < num_accepted[:, None], padded_drafts, -1)
    output_ids = torch.where(out_positions == num_accepted[:, None], top_ids, output_ids)
    return VerifyResult(output_ids=output_ids, num_accepted=num_accepted)
