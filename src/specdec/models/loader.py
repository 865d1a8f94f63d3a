"""Build runners from a model name or path: the edge where user input becomes objects."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.models.cpu_linear import onednn_available, pack_linears
from specdec.models.hf import HFRunner

CPU_LINEAR_CHOICES = ("auto", "onednn", "torch")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    name: str
    path: Path
    runner: HFRunner
    tokenizer: object
    load_time_s: float


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA device")
    return torch.device(device)


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """'auto': float32 on CPU (most CPUs have no fast bf16 matmul), bfloat16 on CUDA."""
    if dtype in (None, "auto"):
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(sorted(DTYPES))}")
    return DTYPES[dtype]


def load_model(name_or_path: str, *, device: str | None = "auto", dtype: str | None = "auto",
               cpu_linear: str = "auto", progress: bool = True) -> LoadedModel:
    """An embedded model name (see `specdec models list`) or a local Hugging Face model directory.

    cpu_linear: "auto" packs linear layers for oneDNN on CPU in fp32 (see
    cpu_linear.py; about 2x cheaper verification of k+1 tokens), "torch" keeps
    stock nn.Linear, "onednn" insists on packing.
    """
    if cpu_linear not in CPU_LINEAR_CHOICES:
        raise ValueError(f"cpu_linear must be one of {', '.join(CPU_LINEAR_CHOICES)}, got {cpu_linear!r}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.models.hub import resolve_model_path

    path = resolve_model_path(name_or_path, progress=progress)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(torch_device).eval()
    can_pack = onednn_available(torch_device, torch_dtype)
    if cpu_linear == "onednn" and not can_pack:
        raise ValueError("cpu_linear='onednn' needs a CPU device, float32 and a torch built with oneDNN")
    if cpu_linear != "torch" and can_pack:
        pack_linears(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return LoadedModel(name_or_path, Path(path), HFRunner(model), tokenizer, time.perf_counter() - started)


def check_same_vocabulary(target_tokenizer: object, draft_tokenizer: object) -> None:
    """A draft must speak the target's token ids, or its guesses mean nothing.

    Raises ValueError naming how the vocabularies differ.
    """
    target_vocab = target_tokenizer.get_vocab()
    draft_vocab = draft_tokenizer.get_vocab()
    if target_vocab == draft_vocab:
        return
    differing = [tok for tok, i in target_vocab.items() if draft_vocab.get(tok) != i]
    raise ValueError(
        "the draft's tokenizer is incompatible with the target's: "
        f"{len(target_vocab)} vs {len(draft_vocab)} tokens, {len(differing)} target tokens "
        f"missing or at other ids in the draft (e.g. {differing[:3]!r}). "
        "Use a draft from the same model family (same tokenizer)."
    )
