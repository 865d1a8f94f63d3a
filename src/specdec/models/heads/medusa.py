"""Medusa's draft heads.

Medusa (Cai et al. 2024, arXiv 2401.10774): m heads on the target's last
feature f_j, head i a residual block x + SiLU(W_i x + b_i) followed by the
output head, predicting t_{j+1+i}: the tokens after the one the target itself
predicts. Medusa-1 gives every head its own copy of the output head; here the
heads share the target's frozen one (cheaper to train and to run), and W_i
starts at zero so each head starts as the target's own next-token guess.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.models.heads.config import HeadConfig


class MedusaHeads(nn.Module):
    """m residual blocks on the target's last feature; block i predicts the token i + 1 steps
    past the target's own next token (through the shared output head)."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(nn.Linear(config.hidden_size, config.hidden_size)
                                    for _ in range(config.num_medusa_heads))
        for block in self.blocks:  # start as the identity: each head begins as the target's own guess
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., m, H] per-head features
        return torch.stack([features + nn.functional.silu(block(features)) for block in self.blocks], dim=-2)
