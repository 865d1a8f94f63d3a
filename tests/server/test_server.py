"""The OpenAI-compatible server, run for real under uvicorn on localhost, with real clients."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from conftest import make_model, make_native
from live_server import MODEL_NAME, chat_tokenizer, serve, tiny_app
from specdec.engine import SpecEngine
from specdec.engine.request import chat_template_ids
from specdec.sampling import SamplingParams

LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}  # ~10 s of tiny-model decoding


@pytest.fixture(scope="module")
def url():
    with serve(tiny_app(method="draft", k=3, slots=4, max_queue=8)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference():
    """Plain greedy decoding of the same target, one request at a time."""
    return SpecEngine(make_native(make_model(seed=0)), None, chat_tokenizer())


def metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics as {'name{label="v"}': value}."""
    values = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


async def ask_at_once(base: str, prompts: list[str], max_tokens: int) -> list[dict]:
    """Greedy completions of every prompt, all sent at once (so the server batches them)."""
    async with httpx.AsyncClient(timeout=60) as http:
        bodies = [{"model": MODEL_NAME, "prompt": p, "max_tokens": max_tokens, "temperature": 0} for p in prompts]
        responses = await asyncio.gather(*(http.post(f"{base}/v1/completions", json=b) for b in bodies))
        return [response.raise_for_status().json() for response in responses]


# ---- the API with the official client ------------------------------------------------------------


def test_completion_is_the_targets_greedy_output_with_speculative_stats(client, reference):
    prompt = "the quick brown fox"
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0)
    expected = reference.generate(prompt, SamplingParams(temperature=0), max_new_tokens=40)
    choice = response.choices[0]
    assert choice.text == expected.text
    assert choice.finish_reason == {"eos": "stop", "stop": "stop", "length": "length"}[expected.finish_reason]
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.token_ids)
    spec = response.model_extra["speculative"]
    assert spec["method"] == "draft" and spec["k"] == 3
    assert 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"] <= 3 * spec["target_forwards"]
    # Each forward emits its accepted drafts plus one token (unless EOS cut the last step).
    assert spec["target_forwards"] + spec["accepted_tokens"] >= response.usage.completion_tokens
    assert spec["mean_accepted_length"] == pytest.approx(
        response.usage.completion_tokens / spec["target_forwards"], abs=1e-3)


def test_a_suffix_server_shares_its_cache_across_requests(reference):
    """--method suffix: the second of two requests drafts from what the first wrote, output unchanged."""
    prompt = "hello there, how are"
    expected = reference.generate(prompt, SamplingParams(temperature=0), max_new_tokens=40)
    with serve(tiny_app(method="suffix", k=4, slots=2)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        answers = [client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0)
                   for _ in range(2)]
    assert [answer.choices[0].text for answer in answers] == [expected.text] * 2
    first, second = (answer.model_extra["speculative"] for answer in answers)
    assert first["method"] == "suffix"
    assert second["accepted_tokens"] > first["accepted_tokens"] and second["target_forwards"] < 20


def test_a_head_server_drafts_trees_for_concurrent_clients_and_answers_plain_greedy(reference):
    """--method eagle-tree: every row drafts its own EAGLE-2 tree from the target's features, the
    trees of concurrent requests are verified in one forward; answers are plain greedy's."""
    from specdec.config import HeadOptions, SpecConfig
    from specdec.models.heads import FrozenVocabulary, HeadConfig, LoadedHead, build_head
    from specdec.server import build_server

    model = make_model(seed=0)
    target = make_native(model, max_context=4096)
    head_config = HeadConfig.for_target("eagle", target.decoder.config)
    torch.manual_seed(0)
    vocab_ids = torch.arange(model.config.vocab_size)
    head = LoadedHead(head_config, build_head(head_config).eval(), vocab_ids, {})
    vocabulary = FrozenVocabulary(model.get_input_embeddings().weight, model.get_output_embeddings().weight, vocab_ids)
    config = SpecConfig(method="eagle-tree", k=3, options=(HeadOptions(tree_size=6, tree_topk=2),))
    app = build_server(target, chat_tokenizer(), name=MODEL_NAME, config=config, slots=3, prefill_chunk=16,
                       head=(head, vocabulary))
    prompts = ["the quick brown fox", "hello", "why? because.", "a b c d e f"]
    with serve(app) as base:
        answers = asyncio.run(ask_at_once(base, prompts, max_tokens=30))
    for prompt, answer in zip(prompts, answers):
        expected = reference.generate(prompt, SamplingParams(temperature=0), max_new_tokens=30)
        assert answer["choices"][0]["text"] == expected.text, prompt
        assert answer["speculative"]["method"] == "eagle-tree" and answer["speculative"]["drafted_tokens"] > 0


def test_a_lookahead_server_guesses_for_concurrent_clients_and_answers_plain_greedy(reference):
    """--method lookahead: each row's Jacobi window rides in the step's one forward beside the other
    rows'; the n-grams the target wrote for itself are drafted, and answers are plain greedy's."""
    prompts = ["the quick brown fox", "hello", "why? because.", "a b c d e f"]
    with serve(tiny_app(method="lookahead", k=4, slots=3)) as base:
        answers = asyncio.run(ask_at_once(base, prompts, max_tokens=60))
    for prompt, answer in zip(prompts, answers):
        expected = reference.generate(prompt, SamplingParams(temperature=0), max_new_tokens=60)
        assert answer["choices"][0]["text"] == expected.text, prompt
        assert answer["speculative"]["method"] == "lookahead"
        assert answer["speculative"]["accepted_tokens"] > 5  # every row's own guesses were kept


def test_token_id_prompts_and_default_max_tokens(client, reference):
    ids = chat_tokenizer()("hello world")["input_ids"]
    response = client.completions.create(model=MODEL_NAME, prompt=ids, temperature=0, extra_body={"ignore_eos": True})
    assert response.usage.prompt_tokens == len(ids) and response.usage.completion_tokens == 16  # OpenAI's default
    expected = reference.generate(ids, SamplingParams(temperature=0), max_new_tokens=16)
    assert response.choices[0].text == expected.text


def test_chat_applies_the_template(client, reference):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    response = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=30, temperature=0)
    ids = chat_template_ids(chat_tokenizer(), messages)
    expected = reference.generate(ids, SamplingParams(temperature=0), max_new_tokens=30)
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].message.role == "assistant"
    assert response.usage.prompt_tokens == len(ids)
    assert response.model_extra["speculative"]["target_forwards"] >= 1


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streaming_yields_the_same_text_then_usage(client, endpoint):
    common = dict(model=MODEL_NAME, max_tokens=40, temperature=0.8, seed=7, extra_body={"ignore_eos": True})
    if endpoint == "chat":
        messages = [{"role": "user", "content": "tell me a story"}]
        whole = client.chat.completions.create(messages=messages, **common).choices[0].message.content
        chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                     stream_options={"include_usage": True}, **common))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        whole = client.completions.create(prompt="once upon a time", **common).choices[0].text
        chunks = list(client.completions.create(prompt="once upon a time", stream=True,
                                                stream_options={"include_usage": True}, **common))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole  # seeded sampling: the same draws streamed or not
    assert len([c for c in chunks if c.choices]) > 3  # it really streamed
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["speculative"]["drafted_tokens"] > 0
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40


def test_stop_strings_cut_the_text(client):
    free = client.completions.create(model=MODEL_NAME, prompt="the quick brown fox", max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = free[12:14]
    cut = client.completions.create(model=MODEL_NAME, prompt="the quick brown fox", max_tokens=40, temperature=0,
                                    stop=[stop, "never appears"], extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == free[: free.index(stop)]
    streamed = client.completions.create(model=MODEL_NAME, prompt="the quick brown fox", max_tokens=40,
                                         temperature=0, stop=stop, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == cut.text  # never streams past the stop string


def test_models_and_health(client, url):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].model_extra["speculative"] == {"method": "draft", "k": 3, "max_k": 8,
                                                    "methods": ["draft", "autoregressive", "copy", "ngram", "suffix"]}
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


# ---- concurrency ----------------------------------------------------------------------------------


def test_each_request_may_choose_its_method_and_k_and_gets_plain_greedy_output(url, client, reference):
    """Requests of every loaded method and several k at once, batched together: each answer is the
    target's greedy one, and its `speculative` block says what it ran with."""
    asked = [{"method": "ngram", "k": 4}, {"method": "copy"}, {"method": "suffix", "k": "auto"}, {"k": 0},
             {"method": "autoregressive"}, None, {"method": "draft", "k": 1}, {"method": "ngram", "k": 0}]
    prompts = ["hello hello hello hello", "the quick brown fox", "abc abc abc, abc abc", "why? because.",
               "one two three", "a b c d e f", "tide tables", "x y x y x y"]

    async def ask_all():
        async with httpx.AsyncClient(timeout=60) as http:
            bodies = [{"model": MODEL_NAME, "prompt": prompt, "max_tokens": 40, "temperature": 0,
                       **({"speculative": speculative} if speculative else {})}
                      for prompt, speculative in zip(prompts, asked)]
            responses = await asyncio.gather(*(http.post(f"{url}/v1/completions", json=b) for b in bodies))
            return [response.raise_for_status().json() for response in responses]

    answers = asyncio.run(ask_all())
    ran = [(a["speculative"]["method"], a["speculative"]["k"], a["speculative"]["drafted_tokens"]) for a in answers]
    assert [(method, k) for method, k, _ in ran] == [("ngram", 4), ("copy", 3), ("suffix", "auto"), ("draft", 0),
                                                     ("autoregressive", 0), ("draft", 3), ("draft", 1), ("ngram", 0)]
    assert all(drafted == 0 for method, k, drafted in ran if k == 0)
    assert ran[0][2] > 0 and ran[5][2] > 0  # the repeated prompt is copied; the draft model drafts
    for prompt, answer in zip(prompts, answers):
        expected = reference.generate(prompt, SamplingParams(temperature=0), max_new_tokens=40)
        assert answer["choices"][0]["text"] == expected.text, prompt
    streamed = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi hi hi"}],
                                              max_tokens=12, temperature=0, stream=True,
                                              extra_body={"speculative": {"method": "suffix", "k": 2}})
    closing = [chunk for chunk in streamed if chunk.choices and chunk.choices[0].finish_reason][0]
    assert closing.model_extra["speculative"]["method"] == "suffix" and closing.model_extra["speculative"]["k"] == 2



def test_concurrent_clients_are_batched_and_each_gets_its_own_answer(url, reference):
    prompts = ["the quick brown fox", "hello", "why? because.", "a b c d e f", "one two three", "x", "zebra",
               "tide tables"]
    before = metrics(url)

    async def ask(http: httpx.AsyncClient, prompt: str) -> dict:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 48, "temperature": 0}
        response = await http.post(f"{url}/v1/completions", json=body)
        response.raise_for_status()
        return response.json()

    async def ask_all():
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(*(ask(http, p) for p in prompts))

    answers = asyncio.run(ask_all())
    for prompt, answer in zip(prompts, answers):
        expected = reference.generate(prompt, SamplingParams(temperature=0), max_new_tokens=48)
        assert answer["choices"][0]["text"] == expected.text, prompt
    after = metrics(url)
    steps = after["specdec_engine_step_rows_count"] - before.get("specdec_engine_step_rows_count", 0)
    single_row_steps = (after['specdec_engine_step_rows_bucket{le="1.0"}']
                        - before.get('specdec_engine_step_rows_bucket{le="1.0"}', 0))
    assert steps > single_row_steps  # some steps verified several requests in one forward
    assert after['specdec_engine_step_rows_bucket{le="4.0"}'] == after["specdec_engine_step_rows_count"]  # <= slots
    generated = after["specdec_generation_tokens_total"] - before["specdec_generation_tokens_total"]
    assert generated == sum(a["usage"]["completion_tokens"] for a in answers)


def test_a_client_that_disconnects_mid_stream_frees_its_row(url, client):
    before = metrics(url)
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{url}/v1/completions",
                         json={"model": MODEL_NAME, "prompt": "hello", "stream": True, **LONG}) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # it started generating
    cancelled = 'specdec_requests_total{endpoint="completions",outcome="cancelled"}'
    wait_for(lambda: metrics(url).get(cancelled, 0) == before.get(cancelled, 0) + 1)
    after = metrics(url)
    assert after["specdec_running_requests"] == 0
    assert after["specdec_generation_tokens_total"] - before["specdec_generation_tokens_total"] < 2000
    # ...and the server goes on serving.
    assert client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=5).usage.completion_tokens >= 1


def test_a_waiting_non_streaming_client_that_leaves_is_dropped(url):
    before = metrics(url)
    cancelled = 'specdec_requests_total{endpoint="completions",outcome="cancelled"}'
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": "hello", **LONG}, timeout=1.0)
    wait_for(lambda: metrics(url).get(cancelled, 0) == before.get(cancelled, 0) + 1)
    assert metrics(url)["specdec_running_requests"] == 0


def test_a_full_queue_answers_429_and_recovers():
    with serve(tiny_app(slots=1, max_queue=1)) as base, httpx.Client(timeout=30) as http:
        body = {"model": MODEL_NAME, "prompt": "hello", "stream": True, **LONG}
        with http.stream("POST", f"{base}/v1/completions", json=body) as running:
            lines = running.iter_lines()  # kept: a collected iterator closes the response
            next(lines)
            with http.stream("POST", f"{base}/v1/completions", json=body) as waiting:
                wait_for(lambda: metrics(base)["specdec_waiting_requests"] == 1)
                refused = httpx.post(f"{base}/v1/completions", json={**body, "stream": False})
                assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
                assert refused.json()["error"]["code"] == "queue_full"
                assert waiting.status_code == 200
        wait_for(lambda: metrics(base)["specdec_running_requests"] == 0
                 and metrics(base)["specdec_waiting_requests"] == 0)
        assert metrics(base)['specdec_rejected_requests_total{reason="queue_full"}'] == 1
        ok = http.post(f"{base}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3})
        assert ok.status_code == 200


def test_a_stopped_engine_answers_503_and_health_says_so():
    app = tiny_app(slots=1)
    with serve(app) as base:
        app.state.scheduler.stop()
        assert httpx.get(f"{base}/health").status_code == 503
        refused = httpx.post(f"{base}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "unavailable"


# ---- bad input ------------------------------------------------------------------------------------

BAD_REQUESTS = [
    ("completions", b'{"model": "tiny", "prompt": ', 400, "not valid JSON"),
    ("completions", b'["a list"]', 400, "JSON object"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "temperature": -0.1}, 400, "temperature"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "stop": [""]}, 400, "stop"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "seed": -1}, 400, "seed"),
    ("completions", {"model": MODEL_NAME, "prompt": ""}, 400, "prompt"),
    ("completions", {"model": MODEL_NAME}, 400, "prompt"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi " * 3000}, 400, "context"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 5000}, 400, "context"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "n": 0}, 400, "n"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "n": 17}, 400, "n"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                          "top_logprobs": 2}, 400, "top_logprobs needs logprobs"),
    ("completions", {"model": "gpt-4", "prompt": "hi"}, 404, "does not exist"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "speculative": {"method": "eagle"}}, 400,
     "'eagle' is not loaded on this engine; loaded: draft, autoregressive, copy, ngram, suffix"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "speculative": {"k": -1}}, 400, "speculative"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "speculative": {"k": 9}}, 400, "at most 8"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "speculative": {"k": "fast"}}, 400, "speculative"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "speculative": {"k": 2.0}}, 400, "speculative"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "speculative": {"method": 3}}, 400, "speculative"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "speculative": {"tree": 4}}, 400, "tree"),
    ("completions", {"model": MODEL_NAME, "prompt": "hi", "speculative": "ngram"}, 400, "speculative"),
    ("chat/completions", {"model": MODEL_NAME, "messages": []}, 400, "messages"),
    ("chat/completions", {"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("chat/completions", {"model": MODEL_NAME, "messages": "hello"}, 400, "messages"),
    ("chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                          "max_completion_tokens": 0}, 400, "max_completion_tokens"),
]


@pytest.mark.parametrize("endpoint,body,status,message", BAD_REQUESTS)
def test_bad_input_is_an_openai_style_4xx(url, endpoint, body, status, message):
    if isinstance(body, bytes):
        response = httpx.post(f"{url}/v1/{endpoint}", content=body, headers={"Content-Type": "application/json"})
    else:
        response = httpx.post(f"{url}/v1/{endpoint}", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"]
    assert httpx.get(f"{url}/health").status_code == 200


def test_the_official_client_raises_its_own_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x " * 3000}])


def test_unknown_routes_and_methods_are_json_errors(url):
    assert httpx.get(f"{url}/v1/nothing").json()["error"]["message"] == "Not Found"
    assert httpx.get(f"{url}/v1/completions").status_code == 405


# ---- metrics --------------------------------------------------------------------------------------


def test_metrics_report_traffic_latency_and_acceptance(client, url):
    client.completions.create(model=MODEL_NAME, prompt="the quick brown fox", max_tokens=30, temperature=0)
    values = metrics(url)
    for name in ("specdec_time_to_first_token_seconds_count", "specdec_inter_token_latency_seconds_count",
                 "specdec_request_latency_seconds_count", "specdec_queue_time_seconds_count",
                 "specdec_engine_step_seconds_count", "specdec_prompt_tokens_total"):
        assert values[name] > 0, name
    tokens, forwards = values["specdec_generation_tokens_total"], values["specdec_target_forwards_total"]
    assert values["specdec_mean_accepted_length"] == pytest.approx(tokens / forwards)
    assert tokens <= forwards + values["specdec_accepted_tokens_total"]  # EOS / stop strings cut some steps
    drafted_first = values['specdec_draft_tokens_by_position_total{position="0"}']
    accepted_first = values['specdec_accepted_tokens_by_position_total{position="0"}']
    assert values['specdec_acceptance_rate_by_position{position="0"}'] == pytest.approx(accepted_first / drafted_first)
    assert values['specdec_info{k="3",method="draft",model="tiny"}'] == 1
    assert values["specdec_slots"] == 4


def test_the_openapi_schema_documents_the_error_bodies(url):
    schema = httpx.get(f"{url}/openapi.json").json()
    responses = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "404", "429", "503"} <= set(responses)
    assert json.dumps(schema).count("ErrorBody") >= 4


@pytest.mark.parametrize("public_metrics", [False, True])
def test_an_api_key_guards_v1_and_metrics_but_not_health(public_metrics):
    """--api-key: a request without `Authorization: Bearer KEY` gets 401 and an OpenAI-style body; the
    official client with the key is served, with a wrong key raises AuthenticationError."""
    with serve(tiny_app(slots=1, api_key="s3cret", public_metrics=public_metrics)) as base, \
            httpx.Client(timeout=30) as http:
        assert http.get(f"{base}/health").status_code == 200
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
            answer = http.request(method, f"{base}{path}", json={"model": MODEL_NAME, "prompt": "hi"})
            assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key", path
            assert answer.headers["www-authenticate"] == "Bearer"
        wrong = http.get(f"{base}/v1/models", headers={"Authorization": "Bearer s3cre"})
        assert wrong.status_code == 401
        assert http.get(f"{base}/metrics").status_code == (200 if public_metrics else 401)
        assert http.get(f"{base}/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="s3cret", max_retries=0)
        reply = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens == 4
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="nope", max_retries=0).models.list()


def _target_logprobs(prompt_ids: list[int], token_ids: list[int], temperature: float) -> torch.Tensor:
    """[n, V] log-probabilities of the target (the transformers model) at each emitted position:
    the raw softmax at temperature 0, the tempered one above it."""
    model = make_model(seed=0)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + token_ids])).logits[0, len(prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits / (temperature or 1.0), dim=-1)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_completion_logprobs_are_the_targets_at_the_emitted_positions(client, temperature):
    """logprobs=N on a speculative server: each token's log-probability under the target's (warped)
    distribution at its position, whatever the draft proposed, and the N most likely alternatives."""
    reply = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=12, temperature=temperature,
                                      seed=3, logprobs=3, extra_body={"return_token_ids": True})
    choice = reply.choices[0]
    ids, logprobs = choice.model_extra["token_ids"], choice.logprobs
    # 12 tokens, or fewer where the sampled text reached the end of sequence (the seed decides)
    assert len(logprobs.tokens) == len(ids) and "".join(logprobs.tokens) == choice.text
    assert len(ids) == 12 or (choice.finish_reason == "stop" and len(ids) >= 2)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset[1] == len(logprobs.tokens[0])
    expected = _target_logprobs(chat_tokenizer()("hello world")["input_ids"], ids, temperature)
    for j, token in enumerate(ids):
        assert logprobs.token_logprobs[j] == pytest.approx(float(expected[j, token]), abs=1e-4)
        top = logprobs.top_logprobs[j]  # a dict by text: ids the tiny tokenizer cannot spell share the key ""
        assert 1 <= len(top) <= 3 and all(value <= 0 for value in top.values())
    assert reply.model_extra["speculative"]["drafted_tokens"] > 0  # speculation ran, and changed nothing


def test_chat_logprobs_streamed_and_whole_agree(client):
    messages = [{"role": "user", "content": "hi there"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0,
                                           logprobs=True, top_logprobs=2)
    content = whole.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == whole.choices[0].message.content
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)
    # Greedy: the emitted token is the most likely one, so it heads its own alternatives.
    assert all(entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
               and entry.logprob >= entry.top_logprobs[1].logprob for entry in content)
    assert all(entry.bytes == list(entry.token.encode()) for entry in content)
    streamed = [entry for chunk in client.chat.completions.create(
                    model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2,
                    stream=True)
                for choice in chunk.choices if choice.logprobs for entry in choice.logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]


def test_n_samples_share_one_prefill_and_each_is_the_seeded_request_alone(client, url):
    """n=3 with a seed: choice i is what the request seeded seed + i writes alone (so the choices differ),
    streamed or not; the prompt is counted once, the choices' tokens all."""
    messages = [{"role": "user", "content": "tell me"}]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=1.0,
                                           seed=11, n=3)
    texts = [choice.message.content for choice in sorted(reply.choices, key=lambda c: c.index)]
    singles = [client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=1.0,
                                              seed=11 + i) for i in range(3)]
    alone = [single.choices[0].message.content for single in singles]
    assert texts == alone and len(set(texts)) > 1
    # Up to 8 tokens each (a sampled end of sequence stops a choice sooner), every choice's counted.
    assert reply.usage.completion_tokens == sum(single.usage.completion_tokens for single in singles) > 3
    assert reply.usage.prompt_tokens == len(
        chat_template_ids(chat_tokenizer(), messages))
    streamed = {0: "", 1: "", 2: ""}
    finished = set()
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=1.0,
                                                seed=11, n=3, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert [streamed[i] for i in range(3)] == texts and finished == {0, 1, 2}
    completion = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=6, temperature=0, n=2)
    assert len(completion.choices) == 2 and completion.choices[0].text == completion.choices[1].text  # greedy


def test_a_chats_next_turns_read_only_their_new_tokens_and_answer_as_without_the_cache(client, reference, url):
    """Prompt caching across requests: turn n + 1's prompt begins with turn n's prompt and answer, which
    the server kept in a free slot; usage.prompt_tokens_details.cached_tokens says how many tokens it
    did not read again, and every answer is still the target's greedy one."""
    messages = [{"role": "user", "content": "tell me about foxes, quick ones"}]
    previous_prompt, cached_before, cached_here = 0, metrics(url)["specdec_prompt_tokens_cached_total"], 0
    for turn in range(3):
        response = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=20, temperature=0)
        ids = chat_template_ids(chat_tokenizer(), messages)
        expected = reference.generate(ids, SamplingParams(temperature=0), max_new_tokens=20)
        answer = response.choices[0].message.content
        assert answer == expected.text
        cached = response.usage.prompt_tokens_details.cached_tokens
        assert response.usage.prompt_tokens == len(ids)
        if turn:
            assert previous_prompt <= cached < len(ids)  # at least the last turn's whole prompt
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"and turn {turn}?"}]
        previous_prompt, cached_here = len(ids), cached_here + cached
    assert metrics(url)["specdec_prompt_tokens_cached_total"] - cached_before == cached_here  # Prometheus too
