"""Build runners from a model name or path: the edge where user input becomes objects."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.models.cpu_linear import onednn_available, pack_linears
from specdec.models.native.linear import QUANTIZATIONS
from specdec.models.runner import ModelRunner

CPU_LINEAR_CHOICES = ("auto", "onednn", "torch")
BACKENDS = ("auto", "native", "hf")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    name: str
    path: Path
    runner: ModelRunner
    tokenizer: object
    load_time_s: float
    backend: str = "hf"  # which runner serves it: "native" or "hf"
    dtype: torch.dtype = torch.float32
    quantize: str = "none"
    eos_token_ids: frozenset[int] = frozenset()  # the tokenizer's and generation_config's
    head_vocab: int | None = None  # rows of a reduced output head
    bridge: object = None  # a draft with another tokenizer: its VocabularyBridge to the target's (factory)

    def describe(self) -> str:
        weights = "" if self.quantize == "none" else f", {self.quantize} weights"
        head = "" if self.head_vocab is None else f", {self.head_vocab}-token head"
        return f"{self.name} [{self.backend}, {str(self.dtype).removeprefix('torch.')}{weights}{head}]"


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA device")
    return torch.device(device)


def cpu_has_fast_bf16() -> bool:
    """True where oneDNN runs bf16 matmuls (AVX-512 and newer, within ONEDNN_MAX_CPU_ISA)."""
    from specdec.models.cpu_features import onednn_bf16_usable

    return onednn_bf16_usable()


def resolve_dtype(dtype: str | None, device: torch.device, backend: str = "hf") -> torch.dtype:
    """'auto': bfloat16 on CUDA; on CPU bfloat16 for the native backend where the CPU
    has bf16 instructions, else float32 (transformers' CPU bf16 path is slower than fp32)."""
    if dtype in (None, "auto"):
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if backend == "native" and cpu_has_fast_bf16() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(sorted(DTYPES))}")
    return DTYPES[dtype]


def load_model(name_or_path: str, *, device: str | None = "auto", dtype: str | None = "auto",
               backend: str = "auto", quantize: str = "none", cpu_linear: str = "auto",
               head_vocab: int | None = None, progress: bool = True, role: str = "target",
               probe: bool | None = None) -> LoadedModel:
    """An embedded model name (see `specdec models list`) or a local Hugging Face model directory.

    backend: "native" (specdec's own Qwen2/Llama decoder, models/native/),
    "hf" (any transformers model), "auto" = native where the architecture is
    supported, else hf with a message on stderr.
    quantize: "int8" or "int4" weight-only quantization, or "w8a8" (int8 weights and
    activations; native backend only), or "w4a8" (4-bit weights, int8 activations, specdec's
    own kernel). "auto" picks the fastest format measured on this kind of machine
    (docs/history.md, "Defaults that pick the fast path"): on an x86 CPU (AVX2 and up) w4a8 for
    target and draft alike; where its kernel cannot be compiled or has no vector path, a
    target takes w8a8 on VNNI/AMX CPUs, else none, and a draft int4 in bf16, else none
    (a draft's precision changes only the speed, never the output).
    cpu_linear (hf backend): "auto" packs linear layers for oneDNN on CPU in
    fp32 (see cpu_linear.py: verifying k+1 tokens then costs little more than one),
    "torch" keeps stock nn.Linear, "onednn" insists on packing.
    head_vocab (native backend): the output head scores only this many tokens,
    the most frequent ones (a reduced-vocabulary draft head, reduced_vocab.py).
    role: "target" runs the cheap batch-invariance probe on a native runner once
    (NativeRunner.check_invariance) and says on stderr that a transformers-backend
    target is not provably exact; "draft" does neither (a draft's numerics never
    reach the output). probe=False skips the cheap probe (`specdec doctor` runs the full one).
    """
    _check_load_options(backend, quantize, cpu_linear)
    from transformers import AutoTokenizer

    from specdec.models.hub import resolve_model_path

    path = Path(resolve_model_path(name_or_path, progress=progress))
    torch_device = resolve_device(device)
    started = time.perf_counter()
    backend, native_config = _choose_backend(path, name_or_path, backend)
    if backend == "hf" and (quantize not in ("none", "auto") or head_vocab is not None):
        raise ValueError("int8/int4 weights and reduced draft heads need the native backend")
    torch_dtype = resolve_dtype(dtype, torch_device, backend)
    if quantize == "auto":
        quantize = auto_quantization(backend, torch_device, torch_dtype, role)
    if quantize == "int4" and (torch_device.type != "cpu" or torch_dtype != torch.bfloat16):
        raise ValueError("int4 weights run on CPU with bfloat16 activations (--dtype bf16)")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if backend == "native":
        from specdec.models.native import load_native_runner
        from specdec.models.native.reduced_vocab import frequent_token_ids

        head_rows = None
        if head_vocab is not None:
            head_rows = frequent_token_ids(tokenizer, head_vocab, native_config.vocab_size)
        # A target keeps a finer output head (linear.head_quantization); a draft's precision only
        # changes its speed, and its head is a quarter of its bytes per step: the same format as the rest.
        runner = load_native_runner(path, dtype=torch_dtype, device=torch_device, quantize=quantize,
                                    head_rows=head_rows, config=native_config,
                                    head_quantize=quantize if role == "draft" else None)
        if role == "target" if probe is None else probe:
            runner.check_invariance()
    else:
        runner = _load_hf_runner(path, torch_dtype, torch_device, cpu_linear)
        if role == "target":
            print(f"specdec: {name_or_path} runs on the transformers backend, whose kernels are chosen by shape: "
                  "speculative greedy output usually, but not provably, equals plain output (the native "
                  "backend guarantees it; `specdec doctor` explains)", file=sys.stderr)
    return LoadedModel(name_or_path, path, runner, tokenizer, time.perf_counter() - started, backend, torch_dtype,
                       quantize, _eos_ids(path, tokenizer), head_vocab if backend == "native" else None)


def _check_load_options(backend: str, quantize: str, cpu_linear: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if quantize not in (*QUANTIZATIONS, "auto"):
        raise ValueError(f"quantize must be one of auto, {', '.join(QUANTIZATIONS)}, got {quantize!r}")
    if cpu_linear not in CPU_LINEAR_CHOICES:
        raise ValueError(f"cpu_linear must be one of {', '.join(CPU_LINEAR_CHOICES)}, got {cpu_linear!r}")


def _choose_backend(path: Path, name_or_path: str, backend: str):
    """(backend, the native config or None): "auto" is native where the architecture is supported,
    else hf with a message on stderr; "native" on an unsupported one is a clear error."""
    if backend == "hf":
        return "hf", None
    from specdec.models.native import UnsupportedModelError, read_config

    try:
        return "native", read_config(path)
    except UnsupportedModelError as reason:
        if backend == "native":
            raise ValueError(f"--backend native cannot run {name_or_path}: {reason}") from None
        print(f"specdec: {name_or_path}: {reason}; using the transformers backend", file=sys.stderr)
        return "hf", None


def auto_quantization(backend: str, device: torch.device, dtype: torch.dtype, role: str) -> str:
    """What quantize="auto" means for this model on this machine (see load_model)."""
    if backend != "native" or device.type != "cpu":
        return "none"
    from specdec.models.native.linear import w8a8_available
    from specdec.models.native.w4a8 import isa_path, w4a8_available

    if isa_path() != "scalar" and w4a8_available() is None:
        return "w4a8"
    if role == "draft":
        return "int4" if dtype == torch.bfloat16 else "none"
    return "w8a8" if w8a8_available() is None else "none"


def _load_hf_runner(path: Path, dtype: torch.dtype, device: torch.device, cpu_linear: str) -> ModelRunner:
    from transformers import AutoModelForCausalLM

    from specdec.models.hf import HFRunner

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    can_pack = onednn_available(device, dtype)
    if cpu_linear == "onednn" and not can_pack:
        raise ValueError("cpu_linear='onednn' needs a CPU device, float32 and a torch built with oneDNN")
    if cpu_linear != "torch" and can_pack:
        pack_linears(model)
    return HFRunner(model)


def eos_ids_of(tokenizer: object | None, model_config: object | None = None) -> frozenset[int]:
    """Every id that ends generation: the tokenizer's EOS and the generation config's."""
    ids: set[int] = set()
    for source in (getattr(tokenizer, "eos_token_id", None), getattr(model_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return frozenset(ids)


def _eos_ids(path: Path, tokenizer: object) -> frozenset[int]:
    from transformers import GenerationConfig

    generation = GenerationConfig.from_pretrained(path) if (path / "generation_config.json").is_file() else None
    return eos_ids_of(tokenizer, generation)


def same_vocabulary(target_tokenizer: object, draft_tokenizer: object) -> bool:
    """Whether a draft speaks the target's token ids (else it drafts through a VocabularyBridge)."""
    return target_tokenizer.get_vocab() == draft_tokenizer.get_vocab()
