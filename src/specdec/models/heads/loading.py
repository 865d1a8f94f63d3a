"""A trained head for a loaded target: where it lives, the target's vocabulary it reads, and the
checks that the two fit (load_head_for)."""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.models.heads.checkpoint import LoadedHead, load_head, quantize_head
from specdec.models.heads.layers import FrozenVocabulary
from specdec.models.heads.speculators import load_speculators
from specdec.models.hub import cache_root


def _feature_decoder(target_runner):
    """What the heads read of the target: the native decoder, or HFFeatures over a transformers model."""
    decoder = getattr(target_runner, "decoder", None)
    if decoder is None:
        raise ValueError("draft heads read the target's hidden states, which this target's runner does not "
                         "give (load it with --backend native or hf)")
    return decoder


def frozen_vocabulary(target_runner, target_path: Path, vocab_ids: torch.Tensor,
                      dtype: torch.dtype | None = None) -> FrozenVocabulary:
    """The target's embedding and output head (rows vocab_ids) from a target runner (native or hf).

    A tied target's output head is its embedding; an untied one's is read from its safetensors.
    """
    decoder = _feature_decoder(target_runner)
    embedding = decoder.embedding.detach()
    if decoder.config.tie_word_embeddings:
        output_weight = embedding
    else:
        from safetensors import safe_open

        output_weight = None
        for file in sorted(Path(target_path).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                if "lm_head.weight" in handle.keys():
                    output_weight = handle.get_tensor("lm_head.weight").to(embedding.device)
        if output_weight is None:
            raise ValueError(f"the target's output head is not tied to its embedding and {target_path} holds "
                             f"no lm_head.weight")
    dtype = dtype or embedding.dtype
    return FrozenVocabulary(embedding.to(dtype), output_weight.to(dtype), vocab_ids.to(embedding.device))


def default_head_path(target_name: str, kind: str) -> Path:
    """Where `specdec train-head` writes and --method eagle / medusa look: the models' cache."""
    return cache_root() / "heads" / Path(target_name).name / f"{kind}.safetensors"


def locate_head(target_name: str, kind: str, path: str | Path | None = None) -> Path:
    """The checkpoint a head method loads (path, else the default for the target); a missing
    one is a FileNotFoundError that says how to train it."""
    location = Path(path) if path else default_head_path(target_name, kind)
    if kind in ("eagle3", "mlp-speculator") and (location / "config.json").is_file():
        return location  # a speculators / EAGLE-3 directory (speculators.py), an fms-extras one (fms_speculator.py)
    if not location.is_file():
        hint = f" --out {location}" if path else ""
        raise FileNotFoundError(f"no trained {kind} head at {location}; train one with: specdec train-head "
                                f"--kind {kind} --target {target_name}{hint}")
    return location


def load_head_for(target, kind: str, path: str | Path | None = None, *, for_drafting: bool = True
                  ) -> tuple[LoadedHead, FrozenVocabulary]:
    """The trained head of `kind` for a loaded target (models.loader.LoadedModel) and the target's
    vocabulary it reads, in the target's dtype on its device; clear errors when either does not fit.

    for_drafting: an EAGLE-3 head or an MLP speculator on a quantized CPU target drafts through the
    target's weight format (quantize_head); False keeps the dense weights (export)."""
    location = locate_head(target.name, kind, path)
    decoder = _feature_decoder(target.runner)
    dtype = decoder.dtype
    if location.is_dir() and kind == "mlp-speculator":  # a published speculator: its own embeddings and heads
        from specdec.models.heads.fms_speculator import load_fms_speculator

        head = load_fms_speculator(location, decoder.config.hidden_size, decoder.config.vocab_size, dtype=dtype,
                                   device=target.runner.device)
        return _for_drafting(head, None, target, for_drafting)
    if location.is_dir():
        head, vocab = load_speculators(location, decoder, decoder.embedding.detach(), dtype=dtype,
                                       device=target.runner.device)
        return _for_drafting(head, vocab, target, for_drafting)
    head = load_head(location, dtype=dtype, device=target.runner.device)
    if head.config.kind != kind:
        raise ValueError(f"{location} holds a {head.config.kind} head, not {kind}")
    if (head.config.hidden_size, head.config.target_vocab_size) != (
            decoder.config.hidden_size, decoder.config.vocab_size):
        raise ValueError(f"{location} was trained for a target with hidden size {head.config.hidden_size} and "
                         f"{head.config.target_vocab_size} tokens ({head.config.target or 'unknown'}); "
                         f"{target.name} has {decoder.config.hidden_size} and {decoder.config.vocab_size}")
    vocab = frozen_vocabulary(target.runner, target.path, head.vocab_ids, dtype)
    if head.config.kind == "mlp-speculator":  # it scores with its own trained output rows
        vocab = FrozenVocabulary.with_output_rows(vocab.embedding, head.module.output.weight.detach(), head.vocab_ids)
    return _for_drafting(head, vocab, target, for_drafting)


def _for_drafting(head: LoadedHead, vocab: FrozenVocabulary | None, target, for_drafting: bool
                  ) -> tuple[LoadedHead, FrozenVocabulary | None]:
    """vocab None: a published MLP speculator, whose projections and heads are all its own."""
    quantize = getattr(target, "quantize", "none")
    if for_drafting and head.config.kind in ("eagle3", "mlp-speculator") and target.runner.device.type == "cpu" and \
            quantize in ("w4a8", "w8a8", "int8"):
        quantize_head(head.module.proj if head.config.kind == "mlp-speculator" and vocab is not None else head.module,
                      quantize)
        if vocab is not None:
            vocab.quantize_output(quantize)
    return head, vocab
