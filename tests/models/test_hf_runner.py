"""KV rollback invariants of the reference runner."""

import pytest
import torch

from conftest import make_model
from specdec.models.hf import HFRunner


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_forward_in_two_parts_equals_one_pass(family):
    runner = HFRunner(make_model(seed=3, family=family))
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12)[None]
    full = runner.forward(ids, positions).logits
    runner.reset()
    first = runner.forward(ids[:, :7], positions[:, :7]).logits
    second = runner.forward(ids[:, 7:], positions[:, 7:]).logits
    assert runner.seq_len == 12
    torch.testing.assert_close(torch.cat([first, second], dim=1), full, atol=1e-5, rtol=1e-5)


def test_truncate_then_reforward_equals_fresh_run():
    runner = HFRunner(make_model(seed=4))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (1, 10), generator=gen)
    wrong = torch.randint(0, 64, (1, 4), generator=gen)
    runner.forward(ids[:, :6], torch.arange(6)[None])
    runner.forward(wrong, torch.arange(6, 10)[None])  # a rejected draft
    runner.truncate(torch.tensor([6]))
    assert runner.seq_len == 6
    again = runner.forward(ids[:, 6:], torch.arange(6, 10)[None]).logits
    runner.reset()
    fresh = runner.forward(ids, torch.arange(10)[None]).logits[:, 6:]
    torch.testing.assert_close(again, fresh, atol=1e-5, rtol=1e-5)


def test_last_n_logits_returns_only_the_tail():
    runner = HFRunner(make_model(seed=5))
    ids = torch.randint(0, 64, (1, 9))
    tail = runner.forward(ids, torch.arange(9)[None], last_n_logits=1).logits
    runner.reset()
    full = runner.forward(ids, torch.arange(9)[None]).logits
    assert tail.shape == (1, 1, 64)
    torch.testing.assert_close(tail[:, 0], full[:, -1], atol=1e-5, rtol=1e-5)


def test_runner_rejects_batches():
    runner = HFRunner(make_model(seed=5))
    with pytest.raises(ValueError, match="batch size 1"):
        runner.forward(torch.zeros(2, 3, dtype=torch.int64), torch.arange(3).expand(2, 3))
