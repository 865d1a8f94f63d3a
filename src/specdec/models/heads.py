"""Draft heads that read the target's own hidden states: EAGLE and Medusa.

Both reuse the target's token embedding and output head (frozen) and add a
few trainable weights, stored apart from the target as safetensors with their
config in the file's metadata (save_head / load_head).

EAGLE (Li et al. 2024, arXiv 2401.15077): drafting at the feature level is
easier than at the token level. One decoder layer reads, at position j, the
target's feature f_j (its final-norm hidden state, what the output head reads)
fused with the embedding of the token that followed, t_{j+1}:
    x_j = fc([embed(t_{j+1}); f_j])          # [2H] -> [H]
    f^_{j+1} = decoder_layer(x_{<=j})        # causal attention, its own KV cache
and the output head turns f^_{j+1} into a distribution for t_{j+2}. Drafting
feeds the predicted feature back (autoregressive at feature level). The output
head may score a reduced vocabulary (EAGLE-3, Li et al. 2025, arXiv 2503.01840).

EAGLE-3 (Li et al. 2025, arXiv 2503.01840): the head reads the target's low,
middle and high layers' features, fused by fc ([3H] -> [H]), predicts tokens
directly (no feature regression), and is trained on its own drafts
(training-time test, training/train_head.py). Its layer is the one vLLM and the
speculators library run (models/eagle3.py), so a head trained here exports to
them (specdec export-head) and theirs load here.

Medusa (Cai et al. 2024, arXiv 2401.10774): m heads on the target's last
feature f_j, head i a residual block x + SiLU(W_i x + b_i) followed by the
output head, predicting t_{j+1+i}: the tokens after the one the target itself
predicts. Medusa-1 gives every head its own copy of the output head; here the
heads share the target's frozen one (cheaper to train and to run), and W_i
starts at zero so each head starts as the target's own next-token guess.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from specdec.models.native.attention import grouped_attention
from specdec.models.native.model import rotate_half

HEAD_KINDS = ("eagle", "eagle3", "medusa")


@dataclass(frozen=True)
class HeadConfig:
    kind: str  # "eagle" | "eagle3" | "medusa"
    hidden_size: int  # the target's
    target_vocab_size: int  # the target's full vocabulary (token ids below it)
    rms_norm_eps: float = 1e-6
    # EAGLE's decoder layer
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    rope_theta: float = 10000.0
    # EAGLE-3: the target layers whose input features are fused (vLLM's
    # eagle_aux_hidden_state_layer_ids), and where the first layer's residual is taken
    aux_layers: list[int] = field(default_factory=list)
    norm_before_residual: bool = True
    # Medusa
    num_medusa_heads: int = 0
    # What training measured (teacher-forced, held-out): top-i accuracy of each head /
    # depth, [depth][i]; Medusa's static tree is built from these.
    accuracies: list[list[float]] = field(default_factory=list)
    target: str = ""  # the target it was trained on, for the error when used with another

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise ValueError(f"unknown head kind {self.kind!r}; choose one of {', '.join(HEAD_KINDS)}")
        if self.kind == "eagle3" and not self.aux_layers:
            raise ValueError("an eagle3 head needs the target layers it reads (aux_layers)")

    @staticmethod
    def for_target(kind: str, decoder_config, *, num_medusa_heads: int = 4, intermediate_size: int | None = None,
                   target: str = "", aux_layers: list[int] | None = None) -> HeadConfig:
        """EAGLE's layer copies the target's layer shape (its paper's choice); Medusa needs only H.
        EAGLE-3 reads layers 2, L/2 and L-3 unless told otherwise (vLLM's default)."""
        layers = decoder_config.num_layers
        if kind == "eagle3" and aux_layers is None:
            aux_layers = [2, layers // 2, layers - 3]
        return HeadConfig(kind=kind, hidden_size=decoder_config.hidden_size,
                          target_vocab_size=decoder_config.vocab_size, rms_norm_eps=decoder_config.rms_norm_eps,
                          num_heads=decoder_config.num_heads, num_kv_heads=decoder_config.num_kv_heads,
                          head_dim=decoder_config.head_dim,
                          intermediate_size=intermediate_size or decoder_config.intermediate_size,
                          rope_theta=decoder_config.rope_theta,
                          num_medusa_heads=num_medusa_heads if kind == "medusa" else 0, target=target,
                          aux_layers=list(aux_layers or []))


class FrozenVocabulary(nn.Module):
    """The target's embedding and (possibly reduced) output head, not trained.

    vocab_ids [N] ascending: the target token ids the head scores (all of them by default).
    """

    def __init__(self, embedding: torch.Tensor, output_weight: torch.Tensor, vocab_ids: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("embedding", embedding.detach(), persistent=False)  # [V, H]
        self.register_buffer("output_weight", output_weight.detach()[vocab_ids.to(output_weight.device)],
                             persistent=False)  # [N, H]
        self.register_buffer("vocab_ids", vocab_ids.to(embedding.device), persistent=False)  # [N]

    @classmethod
    def with_output_rows(cls, embedding: torch.Tensor, rows: torch.Tensor, vocab_ids: torch.Tensor
                         ) -> FrozenVocabulary:
        """rows [N, H]: the head's own output matrix, row i scoring target id vocab_ids[i]
        (an EAGLE-3 checkpoint's lm_head, which its training may have changed)."""
        return cls(embedding, rows, torch.arange(len(vocab_ids), device=rows.device)).relabel(vocab_ids)

    def relabel(self, vocab_ids: torch.Tensor) -> FrozenVocabulary:
        self.vocab_ids = vocab_ids.to(self.embedding.device)
        return self

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:  # [..., T] -> [..., T, H]
        return nn.functional.embedding(token_ids, self.embedding)

    def logits(self, features: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., N] fp32, reduced ids
        fast = self.__dict__.get("_fast_output")
        if fast is not None:
            return fast(features.to(self.output_weight.dtype)).float()
        return nn.functional.linear(features.to(self.output_weight.dtype), self.output_weight).float()

    def quantize_output(self, quantize: str) -> None:
        """Drafting scores the head's vocabulary through the target's weight format (w4a8: 1.7 ms
        instead of 14 ms for 32,768 rows on an AVX2 EPYC). Only drafts change, never the output:
        verification is exact. The dense rows stay (training and export read them)."""
        from specdec.models.native.linear import make_linear

        self.__dict__["_fast_output"] = make_linear(self.output_weight, None, dtype=self.output_weight.dtype,
                                                    device=self.output_weight.device, quantize=quantize)

    def to_target_ids(self, reduced: torch.Tensor) -> torch.Tensor:
        return self.vocab_ids[reduced]


class HeadKVCache:
    """One layer's keys and values for one sequence: [H_kv, capacity, D], grown by doubling."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.keys = torch.zeros(num_kv_heads, 256, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.length = 0

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:  # [H_kv, T, D]
        end = self.length + keys.shape[1]
        if end > self.keys.shape[1]:
            capacity = max(end, 2 * self.keys.shape[1])
            grown_keys = self.keys.new_zeros(self.keys.shape[0], capacity, self.keys.shape[2])
            grown_values = torch.zeros_like(grown_keys)
            grown_keys[:, : self.length], grown_values[:, : self.length] = self.keys[:, : self.length], \
                self.values[:, : self.length]
            self.keys, self.values = grown_keys, grown_values
        self.keys[:, self.length:end], self.values[:, self.length:end] = keys, values
        self.length = end

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:  # [H_kv, S, D]
        return self.keys[:, : self.length], self.values[:, : self.length]


def rotary_angles(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cos, sin [B, 1, T, D] as native/model.py's Rotary, with the frequencies made in fp32
    on every call (no buffer, so casting a bf16 head never rounds them)."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim
    freqs = positions[..., None].float() / theta ** exponents  # [B, T, D/2]
    angles = torch.cat([freqs, freqs], dim=-1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def project_qkv(head: nn.Module, x: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, T, *], positions [B, T] -> query [B, Hq, T, D], key and value [B, Hkv, T, D], RoPE
    applied: a head layer's q/k/v_proj (EAGLE's and EAGLE-3's alike)."""
    batch, steps = x.shape[:2]
    config = head.config
    query = head.q_proj(x).view(batch, steps, config.num_heads, config.head_dim).transpose(1, 2)
    key = head.k_proj(x).view(batch, steps, config.num_kv_heads, config.head_dim).transpose(1, 2)
    value = head.v_proj(x).view(batch, steps, config.num_kv_heads, config.head_dim).transpose(1, 2)
    cos, sin = rotary_angles(positions.to(x.device), config.head_dim, config.rope_theta, query.dtype)
    return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin, value


def attend(config: HeadConfig, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           cache: HeadKVCache | None, mask: torch.Tensor | None) -> torch.Tensor:
    """Training (no cache): causal over the T; drafting: the T new keys join the cache first."""
    if cache is None:
        return nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, enable_gqa=config.num_heads != config.num_kv_heads)
    cache.append(key[0], value[0])
    keys, values = cache.view()
    return grouped_attention(query, keys[None], values[None], mask)


class EagleHead(nn.Module):
    """fc over [embed(next token); feature], then one pre-norm decoder layer (EAGLE-1's
    layer skips the input norm: the fused input is not a residual stream)."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        hidden, heads, kv_heads, dim = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.config = config
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.q_proj = nn.Linear(hidden, heads * dim, bias=True)
        self.k_proj = nn.Linear(hidden, kv_heads * dim, bias=True)
        self.v_proj = nn.Linear(hidden, kv_heads * dim, bias=True)
        self.o_proj = nn.Linear(heads * dim, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        self.gate_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, hidden, bias=False)

    def forward(
        self,
        features: torch.Tensor,  # [B, T, H] f_j (the target's, or the head's own predictions)
        next_embeds: torch.Tensor,  # [B, T, H] embed(t_{j+1})
        positions: torch.Tensor,  # [B, T] j
        *,
        cache: HeadKVCache | None = None,  # decoding (B = 1): appends the T new keys first
        mask: torch.Tensor | None = None,  # [B, 1, T, S] bool for a cache; None: causal over the T
    ) -> torch.Tensor:  # [B, T, H] f^_{j+1}
        batch, steps, _ = features.shape
        x = self.fc(torch.cat([next_embeds.to(features.dtype), features], dim=-1))
        query, key, value = project_qkv(self, x, positions)
        attended = attend(self.config, query, key, value, cache, mask)
        x = x + self.o_proj(attended.transpose(1, 2).reshape(batch, steps, -1))
        # RMSNorm in fp32, as the target's (native/model.py), whatever the head's dtype.
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.mlp_norm.eps)).to(x.dtype)
        normed = normed * self.mlp_norm.weight.to(x.dtype)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(normed)) * self.up_proj(normed))


class MedusaHeads(nn.Module):
    """m residual blocks on the target's last feature; block i predicts the token i + 1 steps
    past the target's own next token (through the shared output head)."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(nn.Linear(config.hidden_size, config.hidden_size)
                                    for _ in range(config.num_medusa_heads))
        for block in self.blocks:  # start as the identity: each head begins as the target's own guess
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., m, H] per-head features
        return torch.stack([features + nn.functional.silu(block(features)) for block in self.blocks], dim=-2)


def quantize_head(module: nn.Module, quantize: str) -> None:
    """A loaded head's projections in the target's weight format, for drafting on a CPU (each
    draft step reads them all; in fp32 an EAGLE-3 layer is ~116 MB). Drafts only: exactness
    is verification's."""
    from specdec.models.native.linear import make_linear

    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, make_linear(child.weight.detach(), None if child.bias is None else
                                              child.bias.detach(), dtype=child.weight.dtype,
                                              device=child.weight.device, quantize=quantize))


def build_head(config: HeadConfig) -> nn.Module:
    if config.kind == "eagle3":
        from specdec.models.eagle3 import Eagle3Head

        return Eagle3Head(config)
    return EagleHead(config) if config.kind == "eagle" else MedusaHeads(config)


# ---- checkpoints ------------------------------------------------------------------------------

def save_head(path: Path, head: nn.Module, config: HeadConfig, vocab_ids: torch.Tensor,
              extra: dict | None = None) -> None:
    """The trainable weights as safetensors; config, vocabulary and `extra` (training state) as metadata."""
    from safetensors.torch import save_file

    tensors = {name: value.detach().contiguous().cpu() for name, value in head.state_dict().items()}
    tensors["vocab_ids"] = vocab_ids.to(torch.int64).cpu().contiguous()
    metadata = {"specdec_head": json.dumps(asdict(config)), "extra": json.dumps(extra or {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    save_file(tensors, str(partial), metadata=metadata)
    partial.replace(path)  # never a half-written checkpoint under the real name


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
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    if "specdec_head" not in metadata:
        raise ValueError(f"{path} is not a specdec head checkpoint (no 'specdec_head' metadata)")
    config = HeadConfig(**json.loads(metadata["specdec_head"]))
    tensors = load_file(str(path))
    vocab_ids = tensors.pop("vocab_ids")
    module = build_head(config)
    module.load_state_dict(tensors, strict=False)
    missing = set(module.state_dict()) - set(tensors)
    if missing:
        raise ValueError(f"{path} lacks weights {sorted(missing)[:3]}...")
    module.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return LoadedHead(config, module, vocab_ids, json.loads(metadata.get("extra", "{}")))


def _native_decoder(target_runner):
    decoder = getattr(target_runner, "decoder", None)
    if decoder is None:
        raise ValueError("draft heads read the target's hidden states: load the target with the native "
                         "backend (--backend native; Qwen2 / Llama family)")
    return decoder


def frozen_vocabulary(target_runner, target_path: Path, vocab_ids: torch.Tensor,
                      dtype: torch.dtype | None = None) -> FrozenVocabulary:
    """The target's embedding and output head (rows vocab_ids) from a native target runner.

    A tied target's output head is its embedding; an untied one's is read from its safetensors.
    """
    decoder = _native_decoder(target_runner)
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
    from specdec.models.hub import cache_root

    return cache_root() / "heads" / Path(target_name).name / f"{kind}.safetensors"


def locate_head(target_name: str, kind: str, path: str | Path | None = None) -> Path:
    """The checkpoint a head method loads (path, else the default for the target); a missing
    one is a FileNotFoundError that says how to train it."""
    location = Path(path) if path else default_head_path(target_name, kind)
    if kind == "eagle3" and (location / "config.json").is_file():
        return location  # a speculators / EAGLE-3 directory (models/speculators.py)
    if not location.is_file():
        hint = f" --out {location}" if path else ""
        raise FileNotFoundError(f"no trained {kind} head at {location}; train one with: specdec train-head "
                                f"--kind {kind} --target {target_name}{hint}")
    return location


def load_head_for(target, kind: str, path: str | Path | None = None, *, for_drafting: bool = True
                  ) -> tuple[LoadedHead, FrozenVocabulary]:
    """The trained head of `kind` for a loaded target (models.loader.LoadedModel) and the target's
    vocabulary it reads, in the target's dtype on its device; clear errors when either does not fit.

    for_drafting: an EAGLE-3 head on a quantized CPU target drafts through the target's weight
    format (quantize_head); False keeps the dense weights (export)."""
    location = locate_head(target.name, kind, path)
    decoder = _native_decoder(target.runner)
    dtype = decoder.dtype
    if location.is_dir():
        from specdec.models.speculators import load_speculators

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
    return _for_drafting(head, frozen_vocabulary(target.runner, target.path, head.vocab_ids, dtype), target,
                         for_drafting)


def _for_drafting(head: LoadedHead, vocab: FrozenVocabulary, target, for_drafting: bool
                  ) -> tuple[LoadedHead, FrozenVocabulary]:
    quantize = getattr(target, "quantize", "none")
    if for_drafting and head.config.kind == "eagle3" and target.runner.device.type == "cpu" and \
            quantize in ("w4a8", "w8a8", "int8"):
        quantize_head(head.module, quantize)
        vocab.quantize_output(quantize)
    return head, vocab
