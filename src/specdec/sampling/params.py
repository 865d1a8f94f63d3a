"""Per-request sampling parameters, validated at the edge."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS, the same floor). Why greedy and not a 400:
# as T -> 0 the tempered distribution tends to the argmax's point mass, so greedy *is* what such a
# request asks for, up to float rounding. At T = 1e-5 a token whose logit is 2.3e-4 below the top
# already has probability e^-23 ~ 1e-10 of it; only near-ties (float32 logits of ~20 are 2e-6 apart at
# best) could differ. Below the floor, dividing float32 logits by T overflows (T = 1e-40: every
# logit becomes +-inf, the softmax NaN), so a sampled answer there would be noise, not the target's.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens.

    The same params warp the draft's and the target's logits (see warp.py): the
    rejection sampler is lossless with respect to the *warped* target
    distribution, so warping both sides identically is what makes
    "speculative output ~ plain output" hold for top-k / top-p sampling too.

    temperature: 0 means greedy (argmax); > 0 divides the logits. A temperature below
                 GREEDY_BELOW_TEMPERATURE (1e-5) counts as 0: the request is greedy, and
                 `temperature` reads 0.0 (see the constant for why).
    top_k:       keep the k most probable tokens; 0 disables.
    top_p:       keep the smallest set whose probability reaches top_p; 1 disables.
    min_p:       drop tokens below min_p * (top probability); 0 disables.
    seed:        seeds the request's own torch.Generator; None draws a fresh seed.
    lenience:    1 (default) = exact verification. 0 < l < 1 is LOSSY (Leviathan et al.,
                 Appendix A.5): drafts are accepted more easily, the output no longer
                 follows the target's distribution (nor, at temperature 0, its greedy output).
    typical_acceptance: False (default) = exact. True is LOSSY: Medusa's typical acceptance
                 (Cai et al. 2024, Section 2.3.1) keeps a draft when the target gives it more than
                 min(0.09, 0.3 exp(-entropy)); sampling/tree.py: typical_verify_tree. Temperature 0
                 stays greedy (exact).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    lenience: float = 1.0
    typical_acceptance: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if self.temperature < GREEDY_BELOW_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)  # frozen: normalised once, here
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = disabled), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 = disabled), got {self.top_p!r}")
        if not isinstance(self.min_p, (int, float)) or not (0.0 <= self.min_p < 1.0):
            raise ValueError(f"min_p must be in [0, 1) (0 = disabled), got {self.min_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {self.seed!r}")

        if isinstance(self.lenience, bool) or not isinstance(self.lenience, (int, float)) or not (
                0.0 < self.lenience <= 1.0):
            raise ValueError(f"lenience must be in (0, 1] (1 = exact, < 1 = lossy), got {self.lenience!r}")
        if not isinstance(self.typical_acceptance, bool):
            raise ValueError(f"typical_acceptance must be True or False, got {self.typical_acceptance!r}")
        if self.typical_acceptance and self.lenience != 1.0:
            raise ValueError("choose one lossy rule: lenience < 1 or typical_acceptance, not both")

    @property
    def exact(self) -> bool:
        """True when verification keeps the target's distribution (lenience 1, no typical acceptance)."""
        return self.lenience == 1.0 and not (self.typical_acceptance and self.temperature > 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """The request's own generator: all of its randomness flows through it."""
        generator = torch.Generator(device=device)
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        return generator
