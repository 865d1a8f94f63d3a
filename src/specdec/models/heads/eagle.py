"""The EAGLE draft head.

EAGLE (Li et al. 2024, arXiv 2401.15077): drafting at the feature level is
easier than at the token level. One decoder layer reads, at position j, the
target's feature f_j (its final-norm hidden state, what the output head reads)
fused with the embedding of the token that followed, t_{j+1}:
    x_j = fc([embed(t_{j+1}); f_j])          # [2H] -> [H]
    f^_{j+1} = decoder_layer(x_{<=j})        # causal attention, its own KV cache
and the output head turns f^_{j+1} into a distribution for t_{j+2}. Drafting
feeds the predicted feature back (autoregressive at feature level). The output
head may score a reduced vocabulary (EAGLE-3, Li et al. 2025, arXiv 2503.01840).
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.models.heads.config import HeadConfig
from specdec.models.heads.layers import HeadKVCache, attend, project_qkv


class EagleHead(nn.Module):
    """fc over [embed(next token); feature], then one pre-norm decoder layer (EAGLE-1's
    layer skips the input norm: the fused input is not a residual stream)."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        hidden, heads, kv_heads, dim = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.config = config
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.q_proj = nn.Linear(hidden, heads * dim, bias=True)
        self.k_proj = nn.Linear(hidden, kv_heads * dim, bias=True)
        self.v_proj = nn.Linear(hidden, kv_heads * dim, bias=True)
        self.o_proj = nn.Linear(heads * dim, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        self.gate_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, hidden, bias=False)

    # The proposer's two hooks, as Eagle3Head's (proposers/heads.py: EagleProposer serves both): EAGLE
    # reads the target's final features as they are, and its output matrix reads what it predicts.
    def read_target(self, features: torch.Tensor) -> torch.Tensor:
        return features

    def to_output(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def forward(
        self,
        features: torch.Tensor,  # [B, T, H] f_j (the target's, or the head's own predictions)
        next_embeds: torch.Tensor,  # [B, T, H] embed(t_{j+1})
        positions: torch.Tensor,  # [B, T] j
        *,
        cache: HeadKVCache | None = None,  # decoding (B = 1): appends the T new keys first
        mask: torch.Tensor | None = None,  # [B, 1, T, S] bool for a cache; None: causal over the T
    ) -> torch.Tensor:  # [B, T, H] f^_{j+1}
        batch, steps, _ = features.shape
        x = self.fc(torch.cat([next_embeds.to(features.dtype), features], dim=-1))
        query, key, value = project_qkv(self, x, positions)
        attended = attend(self.config, query, key, value, cache, mask)
        x = x + self.o_proj(attended.transpose(1, 2).reshape(batch, steps, -1))
        # RMSNorm in fp32, as the target's (native/model.py), whatever the head's dtype.
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.mlp_norm.eps)).to(x.dtype)
        normed = normed * self.mlp_norm.weight.to(x.dtype)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(normed)) * self.up_proj(normed))
