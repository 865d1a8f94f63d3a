"""Where a draft model's chain stops under -k auto: a fixed confidence threshold, or a learned rule.

ConfidenceStop is transformers' assistant_confidence_threshold: stop after the first token drawn
with a probability below the threshold. LearnedStop estimates each drafted token's chance of
acceptance given that the tokens before it were accepted,
    C_i = sigmoid(b + w . x_i),  x_i = (the token's probability, the distribution's second highest,
                                        its entropy, log(i + 1)),
the seeds' C_i = FFN(top-k probabilities, entropy, position) without a hidden layer, and stops as
SpecDec++ does (Huang et al. 2024, arXiv 2405.19715, Section 3): once the chance that the whole
chain is accepted, prod_{j <= i} C_j, falls below `keep`. `benchmarks/draft_stop_rule.py` fits
it on recorded greedy answers and chooses `keep` on this machine's costs.

`--draft-stop` chooses: `threshold` (ConfidenceStop at --draft-confidence, the default), `learned` (the
rule that ships in data/draft_stop_rule.json, fitted for the 0.5B Qwen2.5-Coder draft) or a rule file
the benchmark wrote (stop_rule_named).

Both read only the draft's own distribution (the one the token was drawn from: the warped one when
sampling, the unwarped softmax when greedy), never the target's, so whatever they decide,
verification stays exact.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import torch

STOP_RULES = ("threshold", "learned")  # or a rule file's path
SHIPPED_RULE = "draft_stop_rule.json"
STOP_FEATURES = ("token probability", "second probability", "entropy", "log position")


def distribution_features(probs: torch.Tensor) -> torch.Tensor:
    """probs [..., V] -> [..., 3]: the highest probability, the second highest, the entropy (nats)."""
    top = torch.topk(probs, 2, dim=-1).values
    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
    return torch.cat([top, entropy[..., None]], dim=-1)


def stop_features(probs: torch.Tensor, token: int, position: int) -> list[float]:
    """x_i for the token drawn at chain position `position` (0 = the first) from probs [V]."""
    _, second, entropy = distribution_features(probs).tolist()
    return [float(probs[token]), second, entropy, math.log(position + 1)]


@dataclass(frozen=True)
class ConfidenceStop:
    threshold: float

    def stops(self, probs: torch.Tensor, token: int, position: int, survival: float) -> tuple[bool, float]:
        """(stop after this token, the chain's running state)."""
        return float(probs[token]) < self.threshold, survival  # host sync: the loop must decide


@dataclass(frozen=True)
class LearnedStop:
    """C_i over standardised features ((x - mean) / scale); stop once prod C_i < keep."""

    mean: tuple[float, ...]
    scale: tuple[float, ...]
    weights: tuple[float, ...]
    bias: float
    keep: float

    def __post_init__(self) -> None:
        sizes = {len(self.mean), len(self.scale), len(self.weights)}
        if sizes != {len(STOP_FEATURES)} or not 0.0 <= self.keep < 1.0 or min(self.scale) <= 0:
            raise ValueError(f"a learned stop rule needs {len(STOP_FEATURES)} features with scales > 0 and "
                             f"keep in [0, 1); got sizes {sorted(sizes)}, keep {self.keep}")

    def acceptance(self, features: list[float]) -> float:
        logit = self.bias + sum((x - m) / s * w for x, m, s, w in zip(features, self.mean, self.scale, self.weights))
        return 1.0 / (1.0 + math.exp(-max(-40.0, min(40.0, logit))))

    def stops(self, probs: torch.Tensor, token: int, position: int, survival: float) -> tuple[bool, float]:
        survival *= self.acceptance(stop_features(probs, token, position))
        return survival < self.keep, survival

    def to_json(self, **about) -> str:
        return json.dumps(dict(kind="draft stop rule", features=list(STOP_FEATURES), **asdict(self), **about),
                          indent=1) + "\n"

    @classmethod
    def load(cls, path: str | Path) -> LearnedStop:
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise ValueError(f"{path} is not a draft stop rule (benchmarks/draft_stop_rule.py writes one): "
                             f"{error}") from None
        return cls.from_text(text, str(path))

    @classmethod
    def from_text(cls, text: str, where: str) -> LearnedStop:
        """A rule from its JSON text (where: what to name in an error)."""
        try:
            data = json.loads(text)
            if data.get("kind") != "draft stop rule" or data.get("features") != list(STOP_FEATURES):
                raise ValueError(f"kind {data.get('kind')!r}, features {data.get('features')}")
            return cls(tuple(map(float, data["mean"])), tuple(map(float, data["scale"])),
                       tuple(map(float, data["weights"])), float(data["bias"]), float(data["keep"]))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"{where} is not a draft stop rule (benchmarks/draft_stop_rule.py writes one): "
                             f"{error}") from None


def stop_rule_named(stop: str, confidence: float) -> ConfidenceStop | LearnedStop:
    """--draft-stop's rule: "threshold" (at `confidence`), "learned" (the shipped rule) or a rule file."""
    if stop == "threshold":
        return ConfidenceStop(confidence)
    if stop == "learned":
        return LearnedStop.from_text(resources.files("specdec.data").joinpath(SHIPPED_RULE).read_text(),
                                     f"the shipped {SHIPPED_RULE}")
    return LearnedStop.load(stop)
