"""specdec's own decoder for the Qwen2 / Llama family: static KV cache, fused projections, int8/int4 weights.

    runner = load_native_runner(path, dtype=torch.bfloat16, device=torch.device("cpu"), quantize="int8")

Loads the same safetensors a transformers model directory holds (or the
embedded models' cache). Unsupported configs raise UnsupportedModelError,
which the loader turns into a fallback to the transformers backend.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec.models.native.config import DecoderConfig, UnsupportedModelError
from specdec.models.native.model import NativeDecoder
from specdec.models.native.runner import NativeRunner

__all__ = ["DecoderConfig", "NativeDecoder", "NativeRunner", "UnsupportedModelError", "load_native_runner",
           "read_config"]


def read_config(path: Path) -> DecoderConfig:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise UnsupportedModelError(f"{path} has no config.json")
    return DecoderConfig.from_hf(json.loads(config_file.read_text()))


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{path} has no .safetensors weights (native loads safetensors only)")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    return weights


def load_native_runner(path: Path, *, dtype: torch.dtype, device: torch.device, quantize: str = "none",
                       head_rows: torch.Tensor | None = None, config: DecoderConfig | None = None,
                       head_quantize: str | None = None) -> NativeRunner:
    config = config or read_config(path)
    decoder = NativeDecoder.from_state_dict(config, read_safetensors(path), dtype=dtype, device=device,
                                            quantize=quantize, head_rows=head_rows, head_quantize=head_quantize)
    return NativeRunner(decoder, head_rows=head_rows)
