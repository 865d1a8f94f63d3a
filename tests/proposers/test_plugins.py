"""A method from another package, installed through the `specdec.methods` entry point, runs where a
shipped method does: specdec.load, `specdec generate`, `specdec serve` (with the official openai
client), `specdec bench`, `verify` and `replay`; greedy output is plain output. The toy lives in tests/proposers/plugin_toy and is made
installed by a dist-info folder on PYTHONPATH, as pip would leave it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

import specdec
from conftest import make_model, make_tokenizer
from specdec.proposers import plugins
from specdec.proposers.plugins import PluginMethod, discover

TOY = Path(__file__).parent / "plugin_toy" / "toy_specdec_method.py"
PROMPT = "the cat sat on the mat. the cat sat on the"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """A site folder holding the toy and its distribution's metadata; the environment that sees it."""
    site = tmp_path_factory.mktemp("site")
    shutil.copy(TOY, site / TOY.name)
    info = site / "toy_specdec_method-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-specdec-method\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[specdec.methods]\nrepeat-last = toy_specdec_method:METHOD\n"
                                           "repeat-n = toy_specdec_method:ENTRY\n")
    models = tmp_path_factory.mktemp("plugin-models")
    make_model(seed=0, layers=2).save_pretrained(models / "target")
    make_tokenizer().save_pretrained(models / "target")
    source = str(Path(specdec.__file__).parents[1])
    return {"env": {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), source]), "PYTHONUNBUFFERED": "1"},
            "target": str(models / "target")}


def python(installed, code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], env=installed["env"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_load_and_generate_run_the_plugin_with_plain_greedy_output(installed):
    target = installed["target"]
    out = python(installed, f'''
import json, specdec
from specdec.cli import main
plain = specdec.load({target!r}, method="autoregressive", device="cpu").generate({PROMPT!r}, max_new_tokens=40)
llm = specdec.load({target!r}, method="repeat-last", k=4, device="cpu")
mine = llm.generate({PROMPT!r}, max_new_tokens=40)
print(json.dumps({{"same": mine.token_ids == plain.token_ids, "drafted": mine.stats.drafted_tokens,
                  "described": "repeat-last" in specdec.config.METHODS}}))
main(["generate", "--target", {target!r}, "--device", "cpu", "--method", "repeat-last", "-k", "3",
      "--max-new-tokens", "40", "--json", {PROMPT!r}])
''')
    first, rest = out.split("\n", 1)  # this script's line, then the CLI's JSON
    loaded, cli = json.loads(first), json.loads(rest)
    assert loaded == {"same": True, "drafted": loaded["drafted"], "described": True} and loaded["drafted"] > 0
    plain = specdec.load(target, method="autoregressive", device="cpu").generate(PROMPT, max_new_tokens=40)
    assert cli["method"] == "repeat-last" and cli["token_ids"] == plain.token_ids
    assert cli["stats"]["drafted_tokens"] > 0


def test_a_plugin_entry_brings_its_options_as_flags_and_config(installed):
    """The entry form: the toy's options dataclass is a SpecConfig option group and a flag of every
    command (--repeat-times, under a group titled by the method), and reaches the proposer."""
    target = installed["target"]
    out = python(installed, f'''
import json, specdec
from specdec.cli import main
from toy_specdec_method import RepeatOptions
plain = specdec.load({target!r}, method="autoregressive", device="cpu").generate({PROMPT!r}, max_new_tokens=40)
mine = specdec.load({target!r}, method="repeat-n", k=4, device="cpu", repeat=RepeatOptions(times=2)).generate(
    {PROMPT!r}, max_new_tokens=40)
print(json.dumps({{"same": mine.token_ids == plain.token_ids, "positions": len(mine.stats.drafted_per_position)}}))
try:
    main(["generate", "--help"])
except SystemExit:
    pass
main(["generate", "--target", {target!r}, "--device", "cpu", "--method", "repeat-n", "-k", "4", "--repeat-times",
      "3", "--max-new-tokens", "40", "--json", {PROMPT!r}])
''')
    first, rest = out.split("\n", 1)
    loaded = json.loads(first)
    assert loaded == {"same": True, "positions": 2}  # never more than its 2 tokens a step, at k = 4
    assert "repeating the last token (--method repeat-n):" in rest and "--repeat-times N" in rest
    cli = json.loads(rest[rest.index("\n{") + 1:])
    plain = specdec.load(target, method="autoregressive", device="cpu").generate(PROMPT, max_new_tokens=40)
    assert cli["token_ids"] == plain.token_ids and len(cli["stats"]["drafted_per_position"]) == 3


def test_serve_runs_the_plugin_and_answers_a_real_client(installed):
    with socket.socket() as sock:  # a free port
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "specdec.cli", "serve", "--target", installed["target"], "--port", str(port),
               "--max-batch", "2", "--served-model-name", "tiny", "--log-level", "warning",
               "--method", "repeat-last", "-k", "3"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=installed["env"])
    try:
        deadline = time.monotonic() + 120
        while not _healthy(port):
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    finally:
        process.send_signal(signal.SIGINT)  # Ctrl-C, as a user stops it
        process.communicate(timeout=30)
    plain = specdec.load(installed["target"], method="autoregressive", device="cpu").generate(PROMPT, max_new_tokens=24)
    assert reply.choices[0].text == plain.text
    assert reply.model_extra["speculative"]["method"] == "repeat-last"
    assert reply.model_extra["speculative"]["drafted_tokens"] > 0


def test_bench_verify_and_replay_run_the_plugin(installed, tmp_path):
    """`specdec bench` measures it beside plain decoding (greedy output identical), `specdec verify`
    passes it, and `specdec replay` drafts it from the bench run's recorded answers."""
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "run"
    prompts.write_text(json.dumps({"question_id": "copy", "category": "copy", "turns": [PROMPT]}) + "\n")
    target = installed["target"]
    shared = f'"--target", {target!r}, "--device", "cpu"'
    printed = python(installed, f'''
from specdec.cli import main
codes = [main(["bench", {shared}, "--prompts", {str(prompts)!r}, "--methods", "repeat-last", "--k", "3",
               "--max-new-tokens", "24", "--out", {str(out)!r}, "--quiet", "--no-plots"]),
         main(["verify", {shared}, "--method", "repeat-last", "-k", "3", "--samples", "200", "--temperature", "0.8",
               "--prompt", "the cat sat", "--greedy-prompts", "1"]),
         main(["replay", {str(out)!r}, "--methods", "repeat-last", "--k", "3"])]
print("CODES", codes)
''')
    assert "CODES [0, 0, 0]" in printed, printed
    report = json.loads((out / "report.json").read_text())
    assert report["greedy_equality"] and all(cell["identical"] == cell["total"] == 1
                                             for cell in report["greedy_equality"].values())
    assert "PASSED" in printed and "| repeat-last | 3 |" in printed  # verify's verdict; replay's row


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_a_clashing_or_broken_plugin_is_refused_by_name(monkeypatch):
    class Point:
        def __init__(self, name, value):
            self.name, self.value = name, value

        def load(self):
            return self.value

    def offering(*methods):
        monkeypatch.setattr(plugins, "entry_points", lambda group: [Point(f"p{i}", m) for i, m in enumerate(methods)])

    toy = PluginMethod("toy", "a toy", lambda draft_runner: None)
    offering(toy)
    assert discover({"ngram"}) == {"toy": toy}
    offering(PluginMethod("ngram", "a clash", lambda draft_runner: None))
    with pytest.raises(ValueError, match="'ngram' is already taken"):
        discover({"ngram"})
    offering("not a method")
    with pytest.raises(TypeError, match="must name a specdec.proposers.plugins.PluginMethod or a"):
        discover({"ngram"})
