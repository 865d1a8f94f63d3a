"""A small client for any OpenAI-compatible server (vLLM, SGLang, llama.cpp's llama-server, `specdec serve`).

`specdec bench --endpoint` and `specdec verify --endpoint` talk to servers they did not start, so
every failure a user can cause (a wrong URL, a server that is down, a model name it does not
serve, a 4xx with an error body) becomes one ValueError that names the URL: the CLI prints it as
`specdec: error: ...` and exits 2. httpx, not the openai package: the timing of each streamed
chunk and the servers' own extensions (`speculative`, `token_ids`) are read from the raw answers.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

TIMEOUT_S = 600.0  # one generation; long answers from a slow CPU server take minutes


@dataclass(frozen=True)
class Endpoint:
    label: str  # how reports name it
    base_url: str  # scheme://host:port[/prefix], without /v1
    model: str = ""  # what requests pass as "model"; "" until resolve_model
    api_key: str | None = None

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def url(self, path: str) -> str:
        return f"{self.base_url}{path}"


class EndpointError(ValueError):
    """An HTTP error answer: status and the server's message, for callers that decide by them."""

    def __init__(self, url: str, status: int, message: str, param: str | None = None) -> None:
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.status, self.message, self.param = status, message, param


def parse_endpoint(text: str, api_key: str | None = None) -> Endpoint:
    """'http://h:8000', 'http://h:8000/v1/' or 'LABEL=http://h:8000' -> Endpoint (model not yet known)."""
    label, _, url = text.partition("=") if "=" in text and "://" not in text.split("=", 1)[0] else ("", "", text)
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"endpoint {text!r} is not an http(s) URL like http://127.0.0.1:8000 (or LABEL=URL)")
    base = url.removesuffix("/v1")
    return Endpoint(label.strip() or parts.netloc + parts.path.removesuffix("/v1"), base, api_key=api_key)


def parse_endpoints(texts: list[str], models: list[str] | None, api_key: str | None) -> list[Endpoint]:
    """--endpoint values with --endpoint-model: none (ask each server), one (for all) or one per endpoint."""
    endpoints = [parse_endpoint(text, api_key) for text in texts]
    labels = [e.label for e in endpoints]
    if len(set(labels)) != len(labels):
        raise ValueError(f"endpoint labels must differ, got {labels}; name them LABEL=URL")
    models = models or []
    if len(models) not in (0, 1, len(endpoints)):
        raise ValueError(f"--endpoint-model: give one name for every endpoint or one per endpoint "
                         f"({len(endpoints)}), got {len(models)}")
    if models:
        names = models * len(endpoints) if len(models) == 1 else models
        endpoints = [Endpoint(e.label, e.base_url, name, e.api_key) for e, name in zip(endpoints, names)]
    return endpoints


def default_api_key() -> str | None:
    return os.environ.get("OPENAI_API_KEY") or None


def client(timeout_s: float = TIMEOUT_S):
    import httpx

    return httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0))


def _error_message(response) -> tuple[str, str | None]:
    """The server's own words: OpenAI's {"error": {"message", "param"}}, FastAPI's {"detail"}, or the text."""
    try:
        body = response.json()
    except ValueError:
        return (response.text.strip().splitlines() or [response.reason_phrase])[0][:300], None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error)), error.get("param")
    if isinstance(error, str):
        return error, None
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])[:300], None
    return json.dumps(body)[:300], None


def _send(http, method: str, endpoint: Endpoint, path: str, **kwargs):
    import httpx

    url = endpoint.url(path)
    try:
        return http.request(method, url, headers=endpoint.headers, **kwargs)
    except httpx.TimeoutException:
        raise ValueError(f"{url}: no answer within the timeout") from None
    except httpx.HTTPError as error:
        raise ValueError(f"cannot reach {url}: {error or type(error).__name__}; is the server running?") from None


def _checked(response, url: str):
    if response.status_code >= 400:
        message, param = _error_message(response)
        raise EndpointError(url, response.status_code, message.replace("\n", " "), param)
    return response


def get_json(http, endpoint: Endpoint, path: str) -> dict:
    url = endpoint.url(path)
    response = _checked(_send(http, "GET", endpoint, path), url)
    try:
        return response.json()
    except ValueError:
        raise ValueError(f"{url}: the answer is not JSON; is this an OpenAI-compatible server?") from None


def post_json(http, endpoint: Endpoint, path: str, body: dict) -> dict:
    url = endpoint.url(path)
    response = _checked(_send(http, "POST", endpoint, path, json={"model": endpoint.model, **body}), url)
    try:
        return response.json()
    except ValueError:
        raise ValueError(f"{url}: the answer is not JSON") from None


def resolve_model(http, endpoint: Endpoint) -> Endpoint:
    """The endpoint with its model name: the one given, else the one model GET /v1/models lists."""
    if endpoint.model:
        return endpoint
    url = endpoint.url("/v1/models")
    try:
        listing = get_json(http, endpoint, "/v1/models")
    except EndpointError as error:
        raise ValueError(f"{url}: HTTP {error.status} ({error.message}); is this an OpenAI-compatible server? "
                         "Name the model with --endpoint-model") from None
    names = [m.get("id") for m in listing.get("data", []) if isinstance(m, dict) and m.get("id")] \
        if isinstance(listing, dict) else []
    if len(names) != 1:
        found = f"serves {', '.join(names)}" if names else "lists no model"
        raise ValueError(f"{url} {found}: name the model with --endpoint-model")
    return Endpoint(endpoint.label, endpoint.base_url, names[0], endpoint.api_key)


@dataclass
class StreamedChat:
    """One streamed chat completion, timed on the client's clock (perf_counter seconds)."""

    text: str
    completion_tokens: int  # from usage, else the number of content chunks (one token each on most servers)
    tokens_from_usage: bool
    finish_reason: str | None
    start: float
    first_token: float | None  # the first non-empty content delta
    chunk_times: list[float]  # arrival of every non-empty content delta
    end: float  # the stream closed
    prompt_tokens: int | None
    speculative: dict | None  # specdec's per-request block, when the server sends it


def _events(response) -> Iterator[dict]:
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            yield json.loads(data)
        except json.JSONDecodeError:
            continue  # keep-alive comments and the like


def stream_chat(http, endpoint: Endpoint, messages: list[dict], **sampling) -> StreamedChat:
    """POST /v1/chat/completions with stream: true and usage in the last chunk; time every content chunk."""
    url = endpoint.url("/v1/chat/completions")
    body = {"model": endpoint.model, "messages": messages, "stream": True,
            "stream_options": {"include_usage": True}, **sampling}
    import httpx

    texts, times = [], []
    usage, speculative, finish = None, None, None
    start = time.perf_counter()
    try:
        with http.stream("POST", url, json=body, headers=endpoint.headers) as response:
            if response.status_code >= 400:
                response.read()
                _checked(response, url)
            for event in _events(response):
                if "error" in event:  # an error after the stream began (specdec, vLLM)
                    message = event["error"].get("message", event["error"]) if isinstance(event["error"], dict) \
                        else event["error"]
                    raise ValueError(f"{url}: the stream ended with an error: {message}")
                for choice in event.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        texts.append(content)
                        times.append(time.perf_counter())
                    finish = choice.get("finish_reason") or finish
                usage = event.get("usage") or usage
                speculative = event.get("speculative") or speculative
    except httpx.TimeoutException:
        raise ValueError(f"{url}: no answer within the timeout") from None
    except httpx.HTTPError as error:
        raise ValueError(f"cannot reach {url}: {error or type(error).__name__}; is the server running?") from None
    end = time.perf_counter()
    tokens = (usage or {}).get("completion_tokens")
    return StreamedChat(text="".join(texts), completion_tokens=tokens if tokens is not None else len(texts),
                        tokens_from_usage=tokens is not None, finish_reason=finish, start=start,
                        first_token=times[0] if times else None, chunk_times=times, end=end,
                        prompt_tokens=(usage or {}).get("prompt_tokens"), speculative=speculative)


def vllm_spec_counters(http, endpoint: Endpoint) -> dict[str, float] | None:
    """vLLM's speculative-decoding counters (bench/vllm_peer.py's spec_decode_counters), or None when the
    server exports none: no /metrics, or no vllm:spec_decode_* series (not vLLM, or not speculating)."""
    from specdec.bench.vllm_peer import SPEC_COUNTERS, spec_decode_counters_of

    try:
        page = http.get(endpoint.url("/metrics"), headers=endpoint.headers)
    except Exception:  # noqa: BLE001 - a server without /metrics simply reports no counters
        return None
    if page.status_code != 200 or not any(name in page.text for name in SPEC_COUNTERS):
        return None
    return spec_decode_counters_of(page.text)
