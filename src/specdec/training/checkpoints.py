"""A training run's checkpoint: the head and its optimizer, written as one unit, resumed only as one.

The head (NAME.safetensors, what --method eagle loads; models/heads/checkpoint.py) and the
optimizer's state (AdamW's moments) are two files. A run killed between writing them used to leave
a pair from two different steps, or a truncated optimizer file, and resume trusted it. Now
(save_checkpoint):

1. Both are written under temporary names in the checkpoint's directory
   (models/atomic_files.py: temporary_path) and fsynced.
2. Both carry one checkpoint token, "step-<n>-<16 random hex digits>": the head in its metadata
   (extra["checkpoint_token"]), the optimizer in its file's name, NAME.opt-<token>.pt, and inside
   it ({"checkpoint_token", "optimizer"}). The random part tells apart two runs that reach the
   same step in the same place.
3. The optimizer is renamed to its new name (beside the old pair's, which stays whole), then the
   head over NAME.safetensors: that rename is the commit. The directory is fsynced, and only then
   are the optimizer files no head names any more deleted.

So wherever a kill lands, NAME.safetensors names an optimizer file that is complete and on disk:
before the head's rename, the old head and the old optimizer; after it, the new pair. At most one
stray optimizer file is left (the uncommitted new one, or the old one not yet deleted), and the
next save deletes it. (With one fixed optimizer name, a kill between the two renames left a head
beside another step's optimizer: 7 of 232 random kills in tests/training/test_checkpoints.py.)

On resume (resume_point) the optimizer is used only if the head names it, it loads with
weights_only=True (tensors, numbers, strings, lists, dicts: unpickling it cannot run code) and
carries the head's token inside. Otherwise (a cut or hand-copied file, one from an older specdec,
which did not write the pair as one unit) the run goes on from the head's weights and step with a
fresh optimizer and says why. Not an error, because the head is complete on its own (a rename
never leaves half a file), AdamW's moments re-estimate within a few tens of steps (beta2 = 0.95),
and an error would only make the user delete the optimizer file by hand to get the same outcome,
or start over and lose the weights. What is lost is exactness: the run no longer repeats an
uninterrupted one bit for bit, which the message says. A head file that does not load at all IS an
error: it is never overwritten silently, as it may be the only copy of a long run.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdec.models.atomic_files import fsync_directory, fsync_file, temporary_path
from specdec.models.heads import HeadConfig, LoadedHead, load_head
from specdec.models.heads.checkpoint import write_head_file

TOKEN_KEY = "checkpoint_token"


def optimizer_path(checkpoint: Path, token: str) -> Path:
    """The optimizer file of the head checkpoint NAME.safetensors whose token is `token`: NAME.opt-<token>.pt."""
    return checkpoint.with_name(f"{checkpoint.stem}.opt-{token}.pt")


def optimizer_files(checkpoint: Path) -> list[Path]:
    """Every optimizer file beside the checkpoint: NAME.opt-*.pt, and NAME.opt.pt as older specdecs named it."""
    if not checkpoint.parent.is_dir():
        return []
    return sorted(path for path in checkpoint.parent.iterdir()
                  if path.name == f"{checkpoint.stem}.opt.pt"
                  or (path.name.startswith(f"{checkpoint.stem}.opt-") and path.name.endswith(".pt")))


def save_checkpoint(checkpoint: Path, head: nn.Module, config: HeadConfig, vocab_ids: torch.Tensor, extra: dict,
                    optimizer_state: dict) -> str:
    """Write the head and its optimizer's state_dict as one unit (the module docstring's steps 1-3);
    return the checkpoint token both carry."""
    token = f"step-{int(extra.get('step', 0))}-{secrets.token_hex(8)}"
    optimizer_file = optimizer_path(checkpoint, token)
    # Fixed temporary names (not the token's), so a killed save's leftovers are overwritten, not piled up.
    head_partial = temporary_path(checkpoint)
    optimizer_partial = temporary_path(checkpoint.with_suffix(".opt.pt"))
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_head_file(head_partial, head, config, vocab_ids, {**extra, TOKEN_KEY: token})
        torch.save({TOKEN_KEY: token, "optimizer": optimizer_state}, optimizer_partial)
        fsync_file(head_partial)
        fsync_file(optimizer_partial)
    except BaseException:
        head_partial.unlink(missing_ok=True)
        optimizer_partial.unlink(missing_ok=True)
        raise
    os.replace(optimizer_partial, optimizer_file)
    os.replace(head_partial, checkpoint)  # the commit
    fsync_directory(checkpoint.parent)
    for stale in optimizer_files(checkpoint):
        if stale != optimizer_file:
            stale.unlink(missing_ok=True)
    return token


@dataclass
class ResumePoint:
    head: LoadedHead
    optimizer_state: dict | None  # the head's own optimizer's state_dict; None: start the optimizer fresh
    refused: str | None  # why no optimizer state was used (None when it was)


def resume_point(checkpoint: Path, device: torch.device | str = "cpu") -> ResumePoint | None:
    """What a run resumes from: None when there is no head checkpoint, else the head and, if it is
    the head's own, its optimizer's state (see the module docstring for why a refused optimizer
    means a fresh one, not an error). A head that does not load raises ValueError naming it."""
    if not checkpoint.is_file():
        return None
    try:
        head = load_head(checkpoint, device=device)
    except ValueError as error:
        raise ValueError(f"cannot resume from {checkpoint}: {error}. It is left as it is; delete it and its "
                         f"{checkpoint.stem}.opt-*.pt to train from scratch") from None
    token = head.extra.get(TOKEN_KEY)
    if token is None:
        return ResumePoint(head, None, f"{checkpoint} names no optimizer file (an older specdec wrote it, which did "
                                       "not write the head and its optimizer as one unit)")
    optimizer_file = optimizer_path(checkpoint, token)
    if not optimizer_file.is_file():
        return ResumePoint(head, None, f"{optimizer_file} is missing")
    try:
        saved = torch.load(optimizer_file, map_location=device, weights_only=True)
    except Exception as error:  # cut (EOFError, RuntimeError) or not plain data (UnpicklingError)
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return ResumePoint(head, None, f"{optimizer_file} does not load with weights_only=True ({first_line})")
    if not isinstance(saved, dict) or not isinstance(saved.get("optimizer"), dict):
        return ResumePoint(head, None, f"{optimizer_file} is not a specdec optimizer checkpoint")
    if saved.get(TOKEN_KEY) != token:
        return ResumePoint(head, None, f"{optimizer_file} belongs to another checkpoint ({saved.get(TOKEN_KEY)}; "
                                       f"the head's is {token}): the files were copied or renamed by hand")
    return ResumePoint(head, saved["optimizer"], None)
