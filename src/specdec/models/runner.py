"""The ModelRunner protocol: who runs forward passes, and keeps their KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor  # [B, T, V] (T = last_n_logits when asked for fewer)
    hidden: torch.Tensor | None = None  # [B, T, H] last hidden states, when the runner offers them


class ModelRunner(Protocol):
    """A causal LM with a KV cache that only ever holds committed-or-drafted tokens.

    forward() appends token_ids at `positions` to the cache and returns logits for
    them; truncate() rolls the cache back to `seq_lens` tokens per row. Together
    they let the engine verify k drafts in one pass and forget the rejected ones.
    """

    vocab_size: int  # width of the logits
    max_context: int  # positions the model supports
    device: torch.device

    def forward(
        self,
        token_ids: torch.Tensor,  # [B, T] int64
        positions: torch.Tensor,  # [B, T] int64, contiguous from the cache length
        *,
        last_n_logits: int | None = None,  # only compute logits of the last n positions (prefill)
        rows: slice | None = None,  # which cache rows the B rows are (contiguous; None: all)
    ) -> ForwardOutput: ...

    # [B] keep this many cached tokens per row (rows: as forward's)
    def truncate(self, seq_lens: torch.Tensor | list[int], rows: slice | None = None) -> None: ...

    def reset(self) -> None: ...  # empty the cache (a new request)

    @property
    def seq_len(self) -> int: ...  # tokens currently cached
