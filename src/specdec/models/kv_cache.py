"""A preallocated KV cache where rollback is bookkeeping (gpt-fast style).

Keys and values of every layer live in one tensor [layers, B, H_kv, capacity, D].
Row b holds valid entries in slots [0, seq_lens[b]); a forward writes its T new
tokens at slots seq_lens[b] .. seq_lens[b]+T-1 and the attention mask hides
every slot at or past the end, so truncating after a rejected draft only moves
seq_lens back: the stale entries are overwritten by the next forward.
"""

from __future__ import annotations

import torch


class StaticKVCache:
    def __init__(self, *, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int,
                 max_capacity: int, dtype: torch.dtype, device: torch.device, initial_capacity: int = 2048) -> None:
        self.max_capacity = max_capacity
        self._shape = (num_layers, batch_size, num_kv_heads, 0, head_dim)
        self._dtype, self._device = dtype, device
        self.keys = self.values = None
        self._allocate(min(initial_capacity, max_capacity))
        self.seq_lens = [0] * batch_size  # host-side bookkeeping; no device sync to read it

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def _allocate(self, capacity: int) -> None:
        layers, batch, heads, _, dim = self._shape
        keys = torch.zeros(layers, batch, heads, capacity, dim, dtype=self._dtype, device=self._device)
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

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:  # [B, H_kv, T, D] each
        steps = keys.shape[2]
        for row, start in enumerate(self.seq_lens):
            self.keys[layer, row, :, start:start + steps] = keys[row]
            self.values[layer, row, :, start:start + steps] = values[row]

    def view(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:  # [B, H_kv, length, D] each
        return self.keys[layer, :, :, :length], self.values[layer, :, :, :length]

    def advance(self, steps: int) -> None:
        self.seq_lens = [n + steps for n in self.seq_lens]

    def truncate(self, seq_lens: list[int]) -> None:
        if len(seq_lens) != len(self.seq_lens):
            raise ValueError(f"truncate got {len(seq_lens)} lengths for a batch of {len(self.seq_lens)}")
        if any(new < 0 or new > old for new, old in zip(seq_lens, self.seq_lens)):
            raise ValueError(f"truncate can only shrink: cached {self.seq_lens}, asked {seq_lens}")
        self.seq_lens = list(seq_lens)

    def reset(self) -> None:
        self.seq_lens = [0] * len(self.seq_lens)
