"""engine/step.py directly: what one step lays out and keeps, checked against plain forwards."""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB_SIZE, make_model, make_native
from specdec.engine.request import Request
from specdec.engine.step import Row, prefill, run_step
from specdec.proposers import DraftProposal
from specdec.proposers.batched import BatchProposer
from specdec.sampling import SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7]


class FixedTree(BatchProposer):
    """Drafts one given tree for row 0."""

    def __init__(self, tokens: list[int], parents: tuple[int, ...]) -> None:
        self.tokens, self.parents = tokens, parents

    def propose(self, contexts, max_ks):
        return DraftProposal.of_row(self.tokens, self.parents, contexts[0].token_ids.device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tree_step_gives_each_kept_node_a_chain_forwards_logits_and_cache(dtype):
    """A tree whose accepted path is not its first nodes: (wrong, g1, wrong, g2) with g2 under g1.
    Each kept input's logits are bit for bit those of a chain forward over the path (a node at the
    root's position + its depth, seeing only its ancestors), and the kept cache gives the next token
    the chain's logits too. A node placed one position off, or seeing a sibling, changes bits."""
    model = make_model(seed=4, layers=2, random_bias=True)
    params = SamplingParams(temperature=0)
    chain = make_native(model, dtype=dtype)
    chain.forward(torch.tensor([PROMPT[:-1]]), torch.arange(len(PROMPT) - 1)[None], last_n_logits=1)
    greedy = [PROMPT[-1]]
    for position in range(len(PROMPT) - 1, len(PROMPT) + 3):  # plain greedy: the last prompt token, g1, g2, g3
        logits = chain.forward(torch.tensor([[greedy[-1]]]), torch.tensor([[position]])).logits
        greedy.append(int(logits[0, -1].argmax()))
    g1, g2 = greedy[1], greedy[2]
    chain.truncate([len(PROMPT) - 1])
    chain_logits = chain.forward(torch.tensor([[PROMPT[-1], g1, g2]]),
                                 torch.arange(len(PROMPT) - 1, len(PROMPT) + 2)[None]).logits[0]
    chain_next = chain.forward(torch.tensor([[greedy[3]]]), torch.tensor([[len(PROMPT) + 2]])).logits[0, 0]

    target = make_native(model, dtype=dtype)
    row = Row(Request(list(PROMPT), params, max_new_tokens=16), None, list(PROMPT))
    prefill(target, row, 0, len(PROMPT) - 1, 0, None)
    wrong = [(g1 + 1) % VOCAB_SIZE, (g2 + 1) % VOCAB_SIZE]
    result = run_step(target, FixedTree([wrong[0], g1, wrong[1], g2], (-1, -1, 1, 1)), [row], [4])
    assert result.trees[0] == (-1, -1, 1, 1)
    assert result.accepted == [2] and result.tokens[0] == greedy[1:4]
    assert result.kept_inputs[0] == [0, 2, 4]  # the root, g1 (node 1), g2 (node 3)
    assert torch.equal(result.logits[0, result.kept_inputs[0]], chain_logits)
    assert target.seq_len == len(PROMPT) + 2  # the root and the path, packed after the prompt
    after = target.forward(torch.tensor([[greedy[3]]]), torch.tensor([[len(PROMPT) + 2]])).logits[0, 0]
    assert torch.equal(after, chain_next)
