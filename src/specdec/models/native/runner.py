"""NativeRunner: the ModelRunner over NativeDecoder and a StaticKVCache."""

from __future__ import annotations

import torch

from specdec.models.kv_cache import StaticKVCache
from specdec.models.native.attention import KEY_BLOCK
from specdec.models.native.model import NativeDecoder
from specdec.models.runner import ForwardOutput


class NativeRunner:
    """Any batch size; rows may hold different lengths (per-row truncate).

    head_rows [N] (optional): the decoder's head scores only these target ids
    (a reduced-vocabulary draft, as in EAGLE-3, Li et al. 2025, arXiv 2503.01840);
    the N logits are scattered back into a full-width row with -inf elsewhere,
    so callers see the usual [B, T, V] and never sample an unscored token.
    """

    def __init__(self, decoder: NativeDecoder, *, batch_size: int = 1,
                 head_rows: torch.Tensor | None = None, max_context: int | None = None,
                 initial_cache_len: int = 2048) -> None:
        config = decoder.config
        self.decoder = decoder
        self.device = decoder.device
        self.vocab_size = config.vocab_size
        self.max_context = max_context or config.max_position_embeddings
        self.head_rows = None if head_rows is None else head_rows.to(self.device)
        self.cache = StaticKVCache(num_layers=config.num_layers, batch_size=batch_size,
                                   num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                                   max_capacity=self.max_context, dtype=decoder.dtype, device=self.device,
                                   initial_capacity=initial_cache_len, capacity_multiple=KEY_BLOCK)

    @property
    def seq_len(self) -> int:
        return max(self.cache.seq_lens)

    @property
    def batch_size(self) -> int:
        return len(self.cache.seq_lens)

    def row_lengths(self, rows: slice | None = None) -> list[int]:
        """Cached tokens of each row (of rows, a contiguous block; default all)."""
        return self.cache.seq_lens[rows or slice(None)]

    def with_batch_size(self, batch_size: int, *, max_context: int | None = None,
                        initial_cache_len: int = 512) -> NativeRunner:
        """A runner over the same weights with its own cache of batch_size rows (a server's slots)."""
        return NativeRunner(self.decoder, batch_size=batch_size, head_rows=self.head_rows,
                            max_context=min(max_context or self.max_context, self.max_context),
                            initial_cache_len=initial_cache_len)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T]
        *,
        last_n_logits: int | None = None,
        among_new: torch.Tensor | None = None,  # [B, T, T] bool, which new tokens each new token sees
        rows: slice | None = None,  # only these cache rows (contiguous, step 1); B = their count
    ) -> ForwardOutput:
        cache = self._cache_rows(rows)
        if token_ids.shape[0] != len(cache.seq_lens):
            raise ValueError(f"this forward covers {len(cache.seq_lens)} cache rows, got {token_ids.shape[0]} rows")
        logits, hidden = self.decoder(token_ids.to(self.device), positions.to(self.device), cache,
                                      among_new=among_new, last_n_logits=last_n_logits)
        if self.head_rows is not None:
            full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
            logits = full.index_copy_(-1, self.head_rows, logits)
        return ForwardOutput(logits=logits, hidden=hidden)

    def truncate(self, seq_lens: torch.Tensor | list[int], rows: slice | None = None) -> None:
        cache = self._cache_rows(rows)
        lengths = [int(n) for n in torch.as_tensor(seq_lens).reshape(-1).tolist()]
        if len(lengths) == 1 and len(cache.seq_lens) > 1:
            lengths = lengths * len(cache.seq_lens)
        cache.truncate([min(new, old) for new, old in zip(lengths, cache.seq_lens)])

    def keep_path(self, start: int, offsets: list[int]) -> None:
        """Tree verification's rollback (one row): keep the root at slot start and the
        accepted path's inputs (offsets from start, root excluded), packed after it."""
        if self.batch_size != 1:
            raise ValueError("tree verification runs one request at a time")
        self.cache.keep_path(0, start, offsets)

    def move_row(self, source: int, destination: int) -> None:
        self.cache.move_row(source, destination)

    def _cache_rows(self, rows: slice | None):
        if rows is None:
            return self.cache
        start, stop, step = rows.indices(self.batch_size)
        if step != 1:
            raise ValueError("rows must be a contiguous block")
        return self.cache.rows(start, stop)

    def reset(self) -> None:
        self.cache.reset()
