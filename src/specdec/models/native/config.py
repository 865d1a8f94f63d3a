"""Which Hugging Face configs the native decoder implements, read into one flat dataclass.

The Qwen2 and Llama families (and the many models built on them) share one
block: RMSNorm -> attention with rotary positions and grouped-query heads ->
RMSNorm -> SwiGLU MLP, pre-norm residuals. They differ only in whether q/k/v
carry a bias (Qwen2 does), the rope theta, and whether the head is tied to
the embedding. Anything else (rope scaling, sliding windows, other
activations) is refused with a reason, and the loader falls back to transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")


class UnsupportedModelError(ValueError):
    """The native decoder does not implement this config; the message says why."""


@dataclass(frozen=True)
class DecoderConfig:
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
    qkv_bias: bool  # Qwen2: q, k and v projections have a bias; o_proj never does

    @classmethod
    def from_hf(cls, config: dict) -> DecoderConfig:
        """From a config.json dict (transformers 4.x or 5.x spelling); raises UnsupportedModelError."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not implemented natively (only {', '.join(SUPPORTED_MODEL_TYPES)})")
        if config.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {config['hidden_act']!r} (only silu)")
        rope = config.get("rope_parameters") or {}
        scaling = config.get("rope_scaling") or {}
        for rope_type in (rope.get("rope_type"), scaling.get("rope_type"), scaling.get("type")):
            if rope_type not in (None, "default"):
                raise UnsupportedModelError(f"rope scaling {rope_type!r} (only plain RoPE)")
        if config.get("use_sliding_window"):
            raise UnsupportedModelError("sliding-window attention")
        if config.get("mlp_bias"):
            raise UnsupportedModelError("MLP biases")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        qkv_bias = model_type == "qwen2" or bool(config.get("attention_bias", False))
        if model_type == "llama" and config.get("attention_bias"):
            raise UnsupportedModelError("Llama attention biases (o_proj would carry one too)")
        return cls(
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            rope_theta=float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
        )
