"""Per-request speculative statistics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestStats:
    """What speculation did for one request.

    mean_accepted_length (tau) = tokens emitted per target forward (1.0 for
    plain decoding); acceptance_rate = accepted draft tokens / drafted tokens.
    """

    prompt_tokens: int = 0
    prompt_tokens_reused: int = 0  # of them, cached by the previous request (SpecEngine.reuse_prefix)
    generated_tokens: int = 0
    target_forwards: int = 0  # decode steps; the prefill pass is not counted
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)  # [j] drafts proposed at position j
    accepted_per_position: list[int] = field(default_factory=list)  # [j] drafts accepted at position j
    accepted_per_step: list[int] = field(default_factory=list)  # [s] drafts accepted in decode step s
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    first_token_s: float = 0.0  # time to first token: prefill plus the step that emitted it

    def record_step(self, num_draft: int, num_accepted: int, num_emitted: int) -> None:
        self.target_forwards += 1
        self.drafted_tokens += num_draft
        self.accepted_tokens += num_accepted
        self.generated_tokens += num_emitted
        self.accepted_per_step.append(num_accepted)
        for counts, upto in ((self.drafted_per_position, num_draft), (self.accepted_per_position, num_accepted)):
            counts.extend([0] * (upto - len(counts)))
            for j in range(upto):
                counts[j] += 1

    def merge(self, other: RequestStats) -> None:
        """Add another request's counts (the server's n > 1 choices of one prompt: their totals).
        Times add up too: the total is the compute spent, not the wall time the client waited."""
        for name in ("prompt_tokens", "prompt_tokens_reused", "generated_tokens", "target_forwards", "drafted_tokens",
                     "accepted_tokens", "prefill_time_s", "decode_time_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.accepted_per_step += other.accepted_per_step
        for mine, theirs in ((self.drafted_per_position, other.drafted_per_position),
                             (self.accepted_per_position, other.accepted_per_position)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for j, count in enumerate(theirs):
                mine[j] += count

    @property
    def total_time_s(self) -> float:
        return self.prefill_time_s + self.decode_time_s

    @property
    def tokens_per_s(self) -> float:
        """End to end, prefill included: what a user waits for."""
        return self.generated_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.generated_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in ("total_time_s", "tokens_per_s", "mean_accepted_length", "acceptance_rate", "acceptance_per_position"):
            out[name] = getattr(self, name)
        return out
