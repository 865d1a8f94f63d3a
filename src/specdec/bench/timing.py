"""What a benchmark needs besides prompts: forward-pass timing, copy bandwidth, weight bytes."""

from __future__ import annotations

import statistics
import time

import torch

from specdec.models.runner import ForwardOutput, ModelRunner


class TimedRunner:
    """A ModelRunner that adds up the wall time of its forward passes.

    Engine time minus forward time is the per-step overhead outside the model
    (proposer bookkeeping, verification, commits), the number to keep small.
    """

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.forward_s = 0.0
        self.forwards = 0

    def __getattr__(self, name):  # everything but the timed forward is the runner's (rows, keep_path, ...)
        return getattr(self.runner, name)

    def forward(self, token_ids, positions, **kwargs) -> ForwardOutput:
        started = time.perf_counter()
        out = self.runner.forward(token_ids, positions, **kwargs)
        self.forward_s += time.perf_counter() - started
        self.forwards += 1
        return out


def copy_bandwidth_gbs(megabytes: int = 512, repeats: int = 7) -> float:
    """Median GB/s of a large tensor copy (bytes read + bytes written): what one core pair can stream."""
    source = torch.ones(megabytes * (1 << 20) // 4)
    target = torch.empty_like(source)
    target.copy_(source)  # fault the pages in
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - started)
    return 2 * source.numel() * 4 / statistics.median(times) / 1e9


def tensor_bytes(tensor: torch.Tensor) -> int:
    if tensor.is_mkldnn:  # packed oneDNN weights: same element count, opaque layout
        return tensor.numel() * tensor.element_size()
    return tensor.untyped_storage().nbytes()


def weight_bytes_per_token(module: torch.nn.Module, skip: tuple[str, ...] = ("embedding",)) -> int:
    """Bytes of weights one decode step reads: every parameter and buffer, once, except lookup tables.

    Tensors that share storage (a head tied to the embedding) count once; the
    embedding table itself is only gathered (T rows), so it is skipped.
    """
    seen, total = set(), 0
    packed = [(f"{name}.packed_weight", child.packed_weight) for name, child in module.named_modules()
              if isinstance(getattr(child, "packed_weight", None), torch.Tensor)]  # packed linears keep a plain attribute
    for name, tensor in [*module.named_parameters(), *module.named_buffers(), *packed]:
        if tensor is None or name.split(".")[-1] in skip or name in skip:
            continue
        key = id(tensor) if tensor.is_mkldnn else tensor.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += tensor_bytes(tensor)
    return total
