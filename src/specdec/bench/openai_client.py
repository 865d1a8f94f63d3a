"""A small client for any OpenAI-compatible server (vLLM, SGLang, llama.cpp's llama-server, `specdec serve`).

`specdec bench --endpoint` and `specdec verify --endpoint` talk to servers they did not start, so
every failure a user can cause (a wrong URL, a server that is down, a model name it does not
serve, a 4xx with an error body) becomes one ValueError that names the URL: the CLI prints it as
`specdec: error: ...` and exits 2. httpx, not the openai package: the timing of each streamed
chunk and the servers' own extensions (`speculative`, `token_ids`) are read from the raw answers.

Credentials (docs/benchmarks.md, "Credentials"): a key is sent only when the command line gives one
(--api-key, --api-key-env; $OPENAI_API_KEY is never read on its own), because these servers are
anyone's, not only OpenAI's. No credential (the key, a URL's user:password, a key-like query
parameter) goes over plain http except to loopback, and what is shown or written (labels,
messages, results files) names each URL without its credentials.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from urllib.parse import unquote_plus, urlsplit, urlunsplit

TIMEOUT_S = 600.0  # one generation; long answers from a slow CPU server take minutes


# Query parameters whose values are secrets: api_key=, key=, access_token=, x-api-key=, sig=, ...
SECRET_PARAMETER = re.compile(r"(?:^|[_-])(?:key|apikey|token|secret|password|passwd|pwd|auth|authorization|"
                              r"sig|signature|credentials?)$")
REDACTED = "REDACTED"


def _is_secret(name: str, value: str) -> bool:
    return bool(value) and SECRET_PARAMETER.search(unquote_plus(name).lower()) is not None


def _secret_parameters(query: str) -> list[str]:
    return [name for name, _, value in (item.partition("=") for item in query.split("&")) if _is_secret(name, value)]


def redact_url(url: str) -> str:
    """The URL as it may be shown and written: no user:password@, secret query values replaced."""
    parts = urlsplit(url)
    items = (item.partition("=") for item in parts.query.split("&")) if parts.query else ()
    query = "&".join(f"{name}={REDACTED}" if _is_secret(name, value) else f"{name}{sep}{value}"
                     for name, sep, value in items)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, query, parts.fragment))


def is_loopback(host: str | None) -> bool:
    """127.0.0.0/8, ::1 or localhost: traffic that never leaves this machine. Only literal addresses
    and the name localhost count; any other name could resolve anywhere."""
    if not host:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Endpoint:
    label: str  # how reports name it; never carries the URL's credentials
    base_url: str  # scheme://[user:pass@]host:port[/prefix], without /v1 and without the query
    model: str = ""  # what requests pass as "model"; "" until resolve_model
    api_key: str | None = None  # sent as a Bearer token; only ever one the command line gave
    query: str = ""  # the URL's own query (a gateway's api-version=, key=), added to every request

    def __post_init__(self) -> None:
        self._check_credentials()

    def _check_credentials(self) -> None:
        """Refuse, before any connection, to send a credential where anyone on the way can read it."""
        parts = urlsplit(self.base_url)
        carried = (["the API key"] if self.api_key else []) + \
            (["the user:password in the URL"] if "@" in parts.netloc else []) + \
            [f"the URL's {name}= parameter" for name in _secret_parameters(self.query)]
        if self.api_key and "@" in parts.netloc:
            # httpx would send the URL's user:password as Basic auth in place of the Bearer key
            raise ValueError(f"{self.redacted_url()}: give either user:password in the URL or an API key, not both")
        if carried and parts.scheme != "https" and not is_loopback(parts.hostname):
            them = "it" if len(carried) == 1 else "them"
            raise ValueError(f"refusing to send {' and '.join(carried)} to {self.redacted_url()} over plain http, "
                             f"where anyone on the way can read {them}: use https, or drop "
                             f"{'the key' if carried == ['the API key'] else them} (plain http carries credentials "
                             "only to loopback: 127.0.0.0/8, ::1, localhost)")

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def url(self, path: str) -> str:
        """What is requested: credentials included. Never show or write it; see redacted_url."""
        return f"{self.base_url}{path}" + (f"?{self.query}" if self.query else "")

    def redacted_url(self, path: str = "") -> str:
        """url(path) as messages, reports and results files show it: without credentials."""
        return redact_url(self.url(path))


class EndpointError(ValueError):
    """An HTTP error answer: status and the server's message, for callers that decide by them."""

    def __init__(self, url: str, status: int, message: str, param: str | None = None) -> None:
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.status, self.message, self.param = status, message, param


def parse_endpoint(text: str, api_key: str | None = None) -> Endpoint:
    """'http://h:8000', 'http://h:8000/v1/' or 'LABEL=http://h:8000' -> Endpoint (model not yet known)."""
    label, _, url = text.partition("=") if "=" in text and "://" not in text.split("=", 1)[0] else ("", "", text)
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"endpoint {redact_url(text)!r} is not an http(s) URL like http://127.0.0.1:8000 "
                         "(or LABEL=URL)")
    prefix = parts.path.rstrip("/").removesuffix("/v1")
    base = urlunsplit((parts.scheme, parts.netloc, prefix, "", ""))
    default_label = parts.netloc.rpartition("@")[2] + prefix  # host:port[/prefix], no user:password
    return Endpoint(label.strip() or default_label, base, api_key=api_key, query=parts.query)


@dataclass(frozen=True)
class KeySource:
    """One --api-key or --api-key-env, in command-line order; an environment variable is read when
    the command runs, so an unset one is a clear error there, not a key silently missing."""

    key: str | None = None  # --api-key KEY; "" sends no key to that endpoint
    env_name: str | None = None  # --api-key-env NAME

    def read(self) -> str | None:
        if self.env_name is None:
            return self.key or None
        value = os.environ.get(self.env_name, "")
        if not value.strip():
            state = "is empty" if self.env_name in os.environ else "is not set"
            raise ValueError(f"--api-key-env {self.env_name or repr('')}: that environment variable {state}; "
                             "set it, or give no key")
        return value.strip()


class _AppendKeySource(argparse.Action):
    """--api-key and --api-key-env append to one list, so that their order matches the endpoints'."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        source = KeySource(env_name=value) if option_string == "--api-key-env" else KeySource(key=value)
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), source])


def add_api_key_args(parser, order: str) -> None:
    """--api-key / --api-key-env (stored together in args.api_keys); order: which endpoint the n-th is."""
    parser.add_argument("--api-key", dest="api_keys", action=_AppendKeySource, default=None, metavar="KEY",
                        help=f"send Authorization: Bearer KEY: once for every endpoint, or once per endpoint "
                             f"({order}; '' sends none to that one). Without --api-key or --api-key-env no key is "
                             "sent ($OPENAI_API_KEY is not read). Over plain http only loopback (127.0.0.0/8, ::1, "
                             "localhost) gets a key: use https elsewhere. Other users can see KEY in the process "
                             "list: prefer --api-key-env")
    parser.add_argument("--api-key-env", dest="api_keys", action=_AppendKeySource, metavar="NAME",
                        help="like --api-key, the key read from the environment variable NAME (e.g. --api-key-env "
                             "OPENAI_API_KEY); an error if it is unset or empty. Both flags count together, in "
                             "order")


def parse_endpoints(texts: list[str], models: list[str] | None,
                    keys: list[KeySource] | None = None) -> list[Endpoint]:
    """--endpoint values with --endpoint-model and --api-key/--api-key-env: each none (ask each server;
    send no key), one (for all) or one per endpoint."""
    for flag, given in (("--endpoint-model", models or []), ("--api-key/--api-key-env", keys or [])):
        if len(given) not in (0, 1, len(texts)):
            raise ValueError(f"{flag}: give one for every endpoint or one per endpoint ({len(texts)}), "
                             f"got {len(given)}")
    api_keys = [source.read() for source in keys or []]
    api_keys = api_keys * len(texts) if len(api_keys) == 1 else api_keys or [None] * len(texts)
    endpoints = [parse_endpoint(text, key) for text, key in zip(texts, api_keys)]
    labels = [e.label for e in endpoints]
    if len(set(labels)) != len(labels):
        raise ValueError(f"endpoint labels must differ, got {labels}; name them LABEL=URL")
    if models:
        names = models * len(endpoints) if len(models) == 1 else models
        endpoints = [replace(e, model=name) for e, name in zip(endpoints, names)]
    return endpoints


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

    shown = endpoint.redacted_url(path)
    try:
        return http.request(method, endpoint.url(path), headers=endpoint.headers, **kwargs)
    except httpx.TimeoutException:
        raise ValueError(f"{shown}: no answer within the timeout") from None
    except httpx.HTTPError as error:
        raise ValueError(f"cannot reach {shown}: {error or type(error).__name__}; is the server running?") from None


def _checked(response, url: str):
    if response.status_code >= 400:
        message, param = _error_message(response)
        raise EndpointError(url, response.status_code, message.replace("\n", " "), param)
    return response


def get_json(http, endpoint: Endpoint, path: str) -> dict:
    url = endpoint.redacted_url(path)
    response = _checked(_send(http, "GET", endpoint, path), url)
    try:
        return response.json()
    except ValueError:
        raise ValueError(f"{url}: the answer is not JSON; is this an OpenAI-compatible server?") from None


def post_json(http, endpoint: Endpoint, path: str, body: dict) -> dict:
    url = endpoint.redacted_url(path)
    response = _checked(_send(http, "POST", endpoint, path, json={"model": endpoint.model, **body}), url)
    try:
        return response.json()
    except ValueError:
        raise ValueError(f"{url}: the answer is not JSON") from None


def resolve_model(http, endpoint: Endpoint) -> Endpoint:
    """The endpoint with its model name: the one given, else the one model GET /v1/models lists."""
    if endpoint.model:
        return endpoint
    url = endpoint.redacted_url("/v1/models")
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
    return replace(endpoint, model=names[0])


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
    url = endpoint.redacted_url("/v1/chat/completions")
    body = {"model": endpoint.model, "messages": messages, "stream": True,
            "stream_options": {"include_usage": True}, **sampling}
    import httpx

    texts, times = [], []
    usage, speculative, finish = None, None, None
    start = time.perf_counter()
    try:
        with http.stream("POST", endpoint.url("/v1/chat/completions"), json=body,
                         headers=endpoint.headers) as response:
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
