"""Replayed steps on a CPU, for the tests of models/native/captured.py and of fixed-step runners."""

from __future__ import annotations

import pytest
import torch

from specdec.models.native.captured import FixedSteps, StaticStep


class RecomputingGraph:
    """What a replayed CUDA graph does, on a CPU: the recorded function again, into the outputs
    of the recording, reading nothing but the step's buffers (captured.py). Like a real graph it
    holds the cache storage it was recorded over, and fails if replayed after that is gone."""

    def __init__(self, step: StaticStep) -> None:
        self.step, self.replays = step, 0
        self.storage = step.cache.keys

    def replay(self) -> None:
        assert self.step.cache.keys is self.storage, "replayed a graph over a cache storage that is gone"
        self.replays += 1
        for recorded, fresh in zip(self.step.outputs, self.step.compute()):
            recorded.copy_(fresh)


def record_by_recomputing(step: StaticStep, pool) -> tuple[torch.Tensor, torch.Tensor]:
    outputs = step.compute()
    step.outputs = tuple(tensor.clone() for tensor in outputs)
    step.graph = RecomputingGraph(step)
    return outputs


@pytest.fixture
def replaying(monkeypatch):
    """A function that makes a fixed-step runner record its steps and replay them (on a CPU)."""
    monkeypatch.setattr(StaticStep, "record", record_by_recomputing)

    def replaying(runner):
        runner.fixed_steps = FixedSteps(runner.decoder, runner.cache, capture=True)
        return runner
    return replaying


def replays(runner) -> int:
    """How many steps the runner replayed."""
    return sum(step.graph.replays for step in runner.fixed_steps.steps.values() if step.graph is not None)
