"""specdec's own CPU kernels, compiled on first use into the cache directory.

- w4a8.cpp: 4-bit weights x int8 activations (models/native/w4a8.py).
- w8a8.cpp: int8 weights x int8 activations (models/native/linear.py's W8A8Linear, the w4a8
  target's output head).
- attention.cpp: the blocked attention law of models/native/attention.py in one call per layer.
- layer_ops.cpp: RMSNorm, and the q/k/v split with RoPE, of models/native/model.py in one call each.
- block.cpp: a whole decoder block of a w4a8 model (model.py's Block) for a chain of new tokens.

One library, built with torch.utils.cpp_extension (g++ and ninja; well under a minute, once per
PyTorch version: docs/history.md, "4-bit targets on specdec's own kernel, attention in one
call: w4a8 (issue 19, second part)"), registered as torch.ops.specdec_w4a8, torch.ops.specdec_w8a8,
torch.ops.specdec_attention, torch.ops.specdec_layer and torch.ops.specdec_block.
Where it cannot be built, `load()` says why and the callers keep PyTorch's own kernels.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

import torch

SOURCES = [Path(__file__).with_name(name) for name in ("w4a8.cpp", "w8a8.cpp", "attention.cpp", "layer_ops.cpp",
                                                             "block.cpp")]
LIBRARY = "specdec_kernels"


def build_directory() -> Path:
    from specdec.models.hub import cache_root  # the models' cache: one place for everything specdec keeps

    directory = cache_root() / "kernels" / f"torch{torch.__version__.replace('+', '_')}"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


STALE_LOCK_S = 300  # many times a build's time; a lock this old was left by a process killed while holding it


def clear_stale_lock(build: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove the build's lock file if a killed process left it (torch's FileBaton waits for it forever).

    Every load takes the lock for a moment (ninja checks the library is current), so a process
    interrupted then (Ctrl-C while a model loads) leaves it behind. True if one was removed."""
    lock = build / "lock"
    try:
        age_s = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age_s < max_age_s:
        return False
    print(f"specdec: removing a stale kernel build lock ({lock}, {age_s / 60:.0f} min old)", file=sys.stderr)
    lock.unlink(missing_ok=True)
    return True


@functools.cache
def load() -> str | None:
    """Compile (once) and load the kernels; None on success, else why not."""
    if os.environ.get("SPECDEC_NO_KERNELS"):
        return "SPECDEC_NO_KERNELS is set"
    try:
        from torch.utils import cpp_extension

        try:  # the `ninja` wheel's binary, which need not be on PATH (a virtualenv not activated)
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass  # a system ninja, if any
        build = build_directory()
        clear_stale_lock(build)
        if not (build / f"{LIBRARY}.so").exists():
            print("specdec: compiling specdec's CPU kernels (once, about 30 s)", file=sys.stderr, flush=True)
        cpp_extension.load(name=LIBRARY, sources=[str(source) for source in SOURCES], is_python_module=False,
                           extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp"], build_directory=str(build),
                           verbose=bool(os.environ.get("SPECDEC_VERBOSE_BUILD")))
    except Exception as error:  # no compiler, no ninja, no headers: say which
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f"specdec's CPU kernels could not be compiled here ({first_line}); they need g++ and ninja"
    return None
