"""Benchmarks build their engines as a user's are built (issue 61, item 4): through specdec's factory from
a SpecConfig (benchmarks/public_engines.py), so a benchmark row is what `specdec.load` gives with the
same options; the few hand-built pieces say why beside them."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from conftest import save_tiny_pair
from specdec.config import SpecConfig
from specdec.sampling import SamplingParams

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import peers  # noqa: E402
import public_engines  # noqa: E402

# An engine or a proposer built directly, not by specdec's factory.
BY_HAND = re.compile(r"\b(SpecEngine|BatchEngine|\w*Proposer)\(|\bbuild_proposer\(")


def test_every_hand_built_engine_or_proposer_in_benchmarks_says_why():
    """Each direct construction has, on its line or the few before, the reason it cannot go through the
    factory (its wording names the factory or `specdec serve`, which builds its BatchEngine itself)."""
    unexplained = []
    for path in sorted(BENCHMARKS.glob("*.py")):
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            if BY_HAND.search(line.split("#")[0]) and not line.lstrip().startswith(("class ", "def ")):
                context = " ".join(lines[max(0, number - 6):number + 1])
                if "factory" not in context and "specdec serve" not in context:
                    unexplained.append(f"{path.name}:{number + 1}: {line.strip()}")
    assert unexplained == []


def test_the_check_catches_a_bare_construction():
    assert BY_HAND.search("engine = SpecEngine(target.runner, NgramProposer(), tokenizer)")
    assert BY_HAND.search("proposer = build_proposer('draft', draft_runner=runner)")
    assert not BY_HAND.search("engine = engine_for(config, target, draft)")


def test_a_peer_configuration_is_the_config_generate_builds():
    label, config = peers.spec_config("fast=draft:k=auto,quantize=w8a8")
    assert label == "fast"
    assert config == SpecConfig(target=peers.TARGET, method="draft", k="auto", draft=peers.DRAFT, quantize="w8a8")
    assert config.draft_confidence == SpecConfig().draft_confidence  # the hand-built row had none
    assert peers.spec_config("plain=autoregressive")[1].draft is None


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("bench-models"))


def test_peer_engines_are_the_factorys_with_the_models_loaded_once(model_dirs, monkeypatch):
    import specdec

    monkeypatch.setattr(peers, "TARGET", model_dirs["target"])
    monkeypatch.setattr(peers, "DRAFT", model_dirs["draft"])
    engines = peers.build_engines(["plain=autoregressive", "draft auto=draft:k=auto", "draft 4=draft",
                                   "both=ngram+draft:k=auto", "ngram=ngram:k=auto"])
    assert engines["plain"].proposer is None and engines["draft 4"].k == 4
    default = SpecConfig().draft_confidence
    assert engines["draft auto"].proposer.confidence_threshold == default  # what a user's -k auto gets
    assert engines["both"].proposer.draft.confidence_threshold == default
    assert engines["draft 4"].proposer.confidence_threshold is None  # a fixed k drafts all k
    assert engines["ngram"].proposer.follow_match
    assert len({id(engine.target) for engine in engines.values()}) == 1  # one target for every row
    assert engines["draft auto"].proposer.runner is engines["draft 4"].proposer.runner  # and one draft

    user = specdec.load(model_dirs["target"], method="draft", k="auto", draft=model_dirs["draft"], quantize="none")
    prompt, params = "the cat sat on the mat. the cat", SamplingParams(temperature=0)
    ours = engines["draft auto"].generate(prompt, params, max_new_tokens=16)
    theirs = user.generate(prompt, max_new_tokens=16)
    assert ours.token_ids == theirs.token_ids and ours.stats.drafted_tokens == theirs.stats.drafted_tokens


def test_models_are_keyed_by_what_loading_reads(model_dirs):
    models = public_engines.SharedModels()
    config = SpecConfig(target=model_dirs["target"], draft=model_dirs["draft"], method="draft", quantize="none",
                        draft_quantize="none")
    first = models.target(config)
    assert models.target(config.with_method("ngram", k=4)) is first  # another method: the same weights
    assert models.target(SpecConfig(target=model_dirs["target"], quantize="int8")) is not first
    assert models.draft(config.with_method("ngram")) is None
    assert models.draft(config) is models.draft(config.with_method("ngram+draft", k=2))


def _guarded_by_import_error(node, parents: dict) -> bool:
    """Inside a `try` whose handler catches ImportError (a fallback for an older tree)."""
    import ast

    while node in parents:
        node = parents[node]
        if isinstance(node, ast.Try) and any(
                isinstance(handler.type, ast.Name) and handler.type.id == "ImportError" for handler in node.handlers):
            return True
    return False


def test_every_name_a_benchmark_imports_from_specdec_exists():
    """A script under benchmarks/ runs rarely, so a renamed function breaks it silently: every
    `from specdec... import name` in it must still resolve (a fallback for older trees aside)."""
    import ast
    import importlib

    missing = []
    for script in sorted(BENCHMARKS.glob("*.py")):
        tree = ast.parse(script.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specdec")):
                continue
            if _guarded_by_import_error(node, parents):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name) and importlib.util.find_spec(f"{node.module}.{alias.name}") is None:
                    missing.append(f"{script.name}: {node.module}.{alias.name}")
    assert missing == []


def test_every_spec_config_a_benchmark_builds_names_its_fields():
    """SpecConfig's method options moved into `options=` (issue 61); a benchmark still passing
    `suffix=` or `ngram=` fails only when someone runs it, so every keyword of every
    `SpecConfig(...)` call under benchmarks/ must be one of its fields."""
    import ast
    import dataclasses

    fields = {field.name for field in dataclasses.fields(SpecConfig)}
    unknown = []
    for script in sorted(BENCHMARKS.glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "SpecConfig":
                unknown += [f"{script.name}:{node.lineno}: {keyword.arg}=" for keyword in node.keywords
                            if keyword.arg is not None and keyword.arg not in fields]
    assert unknown == []
