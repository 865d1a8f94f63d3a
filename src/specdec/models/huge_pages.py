"""A CPU model's streamed weights on 2 MB pages (Linux transparent huge pages).

Why: a decoding step reads every projection's weights from memory once, and a verification of k + 1
tokens reads them once while it multiplies. On 4 KB pages the hardware prefetchers stop at every page
boundary (a w4a8 block's 12 KB stream crosses one every 16 groups) and the TLB misses a page every
4 KB, which a virtual machine's nested page walk makes dear. The weights' bytes and arithmetic are
the same on either page size: only the time to fetch them moves. Measured on a 2-core Zen 4 EPYC, both
forms in one process (benchmarks/page_size_ab.py; docs/history.md, "Weights on 2 MB pages: every
forward 2-10% faster, the same bits (issue 38)"): the 1.5B target's w4a8 step, its 9-token verification
and the 0.5B draft's step all took less time; prefill, which is arithmetic-bound, took the same.

PyTorch's allocator can do the same for every allocation of 2 MB or more (THP_MEM_ALLOC_ENABLE=1),
but only when that variable is set before torch's first allocation, which a library imported after
torch cannot promise, and it also moves the forward's short-lived activations, whose fresh 2 MB
pages made an 800-token prefill 6-7% slower on the same CPU. So only the weights move, once, when
the model is built, and the KV cache is allocated the same way (zeros()): into an anonymous mapping
that asks the kernel for huge pages (madvise(MADV_HUGEPAGE), honoured where
/sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise`, the common defaults).
Elsewhere (other systems, THP `never`) the weights stay where they are.
"""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
MIN_BYTES = 1 << 20  # smaller tensors (norms, biases, codes of small layers) are not worth a page's alignment
_ALIGN = 64  # each storage starts on a cache line, as the kernels' vector loads prefer
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_unavailable() -> str | None:
    """None where madvise(MADV_HUGEPAGE) can give this process 2 MB pages, else why not."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return "transparent huge pages are a Linux feature"
    try:
        setting = _THP_SETTING.read_text()
    except OSError:
        return f"{_THP_SETTING} is not readable"
    if "[never]" in setting:
        return "transparent huge pages are off (never) on this system"
    return None


def _streamed_tensors(modules: list[nn.Module]) -> list[tuple[dict, str, torch.Tensor]]:
    """(the dict that holds it, its name, the tensor) for every plain CPU parameter and buffer."""
    found = []
    for module in modules:
        for owner in module.modules():
            for table in (owner._parameters, owner._buffers):
                for name, tensor in table.items():
                    if (tensor is not None and tensor.device.type == "cpu" and tensor.layout == torch.strided
                            and not tensor.is_mkldnn):
                        found.append((table, name, tensor))
    return found


def move_to_huge_pages(modules: list[nn.Module], *, keep: tuple[torch.Tensor, ...] = (),
                       min_bytes: int = MIN_BYTES) -> torch.Tensor:
    """Copy the CPU storages of at least `min_bytes` behind these modules' parameters and buffers into
    one huge-page mapping, in place of the originals; returns that mapping's bytes as one uint8 tensor
    (the storages one after another, each starting on a 64-byte line; empty where nothing moved, as
    where huge pages are unavailable): reading it reads what a step streams, on the same pages
    (analysis/roofline.py's weight floor). Values, dtypes, shapes, strides and storage sharing are
    kept: two tensors that shared a storage share the new one. `keep`: tensors whose storages stay
    where they are (the native decoder's embedding: a step reads a few of its rows, and a tied head
    that shares it must go on sharing it). Call it before anything keeps its own reference to the
    tensors (the native decoder calls it before building its block calls)."""
    nothing = torch.empty(0, dtype=torch.uint8)
    if huge_pages_unavailable() is not None:
        return nothing
    kept = {tensor.untyped_storage().data_ptr() for tensor in keep}
    groups: dict[int, list[tuple[dict, str, torch.Tensor]]] = {}  # storage address -> its tensors
    for entry in _streamed_tensors(modules):
        storage = entry[2].untyped_storage()
        if storage.nbytes() >= min_bytes and storage.data_ptr() not in kept:
            groups.setdefault(storage.data_ptr(), []).append(entry)
    if not groups:
        return nothing
    sizes = {key: group[0][2].untyped_storage().nbytes() for key, group in groups.items()}
    arena, offset = _huge_mapping(sum(_round_up(size, _ALIGN) for size in sizes.values()))
    first = offset
    for key in list(groups):
        # One storage at a time, its old copy released before the next is made: the load's peak
        # memory grows by the largest storage, not by the model.
        group = groups.pop(key)
        # Each storage gets its own view of the arena (the tensor keeps the mapping alive), so code
        # that refuses tensors sharing memory (safetensors' save) sees them as before.
        copy = torch.frombuffer(arena, dtype=torch.uint8, count=sizes[key], offset=offset)
        copy.copy_(torch.empty(0, dtype=torch.uint8).set_(group[0][2].untyped_storage()))
        offset += _round_up(sizes[key], _ALIGN)
        replaced: dict[int, torch.Tensor] = {}  # one new tensor per old one: a tied parameter stays tied
        for table, name, tensor in group:
            if id(tensor) not in replaced:
                placed = torch.empty(0, dtype=tensor.dtype).set_(copy.untyped_storage(), tensor.storage_offset(),
                                                                tensor.size(), tensor.stride())
                replaced[id(tensor)] = (nn.Parameter(placed, requires_grad=tensor.requires_grad)
                                        if isinstance(tensor, nn.Parameter) else placed)
            table[name] = replaced[id(tensor)]
        del group, replaced, copy
    return torch.frombuffer(arena, dtype=torch.uint8, count=offset - first, offset=first)


def _round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def _huge_mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """(an anonymous mapping advised for huge pages, the offset of its first 2 MB boundary), with room
    for `nbytes` from that offset: one extra huge page, since mmap only promises 4 KB alignment."""
    arena = mmap.mmap(-1, _round_up(nbytes, HUGE_PAGE) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena.madvise(mmap.MADV_HUGEPAGE)
    return arena, -torch.frombuffer(arena, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) on the CPU, on huge pages where they are available and the
    tensor has at least MIN_BYTES (a KV cache, which attention reads whole every step)."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if nbytes < MIN_BYTES or huge_pages_unavailable() is not None:
        return torch.zeros(shape, dtype=dtype)
    arena, offset = _huge_mapping(nbytes)
    # An anonymous mapping reads as zeros until written.
    return torch.frombuffer(arena, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)
