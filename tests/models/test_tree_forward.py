"""A tree of drafts in one native forward: each node's logits are its path's, and keeping
the accepted path leaves the cache as if only that path had been fed."""

import pytest
import torch

from specdec.sampling.tree import tree_attention_mask, tree_depths, tree_paths
from conftest import make_model, make_native

PREFIX = [5, 9, 12, 3, 7, 20]
PARENTS = [-1, -1, 0, 0, 2, 1, 4]  # root -> 0 -> {2 -> 4 -> 6, 3}; root -> 1 -> 5
TOKENS = [11, 30, 8, 17, 25, 4, 40]


def _prefilled(model):
    runner = make_native(model)
    runner.forward(torch.tensor([PREFIX[:-1]]), torch.arange(len(PREFIX) - 1)[None])
    return runner


def _tree_forward(runner):
    start = len(PREFIX) - 1
    inputs = torch.tensor([[PREFIX[-1], *TOKENS]])
    positions = start + torch.tensor([[0, *tree_depths(PARENTS)]])
    return runner.forward(inputs, positions, among_new=tree_attention_mask(PARENTS)[None])


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_each_node_sees_only_its_path(family):
    model = make_model(seed=3, family=family)
    tree = _tree_forward(_prefilled(model))
    for path in tree_paths(PARENTS):
        chain_runner = _prefilled(model)
        inputs = torch.tensor([[PREFIX[-1], *[TOKENS[i] for i in path]]])
        chain = chain_runner.forward(inputs, torch.arange(len(PREFIX) - 1, len(PREFIX) + len(path))[None])
        picked = [0] + [i + 1 for i in path]
        assert torch.allclose(tree.logits[0, picked], chain.logits[0], atol=1e-4)
        assert torch.allclose(tree.hidden[0, picked], chain.hidden[0], atol=1e-4)


def test_keep_path_leaves_the_cache_of_the_path_alone():
    model = make_model(seed=4)
    runner = _prefilled(model)
    _tree_forward(runner)
    start = len(PREFIX) - 1
    path = [0, 2, 4]
    runner.keep_path(start, [i + 1 for i in path])
    assert runner.seq_len == start + 1 + len(path)
    following = torch.tensor([[TOKENS[6], 33]])  # continue after the kept path
    next_positions = torch.arange(runner.seq_len, runner.seq_len + 2)[None]
    after_tree = runner.forward(following, next_positions).logits
    fresh = make_native(model)
    fresh.forward(torch.tensor([PREFIX + [TOKENS[i] for i in path]]), torch.arange(len(PREFIX) + len(path))[None])
    assert torch.allclose(after_tree, fresh.forward(following, next_positions).logits, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_tree_kernel_reads_the_prefix_in_place_with_the_gathered_sequences_bits(dtype):
    """kernels/attention.cpp's tree op (the cached prefix's whole blocks read in place, shared by the
    nodes; only each node's tail gathered) against the blocked op over each node's whole gathered
    sequence (what the tree path ran before): the same bits, for two rows with different prefixes
    (so the shared blocks are the shorter row's), 64 and 128 dims, 1 to 17 nodes."""
    from specdec.models.native import kernels
    from specdec.models.native.attention import KEY_BLOCK, TreeKeys, tree_attention

    if kernels.load() is not None:
        pytest.skip(f"no kernels here: {kernels.load()}")
    generator = torch.Generator().manual_seed(11)
    for dim, starts, nodes in [(128, [300, 130], 9), (64, [800, 700], 17), (128, [5, 70], 4), (64, [64, 128], 1)]:
        parents = [(i - 1) // 2 - 1 for i in range(1, nodes)]  # the drafts' parents (-1: the root)
        among = tree_attention_mask(parents).expand(len(starts), -1, -1)  # [B, nodes, nodes], the root first
        tree = TreeKeys.build(starts, among, torch.device("cpu"))
        assert tree.shared_blocks == min(starts) // KEY_BLOCK
        keys, values, query = _random_cache(starts, nodes, dim, dtype, generator)
        got = tree_attention(query, keys, values, tree)
        assert torch.equal(got, _gathered_attention(starts, among, query, keys, values)), (dim, starts, nodes)


def _random_cache(starts, nodes, dim, dtype, generator):
    """keys, values [B, 2, S, D] of a cache with room for the tree; query [B, 12, nodes, D]."""
    from specdec.models.native.attention import round_up

    length = round_up(max(starts) + nodes) + 64  # slots past the tree, as in a cache with room to spare
    keys, values = (torch.randn(len(starts), 2, length, dim, generator=generator).to(dtype) for _ in range(2))
    return keys, values, torch.randn(len(starts), 12, nodes, dim, generator=generator).to(dtype)


def _gathered_attention(starts, among, query, keys, values):
    """The reference: every node's whole key sequence gathered into plain decoding's layout, one
    blocked attention over each."""
    from specdec.models.native.attention import TreeKeys, blocked_attention, round_up

    batch, heads, nodes, dim = query.shape
    index, bias = TreeKeys.gathered_layout(starts, among, round_up(max(starts) + nodes))
    rows = torch.arange(batch)[:, None, None]
    path_keys = keys.permute(0, 2, 1, 3)[rows, index].permute(0, 3, 1, 2, 4)
    path_values = values.permute(0, 2, 1, 3)[rows, index].permute(0, 3, 1, 2, 4)
    grouped = query.view(batch, 2, heads // 2, nodes, dim).transpose(2, 3)
    return blocked_attention(grouped, path_keys, path_values, bias).transpose(2, 3).reshape(query.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_split_tree_form_keeps_the_gathered_sequences_bits(dtype, monkeypatch):
    """The PyTorch tree form CUDA runs (the prefix's whole blocks attended in place by all the nodes
    at once, only each node's near blocks gathered; TreeKeys), here on the CPU with the kernels
    off: the bits of the blocked attention over each node's whole gathered sequence, for rows of
    different prefixes, 1 to 64 nodes, a fixed in-place width past the keys (a recorded step's key
    bucket) or the fewest blocks."""
    from specdec.models.native import kernels
    from specdec.models.native.attention import TreeKeys, tree_attention

    monkeypatch.setattr(kernels, "load", lambda: "off in this test")
    generator = torch.Generator().manual_seed(13)
    for dim, starts, nodes, width in [(128, [300, 130], 9, None), (64, [800, 700], 17, 1024),
                                      (128, [5, 70], 4, 256), (64, [64, 128], 1, None), (128, [511], 64, 1024)]:
        parents = [(i - 1) // 2 - 1 for i in range(1, nodes)]
        among = tree_attention_mask(parents).expand(len(starts), -1, -1)
        tree = TreeKeys.build(starts, among, torch.device("cpu"), width=width)
        keys, values, query = _random_cache(starts, nodes, dim, dtype, generator)
        if width is not None and width > keys.shape[2]:
            keys, values = (torch.nn.functional.pad(t, (0, 0, 0, width - t.shape[2])) for t in (keys, values))
        got = tree_attention(query, keys, values, tree)
        assert torch.equal(got, _gathered_attention(starts, among, query, keys, values)), (dim, starts, nodes)


ATTENTION_SCRIPT = """
import sys, torch
from specdec.models.native.attention import AttentionPlan, KEY_BLOCK
from specdec.sampling.tree import tree_attention_mask
generator = torch.Generator().manual_seed(12)
outs = []
for dtype in (torch.float32, torch.bfloat16):
    # Query heads per KV head 6 (the 1.5B target) and 7 (the 0.5B draft): runs of rows that end in
    # tiles of 4, 2 and 1 rows.
    for dim, start, steps, heads in [(128, 800, 1, 12), (128, 300, 9, 12), (64, 130, 17, 12), (128, 5, 3, 12),
                                     (64, 70, 3, 14)]:
        length = -(-(start + steps) // KEY_BLOCK) * KEY_BLOCK
        keys, values = (torch.randn(1, 2, length, dim, generator=generator).to(dtype) for _ in range(2))
        query = torch.randn(1, heads, steps, dim, generator=generator).to(dtype)
        for among in (None, tree_attention_mask([(i - 1) // 2 - 1 for i in range(1, steps)])[None]):
            plan = AttentionPlan.build([start], steps, heads // 2, among, torch.device("cpu"))
            outs.append(plan.attend(query, keys, values))
torch.save(outs, sys.argv[1])
"""


def test_the_attention_kernels_vector_paths_give_its_generic_paths_bits(tmp_path):
    """kernels/attention.cpp runs tiles of rows in AVX-512 (scores of 4 rows x 4 keys, values 4 rows
    at a time) and AVX2 (scores 4 keys at a time, values 2 rows at a time) where the CPU has them,
    and its generic loops under ONEDNN_MAX_CPU_ISA=SSE41: chains and trees, fp32 and bf16, tiles of
    4, 2 and 1 rows, the same bits."""
    from conftest import results_under_caps, vector_path_caps
    from specdec.models.native import kernels

    if kernels.load() is not None:
        pytest.skip(f"no kernels here: {kernels.load()}")
    caps = vector_path_caps()
    if "avx2" not in caps:
        pytest.skip("no AVX2 here: only the generic path runs")
    results = results_under_caps(ATTENTION_SCRIPT, tmp_path, caps)
    assert len(results["generic"]) == 20
    for name in caps:
        assert all(torch.equal(fast, generic) for fast, generic in zip(results[name], results["generic"])), name
