"""Attention whose result for a query does not depend on who shares its forward pass.

Speculative greedy output equals plain greedy output only if the target's
logits for a position are bit-identical whether that position is decoded alone
(plain decoding), verified among k+1 tokens, as a node of a tree, or beside
other requests' rows. A single `softmax(q k^T) v` over the whole padded key
range breaks that: the number of keys (and queries) changes with the chunking,
and the BLAS library then picks another blocking for the reduction over keys
(measured: chunks [3,3,3] vs [1]*9 differ in bf16 at context 500 under
oneDNN's AVX512_CORE path, and in fp32 at context 7 and 200 on every ISA).

So the reduction over keys is fixed by construction, the rule of the
batch-invariant kernels in vLLM and SGLang (a fixed split size, not a fixed
number of splits), in FlashDecoding's split-KV form (Dao et al. 2023):

1. Keys are cut into blocks of KEY_BLOCK slots aligned to position 0, so a
   query at position p always sees the same blocks, 0 .. p // KEY_BLOCK,
   whatever the forward's length or padding.
2. Within a block every call has the same shape (KEY_BLOCK keys, head_dim),
   whatever the forward: scores, the block's max, exp, the block's sum, and
   weights @ values over exactly KEY_BLOCK keys (masked ones weigh exactly 0).
3. The blocks are combined in fp32, rescaled to the query's overall max (the
   max is exact in any order), by a running sum in block order (`cumsum` runs
   sequentially along a non-innermost dim on CPU and CUDA). Blocks past the
   query's own last block are fully masked; they weigh exactly 0 and come
   after it in that order, so they add nothing: they are skipped, not
   summed as zeros among real terms.

Query rows are padded to whole ROW_TILE tiles: with fewer rows BLAS takes
other paths (a gemv for one row; in fp32 at head_dim 16, 2 rows rounded unlike
18). What remains is that a GEMM's row does not depend on how many whole tiles
share the call; native/invariance.py checks that at the real model's shapes
(the tests under every oneDNN ISA cap, `specdec doctor` on the user's machine).

On a CPU the law runs as one C++ call per layer (kernels/attention.cpp: each
query row loops over its own keys, so invariance holds by construction there
too); the PyTorch form below is what CUDA runs, and the CPU where the kernels
cannot be compiled.
A tree's nodes read the cached prefix in place and gather only their near keys
(TreeKeys, tree_attention): blocked_attention's terms per block (block_terms)
from two calls, concatenated in block order, then combined (combine_blocks).

Cost of the PyTorch form (Qwen2.5-1.5B heads, one layer, `python benchmarks/attention_invariance.py`):
at a few hundred cached tokens a decode step's attention costs somewhat more than the unblocked
two-matmul form, at 4k tokens much more, most of it the fp32 copies of keys and values
(a blocked fp32 cache layout would remove them). On whole steps: benchmarks/RESULTS.md, "Exact on
every machine: batch-invariant decoding (issue 18)".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.models.native import kernels

KEY_BLOCK = 64  # keys per block; also the granularity of the KV cache's capacity
ROW_TILE = 8  # query rows per product are padded to a multiple of this
NEGLIGIBLE_EXPONENT = -60.0  # exp(x) for x below this is taken as exactly 0 (see blocked_attention)
QUERY_CHUNK = 256  # queries per call in a long forward (prefill): bounds memory, changes no value


def round_up(length: int, multiple: int = KEY_BLOCK) -> int:
    return -(-length // multiple) * multiple


def runs_cpu_kernels(device: torch.device) -> bool:
    """Whether attention on `device` runs kernels/attention.cpp (a CPU where it compiled), not the
    PyTorch form below."""
    return device.type == "cpu" and kernels.load() is None


def blocked_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      bias: torch.Tensor) -> torch.Tensor:
    """Softmax attention with a reduction order fixed per query (see the module docstring).

    query  [B, Hkv, Q, M, D]        M query rows per key sequence (grouped heads x tokens)
    keys   [B, Hkv, Qk, S, D]       Qk = Q (a key sequence per query group) or 1 (shared)
    values [B, Hkv, Qk, S, D]       S = nb * KEY_BLOCK
    bias   [B, 1, Q, nb, M'|1, blk] block_bias(): 0 where a row sees a key, -inf where not;
                                    M' = M padded to whole ROW_TILE tiles
    returns [B, Hkv, Q, M, D]       in values.dtype; computed in fp32 throughout (bf16
                                    keys would be copied out of the cache's layout anyway)

    Worked example, KEY_BLOCK = 2, one query at position 2 (keys 0, 1, 2 visible, S = 4):
    blocks {0, 1} and {2, 3}; block 1's key 3 is masked, so its weight is exactly 0;
    out = (e0 v0 + e1 v1) * r0 + (e2 v2 + 0 v3) * r1, normalised by
    (e0 + e1) r0 + (e2 + 0) r1, where e are exp(score - block max) and r rescale
    each block's max to the overall max. In a forward padded to S = 6, block {4, 5}
    is all masked, gets r = 0 and comes last: the same terms in the same order.
    """
    if runs_cpu_kernels(query.device):  # the same law in one call (kernels/attention.cpp)
        return torch.ops.specdec_attention.blocked(query, keys, values, bias, KEY_BLOCK)
    rows = query.shape[-2]
    if rows % ROW_TILE:  # see the module docstring: pad to whole tiles, drop the padding after
        padded = torch.nn.functional.pad(query, (0, 0, 0, round_up(rows, ROW_TILE) - rows))
        return blocked_attention(padded, keys, values, bias)[..., :rows, :]
    return combine_blocks(*block_terms(query, keys, values, bias), values.dtype)


def block_terms(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocked_attention's terms of each key block, before they are combined (rows in whole tiles):
    each block's max [.., nb, M, 1], its sum of weights [.., nb, M, 1] and its weighted values
    [.., nb, M, D]. A query's terms from two calls over disjoint blocks, concatenated in block
    order, are the terms of one call over all of them (tree_attention's split form)."""
    dim = query.shape[-1]
    blocks = keys.shape[-2] // KEY_BLOCK
    key_blocks = keys.float().unflatten(-2, (blocks, KEY_BLOCK))  # [B, Hkv, Qk, nb, blk, D]
    value_blocks = values.float().unflatten(-2, (blocks, KEY_BLOCK))
    scores = torch.matmul(query.float().unsqueeze(3), key_blocks.transpose(-1, -2))  # [B, Hkv, Q, nb, M, blk]
    scores = torch.add(bias, scores, alpha=dim ** -0.5)  # masked keys -inf
    # An all-masked block's max is -inf; the floor keeps exp(-inf - max) at 0 instead of NaN.
    block_max = scores.amax(dim=-1, keepdim=True).clamp_min_(torch.finfo(torch.float32).min)
    # Weights below e^-60 (1e-26 of the block's largest) become exactly 0: they are far below
    # fp32's resolution, and as denormals they cost many times a normal op on some CPUs, enough to slow
    # a decode step on an AVX2 path (benchmarks/RESULTS.md, "Exact on every machine: batch-invariant
    # decoding (issue 18)"). Masked keys (-inf) stay exactly 0.
    weights = torch.nn.functional.threshold_(scores.sub_(block_max), NEGLIGIBLE_EXPONENT, float("-inf")).exp_()
    block_sums = weights.sum(dim=-1, keepdim=True)  # a fixed-length (KEY_BLOCK) reduction per row
    block_outs = torch.matmul(weights, value_blocks)  # [B, Hkv, Q, nb, M, D], K = KEY_BLOCK
    return block_max, block_sums, block_outs


def combine_blocks(block_max: torch.Tensor, block_sums: torch.Tensor, block_outs: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """block_terms' terms [B, Hkv, Q, nb, M, *] -> the attention [B, Hkv, Q, M, D] in dtype: each
    block rescaled to the query's overall max, then summed in block order."""
    rescale = block_max.sub_(block_max.amax(dim=3, keepdim=True))  # 0 for all-masked blocks, after exp
    rescale = torch.nn.functional.threshold_(rescale, NEGLIGIBLE_EXPONENT, float("-inf")).exp_()
    total = running_sum(block_sums.mul_(rescale))  # [B, Hkv, Q, M, 1]
    return running_sum(block_outs.mul_(rescale)).div_(total).to(dtype)


def running_sum(x: torch.Tensor) -> torch.Tensor:
    """x [B, Hkv, Q, nb, M, E] summed over nb strictly in block order -> [B, Hkv, Q, M, E].

    cumsum is a sequential scan along a non-innermost dim (CPU accumulates in
    double), so trailing all-zero blocks leave the last element unchanged; a
    plain sum() may group terms by the dim's length (cascade summation).
    """
    return x.cumsum(dim=3).select(3, -1)


def block_bias(visible: torch.Tensor) -> torch.Tensor:
    """visible [B, 1, Q, M, S] bool -> bias [B, 1, Q, nb, M', KEY_BLOCK] fp32: 0 if seen, -inf if not.

    M' = M padded to whole ROW_TILE tiles (M == 1 stays a row broadcast to all);
    padding rows see every key, so their values stay finite (they are dropped)."""
    rows = visible.shape[-2]
    if rows > 1 and rows % ROW_TILE:
        visible = torch.nn.functional.pad(visible, (0, 0, 0, round_up(rows, ROW_TILE) - rows), value=True)
    blocked = visible.unflatten(-1, (visible.shape[-1] // KEY_BLOCK, KEY_BLOCK)).transpose(3, 4)
    zeros = torch.zeros((), dtype=torch.float32, device=visible.device)
    return torch.where(blocked, zeros, float("-inf"))


@dataclass(frozen=True)
class ChainChunk:
    """Queries first..last-1 of a chain forward: the key slots they can see (length, whole
    blocks) and their bias. Built once per forward, shared by every layer."""
    first: int
    last: int
    length: int
    bias: torch.Tensor  # [B, 1, 1, nb, G * (last - first) in whole ROW_TILEs, KEY_BLOCK]

    @staticmethod
    def plan(starts: list[int], steps: int, groups: int, device: torch.device) -> list[ChainChunk]:
        """A long forward (prefill) goes QUERY_CHUNK queries at a time, each chunk only over
        the key blocks its last query can see: identical values (blocks past a query's
        own are skipped anyway), bounded memory, half the work of a causal prefill."""
        chunks = []
        start = torch.tensor(starts, device=device)
        for first in range(0, steps, QUERY_CHUNK):
            last = min(first + QUERY_CHUNK, steps)
            length = round_up(max(starts) + last)
            chunks.append(ChainChunk(first, last, length, ChainChunk.bias_of(start, first, last, length, groups)))
        return chunks

    @staticmethod
    def bias_of(start: torch.Tensor, first: int, last: int, length: int, groups: int) -> torch.Tensor:
        """The bias of queries first..last-1 over `length` key slots, from the rows' cached lengths
        start [B] on the device: tensor ops alone, so a CUDA graph records it (captured.py)."""
        device = start.device
        # Token i of row b sees the row's cached slots and the new ones up to itself.
        relative = torch.arange(length, device=device)[None, None, :] - start[:, None, None]  # [B, 1, S]
        visible = relative <= torch.arange(first, last, device=device)[None, :, None]  # [B, t, S]
        visible = visible[:, None, :].expand(-1, groups, -1, -1).reshape(start.shape[0], 1, 1, -1, length)
        return block_bias(visible)


def chain_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    chunks: list[ChainChunk]) -> torch.Tensor:
    """Grouped-query attention (Ainslie et al. 2023, arXiv 2305.13245) of a chain of new tokens.

    query [B, Hq, T, D]; keys, values [B, Hkv, S, D] (the cache) -> [B, Hq, T, D].
    Query heads h = j * G + g share kv head j: each group's G x t queries meet its
    one kv head without copying keys.
    """
    batch, query_heads, steps, dim = query.shape
    kv_heads = keys.shape[1]
    groups = query_heads // kv_heads
    grouped = query.view(batch, kv_heads, groups, steps, dim)
    outs = []
    for chunk in chunks:
        count = chunk.last - chunk.first
        rows = grouped[:, :, :, chunk.first:chunk.last].reshape(batch, kv_heads, 1, groups * count, dim)
        attended = blocked_attention(rows, keys[:, :, None, :chunk.length], values[:, :, None, :chunk.length],
                                     chunk.bias)
        outs.append(attended.reshape(batch, kv_heads, groups, count, dim))
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=3)).reshape(batch, query_heads, steps, dim)


@dataclass(frozen=True)
class TreeKeys:
    """Per query of a tree forward, the cache slots it attends to, in the order plain decoding has them.

    Plain decoding of a node's path sees the row's cached prefix, then the path's keys (root first)
    right after it. A mask over the whole forward would give each node the right keys, but with its
    ancestors scattered among masked siblings, in other blocks than plain decoding has them; so
    each node's keys are laid out as plain decoding has them (gathered_layout), which puts them in
    the same blocks, and verification is bit-identical to it. Gathering every node's whole
    sequence copies O(nodes x context) keys, so the forms below read the prefix's whole blocks in
    place, shared by the nodes, and gather only each node's tail:

    - the CPU kernel (kernels/attention.cpp's tree op): the first shared_blocks blocks are the
      prefix's whole blocks common to every row; tail_index [B, T, St] and tail_bias
      [B, T, nbt, KEY_BLOCK] are each node's slots from block shared_blocks on.
    - the PyTorch form (CUDA): far_bias [B, 1, 1, nb, 1, 1] over the `width` slots read in place
      shows each row its own whole prefix blocks (start // KEY_BLOCK of them); near_index [B, T, Sn]
      and near_bias [B, 1, T, nbn, 1, KEY_BLOCK] are each node's slots from its row's first partial
      block on. Sn depends on the node count alone, so a recorded CUDA step keeps its shapes.

    build() makes only the form that runs on its device (runs_cpu_kernels); the other's fields are None.
    """
    shared_blocks: int
    tail_index: torch.Tensor | None  # the CPU kernel's form
    tail_bias: torch.Tensor | None
    far_bias: torch.Tensor | None  # the PyTorch form
    near_index: torch.Tensor | None
    near_bias: torch.Tensor | None

    @staticmethod
    def build(starts: list[int], among_new: torch.Tensor, device: torch.device, width: int | None = None) -> TreeKeys:
        """among_new [B, T, T]: which new tokens each new token sees (itself and its ancestors).
        width: the key slots the in-place part views (whole blocks; default the fewest that hold
        the longest row's prefix and path)."""
        visible = among_new.to(device="cpu", dtype=torch.bool)
        counts = visible.sum(dim=-1)  # [B, T]
        needed = round_up(max(starts) + int(counts.max()))
        if width is None:
            width = needed
        elif width < needed or width % KEY_BLOCK:
            raise ValueError(f"a tree over {needed} key slots cannot attend over {width}")
        batch, steps = visible.shape[:2]
        start = torch.tensor(starts)
        shared_blocks = min(starts) // KEY_BLOCK
        if runs_cpu_kernels(device):
            tail_index, tail_seen = _tree_slots(start, visible, counts, shared_blocks * KEY_BLOCK + torch.arange(
                width - shared_blocks * KEY_BLOCK)[None].expand(batch, -1))
            tail_bias = block_bias(tail_seen[:, None, :, None, :]).reshape(batch, steps, -1, KEY_BLOCK)
            return TreeKeys(shared_blocks, tail_index, tail_bias, None, None, None)
        own_blocks = start // KEY_BLOCK  # [B] each row's whole prefix blocks
        far = torch.arange(width // KEY_BLOCK)[None] < own_blocks[:, None]  # [B, nb]
        zeros = torch.zeros(())
        far_bias = torch.where(far, zeros, float("-inf"))[:, None, None, :, None, None]
        near_width = round_up(KEY_BLOCK - 1 + steps)  # a partial block of prefix, then a path of <= steps
        near_index, near_seen = _tree_slots(start, visible, counts,
                                            own_blocks[:, None] * KEY_BLOCK + torch.arange(near_width)[None])
        near_bias = block_bias(near_seen[:, None, :, None, :])
        return TreeKeys(shared_blocks, None, None, far_bias.to(device), near_index.to(device), near_bias.to(device))

    @staticmethod
    def gathered_layout(starts: list[int], among_new: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each node's whole key sequence as plain decoding has it, the reference both forms keep
        the bits of: index [B, T, width] slots and bias [B, 1, T, nb, 1, KEY_BLOCK] (block_bias)."""
        visible = among_new.to(dtype=torch.bool)
        index, seen = _tree_slots(torch.tensor(starts), visible, visible.sum(dim=-1),
                                  torch.arange(width)[None].expand(len(starts), -1))
        return index, block_bias(seen[:, None, :, None, :])


def _tree_slots(start: torch.Tensor, visible: torch.Tensor, counts: torch.Tensor,
                column: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache slot at each of `column` [B, W] (positions in plain decoding's layout) for every
    node: index [B, T, W] and seen [B, T, W]. Below the row's start a position is its own slot;
    then come the new slots the node sees, in order (a stable sort puts the seen columns first,
    ascending); after them padding (slot 0, not seen)."""
    batch, steps = visible.shape[:2]
    start, column = start[:, None, None], column[:, None, :]  # [B, 1, 1], [B, 1, W]
    seen_in_order = torch.argsort((~visible).to(torch.uint8), dim=-1, stable=True)  # [B, T, T]
    offset = (column - start).clamp(0, steps - 1).expand(batch, steps, -1)
    index = torch.where(column < start, column, start + torch.gather(seen_in_order, 2, offset))
    seen = column < start + counts[..., None]  # [B, T, W]
    return torch.where(seen, index, 0), seen


def tree_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tree: TreeKeys) -> torch.Tensor:
    """Attention of a tree's queries, each over its own key sequence (TreeKeys): [B, Hq, T, D].

    On a CPU one kernel call per layer; elsewhere the prefix's whole blocks are attended in place
    by every node's rows at once (as a chain's), each node's near blocks gathered, and the two
    sets of block terms combined in block order: a row's in-place blocks past its own are all
    masked and add exact zeros, so the sum is plain decoding's, term for term.
    """
    batch, query_heads, steps, dim = query.shape
    kv_heads = keys.shape[1]
    groups = query_heads // kv_heads
    rows = torch.arange(batch, device=keys.device)[:, None, None]
    grouped = query.view(batch, kv_heads, groups, steps, dim).transpose(2, 3)  # [B, Hkv, T, G, D]
    if runs_cpu_kernels(query.device):  # kernels/attention.cpp's tree op
        tail_keys = keys.permute(0, 2, 1, 3)[rows, tree.tail_index].permute(0, 3, 1, 2, 4)  # [B, Hkv, T, St, D]
        tail_values = values.permute(0, 2, 1, 3)[rows, tree.tail_index].permute(0, 3, 1, 2, 4)
        attended = torch.ops.specdec_attention.tree(grouped, keys, values, tail_keys, tail_values, tree.tail_bias,
                                                    tree.shared_blocks, KEY_BLOCK)
        return attended.transpose(2, 3).reshape(batch, query_heads, steps, dim)
    tile = round_up(groups, ROW_TILE)
    padded = torch.nn.functional.pad(grouped, (0, 0, 0, tile - groups))  # [B, Hkv, T, G', D]
    width = tree.far_bias.shape[3] * KEY_BLOCK
    far = block_terms(padded.reshape(batch, kv_heads, 1, steps * tile, dim), keys[:, :, None, :width],
                      values[:, :, None, :width], tree.far_bias)  # each [B, Hkv, 1, nb, T * G', E]
    near_keys = keys.permute(0, 2, 1, 3)[rows, tree.near_index].permute(0, 3, 1, 2, 4)  # [B, Hkv, T, Sn, D]
    near_values = values.permute(0, 2, 1, 3)[rows, tree.near_index].permute(0, 3, 1, 2, 4)
    near = block_terms(padded, near_keys, near_values, tree.near_bias)  # each [B, Hkv, T, nbn, G', E]
    near = [term.transpose(2, 3).flatten(3, 4).unsqueeze(2) for term in near]  # [B, Hkv, 1, nbn, T * G', E]
    terms = (torch.cat(pair, dim=3) for pair in zip(far, near))
    attended = combine_blocks(*terms, values.dtype).view(batch, kv_heads, steps, tile, dim)[..., :groups, :]
    return attended.transpose(2, 3).reshape(batch, query_heads, steps, dim)


@dataclass(frozen=True)
class AttentionPlan:
    """What every layer of one forward needs to attend: built once per forward.

    key_length: cache slots to view (whole blocks); chain: the chunks of a chain of new
    tokens, or tree: each tree node's own keys.
    """
    key_length: int
    chain: list[ChainChunk] | None = None
    tree: TreeKeys | None = None

    @staticmethod
    def build(starts: list[int], steps: int, groups: int, among_new: torch.Tensor | None,
              device: torch.device) -> AttentionPlan:
        key_length = round_up(max(starts) + steps)
        if among_new is None:
            return AttentionPlan(key_length, chain=ChainChunk.plan(starts, steps, groups, device))
        return AttentionPlan(key_length, tree=TreeKeys.build(starts, among_new, device))

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """query [B, Hq, T, D]; keys, values [B, Hkv, key_length, D] -> [B, Hq, T, D]."""
        if self.tree is not None:
            return tree_attention(query, keys, values, self.tree)
        return chain_attention(query, keys, values, self.chain)


# Draft-side attention. A proposer's numerics change which tokens it guesses, never
# the output (the target verifies every guess), so EAGLE heads keep the plain
# two-matmul form over their own small cache.

def grouped_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      mask: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention (Ainslie et al. 2023, arXiv 2305.13245) as two batched matmuls.

    query [B, Hq, T, D]; keys, values [B, Hkv, S, D]; mask [B, 1, T, S] bool or None -> [B, Hq, T, D].
    Query heads h = j * G + g share kv head j, so a reshape puts each group's
    G x T queries against its one kv head without copying keys. For decoding's
    few queries this beats SDPA's CPU kernel several times over in bf16 (one query
    over a few hundred keys); softmax runs in fp32 as in transformers.
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
