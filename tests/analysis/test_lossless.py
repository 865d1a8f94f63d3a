"""The losslessness checker: its test statistic, and that it passes the real engine and fails a broken one."""

import pytest
import torch
from scipy.stats import chi2 as scipy_chi2

import specdec.engine.step as step_module
from conftest import make_model, make_native
from specdec.analysis.lossless import chi2_survival, distribution_tests, homogeneity_test
from specdec.engine import SpecEngine
from specdec.proposers.draft_model import DraftModelProposer
from specdec.sampling import SamplingParams
from specdec.sampling.rejection import VerifyResult


@pytest.mark.parametrize("chi2,dof", [(0.5, 1), (3.84, 1), (20.0, 10), (100.0, 60), (7.0, 3)])
def test_chi2_survival_matches_scipy(chi2, dof):
    assert chi2_survival(chi2, dof) == pytest.approx(scipy_chi2.sf(chi2, dof), rel=1e-6)


def test_homogeneity_pools_rare_outcomes_and_measures_total_variation():
    rare_spec, rare_plain = list("cdefghijkl"), list("cmnopqrstu")
    spec, plain = ["a"] * 56 + ["b"] * 34 + rare_spec, ["a"] * 54 + ["b"] * 36 + rare_plain
    test = homogeneity_test(spec, plain)
    assert test.categories == 3  # a, b, and the 19 rare outcomes pooled into one
    assert test.dof == 2 and test.p_value > 0.5
    outcomes = set(spec) | set(plain)
    assert test.total_variation == pytest.approx(0.5 * sum(abs(spec.count(o) - plain.count(o)) / 100 for o in outcomes))
    lopsided = homogeneity_test(["a"] * 95 + ["b"] * 5, ["a"] * 5 + ["b"] * 95)
    assert lopsided.p_value < 1e-20 and lopsided.total_variation == pytest.approx(0.9)
    with pytest.raises(ValueError):
        homogeneity_test([], plain)


@pytest.fixture(scope="module")
def engines():
    target = make_native(make_model(seed=0))
    draft = make_native(make_model(seed=1, layers=1))
    return (SpecEngine(target, DraftModelProposer(draft), None, k=3, eos_token_ids=frozenset()),
            SpecEngine(target, None, None, k=1, eos_token_ids=frozenset()))


PARAMS = SamplingParams(temperature=0.6)
PROMPT = [5, 9, 12, 3, 7]


@pytest.fixture(scope="module")
def plain_draws(engines):
    return list(engines[1].sample_continuations(PROMPT, PARAMS, 1000, seed=10_000))


def test_the_real_engine_passes(engines, plain_draws):
    spec_draws = list(engines[0].sample_continuations(PROMPT, PARAMS, 1000))
    assert all(len(d) >= 2 for d in spec_draws)
    tests = distribution_tests(spec_draws, plain_draws)
    assert all(t.dof >= 3 for t in tests)  # sharp enough that the test has something to test
    assert min(t.p_value for t in tests) > 1e-4, tests


def test_a_verifier_that_accepts_every_draft_is_caught(engines, plain_draws, monkeypatch):
    """Accepting all drafts emits the draft's distribution, not the target's: the check must fail."""
    def accept_everything(draft_ids, num_draft, draft_probs, target_probs, generator=None, lenience=1.0):
        bonus = torch.multinomial(target_probs[:, -1], 1, generator=generator)
        return VerifyResult(torch.cat([draft_ids, bonus], dim=1), num_draft.clone())

    monkeypatch.setattr(step_module, "rejection_sample", accept_everything)
    tests = distribution_tests(list(engines[0].sample_continuations(PROMPT, PARAMS, 500)), plain_draws)
    assert min(t.p_value for t in tests) < 1e-6
    assert max(t.total_variation for t in tests) > 0.2
