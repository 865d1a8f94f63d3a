"""`specdec verify --endpoint --reference` against real `specdec serve` subprocesses: a speculative
server and a plain one must agree; a lossy one (lenience 0.05) must be caught.

The draft is the target with sharpened logits (tests/server/serve_processes.py): it ranks tokens as
the target does, so the lossy server accepts nearly every draft and writes nearly the draft's
distribution, far from the target's (TV ~0.25 on the first two tokens at top-k 3). All draws are
seeded, so the verdicts are the same on every run.
"""

from __future__ import annotations

import httpx
import pytest

from transformers import AutoTokenizer

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
    assert listing["data"][0]["speculative"] == {"method": "draft", "k": 3, "lenience": 0.05, "lossy": True}
    assert httpx.get(f"{servers['spec']}/v1/models", timeout=10).json()["data"][0]["speculative"] == \
        {"method": "draft", "k": 3}


@pytest.mark.parametrize("value", ["0", "1.5", "nan"])
def test_bad_lenience_is_one_line_before_any_model_loads(capsys, value):
    assert main(["serve", "--target", "/nonexistent", "--lenience", value]) == 2
    err = capsys.readouterr().err
    assert "--lenience must be in (0, 1]" in err and err.count("\n") == 1
