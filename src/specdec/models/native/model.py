"""The Qwen2 / Llama decoder in plain PyTorch, reading and writing a StaticKVCache.

Same math as transformers' Qwen2ForCausalLM / LlamaForCausalLM (pre-norm
blocks, RMSNorm in fp32, rotate-half RoPE, grouped-query attention, SwiGLU),
with three changes for decoding speed: q/k/v and gate/up are fused into one
projection each (one weight read, one kernel call), the KV cache is static
(kv_cache.py), and any T >= 1 new tokens may come in at once with an optional
mask among them (tree drafts), because verification feeds k+1 tokens per step.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from specdec.models.huge_pages import move_to_huge_pages
from specdec.models.kv_cache import StaticKVCache
from specdec.models.native import kernels
from specdec.models.native.attention import KEY_BLOCK, AttentionPlan
from specdec.models.native.config import DecoderConfig
from specdec.models.native.linear import head_quantization, make_linear
from specdec.models.native.w4a8 import ISA_PATHS, W4A8Linear


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_layer_ops(x) and x.dtype == self.weight.dtype:  # the same law in one call (kernels/layer_ops.cpp)
            return torch.ops.specdec_layer.rms_norm(x, self.weight, self.eps)
        # In fp32 whatever the compute dtype, as transformers does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def fused_layer_ops(x: torch.Tensor) -> bool:
    """Whether x's layer ops run as specdec's CPU kernels (kernels/layer_ops.cpp) rather than PyTorch ops."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and kernels.load() is None


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


class Packing:
    """A ragged batch: rows of different lengths padded to [B, T], of which `valid` marks the real
    tokens. The projections and norms (nearly all of a forward's work) run on the N real tokens
    packed as [1, N, ...]; only rotary, the cache and attention see the padded [B, T] layout. A
    projection's rows never depend on how many rows share its call (linear.batch_invariant), so a
    token's output is the same packed or padded; the padding's cache entries are garbage that the
    caller's rollback drops (they come after each row's real tokens, which never see them)."""

    def __init__(self, valid: torch.Tensor) -> None:  # [B, T] bool
        self.batch, self.steps = valid.shape
        self.index = valid.reshape(-1).nonzero().squeeze(1)  # [N] flat positions of the real tokens

    def pack(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, F] -> [1, N, F]
        return x.reshape(self.batch * self.steps, -1).index_select(0, self.index)[None]

    def unpack(self, x: torch.Tensor) -> torch.Tensor:  # [1, N, F] -> [B, T, F], zeros at the padding
        out = x.new_zeros(self.batch * self.steps, x.shape[-1])
        return out.index_copy_(0, self.index, x[0]).view(self.batch, self.steps, -1)


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig, qkv: nn.Module, out: nn.Module) -> None:
        super().__init__()
        self.qkv, self.out = qkv, out
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: StaticKVCache, layer: int,
                plan: AttentionPlan, packing: Packing | None = None) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv(x)  # [B, T, q_size + 2 kv_size] ([1, N, ...] packed)
        if packing is not None:
            qkv = packing.unpack(qkv)
        batch, steps, _ = qkv.shape
        if fused_layer_ops(qkv) and cos.dtype == qkv.dtype:  # the same ops in one call (kernels/layer_ops.cpp)
            query, key, value = torch.ops.specdec_layer.split_rope(qkv, cos, sin, self.num_heads,
                                                                   self.num_kv_heads, self.head_dim)
        else:
            query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
            query = query.view(batch, steps, self.num_heads, self.head_dim).transpose(1, 2)  # [B, Hq, T, D]
            key = key.view(batch, steps, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
            value = value.view(batch, steps, self.num_kv_heads, self.head_dim).transpose(1, 2)
            query = query * cos + rotate_half(query) * sin
            key = key * cos + rotate_half(key) * sin
        cache.write(layer, key, value)
        keys, values = cache.view(layer, plan.key_length)  # [B, Hkv, S, D], whole key blocks
        attended = plan.attend(query, keys, values).transpose(1, 2).reshape(batch, steps, q_size)  # [B, T, q_size]
        return self.out(attended if packing is None else packing.pack(attended))


class MLP(nn.Module):
    def __init__(self, gate_up: nn.Module, down: nn.Module) -> None:
        super().__init__()
        self.gate_up, self.down = gate_up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if fused_layer_ops(gate_up):  # specdec's law for silu(gate) * up, in one pass (kernels/layer_ops.cpp)
            return self.down(torch.ops.specdec_layer.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, attention_norm: RMSNorm, attention: Attention, mlp_norm: RMSNorm, mlp: MLP) -> None:
        super().__init__()
        self.attention_norm, self.attention, self.mlp_norm, self.mlp = attention_norm, attention, mlp_norm, mlp

    def forward(self, x, cos, sin, cache, layer, plan, packing=None):
        x = x + self.attention(self.attention_norm(x), cos, sin, cache, layer, plan, packing)
        return x + self.mlp(self.mlp_norm(x))


# How a chain forward runs its blocks: all in one C++ call (the default), one call a block, or Block.forward's
# op-by-op form. The same bits in all three (tests/models/test_layer_ops.py); benchmarks/native_kernels.py
# --blocks times them.
BLOCK_FORMS = ("one call", "a call a block", "op by op")


class ChainCall:
    """w4a8 blocks first_layer, first_layer + 1, ... over a chain of new tokens as one C++ call
    (kernels/block.cpp's chain_layers): the same ops in the same order as Block.forward's op-by-op
    form, so the same bits, without ~40 Python-dispatched ops a layer (more of the 1.5B target's step
    than attention on a 2-core Zen 4: docs/history.md, "Decoder blocks in one call, prompt caching in
    `specdec serve` (issues 20 and 21, progress)") and the Python loop over blocks (a few percent
    of a step: docs/history.md, "Every block in one call: the layer loop in C++ (issue 38,
    item 3)"). Trees, ragged batches and prefills longer than one query chunk keep the op-by-op form."""

    def __init__(self, blocks: list[Block], first_layer: int) -> None:
        first = blocks[0]
        self.first_layer = first_layer
        self.norms = [norm.weight for block in blocks for norm in (block.attention_norm, block.mlp_norm)]
        self.eps = first.attention_norm.eps
        self.weights, self.biases = [], []
        for block in blocks:
            for linear in _projections(block):
                self.weights += [linear.packed, linear.codes, linear.supers]
                self.biases.append(linear.bias)
        self.outputs = [linear.out_features for linear in _projections(first)]
        self.isa = ISA_PATHS[first.attention.qkv.path]
        self.dtype = first.attention.qkv.dtype
        self.heads = (first.attention.num_heads, first.attention.num_kv_heads, first.attention.head_dim)

    @staticmethod
    def of(blocks, first_layer: int = 0) -> ChainCall | None:
        """The call for blocks whose projections are all w4a8 of one path and dtype, with the same shapes
        and norms in that dtype, where the kernels run here; else None."""
        blocks = list(blocks)
        if not blocks or kernels.load() is not None:
            return None
        projections = [linear for block in blocks for linear in _projections(block)]
        if not all(isinstance(linear, W4A8Linear) for linear in projections):
            return None

        def shapes(block: Block) -> tuple:
            attention = block.attention
            return ([linear.out_features for linear in _projections(block)], block.attention_norm.eps,
                    attention.num_heads, attention.num_kv_heads, attention.head_dim)

        dtypes = {linear.dtype for linear in projections}
        norm_dtypes = {norm.weight.dtype for block in blocks for norm in (block.attention_norm, block.mlp_norm)}
        if (len({linear.path for linear in projections}) != 1 or len(dtypes) != 1 or norm_dtypes != dtypes
                or any(shapes(block) != shapes(blocks[0]) for block in blocks)):
            return None
        return ChainCall(blocks, first_layer)

    def covers(self, x: torch.Tensor, cos: torch.Tensor, cache, plan: AttentionPlan, packing) -> bool:
        return (packing is None and plan.chain is not None and len(plan.chain) == 1 and x.device.type == "cpu"
                and x.dtype == self.dtype and cos.dtype == self.dtype and hasattr(cache, "storage"))

    def __call__(self, x, cos, sin, cache, plan: AttentionPlan, capture: tuple[int, ...] = ()):
        """-> (the last block's output, {layer: the stream entering it} for each layer in capture)."""
        keys, values, first_row = cache.storage()
        heads, kv_heads, dim = self.heads
        out = torch.ops.specdec_block.chain_layers(
            x, self.norms, self.eps, self.weights, self.biases, self.outputs, self.isa, cos, sin,
            heads, kv_heads, dim, keys, values, first_row, list(cache.seq_lens), plan.key_length,
            plan.chain[0].bias, KEY_BLOCK, list(capture), self.first_layer)
        return out[0], dict(zip(capture, out[1:]))


def _projections(block: Block) -> tuple[nn.Module, ...]:
    """A block's four projections, in block.cpp's order."""
    return block.attention.qkv, block.attention.out, block.mlp.gate_up, block.mlp.down


class NativeDecoder(nn.Module):
    def __init__(self, config: DecoderConfig, embedding: torch.Tensor, blocks: list[Block], norm: RMSNorm,
                 head: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config, self.dtype, self.device = config, dtype, device
        self.embedding = nn.Parameter(embedding, requires_grad=False)  # [V, H]
        self.blocks = nn.ModuleList(blocks)
        self.norm, self.head = norm, head
        self.rotary = Rotary(config.head_dim, config.rope_theta, device)
        # Before the block calls keep their own references: every step streams the blocks' and the
        # head's weights, and on 2 MB pages it fetches them faster (models/huge_pages.py). The mapping
        # that holds them (none where nothing moved) is what `specdec doctor` reads for the weight
        # floor: a tuple, so that analysis/roofline.py's weight_bytes does not count its bytes twice.
        pages = move_to_huge_pages([*self.blocks, self.head], keep=(self.embedding,))
        self.weight_pages: tuple[torch.Tensor, ...] = (pages,) if pages.numel() else ()
        self.chain_call = ChainCall.of(self.blocks)  # every block in one call, where they are all w4a8
        self.block_form = BLOCK_FORMS[0]
        # EAGLE-3 reads several layers' features instead of the final one (capture_layers).
        self.feature_layers: tuple[int, ...] = ()

    def capture_layers(self, layers: tuple[int, ...] | list[int]) -> None:
        """forward's hidden becomes the residual stream entering each of `layers`, concatenated
        [B, T, len(layers) x H], instead of the final norm's output: EAGLE-3's low, middle and
        high features (Li et al. 2025, arXiv 2503.01840), taken where vLLM takes them (the input
        of layer i, i.e. the output of layer i - 1), so a head trained here reads in vLLM what it
        read here. () restores the final features; layer L (the number of layers) names them
        among the others (training reads both in one pass)."""
        for layer in layers:
            if not 0 <= layer <= len(self.blocks):
                raise ValueError(f"feature layer {layer} is outside the target's {len(self.blocks)} layers "
                                 f"(0..{len(self.blocks) - 1}, or {len(self.blocks)} for the final features)")
        self.feature_layers = tuple(layers)

    @classmethod
    def from_state_dict(cls, config: DecoderConfig, weights: dict[str, torch.Tensor], *, dtype: torch.dtype,
                        device: torch.device, quantize: str = "none",
                        head_rows: torch.Tensor | None = None, head_quantize: str | None = None) -> NativeDecoder:
        """Build from transformers' parameter names (model.layers.N.self_attn.q_proj.weight, ...).

        head_rows [N]: keep only these rows of the output head (a reduced-vocabulary draft head).
        head_quantize: the output head's format (default: linear.head_quantization(quantize)).
        Consumes `weights` (entries are popped as they are converted, to bound peak memory).
        """
        def take(name: str) -> torch.Tensor:
            return weights.pop(name)

        def dense(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(device=device, dtype=dtype)

        def linear(weight, bias=None, quantize=quantize):
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
        head = linear(head_weight, quantize=head_quantize or head_quantization(quantize))
        return cls(config, dense(embedding), blocks, norm, head, dtype, device)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache, *,
                among_new: torch.Tensor | None = None, last_n_logits: int | None = None,
                valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """token_ids, positions [B, T] -> (logits [B, T', V_head] fp32, hidden [B, T, H]); T' = last_n_logits or T.

        hidden is the final norm's output, the features the output head reads (what
        EAGLE's head predicts, Li et al. 2024, arXiv 2401.15077), for all T tokens.
        Writes the T new keys/values after each row's cached ones and advances the cache.
        valid [B, T] bool: the real tokens of a ragged batch (Packing); the padding's logits
        and hidden are zeros. None: every token is real.
        """
        packing = None
        if valid is not None and not bool(valid.all()):
            if last_n_logits is not None:
                raise ValueError("a ragged forward (valid) returns every position's logits: no last_n_logits")
            packing = Packing(valid.to(token_ids.device))
        steps = token_ids.shape[1]
        cache.reserve(max(cache.seq_lens) + steps)
        plan = AttentionPlan.build(list(cache.seq_lens), steps, self.query_groups, among_new, self.device)
        logits, hidden = self.run(token_ids, positions, cache, plan, packing=packing, last_n_logits=last_n_logits)
        cache.advance(steps)
        return logits, hidden

    @functools.cached_property
    def calls_a_block(self) -> list[ChainCall | None]:
        """One ChainCall per block: the "a call a block" form, which tests and benchmarks compare."""
        return [ChainCall.of([block], layer) for layer, block in enumerate(self.blocks)]

    @property
    def query_groups(self) -> int:
        """Query heads per kv head."""
        return self.config.num_heads // self.config.num_kv_heads

    def run(self, token_ids: torch.Tensor, positions: torch.Tensor, cache, plan: AttentionPlan, *,
            packing: Packing | None = None, last_n_logits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """forward's layers, norm and head over a built attention plan. It reads no host-side
        state and moves no cache length (forward does both), so a CUDA graph can record it
        whole (captured.py); cache only needs write(layer, keys, values) and view(layer, length)."""
        cos, sin = self.rotary(positions, self.dtype)
        x = nn.functional.embedding(token_ids, self.embedding)  # [B, T, H]
        if packing is not None:
            x = packing.pack(x)  # [1, N, H]
        whole = self.chain_call if self.block_form == "one call" else None
        if whole is not None and whole.covers(x, cos, cache, plan, packing):
            x, captured = whole(x, cos, sin, cache, plan, tuple(n for n in self.feature_layers if n < len(self.blocks)))
        else:
            captured = {}  # layer -> the stream entering it
            for layer, block in enumerate(self.blocks):
                if layer in self.feature_layers:
                    captured[layer] = x
                alone = self.calls_a_block[layer] if self.block_form == "a call a block" else None
                if alone is not None and alone.covers(x, cos, cache, plan, packing):
                    x = alone(x, cos, sin, cache, plan)[0]
                else:
                    x = block(x, cos, sin, cache, layer, plan, packing)
        hidden = self.norm(x)
        scored = hidden[:, -last_n_logits:] if last_n_logits else hidden
        logits = self.head(scored).float()
        if self.feature_layers:
            captured[len(self.blocks)] = hidden
            hidden = torch.cat([captured[layer] for layer in self.feature_layers], dim=-1)
        if packing is not None:
            logits, hidden = packing.unpack(logits), packing.unpack(hidden)
        return logits, hidden
