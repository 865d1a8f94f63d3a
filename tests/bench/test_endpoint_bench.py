"""`specdec bench --endpoint` against real `specdec serve` subprocesses: one speculative, one plain."""

from __future__ import annotations

import json

import pytest

from server.serve_processes import save_models, specdec_servers
from specdec.cli import main

PROMPTS = [
    {"question_id": "t/chat-1", "category": "chat", "turns": ["hello, how are you?", "and then?"]},
    {"question_id": "t/chat-2", "category": "chat", "turns": ["the cat sat on the mat."]},
    {"question_id": "t/code-1", "category": "code", "turns": ["write a function add of a and b."]},
]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    models = save_models(tmp_path_factory.mktemp("endpoint-bench-models"))
    with specdec_servers(models, {
        "spec": ["--method", "draft", "--draft", str(models / "draft"), "-k", "3", "--max-batch", "2"],
        "plain": ["--method", "autoregressive", "--max-batch", "2"],
    }) as urls:
        yield urls


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("endpoint-prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def _bench(servers, prompt_file, out, *extra) -> list[str]:
    return ["bench", "--endpoint", f"plain={servers['plain']}", "--endpoint", f"spec={servers['spec']}/v1/",
            "--prompts", str(prompt_file), "--per-category", "5", "--temperature", "0,1", "--max-new-tokens", "12",
            "--out", str(out), "--quiet", *extra]


def test_bench_endpoints_interleaves_reports_and_resumes(servers, prompt_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_bench(servers, prompt_file, out)) == 0
    stdout = capsys.readouterr().out
    lines = (out / "results.jsonl").read_text().splitlines()
    header, rows = json.loads(lines[0]), [json.loads(line) for line in lines[1:]]
    assert header["bench"] == "endpoints" and header["reference"] == "plain"
    assert [(e["label"], e["model"]) for e in header["endpoints"]] == [("plain", "tiny"), ("spec", "tiny")]
    setup = header["endpoints"][1]["speculative"]
    assert (setup["method"], setup["k"], setup["methods"][0]) == ("draft", 3, "draft")

    # 3 prompts x 2 temperatures x 2 endpoints, the endpoints' order rotating from group to group
    assert len(rows) == 12 and not any(r.get("error") for r in rows)
    assert [r["endpoint"] for r in rows[:4]] == ["plain", "spec", "spec", "plain"]
    for row in rows:
        assert row["tokens"] > 0 and row["tokens_per_s"] > 0
        for turn in row["turns"]:
            assert turn["tokens_from_usage"] and 0 < turn["ttft_seconds"] <= turn["seconds"]
            assert turn["chunks"] >= 1 and len(turn["chunk_gaps_ms"]) == turn["chunks"] - 1
            assert turn["acceptance_source"] == "specdec"
        assert (row["drafted_tokens"] > 0) == (row["endpoint"] == "spec")
    # the second turn carries the first answer: its prompt holds the first prompt and answer (one token a char)
    first, second = next(r for r in rows if r["question_id"] == "t/chat-1")["turns"]
    assert second["prompt_tokens"] >= first["prompt_tokens"] + len(first["text"])

    report = json.loads((out / "report.json").read_text())
    cells = report["temperatures"]["0"]["categories"]
    assert set(cells) == {"chat", "code", "overall"}
    assert cells["overall"]["plain"]["ratio"] == 1.0 and cells["overall"]["spec"]["ratio"] > 0
    assert cells["overall"]["spec"]["acceptance_rate"] is not None
    assert cells["overall"]["plain"]["mean_accepted_length"] == 1.0
    assert report["identical_at_t0"] == {"spec": {"identical": 3, "total": 3, "differing": []}}
    markdown = (out / "report.md").read_text()
    assert "vs plain" in markdown and "wrote the same text as plain on 3/3 prompts" in markdown
    assert (out / "throughput.png").stat().st_size > 0 and (out / "latency.png").stat().st_size > 0
    assert "temperature 0" in stdout and "TTFT p50 ms" in stdout

    # a rerun finds every row done: nothing is appended, the report is rebuilt
    assert main(_bench(servers, prompt_file, out, "--no-plots")) == 0
    assert (out / "results.jsonl").read_text().splitlines() == lines
    # --report-only recognises an endpoint run without --endpoint
    capsys.readouterr()
    assert main(["bench", "--out", str(out), "--report-only", "--no-plots"]) == 0
    assert "vs plain" in capsys.readouterr().out


def test_bench_endpoint_errors_are_one_line_with_the_url(servers, prompt_file, tmp_path, capsys):
    unreachable = ["bench", "--endpoint", "http://127.0.0.1:9", "--prompts", str(prompt_file), "--out",
                   str(tmp_path / "a"), "--quiet"]
    assert main(unreachable) == 2
    err = capsys.readouterr().err
    assert "cannot reach http://127.0.0.1:9/v1/models" in err and err.count("\n") == 1

    wrong_model = ["bench", "--endpoint", servers["plain"], "--endpoint-model", "nope", "--prompts",
                   str(prompt_file), "--out", str(tmp_path / "b"), "--quiet"]
    assert main(wrong_model) == 2
    err = capsys.readouterr().err
    assert f"{servers['plain']}/v1/chat/completions: HTTP 404" in err and "'nope' does not exist" in err

    assert main(["bench", "--endpoint", "x=http://a", "--endpoint", "x=http://b", "--out", str(tmp_path / "c")]) == 2
    assert "endpoint labels must differ" in capsys.readouterr().err
