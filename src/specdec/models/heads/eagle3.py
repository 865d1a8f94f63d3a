"""The EAGLE-3 draft head (Li et al. 2025, arXiv 2503.01840), laid out as vLLM runs it.

The head reads g_j, the target's residual stream entering three of its layers
(low, middle, high: vLLM's default 2, L/2 and L-3), concatenated [3H], and
the embedding of the token that followed, t_{j+1}:

    h_j   = fc(g_j)                                    # [3H] -> [H], no bias (first step only)
    x_j   = [input_norm(embed(t_{j+1})); hidden_norm(h_j)]    # [2H]
    a_j   = o_proj(attention(q/k/v_proj(x_j)))         # q/k/v read 2H, causal, RoPE
    r_j   = hidden_norm(h_j) if norm_before_residual else h_j
    h'_j  = r_j + a_j;  h'_j = h'_j + mlp(post_norm(h'_j))
    p(t_{j+2}) = softmax(lm_head(norm(h'_j)))          # over the head's draft vocabulary

Drafting feeds h'_j back as the next step's h (no fc), with the drafted token:
the head predicts tokens directly and never regresses the target's features,
unlike EAGLE-1 (eagle.py: EagleHead). These are the equations of
vLLM's `Eagle3LlamaForCausalLM` and of speculators' `LlamaDecoderEagle3FirstLayer`,
with the same parameter names (export.py writes them), so a head trained here
drafts the same tokens there.

The output matrix (lm_head) is the target's own rows for the draft vocabulary
(layers.py: FrozenVocabulary), frozen as speculators trains it; the
draft-to-target id map is FrozenVocabulary.vocab_ids (speculators' d2t holds
vocab_ids[i] - i).
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.models.heads.config import HeadConfig
from specdec.models.heads.layers import HeadKVCache, attend, project_qkv


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, as the target's (native/model.py), whatever the head's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight.to(x.dtype)


class Eagle3Head(nn.Module):
    """fc over the target's fused features, one decoder layer over [embedding; feature], a final norm."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        hidden, heads, kv_heads, dim = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.config = config
        self.fc = nn.Linear(len(config.aux_layers) * hidden, hidden, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(hidden))
        self.hidden_norm = nn.Parameter(torch.ones(hidden))
        self.q_proj = nn.Linear(2 * hidden, heads * dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * dim, bias=False)
        self.o_proj = nn.Linear(heads * dim, hidden, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(hidden))
        self.gate_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, hidden, bias=False)
        self.norm = nn.Parameter(torch.ones(hidden))

    # The proposer's two hooks (proposers/heads.py: EagleProposer serves EAGLE and EAGLE-3).
    def read_target(self, aux: torch.Tensor) -> torch.Tensor:  # [..., 3H] -> [..., H]
        return self.fc(aux.to(self.norm.dtype))

    def to_output(self, hidden: torch.Tensor) -> torch.Tensor:  # h' -> what the output matrix reads
        return rms_norm(hidden, self.norm, self.config.rms_norm_eps)

    def project(self, hidden: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden, next_embeds [B, T, H], positions [B, T] -> query [B, Hq, T, D], key, value
        [B, Hkv, T, D] (RoPE applied) and the residual [B, T, H]."""
        eps = self.config.rms_norm_eps
        normed = rms_norm(hidden, self.hidden_norm, eps)
        x = torch.cat([rms_norm(next_embeds.to(hidden.dtype), self.input_layernorm, eps), normed], dim=-1)
        query, key, value = project_qkv(self, x, positions)
        return query, key, value, normed if self.config.norm_before_residual else hidden

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attended [B, Hq, T, D], residual [B, T, H] -> h' [B, T, H] (before the final norm)."""
        batch, _, steps, _ = attended.shape
        x = residual + self.o_proj(attended.transpose(1, 2).reshape(batch, steps, -1))
        normed = rms_norm(x, self.post_attention_layernorm, self.config.rms_norm_eps)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(normed)) * self.up_proj(normed))

    def forward(
        self,
        hidden: torch.Tensor,  # [B, T, H] h_j: fc(target features), or the head's own h'
        next_embeds: torch.Tensor,  # [B, T, H] embed(t_{j+1})
        positions: torch.Tensor,  # [B, T] j
        *,
        cache: HeadKVCache | None = None,  # decoding (B = 1): appends the T new keys first
        mask: torch.Tensor | None = None,  # [B, 1, T, S] bool for a cache; None: causal over the T
    ) -> torch.Tensor:  # [B, T, H] h'_j
        query, key, value, residual = self.project(hidden, next_embeds, positions)
        return self.finish(attend(self.config, query, key, value, cache, mask), residual)


def unrolled_mask(roots: torch.Tensor, length: int, depth: int) -> torch.Tensor:
    """Training-time test's attention mask [P, length + (depth - 1) x P] for unroll step depth - 1,
    whose queries are the P roots j (ascending positions in a window of `length`).

    Keys are laid out step by step: first the `length` positions fed with the target's features
    (step 0, every position), then block i holds the roots' i-th drafts. A query at root j drafts
    the (s+1)-th token after it; drafting would let it see the committed context (positions <= j)
    and its own chain's earlier drafts, which all grew from root j: the diagonal of blocks
    1..s. EAGLE-3 Section 3.2 (its Figure 5); speculators' diagonal extension of the causal mask.
    """
    context = torch.arange(length, device=roots.device)[None] <= roots[:, None]  # [P, length]
    diagonal = torch.eye(len(roots), dtype=torch.bool, device=roots.device)
    return torch.cat([context] + [diagonal] * (depth - 1), dim=1)
