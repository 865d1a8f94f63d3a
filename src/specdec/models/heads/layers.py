"""What the heads share: the target's frozen vocabulary, a head layer's KV cache, RoPE, and the
q/k/v projection and attention of EAGLE's and EAGLE-3's layers."""

from __future__ import annotations

import torch
from torch import nn

from specdec.models.heads.config import HeadConfig
from specdec.models.native.attention import grouped_attention
from specdec.models.native.linear import make_linear
from specdec.models.native.model import rotate_half


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
        """Drafting scores the head's vocabulary through the target's weight format: in dense fp32 the
        output matrix alone cost several times the w4a8 kernel per draft token (docs/history.md,
        "EAGLE-3 heads trained on a 2-core CPU (issue 20, first part)"). Only drafts change, never the
        output: verification is exact. The dense rows stay (training and export read them)."""
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
