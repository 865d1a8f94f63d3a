"""OpenVINO GenAI as a peer: Intel's inference stack on the same CPU, the same prompts (peers.py).

Everything comes from the package registry: a virtualenv of its own under
~/.cache/specdec/openvino (openvino-genai, openvino-tokenizers, optimum-intel and nncf pull their own
transformers; torch is pinned to the CPU build by constraints.txt), and the embedded models' bf16
directories exported with optimum-intel's int4 defaults, what a user would type (int4_asym, group
size 128, a few layers int8):

    python benchmarks/openvino_peer.py setup      # once: ~5 minutes on 2 cores

Each peers.py mode (plain, speculative with the 0.5B draft, prompt lookup) is one long-lived worker
process (benchmarks/openvino_worker.py) holding its pipeline, fed one prompt at a time, so loading
and compiling the model is paid once and the runs interleave with the other engines'.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from specdec.models import hub

PACKAGES = ("openvino-genai==2026.4.1.0", "openvino-tokenizers==2026.4.1.0", "optimum-intel[openvino]==2.2.0", "nncf")
MODES = ("plain", "speculative", "lookup")
ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("openvino_worker.py")


def peer_dir() -> Path:
    return hub.cache_root() / "openvino"


def python() -> Path:
    return peer_dir() / "venv" / "bin" / "python"


def exported(name: str) -> Path:
    return peer_dir() / f"{name}-int4"


def setup(names: tuple[str, ...], log=print) -> None:
    """The virtualenv and each model's int4 IR (each step skipped where already done)."""
    venv = peer_dir() / "venv"
    marker = venv / ".installed"
    if not marker.is_file():
        log(f"creating {venv} and installing {', '.join(PACKAGES)} from PyPI ...")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python()), "-m", "pip", "install", "--disable-pip-version-check", "-q",
               "-c", str(ROOT / "constraints.txt")]
        subprocess.run([*pip, "torch==2.13.0"], check=True)  # the CPU build first: never the CUDA one
        subprocess.run([*pip, *PACKAGES], check=True)
        # A dependency pulls torchvision, built for another torch: its missing operators break
        # transformers' imports (torchvision::nms). Text models need none of it.
        subprocess.run([str(python()), "-m", "pip", "uninstall", "-y", "-q", "torchvision"], check=True)
        marker.write_text("\n".join(PACKAGES) + "\n")
    for name in names:
        out = exported(name)
        if (out / "openvino_model.xml").is_file():
            continue
        log(f"exporting {name} to OpenVINO IR, int4 (optimum-intel's defaults) -> {out} ...")
        source = hub.fetch(name, progress=False)
        subprocess.run([str(python()), "-m", "optimum.commands.optimum_cli", "export", "openvino", "--model",
                        str(source), "--task", "text-generation-with-past", "--weight-format", "int4", str(out)],
                       check=True)


class Worker:
    """One mode's pipeline in its own process; generate() sends a prompt and reads the answer."""

    def __init__(self, mode: str, target: str, draft: str, threads: int, assistant_tokens: int) -> None:
        command = [str(python()), str(WORKER), "--mode", mode, "--target", str(exported(target)),
                   "--threads", str(threads), "--assistant-tokens", str(assistant_tokens)]
        if mode == "speculative":
            command += ["--draft", str(exported(draft))]
        self.mode = mode
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.process.stdout.readline()
        if not ready.strip():
            raise RuntimeError(f"the OpenVINO {mode} worker did not start (exit {self.process.poll()})")

    def generate(self, text: str, max_new_tokens: int, temperature: float, top_p: float) -> dict:
        request = dict(text=text, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=1)
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            return dict(errors=[f"the worker exited ({self.process.poll()})"])
        answer = json.loads(line)
        if "error" in answer or not answer.get("decode_tok_s"):
            return dict(errors=[answer.get("error", "no decode time")])
        return dict(answer, errors=[])

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=60)


def main() -> int:
    if sys.argv[1:] != ["setup"]:
        print(__doc__)
        return 2
    setup(("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"))
    print(f"ready: {python()}; models under {peer_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
