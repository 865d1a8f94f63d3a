"""`specdec bench --endpoint` credentials (docs/benchmarks.md, "Credentials"): a key goes only where
the command line sends it, never over plain http to another machine, and nothing written or printed
names a URL with its credentials. The server is real (tests/bench/recording_server.py): what it
records is what went over the socket."""

from __future__ import annotations

import base64
import json

import pytest

from bench.recording_server import forbid_connections, recording_server
from specdec.bench.openai_client import KeySource, parse_endpoints, redact_url
from specdec.cli import main

PROMPTS = [{"question_id": "t/ok", "category": "chat", "turns": ["hello"]},
           {"question_id": "t/rejected", "category": "chat", "turns": ["REJECT this one"]}]


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


@pytest.fixture
def server():
    with recording_server() as recording:
        yield recording


def _bench(endpoints: list[str], prompt_file, out, *extra) -> list[str]:
    return ["bench", *[arg for e in endpoints for arg in ("--endpoint", e)], "--prompts", str(prompt_file),
            "--per-category", "5", "--temperature", "0", "--max-new-tokens", "4", "--out", str(out), "--quiet",
            "--no-plots", *extra]


def _authorizations(server) -> set:
    return {seen.authorization for seen in server.seen}


def test_no_key_is_sent_without_a_key_flag_even_with_openai_api_key_set(server, prompt_file, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-ambient")
    assert main(_bench([server.url], prompt_file, tmp_path / "out")) == 0
    assert {"/v1/models", "/v1/chat/completions"} <= {seen.path for seen in server.seen}  # the run talked to it
    assert _authorizations(server) == {None}


@pytest.mark.parametrize("flags, key", [(["--api-key", "sk-given"], "sk-given"),
                                        (["--api-key-env", "SPECDEC_TEST_KEY"], "sk-from-env")])
def test_a_key_flag_sends_that_key_on_every_request(server, prompt_file, tmp_path, monkeypatch, flags, key):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-ambient")
    monkeypatch.setenv("SPECDEC_TEST_KEY", "sk-from-env")
    assert main(_bench([server.url], prompt_file, tmp_path / "out", *flags)) == 0
    assert {"/v1/models", "/v1/chat/completions"} <= {seen.path for seen in server.seen}
    assert _authorizations(server) == {f"Bearer {key}"}
    assert key not in (tmp_path / "out" / "results.jsonl").read_text()


def test_each_endpoint_gets_its_own_key_in_order(server, prompt_file, tmp_path, monkeypatch):
    monkeypatch.setenv("FIRST_KEY", "sk-first")
    with recording_server() as second:
        endpoints = [f"first={server.url}", f"second={second.url}/v1"]
        assert main(_bench(endpoints, prompt_file, tmp_path / "out", "--api-key-env", "FIRST_KEY",
                           "--api-key", "")) == 0
        assert _authorizations(server) == {"Bearer sk-first"}
        assert second.seen and _authorizations(second) == {None}


def test_key_flags_must_match_the_endpoints(server, prompt_file, tmp_path, capsys):
    argv = _bench([f"a={server.url}", f"b={server.url}"], prompt_file, tmp_path / "out",
                  "--api-key", "1", "--api-key", "2", "--api-key", "3")
    assert main(argv) == 2
    assert "--api-key/--api-key-env: give one for every endpoint or one per endpoint (2), got 3" in \
        capsys.readouterr().err
    assert server.seen == []


@pytest.mark.parametrize("value, state", [(None, "is not set"), ("", "is empty"), ("  ", "is empty")])
def test_an_unset_or_empty_key_variable_is_an_error_before_any_request(server, prompt_file, tmp_path, monkeypatch,
                                                                       capsys, value, state):
    monkeypatch.delenv("SPECDEC_TEST_KEY", raising=False)
    if value is not None:
        monkeypatch.setenv("SPECDEC_TEST_KEY", value)
    assert main(_bench([server.url], prompt_file, tmp_path / "out", "--api-key-env", "SPECDEC_TEST_KEY")) == 2
    err = capsys.readouterr().err
    assert f"--api-key-env SPECDEC_TEST_KEY: that environment variable {state}" in err and err.count("\n") == 1
    assert server.seen == []


def test_a_key_over_plain_http_to_another_host_is_refused_before_any_connection(prompt_file, tmp_path, monkeypatch,
                                                                                  capsys):
    attempts = forbid_connections(monkeypatch)
    assert main(_bench(["http://example.com/v1"], prompt_file, tmp_path / "a", "--api-key", "sk-1")) == 2
    err = capsys.readouterr().err
    assert "refusing to send the API key to http://example.com over plain http" in err
    assert "use https, or drop the key" in err and err.count("\n") == 1
    assert attempts == []
    # https to the same host passes the check: the command goes on to connect (and the test stops it there)
    assert main(_bench(["https://example.com/v1"], prompt_file, tmp_path / "b", "--api-key", "sk-1")) == 2
    assert "cannot reach https://example.com/v1/models" in capsys.readouterr().err
    assert attempts and "example.com" in attempts[0]


def test_written_labels_carry_no_credentials(server, prompt_file, tmp_path, capsys):
    host = server.url.removeprefix("http://")
    url = f"http://bench-user:s3cret-pass@{host}/v1/?api_key=q-s3cret&api-version=1"
    out = tmp_path / "out"
    assert main(_bench([url], prompt_file, out)) == 0
    # the credentials still work: Basic auth from the URL and the query on every request
    basic = "Basic " + base64.b64encode(b"bench-user:s3cret-pass").decode()
    assert _authorizations(server) == {basic}
    assert all(seen.path.endswith("?api_key=q-s3cret&api-version=1") for seen in server.seen)

    header, *rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert header["endpoints"][0]["label"] == host and header["reference"] == host
    assert header["endpoints"][0]["url"] == f"http://{host}?api_key=REDACTED&api-version=1"
    rejected = next(r for r in rows if r["question_id"] == "t/rejected")
    assert rejected["error"].startswith(f"http://{host}/v1/chat/completions?api_key=REDACTED&api-version=1: HTTP 400")
    printed = capsys.readouterr()
    for text in [*(path.read_text() for path in (out / "results.jsonl", out / "report.json", out / "report.md")),
                 printed.out, printed.err]:
        assert host in text
        assert "bench-user" not in text and "s3cret" not in text


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://127.3.2.1", "http://localhost:8000/v1",
                                 "http://LocalHost", "http://[::1]:8000", "https://example.com/v1",
                                 "https://10.0.0.5:8443"])
def test_a_key_may_go_to_loopback_or_over_https(url):
    assert parse_endpoints([url], None, [KeySource(key="sk-1")])[0].headers == {"Authorization": "Bearer sk-1"}


@pytest.mark.parametrize("url", ["http://example.com", "http://10.0.0.5:8000", "http://[::2]:8000",
                                 "http://127.0.0.1.example.com", "http://localhost.example.com",
                                 "http://0.0.0.0:8000"])
def test_a_key_over_plain_http_elsewhere_is_refused(url):
    with pytest.raises(ValueError, match="refusing to send the API key to .* over plain http"):
        parse_endpoints([url], None, [KeySource(key="sk-1")])
    parse_endpoints([url], None, [KeySource(key="")])  # '' is no key: nothing to refuse


@pytest.mark.parametrize("url, reason", [("http://u:p@example.com", "the user:password in the URL"),
                                         ("http://example.com/v1?key=abc", "the URL's key= parameter")])
def test_credentials_in_the_url_follow_the_same_rule(url, reason):
    with pytest.raises(ValueError, match=f"refusing to send {reason} to http://example.com"):
        parse_endpoints([url], None)
    assert parse_endpoints([url.replace("http://", "https://")], None)  # over https they may go


def test_a_url_key_and_an_api_key_together_are_refused():
    with pytest.raises(ValueError, match="either user:password in the URL or an API key"):
        parse_endpoints(["https://u:p@example.com"], None, [KeySource(key="sk-1")])


@pytest.mark.parametrize("url, shown", [
    ("http://u:p@h:1/v1", "http://h:1/v1"),
    ("https://user@h/x?api_key=1&api-version=2&token=t&access_token=a&x-api-key=k&page=3",
     "https://h/x?api_key=REDACTED&api-version=2&token=REDACTED&access_token=REDACTED&x-api-key=REDACTED&page=3"),
    ("https://h/?Key=1&keyword=2&monkey=3&sig=4", "https://h/?Key=REDACTED&keyword=2&monkey=3&sig=REDACTED"),
    ("https://h/?key=&flag", "https://h/?key=&flag"),
])
def test_redact_url(url, shown):
    assert redact_url(url) == shown
