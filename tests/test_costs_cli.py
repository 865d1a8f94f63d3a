"""`specdec costs` end to end on tiny models saved as Hugging Face directories: the file it writes is
the one `specdec replay --costs` prices with, and bad input is one clear line."""

import json

import pytest

from conftest import save_tiny_pair
from specdec.cli import main
from specdec.models.cpu_features import cpu_model, effective_isa

FAST = ["--dtype", "float32", "--quantize", "none", "--repeats", "2"]  # no kernel to compile, two passes


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("models"))


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_cost_file_is_what_replay_prices_with(capsys, model_dirs, tmp_path):
    """With rows 1 and 5 only, replay's cost of a forward is the line through them, so a replayed
    method's decode time is exactly steps + slope * drafted tokens: the file's numbers, used."""
    costs = tmp_path / "costs.json"
    code, out, err = run(capsys, "costs", "--target", model_dirs["target"], *FAST, "--context", "24", "--rows", "5",
                         "--draft", model_dirs["draft"], "--draft-quantize", "none", "--draft-context", "8",
                         "--draft-rows", "1,3", "--out", str(costs))
    assert code == 0, err
    table = json.loads(costs.read_text())
    machine = f"{cpu_model()} {effective_isa() or ''}".strip()
    assert table["cpu"] == cpu_model() and table["isa"] == effective_isa() and table["threads"] >= 1
    target = table["results"][0]
    assert list(target["step_ms"]) == ["1", "5"] and target["ratio"]["1"] == 1.0 and target["context"] == 24
    assert all(ms > 0 for ms in target["step_ms"].values()) and target["prefill_tok_s"] > 0
    assert target["read_gb_s"] > 0 and "weights read at" in out  # which memory this process's weights got
    assert list(table["draft"]["step_ms"]) == ["1", "3"] and table["draft"]["context"] == 8
    assert f"machine: {cpu_model()}" in out and "x target step" in out and f"wrote {costs}" in out
    assert "timing" in err  # the progress bar

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": f"q{i}", "category": category, "turns": [text]}) + "\n"
                               for i, (category, text) in enumerate([("copy", "the cat sat on the mat. the cat"),
                                                                     ("chat", "hello there, how are you")])))
    bench = tmp_path / "run"
    code, _, err = run(capsys, "bench", "--target", model_dirs["target"], "--draft", model_dirs["draft"],
                       "--prompts", str(prompts), "--methods", "ngram", "--k", "4", "--max-new-tokens", "24",
                       "--out", str(bench), "--quiet", "--no-plots")
    assert code == 0, err
    report = tmp_path / "replay.json"
    code, text, err = run(capsys, "replay", str(bench), "--costs", str(costs), "--draft", model_dirs["draft"],
                          "--draft-quantize", "none", "--json", str(report))
    assert code == 0, err
    replayed = json.loads(report.read_text())
    assert replayed["costs"].startswith(f"{machine}, {target['format']}, weights read at "
                                        f"{target['read_gb_s']:.0f} GB/s; {table['draft']['format']}: ")
    assert f"costs: {machine}" in text and "share of the copy ceiling's / ngram+draft oracle's" in text
    slope = (target["ratio"]["5"] - 1) / 4
    rows = {row["label"]: row for row in replayed["rows"]}
    for category, ngram in rows["ngram"]["categories"].items():
        decode_tokens = ngram["tokens"] - ngram["turns"]
        assert ngram["speedup"] == pytest.approx(decode_tokens / (ngram["steps"] + slope * ngram["drafted"]))

    # Every replayed row's share of each yardstick is its speedup over the yardstick's, category by category.
    by_key = {(row["label"], row["k"]): row for row in replayed["rows"]}
    for row in replayed["rows"]:
        if row["bound"]:
            assert all(entry["share_of"] == {} for entry in row["categories"].values())
            continue
        for category, entry in row["categories"].items():
            assert set(entry["share_of"]) == {"copy ceiling", "ngram+draft oracle"}
            for label, share in entry["share_of"].items():
                bound = by_key[label, row["k"]]["categories"][category]
                assert share == pytest.approx(entry["speedup"] / bound["speedup"])


@pytest.mark.parametrize("argv, message", [
    (["--rows", "1"], "--rows '1': needs a forward of more than one token"),
    (["--rows", "0,4"], "--rows must be comma-separated ints >= 1, got '0,4'"),
    (["--draft-rows", "4,4"], "--draft-rows '4,4': needs two sizes"),
    (["--out", "."], "--out '.' is a directory"),
    (["--target", "/no/such/model"], "/no/such/model"),
])
def test_bad_input_is_one_clear_line_before_any_timing(capsys, argv, message):
    code, out, err = run(capsys, "costs", *argv)
    assert code == 2 and message in err and "Traceback" not in err and "timing" not in err


def test_a_context_longer_than_the_model_takes_is_refused_before_any_timing(capsys, model_dirs, tmp_path):
    code, _, err = run(capsys, "costs", "--target", model_dirs["target"], *FAST, "--context", "250",
                       "--out", str(tmp_path / "costs.json"))
    assert code == 2 and "250 cached tokens and a forward of 17 exceed" in err and "lower --context" in err
    code, _, err = run(capsys, "costs", "--target", model_dirs["target"], *FAST, "--context", "24",
                       "--draft", model_dirs["draft"], "--draft-quantize", "none",
                       "--out", str(tmp_path / "costs.json"))  # the draft's default 320 + 64
    assert code == 2 and "320 cached tokens and a forward of 64 exceed" in err and "lower --draft-context" in err
    assert "timing" not in err and not (tmp_path / "costs.json").exists()


def test_help_teaches_by_example(capsys):
    with pytest.raises(SystemExit):
        main(["costs", "--help"])
    text = capsys.readouterr().out
    assert "specdec costs --draft qwen2.5-coder-0.5b" in text and "--costs costs.json" in text
    with pytest.raises(SystemExit) as exit_info:
        main(["costs", "--repeats", "0"])
    assert exit_info.value.code == 2 and "must be an integer >= 1" in capsys.readouterr().err


def test_trees_are_timed_as_a_second_entry_that_copy_prices_trees_by(capsys, model_dirs, tmp_path):
    from specdec.planning.costs import tree_cost_ratios
    from specdec.proposers.scored_copy import CopyOptions

    costs = tmp_path / "costs.json"
    code, out, err = run(capsys, "costs", "--target", model_dirs["target"], *FAST, "--context", "24", "--rows", "5",
                         "--trees", "--out", str(costs))
    assert code == 0, err
    chain, trees = json.loads(costs.read_text())["results"]
    assert not chain["tree"] and trees["tree"] and list(trees["step_ms"]) == ["1", "5"]
    assert "x chain step" in out and "timing" in err
    points = tree_cost_ratios(costs)
    assert points == [(int(n), ms / chain["step_ms"]["1"]) for n, ms in trees["step_ms"].items()]
    step_costs = CopyOptions(costs=str(costs)).new_step_costs()
    assert step_costs.tree_cost(5) == pytest.approx(max(points[1][1], step_costs.cost(5)))

