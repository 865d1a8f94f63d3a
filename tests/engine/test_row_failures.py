"""A target whose logits turn NaN for one request: that request fails with a clear error and emits
nothing wrong, and every other request in the batch runs on to the output it would have alone."""

from __future__ import annotations

import pytest
import torch

from conftest import CHARS, make_model, make_native, run_all
from specdec.engine import GenerationError, SpecEngine
from specdec.engine.batch import BatchEngine
from specdec.proposers.registry import build_proposer
from specdec.sampling import SamplingParams

POISON = "z"  # its embedding row is NaN: every logit of a row that reads it is NaN


@pytest.fixture(scope="module")
def poisoned():
    model = make_model(seed=0, random_bias=True)
    with torch.no_grad():
        model.get_input_embeddings().weight[CHARS.index(POISON) + 2] = float("nan")
    return model


@pytest.mark.parametrize("temperature", [0.0, 1e-40, 0.8])
@pytest.mark.parametrize("method", ["autoregressive", "ngram"])
def test_a_request_whose_logits_are_nan_fails_alone(poisoned, tokenizer, method, temperature):
    slots = 3
    batched = BatchEngine(make_native(poisoned, batch_size=slots), build_proposer(method, slots=slots),
                          tokenizer, k=3, prompt_cache=False)
    params = SamplingParams(temperature=temperature, seed=7)
    prompts = {"clean": "the quick brown fox", "poisoned": "lazy dogs", "also clean": "hello hello hello"}
    requests = {name: batched.make_request(prompt, params, max_new_tokens=12) for name, prompt in prompts.items()}
    errors = {}
    got = run_all(batched, requests, errors)
    out, reasons = {name: tokens for name, (tokens, _) in got.items()}, {name: why for name, (_, why) in got.items()}
    assert reasons["poisoned"] == "error" and out["poisoned"] == []
    assert "no finite value" in errors["poisoned"]
    alone = SpecEngine(make_native(poisoned), build_proposer(method), tokenizer, k=3)
    for name in ("clean", "also clean"):
        expected = alone.generate(prompts[name], params, max_new_tokens=12)
        assert errors[name] is None
        assert (out[name], reasons[name]) == (expected.token_ids, expected.finish_reason)
        assert all(0 <= token < poisoned.config.vocab_size for token in out[name])
    with pytest.raises(GenerationError, match="no finite value"):
        alone.generate(prompts["poisoned"], params, max_new_tokens=12)
    # The engine serves on after the failure, and the failed row was not parked as a prompt cache.
    again = run_all(batched, {"next": batched.make_request(prompts["clean"], params, max_new_tokens=12)})
    assert again["next"][0] == out["clean"]
