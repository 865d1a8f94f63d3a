"""A real uvicorn server on a free localhost port, over tiny models."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import uvicorn

from conftest import CHAT_TEMPLATE, make_model, make_native, make_tokenizer
from specdec.config import SpecConfig
from specdec.proposers.scored_copy import CopyOptions
from specdec.server import build_server

MODEL_NAME = "tiny"


def chat_tokenizer():
    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_app(*, method: str = "draft", k: int = 3, slots: int = 4, max_queue: int = 8, max_context: int = 4096,
             prefill_chunk: int | None = 16, copy: CopyOptions | None = None, **options):
    """Target and draft write text (no random biases); RoPE lets them run past their nominal 256 positions.
    Prompts are prefilled 16 tokens per step (chunked prefill), so every server test also checks that
    chunking changes no output."""
    target = make_native(make_model(seed=0), max_context=max_context)
    draft = make_native(make_model(seed=1, layers=1), max_context=max_context)
    return build_server(target, chat_tokenizer(), name=MODEL_NAME, config=SpecConfig(method=method, k=k, options=(copy or CopyOptions(),)),
                        draft_runner=draft,
                        slots=slots, max_queue=max_queue, max_context=max_context, prefill_chunk=prefill_chunk,
                        **options)


@contextmanager
def serve(app):
    """Run app under uvicorn in a thread; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
