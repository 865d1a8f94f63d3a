"""A head and its optimizer are written as one unit and resumed only as one (training/checkpoints.py):
a run killed at any moment leaves the last whole checkpoint, which resume trusts, or a pair it
refuses; damaged, foreign and malicious optimizer files are refused; a cut head is a clear error.

The runs are a tiny EAGLE head's, checkpointing every step (checkpoint_jobs.py); the kills are real
SIGKILLs of forked training processes (tests/killing.py)."""

from __future__ import annotations

import pickle
import random
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_jobs import HEAD_FILE, STEPS, train_tiny_head
from killing import Killer

from specdec.models.atomic_files import temporary_path
from specdec.models.heads import load_head, save_head
from specdec.training.checkpoints import optimizer_files, optimizer_path, resume_point, save_checkpoint

JOBS = Path(__file__).with_name("checkpoint_jobs.py")


class Stop(Exception):
    pass


def stop_at(step: int):
    """A log callback that stops the run right after its step-`step` checkpoint (train_head logs after saving)."""
    def log(message: str) -> None:
        if message.startswith(f"step {step}:"):
            raise Stop(message)
    return log


def own_optimizer(path: Path) -> Path:
    """The optimizer file the head at `path` names."""
    return optimizer_path(path, load_head(path).extra["checkpoint_token"])


def same(a, b) -> bool:
    """Equal state: tensors bit for bit, containers element by element."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return a == b


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, tuple[dict, dict]]:
    """An uninterrupted run's checkpoint after every step: step -> (head weights, optimizer state),
    each read back through resume_point the moment it was written."""
    path = tmp_path_factory.mktemp("reference") / HEAD_FILE
    states = {}

    def snapshot(message: str) -> None:
        point = resume_point(path)
        assert point.refused is None, point.refused  # every checkpoint a run writes is one it resumes from
        states[point.head.extra["step"]] = (point.head.module.state_dict(), point.optimizer_state)

    train_tiny_head(path.parent, log=snapshot)
    assert sorted(states) == list(range(1, STEPS + 1))
    return states


def test_every_checkpoint_is_a_matching_pair_that_loads_weights_only(reference):
    for step, (_, optimizer_state) in reference.items():
        # AdamW's own count of its steps: the optimizer state is the head's step's, not a neighbour's
        assert all(int(state["step"]) == step for state in optimizer_state["state"].values())
        assert optimizer_state["param_groups"][0]["betas"] == (0.9, 0.95)  # tuples survive weights_only


def test_a_kill_at_any_moment_leaves_a_checkpoint_resume_can_trust(reference, tmp_path):
    """SIGKILL training runs after seeded random delays (within an uninterrupted run's time), then:
    what is on disk is nothing, or exactly the uninterrupted run's checkpoint of its step, head and
    optimizer both (the head always names a whole optimizer file); and resuming from it ends on the
    uninterrupted run's final weights, leaving the head and its optimizer file alone."""
    temporary = {temporary_path(Path(HEAD_FILE)).name, temporary_path(Path(HEAD_FILE).with_suffix(".opt.pt")).name}
    outcomes = []
    with Killer(JOBS, "train_tiny_head", tmp_path) as killer:
        whole = killer.run(tmp_path / "whole")
        assert whole["exit_codes"] == [0], killer.stderr()
        delays = [random.Random(59 + attempt).uniform(0.0, whole["seconds"]) for attempt in range(8)]
        for attempt, delay in enumerate(delays):
            directory = tmp_path / f"killed-{attempt}"
            answer = killer.run(directory, kill_after=delay)
            assert answer["exit_codes"] in ([0], [-9]), killer.stderr()
            path = directory / HEAD_FILE
            strays = {entry.name for entry in directory.iterdir()} - {HEAD_FILE} - temporary
            assert {entry.name for entry in optimizer_files(path)} == strays and len(strays) <= 2

            point = resume_point(path)
            if point is None:
                assert not path.exists()
                outcomes.append("nothing")
            else:
                step = point.head.extra["step"]
                assert point.refused is None, point.refused
                assert same(point.head.module.state_dict(), reference[step][0]), step
                assert same(point.optimizer_state, reference[step][1]), step
                outcomes.append(f"step {step}")

            train_tiny_head(directory)
            assert {entry.name for entry in directory.iterdir()} == {HEAD_FILE, own_optimizer(path).name}
            assert same(load_head(path).module.state_dict(), reference[STEPS][0])
    assert len(outcomes) == len(delays)


@pytest.mark.parametrize("damage", ["another run's", "cut", "not specdec's", "missing", "older specdec"])
def test_an_optimizer_that_is_not_the_heads_own_is_refused_and_the_run_goes_on(damage, reference, tmp_path):
    path = tmp_path / "run" / HEAD_FILE
    with pytest.raises(Stop):
        train_tiny_head(path.parent, log=stop_at(5))
    optimizer_file = own_optimizer(path)
    if damage == "another run's":  # copied over by hand
        with pytest.raises(Stop):
            train_tiny_head(tmp_path / "other", log=stop_at(7))
        shutil.copy(own_optimizer(tmp_path / "other" / HEAD_FILE), optimizer_file)
    elif damage == "cut":
        optimizer_file.write_bytes(optimizer_file.read_bytes()[: optimizer_file.stat().st_size // 2])
    elif damage == "not specdec's":
        torch.save(reference[5][1], optimizer_file)  # a bare state_dict
    elif damage == "missing":
        optimizer_file.unlink()
    else:  # what specdec wrote before the pair was one unit: no token in the head, NAME.opt.pt beside it
        point = resume_point(path)
        extra = {key: value for key, value in point.head.extra.items() if key != "checkpoint_token"}
        save_head(path, point.head.module, point.head.config, point.head.vocab_ids, extra)
        optimizer_file.rename(path.with_suffix(".opt.pt"))
        optimizer_file = path.with_suffix(".opt.pt")

    point = resume_point(path)
    assert same(point.head.module.state_dict(), reference[5][0]) and point.optimizer_state is None
    expected = {"another run's": "belongs to another checkpoint", "cut": "does not load with weights_only=True",
                "not specdec's": "is not a specdec optimizer checkpoint", "missing": "is missing",
                "older specdec": "names no optimizer file"}[damage]
    assert expected in point.refused
    assert str(path if damage == "older specdec" else optimizer_file) in point.refused

    messages = []
    train_tiny_head(path.parent, log=messages.append)
    assert messages[0].startswith("resuming head.safetensors at step 5/16 with a fresh optimizer")
    assert expected in messages[0] and "not repeat an uninterrupted one exactly" in messages[0]
    assert load_head(path).extra["step"] == STEPS
    assert resume_point(path).refused is None  # the next checkpoint is a whole pair again ...
    assert optimizer_files(path) == [own_optimizer(path)]  # ... and the refused file is gone


def test_a_cut_head_is_a_clear_error_and_is_left_alone(tmp_path):
    path = tmp_path / HEAD_FILE
    with pytest.raises(Stop):
        train_tiny_head(tmp_path, log=stop_at(3))
    cut = path.read_bytes()[:-100]
    path.write_bytes(cut)
    with pytest.raises(ValueError, match=r"cannot resume from .*head.safetensors.*truncated or damaged.*"
                                         r"delete it and its head.opt-\*.pt to train from scratch"):
        train_tiny_head(tmp_path)
    assert path.read_bytes() == cut  # never overwritten: it may be a long run's only copy


class _RunsCode:
    """A pickle payload: unpickling it calls exec, as a malicious .opt.pt would."""

    def __init__(self, proof: Path) -> None:
        self.proof = proof

    def __reduce__(self):
        return exec, (f"open({str(self.proof)!r}, 'w').write('ran')",)


def test_a_malicious_optimizer_file_is_refused_without_running_it(reference, tmp_path):
    path = tmp_path / HEAD_FILE
    with pytest.raises(Stop):
        train_tiny_head(tmp_path, log=stop_at(4))
    token = load_head(path).extra["checkpoint_token"]
    proof = tmp_path / "payload-ran"
    torch.save({"checkpoint_token": token, "optimizer": _RunsCode(proof)}, own_optimizer(path))

    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torch.load(own_optimizer(path), weights_only=True)
    point = resume_point(path)
    assert point.optimizer_state is None and "does not load with weights_only=True" in point.refused
    assert not proof.exists()
    messages = []
    train_tiny_head(tmp_path, log=messages.append)
    assert "fresh optimizer" in messages[0] and not proof.exists()

    # The payload is real: the unsafe load (what train_head did before) runs it.
    hostile = tmp_path / "hostile.pt"
    torch.save(_RunsCode(proof), hostile)
    torch.load(hostile, weights_only=False)
    assert proof.read_text() == "ran"


def test_a_failed_save_keeps_the_previous_pair(reference, tmp_path):
    """An error while writing (a full disk, say) leaves the last pair and no temporary files."""
    path = tmp_path / HEAD_FILE
    with pytest.raises(Stop):
        train_tiny_head(tmp_path, log=stop_at(2))
    before = {name: (tmp_path / name).read_bytes() for name in (HEAD_FILE, own_optimizer(path).name)}
    point = resume_point(path)
    unpicklable = {"state": {}, "param_groups": [{"params": [0], "lambda": lambda: None}]}
    with pytest.raises(Exception):
        save_checkpoint(path, point.head.module, point.head.config, point.head.vocab_ids, {"step": 3}, unpicklable)
    assert {entry.name: entry.read_bytes() for entry in tmp_path.iterdir()} == before
