"""Quality drift measures: HumanEval's tests in a subprocess, and the target's log-likelihood of an answer."""

import pytest
import torch

from conftest import make_model
from specdec.bench.prompt_sets import humaneval_problems
from specdec.bench.quality import extract_code, humaneval_passes, target_log_likelihood
from specdec.engine import SpecEngine
from specdec.models.hf import HFRunner


@pytest.fixture(scope="module")
def problem():
    return next(p for p in humaneval_problems() if p["task_id"] == "HumanEval/0")


def test_the_canonical_solution_passes_and_a_wrong_one_fails(problem):
    solution = problem["prompt"] + problem["canonical_solution"]
    answer = f"Here is the function:\n\n```python\n{solution}```\n\nIt compares every pair."
    assert humaneval_passes("HumanEval/0", answer)
    wrong = solution.replace("return True", "return False", 1)
    assert wrong != solution and not humaneval_passes("HumanEval/0", f"```python\n{wrong}```")
    assert not humaneval_passes("HumanEval/0", "```python\ndef has_close_elements(:\n```")  # syntax error


def test_a_hanging_answer_is_a_failure_not_a_hang(problem):
    answer = "```python\ndef has_close_elements(numbers, threshold):\n    while True:\n        pass\n```"
    assert not humaneval_passes("HumanEval/0", answer, timeout_s=1.0)


def test_an_unknown_task_is_a_clear_error():
    with pytest.raises(ValueError, match="HumanEval"):
        humaneval_passes("HumanEval/99999", "pass")


@pytest.mark.parametrize("answer, code", [
    ("text\n```python\nx = 1\n```\nmore\n```python\ny = 2\n```", "x = 1\n"),  # the first block
    ("```\nx = 1\n```", "x = 1\n"),  # no language tag
    ("```python\nx = 1\n", "x = 1\n"),  # cut off by max_tokens: runs to the end
    ("x = 1", "x = 1"),  # no fence: the whole answer
])
def test_extract_code(answer, code):
    assert extract_code(answer) == code


def test_target_log_likelihood_is_the_sum_of_next_token_log_probabilities(tokenizer):
    runner = HFRunner(make_model(seed=0))
    prompt, answer = [3, 9, 4, 11], [7, 7, 20, 5, 13]
    with torch.no_grad():
        logits = runner.model(torch.tensor([prompt + answer])).logits[0].float()  # [L, V]
    log_probs = torch.log_softmax(logits, dim=-1)
    expected = sum(float(log_probs[len(prompt) - 1 + i, token]) for i, token in enumerate(answer))
    assert target_log_likelihood(runner, prompt, answer) == pytest.approx(expected, abs=1e-4)
    assert target_log_likelihood(runner, prompt, []) == 0.0
    # The runner's cache is left empty: the engine that owns it still generates plain greedy text.
    assert runner.seq_len == 0
    reference = SpecEngine(HFRunner(make_model(seed=0)), None, tokenizer).generate("the cat", max_new_tokens=10)
    assert SpecEngine(runner, None, tokenizer).generate("the cat", max_new_tokens=10).token_ids == reference.token_ids


def test_an_answer_that_grabs_memory_is_stopped_by_the_limit():
    answer = "```python\nhog = bytearray(8 << 30)\n\ndef has_close_elements(numbers, threshold):\n    return False\n```"
    assert not humaneval_passes("HumanEval/0", answer, timeout_s=5.0)
