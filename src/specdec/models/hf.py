"""The reference ModelRunner over any transformers AutoModelForCausalLM.

It keeps a transformers DynamicCache and rolls it back with crop(), so any
architecture transformers supports works, on CPU or CUDA. It serves one
sequence at a time (ragged per-row rollback needs the native runner's static cache).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from specdec.models.runner import ForwardOutput


class HFRunner:
    batch_size = 1  # cache rows

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.vocab_size = model.get_output_embeddings().out_features
        self.max_context = int(getattr(model.config, "max_position_embeddings", None) or 1 << 30)
        self._cache = DynamicCache()

    @property
    def seq_len(self) -> int:
        return self._cache.get_seq_length()

    def row_lengths(self, rows: slice | None = None) -> list[int]:
        _check_one_row(rows)
        return [self.seq_len]

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,  # [1, T]
        positions: torch.Tensor,  # [1, T]
        *,
        last_n_logits: int | None = None,
        rows: slice | None = None,  # the engines' row selector: here only the one row there is
    ) -> ForwardOutput:
        _check_one_row(rows)
        if token_ids.shape[0] != 1:
            raise ValueError("HFRunner serves one sequence at a time (batch size 1)")
        out = self.model(
            input_ids=token_ids.to(self.device),
            position_ids=positions.to(self.device),
            past_key_values=self._cache,
            use_cache=True,
            # Skips the V-wide lm_head on prefill positions nobody reads.
            logits_to_keep=last_n_logits or 0,
        )
        return ForwardOutput(logits=out.logits)

    def truncate(self, seq_lens: torch.Tensor | list[int], rows: slice | None = None) -> None:
        _check_one_row(rows)
        remove = self.seq_len - int(torch.as_tensor(seq_lens).reshape(-1)[0])
        if remove > 0:
            # A negative argument means "drop this many" in transformers 4.x and 5.x alike.
            self._cache.crop(-remove)

    def reset(self) -> None:
        self._cache = DynamicCache()


def _check_one_row(rows: slice | None) -> None:
    if rows is not None and (rows.start or 0, rows.stop) != (0, 1):
        raise ValueError("HFRunner serves one sequence at a time (batch size 1); use the native backend for more")
