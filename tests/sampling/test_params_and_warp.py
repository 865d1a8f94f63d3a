import pytest
import torch

from specdec.sampling import SamplingParams, warp_logits


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"min_p": 1.0}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"seed": -3}, "seed"),
    ],
)
def test_bad_sampling_params_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_greedy_warp_is_point_mass_on_first_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    assert warp_logits(logits, SamplingParams(temperature=0)).tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_temperature_top_k_example_from_docstring():
    probs = warp_logits(torch.tensor([2.0, 1.0, 0.0]), SamplingParams(temperature=1.0, top_k=2))
    expected = torch.softmax(torch.tensor([2.0, 1.0]), dim=0)
    assert torch.allclose(probs, torch.cat([expected, torch.zeros(1)]), atol=1e-6)


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    warped = warp_logits(probs.log(), SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(warped, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=1e-6)
    # Reaching exactly p needs no extra token; just above it needs one more.
    warped = warp_logits(probs.log(), SamplingParams(temperature=1.0, top_p=0.81))
    assert (warped > 0).sum() == 3


def whole_sort_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The rule sorting the whole row (warp.py's form before its candidates): the reference."""
    sorted_probs, sorted_idx = torch.sort(probs, dim=-1, descending=True)
    drop_sorted = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
    return torch.zeros_like(drop_sorted).scatter(-1, sorted_idx, drop_sorted)


@pytest.mark.parametrize("seed", [0, 1])
def test_top_p_from_candidates_drops_what_sorting_the_whole_row_drops(seed):
    """Rows of a 30,000-token vocabulary whose nuclei need 256 candidates, 4096, or the whole sort, in one
    batch: the same tokens dropped as by the whole sort, and the same row alone as in the batch."""
    from specdec.sampling.warp import NUCLEUS_CANDIDATES, outside_nucleus

    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 30_000, generator=generator) * torch.tensor([[12.0], [3.0], [0.3]])  # sharp to flat
    probs = torch.softmax(logits, dim=-1)
    for top_p in (0.5, 0.9, 0.99):
        dropped = outside_nucleus(probs, top_p)
        assert torch.equal(dropped, whole_sort_nucleus(probs, top_p))
        assert all(torch.equal(outside_nucleus(probs[b], top_p), dropped[b]) for b in range(3))
    kept = sorted((~outside_nucleus(probs, 0.9)).sum(-1).tolist())
    first, last = NUCLEUS_CANDIDATES
    assert kept[0] <= first < kept[1] <= last < kept[2]  # each row took another path


def test_min_p_drops_tokens_below_fraction_of_top():
    probs = torch.tensor([0.6, 0.3, 0.07, 0.03])
    warped = warp_logits(probs.log(), SamplingParams(temperature=1.0, min_p=0.1))
    assert warped[2] > 0 and warped[3] == 0
    assert torch.allclose(warped.sum(), torch.tensor(1.0))


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([1.0, 0.0])
    cold = warp_logits(logits, SamplingParams(temperature=0.5))
    hot = warp_logits(logits, SamplingParams(temperature=2.0))
    assert cold[0] > torch.softmax(logits, 0)[0] > hot[0]


def test_seeded_generators_repeat():
    a = torch.rand(5, generator=SamplingParams(seed=7).make_generator())
    b = torch.rand(5, generator=SamplingParams(seed=7).make_generator())
    assert torch.equal(a, b)
