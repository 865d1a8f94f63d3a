"""Run a job in forked children, kill them with SIGKILL at chosen moments: the crash-safety tests' tool
(tests/models/test_hub.py, tests/training/test_checkpoints.py).

`python killing.py FILE.py:FUNCTION` imports the job once (torch, transformers: seconds), runs
the module's warm_up() if it has one, says "ready", then answers each JSON line {"directory",
"children", "kill_after"} on stdin: it forks `children` processes that each call
FUNCTION(Path(directory)), SIGKILLs those still running kill_after seconds later (None: never),
reaps them, and prints one JSON line {"exit_codes", "killed", "seconds"}. Forking after the
imports makes a kill cost milliseconds, not an interpreter start, so a test can kill a job at many
moments. A child's stdout goes to stderr: stdout is the answer channel. The server exits when its
stdin closes, so a test process that dies takes it along.

    with Killer(Path(__file__).parent / "checkpoint_jobs.py", "train_tiny_head", tmp_path) as killer:
        answer = killer.run(tmp_path / "run1", kill_after=0.05)  # {"exit_codes": [-9], "killed": 1, ...}
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

TESTS = Path(__file__).resolve().parent


class Killer:
    """The client: starts the fork server for FUNCTION in FILE and sends it orders."""

    def __init__(self, job_file: Path, function: str, log_dir: Path) -> None:
        self.stderr_path = log_dir / f"killer-{function}.stderr"
        self._stderr = open(self.stderr_path, "w")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
        self.process = subprocess.Popen([sys.executable, __file__, f"{job_file}:{function}"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env)
        ready = self.process.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"the fork server did not start: {self.stderr()}")

    def run(self, directory: Path, *, kill_after: float | None = None, children: int = 1) -> dict:
        """Fork `children` jobs on `directory`; kill those still running after kill_after seconds."""
        directory.mkdir(parents=True, exist_ok=True)
        order = {"directory": str(directory), "children": children, "kill_after": kill_after}
        self.process.stdin.write(json.dumps(order) + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        if not answer:
            raise RuntimeError(f"the fork server died: {self.stderr()}")
        return json.loads(answer)

    def stderr(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text()

    def __enter__(self) -> Killer:
        return self

    def __exit__(self, *exc) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            self._stderr.close()


def _load(spec: str):
    file, function = spec.rsplit(":", 1)
    sys.path[:0] = [str(Path(file).parent), str(TESTS)]
    module_spec = importlib.util.spec_from_file_location(Path(file).stem, file)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    module_spec.loader.exec_module(module)
    return getattr(module, function)


def _child(job, directory: Path) -> None:
    """In the forked child: run the job, exit without returning into the server's loop."""
    os.dup2(2, 1)  # the job's prints must not reach the answer channel
    code = 0
    try:
        job(directory)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(spec: str) -> None:
    import torch

    torch.set_num_threads(1)  # as tests/conftest.py: the children compute what the test process computes
    job = _load(spec)
    warm_up = getattr(sys.modules[job.__module__], "warm_up", None)
    if warm_up is not None:  # what a first call costs once (lazy imports, kernels built on first use), not per child
        warm_up()
    print("ready", flush=True)
    for line in sys.stdin:
        order = json.loads(line)
        pids = []
        for _ in range(order["children"]):
            pid = os.fork()
            if pid == 0:
                _child(job, Path(order["directory"]))
            pids.append(pid)
        started = time.monotonic()
        codes = {}
        while len(codes) < len(pids):
            for pid in pids:
                if pid not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[pid] = os.waitstatus_to_exitcode(status)
            if order["kill_after"] is not None and time.monotonic() - started >= order["kill_after"]:
                for pid in pids:
                    if pid not in codes:
                        os.kill(pid, signal.SIGKILL)  # a child that just exited is a zombie: no error
                        codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            time.sleep(0.0005)
        exit_codes = [codes[pid] for pid in pids]
        print(json.dumps({"exit_codes": exit_codes, "killed": exit_codes.count(-signal.SIGKILL),
                          "seconds": round(time.monotonic() - started, 4)}), flush=True)


if __name__ == "__main__":
    serve(sys.argv[1])
