"""alpha and c measured on tiny models; predictions joined with measurements."""

import pytest
import torch

from conftest import make_model, make_native
from specdec.analysis.machine_costs import forwards_per_model
from specdec.analysis.measure import (ScoredText, ForwardTimes, acceptance_per_position, forward_costs, measure_alpha,
                                      measure_step_costs, random_tree)
from specdec.sampling.tree import tree_attention_mask
from specdec.analysis.predicted import prediction_rows, render
from specdec.planning.theory import expected_tokens_per_loop, walltime_speedup
from specdec.sampling import SamplingParams

TEXT = [3, 17, 22, 9, 40, 5, 5, 31, 12, 8, 27, 19, 2, 44, 13, 7, 30, 21]


@pytest.fixture(scope="module")
def models():
    target_model, draft_model = make_model(seed=0), make_model(seed=1, layers=1)
    return target_model, draft_model, make_native(target_model), make_native(draft_model)


def _reference_probs(model, ids, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.softmax(logits / temperature, dim=-1)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_alpha_is_the_mean_overlap_of_next_token_distributions(models, temperature):
    target_model, draft_model, target, draft = models
    text = ScoredText("t", TEXT, first_scored=4)
    got = acceptance_per_position(target, draft, text, SamplingParams(temperature=temperature))
    p = _reference_probs(target_model, TEXT, temperature)[3:-1]  # logits t-1 predict token t
    q = _reference_probs(draft_model, TEXT, temperature)[3:-1]
    assert got.shape == (len(TEXT) - 4,)
    assert got.tolist() == pytest.approx(torch.minimum(p, q).sum(-1).tolist(), abs=1e-4)


def test_greedy_alpha_counts_argmax_agreement(models):
    target_model, draft_model, target, draft = models
    got = acceptance_per_position(target, draft, ScoredText("t", TEXT, 1), SamplingParams(temperature=0.0))
    agree = (_reference_probs(target_model, TEXT, 1.0).argmax(-1) == _reference_probs(draft_model, TEXT, 1.0).argmax(-1))
    assert got.tolist() == agree[:-1].float().tolist()


def test_a_model_against_itself_has_alpha_one_per_category(models):
    _, _, target, _ = models
    texts = [ScoredText("a", TEXT, 2), ScoredText("b", TEXT[:10], 3)]
    alpha = measure_alpha(target, target, texts, SamplingParams(temperature=0.8))
    assert set(alpha) == {"a", "b", "overall"}
    assert all(entry["alpha"] == pytest.approx(1.0, abs=1e-5) for entry in alpha.values())
    assert alpha["overall"]["positions"] == (len(TEXT) - 2) + (10 - 3)


def test_bad_scored_range_is_refused(models):
    _, _, target, draft = models
    with pytest.raises(ValueError, match="first_scored"):
        acceptance_per_position(target, draft, ScoredText("t", TEXT, 0), SamplingParams())


def test_step_costs_are_measured_and_interpolated(models):
    _, _, target, draft = models
    costs = measure_step_costs(target, draft, context=16, verify_widths=(1, 3, 5), repeats=3)
    assert costs.target_step_s > 0 and costs.draft_step_s > 0 and costs.c > 0
    assert target.seq_len == 0  # the timing leaves the cache empty
    fixed = ForwardTimes(16, 0.010, 0.002, {1: 0.010, 3: 0.012, 5: 0.016})
    assert fixed.c == pytest.approx(0.2)
    assert fixed.verify_s(2) == 0.012 and fixed.verify_s(3) == pytest.approx(0.014) and fixed.verify_s(9) == 0.016


def test_forward_costs_time_chains_and_trees_and_count_every_forward(models):
    _, _, target, _ = models
    for tree in (False, True):
        ticks = []
        costs = forward_costs(target, 16, [1, 4, 7], repeats=3, tree=tree, on_forward=lambda: ticks.append(1))
        assert sorted(costs.seconds) == [1, 4, 7] and min(costs.seconds.values()) > 0 and costs.prefill_s > 0
        assert len(ticks) == forwards_per_model([1, 4, 7], 3) and target.seq_len == 0


def test_a_random_tree_is_a_tree_in_topological_order():
    generator = torch.Generator().manual_seed(3)
    for nodes in (1, 2, 9, 33):
        mask, depths = random_tree(nodes, generator)
        assert mask.shape == (nodes, nodes) and bool(mask[:, 0].all()) and bool(mask.diagonal().all())
        assert torch.equal(mask, mask.tril())  # each node's ancestors come before it
        parents = [int(row[:i].nonzero().max()) - 1 if i else -1 for i, row in enumerate(mask)][1:]
        assert torch.equal(mask, tree_attention_mask(parents)) and torch.equal(depths, mask.sum(-1) - 1)


def test_predictions_sit_next_to_measurements():
    costs = ForwardTimes(256, 0.080, 0.016, {1: 0.080, 3: 0.084, 5: 0.090})
    measured = {"code": {4: {"speedup": 1.8, "mean_accepted_length": 3.0}}}
    rows = prediction_rows({"code": {"alpha": 0.8}}, costs, [2, 4], measured)
    by_k = {row["k"]: row for row in rows}
    assert by_k[4]["tau_predicted"] == pytest.approx(expected_tokens_per_loop(0.8, 4))
    assert by_k[4]["speedup_leviathan"] == pytest.approx(walltime_speedup(0.8, 4, 0.2))
    assert by_k[4]["speedup_with_costs"] == pytest.approx(
        expected_tokens_per_loop(0.8, 4) * 0.080 / (4 * 0.016 + 0.090))
    assert by_k[4]["measured_over_leviathan"] == pytest.approx(1.8 / walltime_speedup(0.8, 4, 0.2))
    assert "speedup_measured" not in by_k[2]
    text = render(rows, costs, 0.0)
    assert "c = 0.200" in text and "1.80x" in text
    assert render(rows, costs, 0.0, markdown=True).count("\n| code |") == 2
