"""Losslessness of rejection_sample: exact enumeration, then sampling at scale."""


import pytest
import torch
from scipy.stats import chisquare

from specdec.sampling import (
    SamplingParams,
    acceptance_probs,
    greedy_verify,
    recovery_probs,
    rejection_sample,
    warp_logits,
)


def random_dist(vocab: int, generator: torch.Generator, zeros: int = 0) -> torch.Tensor:
    probs = torch.rand(vocab, generator=generator, dtype=torch.float64) + 1e-3
    if zeros:
        probs[torch.randperm(vocab, generator=generator)[:zeros]] = 0.0
    return probs / probs.sum()


def cases():
    gen = torch.Generator().manual_seed(0)
    out = []
    for vocab in (2, 3, 5):
        for zeros_p, zeros_q in ((0, 0), (1, 0), (0, 1), (1, 1)):
            if max(zeros_p, zeros_q) < vocab:
                out.append((random_dist(vocab, gen, zeros_p), random_dist(vocab, gen, zeros_q)))
    # Disjoint supports: every draft is rejected, the residual is p itself.
    out.append((torch.tensor([0.7, 0.3, 0.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 0.0, 0.4, 0.6], dtype=torch.float64)))
    # Identical distributions: everything is accepted.
    same = random_dist(4, gen)
    out.append((same, same.clone()))
    return out


def exact_first_token_distribution(target: torch.Tensor, draft: torch.Tensor, k: int) -> torch.Tensor:
    """P(first emitted token = y), enumerating every draft x_0 and both outcomes of its test.

    Uses the library's own acceptance_probs and recovery_probs, i.e. the exact
    quantities rejection_sample thresholds and samples from. Later positions
    do not affect the first token, so they get the same distributions.
    """
    vocab = target.shape[0]
    target_probs = target.expand(1, k + 1, vocab)
    draft_probs = draft.expand(1, k, vocab)
    result = torch.zeros(vocab, dtype=torch.float64)
    for x0 in range(vocab):
        if draft[x0] == 0:
            continue  # never drafted
        draft_ids = torch.full((1, k), x0, dtype=torch.int64)
        accept = acceptance_probs(draft_ids, draft_probs, target_probs)[0, 0].double()
        recovered = recovery_probs(torch.tensor([0]), torch.tensor([k]), draft_ids, draft_probs, target_probs)[0]
        step = recovered.double() * (1 - accept)
        step[x0] += accept
        result += draft[x0].double() * step
    return result


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("target, draft", cases())
def test_first_token_is_exactly_target_by_enumeration(target, draft, k):
    got = exact_first_token_distribution(target.float(), draft.float(), k)
    assert torch.allclose(got, target, atol=1e-6), (got, target)


@pytest.mark.parametrize("target, draft", cases())
def test_point_mass_draft_is_exact_for_every_proposed_token(target, draft):
    """An n-gram proposal of any fixed token x still emits exactly p."""
    vocab = target.shape[0]
    target_probs = target.float().expand(1, 2, vocab)
    for x in range(vocab):
        ids = torch.tensor([[x]])
        accept = acceptance_probs(ids, None, target_probs)[0, 0].double()
        dist = recovery_probs(torch.tensor([0]), torch.tensor([1]), ids, None, target_probs)[0].double() * (1 - accept)
        dist[x] += accept
        assert torch.allclose(dist, target, atol=1e-6)


def test_bonus_token_comes_from_the_last_target_position():
    target_probs = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])
    draft_probs = torch.tensor([[[0.0, 1.0, 0.0]]])
    out = rejection_sample(torch.tensor([[1]]), torch.tensor([1]), draft_probs, target_probs)
    assert out.num_accepted.tolist() == [1]
    assert out.output_ids.tolist() == [[1, 2]]


def test_no_draft_is_plain_sampling_and_padding_is_minus_one():
    target_probs = torch.tensor([[[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])
    out = rejection_sample(torch.tensor([[-1]]), torch.tensor([0]), None, target_probs)
    assert out.output_ids.tolist() == [[2, -1]] and out.num_accepted.tolist() == [0]


def test_one_hot_target_makes_rejection_sampling_equal_greedy_verify():
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        logits = torch.randn(1, 4, 7, generator=gen)
        target_probs = warp_logits(logits, SamplingParams(temperature=0))
        argmax = logits.argmax(-1)
        drafts = torch.where(torch.rand(1, 3, generator=gen) < 0.6, argmax[:, :3], torch.randint(0, 7, (1, 3), generator=gen))
        draft_probs = torch.softmax(torch.randn(1, 3, 7, generator=gen), -1)
        exact = rejection_sample(drafts, torch.tensor([3]), draft_probs, target_probs, generator=gen)
        greedy = greedy_verify(drafts, torch.tensor([3]), argmax)
        assert torch.equal(exact.output_ids, greedy.output_ids)


def test_greedy_verify_docstring_example():
    out = greedy_verify(torch.tensor([[5, 7, 9]]), torch.tensor([3]), torch.tensor([[5, 7, 3, 8]]))
    assert out.num_accepted.tolist() == [2] and out.output_ids.tolist() == [[5, 7, 3, -1]]


def test_same_generator_seed_same_result():
    probs = torch.softmax(torch.randn(1, 5, 11), -1)
    drafts = torch.randint(0, 11, (1, 4))
    draft_probs = torch.softmax(torch.randn(1, 4, 11), -1)
    a = rejection_sample(drafts, torch.tensor([4]), draft_probs, probs, generator=torch.Generator().manual_seed(3))
    b = rejection_sample(drafts, torch.tensor([4]), draft_probs, probs, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.output_ids, b.output_ids)


WARPS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=5, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("params", WARPS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
@pytest.mark.parametrize("point_mass", [False, True], ids=["draft-model", "point-mass"])
def test_full_k_step_sampled_matches_target(params, point_mass):
    """200k independent steps in one batch: every emitted position j follows p_j.

    Given that positions < j were accepted, the token at j must be distributed
    as the warped target p_j (recovered or accepted or bonus alike), and the
    number of accepted drafts must follow the product of per-position
    acceptance rates beta_j = sum_x min(p_j, q_j) (Leviathan et al., Thm 3.5).
    """
    rows, k, vocab = 200_000, 3, 8
    gen = torch.Generator().manual_seed(42)
    target_probs = warp_logits(torch.randn(k + 1, vocab, generator=gen) * 1.5, params)  # [k+1, V]
    draft_dist = warp_logits(torch.randn(k, vocab, generator=gen) * 1.5, params)  # [k, V]
    if point_mass:
        draft_ids = torch.randint(0, vocab, (rows, k), generator=gen)
        draft_probs = None
        beta = target_probs[:k].mean(dim=-1)  # E_x~uniform[p(x)]: acceptance of a uniform random fixed token
    else:
        draft_ids = torch.multinomial(draft_dist, rows, replacement=True, generator=gen).T.contiguous()  # [rows, k]
        draft_probs = draft_dist.expand(rows, k, vocab)
        beta = torch.minimum(target_probs[:k], draft_dist).sum(-1)
    out = rejection_sample(
        draft_ids, torch.full((rows,), k), draft_probs, target_probs.expand(rows, k + 1, vocab), generator=gen
    )
    for j in range(k + 1):
        reached = out.num_accepted >= j
        tokens = out.output_ids[reached, j]
        observed = torch.bincount(tokens, minlength=vocab).double()
        expected = target_probs[j].double() * reached.sum()
        support = expected > 0
        assert observed[~support].sum() == 0, "emitted a token the warped target forbids"
        if support.sum() > 1:
            expected = expected[support] * observed.sum() / expected[support].sum()  # exact totals for scipy
            assert chisquare(observed[support].numpy(), expected.numpy()).pvalue > 1e-4
    mean_accepted = out.num_accepted.double().mean().item()
    expected_accepted = sum(torch.prod(beta[: j + 1]).item() for j in range(k))
    assert abs(mean_accepted - expected_accepted) < 0.02
