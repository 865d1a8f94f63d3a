"""Never a wrong token (docs/architecture.md): no SamplingParams that validation accepts and no logits a
model produces (inf, NaN, a tiny temperature) make the sampler return an id outside the vocabulary or
one the target would not emit."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from specdec.sampling import SamplingParams, warp_logits
from specdec.sampling.categorical import draw, sample_rows
from specdec.sampling.params import GREEDY_BELOW_TEMPERATURE
from specdec.sampling.rejection import acceptance_probs, recovery_probs, rejection_sample
from specdec.sampling.tree import sample_verify_tree
from specdec.sampling.warp import greedy_tokens

INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("temperature", [5e-324, 1e-308, 1e-40, 1e-6, 9.9e-6])
def test_a_temperature_below_the_floor_is_greedy(temperature):
    params = SamplingParams(temperature=temperature)
    assert params.greedy and params.temperature == 0.0
    logits = torch.randn(3, 151_936, generator=torch.Generator().manual_seed(0))
    assert torch.equal(warp_logits(logits, params).argmax(-1), logits.argmax(-1))
    assert torch.equal(warp_logits(logits, params).sum(-1), torch.ones(3))


def test_the_floor_itself_samples_and_stays_finite_with_huge_logits():
    params = SamplingParams(temperature=GREEDY_BELOW_TEMPERATURE)
    assert not params.greedy
    logits = torch.tensor([[3e38, -3e38, 1e30, 0.0], [1e-3, 2e-3, 0.0, -1.0]])
    probs = warp_logits(logits, params)
    assert probs.isfinite().all() and torch.allclose(probs.sum(-1), torch.ones(2))
    assert probs[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert probs[1].argmax() == 1


def test_the_issues_reproduction_gives_the_greedy_token_not_151551():
    """warp_logits(randn(1, 151936), T=1e-40) was NaN everywhere, and the draw returned 151551."""
    logits = torch.randn(1, 151_936, generator=torch.Generator().manual_seed(3))
    probs = warp_logits(logits, SamplingParams(temperature=1e-40))
    assert sample_rows(probs, torch.Generator().manual_seed(0)).item() == logits.argmax().item()


def test_nan_never_wins_and_inf_takes_the_row():
    logits = torch.tensor([[NAN, 1.0, 2.0, NAN],   # NaN counts as -inf: token 2
                           [1.0, INF, 0.0, INF],   # the +inf entries, equally likely
                           [-INF, NAN, -INF, NAN],  # no candidate at all
                           [-INF, -INF, 5.0, -INF]])
    assert greedy_tokens(logits).tolist() == [2, 1, -1, 2]
    probs = warp_logits(logits, SamplingParams(temperature=0.8))
    assert probs.isfinite().all()
    assert probs[1].tolist() == [0.0, 0.5, 0.0, 0.5]
    assert probs[2].tolist() == [0.0] * 4
    assert probs[3].tolist() == [0.0, 0.0, 1.0, 0.0]
    tokens = sample_rows(probs.repeat(50, 1), torch.Generator().manual_seed(1)).view(50, 4)
    assert set(tokens[:, 0].tolist()) <= {1, 2} and set(tokens[:, 1].tolist()) == {1, 3}
    assert set(tokens[:, 2].tolist()) == {-1} and set(tokens[:, 3].tolist()) == {2}


@pytest.mark.parametrize("row", [[0.0, 0.0, 0.0], [0.2, NAN, 0.3], [0.2, INF, 0.1], [NAN] * 3, [-0.0, 0.0, 0.0]])
def test_a_row_without_positive_finite_mass_draws_minus_one(row):
    probs = torch.tensor([row, [0.1, 0.0, 0.9]])
    assert draw(probs, torch.tensor([0.5, 0.5], dtype=torch.float64)).tolist() == [-1, 2]


# ---- hypothesis: extreme temperatures, filter edges, and logits holding inf, -inf and NaN ---------

extreme_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                           st.sampled_from([INF, -INF, NAN, 0.0, 3e38, -3e38, 1e-45]),
                           st.floats(-30, 30, width=32))
temperatures = st.one_of(st.sampled_from([5e-324, 1e-300, 1e-40, 1e-6, GREEDY_BELOW_TEMPERATURE, 1e6, 1e300, 0.0]),
                         st.floats(0, 1e6, allow_nan=False))


@st.composite
def logits_and_params(draw_from):
    vocab = draw_from(st.integers(1, 9))
    rows = draw_from(st.integers(1, 4))
    values = draw_from(st.lists(extreme_floats, min_size=vocab * rows, max_size=vocab * rows))
    params = SamplingParams(temperature=draw_from(temperatures), top_k=draw_from(st.integers(0, vocab + 1)),
                            top_p=draw_from(st.one_of(st.just(1.0), st.floats(1e-9, 1.0, exclude_min=True))),
                            min_p=draw_from(st.one_of(st.just(0.0), st.floats(0.0, 1.0, exclude_max=True))))
    return torch.tensor(values, dtype=torch.float32).view(rows, vocab), params


def candidates_of(row: torch.Tensor) -> set[int]:
    """The tokens a row's logits allow: its +inf entries if any, else every entry above -inf (NaN: none)."""
    values = [float(v) for v in row]
    top = [i for i, v in enumerate(values) if v == INF]
    return set(top) if top else {i for i, v in enumerate(values) if not math.isnan(v) and v > -INF}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=logits_and_params(), seed=st.integers(0, 2**31 - 1))
def test_warp_then_draw_never_leaves_the_candidates(case, seed):
    logits, params = case
    probs = warp_logits(logits, params)
    assert probs.isfinite().all() and (probs >= 0).all()
    tokens = sample_rows(probs, torch.Generator().manual_seed(seed)).tolist()
    for row, token, prob in zip(logits, tokens, probs):
        allowed = candidates_of(row)
        if not allowed:
            assert token == -1 and prob.sum() == 0
        else:
            assert abs(float(prob.sum()) - 1.0) < 1e-5
            assert token in allowed and prob[token] > 0
            if params.greedy:
                assert token == int(greedy_tokens(row))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=logits_and_params(), draft=st.lists(extreme_floats, min_size=9 * 2, max_size=9 * 2),
       draft_ids=st.lists(st.integers(-1, 9), min_size=2, max_size=2), seed=st.integers(0, 2**31 - 1))
def test_rejection_sampling_emits_only_candidates_whatever_the_draft(case, draft, draft_ids, seed):
    """Any draft, a broken one included (NaN or inf probabilities, ids outside the vocabulary): an
    accepted draft is a token the target gives probability, and the closing token one of its candidates."""
    logits, params = case
    vocab = logits.shape[-1]
    target_logits = logits[:1].expand(3, vocab)  # [k+1, V], k = 2
    target_probs = warp_logits(target_logits, params)[None]  # [1, 3, V]
    draft_probs = torch.tensor(draft, dtype=torch.float32).view(1, 2, 9)[..., :vocab].abs()
    ids = torch.tensor([draft_ids])
    result = rejection_sample(ids, torch.tensor([2]), draft_probs, target_probs,
                              generator=torch.Generator().manual_seed(seed))
    allowed = candidates_of(logits[0])
    emitted = result.output_ids[0, : int(result.num_accepted) + 1].tolist()
    for token in emitted:
        assert token in allowed or (not allowed and token == -1)


def test_an_all_zero_residual_draws_from_the_target():
    """p == q at the rejected position: rejection had probability 0 there, and the fallback is p."""
    target = torch.tensor([[[0.25, 0.75, 0.0], [0.5, 0.5, 0.0]]])
    draft = target[:, :1].clone()
    final = recovery_probs(torch.tensor([0]), torch.tensor([1]), torch.tensor([[1]]), draft, target)
    assert torch.equal(final, target[:, 0])


@pytest.mark.parametrize("broken", [NAN, INF])
def test_a_non_finite_draft_is_never_accepted_and_the_target_closes_the_step(broken):
    target = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])
    draft = torch.tensor([[[0.0, broken, 0.0]]])
    assert acceptance_probs(torch.tensor([[1]]), draft, target).tolist() == [[0.0]]
    final = recovery_probs(torch.tensor([0]), torch.tensor([1]), torch.tensor([[1]]), draft, target)
    assert torch.equal(final, target[:, 0])
    for seed in range(20):
        result = rejection_sample(torch.tensor([[1]]), torch.tensor([1]), draft, target,
                                  generator=torch.Generator().manual_seed(seed))
        assert result.output_ids.tolist() == [[1, -1]] and result.num_accepted.tolist() == [0]


def test_a_draft_id_outside_the_vocabulary_is_never_accepted():
    target = torch.tensor([[[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]])  # token 2 is certain: -1 would wrap to it
    assert acceptance_probs(torch.tensor([[-1]]), None, target).tolist() == [[0.0]]
    assert acceptance_probs(torch.tensor([[3]]), None, target).tolist() == [[0.0]]
    result = rejection_sample(torch.tensor([[-1]]), torch.tensor([1]), None, target)
    assert result.output_ids.tolist() == [[2, -1]]


def test_a_tree_never_accepts_a_child_with_a_non_finite_draft_probability():
    target = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    draft = torch.tensor([[0.0, NAN, 0.0], [0.0, 0.0, 1.0]])
    for seed in range(20):
        result = sample_verify_tree([1, 2], [-1, -1], draft, target, torch.Generator().manual_seed(seed))
        assert 0 not in result.path  # the NaN child
        # The other child (token 2) accepted, then the target's certain 0; or rejected, then r = [0, 1, 0].
        assert result.output_ids == ([2, 0] if result.path == [1] else [1])
    # An id outside the vocabulary, as a point mass: skipped, the target's token closes the step.
    result = sample_verify_tree([-1], [-1], None, target, torch.Generator().manual_seed(0))
    assert result.path == [] and result.output_ids[0] in (1, 2)
