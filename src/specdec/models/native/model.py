"""The Qwen2 / Llama decoder in plain PyTorch, reading and writing a StaticKVCache.

Same math as transformers' Qwen2ForCausalLM / LlamaForCausalLM (pre-norm
blocks, RMSNorm in fp32, rotate-half RoPE, grouped-query attention, SwiGLU),
with three changes for decoding speed: q/k/v and gate/up are fused into one
projection each (one weight read, one kernel call), the KV cache is static
(kv_cache.py), and any T >= 1 new tokens may come in at once with an optional
mask among them (tree drafts), because verification feeds k+1 tokens per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specdec.models.kv_cache import StaticKVCache
from specdec.models.native.config import DecoderConfig
from specdec.models.native.linear import make_linear


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In fp32 whatever the compute dtype, as transformers does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Rotary(nn.Module):
    """RoPE (Su et al. 2021, arXiv 2104.09864) with the model's theta, in the rotate-half layout."""

    def __init__(self, head_dim: int, theta: float, device: torch.device) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        self.register_buffer("inv_freq", 1.0 / theta ** exponents, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        angles = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, D]
        return angles.cos().to(dtype), angles.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig, qkv: nn.Module, out: nn.Module) -> None:
        super().__init__()
        self.qkv, self.out = qkv, out
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: StaticKVCache, layer: int,
                key_length: int, mask: torch.Tensor | None, tree: TreeKeys | None = None) -> torch.Tensor:
        batch, steps, _ = x.shape
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        query, key, value = self.qkv(x).split([q_size, kv_size, kv_size], dim=-1)
        query = query.view(batch, steps, self.num_heads, self.head_dim).transpose(1, 2)  # [B, Hq, T, D]
        key = key.view(batch, steps, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        value = value.view(batch, steps, self.num_kv_heads, self.head_dim).transpose(1, 2)
        query = query * cos + rotate_half(query) * sin
        key = key * cos + rotate_half(key) * sin
        cache.write(layer, key, value)
        keys, values = cache.view(layer, key_length)  # [B, Hkv, S, D]
        if tree is None:
            attended = grouped_attention(query, keys, values, mask)  # [B, Hq, T, D]
        else:
            attended = tree_attention(query, keys, values, tree)
        return self.out(attended.transpose(1, 2).reshape(batch, steps, q_size))


def grouped_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      mask: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention (Ainslie et al. 2023, arXiv 2305.13245) as two batched matmuls.

    query [B, Hq, T, D]; keys, values [B, Hkv, S, D]; mask [B, 1, T, S] bool or None -> [B, Hq, T, D].
    Query heads h = j * G + g share kv head j, so a reshape puts each group's
    G x T queries against its one kv head without copying keys. For decoding's
    few queries this beats SDPA's CPU kernel several times over in bf16
    (90 vs 480 us per layer at T=1, S=400); softmax runs in fp32 as in transformers.
    """
    batch, query_heads, steps, dim = query.shape
    kv_heads, key_length = keys.shape[1], keys.shape[2]
    groups = query_heads // kv_heads
    scores = torch.matmul(query.reshape(batch, kv_heads, groups * steps, dim), keys.transpose(-1, -2))
    scores = scores.float() * dim ** -0.5  # [B, Hkv, G*T, S]
    if mask is not None:
        scores = scores.view(batch, kv_heads, groups, steps, key_length).masked_fill(~mask[:, :, None], float("-inf"))
        scores = scores.view(batch, kv_heads, groups * steps, key_length)
    weights = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(weights, values).view(batch, query_heads, steps, dim)


@dataclass(frozen=True)
class TreeKeys:
    """Per query of a tree forward, the cache slots it attends to, in the order plain decoding has them.

    index [B, T, S'] slots: the row's cached prefix, then the query's ancestors and itself
    (root first); mask [B, 1, T, S'] marks the real ones (the rest is padding at the end).
    """
    index: torch.Tensor
    mask: torch.Tensor

    @staticmethod
    def build(starts: list[int], among_new: torch.Tensor, device: torch.device) -> TreeKeys:
        """among_new [B, T, T]: which new tokens each new token sees (itself and its ancestors)."""
        visible = among_new.to(device="cpu", dtype=torch.bool)
        counts = visible.sum(dim=-1)  # [B, T]
        width = max(starts) + int(counts.max())
        index = torch.zeros(visible.shape[0], visible.shape[1], width, dtype=torch.int64)
        mask = torch.zeros(visible.shape[0], 1, visible.shape[1], width, dtype=torch.bool)
        for row, start in enumerate(starts):
            for query in range(visible.shape[1]):
                slots = torch.cat([torch.arange(start), start + visible[row, query].nonzero().flatten()])
                index[row, query, : len(slots)] = slots
                mask[row, 0, query, : len(slots)] = True
        return TreeKeys(index.to(device), mask.to(device))


def tree_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tree: TreeKeys) -> torch.Tensor:
    """Attention of a tree's queries, each over its own key sequence: [B, Hq, T, D].

    A mask over the whole forward (as for a chain) would give each node the right
    keys, but with its ancestors scattered among masked siblings; the reductions of
    softmax and of weights @ values then group the terms differently from plain
    decoding and round differently, and in bf16 that can change a greedy token.
    Gathering each query's keys into the prefix-then-path layout of plain decoding
    keeps verification bit-identical to it (the tests compare token for token).
    """
    batch, query_heads, steps, dim = query.shape
    kv_heads = keys.shape[1]
    groups = query_heads // kv_heads
    rows = torch.arange(batch, device=keys.device)[:, None, None]
    path_keys = keys.permute(0, 2, 1, 3)[rows, tree.index].permute(0, 3, 1, 2, 4)  # [B, Hkv, T, S', D]
    path_values = values.permute(0, 2, 1, 3)[rows, tree.index].permute(0, 3, 1, 2, 4)
    grouped = query.view(batch, kv_heads, groups, steps, dim).transpose(2, 3)  # [B, Hkv, T, G, D]
    scores = torch.matmul(grouped, path_keys.transpose(-1, -2)).float() * dim ** -0.5  # [B, Hkv, T, G, S']
    scores = scores.masked_fill(~tree.mask[:, :, :, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(values.dtype)
    attended = torch.matmul(weights, path_values)  # [B, Hkv, T, G, D]
    return attended.transpose(2, 3).reshape(batch, query_heads, steps, dim)


class MLP(nn.Module):
    def __init__(self, gate_up: nn.Module, down: nn.Module) -> None:
        super().__init__()
        self.gate_up, self.down = gate_up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, attention_norm: RMSNorm, attention: Attention, mlp_norm: RMSNorm, mlp: MLP) -> None:
        super().__init__()
        self.attention_norm, self.attention, self.mlp_norm, self.mlp = attention_norm, attention, mlp_norm, mlp

    def forward(self, x, cos, sin, cache, layer, key_length, mask, tree=None):
        x = x + self.attention(self.attention_norm(x), cos, sin, cache, layer, key_length, mask, tree)
        return x + self.mlp(self.mlp_norm(x))


def attention_mask(starts: list[int], steps: int, key_length: int, among_new: torch.Tensor | None,
                   device: torch.device) -> torch.Tensor | None:
    """[B, 1, T, S] bool: query i of row b sees cached slots < starts[b] and the new slots among_new allows.

    among_new [B, T, T] (None = causal) says which of this forward's tokens
    each new token sees; a tree of drafts passes its ancestor matrix here.
    Returns None when every query sees every key (one token, one row): SDPA's fastest path.
    """
    if among_new is None and steps == 1 and len(starts) == 1:
        return None
    start = torch.tensor(starts, device=device)[:, None, None]  # [B, 1, 1]
    relative = torch.arange(key_length, device=device)[None, None, :] - start  # [B, 1, S] slot - start
    if among_new is None:
        new_visible = relative <= torch.arange(steps, device=device)[None, :, None]  # causal [B, T, S]
    else:
        index = relative.clamp(0, steps - 1).expand(-1, steps, -1)  # [B, T, S]
        new_visible = torch.gather(among_new.to(device=device, dtype=torch.bool), 2, index)
    mask = (relative < 0) | ((relative < steps) & new_visible)  # [B, T, S]
    return mask[:, None]


class NativeDecoder(nn.Module):
    def __init__(self, config: DecoderConfig, embedding: torch.Tensor, blocks: list[Block], norm: RMSNorm,
                 head: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config, self.dtype, self.device = config, dtype, device
        self.embedding = nn.Parameter(embedding, requires_grad=False)  # [V, H]
        self.blocks = nn.ModuleList(blocks)
        self.norm, self.head = norm, head
        self.rotary = Rotary(config.head_dim, config.rope_theta, device)

    @classmethod
    def from_state_dict(cls, config: DecoderConfig, weights: dict[str, torch.Tensor], *, dtype: torch.dtype,
                        device: torch.device, quantize: str = "none",
                        head_rows: torch.Tensor | None = None) -> NativeDecoder:
        """Build from transformers' parameter names (model.layers.N.self_attn.q_proj.weight, ...).

        head_rows [N]: keep only these rows of the output head (a reduced-vocabulary draft head).
        Consumes `weights` (entries are popped as they are converted, to bound peak memory).
        """
        def take(name: str) -> torch.Tensor:
            return weights.pop(name)

        def dense(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(device=device, dtype=dtype)

        def linear(weight, bias=None):
            return make_linear(weight, bias, dtype=dtype, device=device, quantize=quantize)

        blocks = []
        for i in range(config.num_layers):
            prefix = f"model.layers.{i}."
            projections = [take(f"{prefix}self_attn.{p}_proj.weight") for p in "qkv"]
            bias = (torch.cat([take(f"{prefix}self_attn.{p}_proj.bias") for p in "qkv"])
                    if config.qkv_bias else None)
            attention = Attention(config, linear(torch.cat(projections), bias),
                                  linear(take(f"{prefix}self_attn.o_proj.weight")))
            gate_up = linear(torch.cat([take(f"{prefix}mlp.gate_proj.weight"), take(f"{prefix}mlp.up_proj.weight")]))
            mlp = MLP(gate_up, linear(take(f"{prefix}mlp.down_proj.weight")))
            blocks.append(Block(RMSNorm(dense(take(f"{prefix}input_layernorm.weight")), config.rms_norm_eps), attention,
                                RMSNorm(dense(take(f"{prefix}post_attention_layernorm.weight")), config.rms_norm_eps),
                                mlp))
        embedding = take("model.embed_tokens.weight")
        head_weight = embedding if config.tie_word_embeddings or "lm_head.weight" not in weights else take("lm_head.weight")
        if head_rows is not None:
            head_weight = head_weight[head_rows.to(head_weight.device)]
        norm = RMSNorm(dense(take("model.norm.weight")), config.rms_norm_eps)
        return cls(config, dense(embedding), blocks, norm, linear(head_weight), dtype, device)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache, *,
                among_new: torch.Tensor | None = None, last_n_logits: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """token_ids, positions [B, T] -> (logits [B, T', V_head] fp32, hidden [B, T, H]); T' = last_n_logits or T.

        hidden is the final norm's output, the features the output head reads (what
        EAGLE's head predicts, Li et al. 2024, arXiv 2401.15077), for all T tokens.
        Writes the T new keys/values after each row's cached ones and advances the cache.
        """
        steps = token_ids.shape[1]
        key_length = max(cache.seq_lens) + steps
        cache.reserve(key_length)
        if among_new is None:
            mask, tree = attention_mask(cache.seq_lens, steps, key_length, None, self.device), None
        else:  # a tree: each query over its own prefix-then-path keys (tree_attention)
            mask, tree = None, TreeKeys.build(cache.seq_lens, among_new, self.device)
        cos, sin = self.rotary(positions, self.dtype)
        x = nn.functional.embedding(token_ids, self.embedding)  # [B, T, H]
        for layer, block in enumerate(self.blocks):
            x = block(x, cos, sin, cache, layer, key_length, mask, tree)
        cache.advance(steps)
        hidden = self.norm(x)
        scored = hidden[:, -last_n_logits:] if last_n_logits else hidden
        return self.head(scored).float(), hidden
