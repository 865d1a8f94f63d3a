"""Method name -> proposer. The only place a method string is read."""

from __future__ import annotations

from specdec.models.runner import ModelRunner
from specdec.proposers.base import Proposer
from specdec.proposers.draft_model import DraftModelProposer

METHODS = {
    "autoregressive": "plain decoding of the target, one token per forward (Chen et al. Algorithm 1)",
    "draft": "a small draft model proposes k tokens, the target verifies them (Chen et al. Algorithm 2)",
}


def needs_draft_model(method: str) -> bool:
    check_method(method)
    return method == "draft"


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")


def build_proposer(method: str, *, draft_runner: ModelRunner | None = None) -> Proposer | None:
    """None means plain decoding: the engine then drafts nothing."""
    check_method(method)
    if method == "autoregressive":
        return None
    if draft_runner is None:
        raise ValueError(f"method {method!r} needs a draft model (--draft)")
    return DraftModelProposer(draft_runner)
