"""`specdec models fetch` of a fake embedded model in processes of its own: the job tests/models/test_hub.py
runs twice at once and kills at random moments (tests/killing.py).

The model's packages and its cache are test_hub.py's fake_model fixture's, described in
DIRECTORY/job.json (write_job). The conversion (convert_tiny_model, in place of the GGUF one) saves
a tiny model built from a config, as tests/conftest.py builds them, and logs each conversion's start
and end beside the cache, so a test can count them.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import time
from pathlib import Path

from conftest import make_model, make_tokenizer

from specdec.models import hub

CONVERSIONS = "conversions.log"  # beside the cache root: "start PID" and "done PID" lines
PAUSE = 0.1  # seconds between the conversion's writes: a kill can land between them, as in a real one


def convert_tiny_model(spec, gguf_dir, gguf_name, out: Path, progress: bool = True) -> None:
    """Stands in for gguf_convert (a minute for the real target): the tiny model's weights and config,
    a pause, its tokenizer, a pause."""
    log = hub.cache_root().parent / CONVERSIONS
    with open(log, "a") as handle:
        handle.write(f"start {os.getpid()}\n")
    if (Path(gguf_dir) / gguf_name).stat().st_size != spec.size_bytes:
        raise AssertionError("the converter was handed a partial GGUF")
    make_model(seed=0).save_pretrained(out)
    time.sleep(PAUSE)
    make_tokenizer().save_pretrained(out)
    time.sleep(PAUSE)
    with open(log, "a") as handle:
        handle.write(f"done {os.getpid()}\n")


def write_job(directory: Path, model: hub.EmbeddedModel, site: Path, cache: Path) -> Path:
    """DIRECTORY/job.json: the fake model (its fields), where its packages are, which cache to fill."""
    directory.mkdir(parents=True, exist_ok=True)
    job = {"model": dataclasses.asdict(model), "site": str(site), "cache": str(cache)}
    (directory / "job.json").write_text(json.dumps(job))
    return directory


def fetch_fake_model(directory: Path) -> None:
    """In a child: make the job's fake model the one embedded model, then fetch it."""
    job = json.loads((directory / "job.json").read_text())
    fields = job["model"]
    model = hub.EmbeddedModel(**{**fields, "requirements": tuple(fields["requirements"]),
                                 "parts": tuple(tuple(part) for part in fields["parts"]),
                                 "eos_tokens": tuple(fields["eos_tokens"])})
    sys.path.insert(0, job["site"])
    importlib.invalidate_caches()
    os.environ["SPECDEC_CACHE"] = job["cache"]
    hub.EMBEDDED = {model.name: model}
    hub._convert = convert_tiny_model
    hub.fetch(model.name, progress=False)


def warm_up() -> None:
    """Before tests/killing.py forks: transformers' lazy imports, paid once instead of in every child."""
    import tempfile

    import tqdm.auto  # noqa: F401  (hub's progress bars: imported on first use, so here, once)

    with tempfile.TemporaryDirectory() as directory:
        make_model(seed=0).save_pretrained(directory)
        make_tokenizer().save_pretrained(directory)
