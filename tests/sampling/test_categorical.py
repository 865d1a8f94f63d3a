"""The two-level categorical draw (sampling/categorical.py) against the float64 inverse CDF."""

import pytest
import torch
from scipy.stats import chisquare

from specdec.sampling.categorical import BLOCK, draw, sample_rows, uniforms


def reference(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The inverse CDF over the whole row, one float64 cumulative sum (torch.multinomial's own way)."""
    cumulative = probs.double().cumsum(-1)
    return torch.searchsorted(cumulative, (u * cumulative[:, -1])[:, None], right=True)[:, 0]


def spiky_rows(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Softmax-like rows: most mass on a few tokens spread over the blocks, whole blocks of zeros,
    a zero last token, and mass in the last, partial block."""
    generator = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(rows, vocab, generator=generator) * 4, -1)
    probs[:, BLOCK:2 * BLOCK] = 0.0  # an empty block
    probs[:, -1] = 0.0
    probs[:, 5] = 0.0
    return probs / probs.sum(-1, keepdim=True)


@pytest.mark.parametrize("vocab", [7, BLOCK, 3 * BLOCK + 17])
def test_the_draw_is_the_float64_inverse_cdf_at_every_uniform(vocab):
    """Exact, not statistical: at 20,000 uniforms (and both ends of [0, 1)) the two-level draw picks
    the token the whole row's float64 cumulative sum picks, so its distribution is that of
    torch.multinomial's float64 inverse CDF."""
    probs = spiky_rows(1, vocab, seed=vocab) if vocab > 2 * BLOCK else torch.softmax(torch.randn(1, vocab) * 3, -1)
    u = torch.cat([torch.rand(20_000, generator=torch.Generator().manual_seed(1), dtype=torch.float64),
                   torch.tensor([0.0, 1.0 - 2.0**-53], dtype=torch.float64)])
    rows = probs.expand(u.numel(), vocab)
    assert torch.equal(draw(rows, u), reference(rows, u))


def test_a_token_of_probability_zero_is_never_drawn():
    vocab = 3 * BLOCK + 17
    probs = spiky_rows(1, vocab, seed=3)
    zero = torch.zeros_like(probs)
    zero[0, BLOCK - 1] = 0.25  # the last entry of a block, before an empty block
    zero[0, 2 * BLOCK + 3] = 0.75
    edges = torch.tensor([0.0, 0.25 - 1e-12, 0.25, 0.5, 1.0 - 2.0**-53], dtype=torch.float64)
    for row in (probs, zero):
        rows = row.expand(edges.numel(), vocab)
        drawn = draw(rows, edges)
        assert bool((row[0, drawn] > 0).all()), drawn
    assert draw(zero.expand(5, vocab), edges).tolist() == [BLOCK - 1, BLOCK - 1, 2 * BLOCK + 3, 2 * BLOCK + 3,
                                                           2 * BLOCK + 3]


def test_unnormalized_rows_draw_as_their_normalized_form():
    probs = spiky_rows(1, 2 * BLOCK + 100, seed=4)
    u = torch.rand(2000, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    assert torch.equal(draw((probs * 37.5).expand(2000, -1), u), draw(probs.expand(2000, -1), u))


def test_a_row_draws_the_same_token_alone_or_in_a_batch():
    probs = spiky_rows(6, 2 * BLOCK + 5, seed=5)
    u = torch.rand(6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    together = draw(probs, u)
    alone = torch.cat([draw(probs[b:b + 1], u[b:b + 1]) for b in range(6)])
    assert torch.equal(together, alone)
    generators = [torch.Generator().manual_seed(10 + b) for b in range(6)]
    batched = sample_rows(probs, generators)
    singles = torch.cat([sample_rows(probs[b:b + 1], torch.Generator().manual_seed(10 + b)) for b in range(6)])
    assert torch.equal(batched, singles)


def test_frequencies_follow_the_distribution():
    """At scale, through the generator: a chi-square test over a 3-block row's tokens."""
    vocab = 2 * BLOCK + 300
    generator = torch.Generator().manual_seed(7)
    probs = torch.zeros(vocab)
    support = torch.tensor([0, 17, BLOCK - 1, BLOCK, BLOCK + 500, 2 * BLOCK + 299])
    probs[support] = torch.tensor([0.05, 0.3, 0.1, 0.25, 0.2, 0.1])
    draws = 60_000
    u = uniforms((draws,), generator, torch.device("cpu"), torch.float64)
    tokens = draw(probs.expand(draws, vocab), u)
    counts = torch.bincount(tokens, minlength=vocab)
    assert int(counts.sum() - counts[support].sum()) == 0
    assert chisquare(counts[support].numpy(), probs[support].numpy() * draws).pvalue > 1e-3


def test_one_uniform_per_row():
    with pytest.raises(ValueError, match="one uniform per row"):
        draw(torch.ones(2, 10), torch.zeros(3, dtype=torch.float64))
