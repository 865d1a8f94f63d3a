"""Random MLP speculators in IBM's fms-extras layout, for the tests that load one."""

import json

import torch
from safetensors.torch import save_file


def published(directory, *, emb_dim: int = 32, inner_dim: int = 24, vocab_size: int = 64, stages: int = 3,
              scale_input: bool = True, tied: bool = False, seed: int = 0):
    """A random checkpoint as IBM publishes them (inner_dim != emb_dim, ln0); tied: only the tensors
    a tied checkpoint must hold (emb.0, proj.0, proj.1, ln.0, every head), under fms' prefix."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator) * scale

    tensors = {}
    for stage in range(1 if tied else stages):
        tensors[f"emb.{stage}.weight"] = randn(vocab_size, inner_dim)
        tensors[f"ln.{stage}.weight"], tensors[f"ln.{stage}.bias"] = 1 + randn(inner_dim, scale=0.3), randn(inner_dim, scale=0.3)
    for stage in range(min(2, stages) if tied else stages):
        tensors[f"proj.{stage}.weight"] = randn(inner_dim, emb_dim if stage == 0 else inner_dim, scale=emb_dim ** -0.5)
    for stage in range(stages):
        tensors[f"head.{stage}.weight"] = randn(vocab_size, inner_dim)
    directory.mkdir(parents=True)
    save_file({f"speculator.{name}": value for name, value in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "model_type": "mlp_speculator", "architectures": ["MLPSpeculatorPreTrainedModel"], "emb_dim": emb_dim,
        "inner_dim": inner_dim, "vocab_size": vocab_size, "n_predict": stages, "tie_weights": tied,
        "scale_input": scale_input, "top_k_tokens_per_head": [1] * stages, "n_candidates": 1}))
    return directory
