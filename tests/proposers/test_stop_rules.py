"""The draft model's stop rules: the learned one stops where the chain's chance of acceptance falls
below keep, reads only the draft's distribution (greedy output stays plain decoding's, the sampled law
the target's), and round-trips as data."""

import math

import pytest
import torch
from conftest import VOCAB_SIZE, make_model, make_native

from specdec.analysis.lossless import distribution_tests
from specdec.engine import SpecEngine
from specdec.models.hf import HFRunner
from specdec.proposers import DraftModelProposer
from specdec.proposers.base import ProposeContext
from specdec.proposers.draft_model import DraftOptions
from specdec.proposers.registry import build_proposer
from specdec.proposers.stop_rules import STOP_FEATURES, ConfidenceStop, LearnedStop, stop_features
from specdec.sampling import SamplingParams


def constant(acceptance: float, keep: float) -> LearnedStop:
    """Every drafted token accepted with this chance, whatever its features."""
    n = len(STOP_FEATURES)
    return LearnedStop((0.0,) * n, (1.0,) * n, (0.0,) * n, math.log(acceptance / (1 - acceptance)), keep)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=1.0)])
def test_the_chain_stops_where_its_chance_of_acceptance_falls_below_keep(params):
    """0.8 a token, keep 0.6: 0.8 and 0.64 go on, 0.512 stops: three tokens of eight."""
    generator = torch.Generator().manual_seed(0) if not params.greedy else None
    context = ProposeContext(torch.tensor([[3, 4, 5, 6]]), params, generator, VOCAB_SIZE)
    proposer = DraftModelProposer(HFRunner(make_model(seed=1, layers=1)), stop_rule=constant(0.8, 0.6))
    assert int(proposer.propose([context], [8]).num_tokens[0]) == 3


def test_the_features_and_the_threshold_read_the_drawn_token():
    probs = torch.tensor([0.5, 0.3, 0.2])
    features = stop_features(probs, 1, 2)
    assert features[:2] == pytest.approx([0.3, 0.3])  # the token's probability, the second highest
    assert features[2] == pytest.approx(-(0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.2)))
    assert features[3] == pytest.approx(math.log(3))
    assert ConfidenceStop(0.4).stops(probs, 1, 0, 1.0) == (True, 1.0)
    assert ConfidenceStop(0.4).stops(probs, 0, 0, 1.0) == (False, 1.0)


def test_a_learned_rule_keeps_greedy_output_and_the_sampled_law():
    model = make_model(seed=0)
    target = make_native(model)
    rule = LearnedStop((0.3, 0.1, 2.0, 0.5), (0.2, 0.1, 1.0, 0.5), (2.0, -1.0, -0.5, -0.5), 0.5, 0.3)
    spec = SpecEngine(target, DraftModelProposer(HFRunner(make_model(seed=1, layers=1)), stop_rule=rule), None,
                      k=5, eos_token_ids=frozenset())
    plain = SpecEngine(target, None, None, eos_token_ids=frozenset())
    greedy = SamplingParams(temperature=0)
    for prompt in ([5, 9, 12, 3], [20, 21, 22]):
        assert spec.generate(prompt, greedy, max_new_tokens=30).token_ids == \
            plain.generate(prompt, greedy, max_new_tokens=30).token_ids
    params = SamplingParams(temperature=0.9)
    tests = distribution_tests(list(spec.sample_continuations([5, 9], params, 600)),
                               list(plain.sample_continuations([5, 9], params, 600, seed=10_000)))
    assert min(test.p_value for test in tests) > 1e-4, tests


def test_a_rule_round_trips_as_data_and_a_bad_file_is_a_clear_error(tmp_path):
    rule = constant(0.7, 0.25)
    (tmp_path / "rule.json").write_text(rule.to_json(fitted_on=["somewhere"]))
    assert LearnedStop.load(tmp_path / "rule.json") == rule
    (tmp_path / "bad.json").write_text('{"kind": "logistic hazard"}')
    with pytest.raises(ValueError, match="not a draft stop rule"):
        LearnedStop.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="keep"):
        LearnedStop((0.0,) * 4, (1.0,) * 4, (0.0,) * 4, 0.0, 1.5)


def test_draft_stop_names_the_threshold_the_shipped_rule_or_a_file(tmp_path):
    assert DraftOptions().rule(0.3) == ConfidenceStop(0.3)  # the default: --draft-confidence's threshold
    shipped = DraftOptions(stop="learned").rule(0.3)
    assert isinstance(shipped, LearnedStop) and 0.0 < shipped.keep < 1.0
    assert shipped.acceptance([0.99, 0.005, 0.05, 0.0]) > shipped.acceptance([0.3, 0.25, 2.5, 0.0])
    assert DraftOptions(stop="learned").rule(None) is None  # a fixed k drafts exactly k
    (tmp_path / "rule.json").write_text(constant(0.7, 0.25).to_json())
    assert DraftOptions(stop=str(tmp_path / "rule.json")).rule(0.4) == constant(0.7, 0.25)
    with pytest.raises(ValueError, match="missing.json is not a draft stop rule"):
        DraftOptions(stop=str(tmp_path / "missing.json"))  # refused when the options are made


@pytest.mark.parametrize("method", ["draft", "ngram+draft"])
def test_the_registry_hands_the_chosen_rule_to_the_draft_model(draft_runner, method):
    built = build_proposer(method, draft_runner=draft_runner, adaptive=True, draft_confidence=0.4,
                           draft=DraftOptions(stop="learned"))
    draft = built if method == "draft" else built.draft
    assert draft.stop_rule == DraftOptions(stop="learned").rule(0.4)
