"""The MLP speculator in the layout of IBM's fms-extras checkpoints, the one vLLM's MLPSpeculator reads.

A directory holds `config.json` and `model.safetensors`:

config.json (vLLM's MLPSpeculatorConfig, fms-extras' MLPSpeculatorConfig):
  model_type "mlp_speculator"; architectures ["MLPSpeculatorPreTrainedModel"]
  vocab_size     the target's vocabulary
  emb_dim        the target's hidden size (the state the first stage reads)
  inner_dim      the stages' state width
  n_predict      stages; top_k_tokens_per_head one entry per stage; n_candidates
  tie_weights    false: every stage has its own tensors; scale_input false: f_j enters as it is
model.safetensors, per stage i:
  emb.i.weight [V, inner]; proj.i.weight [inner, emb_dim (i = 0) or inner]; ln.i.weight, ln.i.bias
  [inner]; head.i.weight [V, inner].

specdec's head shares the target's embedding (written into every emb.i) and one output matrix over
its reduced vocabulary (written into every head.i, zeros in the rows of tokens outside it: those
score 0, below the chosen token wherever its logit is positive). vLLM 0.32 parses the config, but its
engine does not run the method: the model is commented out of its registry until V1 supports it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec.models.atomic_files import atomic_path, write_safetensors
from specdec.models.heads.checkpoint import LoadedHead
from specdec.models.heads.layers import FrozenVocabulary


def export_mlp_speculator(head: LoadedHead, vocab: FrozenVocabulary, out_dir: Path | str, *,
                          dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a trained mlp-speculator head (vocab: the target's embedding, the head's output rows)."""
    config = head.config
    if config.kind != "mlp-speculator":
        raise ValueError(f"only mlp-speculator heads have the mlp_speculator layout; this one is {config.kind}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    module = head.module
    full_output = torch.zeros(config.target_vocab_size, config.hidden_size, dtype=dtype)
    full_output[vocab.vocab_ids.cpu()] = vocab.output_weight.detach().to(dtype).cpu()
    embedding = vocab.embedding.detach().to(dtype).cpu()
    tensors = {}
    for stage in range(config.mlp_stages):  # each its own copy: safetensors stores no shared tensors
        tensors[f"emb.{stage}.weight"] = embedding.clone()
        tensors[f"proj.{stage}.weight"] = module.proj[stage].weight.detach().to(dtype).cpu().contiguous()
        tensors[f"ln.{stage}.weight"] = module.ln[stage].weight.detach().to(dtype).cpu().contiguous()
        tensors[f"ln.{stage}.bias"] = module.ln[stage].bias.detach().to(dtype).cpu().contiguous()
        tensors[f"head.{stage}.weight"] = full_output.clone()
    document = {
        "architectures": ["MLPSpeculatorPreTrainedModel"],
        "model_type": "mlp_speculator",
        "vocab_size": config.target_vocab_size,
        "emb_dim": config.hidden_size,
        "inner_dim": config.hidden_size,
        "n_predict": config.mlp_stages,
        "top_k_tokens_per_head": [1] * config.mlp_stages,
        "n_candidates": 1,
        "tie_weights": False,
        "scale_input": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "specdec": {"trained_on": config.target, "heldout_accuracies": config.accuracies,
                    "draft_vocab_size": len(vocab.vocab_ids)},
    }
    # config.json last: a directory with one is a finished export.
    with atomic_path(out / "model.safetensors") as partial:
        write_safetensors(partial, tensors, {"format": "pt"})
    with atomic_path(out / "config.json") as partial:
        partial.write_text(json.dumps(document, indent=2) + "\n")
    return out
