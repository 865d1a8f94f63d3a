"""A draft head's configuration (HeadConfig): its kind, the target's shapes, what training
measured. A checkpoint keeps it in its metadata (checkpoint.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

HEAD_KINDS = ("eagle", "eagle3", "medusa", "mlp-speculator")


@dataclass(frozen=True)
class HeadConfig:
    kind: str  # "eagle" | "eagle3" | "medusa" | "mlp-speculator"
    hidden_size: int  # the target's
    target_vocab_size: int  # the target's full vocabulary (token ids below it)
    rms_norm_eps: float = 1e-6
    # EAGLE's decoder layer
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    rope_theta: float = 10000.0
    # EAGLE-3: the target layers whose input features are fused (vLLM's
    # eagle_aux_hidden_state_layer_ids), and where the first layer's residual is taken
    aux_layers: list[int] = field(default_factory=list)
    norm_before_residual: bool = True
    # Medusa
    num_medusa_heads: int = 0
    # The MLP speculator: its stages (the longest chain it drafts) and its own output matrix's rows
    mlp_stages: int = 0
    draft_vocab_size: int = 0
    # What training measured (teacher-forced, held-out): top-i accuracy of each head /
    # depth, [depth][i]; Medusa's static tree is built from these.
    accuracies: list[list[float]] = field(default_factory=list)
    target: str = ""  # the target it was trained on, for the error when used with another

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise ValueError(f"unknown head kind {self.kind!r}; choose one of {', '.join(HEAD_KINDS)}")
        if self.kind == "eagle3" and not self.aux_layers:
            raise ValueError("an eagle3 head needs the target layers it reads (aux_layers)")
        if self.kind == "mlp-speculator" and (self.mlp_stages < 1 or self.draft_vocab_size < 1):
            raise ValueError("an mlp-speculator head needs stages >= 1 and its vocabulary's size")

    @staticmethod
    def for_target(kind: str, decoder_config, *, num_medusa_heads: int = 4, intermediate_size: int | None = None,
                   target: str = "", aux_layers: list[int] | None = None, mlp_stages: int = 4,
                   draft_vocab_size: int = 0) -> HeadConfig:
        """EAGLE's layer copies the target's layer shape (its paper's choice); Medusa needs only H.
        EAGLE-3 reads layers 2, L/2 and L-3 unless told otherwise (vLLM's default)."""
        layers = decoder_config.num_layers
        if kind == "eagle3" and aux_layers is None:
            aux_layers = [2, layers // 2, layers - 3]
        return HeadConfig(kind=kind, hidden_size=decoder_config.hidden_size,
                          target_vocab_size=decoder_config.vocab_size, rms_norm_eps=decoder_config.rms_norm_eps,
                          num_heads=decoder_config.num_heads, num_kv_heads=decoder_config.num_kv_heads,
                          head_dim=decoder_config.head_dim,
                          intermediate_size=intermediate_size or decoder_config.intermediate_size,
                          rope_theta=decoder_config.rope_theta,
                          num_medusa_heads=num_medusa_heads if kind == "medusa" else 0, target=target,
                          mlp_stages=mlp_stages if kind == "mlp-speculator" else 0,
                          draft_vocab_size=draft_vocab_size if kind == "mlp-speculator" else 0,
                          aux_layers=list(aux_layers or []))
