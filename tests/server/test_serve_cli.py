"""`specdec serve` as a user runs it: a subprocess on a free port, over tiny models saved as HF directories."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from conftest import make_model
from live_server import chat_tokenizer
from specdec.cli import main


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-models")
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        make_model(seed=seed, layers=layers).save_pretrained(root / name)
        chat_tokenizer().save_pretrained(root / name)
    return root


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_serve(model_dirs, *argv: str) -> tuple[subprocess.Popen, int]:
    """`specdec serve --target TARGET ARGV` on a free port, once /health answers."""
    port = free_port()
    command = [sys.executable, "-m", "specdec.cli", "serve", "--target", str(model_dirs / "target"),
               "--port", str(port), "--max-batch", "2", "--served-model-name", "tiny", "--log-level", "warning",
               *argv]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, process.stderr.read()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process, port
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)


def stop_serve(process: subprocess.Popen) -> str:
    """Ctrl-C, as a user stops it; its stderr."""
    process.send_signal(signal.SIGINT)
    return process.communicate(timeout=30)[1]


def test_serve_starts_answers_and_stops_on_ctrl_c(model_dirs):
    process, port = start_serve(model_dirs, "-k", "2")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                               max_tokens=12, temperature=0)
        assert reply.usage.completion_tokens >= 1 and reply.model_extra["speculative"]["k"] == 2
        chosen = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                                max_tokens=12, temperature=0,
                                                extra_body={"speculative": {"method": "ngram", "k": 4}})
        assert chosen.choices[0].message.content == reply.choices[0].message.content
        assert (chosen.model_extra["speculative"]["method"], chosen.model_extra["speculative"]["k"]) == ("ngram", 4)
    finally:
        stderr = stop_serve(process)
    assert process.returncode == 0
    # --method auto is copy on a CPU (no draft model is read), --spec-max-batch auto is 1
    assert "serving 'tiny' (copy, k=2, 2 rows, drafting while <= 1 run" in stderr


@pytest.mark.parametrize("argv,message", [
    (["--prefill-chunk", "-1"], "--prefill-chunk must be >= 0"),
    (["--method", "eagle", "--head", "/no/such/head.safetensors"], "no trained eagle head"),
    (["--max-queue", "-1"], "--max-queue must be >= 0"),
    (["--port", "70000"], "--port must be in 0..65535"),
    (["--spec-max-batch", "0"], "--spec-max-batch must be auto or an integer >= 1"),
    (["--request-methods", "ngram,eagle"], "--request-methods: a request cannot choose eagle beside copy"),
    (["--request-methods", "nosuch"], "unknown method 'nosuch'"),
])
def test_bad_serve_options_are_one_line_before_any_model_loads(capsys, argv, message):
    assert main(["serve", "--target", "/nonexistent", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def _random_eagle_head(model_dirs) -> str:
    """An untrained EAGLE head for the saved target (its drafts are mostly rejected: exactness is the point)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specdec.models.heads import HeadConfig, build_head, save_head
    from specdec.models.native import DecoderConfig

    target = AutoModelForCausalLM.from_pretrained(model_dirs / "target")
    config = HeadConfig.for_target("eagle", DecoderConfig.from_hf(target.config.to_dict()))
    torch.manual_seed(0)
    path = model_dirs / "eagle.safetensors"
    save_head(path, build_head(config), config, torch.arange(target.config.vocab_size))
    return str(path)


def test_serve_with_goodput_k_answers_as_plain_decoding(model_dirs):
    """`specdec serve -k auto`: the step's k from measured costs; greedy text equals a plain server's,
    with a draft model and with an EAGLE head drafting trees (--head)."""
    texts = {}
    for argv in (["--method", "draft", "--draft", str(model_dirs / "draft"), "-k", "auto", "--max-k", "4"],
                 ["--method", "eagle-tree", "--head", _random_eagle_head(model_dirs), "--tree-size", "6", "-k",
                  "auto", "--max-k", "4"],
                 ["--method", "autoregressive"]):
        process, port = start_serve(model_dirs, *argv)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
            replies = [client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
                       for prompt in ("hello world", "the quick brown fox", "abc abc abc")]
            texts[argv[1]] = [reply.choices[0].text for reply in replies]
            if argv[1] == "draft":
                assert replies[0].model_extra["speculative"]["k"] == "auto"
        finally:
            stderr = stop_serve(process)
        if argv[1] == "draft":
            assert "k per step by goodput, <= 4" in stderr
    assert texts["draft"] == texts["eagle-tree"] == texts["autoregressive"]
