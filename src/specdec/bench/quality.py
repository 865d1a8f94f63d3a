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
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from specdec.models.runner import ModelRunner

HUMANEVAL_TIMEOUT_S = 10.0
_CODE_BLOCK = re.compile(r"```[a-zA-Z0-9_+-]*[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


@torch.no_grad()
def target_log_likelihood(runner: ModelRunner, prompt_ids: list[int], token_ids: list[int]) -> float:
    """log p_target(token_ids | prompt_ids): one forward over the prompt and the answer (the cache is reset)."""
    if not token_ids:
        return 0.0
    ids = torch.tensor([prompt_ids + token_ids[:-1]], dtype=torch.int64, device=runner.device)  # [1, L-1]
    positions = torch.arange(ids.shape[1], device=runner.device)[None]
    runner.reset()
    logits = runner.forward(ids, positions, last_n_logits=len(token_ids)).logits[0].float()  # [n, V]
    runner.reset()
    answer = torch.tensor(token_ids, device=logits.device)
    return float(torch.log_softmax(logits, dim=-1).gather(-1, answer[:, None]).sum())


def extract_code(answer: str) -> str:
    """The first fenced code block of a chat answer (an unclosed one runs to the end), else the whole answer."""
    match = _CODE_BLOCK.search(answer)
    return match.group(1) if match else answer


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
            done = subprocess.run([sys.executable, "-I", str(path)], cwd=directory, capture_output=True,
                                  timeout=timeout_s, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0
