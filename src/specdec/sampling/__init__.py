"""Pure tensor math for sampling and verification; imports only torch."""

from specdec.sampling.params import SamplingParams
from specdec.sampling.rejection import (
    VerifyResult,
    acceptance_probs,
    greedy_verify,
    lenient_greedy_verify,
    recovery_probs,
    rejection_sample,
)
from specdec.sampling.warp import warp_logits

__all__ = [
    "SamplingParams",
    "VerifyResult",
    "acceptance_probs",
    "greedy_verify",
    "lenient_greedy_verify",
    "recovery_probs",
    "rejection_sample",
    "warp_logits",
]
