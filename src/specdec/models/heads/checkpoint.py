"""A head's checkpoint: its trainable weights as safetensors, with its config, vocabulary and
training state as metadata (save_head, load_head), and the module a config names (build_head)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from specdec.models.atomic_files import atomic_path, write_safetensors
from specdec.models.heads.config import HeadConfig
from specdec.models.heads.eagle import EagleHead
from specdec.models.heads.eagle3 import Eagle3Head
from specdec.models.heads.medusa import MedusaHeads
from specdec.models.heads.mlp_speculator import MLPSpeculator
from specdec.models.native.linear import make_linear


def quantize_head(module: nn.Module, quantize: str) -> None:
    """A loaded head's projections in the target's weight format, for drafting on a CPU (each
    draft step reads them all; in fp32 an EAGLE-3 layer is ~116 MB). Drafts only: exactness
    is verification's."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.ModuleList):  # the MLP speculator's stages
            quantize_head(child, quantize)
        elif isinstance(child, nn.Linear):
            setattr(module, name, make_linear(child.weight.detach(), None if child.bias is None else
                                              child.bias.detach(), dtype=child.weight.dtype,
                                              device=child.weight.device, quantize=quantize))


def build_head(config: HeadConfig) -> nn.Module:
    if config.kind == "eagle3":
        return Eagle3Head(config)
    if config.kind == "mlp-speculator":
        return MLPSpeculator(config)
    return EagleHead(config) if config.kind == "eagle" else MedusaHeads(config)


def write_head_file(path: Path, head: nn.Module, config: HeadConfig, vocab_ids: torch.Tensor,
                    extra: dict | None = None) -> None:
    """Write the checkpoint at exactly `path`, not atomically: for callers that rename it into place
    themselves (save_head; training/checkpoints.py, which writes a head and its optimizer as one unit)."""
    tensors = {name: value.detach().contiguous().cpu() for name, value in head.state_dict().items()}
    tensors["vocab_ids"] = vocab_ids.to(torch.int64).cpu().contiguous()
    metadata = {"specdec_head": json.dumps(asdict(config)), "extra": json.dumps(extra or {})}
    write_safetensors(path, tensors, metadata)


def save_head(path: Path, head: nn.Module, config: HeadConfig, vocab_ids: torch.Tensor,
              extra: dict | None = None) -> None:
    """The trainable weights as safetensors; config, vocabulary and `extra` (training state) as metadata.

    Written under a temporary name, fsynced and renamed (models/atomic_files.py): a kill or a power cut
    leaves the old checkpoint or the new one under `path`, never a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as partial:
        write_head_file(partial, head, config, vocab_ids, extra)


@dataclass
class LoadedHead:
    config: HeadConfig
    module: nn.Module
    vocab_ids: torch.Tensor  # [N]
    extra: dict


def load_head(path: Path | str, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
              ) -> LoadedHead:
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no head checkpoint at {path}")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        tensors = load_file(str(path))
    except Exception as error:  # safetensors raises its own SafetensorError (and OSError) on a cut file
        raise ValueError(f"{path} is not a readable safetensors file (truncated or damaged?): {error}") from None
    if "specdec_head" not in metadata:
        raise ValueError(f"{path} is not a specdec head checkpoint (no 'specdec_head' metadata)")
    config = HeadConfig(**json.loads(metadata["specdec_head"]))
    vocab_ids = tensors.pop("vocab_ids")
    module = build_head(config)
    module.load_state_dict(tensors, strict=False)
    missing = set(module.state_dict()) - set(tensors)
    if missing:
        raise ValueError(f"{path} lacks weights {sorted(missing)[:3]}...")
    module.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return LoadedHead(config, module, vocab_ids, json.loads(metadata.get("extra", "{}")))
