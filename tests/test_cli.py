"""The command line on tiny models saved as ordinary Hugging Face directories."""

import json
from pathlib import Path

import pytest

from conftest import make_model, make_tokenizer
from specdec.cli import main


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    paths = {}
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        path = root / name
        make_model(seed=seed, layers=layers).save_pretrained(path)
        make_tokenizer().save_pretrained(path)
        paths[name] = str(path)
    return paths


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_json_with_a_draft_matches_plain(capsys, model_dirs):
    common = ["--target", model_dirs["target"], "--max-new-tokens", "20", "--json", "hello world"]
    code, out, _ = run(capsys, "generate", "--method", "autoregressive", *common)
    assert code == 0
    plain = json.loads(out)
    code, out, _ = run(capsys, "generate", "--method", "draft", "--draft", model_dirs["draft"], "-k", "3", *common)
    assert code == 0
    spec = json.loads(out)
    assert spec["token_ids"] == plain["token_ids"] and len(spec["token_ids"]) == 20
    assert spec["stats"]["drafted_tokens"] > 0 and plain["stats"]["drafted_tokens"] == 0
    assert set(spec["stats"]) >= {"mean_accepted_length", "acceptance_rate", "tokens_per_s"}


@pytest.mark.parametrize("method", ["ngram", "ngram+draft"])
def test_generate_ngram_methods_match_plain(capsys, model_dirs, method):
    prompt = "abc abc abc abc"
    common = ["--target", model_dirs["target"], "--max-new-tokens", "30", "--json", prompt]
    code, out, _ = run(capsys, "generate", "--method", "autoregressive", *common)
    plain = json.loads(out)
    code, out, _ = run(capsys, "generate", "--method", method, "--draft", model_dirs["draft"], "-k", "6",
                       "--ngram-max", "4", "--ngram-min", "2", "--draft-k", "3", *common)
    assert code == 0
    spec = json.loads(out)
    assert spec["token_ids"] == plain["token_ids"] and spec["method"] == method
    assert spec["stats"]["drafted_tokens"] > 0


def test_default_method_on_a_cpu_is_scored_copying_with_adaptive_k(capsys, model_dirs):
    """--method auto (the default) runs scored copying on a CPU, the fastest lossless method
    measured there, and loads no draft model; naming a --draft makes it draft with that model."""
    prompt = "abc abc abc abc"
    common = ["--target", model_dirs["target"], "--device", "cpu", "--max-new-tokens", "30", "--json", prompt]
    code, out, _ = run(capsys, "generate", "--method", "autoregressive", *common)
    plain = json.loads(out)
    code, out, err = run(capsys, "generate", *common)
    assert code == 0, err
    spec = json.loads(out)
    assert spec["method"] == "copy" and spec["k"] == "auto" and "loading draft" not in err
    assert spec["token_ids"] == plain["token_ids"] and spec["stats"]["drafted_tokens"] > 0
    code, out, err = run(capsys, "generate", "--draft", model_dirs["draft"], *common)
    assert code == 0, err
    spec = json.loads(out)
    assert spec["method"] == "ngram+draft" and "loading draft" in err and spec["token_ids"] == plain["token_ids"]
    code, out, err = run(capsys, "generate", "--draft", model_dirs["draft"], "-k", "3", *common)
    assert code == 0, err
    assert json.loads(out)["method"] == "draft"  # a fixed k: the draft model alone


def test_resolve_method_follows_the_device():
    from specdec.proposers.registry import resolve_method

    assert resolve_method("auto", "cpu") == "copy"
    assert resolve_method("auto", "cuda") == "ngram"  # launch-bound on an H100: see default_method
    assert resolve_method("draft", "cpu") == "draft"  # a method named is never replaced


def test_bad_ngram_options_fail_before_loading_any_model(capsys):
    code, _, err = run(capsys, "generate", "--target", "no-such-model", "--method", "ngram",
                       "--ngram-max", "2", "--ngram-min", "3", "hi")
    assert code == 2 and "ngram_min (3) must not exceed ngram_max (2)" in err
    assert "no-such-model" not in err  # refused before the target was looked up


def test_a_bad_draft_stop_rule_fails_before_loading_any_model(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "--target", "no-such-model", "--method", "draft", "--draft", "x",
                       "--draft-stop", str(tmp_path / "nothing.json"), "hi")
    assert code == 2 and "nothing.json is not a draft stop rule" in err and "no-such-model" not in err


def test_generate_streams_text_and_prints_stats(capsys, model_dirs):
    code, out, err = run(capsys, "generate", "--target", model_dirs["target"], "--draft", model_dirs["draft"],
                         "--max-new-tokens", "10", "--stats", "--temperature", "0.9", "--seed", "3", "abc")
    assert code == 0
    assert "mean accepted length" in err and "acceptance rate" in err
    assert out.endswith("\n")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--target", "no-such-model", "hi"], "no-such-model"),
        (["generate", "--temperature", "-1", "hi"], "temperature"),
        (["generate", "--top-p", "0", "hi"], "top_p"),
    ],
)
def test_bad_input_is_one_clear_line(capsys, model_dirs, argv, message):
    if "--target" not in argv:
        argv = argv[:1] + ["--target", model_dirs["target"], "--method", "autoregressive"] + argv[1:]
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in err and "Traceback" not in err


def test_k_below_one_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "-k", "0", "hi"])
    assert exit_info.value.code == 2
    assert "must be an integer >= 1" in capsys.readouterr().err


def test_incompatible_draft_tokenizer_is_refused(capsys, model_dirs, tmp_path):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    other = tmp_path / "other"
    make_model(seed=2, layers=1).save_pretrained(other)
    backend = Tokenizer(models.BPE(vocab={"<unk>": 0, "x": 1, "y": 2}, merges=[], unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(other)
    code, _, err = run(capsys, "generate", "--target", model_dirs["target"], "--method", "draft", "--draft", str(other),
                       "hi")
    assert code == 2 and "incompatible" in err


def test_native_and_transformers_backends_agree_in_fp32(capsys, model_dirs):
    outputs = {}
    for backend in ("native", "hf"):
        code, out, err = run(capsys, "generate", "--target", model_dirs["target"], "--backend", backend,
                             "--dtype", "float32", "--quantize", "none", "--method", "autoregressive",
                             "--max-new-tokens", "25",
                             "--json", "hello world")
        assert code == 0
        outputs[backend] = json.loads(out)["token_ids"]
        assert f"[{backend}, float32]" in err  # the log names the backend that served it
    assert outputs["native"] == outputs["hf"]


def test_quantized_reduced_vocabulary_draft_keeps_output_exact(capsys, model_dirs):
    common = ["--target", model_dirs["target"], "--max-new-tokens", "25", "--json", "hello world"]
    code, out, _ = run(capsys, "generate", "--method", "autoregressive", *common)
    plain = json.loads(out)
    code, out, err = run(capsys, "generate", "--draft", model_dirs["draft"], "--draft-quantize", "int8",
                         "--draft-vocab", "20", "-k", "3", *common)
    assert code == 0, err
    assert "int8 weights, 20-token head" in err
    assert json.loads(out)["token_ids"] == plain["token_ids"]


def test_quantizing_on_the_transformers_backend_is_refused(capsys, model_dirs):
    code, _, err = run(capsys, "generate", "--target", model_dirs["target"], "--backend", "hf", "--quantize", "int8",
                       "--method", "autoregressive", "hi")
    assert code == 2 and "need the native backend" in err and "Traceback" not in err


def test_generate_with_auto_k_matches_plain_and_lenience_accepts_more(capsys, model_dirs):
    common = ["--target", model_dirs["target"], "--max-new-tokens", "30", "--json", "hello world"]
    _, out, _ = run(capsys, "generate", "--method", "autoregressive", *common)
    plain = json.loads(out)
    code, out, err = run(capsys, "generate", "--draft", model_dirs["draft"], "-k", "auto", "--max-k", "5",
                         "--draft-confidence", "0.1", *common)
    assert code == 0, err
    auto = json.loads(out)
    assert auto["token_ids"] == plain["token_ids"] and auto["stats"]["drafted_tokens"] > 0
    assert len(auto["stats"]["drafted_per_position"]) <= 5
    _, out, _ = run(capsys, "generate", "--draft", model_dirs["draft"], "-k", "3", *common)
    exact = json.loads(out)
    code, out, err = run(capsys, "generate", "--draft", model_dirs["draft"], "-k", "3", "--lenience", "0.05", *common)
    assert code == 0, err
    lenient = json.loads(out)
    assert lenient["stats"]["acceptance_rate"] > exact["stats"]["acceptance_rate"]


@pytest.mark.parametrize("argv, message", [
    (["generate", "-k", "often", "hi"], "integer >= 1 or auto"),
    (["generate", "--lenience", "0", "hi"], "(0, 1]"),
    (["generate", "--lenience", "1.5", "hi"], "(0, 1]"),
    (["generate", "--draft-confidence", "1", "hi"], "[0, 1)"),
    (["generate", "--max-k", "0", "hi"], "must be an integer >= 1"),
    (["serve", "-k", "sometimes"], "integer >= 1 or auto"),  # serve takes -k auto (goodput) too
])
def test_bad_adaptive_and_lenience_options_are_argument_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_labels_lenience_as_lossy(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "LOSSY" in help_text and "auto" in help_text and "Still lossless" in help_text


def test_train_head_then_generate_with_it_matches_plain(capsys, model_dirs, tmp_path):
    """train-head end to end on the tiny target (a few steps), then every head method, greedy == plain."""
    common = ["--target", model_dirs["target"], "--max-new-tokens", "24", "--json", "hello world"]
    _, out, _ = run(capsys, "generate", "--method", "autoregressive", *common)
    plain = json.loads(out)["token_ids"]
    for kind, methods in (("eagle", ["eagle", "eagle-tree"]), ("medusa", ["medusa"])):
        head = tmp_path / f"{kind}.safetensors"
        code, _, err = run(capsys, "train-head", "--kind", kind, "--target", model_dirs["target"], "--out", str(head),
                           "--max-tokens", "2048", "--seq-len", "64", "--steps", "6", "--checkpoint-every", "3")
        assert code == 0, err
        assert head.is_file() and "step 6" in err and "resuming" not in err
        for method in methods:
            code, out, err = run(capsys, "generate", "--method", method, "--head", str(head), "-k", "3",
                                 "--tree-size", "5", *common)
            assert code == 0, err
            assert json.loads(out)["token_ids"] == plain
        code, _, err = run(capsys, "train-head", "--kind", kind, "--target", model_dirs["target"], "--out", str(head),
                           "--max-tokens", "2048", "--seq-len", "64", "--steps", "6")
        assert code == 0 and "resuming" in err  # the same command again finds the finished run


def test_a_published_mlp_speculator_directory_drafts(capsys, model_dirs, tmp_path):
    """--method mlp-speculator --head DIR with a checkpoint in fms-extras' layout (IBM's published
    accelerators): greedy output plain's; export-head has nothing to convert."""
    from fms_checkpoints import published

    config = json.loads((Path(model_dirs["target"]) / "config.json").read_text())
    directory = published(tmp_path / "accelerator", emb_dim=config["hidden_size"], inner_dim=config["hidden_size"],
                          vocab_size=config["vocab_size"])  # widths the target's w4a8 format takes
    common = ["--target", model_dirs["target"], "--max-new-tokens", "24", "--json", "hello world"]
    _, out, _ = run(capsys, "generate", "--method", "autoregressive", *common)
    code, spec, err = run(capsys, "generate", "--method", "mlp-speculator", "--head", str(directory), "-k", "3", *common)
    assert code == 0, err
    assert json.loads(spec)["token_ids"] == json.loads(out)["token_ids"] and json.loads(spec)["stats"]["drafted_tokens"]
    code, _, err = run(capsys, "export-head", "--kind", "mlp-speculator", "--target", model_dirs["target"], "--head",
                       str(directory), "--out", str(tmp_path / "again"))
    assert code == 2 and "mlp_speculator directory already" in err


def test_eagle3_trains_exports_to_speculators_and_loads_back(capsys, model_dirs, tmp_path):
    """train-head --kind eagle3, then its chain and tree, then export-head and the exported directory
    as --head: every output greedy == plain."""
    common = ["--target", model_dirs["target"], "--max-new-tokens", "24", "--json", "hello world"]
    _, out, _ = run(capsys, "generate", "--method", "autoregressive", *common)
    plain = json.loads(out)["token_ids"]
    head = tmp_path / "eagle3.safetensors"
    code, _, err = run(capsys, "train-head", "--kind", "eagle3", "--aux-layers", "0,1,1", "--target",
                       model_dirs["target"], "--out", str(head), "--max-tokens", "2048", "--seq-len", "64",
                       "--steps", "6", "--checkpoint-every", "3")
    assert code == 0, err
    exported = tmp_path / "eagle3-vllm"
    code, _, err = run(capsys, "export-head", "--target", model_dirs["target"], "--head", str(head), "--out",
                       str(exported))
    assert code == 0, err
    assert (exported / "config.json").is_file() and "vllm serve" in err and '"method": "eagle3"' in err
    for method, location in (("eagle3", head), ("eagle3-tree", head), ("eagle3", exported)):
        code, out, err = run(capsys, "generate", "--method", method, "--head", str(location), "-k", "3",
                             "--tree-size", "5", *common)
        assert code == 0, err
        assert json.loads(out)["token_ids"] == plain
    code, _, err = run(capsys, "export-head", "--target", model_dirs["target"], "--head", str(head), "--out",
                       str(exported))
    assert code == 2 and "not empty" in err  # never writes over a directory
    # Self-distillation: the target's own answers, cached; the same command resumes without asking again.
    distilled = tmp_path / "distilled" / "eagle3.safetensors"
    distill = ["train-head", "--kind", "eagle3", "--aux-layers", "0,1,1", "--target", model_dirs["target"], "--out",
               str(distilled), "--self-distill", "12", "--distill-tokens", "40", "--seq-len", "32", "--steps", "4",
               "--max-tokens", "256"]
    code, _, err = run(capsys, *distill)
    assert code == 0, err
    cache = next((tmp_path / "distilled").glob("distill-*.jsonl"))
    rows = [json.loads(line) for line in cache.read_text().splitlines()]
    assert len(rows) == 12 and sum(bool(row["answer"]) for row in rows) >= 3  # long prompts skip 256 tokens
    assert sorted(row["index"] for row in rows) == list(range(12))
    code, _, err = run(capsys, *distill)
    assert code == 0 and "resuming" in err and len(cache.read_text().splitlines()) == 12
    code, _, err = run(capsys, "train-head", "--kind", "eagle3", "--aux-layers", "0,7", "--target",
                       model_dirs["target"], "--out", str(tmp_path / "bad.safetensors"))
    assert code == 2 and "outside the target's 2 layers" in err


@pytest.mark.integration  # reads the ShareGPT package, which `make models` installs
def test_train_head_on_sharegpt_keeps_the_bench_out_and_its_head_is_exact(capsys, model_dirs, tmp_path):
    head = tmp_path / "chat" / "eagle.safetensors"
    code, _, err = run(capsys, "train-head", "--kind", "eagle", "--corpus", "sharegpt", "--target",
                       model_dirs["target"], "--out", str(head), "--max-tokens", "1024", "--seq-len", "64",
                       "--steps", "3", "--checkpoint-every", "3")
    assert code == 0, err
    assert "ShareGPT: 17671 conversations read" in err and "sharing 13 words with a bench prompt" in err
    assert "corpus: 16 windows x 64 tokens" in err
    common = ["--target", model_dirs["target"], "--max-new-tokens", "20", "--json", "Tell me about Hawaii."]
    _, out, _ = run(capsys, "generate", "--method", "autoregressive", *common)
    code, spec, err = run(capsys, "generate", "--method", "eagle", "--head", str(head), *common)
    assert code == 0, err
    assert json.loads(spec)["token_ids"] == json.loads(out)["token_ids"]


@pytest.mark.parametrize("argv, message", [
    (["generate", "--method", "eagle", "--head", "/no/such/head.safetensors", "hi"], "no trained eagle head"),
    (["generate", "--method", "medusa", "--target", "no-such-model", "hi"], "specdec train-head --kind medusa"),
    (["train-head", "--kind", "eagle", "--topk-distill", "10"], "--topk-distill takes K >= 1 for --kind eagle3"),
    (["train-head", "--kind", "eagle3", "--topk-distill", "-1"], "--topk-distill takes K >= 1"),
])
def test_a_missing_head_is_one_clear_line_before_any_load(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err and "Traceback" not in err
    assert "loading target" not in err


def test_the_usage_line_names_every_subcommand(capsys):
    from specdec.cli import SUBCOMMANDS

    with pytest.raises(SystemExit):
        main(["--help"])
    usage = capsys.readouterr().out.split("\n\n")[0]
    assert all(name in usage for name in SUBCOMMANDS) and "train-head" in usage


def test_no_import_circle_and_no_namespace_below_the_commands():
    """Command modules share options through cli_options, never through cli.py; the layers below
    the commands (config, factory, registry, server, engine) never see argparse."""
    import ast
    from pathlib import Path

    import specdec

    root = Path(specdec.__file__).parent
    for name in ("cli_options", "generate_cli", "demo", "serve_cli", "research_cli", "replay_cli", "train_cli",
                 "doctor", "costs_cli"):
        imported = {node.module for node in ast.walk(ast.parse((root / f"{name}.py").read_text()))
                    if isinstance(node, ast.ImportFrom)}
        assert "specdec.cli" not in imported, name
    below = [root / "config.py", root / "factory.py", root / "api.py", *(root / "proposers").glob("*.py"),
             *(root / "server").glob("*.py"), *(root / "engine").glob("*.py")]
    assert [path.name for path in below if "argparse" in path.read_text()] == []