"""Hostile and unlucky input through the real server (docs/security.md): tiny temperatures, huge
bodies and stop strings, clients that leave behind an API key, deadlines, a model whose logits turn
NaN, an engine thread that hits an unexpected error, and two tenants' caches."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
import torch

from conftest import CHARS, make_model, make_native
from live_server import MODEL_NAME, chat_tokenizer, serve, tiny_app
from specdec.config import SpecConfig
from specdec.proposers.scored_copy import CopyOptions
from specdec.server import ServerLimits, build_server

from test_server import LONG, metrics, wait_for

KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def keyed():
    """A server with an API key and tight limits, and a greedy reference answer from it."""
    limits = ServerLimits(max_body_bytes=1024 * 1024, max_tokens_cap=3000, max_stop_chars=100,
                          max_prompt_chars=20_000)
    with serve(tiny_app(slots=4, max_queue=8, api_key=KEY, limits=limits)) as base:
        yield base


def complete(base: str, timeout: float = 60, **fields) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json={"model": MODEL_NAME, **fields}, headers=AUTH, timeout=timeout)


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-6])
def test_a_tiny_temperature_gives_the_greedy_answer(keyed, temperature):
    greedy = complete(keyed, prompt="the quick brown", max_tokens=24, temperature=0, return_token_ids=True)
    tiny = complete(keyed, prompt="the quick brown", max_tokens=24, temperature=temperature, return_token_ids=True)
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["token_ids"] == greedy.json()["choices"][0]["token_ids"]
    assert all(0 <= t < 64 for t in tiny.json()["choices"][0]["token_ids"])


def test_a_body_past_the_limit_gets_413_without_being_read(keyed):
    started = time.perf_counter()
    answer = httpx.post(f"{keyed}/v1/completions", content=b"x" * (10 * 1024 * 1024), headers={
        **AUTH, "Content-Type": "application/json"}, timeout=30)
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "request_too_large"
    assert "--max-body-mb" in answer.json()["error"]["message"]
    print(f"10 MB body: 413 in {(time.perf_counter() - started) * 1e3:.0f} ms")
    # Without a Content-Length (chunked), counted as it arrives.
    chunks = (b"x" * 65536 for _ in range(40))
    answer = httpx.post(f"{keyed}/v1/completions", content=chunks, headers={**AUTH, "Content-Type": "application/json"},
                        timeout=30)
    assert answer.status_code == 413
    assert complete(keyed, prompt="hi", max_tokens=3).status_code == 200


def test_a_body_sent_too_slowly_gets_408():
    with serve(tiny_app(slots=1, limits=ServerLimits(body_timeout_s=0.3))) as base:
        host, port = base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as connection:
            connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               b"Content-Length: 100\r\n\r\n{\"model\":")
            reply = b""
            while chunk := connection.recv(4096):  # the server closes after its answer
                reply += chunk
            reply = reply.decode()
        assert reply.startswith("HTTP/1.1 408") and "request_timeout" in reply
        assert httpx.get(f"{base}/health").status_code == 200


@pytest.mark.parametrize("fields, message", [
    ({"stop": ["x" * 10_000] * 16}, "stop strings may be at most 100"),
    ({"stop": ["y" * 90] * 5}, "400 in all"),
    ({"max_tokens": 3001}, "--max-tokens-cap"),
    ({"prompt": "ab" * 10_001}, "--max-prompt-chars"),
])
def test_limits_are_clear_400s(keyed, fields, message):
    started = time.perf_counter()
    answer = complete(keyed, **{"prompt": "hi", "max_tokens": 4, **fields})
    assert answer.status_code == 400 and message in answer.json()["error"]["message"], answer.text
    print(f"{message}: 400 in {(time.perf_counter() - started) * 1e3:.0f} ms")


def test_an_overlong_chat_is_refused_before_its_template(keyed):
    answer = httpx.post(f"{keyed}/v1/chat/completions", headers=AUTH, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hello " * 2000}] * 3}, timeout=30)
    assert answer.status_code == 400 and "--max-prompt-chars" in answer.json()["error"]["message"]


def test_a_client_that_leaves_mid_stream_behind_a_key_frees_its_row(keyed):
    cancelled = 'specdec_requests_total{endpoint="completions",outcome="cancelled"}'
    scrape = lambda: metrics_with_key(keyed)  # noqa: E731
    before = scrape()
    with httpx.Client(timeout=30, headers=AUTH) as http:
        with http.stream("POST", f"{keyed}/v1/completions",
                         json={"model": MODEL_NAME, "prompt": "hello", "stream": True, **LONG}) as response:
            assert next(line for line in response.iter_lines() if line.startswith("data: "))
    wait_for(lambda: scrape().get(cancelled, 0) == before.get(cancelled, 0) + 1)
    assert scrape()["specdec_running_requests"] == 0


def test_a_waiting_client_that_leaves_behind_a_key_is_dropped(keyed):
    """The case BaseHTTPMiddleware broke: request.is_disconnected() never fired behind it."""
    cancelled = 'specdec_requests_total{endpoint="completions",outcome="cancelled"}'
    before = metrics_with_key(keyed)
    with pytest.raises(httpx.TimeoutException):
        complete(keyed, prompt="hello", timeout=1.0, **LONG)
    wait_for(lambda: metrics_with_key(keyed).get(cancelled, 0) == before.get(cancelled, 0) + 1)
    after = metrics_with_key(keyed)
    assert after["specdec_running_requests"] == 0
    assert after["specdec_generation_tokens_total"] - before["specdec_generation_tokens_total"] < 2000


def metrics_with_key(base: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics", headers=AUTH).text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def test_a_request_past_its_deadline_gets_504_and_frees_its_row():
    with serve(tiny_app(slots=2, limits=ServerLimits(deadline_s=0.5))) as base:
        started = time.perf_counter()
        answer = httpx.post(f"{base}/v1/completions", json={"model": MODEL_NAME, "prompt": "hello", **LONG},
                            timeout=60)
        assert answer.status_code == 504 and answer.json()["error"]["code"] == "deadline_exceeded"
        assert time.perf_counter() - started < 10  # LONG alone runs ~10 s
        wait_for(lambda: metrics(base)["specdec_running_requests"] == 0)
        ok = httpx.post(f"{base}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3})
        assert ok.status_code == 200


# ---- a model whose logits turn NaN for one request ----------------------------------------------


def poisoned_app():
    """The tiny target with token 'z''s embedding NaN: a request that reads 'z' has no finite logit."""
    model = make_model(seed=0)
    with torch.no_grad():
        model.get_input_embeddings().weight[CHARS.index("z") + 2] = float("nan")
    return build_server(make_native(model, max_context=512), chat_tokenizer(), name=MODEL_NAME,
                        config=SpecConfig(method="ngram", k=3), slots=2, max_context=512)


def test_a_request_whose_logits_are_nan_gets_a_500_and_the_others_their_answers():
    reference_model = make_model(seed=0)
    with serve(poisoned_app()) as base, httpx.Client(timeout=60) as http:
        import concurrent.futures

        body = {"model": MODEL_NAME, "max_tokens": 20, "temperature": 0, "return_token_ids": True}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            bad = pool.submit(http.post, f"{base}/v1/completions", json={**body, "prompt": "lazy dogs"})
            good = pool.submit(http.post, f"{base}/v1/completions", json={**body, "prompt": "the quick brown"})
            bad, good = bad.result(), good.result()
        assert bad.status_code == 500 and "no finite value" in bad.json()["error"]["message"]
        assert good.status_code == 200
        expected = SpecEngineOf(reference_model).generate("the quick brown", max_new_tokens=20).token_ids
        assert good.json()["choices"][0]["token_ids"] == expected
        assert http.get(f"{base}/health").json()["status"] == "ok"
        assert metrics(base)['specdec_requests_total{endpoint="completions",outcome="error"}'] == 1


def SpecEngineOf(model):  # noqa: N802 - reads as the engine it builds
    from specdec.engine import SpecEngine

    return SpecEngine(make_native(model), None, chat_tokenizer())


# ---- the engine thread outlives an unexpected error -----------------------------------------------


def test_an_error_outside_the_step_fails_the_running_requests_and_the_thread_serves_on():
    app = tiny_app(slots=2)
    scheduler = app.state.scheduler
    with serve(app) as base, httpx.Client(timeout=60) as http:
        remove = scheduler.engine.remove

        def broken_remove(handle):  # a fault in the bookkeeping around a cancelled job
            scheduler.engine.remove = remove
            raise RuntimeError("injected fault in remove")

        scheduler.engine.remove = broken_remove
        with pytest.raises(httpx.TimeoutException):  # leaves: its job is cancelled, remove() raises
            http.post(f"{base}/v1/completions", json={"model": MODEL_NAME, "prompt": "hello", **LONG}, timeout=1.0)
        wait_for(lambda: scheduler.engine.running == 0)
        assert scheduler.alive and http.get(f"{base}/health").status_code == 200
        ok = http.post(f"{base}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3})
        assert ok.status_code == 200


def test_an_engine_that_cannot_recover_fails_every_job_and_health_says_503():
    app = tiny_app(slots=1, max_queue=4)
    scheduler = app.state.scheduler
    with serve(app) as base, httpx.Client(timeout=60) as http:
        def broken(*_args, **_kwargs):
            raise RuntimeError("injected: the cache is gone")

        scheduler.engine.step = broken  # every step fails...
        scheduler.engine.clear = broken  # ...and so does emptying the batch
        answer = http.post(f"{base}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3})
        assert answer.status_code in (500, 503)
        wait_for(lambda: scheduler.broken is not None)
        health = http.get(f"{base}/health")
        assert health.status_code == 503 and "the cache is gone" in health.json()["error"]
        refused = http.post(f"{base}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3})
        assert refused.status_code == 503 and "broken" in refused.json()["error"]["message"]


# ---- two tenants never see each other's cached tokens ----------------------------------------------


@pytest.mark.parametrize("method", ["ngram", "suffix", "copy"])
def test_two_api_keys_never_share_cached_prompts_or_suffix_outputs(method, tmp_path):
    keys = {"alice": "key-alice", "bob": "key-bob"}
    # copy: fixed costs, so its draft lengths follow what it copies, not the machine's timings
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"results": [{"ratio": {"1": 1.0, "9": 1.4}}]}))
    copy = CopyOptions(costs=str(costs))
    prompt = "the quick brown fox jumps over the lazy dog, " * 3

    def ask(base: str, who: str) -> dict:
        answer = httpx.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {keys[who]}"}, timeout=60,
                            json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 40, "temperature": 0})
        assert answer.status_code == 200, answer.text
        return answer.json()

    with serve(tiny_app(method=method, k=4, slots=2, api_key=list(keys.values()), copy=copy)) as base:
        alice_first = ask(base, "alice")
        bob_first = ask(base, "bob")
        alice_again = ask(base, "alice")
    assert alice_first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert bob_first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # alice's row is not bob's
    assert alice_again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # her own is
    # Bob's speculation is exactly a first request's: nothing learned from alice's answer shows.
    assert bob_first["speculative"]["accepted_tokens"] == alice_first["speculative"]["accepted_tokens"]
    assert bob_first["choices"][0]["text"] == alice_first["choices"][0]["text"]
    if method in ("suffix", "copy"):  # alice's own cache did learn: her second answer drafts from her first
        assert alice_again["speculative"]["accepted_tokens"] > alice_first["speculative"]["accepted_tokens"]

    with serve(tiny_app(method=method, k=4, slots=2, api_key=list(keys.values()), shared_cache=True,
                        copy=copy)) as base:
        ask(base, "alice")
        shared = ask(base, "bob")
    assert shared["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the operator's choice: one cache
