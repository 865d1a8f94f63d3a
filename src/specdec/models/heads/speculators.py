"""EAGLE-3 heads in the field's interchange layout: the `speculators` directory vLLM and SGLang load.

A directory holds `config.json` and `model.safetensors`:

config.json (speculators' Eagle3SpeculatorConfig, serialized):
  speculators_model_type  "eagle3"; architectures ["Eagle3Speculator"]
  transformer_layer_config  the draft layer as a Llama config (hidden_size, num_attention_heads,
                          num_key_value_heads, head_dim, intermediate_size, rms_norm_eps,
                          rope_theta, vocab_size = the target's, num_hidden_layers = 1, ...)
  draft_vocab_size        rows of lm_head
  norm_before_residual    the first layer's residual is hidden_norm(h), not h
  target_hidden_size      the target's hidden size (fc reads three times it)
  eagle_aux_hidden_state_layer_ids  the target layers whose inputs fc fuses
  speculators_config      algorithm "eagle3", proposal_methods [{"proposal_type": "greedy",
                          "speculative_tokens": k, ...}], default_proposal_method,
                          verifier {"name_or_path", "architectures"}
model.safetensors:
  fc.weight [H, 3H]; layers.0.{input_layernorm, hidden_norm, post_attention_layernorm}.weight;
  layers.0.self_attn.{q,k,v}_proj.weight [*, 2H], o_proj; layers.0.mlp.{gate,up,down}_proj.weight;
  norm.weight; lm_head.weight [N, H]; d2t [N] int64 (target id = i + d2t[i]); t2d [V] bool;
  embed_tokens.weight optional (the target's when absent).

EAGLE-3's original checkpoints (SafeAILab/EAGLE) name the layer `midlayer.` and keep the layer
fields at the top of config.json; vLLM reads both, and so does load_speculators.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec.models.atomic_files import atomic_path, write_safetensors
from specdec.models.heads.checkpoint import LoadedHead, build_head
from specdec.models.heads.config import HeadConfig
from specdec.models.heads.layers import FrozenVocabulary

SPECULATORS_VERSION = "0.3.0"  # the speculators release whose field list this follows

# speculators / vLLM parameter name -> Eagle3Head's
_LAYER_NAMES = {
    "fc.weight": "fc.weight",
    "layers.0.input_layernorm.weight": "input_layernorm",
    "layers.0.hidden_norm.weight": "hidden_norm",
    "layers.0.self_attn.q_proj.weight": "q_proj.weight",
    "layers.0.self_attn.k_proj.weight": "k_proj.weight",
    "layers.0.self_attn.v_proj.weight": "v_proj.weight",
    "layers.0.self_attn.o_proj.weight": "o_proj.weight",
    "layers.0.post_attention_layernorm.weight": "post_attention_layernorm",
    "layers.0.mlp.gate_proj.weight": "gate_proj.weight",
    "layers.0.mlp.up_proj.weight": "up_proj.weight",
    "layers.0.mlp.down_proj.weight": "down_proj.weight",
    "norm.weight": "norm",
}


def is_speculators_dir(path: Path | str) -> bool:
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def export_speculators(head: LoadedHead, vocab: FrozenVocabulary, out_dir: Path | str, *, verifier: str,
                       verifier_architectures: list[str], max_position_embeddings: int,
                       speculative_tokens: int = 3, eos_token_id: int | list[int] | None = None,
                       dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a trained eagle3 head as a speculators directory (config.json, model.safetensors)."""
    config = head.config
    if config.kind != "eagle3":
        raise ValueError(f"only eagle3 heads have a speculators layout; this one is {config.kind}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = head.module.state_dict()
    tensors = {theirs: state[ours].detach().to(dtype).contiguous().cpu() for theirs, ours in _LAYER_NAMES.items()}
    vocab_ids = vocab.vocab_ids.cpu().to(torch.int64)
    tensors["lm_head.weight"] = vocab.output_weight.detach().to(dtype).contiguous().cpu()
    tensors["d2t"] = (vocab_ids - torch.arange(len(vocab_ids))).contiguous()
    t2d = torch.zeros(config.target_vocab_size, dtype=torch.bool)
    t2d[vocab_ids] = True
    tensors["t2d"] = t2d
    layer = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "num_hidden_layers": 1, "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta, "rope_scaling": None,
        "max_position_embeddings": max_position_embeddings, "vocab_size": config.target_vocab_size,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "eos_token_id": eos_token_id, "torch_dtype": str(dtype).removeprefix("torch."),
    }
    document = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": len(vocab_ids),
        "norm_before_residual": config.norm_before_residual,
        "target_hidden_size": config.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layers),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "torch_dtype": str(dtype).removeprefix("torch."),
        "specdec": {"trained_on": config.target, "heldout_accuracies": config.accuracies},
    }
    # Each file whole under its name, config.json last: a directory is a speculators head once it has
    # one (is_speculators_dir), so a killed export never looks like a finished one.
    with atomic_path(out / "model.safetensors") as partial:
        write_safetensors(partial, tensors, {"format": "pt"})
    with atomic_path(out / "config.json") as partial:
        partial.write_text(json.dumps(document, indent=2) + "\n")
    return out


def _layer_fields(document: dict) -> tuple[dict, bool]:
    """The draft layer's config and whether the file is speculators' layout (else EAGLE-3's original)."""
    if "transformer_layer_config" in document:
        return document["transformer_layer_config"], True
    return document, False


def _mismatches(document: dict, layer: dict, target) -> list[str]:
    """What keeps a head's config.json (document, its draft layer's fields) from drafting for the
    target (a DecoderConfig): one phrase each, none where it fits."""
    problems = []
    if int(layer.get("num_hidden_layers", 1)) != 1:
        problems.append(f"{layer['num_hidden_layers']} draft layers (specdec runs EAGLE-3's one)")
    for key in ("rope_scaling", "rope_parameters"):
        scaling = layer.get(key) or {}
        if scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
            problems.append(f"rope scaling {scaling.get('rope_type', scaling.get('type'))!r}")
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        problems.append("biases in the draft layer")
    if document.get("norm_before_fc"):
        problems.append("norm_before_fc")
    hidden = int(layer["hidden_size"])
    target_hidden = int(document.get("target_hidden_size") or hidden)
    if (hidden, target_hidden) != (target.hidden_size, target.hidden_size):
        problems.append(f"hidden size {hidden} (target features {target_hidden}); the target has "
                        f"{target.hidden_size}")
    if int(layer.get("vocab_size", target.vocab_size)) != target.vocab_size:
        problems.append(f"a {layer['vocab_size']}-token target vocabulary; the target has {target.vocab_size}")
    return problems


def load_speculators(directory: Path | str, target_decoder, target_embedding: torch.Tensor, *,
                     dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
                     ) -> tuple[LoadedHead, FrozenVocabulary]:
    """A speculators (or original EAGLE-3) directory -> (head, the vocabulary it drafts from),
    checked against the target it will draft for (target_decoder: a NativeDecoder)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    document = json.loads((directory / "config.json").read_text())
    kind = document.get("speculators_model_type")
    architectures = " ".join(document.get("architectures") or [])
    if kind not in (None, "eagle3") or (kind is None and "Eagle3" not in architectures):
        raise ValueError(f"{directory} holds a {kind or architectures or 'non-EAGLE-3'} model; "
                         f"specdec loads eagle3 heads from such directories")
    layer, speculators_layout = _layer_fields(document)
    target = target_decoder.config
    problems = _mismatches(document, layer, target)
    if problems:
        raise ValueError(f"{directory} cannot draft for this target: {'; '.join(problems)}")
    hidden = int(layer["hidden_size"])

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has no .safetensors weights (convert pytorch_model.bin first)")
    weights = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            name = name.removeprefix("model.").replace("midlayer.", "layers.0.")
            weights[name] = tensor
    missing = [name for name in (*_LAYER_NAMES, "lm_head.weight") if name not in weights]
    if missing:
        raise ValueError(f"{directory} lacks {', '.join(missing[:4])}: not an EAGLE-3 head")
    rows = weights["lm_head.weight"]
    draft_vocab = int(document.get("draft_vocab_size") or rows.shape[0])
    if "d2t" in weights:
        vocab_ids = torch.arange(draft_vocab) + weights["d2t"].to(torch.int64)
    elif draft_vocab == target.vocab_size:
        vocab_ids = torch.arange(draft_vocab)
    else:
        raise ValueError(f"{directory} drafts from {draft_vocab} tokens but has no d2t map to the target's ids")
    if rows.shape[0] != draft_vocab or int(vocab_ids.max()) >= target.vocab_size or int(vocab_ids.min()) < 0:
        raise ValueError(f"{directory}: lm_head has {rows.shape[0]} rows and d2t maps outside the target's "
                         f"{target.vocab_size} tokens; the files disagree")
    num_heads = int(layer["num_attention_heads"])
    rope = layer.get("rope_parameters") or {}
    aux_layers = document.get("eagle_aux_hidden_state_layer_ids") or [2, target.num_layers // 2,
                                                                       target.num_layers - 3]
    config = HeadConfig(
        kind="eagle3", hidden_size=hidden, target_vocab_size=target.vocab_size,
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)), num_heads=num_heads,
        num_kv_heads=int(layer.get("num_key_value_heads") or num_heads),
        head_dim=int(layer.get("head_dim") or hidden // num_heads),
        intermediate_size=int(layer["intermediate_size"]),
        rope_theta=float(rope.get("rope_theta") or layer.get("rope_theta") or 10000.0),
        aux_layers=[int(i) for i in aux_layers],
        # vLLM's defaults: speculators files say it; EAGLE-3's own layer takes the residual before the norm
        norm_before_residual=bool(document.get("norm_before_residual", speculators_layout)),
        accuracies=(document.get("specdec") or {}).get("heldout_accuracies") or [],
        target=str(((document.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or ""),
    )
    module = build_head(config)
    module.load_state_dict({ours: weights[theirs] for theirs, ours in _LAYER_NAMES.items()})
    module.to(device=device, dtype=dtype).eval().requires_grad_(False)
    embedding = weights.get("embed_tokens.weight", target_embedding)
    vocab = FrozenVocabulary.with_output_rows(embedding.to(device=device, dtype=dtype),
                                              rows.to(device=device, dtype=dtype), vocab_ids.to(device))
    return LoadedHead(config, module, vocab_ids, {"source": str(directory)}), vocab
