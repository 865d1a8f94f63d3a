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
