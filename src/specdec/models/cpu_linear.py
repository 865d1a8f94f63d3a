"""Linear layers with oneDNN pre-packed weights: flat cost from 1 to ~8 tokens on CPU.

Speculative decoding pays only if a forward over k+1 tokens costs about as much
as over one (Leviathan et al. 2022, section 3.4: the verifier is memory-bound).
On CPUs, PyTorch's default fp32 path for nn.Linear (MKL sgemm) is memory-bound
for one token but turns compute-inefficient for 2..8 rows: a few rows cost several
times one row, while oneDNN's linear with a pre-packed weight costs about the same
for one row or a few, so a forward over k+1 tokens costs little more than over one.
Same math, same fp32 results up to summation order. Per projection: docs/history.md,
"4-bit targets on specdec's own kernel, attention in one call: w4a8 (issue 19, second part)"
(`python benchmarks/native_kernels.py`); on whole models: benchmarks/RESULTS.md,
"specdec vs transformers assisted generation (issue 2)".
"""

from __future__ import annotations

import torch
from torch import nn


class OneDNNLinear(nn.Module):
    """Drop-in inference replacement for nn.Linear on CPU, fp32."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # The packed copy replaces the dense weight (no doubled memory), except
        # where the dense tensor is shared (tied embeddings), which keep theirs.
        self.packed_weight = linear.weight.detach().to_mkldnn()
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """A dense copy, for code that inspects weights (shapes, tying); not used in forward."""
        return self.packed_weight.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, self.in_features).contiguous().to_mkldnn()
        out = torch._C._nn.mkldnn_linear(rows, self.packed_weight, self.bias).to_dense()
        return out.reshape(*x.shape[:-1], self.out_features)


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_linears(module: nn.Module) -> int:
    """Replace every nn.Linear under `module` by a OneDNNLinear; returns how many."""
    swapped = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:
            setattr(module, name, OneDNNLinear(child))
            swapped += 1
        else:
            swapped += pack_linears(child)
    return swapped
