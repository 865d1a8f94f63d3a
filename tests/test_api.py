"""SpecConfig and the two-line Python API (specdec.load) on tiny models saved as HF directories."""

import dataclasses

import pytest

import specdec
from conftest import make_model, make_tokenizer
from specdec.cli import build_parser
from specdec.cli_options import config_from_args
from specdec.config import HeadOptions, NgramOptions, SpecConfig
from specdec.proposers.lookahead import LookaheadOptions
from specdec.proposers.suffix import SuffixOptions


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("api-models")
    paths = {}
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        make_model(seed=seed, layers=layers).save_pretrained(root / name)
        make_tokenizer().save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


def test_load_generates_the_targets_greedy_output_and_streams_the_same_text(model_dirs):
    plain = specdec.load(model_dirs["target"], method="autoregressive", device="cpu")
    llm = specdec.load(model_dirs["target"], method="draft", draft=model_dirs["draft"], k=3, device="cpu")
    assert isinstance(llm, specdec.LLM) and isinstance(llm.config, specdec.SpecConfig)
    assert llm.config.method == "draft" and llm.config.k == 3 and llm.config.draft == model_dirs["draft"]
    expected = plain.generate("hello world", max_new_tokens=24)
    result = llm.generate("hello world", max_new_tokens=24)
    assert result.token_ids == expected.token_ids and len(result.token_ids) == 24
    assert result.stats.drafted_tokens > 0 and expected.stats.drafted_tokens == 0
    chunks = list(llm.stream("hello world", max_new_tokens=24))
    assert "".join(chunk.text for chunk in chunks) == expected.text and chunks[-1].stats is not None
    sampled = [llm.generate("hello", max_new_tokens=8, temperature=0.8, seed=5).token_ids for _ in range(2)]
    assert sampled[0] == sampled[1]  # a seed makes a sampled answer reproducible


def test_load_settles_auto_and_reports_bad_options_before_loading(model_dirs):
    llm = specdec.load(model_dirs["target"], device="cpu")  # auto on a CPU: scored copying, no draft model
    assert llm.config.method == "copy" and llm.draft is None
    with pytest.raises(TypeError, match="unknown options speculative_tokens"):
        specdec.load(model_dirs["target"], speculative_tokens=3)
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        specdec.load(model_dirs["target"], k=0)
    with pytest.raises(FileNotFoundError):
        specdec.load(model_dirs["target"], method="eagle", head=str(model_dirs["target"]) + "/no-head.safetensors")


@pytest.mark.parametrize("bad, message", [
    (dict(method="telepathy"), "unknown method"),
    (dict(k="sometimes"), "k must be"),
    (dict(k=True), "k must be"),
    (dict(max_k=0), "max_k"),
    (dict(draft_confidence=1.0), "confidence"),
    (dict(quantize="int3"), "quantize must be one of"),
    (dict(dtype="float8"), "dtype must be one of"),
    (dict(options=("big",)), "SuffixOptions"),
    (dict(options=(SuffixOptions(), SuffixOptions(max_depth=3))), "two SuffixOptions"),
])
def test_a_bad_config_is_a_clear_error(bad, message):
    with pytest.raises(ValueError, match=message):
        SpecConfig(**bad)
    with pytest.raises(ValueError, match="must not exceed"):
        NgramOptions(max=2, min=3)
    with pytest.raises(ValueError, match="tree_topk"):
        HeadOptions(tree_topk=0)


def test_resolved_picks_the_devices_method_and_a_named_draft_wins():
    assert SpecConfig().resolved("cpu").method == "copy"
    assert SpecConfig().resolved("cuda").method == "ngram"
    named = SpecConfig(draft="./my-draft").resolved("cpu")
    assert (named.method, named.draft) == ("ngram+draft", "./my-draft")  # -k auto picks each step's source
    assert SpecConfig(draft="./my-draft", k=4).resolved("cpu").method == "draft"  # a fixed k: the draft alone
    assert SpecConfig(method="draft").resolved("cpu").draft == "qwen2.5-coder-0.5b"  # the default draft
    assert SpecConfig(method="suffix", k=8).with_method("ngram").k == 8


def test_the_command_line_builds_the_config_the_api_would():
    """Every shared option lands in its SpecConfig field: the CLI and specdec.load meet in one value."""
    args = build_parser().parse_args([
        "generate", "--target", "./t", "--draft", "./d", "--method", "ngram+draft", "-k", "6", "--max-k", "7",
        "--draft-k", "2", "--dtype", "float32", "--quantize", "int8", "--draft-quantize", "none",
        "--ngram-max", "4", "--ngram-min", "2", "--suffix-cache-requests", "9", "--suffix-min-prob", "0.2",
        "--lookahead-window", "5", "--head", "./h", "--tree-size", "6", "hi"])
    config = config_from_args(args)
    assert config == SpecConfig(
        target="./t", method="ngram+draft", k=6, draft="./d", max_k=7, draft_k=2, dtype="float32", quantize="int8",
        draft_quantize="none", options=(NgramOptions(4, 2), SuffixOptions(cache_requests=9, min_token_prob=0.2),
                                        LookaheadOptions(window=5), HeadOptions("./h", 6)))
