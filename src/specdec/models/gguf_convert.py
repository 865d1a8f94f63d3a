"""GGUF -> a Hugging Face directory (bf16 safetensors, tokenizer, generation config) for hub.py.

The embedded models ship as GGUF parts inside pip packages (hub.py joins and verifies them); this
dequantises one through transformers' GGUF loader, repairs what that conversion loses, and saves it.
"""

from __future__ import annotations

from pathlib import Path


def fix_tokenizer_and_generation(name: str, eos_tokens: tuple[str, ...], model, tokenizer) -> None:
    """Repair what the GGUF -> transformers conversion loses or gets wrong.

    - The GGUF loader leaves a quantizer on the model (and quant_method "gguf"
      in its config) even when every weight was unpacked to a dense tensor;
      save_pretrained refuses such a model, and the config would describe bf16
      safetensors as a GGUF checkpoint.
    - GGUF stores one eos id; the instruct releases stop on several end tokens.
      generation_config keeps greedy defaults (no sampling settings): specdec
      passes its own SamplingParams, and HF generate() should stay deterministic.
    - The GGUF tokenizer comes back with "unlimited" model_max_length.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # transformers >= 5; 4.x dequantised without one
        quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = "bfloat16"  # matches the saved tensors

    if eos_tokens:
        # The first listed end token is the one the chat template closes turns with.
        tokenizer.eos_token = eos_tokens[0]
    vocab = tokenizer.get_vocab()
    eos_ids: list[int] = []
    for token in dict.fromkeys((tokenizer.eos_token, *eos_tokens)):  # ordered, unique
        if token not in vocab:
            raise RuntimeError(f"{name}: end token {token!r} is not in the tokenizer vocabulary")
        eos_ids.append(vocab[token])
    gen = model.generation_config
    gen.eos_token_id = eos_ids if len(eos_ids) > 1 else eos_ids[0]
    gen.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[-1]
    model.config.eos_token_id = eos_ids[0]

    # The GGUF tokenizer comes back with "unlimited" length; the real limit is
    # the model's context, and tokenizers warn/truncate against this number.
    max_positions = getattr(model.config, "max_position_embeddings", None)
    if max_positions:
        tokenizer.model_max_length = max_positions


def convert_gguf(name: str, eos_tokens: tuple[str, ...], gguf_dir: Path, gguf_name: str, out: Path,
                 progress: bool = True) -> None:
    """GGUF -> bf16 safetensors + tokenizer in ``out``; name and eos_tokens: the model's (hub.EmbeddedModel)."""
    from transformers.utils import logging as hf_logging

    # transformers draws its own bars (dequantising, loading); honour progress=False.
    bars_were_on = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        _convert_quietly(name, eos_tokens, gguf_dir, gguf_name, out)
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()


def _convert_quietly(name: str, eos_tokens: tuple[str, ...], gguf_dir: Path, gguf_name: str, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    if not getattr(tokenizer, "chat_template", None):
        # Without it nobody can format the prompts these instruct models were
        # trained on; fail before the minute-long weight conversion.
        raise RuntimeError(f"{name}: the GGUF carries no chat template; refusing to cache it")
    # Dequantise into fp32 (what transformers' GGUF loader produces anyway), then
    # store bf16: half the disk and read time of fp32, and the dtype people
    # publish these models in. Note: bf16 rounds the dequantised values a little.
    kwargs = {}
    try:
        from transformers import GgufConfig

        # transformers 5 keeps weights packed in GGUF blocks when a matmul kernel
        # is installed (`kernels`); we want plain dense tensors to save.
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # transformers 4.x always dequantises GGUF
        pass
    model = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_name, dtype=torch.float32, **kwargs
    )
    fix_tokenizer_and_generation(name, eos_tokens, model, tokenizer)
    model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
