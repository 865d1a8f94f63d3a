"""`specdec doctor` end to end on a tiny model directory: facts, kernels, probe, verdict, exit status."""

import json

import pytest

from conftest import make_model, make_tokenizer
from specdec.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_model(random_bias=True, seed=30, hidden=64).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


def test_doctor_guarantees_exactness_on_a_native_model(model_dir, tmp_path, capsys):
    report_path = tmp_path / "doctor.json"
    status = main(["doctor", "--target", str(model_dir), "--dtype", "float32", "--contexts", "5,63,130",
                   "--json", str(report_path)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "oneDNN:" in out and "kernels:" in out and "attention: blocked" in out
    assert "bit-exact greedy equality: GUARANTEED here" in out
    report = json.loads(report_path.read_text())
    names = [case["name"] for case in report["cases"]]
    assert report["ok"] and all(case["identical"] for case in report["cases"])
    assert any(name.startswith("projection head") for name in names)
    assert any("context 130, chunks [3, 3, 3]" in name for name in names)
    assert any(name.startswith("batched rows") for name in names)
    assert any(name.startswith("tree after context 130") for name in names)
    assert report["facts"]["threads"] >= 1 and report["kernels"]["dtype"] == "float32"
    # The cost table: a forward of 1..33 tokens here, next to its weight-read and arithmetic floors.
    assert "cost of a forward after" in out and "x floor" in out
    costs = report["costs"]
    assert [row["tokens"] for row in costs["rows"]] == [1, 2, 5, 9, 17, 33]
    assert costs["bandwidth_bytes_s"] > 0 and costs["peak_multiply_adds_s"] > 0
    assert all(row["ms"] > 0 and row["weight_floor_ms"] > 0 for row in costs["rows"])
    floors = [row["arithmetic_floor_ms"] for row in costs["rows"]]
    assert floors == sorted(floors) and floors[-1] > floors[0]  # more rows, more multiply-adds


def test_doctor_skips_the_cost_table_when_asked(model_dir, capsys):
    status = main(["doctor", "--target", str(model_dir), "--dtype", "float32", "--contexts", "5", "--no-costs"])
    out = capsys.readouterr().out
    assert status == 0 and "cost of a forward" not in out


def test_doctor_says_a_transformers_backend_model_is_not_guaranteed(model_dir, tmp_path, capsys):
    config = json.loads((model_dir / "config.json").read_text())
    other = tmp_path / "sliding"
    other.mkdir()
    for file in model_dir.iterdir():
        (other / file.name).write_bytes(file.read_bytes())
    (other / "config.json").write_text(json.dumps(config | {"use_sliding_window": True, "sliding_window": 4}))
    assert main(["doctor", "--target", str(other), "--dtype", "float32"]) == 1
    assert "NOT guaranteed" in capsys.readouterr().out


@pytest.mark.parametrize("context", ["0", "-5", "many"])
def test_doctor_refuses_a_bad_cost_context(context, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["doctor", "--cost-context", context])
    assert exit_info.value.code == 2 and "--cost-context" in capsys.readouterr().err


@pytest.mark.parametrize("contexts", ["0", "a,b", ""])
def test_doctor_refuses_bad_context_lengths(contexts, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["doctor", "--contexts", contexts])
    assert exit_info.value.code == 2
    assert "--contexts" in capsys.readouterr().err


def test_doctor_with_an_unknown_model_is_a_clear_error(tmp_path, capsys):
    assert main(["doctor", "--target", str(tmp_path / "nowhere")]) == 2
    assert "specdec: error:" in capsys.readouterr().err


def test_doctor_writes_the_cost_table_specdec_costs_writes(model_dir, tmp_path, capsys):
    """--costs FILE is `specdec costs --out FILE` for the same target: one file, the one replay reads."""
    from specdec.analysis.machine_costs import TARGET_ROWS

    path = tmp_path / "costs.json"
    status = main(["doctor", "--target", str(model_dir), "--dtype", "float32", "--quantize", "none", "--contexts", "5",
                   "--no-costs", "--cost-context", "24", "--costs", str(path)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "GUARANTEED here" in out and "cost of a forward after" not in out  # --no-costs: the roofline only
    table = json.loads(path.read_text())
    target = table["results"][0]
    assert target["context"] == 24 and [int(n) for n in target["step_ms"]] == list(TARGET_ROWS)
    assert target["quantize"] == "none" and target["ratio"]["1"] == 1.0 and "draft" not in table
    assert f"wrote {path}" in out and "specdec replay BENCH_DIR --costs" in out


@pytest.mark.parametrize("argv, message", [(["--synthetic"], "give --target, not --synthetic"),
                                           (["--target", "."], "is a directory")])
def test_doctor_refuses_a_bad_costs_option_before_probing(argv, message, tmp_path, capsys):
    costs = str(tmp_path) if "--target" in argv else str(tmp_path / "costs.json")
    assert main(["doctor", *argv, "--costs", costs]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "bit-exact" not in captured.out
