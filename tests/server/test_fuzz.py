"""Fuzzing the live server: whatever a client sends, the answer is never a 5xx and the server stays up.

Two fuzzers: schemathesis generates requests from the app's own OpenAPI schema
(valid and invalid bodies for every operation), and hypothesis throws bodies of
random shapes and types at the generation endpoints with the served model name,
so that they get past the model check into sampling, encoding and the engine.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import content_type_conformance, not_a_server_error, status_code_conformance

from live_server import MODEL_NAME, serve, tiny_app

FUZZ_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck),
                         derandomize=True)


FUZZ_KEY = "fuzz-key"


@pytest.fixture(scope="module", params=[None, FUZZ_KEY], ids=["no-key", "api-key"])
def server(request):
    """(base URL, the headers every request sends): without an API key, and with one (its middleware
    must not turn any input into a 5xx either)."""
    # A 64-token context keeps every generated request short.
    with serve(tiny_app(slots=4, max_queue=64, max_context=64, api_key=request.param)) as base:
        yield base, {"Authorization": f"Bearer {request.param}"} if request.param else {}


@pytest.fixture(scope="module")
def fuzz_url(server):
    return server[0]


@pytest.fixture(scope="module")
def auth(server):
    return server[1]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_schemathesis_finds_no_server_error(fuzz_url, auth, mode):
    """Every operation of /openapi.json, bodies valid and invalid per the schema."""
    schema = schemathesis.openapi.from_url(f"{fuzz_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions",
                                               "GET /v1/models", "GET /health", "GET /metrics"}
    if mode == GenerationMode.NEGATIVE:  # GETs take no input to get wrong
        operations = [op for op in operations if op.label.startswith("POST")]
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @FUZZ_SETTINGS
        def check(case):
            response = case.call_and_validate(headers=auth, checks=[not_a_server_error, status_code_conformance,
                                                                    content_type_conformance])
            if response.status_code >= 400:
                assert set(response.json()["error"]) >= {"message", "type"}

        check()


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6)
                           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20), lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)
FIELDS = ["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n",
          "stream", "stream_options", "ignore_eos", "logprobs", "max_completion_tokens", "top_logprobs",
          "return_token_ids"]
PLAUSIBLE = {
    "prompt": st.text(max_size=80) | st.lists(st.integers(-5, 100), max_size=10),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bot"]),
                                                "content": st.text(max_size=40)}), max_size=3),
    "max_tokens": st.integers(-3, 80),
    "temperature": st.floats(-1, 3, allow_nan=False) | st.sampled_from([5e-324, 1e-40, 1e-6, 1e-5, 1e6, 1e308]),
    "top_p": st.floats(-0.5, 1.5, allow_nan=False), "top_k": st.integers(-3, 70), "seed": st.integers(-2, 2**64),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3), "stream": st.booleans(),
    "n": st.integers(-1, 5), "logprobs": st.integers(-1, 22) | st.booleans(), "top_logprobs": st.integers(-1, 22),
    "return_token_ids": st.booleans(),
}


STATUSES_SEEN: set[int] = set()


@st.composite
def requests(draw):
    """(endpoint, body): mostly plausible values, some of any JSON type, any subset of fields."""
    endpoint = draw(st.sampled_from(["completions", "chat/completions"]))
    body = {"model": MODEL_NAME}
    required = "prompt" if endpoint == "completions" else "messages"
    if draw(st.integers(0, 4)):  # usually present, so that most bodies get past the validator
        body[required] = draw(PLAUSIBLE[required])
    for field in draw(st.lists(st.sampled_from(FIELDS), unique=True, max_size=5)):
        plausible = PLAUSIBLE.get(field)
        body[field] = draw(plausible if plausible is not None and draw(st.integers(0, 3)) else JSON_VALUES)
    return endpoint, body


@given(endpoint_and_body=requests())
@FUZZ_SETTINGS
def test_random_bodies_get_an_answer_or_a_4xx(fuzz_url, auth, endpoint_and_body):
    endpoint, body = endpoint_and_body
    response = httpx.post(f"{fuzz_url}/v1/{endpoint}", json=body, headers=auth, timeout=60)
    STATUSES_SEEN.add(response.status_code)
    assert response.status_code in (200, 400, 404), response.text
    if response.status_code != 200:
        assert response.json()["error"]["message"]
    elif body.get("stream") is True:
        assert response.text.rstrip().endswith("data: [DONE]")
    else:
        assert response.json()["usage"]["completion_tokens"] >= 1


def test_the_server_survived_the_fuzzing(fuzz_url, auth):
    assert STATUSES_SEEN >= {200, 400}  # the random bodies reached the engine, not only the validator
    assert httpx.get(f"{fuzz_url}/health").json()["status"] == "ok"
    ok = httpx.post(f"{fuzz_url}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4},
                    headers=auth)
    assert ok.status_code == 200
