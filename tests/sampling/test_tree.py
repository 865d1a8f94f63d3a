"""Token trees: mask, depths, paths on hand-made trees; verification along a tree
(greedy == the best path's chain verification; sampling lossless, by exact law and by draws)."""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from specdec.sampling import greedy_verify
from specdec.sampling.tree import (
    check_parents,
    greedy_verify_tree,
    sample_verify_tree,
    tree_attention_mask,
    tree_children,
    tree_depths,
    tree_paths,
    typical_verify_tree,
)

# root ─┬─ 0 ─┬─ 2 ── 4
#       │     └─ 3
#       └─ 1
PARENTS = [-1, -1, 0, 0, 2]


def test_depths_children_and_paths_of_a_hand_made_tree():
    assert tree_depths(PARENTS) == [1, 1, 2, 2, 3]
    assert tree_children(PARENTS) == [[0, 1], [2, 3], [], [4], [], []]
    assert tree_paths(PARENTS) == [[1], [0, 3], [0, 2, 4]]


def test_attention_mask_lets_each_input_see_itself_and_its_ancestors_only():
    expected = torch.tensor([
        # root 0  1  2  3  4
        [1, 0, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 0, 0],  # 0
        [1, 0, 1, 0, 0, 0],  # 1
        [1, 1, 0, 1, 0, 0],  # 2
        [1, 1, 0, 0, 1, 0],  # 3
        [1, 1, 0, 1, 0, 1],  # 4
    ], dtype=torch.bool)
    assert torch.equal(tree_attention_mask(PARENTS), expected)


def test_a_chain_is_the_causal_case():
    chain = [-1, 0, 1, 2]
    assert torch.equal(tree_attention_mask(chain), torch.tril(torch.ones(5, 5, dtype=torch.bool)))
    assert tree_depths(chain) == [1, 2, 3, 4]


@pytest.mark.parametrize("bad", [[0], [-1, 1], [-2], [-1, 5, 0]])
def test_parents_must_be_topological(bad):
    with pytest.raises(ValueError, match="topological"):
        check_parents(bad)


def test_greedy_walk_follows_the_argmax_and_closes_with_it():
    tokens = [7, 8, 5, 6, 9]
    # argmax at root, 0, 1, 2, 3, 4: root wants 7 (node 0), node 0 wants 5 (node 2), node 2 wants 4 (none).
    result = greedy_verify_tree(tokens, PARENTS, [7, 5, 1, 4, 0, 0])
    assert result.path == [0, 2] and result.output_ids == [7, 5, 4]
    # The second sibling can be the one accepted.
    assert greedy_verify_tree(tokens, PARENTS, [8, 0, 3, 0, 0, 0]).output_ids == [8, 3]
    assert greedy_verify_tree(tokens, PARENTS, [1, 0, 0, 0, 0, 0]).output_ids == [1]
    assert greedy_verify_tree(tokens, PARENTS, [7, 5, 0, 9, 0, 2]).output_ids == [7, 5, 9, 2]


@pytest.mark.parametrize("seed", range(20))
def test_greedy_tree_equals_the_best_chain_verification_of_its_paths(seed):
    """Random trees and random argmaxes: the tree accepts what the best single path would."""
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 12, (), generator=gen))
    parents = [int(torch.randint(-1, i, (), generator=gen)) if i else -1 for i in range(n)]
    # Siblings hold distinct tokens (a real tree never drafts one token twice under a parent).
    tokens = [0] * n
    for children in tree_children(parents):
        for slot, child in enumerate(children):
            tokens[child] = slot
    argmax = torch.randint(0, 3, (n + 1,), generator=gen).tolist()
    tree = greedy_verify_tree(tokens, parents, argmax)
    best = []
    for path in tree_paths(parents):
        chain = greedy_verify(torch.tensor([[tokens[i] for i in path]]), torch.tensor([len(path)]),
                              torch.tensor([[argmax[0]] + [argmax[i + 1] for i in path]]))
        accepted = int(chain.num_accepted[0])
        candidate = chain.output_ids[0, : accepted + 1].tolist()
        if len(candidate) > len(best):
            best = candidate
    assert tree.output_ids == best


def _softmax(seed: int, vocab: int, rows: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, vocab, generator=gen) * 1.5, dim=-1).squeeze(0)


def _exact_first_token_law(root_p: torch.Tensor, candidates: list[int]) -> torch.Tensor:
    """The recursive rule for point-mass siblings, written out by hand (not the library's loop)."""
    law = torch.zeros_like(root_p)
    residual, survive = root_p.clone(), 1.0
    for token in candidates:
        law[token] += survive * residual[token]
        survive *= 1 - residual[token]
        residual[token] = 0
        residual = residual / residual.sum()
    return law + survive * residual


def test_point_mass_siblings_have_exactly_the_target_law_worked_example():
    root_p = torch.tensor([0.5, 0.3, 0.2])
    assert torch.allclose(_exact_first_token_law(root_p, [0, 1]), root_p)
    for seed in range(5):
        p = _softmax(seed, 6)
        assert torch.allclose(_exact_first_token_law(p, [3, 1, 4]), p, atol=1e-6)


def test_sampling_along_a_point_mass_tree_draws_the_target_joint_law():
    """Two tokens out of a depth-2 tree: their joint frequency is p_root(x) p_x(y), by chi-square."""
    vocab = 4
    parents = [-1, -1, 0, 0, 1]  # root -> {0: token 2, 1: token 0}; 0 -> {2: 1, 3: 3}; 1 -> {4: 2}
    tokens = [2, 0, 1, 3, 2]
    probs = _softmax(11, vocab, rows=vocab + 1)  # p at root, then p after each first token (by token)
    root_p, after = probs[0], probs[1:]  # after[x] = p(. | x), the same whichever node drafted x
    target_probs = torch.stack([root_p] + [after[t] for t in tokens])  # [n+1, V]
    draws = 30_000
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(vocab, vocab)
    for _ in range(draws):
        result = sample_verify_tree(tokens, parents, None, target_probs, gen)
        if len(result.output_ids) < 2:  # the walk stopped at the root: the second token is plain p(. | x)
            first = result.output_ids[0]
            second = int(torch.multinomial(after[first], 1, generator=gen))
        else:
            first, second = result.output_ids[:2]
        counts[first, second] += 1
    expected = (root_p[:, None] * after).flatten() * draws
    assert chisquare(counts.flatten().numpy(), expected.numpy()).pvalue > 1e-4


def test_sampled_siblings_from_one_draft_keep_the_target_law():
    """SpecInfer's case: three siblings drawn i.i.d. from q (duplicates allowed), one level."""
    vocab = 5
    root_p, draft_q = _softmax(3, vocab), _softmax(4, vocab)
    draws = 30_000
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(vocab)
    accepted = 0
    for _ in range(draws):
        tokens = torch.multinomial(draft_q, 3, replacement=True, generator=gen).tolist()
        result = sample_verify_tree(tokens, [-1, -1, -1], draft_q.expand(3, vocab),
                                    torch.stack([root_p, root_p, root_p, root_p]), gen)
        counts[result.output_ids[0]] += 1
        accepted += result.num_accepted
    assert chisquare(counts.numpy(), (root_p * draws).numpy()).pvalue > 1e-4
    # Three tries accept more often than one would (sum min(p, q)).
    assert accepted / draws > float(torch.minimum(root_p, draft_q).sum()) + 0.02


def test_point_mass_law_by_exact_enumeration_of_the_rule():
    """Enumerate every branch of the rule on a tiny tree (no sampling) and sum the emitted law."""
    root_p = _softmax(7, 3)
    candidates = [2, 0]
    for order in itertools.permutations(candidates):
        assert torch.allclose(_exact_first_token_law(root_p, list(order)), root_p, atol=1e-6)


def test_typical_acceptance_is_lossy_and_accepts_plausible_tokens_under_an_unsure_target():
    flat = torch.full((4,), 0.25)  # entropy log 4: cutoff min(.09, .3 / 4) = .075, every token passes
    sharp = torch.tensor([0.97, 0.01, 0.01, 0.01])  # cutoff ~.09 * ... only token 0 passes
    tokens, parents = [3, 2], [-1, 0]
    out = typical_verify_tree(tokens, parents, torch.stack([flat, flat, sharp]), torch.Generator().manual_seed(0))
    assert out.path == [0, 1]  # both accepted although neither is the target's favourite
    out = typical_verify_tree(tokens, parents, torch.stack([flat, sharp, sharp]), torch.Generator().manual_seed(0))
    assert out.path == [0]  # under the sharp target the second draft (p .01) is refused


def test_typical_acceptance_is_opt_in_labelled_and_exclusive_with_lenience():
    from specdec.sampling import SamplingParams

    assert SamplingParams(temperature=0.7).exact
    assert not SamplingParams(temperature=0.7, typical_acceptance=True).exact  # LOSSY
    assert SamplingParams(temperature=0.0, typical_acceptance=True).exact  # greedy stays greedy
    with pytest.raises(ValueError, match="one lossy rule"):
        SamplingParams(temperature=0.7, lenience=0.5, typical_acceptance=True)
