"""Quality of what a method wrote, for lossy settings (`--lenience` < 1): measured, not assumed.

Exact methods write what the target would (greedy: the same tokens; sampling: the
same distribution), so their numbers here match plain decoding's up to sampling
noise, and they are the reference the lossy rows drift from:
  target_log_likelihood  sum of log p_target(token | everything before it) over
                         the answer, p the target's unwarped softmax; the report
                         divides by the token count (mean log-likelihood per token);
  humaneval_passes       HumanEval pass@1 (Chen et al. 2021, arXiv 2107.03374): the
                         answer's code and the problem's own tests run in a fresh
                         Python subprocess with a timeout.

humaneval_passes RUNS CODE THE MODEL WROTE on this machine (as HumanEval's own
harness does once its safety switch is removed). The subprocess is isolated
only lightly: python -I in an empty temporary directory, a wall-clock timeout,
and on POSIX limits on CPU time, memory and file size. Use it on models you
trust, or inside a container.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from specdec.models.runner import ModelRunner

HUMANEVAL_TIMEOUT_S = 10.0
HUMANEVAL_MEMORY_BYTES = 2 << 30  # address space of the test subprocess
_CODE_BLOCK = re.compile(r"```[a-zA-Z0-9_+-]*[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


@torch.no_grad()
def answer_logits(runner: ModelRunner, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """[n, V] fp32: the target's logits at each of the n answer tokens, teacher-forced in one forward
    over the prompt and the answer (the cache is reset before and after)."""
    ids = torch.tensor([prompt_ids + token_ids[:-1]], dtype=torch.int64, device=runner.device)  # [1, L-1]
    positions = torch.arange(ids.shape[1], device=runner.device)[None]
    runner.reset()
    logits = runner.forward(ids, positions, last_n_logits=len(token_ids)).logits[0].float()
    runner.reset()
    return logits


def target_log_likelihood(runner: ModelRunner, prompt_ids: list[int], token_ids: list[int]) -> float:
    """log p_target(token_ids | prompt_ids): one forward over the prompt and the answer (the cache is reset)."""
    if not token_ids:
        return 0.0
    logits = answer_logits(runner, prompt_ids, token_ids)  # [n, V]
    answer = torch.tensor(token_ids, device=logits.device)
    return float(torch.log_softmax(logits, dim=-1).gather(-1, answer[:, None]).sum())


def extract_code(answer: str) -> str:
    """The first fenced code block of a chat answer (an unclosed one runs to the end), else the whole answer."""
    match = _CODE_BLOCK.search(answer)
    return match.group(1) if match else answer


def _limit_resources(cpu_s: int) -> None:
    """preexec_fn of the test subprocess (POSIX): CPU seconds, address space, file size, no core dumps."""
    import resource

    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (HUMANEVAL_MEMORY_BYTES, HUMANEVAL_MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


@functools.cache
def _problems() -> dict[str, dict]:
    from specdec.bench.prompt_sets import humaneval_problems

    return {problem["task_id"]: problem for problem in humaneval_problems()}


def humaneval_passes(task_id: str, answer: str, timeout_s: float = HUMANEVAL_TIMEOUT_S) -> bool:
    """Does the answer's code pass the problem's tests? False on failure, error or timeout.

    The problem's prompt (its imports and the signature with the docstring) comes
    first, so an answer that repeats only the function still finds its imports;
    the answer's definition replaces the stub.
    """
    problem = _problems().get(task_id)
    if problem is None:
        raise ValueError(f"{task_id!r} is not a HumanEval task")
    program = "\n\n".join([problem["prompt"], extract_code(answer), problem["test"],
                           f"check({problem['entry_point']})\n"])
    with tempfile.TemporaryDirectory(prefix="specdec-humaneval-") as directory:
        path = Path(directory) / "program.py"
        path.write_text(program)
        try:
            # -I: isolated (no user site, no PYTHON* variables, no cwd on sys.path).
            limits = functools.partial(_limit_resources, max(int(timeout_s) + 1, 2)) if os.name == "posix" else None
            done = subprocess.run([sys.executable, "-I", str(path)], cwd=directory, capture_output=True,
                                  timeout=timeout_s, stdin=subprocess.DEVNULL, preexec_fn=limits)
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0
