"""The reference ModelRunner over any transformers AutoModelForCausalLM.

It keeps a transformers DynamicCache and rolls it back with crop(), so any
architecture transformers supports works, on CPU or CUDA. It serves one
sequence at a time (ragged per-row rollback needs the native runner's static cache).
Its `decoder` (HFFeatures) hands the draft heads (models/heads/) the target's
hidden states and vocabulary as the native decoder does, so EAGLE, EAGLE-3 and
Medusa heads train and draft on any architecture transformers runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from specdec.models.runner import ForwardOutput


@dataclass(frozen=True)
class FeatureShape:
    """What a head reads of its target's shape, under the native DecoderConfig's names. A head's own
    decoder layer is Llama-shaped whatever the target's (models/heads/layers.py): for a target with no
    RoPE or RMSNorm, the head takes the usual 10,000 and 1e-6."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def of(cls, model: PreTrainedModel) -> FeatureShape:
        config = model.config.get_text_config()
        hidden = int(config.hidden_size)
        heads = int(config.num_attention_heads)
        rope = getattr(config, "rope_parameters", None) or {}
        return cls(model_type=str(config.model_type), vocab_size=model.get_output_embeddings().out_features,
                   hidden_size=hidden,
                   intermediate_size=int(getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
                                         or 4 * hidden),
                   num_layers=int(config.num_hidden_layers), num_heads=heads,
                   num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
                   rope_theta=float(rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10_000.0),
                   rms_norm_eps=float(getattr(config, "rms_norm_eps", None) or 1e-6),
                   max_position_embeddings=int(getattr(config, "max_position_embeddings", None)
                                               or getattr(config, "n_positions", None) or 1 << 30),
                   tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)))


class HFFeatures:
    """The native decoder's face towards the heads (config, embedding, dtype, capture_layers) over a
    transformers model: forward's hidden is hidden_states[i] for each captured layer i, the residual
    stream entering layer i (i = the number of layers: the final norm's output), concatenated."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.config = FeatureShape.of(model)
        self.embedding = model.get_input_embeddings().weight
        self.dtype = self.embedding.dtype
        self.feature_layers: tuple[int, ...] | None = None  # None: forward returns no hidden states

    def capture_layers(self, layers: tuple[int, ...] | list[int]) -> None:
        """As NativeDecoder.capture_layers: () the final features, else those layers' inputs."""
        for layer in layers:
            if not 0 <= layer <= self.config.num_layers:
                raise ValueError(f"feature layer {layer} is outside the target's {self.config.num_layers} layers "
                                 f"(0..{self.config.num_layers - 1}, or {self.config.num_layers} for the final "
                                 "features)")
        self.feature_layers = tuple(layers)

    def hidden(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        layers = self.feature_layers or (self.config.num_layers,)
        return torch.cat([hidden_states[layer] for layer in layers], dim=-1)


class HFRunner:
    batch_size = 1  # cache rows

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.vocab_size = model.get_output_embeddings().out_features
        self.max_context = int(getattr(model.config, "max_position_embeddings", None) or 1 << 30)
        self.decoder = HFFeatures(model)
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
        among_new: torch.Tensor | None = None,  # a tree's mask: refused, this runner verifies chains
    ) -> ForwardOutput:
        _check_one_row(rows)
        if among_new is not None:
            raise ValueError("the transformers backend verifies chains only: trees and lookahead windows "
                             "(eagle-tree, eagle3-tree, medusa, lookahead, --copy-trees) need the native "
                             "backend (Qwen2 / Llama); eagle and eagle3 draft chains on any model")
        if token_ids.shape[0] != 1:
            raise ValueError("HFRunner serves one sequence at a time (batch size 1)")
        features = self.decoder.feature_layers is not None
        out = self.model(
            input_ids=token_ids.to(self.device),
            position_ids=positions.to(self.device),
            past_key_values=self._cache,
            use_cache=True,
            # Skips the V-wide lm_head on prefill positions nobody reads.
            logits_to_keep=last_n_logits or 0,
            output_hidden_states=features,
        )
        return ForwardOutput(logits=out.logits, hidden=self.decoder.hidden(out.hidden_states) if features else None)

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
