"""`specdec serve` subprocesses over tiny models saved as HF directories, for tests that need servers
they did not build in-process (bench --endpoint, verify --endpoint): started together, waited on
/health, stopped with Ctrl-C (SIGINT) as a user stops them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch

from conftest import CHAT_TEMPLATE, make_peaked_model, make_tokenizer


def chat_tokenizer():
    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_models(root: Path, draft_sharpness: float = 2.0) -> Path:
    """root/target: a peaked model (sampled continuations spread over a few tokens); root/draft: the same
    weights with logits draft_sharpness times larger. The draft ranks tokens as the target does, so
    its drafts are accepted often, yet its distribution differs: a lossy server, which emits nearly
    the draft's distribution, is then far (in total variation) from the target's."""
    target = make_peaked_model(seed=0)
    draft = make_peaked_model(seed=0)
    with torch.no_grad():
        draft.get_output_embeddings().weight.mul_(draft_sharpness)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        chat_tokenizer().save_pretrained(root / name)
    return root


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def specdec_servers(models: Path, setups: dict[str, list[str]], timeout_s: float = 120):
    """One `specdec serve --target models/target ARGS` per setup, all started at once; yields
    {name: base URL} once every /health answers 200."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    processes, urls = {}, {}
    try:
        for name, argv in setups.items():
            port = free_port()
            command = [sys.executable, "-m", "specdec.cli", "serve", "--target", str(models / "target"),
                       "--port", str(port), "--served-model-name", "tiny", "--log-level", "warning", *argv]
            processes[name] = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
            urls[name] = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        for name, process in processes.items():
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"specdec serve ({name}) exited: {process.stderr.read()}")
                try:
                    if httpx.get(f"{urls[name]}/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"specdec serve ({name}) did not come up")
                time.sleep(0.2)
        yield urls
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        for process in processes.values():
            try:
                process.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
