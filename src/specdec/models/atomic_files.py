"""Files that survive kills and power cuts: write under a temporary name, fsync, rename into place.

A rename within one directory is atomic (POSIX rename(2)): a reader sees the old file or the new
one, never a half-written one, whatever moment a SIGKILL lands. A power cut is another matter:
without fsync the rename can reach the disk before the data it names, and the file comes back
empty or truncated. So every writer here fsyncs the file before the rename and the directory
after it (docs/architecture.md, "Files that survive kills and races").
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_file(path: Path | str) -> None:
    """Force a written file's bytes to the disk (opened read-only: fsync needs only a descriptor)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_directory(path: Path | str) -> None:
    """Make the renames and creations inside a directory durable (a no-op where directories cannot
    be opened, as on Windows)."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except (PermissionError, IsADirectoryError):
        return
    try:
        os.fsync(descriptor)
    except OSError:  # some filesystems refuse fsync on a directory; the rename is still atomic
        pass
    finally:
        os.close(descriptor)


def temporary_path(path: Path) -> Path:
    """The name a file is written under before its rename: beside it (the same filesystem, so the
    rename is atomic), hidden, and fixed, so that a killed writer's leftover is overwritten by the
    next write instead of piling up."""
    return path.with_name(f".{path.name}.partial")


@contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temporary path to write `path`'s new content to; on a clean exit, fsync it and rename
    it over `path` (then fsync the directory). On an exception the temporary file is removed and
    `path` keeps its old content.

        with atomic_path(out) as partial:
            save_file(tensors, str(partial))
    """
    path = Path(path)
    partial = temporary_path(path)
    try:
        yield partial
        fsync_file(partial)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, path)
    fsync_directory(path.parent)


def write_safetensors(path: Path | str, tensors: dict, metadata: dict | None = None) -> None:
    """safetensors' format written at exactly `path` (for atomic_path's temporary name). Not
    safetensors' save_file: that writes a .tmpXXXXXX file beside `path` first and renames it, and a
    kill leaves that behind under a name no one cleans up. This holds the file's bytes in memory
    once instead (a head or a features shard: megabytes to a few hundred)."""
    from safetensors.torch import save

    with open(path, "wb") as handle:
        handle.write(save(tensors, metadata=metadata))
