"""specdec bench | analyze | verify end to end on tiny models saved as Hugging Face directories."""

import json

import pytest

from conftest import make_model, make_other_tokenizer, save_tiny_pair
from specdec.bench.harness import read_results
from specdec.cli import main


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    paths = save_tiny_pair(root)
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": "chat", "category": "chat", "turns": ["hello there", "again"]})
                       + "\n" + json.dumps({"question_id": "copy", "category": "copy",
                                            "turns": ["the cat sat on the mat. the cat"]}) + "\n")
    paths["prompts"] = str(prompts)
    return paths


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _models(dirs):
    return ["--target", dirs["target"], "--draft", dirs["draft"]]


def test_bench_runs_the_grid_reports_and_resumes(capsys, model_dirs, tmp_path):
    out = tmp_path / "run"
    argv = [*_models(model_dirs), "--prompts", model_dirs["prompts"], "--methods", "draft,ngram", "--k", "1,2",
            "--temperature", "0,0.8", "--max-new-tokens", "12", "--out", str(out), "--quiet"]
    code, text, err = run(capsys, "bench", *argv)
    assert code == 0, err
    info, rows = read_results(out / "results.jsonl")
    assert info["target"] == model_dirs["target"] and info["max_new_tokens"] == 12
    assert len(rows) == 2 * 5 * 2  # prompts x (plain + 2 methods x 2 k) x temperatures
    chat = next(r for r in rows if r["question_id"] == "chat" and r["method"] == "draft")
    assert len(chat["turns"]) == 2 and chat["tokens"] == sum(t["tokens"] for t in chat["turns"])
    assert len(chat["turns"][0]["accepted_per_step"]) == chat["turns"][0]["target_forwards"]
    assert all(r["tokens"] > 0 and r["seconds"] > 0 for r in rows)
    report = json.loads((out / "report.json").read_text())
    assert all(cell["identical"] == cell["total"] == 2 for cell in report["greedy_equality"].values())
    assert "Temperature 0: output identical to plain decoding" in text and "draft k=2" in text
    assert {p.name for p in out.glob("*.png")} == {"speedup.png", "figure1-draft.png", "figure1-ngram.png"}
    assert (out / "report.md").read_text().startswith("# specdec bench report")

    code, _, _ = run(capsys, "bench", *argv)  # everything is done: resumes with no new rows
    assert code == 0 and len(read_results(out / "results.jsonl")[1]) == len(rows)
    code, text, _ = run(capsys, "bench", "--out", str(out), "--report-only", "--no-plots")
    assert code == 0 and "draft k=1" in text

    code, _, err = run(capsys, "bench", *argv[:-5], "--max-new-tokens", "5", "--out", str(out), "--quiet")
    assert code == 2 and "max_new_tokens=12" in err  # a results file never mixes settings


def test_analyze_reads_the_bench_results_and_predicts(capsys, model_dirs, tmp_path):
    out = tmp_path / "run"
    code, _, err = run(capsys, "bench", *_models(model_dirs), "--prompts", model_dirs["prompts"], "--methods",
                       "draft", "--k", "2", "--max-new-tokens", "12", "--out", str(out), "--quiet", "--no-plots")
    assert code == 0, err
    summary = tmp_path / "analysis.json"
    code, text, err = run(capsys, "analyze", *_models(model_dirs), "--results", str(out), "--context", "16",
                          "--json", str(summary), "--markdown", str(tmp_path / "analysis.md"))
    assert code == 0, err
    assert "speedup Leviathan" in text and "c = " in text
    result = json.loads(summary.read_text())
    (block,) = result["temperatures"]
    assert set(block["alpha"]) == {"chat", "copy", "overall"}
    assert 0 <= block["alpha"]["overall"]["alpha"] <= 1
    assert {row["k"] for row in block["rows"]} == {2} and "speedup_measured" in block["rows"][0]
    assert (tmp_path / "analysis.md").read_text().count("| overall | 2 |") == 1


def test_analyze_on_a_text_file_without_bench_results(capsys, model_dirs, tmp_path):
    texts = tmp_path / "texts.jsonl"
    texts.write_text("\n".join(json.dumps({"category": c, "text": t}) for c, t in [
        ("story", "once upon a time there was a cat who sat on a mat all day long."),
        ("story", "the dog ran to the park and back again, then slept by the fire."),
        ("list", "apples, pears, plums, cherries, grapes, lemons, limes and figs."),
    ]) + "\n")
    code, text, err = run(capsys, "analyze", *_models(model_dirs), "--texts", str(texts), "--temperature", "0,1",
                          "--k", "1,3", "--context", "16", "--json", str(tmp_path / "a.json"))
    assert code == 0, err
    result = json.loads((tmp_path / "a.json").read_text())
    assert [block["temperature"] for block in result["temperatures"]] == [0.0, 1.0]
    alpha = result["temperatures"][0]["alpha"]
    assert alpha["story"]["texts"] == 2 and alpha["list"]["texts"] == 1
    assert all("speedup_measured" not in row for row in result["temperatures"][1]["rows"])  # nothing measured
    assert result["costs"]["c"] > 0 and "measured*" in text


def test_verify_passes_the_engine(capsys, model_dirs):
    code, text, err = run(capsys, "verify", *_models(model_dirs), "-k", "3", "--samples", "300",
                          "--temperature", "0.6", "--prompt", "the cat sat", "--greedy-prompts", "0")
    assert code == 0, text + err
    assert "PASS  first token" in text and "greedy check: 1/1" in text and "PASSED" in text


def test_verify_exits_one_when_speculation_is_not_lossless(capsys, model_dirs, monkeypatch):
    import torch

    import specdec.engine.step as step_module
    from specdec.sampling.rejection import VerifyResult

    def accept_everything(draft_ids, num_draft, draft_probs, target_probs, generator=None, lenience=1.0):
        bonus = torch.multinomial(target_probs[:, -1], 1, generator=generator)
        return VerifyResult(torch.cat([draft_ids, bonus], dim=1), num_draft.clone())

    monkeypatch.setattr(step_module, "rejection_sample", accept_everything)
    code, text, _ = run(capsys, "verify", *_models(model_dirs), "-k", "3", "--samples", "300",
                        "--temperature", "0.6", "--prompt", "the cat sat", "--greedy-prompts", "0")
    assert code == 1 and "FAIL  first token" in text and "FAILED" in text


@pytest.mark.parametrize("argv,message", [
    (["bench", "--k", "0,2"], "k values must be comma-separated integers >= 1 or auto"),
    (["bench", "--k", "two"], "k values must be comma-separated integers >= 1 or auto"),
    (["bench", "--temperature", "-1"], "temperatures must be comma-separated floats >= 0"),
    (["bench", "--methods", "draft,magic"], "unknown method 'magic'"),
    (["bench", "--prompts", "nowhere.jsonl"], "not found"),
    (["bench", "--report-only", "--out", "/nonexistent/run"], "no results"),
    (["verify", "--temperature", "0"], "must be > 0"),
    (["verify", "--method", "autoregressive"], "nothing to verify"),
    (["analyze", "--results", "/nonexistent/run"], "not found"),
])
def test_bad_input_is_one_line_before_any_model_loads(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("stream", [False, True], ids=["alone", "stream"])
def test_bench_stream_lets_suffix_decoding_learn_from_earlier_prompts(capsys, model_dirs, tmp_path, stream):
    """The same request twice: in a stream the second drafts from the first's output (and gets
    the whole answer accepted); measured alone, both start from an empty cache."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": f"q{i}", "category": "same", "turns": ["hello there"]})
                               + "\n" for i in (1, 2)))
    out = tmp_path / "run"
    code, text, err = run(capsys, "bench", *_models(model_dirs), "--prompts", str(prompts), "--methods", "suffix",
                          "--k", "8", "--max-new-tokens", "24", "--per-category", "2", "--out", str(out), "--quiet",
                          "--no-plots",
                          *(["--stream"] if stream else []))
    assert code == 0, err
    info, rows = read_results(out / "results.jsonl")
    assert info["stream"] is stream and info["options"]["suffix"]["cache_requests"] == 500
    suffix = {r["question_id"]: r for r in rows if r["method"] == "suffix"}
    plain = {r["question_id"]: r for r in rows if r["method"] == "autoregressive"}
    assert all(suffix[q]["turns"][0]["token_ids"] == plain[q]["turns"][0]["token_ids"] for q in ("q1", "q2"))
    if stream:
        assert suffix["q2"]["accepted_tokens"] >= suffix["q1"]["accepted_tokens"] + 5
    else:
        assert suffix["q2"]["accepted_tokens"] == suffix["q1"]["accepted_tokens"]


def test_replay_reproduces_the_recorded_bench_run_without_a_model(capsys, model_dirs, tmp_path):
    """Greedy ngram and suffix runs of a stream, replayed from plain decoding's answers alone: the
    same accepted tokens at every step, and the copy ceiling at least as high."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": f"q{i}", "category": category, "turns": [text]}) + "\n"
                               for i, (category, text) in enumerate([("copy", "the cat sat on the mat. the cat"),
                                                                     ("same", "hello there"),
                                                                     ("same", "hello there")])))
    out = tmp_path / "run"
    code, _, err = run(capsys, "bench", *_models(model_dirs), "--prompts", str(prompts), "--methods", "ngram,suffix",
                       "--k", "4", "--max-new-tokens", "24", "--per-category", "2", "--out", str(out), "--quiet",
                       "--no-plots", "--stream")
    assert code == 0, err
    _, rows = read_results(out / "results.jsonl")
    report = tmp_path / "replay.json"
    code, text, err = run(capsys, "replay", str(out), "--json", str(report))
    assert code == 0, err
    assert "ngram k=4: 3/3 turns identical to the recorded run" in text
    assert "suffix k=4: 3/3 turns identical to the recorded run" in text
    replayed = {row["label"]: row["categories"]["overall"] for row in json.loads(report.read_text())["rows"]}
    for method in ("ngram", "suffix"):
        recorded = [r for r in rows if r["method"] == method]
        forwards = sum(r["target_forwards"] for r in recorded)
        assert replayed[method]["tau"] == pytest.approx(sum(r["tokens"] for r in recorded) / forwards)
        assert replayed["copy ceiling"]["tau"] >= replayed[method]["tau"]
    assert replayed["suffix"]["tau"] > 1.5  # the repeated request is copied from the first one's answer
    assert 1.0 <= replayed["copy"]["tau"] <= replayed["copy ceiling"]["tau"]
    # Where copy's choice loses: the matched ceiling is the cheapest path over what any candidate offers,
    # so neither half-oracle (each a path through the same offers) is faster, nor is it above the ceiling.
    matched = replayed["matched ceiling"]["speedup"]
    assert matched <= replayed["copy ceiling"]["speedup"] + 1e-9
    halves = [label for label in replayed if label.startswith("copy's score: ")]
    assert len(halves) == 2 and all(replayed[label]["speedup"] <= matched + 1e-9 for label in halves)
    assert "The matched ceiling drafts" in text
    scorer = tmp_path / "scorer.json"  # --fit: copy's scorer from these answers, then used as a file
    code, fitted, err = run(capsys, "replay", str(out), "--methods", "copy", "--fit", str(scorer))
    assert code == 0 and "fitted copy's scorer on" in fitted, err
    assert json.loads(scorer.read_text())["fitted on"] == [str(out)]
    code, reused, err = run(capsys, "replay", str(out), "--methods", "copy", "--copy-scorer", str(scorer))
    assert code == 0 and reused.strip() in fitted, err  # the same replay, from the file
    code, _, err = run(capsys, "replay", str(out), "--copy-scorer", str(tmp_path / "none.json"))
    assert code == 2 and "cannot read the copy scorer" in err
    code, text, err = run(capsys, "replay", str(tmp_path / "nothing"))
    assert code == 2 and "no bench results" in err and "Traceback" not in err
    code, text, err = run(capsys, "replay", str(out), "--methods", "draft")
    assert code == 2 and "needs a draft model: --draft NAME" in err
    code, text, err = run(capsys, "replay", str(out), "--methods", "eagle")
    assert code == 2 and "not 'eagle'" in err
    other = tmp_path / "other-draft"  # the recorded ids are the target's: another tokenizer is benched instead
    make_model(seed=1, layers=1).save_pretrained(other)
    make_other_tokenizer().save_pretrained(other)
    code, text, err = run(capsys, "replay", str(out), "--methods", "draft", "--draft", str(other))
    assert code == 2 and "does not share: bench it instead" in err
    broken = tmp_path / "broken.jsonl"
    broken.write_text((out / "results.jsonl").read_text() + "{not json\n")
    code, text, err = run(capsys, "replay", str(broken))
    assert code == 2 and "broken.jsonl:" in err and "is not JSON" in err


def test_bench_with_auto_k_and_lenience_reports_speed_and_quality(capsys, model_dirs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": "HumanEval/2", "category": "humaneval",
                                   "turns": ["def truncate_number(number: float) -> float:"]}) + "\n"
                       + json.dumps({"question_id": "copy", "category": "copy",
                                     "turns": ["the cat sat on the mat. the cat"]}) + "\n")
    out = tmp_path / "run"
    code, text, err = run(capsys, "bench", *_models(model_dirs), "--prompts", str(prompts), "--methods", "draft",
                          "--k", "2,auto", "--lenience", "1,0.5", "--temperature", "0,0.8", "--max-new-tokens", "10",
                          "--max-k", "4", "--out", str(out), "--quiet", "--no-plots")
    assert code == 0, err
    info, rows = read_results(out / "results.jsonl")
    assert info["max_k"] == 4
    assert {(r["k"], r["lenience"]) for r in rows if r["method"] == "draft"} == {(2, 1.0), ("auto", 1.0), (2, 0.5),
                                                                                  ("auto", 0.5)}
    assert len(rows) == 2 * 5 * 2  # prompts x (plain + 2 k x 2 lenience) x temperatures
    # A lenience below 1 switches quality on: every answer scored, HumanEval answers run against their tests.
    assert all("target_logprob" in r and r["target_logprob"] <= 0 for r in rows)
    assert all(isinstance(r["passed"], bool) for r in rows if r["category"] == "humaneval")
    assert "passed" not in next(r for r in rows if r["category"] == "copy")
    report = json.loads((out / "report.json").read_text())
    assert set(report["greedy_equality"]) == {"draft k=2", "draft k=auto"}  # the exact ones, both identical
    assert all(cell["identical"] == cell["total"] == 2 for cell in report["greedy_equality"].values())
    assert "Quality drift, temperature 0.8" in text and "draft k=auto l=0.5 (lossy)" in text
    assert "s/prompt p50" in text


def test_verify_passes_the_engine_with_auto_k(capsys, model_dirs):
    code, text, err = run(capsys, "verify", *_models(model_dirs), "-k", "auto", "--max-k", "4",
                          "--draft-confidence", "0.02", "--samples", "300", "--temperature", "0.6",
                          "--prompt", "the cat sat", "--greedy-prompts", "1", "--max-new-tokens", "16")
    assert code == 0, text + err
    assert "PASS  first token" in text and "greedy check: 1/1" in text and "PASSED" in text


@pytest.fixture(scope="module")
def trained_heads(model_dirs, tmp_path_factory):
    """EAGLE and Medusa heads for the tiny target, a few steps of `specdec train-head` each."""
    root = tmp_path_factory.mktemp("heads")
    paths = {}
    for kind in ("eagle", "medusa"):
        paths[kind] = str(root / f"{kind}.safetensors")
        assert main(["train-head", "--kind", kind, "--target", model_dirs["target"], "--out", paths[kind],
                     "--max-tokens", "2048", "--seq-len", "64", "--steps", "4"]) == 0
    return paths


def test_bench_runs_the_head_methods_and_checks_their_greedy_output(capsys, model_dirs, trained_heads, tmp_path):
    out = tmp_path / "heads"
    for kind, methods, sizes in (("eagle", "eagle,eagle-tree", "5,auto"), ("medusa", "medusa", "5")):
        code, text, err = run(capsys, "bench", "--target", model_dirs["target"], "--prompts", model_dirs["prompts"],
                              "--methods", methods, "--head", trained_heads[kind], "--tree-size", sizes, "--k", "3",
                              "--max-new-tokens", "12", "--out", str(out / kind), "--quiet")
        assert code == 0, err
        report = json.loads((out / kind / "report.json").read_text())
        assert report["greedy_equality"] and all(cell["identical"] == cell["total"] == 2
                                                 for cell in report["greedy_equality"].values())
    # Two tree sizes: the tree method runs at each, interleaved, each its own row; the chain method once.
    assert set(report_of(out / "eagle")["greedy_equality"]) == {"eagle k=3", "eagle-tree k=3 tree=5",
                                                                "eagle-tree k=3 tree=auto"}
    assert set(report_of(out / "medusa")["greedy_equality"]) == {"medusa k=3"}


def report_of(out) -> dict:
    return json.loads((out / "report.json").read_text())


def test_verify_passes_an_eagle_tree(capsys, model_dirs, trained_heads):
    code, text, err = run(capsys, "verify", "--target", model_dirs["target"], "--method", "eagle-tree",
                          "--head", trained_heads["eagle"], "--tree-size", "6", "-k", "3", "--samples", "300",
                          "--temperature", "0.6", "--prompt", "the cat sat", "--greedy-prompts", "1",
                          "--max-new-tokens", "16")
    assert code == 0, text + err
    assert "PASSED" in text


def test_replay_reproduces_a_draft_models_run_and_prices_its_oracle(capsys, model_dirs, tmp_path):
    """The draft model replayed alone (no target) accepts what the recorded bench run accepted at
    every step; its oracle, priced with the same costs, decodes at least as fast."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": f"q{i}", "category": category, "turns": [text]}) + "\n"
                               for i, (category, text) in enumerate([("copy", "the cat sat on the mat. the cat"),
                                                                     ("chat", "hello there, how are you")])))
    out = tmp_path / "run"
    code, _, err = run(capsys, "bench", *_models(model_dirs), "--prompts", str(prompts), "--methods", "draft",
                       "--k", "2", "--max-new-tokens", "24", "--out", str(out), "--quiet", "--no-plots")
    assert code == 0, err
    report = tmp_path / "replay.json"
    code, text, err = run(capsys, "replay", str(out), "--draft", model_dirs["draft"], "--draft-cost", "0.3",
                          "--json", str(report))
    assert code == 0, err
    assert "draft k=2: 2/2 turns identical to the recorded run" in text
    assert "ngram+draft oracle" in text and "draft forwards 0.3 of a step" in text
    replayed = {row["label"]: row["categories"]["overall"] for row in json.loads(report.read_text())["rows"]}
    assert replayed["draft oracle"]["speedup"] >= replayed["draft"]["speedup"]
    # it may copy wherever the copy ceiling does (ngram copies less), and draft on top
    assert replayed["ngram+draft oracle"]["speedup"] >= replayed["copy ceiling"]["speedup"] - 1e-9
    assert replayed["copy ceiling"]["speedup"] >= replayed["ngram"]["speedup"]
    with pytest.raises(SystemExit) as exit_info:
        main(["replay", str(out), "--draft", model_dirs["draft"], "--draft-cost", "-1"])
    assert exit_info.value.code == 2 and "must be a number in [0, inf)" in capsys.readouterr().err
