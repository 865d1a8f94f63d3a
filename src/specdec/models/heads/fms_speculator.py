"""An MLP speculator published in IBM's fms-extras layout (the ibm-ai-platform and ibm-granite
"accelerator" checkpoints vLLM's MLPSpeculator reads), or one `specdec export-head` wrote.

The layout (mlp_speculator_export.py lists its config fields and tensors): per stage i its own token
embedding emb.i [V, inner], projection proj.i [inner, emb_dim (i = 0) or inner], norm ln.i and head
head.i [V, inner] over the full vocabulary. The equations are Wertheimer et al.'s (arXiv 2404.19124),
as mlp_speculator.py gives them, with two options of the published checkpoints:
  scale_input: the target's feature is first RMS-normalised (no scale, no shift) and divided by
               sqrt(2) (fms-extras' ln0);
  tie_weights: one embedding, one norm and one projection after the first, shared by the stages
               (the checkpoint may then name only stage 0's, and proj.1).
A directory with `config.json` (model_type "mlp_speculator") and `*.safetensors` weights is one;
`--method mlp-speculator --head DIR` drafts with it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from specdec.models.heads.checkpoint import LoadedHead
from specdec.models.heads.config import HeadConfig
from specdec.models.heads.mlp_speculator import SpeculatorNorm


class FMSSpeculator(nn.Module):
    """stages (the config's n_predict) stages, each with its own emb, proj, ln and head (shared
    modules where the checkpoint ties them)."""

    def __init__(self, emb_dim: int, inner_dim: int, vocab_size: int, stages: int, *, scale_input: bool = False,
                 tie_weights: bool = False) -> None:
        super().__init__()
        self.stages, self.vocab_size, self.scale_input = stages, vocab_size, scale_input

        def per_stage(make, first=None) -> nn.ModuleList:
            shared = make() if tie_weights else None
            modules = [first() if first is not None and i == 0 else shared if shared is not None else make()
                       for i in range(stages)]
            return nn.ModuleList(modules)

        self.emb = per_stage(lambda: nn.Embedding(vocab_size, inner_dim))
        self.proj = per_stage(lambda: nn.Linear(inner_dim, inner_dim, bias=False),
                              first=lambda: nn.Linear(emb_dim, inner_dim, bias=False))
        self.ln = per_stage(lambda: SpeculatorNorm(inner_dim))
        self.head = nn.ModuleList(nn.Linear(inner_dim, vocab_size, bias=False) for _ in range(stages))
        state_weight = 0.5 ** (0.5 / stages)
        self.token_scale = math.sqrt((1 - state_weight ** 2) * (inner_dim / 2)) / state_weight

    def start(self, feature: torch.Tensor) -> torch.Tensor:
        """s_0 from the target's final-norm feature f_j [..., emb_dim]."""
        if not self.scale_input:
            return feature
        normed = feature * torch.rsqrt(feature.pow(2).mean(-1, keepdim=True) + 1e-6)
        return normed / math.sqrt(2)

    def stage(self, index: int, state: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """s_{i+1} from s_i [..., in] and the token before the one stage i drafts ([...] ids)."""
        mixed = self.proj[index](state) + self.token_scale * self.emb[index](token_ids).to(state.dtype)
        return nn.functional.gelu(self.ln[index](mixed))

    def logits(self, index: int, state: torch.Tensor) -> torch.Tensor:
        """Stage index's scores over its vocabulary (the target's ids below vocab_size)."""
        return self.head[index](state)


def is_fms_speculator(directory: Path) -> bool:
    config = directory / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("model_type") == "mlp_speculator"
    except (OSError, ValueError, AttributeError):
        return False


def load_fms_speculator(directory: Path | str, hidden_size: int, target_vocab_size: int, *,
                        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> LoadedHead:
    """The speculator in `directory`, checked against the target it will draft for (its hidden size
    and vocabulary); clear errors where it does not fit or a tensor is missing."""
    from safetensors.torch import load_file

    directory = Path(directory)
    document = json.loads((directory / "config.json").read_text())
    if document.get("model_type") != "mlp_speculator":
        raise ValueError(f"{directory} holds a {document.get('model_type')!r} model, not an mlp_speculator")
    emb_dim, vocab_size, stages = (int(document[name]) for name in ("emb_dim", "vocab_size", "n_predict"))
    inner_dim = int(document.get("inner_dim") or emb_dim)
    if emb_dim != hidden_size or vocab_size > target_vocab_size:
        raise ValueError(f"{directory} drafts for a target with hidden size {emb_dim} and {vocab_size} tokens; "
                         f"this target has {hidden_size} and {target_vocab_size}")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has no .safetensors weights (convert pytorch_model.bin first)")
    weights = {name.removeprefix("speculator."): tensor for file in files for name, tensor in load_file(str(file)).items()}
    tied = bool(document.get("tie_weights"))
    module = FMSSpeculator(emb_dim, inner_dim, vocab_size, stages, scale_input=bool(document.get("scale_input")),
                           tie_weights=tied)
    state = {}
    for name in module.state_dict():
        found = _stored_name(name, weights, tied)
        if found is None:
            raise ValueError(f"{directory} lacks {name} (an mlp_speculator of {stages} stages"
                             f"{', tied' if tied else ''})")
        state[name] = weights[found]
    module.load_state_dict(state)
    module.to(device=device, dtype=dtype).eval().requires_grad_(False)
    config = HeadConfig(kind="mlp-speculator", hidden_size=hidden_size, target_vocab_size=target_vocab_size,
                        mlp_stages=stages, draft_vocab_size=vocab_size, target=str(directory))
    return LoadedHead(config, module, torch.arange(vocab_size), {"layout": "fms-extras"})


def _stored_name(name: str, weights: dict, tied: bool) -> str | None:
    """The checkpoint's tensor for the module's `name` (kind.stage.param); tied checkpoints may store
    only stage 0's embedding and norm and proj.1."""
    if name in weights:
        return name
    kind, stage, param = name.split(".", 2)
    if not tied or kind == "head":
        return None
    shared = f"{kind}.{1 if kind == 'proj' and int(stage) > 0 else 0}.{param}"
    return shared if shared in weights else None
