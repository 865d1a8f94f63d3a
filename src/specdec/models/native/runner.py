"""NativeRunner: the ModelRunner over NativeDecoder and a StaticKVCache."""

from __future__ import annotations

import sys

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
        # The safe path, set where the invariance probe failed (check_invariance): see _one_token_per_call.
        self.one_token_per_call = False
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
        runner = NativeRunner(self.decoder, batch_size=batch_size, head_rows=self.head_rows,
                              max_context=min(max_context or self.max_context, self.max_context),
                              initial_cache_len=initial_cache_len)
        runner.one_token_per_call = self.one_token_per_call
        return runner

    def check_invariance(self, out=None) -> bool:
        """The cheap invariance probe (native/invariance.py), once per loaded target. Where it
        fails, switch to the safe path and say so: never silently inexact."""
        from specdec.models.native.invariance import cheap_probe

        report = cheap_probe(self.decoder)
        if not report.ok:
            self.one_token_per_call = True
            worst = report.failures[0]
            print(f"specdec: batch invariance failed on this machine ({len(report.failures)} probes, e.g. "
                  f"{worst.name}: max |diff| {worst.max_abs_diff:.3g}); verifying one token per call so "
                  "output stays exact (speculation gains nothing). Run `specdec doctor` for details.",
                  file=out or sys.stderr)
        return report.ok

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T]
        *,
        last_n_logits: int | None = None,
        among_new: torch.Tensor | None = None,  # [B, T, T] bool, which new tokens each new token sees
        rows: slice | None = None,  # only these cache rows (contiguous, step 1); B = their count
        valid: torch.Tensor | None = None,  # [B, T] bool: a ragged batch's real tokens (None: all)
    ) -> ForwardOutput:
        cache = self._cache_rows(rows)
        if token_ids.shape[0] != len(cache.seq_lens):
            raise ValueError(f"this forward covers {len(cache.seq_lens)} cache rows, got {token_ids.shape[0]} rows")
        token_ids, positions = token_ids.to(self.device), positions.to(self.device)
        if self.one_token_per_call and last_n_logits is None and token_ids.numel() > 1:
            logits, hidden = self._one_token_per_call(token_ids, positions, among_new, rows)
        else:
            logits, hidden = self.decoder(token_ids, positions, cache, among_new=among_new,
                                          last_n_logits=last_n_logits, valid=valid)
        if self.head_rows is not None:
            full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
            logits = full.index_copy_(-1, self.head_rows, logits)
        return ForwardOutput(logits=logits, hidden=hidden)

    def _one_token_per_call(self, token_ids: torch.Tensor, positions: torch.Tensor,
                            among_new: torch.Tensor | None, rows: slice | None):
        """The safe path (the invariance probe failed here): every decoded position in a call
        of its own, exactly as plain decoding makes it, so verification and batching cannot
        change a logit. Prefill (last_n_logits) stays one call: plain and speculative
        decoding prefill alike. Verification then costs k+1 plain steps."""
        if among_new is not None:
            raise ValueError("tree verification is not exact on this machine (the invariance probe failed; "
                             "see `specdec doctor`): use a chain method such as draft or ngram")
        first = 0 if rows is None else rows.indices(self.batch_size)[0]
        per_row = []  # (logits [1, T, V], hidden [1, T, H]) of each row
        for row in range(token_ids.shape[0]):
            cache = self.cache.rows(first + row, first + row + 1)
            steps = [self.decoder(token_ids[row:row + 1, t:t + 1], positions[row:row + 1, t:t + 1], cache)
                     for t in range(token_ids.shape[1])]
            per_row.append((torch.cat([logits for logits, _ in steps], dim=1),
                            torch.cat([hidden for _, hidden in steps], dim=1)))
        return torch.cat([logits for logits, _ in per_row]), torch.cat([hidden for _, hidden in per_row])

    def truncate(self, seq_lens: torch.Tensor | list[int], rows: slice | None = None) -> None:
        cache = self._cache_rows(rows)
        lengths = [int(n) for n in torch.as_tensor(seq_lens).reshape(-1).tolist()]
        if len(lengths) == 1 and len(cache.seq_lens) > 1:
            lengths = lengths * len(cache.seq_lens)
        cache.truncate([min(new, old) for new, old in zip(lengths, cache.seq_lens)])

    # The cache's storage is (re)allocated inside forward, under inference mode, once a row
    # outgrows it; in-place copies into such an inference tensor are allowed only in that mode.
    @torch.inference_mode()
    def keep_path(self, start: int, offsets: list[int], row: int | None = None) -> None:
        """Tree verification's rollback of one row: keep the root at slot start and the
        accepted path's inputs (offsets from start, root excluded), packed after it.
        row: the cache row (None: the only one)."""
        if row is None and self.batch_size != 1:
            raise ValueError("name the row whose tree to keep: this runner holds several")
        self.cache.keep_path(0 if row is None else row, start, offsets)

    @torch.inference_mode()
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
