"""A tiny OpenAI-compatible HTTP server on 127.0.0.1 that records every request it receives (method,
path with query, Authorization header): what `bench --endpoint` and `verify --endpoint` really send,
read off a real socket rather than a mocked client.

It serves one model and answers the calls those commands make: GET /v1/models, GET /metrics (404:
no vLLM counters), POST /v1/chat/completions (streamed, one content chunk and a usage chunk) and
POST /v1/completions (n choices, each with token ids and logprobs tokens). A chat whose message says
REJECT is answered 400, as a server answers a prompt longer than its context.
"""

from __future__ import annotations

import json
import socket
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "fake-model"
ANSWER = "hi there"


@dataclass(frozen=True)
class Seen:
    method: str
    path: str  # with the query, as the request line carried it
    authorization: str | None


class _Handler(BaseHTTPRequestHandler):
    server: _RecordingServer

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        pass  # keep test output clean

    def _record(self) -> None:
        with self.server.lock:
            self.server.seen.append(Seen(self.command, self.path, self.headers.get("Authorization")))

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._record()
        if self.path.split("?")[0] == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        else:
            self._json(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:  # noqa: N802
        self._record()
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        path = self.path.split("?")[0]
        if path == "/v1/chat/completions" and any("REJECT" in m["content"] for m in body.get("messages", [])):
            self._json(400, {"error": {"message": "this prompt is rejected", "param": "messages"}})
        elif path == "/v1/chat/completions" and body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
            for event in ({"choices": [{"index": 0, "delta": {"content": ANSWER}, "finish_reason": None}]},
                          {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                          {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}):
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
        elif path == "/v1/completions":
            choice = {"index": 0, "text": " a b", "token_ids": [7, 8], "logprobs": {"tokens": [" a", " b"]},
                      "finish_reason": "length"}
            self._json(200, {"choices": [{**choice, "index": i} for i in range(int(body.get("n", 1)))],
                             "usage": {"prompt_tokens": 5, "completion_tokens": 2}})
        else:
            self._json(404, {"error": {"message": "not found"}})


class _RecordingServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.seen: list[Seen] = []


@dataclass
class Recording:
    url: str  # http://127.0.0.1:PORT
    server: _RecordingServer

    @property
    def seen(self) -> list[Seen]:
        with self.server.lock:
            return list(self.server.seen)

    def clear(self) -> None:
        with self.server.lock:
            self.server.seen.clear()


@contextmanager
def recording_server():
    """Yields a Recording; the server runs in a thread until the block ends."""
    server = _RecordingServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Recording(f"http://127.0.0.1:{server.server_address[1]}", server)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def forbid_connections(monkeypatch) -> list:
    """Make every name lookup and connection fail, recording its address: what a command tried to reach."""
    attempts: list = []

    def refuse(address, *args, **kwargs):
        attempts.append(address)
        raise OSError("connections are forbidden in this test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    return attempts
