"""The MLP speculator: a chain of small MLP stages on the target's last feature and the drafted tokens.

Wertheimer et al. 2024, "Accelerating Production LLMs with Combined Token/Embedding Speculators"
(arXiv 2404.19124), in the layout of IBM's fms-extras and vLLM's MLPSpeculator. From the target's
final-norm feature f_j (which predicted t_{j+1}) and the tokens drafted so far, stage i predicts
t_{j+2+i}:
    s_0 = f_j
    s_{i+1} = GELU(LN_i(P_i s_i + (w_e / w_s) * E(t_{j+1+i})))      # LN_i: RMS-normalise, scale, shift
    logits_i = W s_{i+1}
with w_s = 0.5^(0.5 / n) and w_e = sqrt((1 - w_s^2) * H / 2) (n stages, H the state width): the state
carries a decaying share of the target's feature and each stage mixes in one more token. No
attention and no cache: a stage costs one H x H matmul and the output head, so a drafted token costs
a small fraction of a target step; what it knows of the context is what f_j holds.

Here E is the target's own embedding (frozen, so the state is H wide) and W is the head's own output
matrix over its reduced vocabulary (vocab_ids; trained, started from the target's rows), shared by the
stages. models/heads/mlp_speculator_export.py writes it in the fms-extras / vLLM layout.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from specdec.models.heads.config import HeadConfig


class SpeculatorNorm(nn.Module):
    """fms-extras' LayerNormParameterized as the MLP speculator uses it: x / rms(x), then * weight + bias."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed + self.bias


class MLPSpeculator(nn.Module):
    """config.mlp_stages stages, each P_i and LN_i; one output matrix over config.draft_vocab_size tokens."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        width, stages = config.hidden_size, config.mlp_stages
        self.config = config
        self.proj = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(stages))
        self.ln = nn.ModuleList(SpeculatorNorm(width) for _ in range(stages))
        self.output = nn.Linear(width, config.draft_vocab_size, bias=False)
        for proj in self.proj:  # fms-extras' initialisation
            nn.init.normal_(proj.weight, 0.0, 1 / math.sqrt(width))
        state_weight = 0.5 ** (0.5 / stages)
        self.token_scale = math.sqrt((1 - state_weight ** 2) * (width / 2)) / state_weight

    def start_from(self, output_rows: torch.Tensor) -> None:
        """The output matrix starts as the target's rows for the head's vocabulary ([N, H])."""
        with torch.no_grad():
            self.output.weight.copy_(output_rows)

    def stage(self, index: int, state: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        """s_{i+1} from s_i [..., H] and E(t_{j+1+i}) [..., H]."""
        mixed = self.proj[index](state) + self.token_scale * token_embedding.to(state.dtype)
        return nn.functional.gelu(self.ln[index](mixed))
