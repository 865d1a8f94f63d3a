"""A preallocated KV cache where rollback is bookkeeping (gpt-fast style).

Keys and values of every layer live in one tensor [layers, B, H_kv, capacity, D].
Row b holds valid entries in slots [0, seq_lens[b]); a forward writes its T new
tokens at slots seq_lens[b] .. seq_lens[b]+T-1 and the attention mask hides
every slot at or past the end, so truncating after a rejected draft only moves
seq_lens back: the stale entries are overwritten by the next forward.

A server keeps one row per running request: rows(start, stop) is a view on a
contiguous block of rows (a forward over only the running requests, or a
prefill of one newcomer), and move_row() packs the running rows together when
one finishes, so that block stays contiguous.
"""

from __future__ import annotations

import torch

from specdec.models import huge_pages


class StaticKVCache:
    def __init__(self, *, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int,
                 max_capacity: int, dtype: torch.dtype, device: torch.device, initial_capacity: int = 2048,
                 capacity_multiple: int = 1) -> None:
        self.max_capacity = max_capacity
        self.capacity_multiple = capacity_multiple  # the capacity is kept a multiple of this (whole key blocks)
        self._shape = (num_layers, batch_size, num_kv_heads, 0, head_dim)
        self._dtype, self._device = dtype, device
        self.keys = self.values = None
        self._allocate(min(initial_capacity, max_capacity))
        self.seq_lens = [0] * batch_size  # host-side bookkeeping; no device sync to read it
        self._all = CacheRows(self, 0, batch_size)

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def _allocate(self, capacity: int) -> None:
        layers, batch, heads, _, dim = self._shape
        capacity = -(-capacity // self.capacity_multiple) * self.capacity_multiple
        shape = (layers, batch, heads, capacity, dim)
        if self._device.type == "cpu":  # attention reads the whole cache every step: huge pages fetch it faster
            keys, values = huge_pages.zeros(shape, self._dtype), huge_pages.zeros(shape, self._dtype)
        else:
            keys = torch.zeros(shape, dtype=self._dtype, device=self._device)
            values = torch.zeros_like(keys)
        if self.keys is not None:  # growing: keep what is there
            old = self.keys.shape[3]
            keys[:, :, :, :old] = self.keys
            values[:, :, :, :old] = self.values
        self.keys, self.values = keys, values

    def reserve(self, length: int) -> None:
        """Make room for `length` slots per row, doubling the capacity (rarely) up to max_capacity."""
        if length > self.max_capacity:
            raise ValueError(f"{length} tokens do not fit the model's context of {self.max_capacity} tokens")
        if length > self.capacity:
            capacity = self.capacity
            while capacity < length:
                capacity *= 2
            self._allocate(min(capacity, self.max_capacity))

    # Whole-cache access is the view over every row.
    def storage(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self._all.storage()

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:  # [B, H_kv, T, D] each
        self._all.write(layer, keys, values)

    def view(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:  # [B, H_kv, length, D] each
        return self._all.view(layer, length)

    def advance(self, steps: int) -> None:
        self._all.advance(steps)

    def truncate(self, seq_lens: list[int]) -> None:
        self._all.truncate(seq_lens)

    def reset(self) -> None:
        self.seq_lens = [0] * len(self.seq_lens)

    def rows(self, start: int, stop: int) -> CacheRows:
        if not 0 <= start < stop <= len(self.seq_lens):
            raise ValueError(f"rows {start}:{stop} are outside a cache of {len(self.seq_lens)} rows")
        return CacheRows(self, start, stop)

    def keep_path(self, row: int, start: int, offsets: list[int]) -> None:
        """After a tree forward wrote its inputs at slots start, start+1, ...: keep slot start
        (the root) and the slots start + offsets (the accepted path, in order) packed
        right after it, and drop every other draft. The kept keys were computed at
        their tree positions (prefix + depth), which are exactly their positions on
        the path, so moving them is all it takes."""
        if offsets:
            source = torch.tensor([start + offset for offset in offsets], device=self.keys.device)
            destination = slice(start + 1, start + 1 + len(offsets))
            self.keys[:, row, :, destination] = self.keys[:, row, :, source]  # index_select copies first
            self.values[:, row, :, destination] = self.values[:, row, :, source]
        self.seq_lens[row] = start + 1 + len(offsets)

    def move_row(self, source: int, destination: int) -> None:
        """Copy row source's entries into row destination (whose old entries are dropped)."""
        length = self.seq_lens[source]
        self.keys[:, destination, :, :length] = self.keys[:, source, :, :length]
        self.values[:, destination, :, :length] = self.values[:, source, :, :length]
        self.seq_lens[destination] = length

    def swap_rows(self, first: int, second: int) -> None:
        """Exchange two rows' entries (a packing that keeps the row it frees, for prompt caching)."""
        length = max(self.seq_lens[first], self.seq_lens[second])
        for storage in (self.keys, self.values):
            saved = storage[:, first, :, :length].clone()
            storage[:, first, :, :length] = storage[:, second, :, :length]
            storage[:, second, :, :length] = saved
        self.seq_lens[first], self.seq_lens[second] = self.seq_lens[second], self.seq_lens[first]


class CacheRows:
    """Rows [start, stop) of a StaticKVCache, with the same interface: a forward over
    them reads and writes only those rows. Storage and bookkeeping stay the parent's
    (read at every call, so a growing parent is seen)."""

    def __init__(self, parent: StaticKVCache, start: int, stop: int) -> None:
        self.parent, self.start, self.stop = parent, start, stop

    @property
    def seq_lens(self) -> list[int]:
        return self.parent.seq_lens[self.start:self.stop]

    def reserve(self, length: int) -> None:
        self.parent.reserve(length)

    def storage(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The parent's whole keys and values [L, rows, H_kv, S, D] and this view's first row (for
        kernels/block.cpp, which writes and reads them as write and view do)."""
        return self.parent.keys, self.parent.values, self.start

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:  # [b, H_kv, T, D] each
        steps = keys.shape[2]
        for offset, start in enumerate(self.seq_lens):
            row = self.start + offset
            self.parent.keys[layer, row, :, start:start + steps] = keys[offset]
            self.parent.values[layer, row, :, start:start + steps] = values[offset]

    def view(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:  # [b, H_kv, length, D] each
        rows = slice(self.start, self.stop)
        return self.parent.keys[layer, rows, :, :length], self.parent.values[layer, rows, :, :length]

    def advance(self, steps: int) -> None:
        self._set_lengths([n + steps for n in self.seq_lens])

    def truncate(self, seq_lens: list[int]) -> None:
        if len(seq_lens) != self.stop - self.start:
            raise ValueError(f"truncate got {len(seq_lens)} lengths for a batch of {self.stop - self.start}")
        if any(new < 0 or new > old for new, old in zip(seq_lens, self.seq_lens)):
            raise ValueError(f"truncate can only shrink: cached {self.seq_lens}, asked {seq_lens}")
        self._set_lengths(seq_lens)

    def _set_lengths(self, seq_lens: list[int]) -> None:
        self.parent.seq_lens[self.start:self.stop] = list(seq_lens)


class SlotRows:
    """Rows [start, stop) of a StaticKVCache whose new keys and values go to the slots of a device
    tensor, slots [rows, T], instead of after host-side lengths: CacheRows.write slices at Python
    ints, which a recorded CUDA graph would freeze (models/native/captured.py). Same values, same
    places; lengths stay the caller's to move."""

    def __init__(self, parent: StaticKVCache, start: int, stop: int, slots: torch.Tensor) -> None:
        self.parent, self.start, self.stop, self.slots = parent, start, stop, slots

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:  # [b, H_kv, T, D] each
        rows = torch.arange(self.stop - self.start, device=self.slots.device)[:, None]  # [b, 1] against [b, T]
        # The [b, S, H_kv, D] view of the rows: one index_put per tensor writes every row's tokens in place.
        self.parent.keys[layer, self.start:self.stop].transpose(1, 2)[rows, self.slots] = keys.transpose(1, 2)
        self.parent.values[layer, self.start:self.stop].transpose(1, 2)[rows, self.slots] = values.transpose(1, 2)

    def view(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:  # [b, H_kv, length, D] each
        rows = slice(self.start, self.stop)
        return self.parent.keys[layer, rows, :, :length], self.parent.values[layer, rows, :, :length]
