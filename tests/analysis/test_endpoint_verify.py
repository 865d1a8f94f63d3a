"""`specdec verify --endpoint --reference` against real `specdec serve` subprocesses: a speculative
server and a plain one must agree; a lossy one (lenience 0.05) must be caught.

The draft is the target with sharpened logits (tests/server/serve_processes.py): it ranks tokens as
the target does, so the lossy server accepts nearly every draft and writes nearly the draft's
distribution, far from the target's (TV ~0.25 on the first two tokens at top-k 3). All draws are
seeded, so the verdicts are the same on every run. The credential tests talk to recording servers
(tests/bench/recording_server.py): what they record is what went over the socket.
"""

from __future__ import annotations

import base64

import httpx
import pytest

from transformers import AutoTokenizer

from bench.recording_server import forbid_connections, recording_server
from server.serve_processes import save_models, specdec_servers
from specdec.cli import main
from specdec.engine.request import chat_template_ids

DRAFTING = ["--method", "draft", "-k", "3", "--max-batch", "4", "--spec-max-batch", "4"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("endpoint-verify-models"), draft_sharpness=4.0)


@pytest.fixture(scope="module")
def servers(models):
    draft = ["--draft", str(models / "draft")]
    with specdec_servers(models, {
        "spec": [*DRAFTING, *draft],
        "plain": ["--method", "autoregressive", "--max-batch", "4"],
        "lossy": [*DRAFTING, *draft, "--lenience", "0.05"],
    }) as urls:
        yield urls


def _verify(endpoint: str, reference: str) -> list[str]:
    return ["verify", "--endpoint", endpoint, "--reference", reference, "--prompt", "the cat sat on the",
            "--samples", "300", "--temperature", "1", "--top-k", "3", "--greedy-prompts", "0",
            "--max-new-tokens", "16"]


def test_speculative_server_matches_the_plain_one(servers, capsys):
    assert main(_verify(f"spec={servers['spec']}", f"plain={servers['plain']}/v1")) == 0
    out = capsys.readouterr().out
    assert "distribution check: spec against plain (tiny) at temperature 1, 300 draws per side" in out
    assert "PASS  first token" in out and "PASS  first two tokens" in out
    assert "outcomes read from" not in out  # token ids, through return_token_ids
    assert "greedy check: 1/1 prompts identical to plain" in out
    assert "speculation on spec:" in out and " 0 tokens drafted" not in out
    assert "PASSED: no evidence that spec's output distribution differs from plain's" in out


def test_lossy_server_fails(servers, capsys):
    assert main(_verify(f"lossy={servers['lossy']}", f"plain={servers['plain']}")) == 1
    out = capsys.readouterr().out
    assert "FAIL  first two tokens" in out
    assert "lenience 0.05 (LOSSY by design)" in out
    assert "FAILED: lossy's output does not follow plain's distribution" in out


def test_verify_needs_both_servers(capsys):
    assert main(["verify", "--endpoint", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "needs both --endpoint URL" in err and err.count("\n") == 1


def test_return_token_ids(servers, models):
    tokenizer = AutoTokenizer.from_pretrained(models / "target")  # as the servers load it
    url = servers["spec"]
    request = {"model": "tiny", "prompt": "the cat", "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    body = httpx.post(f"{url}/v1/completions", timeout=60, json=request).json()
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == body["usage"]["completion_tokens"]
    # the model's 64 logits outnumber the tokenizer's ids: the unknown ones (and EOS) write no text
    text_ids = [t for t in choice["token_ids"] if t < len(tokenizer) and t != tokenizer.eos_token_id]
    assert text_ids == tokenizer(choice["text"])["input_ids"]
    # greedy ids of the plain server are the same: the ids are the engine's, not a re-encoding
    plain = httpx.post(f"{servers['plain']}/v1/completions", timeout=60, json=request).json()
    assert plain["choices"][0]["token_ids"] == choice["token_ids"]

    messages = [{"role": "user", "content": "hello"}]
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0, "return_token_ids": True}).json()
    assert chat["prompt_token_ids"] == chat_template_ids(tokenizer, messages)
    assert tokenizer.decode(chat["choices"][0]["token_ids"], skip_special_tokens=True) == \
        chat["choices"][0]["message"]["content"]
    without = httpx.post(f"{url}/v1/completions", timeout=60, json={"model": "tiny", "prompt": "the cat",
                                                                    "max_tokens": 4}).json()
    assert "token_ids" not in without["choices"][0]


def test_lossy_server_says_so(servers):
    listing = httpx.get(f"{servers['lossy']}/v1/models", timeout=10).json()
    setup = listing["data"][0]["speculative"]
    assert {key: setup[key] for key in ("method", "k", "lenience", "lossy")} == {"method": "draft", "k": 3,
                                                                                "lenience": 0.05, "lossy": True}
    exact = httpx.get(f"{servers['spec']}/v1/models", timeout=10).json()["data"][0]["speculative"]
    assert (exact["method"], exact["k"]) == ("draft", 3) and "lossy" not in exact


@pytest.mark.parametrize("value", ["0", "1.5", "nan"])
def test_bad_lenience_is_one_line_before_any_model_loads(capsys, value):
    assert main(["serve", "--target", "/nonexistent", "--lenience", value]) == 2
    err = capsys.readouterr().err
    assert "--lenience must be in (0, 1]" in err and err.count("\n") == 1


# ---- credentials (docs/benchmarks.md, "Credentials") ------------------------------------------


@pytest.fixture
def recorders():
    with recording_server() as spec, recording_server() as plain:
        yield spec, plain


def _verify_recorders(endpoint: str, reference: str, *extra) -> list[str]:
    return ["verify", "--endpoint", endpoint, "--reference", reference, "--prompt", "x", "--samples", "4",
            "--greedy-prompts", "0", "--max-new-tokens", "4", "--concurrency", "1", *extra]


def test_verify_sends_no_key_without_a_key_flag(recorders, monkeypatch, capsys):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-ambient")
    spec, plain = recorders
    assert main(_verify_recorders(f"spec={spec.url}", f"plain={plain.url}")) == 0
    assert "PASSED" in capsys.readouterr().out
    for server in recorders:
        assert any(seen.path == "/v1/completions" for seen in server.seen)  # the check ran on both
        assert {seen.authorization for seen in server.seen} == {None}


def test_verify_sends_each_server_its_own_key(recorders, monkeypatch):
    monkeypatch.setenv("SPEC_KEY", "sk-spec")
    spec, plain = recorders
    assert main(_verify_recorders(f"spec={spec.url}", f"plain={plain.url}/v1",
                                  "--api-key-env", "SPEC_KEY", "--api-key", "sk-plain")) == 0
    assert spec.seen and {seen.authorization for seen in spec.seen} == {"Bearer sk-spec"}
    assert plain.seen and {seen.authorization for seen in plain.seen} == {"Bearer sk-plain"}


def test_verify_sends_one_key_to_both_servers(recorders):
    spec, plain = recorders
    assert main(_verify_recorders(spec.url, plain.url, "--api-key", "sk-both")) == 0
    for server in recorders:
        assert server.seen and {seen.authorization for seen in server.seen} == {"Bearer sk-both"}


def test_verify_refuses_a_key_over_plain_http_before_any_connection(monkeypatch, capsys):
    attempts = forbid_connections(monkeypatch)
    assert main(_verify_recorders("http://127.0.0.1:9", "plain=http://example.com:8000/v1", "--api-key", "k")) == 2
    err = capsys.readouterr().err
    assert "refusing to send the API key to http://example.com:8000 over plain http" in err
    assert "use https, or drop the key" in err and err.count("\n") == 1
    assert attempts == []


def test_verify_prints_labels_without_credentials(recorders, capsys):
    spec, plain = recorders
    host = spec.url.removeprefix("http://")
    assert main(_verify_recorders(f"http://verify-user:pa55word@{host}", plain.url)) == 0
    assert {seen.authorization for seen in spec.seen} == \
        {"Basic " + base64.b64encode(b"verify-user:pa55word").decode()}
    printed = capsys.readouterr()
    assert f"distribution check: {host} against" in printed.out
    assert "verify-user" not in printed.out + printed.err and "pa55word" not in printed.out + printed.err
