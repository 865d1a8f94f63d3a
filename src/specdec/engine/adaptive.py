"""Adaptive k (`-k auto`): each step's draft length per row, from what the last steps measured.

One controller for both engines: SpecEngine asks it about one row, BatchEngine about all of its
rows (docs/adaptive-k.md says why each rule is there and what it measured). Before every step it
chooses the k that maximises predicted tokens per second over the whole step,

    sum_b E_b(min(k, cap_b)) / (draft_s(k) + verify_s(the forward's tokens)),

k = 0 (a plain step) included. E_b is Leviathan et al.'s Equation 1 (arXiv 2211.17192) with one
conditional acceptance rate per draft position (acceptance is bursty), per row, shrunk towards the
engine's rates over all requests (deeper positions: towards the row's own rate one position up, in the
engine's shape). The costs are medians of this engine's own steps (planning/costs.py): the target's by
the tokens in its forward, whatever the rows (a CPU forward costs about the same for 4 rows of 1 token
as for 1 row of 4), the proposer's by the drafts of the widest row (one draft forward per position,
whatever the rows), a draft model's backlog after steps without drafting kept apart. The verify forward is rectangular, so only the widest
row's drafts count, as in SmartSpec's goodput (Liu et al. 2024, arXiv 2406.14066). A row asked to draft
may propose nothing (an n-gram without a match): it then commits one token, and where no row proposes,
the forward is a plain one; each row's rate of proposing weighs both. Around that choice:
  - plain streaks end with a one-token probe, each fruitless probe doubling the wait;
  - a request starts slowly (k <= 2, doubling after each fully accepted step: TCP's slow start);
  - a draft model's prefill of a prompt is begun only where drafting is predicted to pay it back.
It only changes how many tokens are proposed, never how they are verified, so output stays exactly
what it is with a fixed k (tests pin it).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from specdec.planning.costs import RecentTimes
from specdec.planning.theory import expected_tokens_from_rates

# Committed tokens a drafting row's proposer reads in a step when it also drafted in the step before:
# that step's last draft (never fed) and the target's bonus token. More is a backlog (see record).
STEADY_READ = 2


@dataclass
class _Row:
    """One request's state: decayed trials and hits per draft position, its slow-start cap."""

    tried: list[float]
    accepted: list[float]
    ramp: int
    asked: float = 0.0  # decayed: steps it was asked to draft,
    proposed: float = 0.0  # and of those, steps it drafted anything (an n-gram finds no match at times)
    drafted: bool = False  # it has drafted: its catch-up was weighed, or needed no weighing
    plain: bool = False  # its catch-up would not pay: it decodes plainly to the end
    drafted_last: bool = False  # it drafted in the last step it took part in


class AdaptiveK:
    """Chooses each row's k for the next step; one per engine.

    >>> controller = AdaptiveK(max_k=8)
    >>> controller.start_row("a")
    >>> controller.record(["a"], [0], [0], [0], draft_s=0.0, tokens=1, verify_s=0.30)   # a plain step
    >>> controller.choose(["a"], [8])              # no drafting measured yet: slow start
    [2]
    >>> controller.record(["a"], [2], [2], [2], draft_s=0.02, tokens=3, verify_s=0.32)
    >>> 1 <= controller.choose(["a"], [8])[0] <= 4
    True
    """

    def __init__(self, max_k: int = 8, start_k: int = 4, decay: float = 0.85, engine_decay: float = 0.995,
                 cost_window: int = 32, prior_weight: float = 2.0, prior_rate: float = 0.5,
                 explore_every: int = 8, max_explore_every: int = 64, ramp_start: int = 2,
                 extra_tokens: int = 0) -> None:
        if isinstance(max_k, bool) or not isinstance(max_k, int) or max_k < 1:
            raise ValueError(f"max_k must be an integer >= 1, got {max_k!r}")
        if not all(0 < d < 1 for d in (decay, engine_decay)):
            raise ValueError("decay and engine_decay must lie in (0, 1)")
        self.max_k = max_k
        self.start_k = min(start_k, max_k)
        self.decay = decay  # per drafted step, a request's counts
        self.engine_decay = engine_decay  # per drafted step, the engine-wide counts (half-life ~140 steps)
        self.prior_weight = prior_weight  # trials a prior is worth, per position
        self.prior_rate = prior_rate  # the engine's rate at position 0 before anything is measured
        self.explore_every = explore_every  # plain steps in a row before drafting is tried again
        self.max_explore_every = max(max_explore_every, explore_every)  # the gap doubles up to this
        self.ramp_start = max(1, ramp_start)
        # Tokens each drafting row adds to the forward besides its drafts (lookahead decoding's window).
        self.extra_tokens = extra_tokens
        self.min_draft_samples = 3  # drafted steps measured before plain decoding may be chosen
        self._draft_s = RecentTimes(cost_window)  # the proposer's seconds, x = the widest row's drafts
        self._verify_s = RecentTimes(cost_window)  # the target's seconds, x = the forward's tokens
        self._drafted_steps = 0
        self._catch_up: deque[tuple[int, float]] = deque(maxlen=cost_window)  # (tokens read, seconds)
        self._all_tried = [0.0] * max_k  # engine-wide, every request: a new request's prior
        self._all_accepted = [0.0] * max_k
        self._rows: dict[Hashable, _Row] = {}
        self._plain_in_a_row = 0
        self._explore_gap = explore_every
        self._probing = False  # the last choice was a probe (drafting tried after a plain streak)
        self._probe_again = False  # that probe only read the proposer's backlog: probe at the next step

    @classmethod
    def for_proposer(cls, max_k: int, proposer) -> AdaptiveK:
        """Both engines' `-k auto` controller: the tokens `proposer` (None: plain decoding) adds to
        each drafting row's forward besides its drafts count in the step's cost."""
        return cls(max_k, extra_tokens=proposer.extra_verify_tokens if proposer is not None else 0)

    # ---- requests ---------------------------------------------------------------------------

    def start_row(self, handle: Hashable) -> None:
        """A request begins: its own counts start empty (its rates are the engine's), and slowly.
        Where it runs alone, exploration starts over at the first gap (new text); beside others, the
        batch's plain streak goes on (requests arriving all the time would otherwise keep probing)."""
        self.forget(handle)
        if not self._rows:
            self._plain_in_a_row, self._explore_gap = 0, self.explore_every
        self._row(handle)

    def forget(self, handle: Hashable) -> None:
        """The request left."""
        self._rows.pop(handle, None)

    def _row(self, handle: Hashable) -> _Row:
        """The request's state; a handle not started yet starts now."""
        if handle not in self._rows:
            self._rows[handle] = _Row([0.0] * self.max_k, [0.0] * self.max_k, self.ramp_start)
        return self._rows[handle]

    def rates(self, handle: Hashable) -> list[float]:
        """P(draft j accepted | drafts before it accepted), j = 0..max_k-1, for this request now.

        Two shrinkage steps, each (hits + w x prior) / (trials + w). The engine's rate at j is shrunk
        towards its rate at j - 1 (prior_rate at j = 0), so a deep position tried a few times drifts
        back and is tried again. This request's rate at j is shrunk towards the engine's at j = 0,
        and deeper towards its own rate at j - 1 times the engine's ratio of j to j - 1: the engine
        knows the draft's shape over positions, the request its own level. A request whose first
        drafts are all accepted thus tries deeper ones soon, even after requests whose drafts failed
        early and never reached them (benchmarks/RESULTS.md, "-k auto after a plain streak"). A
        position with no trials takes its prior whole; no prior exceeds the larger of its two sources.
        """
        row, rates, w = self._row(handle), [], self.prior_weight
        engine_rate = self.prior_rate
        for j in range(self.max_k):
            before = engine_rate
            engine_rate = (self._all_accepted[j] + w * engine_rate) / (self._all_tried[j] + w)
            prior = engine_rate if j == 0 else min(rates[-1] * engine_rate / before, max(rates[-1], engine_rate))
            rates.append((row.accepted[j] + w * prior) / (row.tried[j] + w))
        return rates

    # ---- the choice -------------------------------------------------------------------------

    def choose(self, handles: Sequence[Hashable], caps: Sequence[int], unread: Sequence[int] | None = None,
               remaining: Sequence[int] | None = None) -> list[int]:
        """Each row's k (0..its cap) for the next step.

        caps: what each row may draft (its remaining tokens, the context); unread: committed tokens
        each row's proposer has not read yet (a draft model's prefill, Proposer.unread_tokens);
        remaining: what each row may still emit. The last two only matter before a row first drafts.
        """
        self._probing = False
        rows = [self._row(handle) for handle in handles]
        caps = [0 if row.plain else min(cap, self.max_k) for row, cap in zip(rows, caps)]
        if not any(caps):
            return [0] * len(caps)
        draft, verify = self._draft_s.predictor(), self._verify_s.predictor()
        if verify is None:
            return [0] * len(caps)  # a plain step is measured first: this one
        if draft is None:  # nothing drafted yet
            return self._capped(self.start_k, rows, caps)
        rates = [self.rates(handle) for handle in handles]

        def step_s(k: int) -> float:
            widest = max(min(k, cap) for cap in caps)
            tokens = len(rows) * (widest + 1 + (self.extra_tokens if widest else 0))
            return max((draft(widest) if widest else 0.0) + verify(tokens), 1e-9)

        def expected(b: int, k: int) -> float:
            return expected_tokens_from_rates(rates[b][:min(k, caps[b])])

        # A row asked to draft proposes something with probability p_b: else it commits one token, and
        # where no row proposes the forward is a plain one; where any does, every row pays its width.
        proposes = [(row.proposed + 1) / (row.asked + 1) if cap else 0.0 for row, cap in zip(rows, caps)]
        none_proposes = math.prod(1 - p for p in proposes)

        def tokens_per_s(k: int) -> float:
            if k == 0:
                return len(rows) / step_s(0)
            tokens = sum(1 - p + p * expected(b, k) for b, p in enumerate(proposes))
            return tokens / (none_proposes * step_s(0) + (1 - none_proposes) * step_s(k))

        min_k = 0 if self._drafted_steps >= self.min_draft_samples else 1
        k = max(range(min_k, self.max_k + 1), key=lambda k: (tokens_per_s(k), -k))  # ties: the smaller k
        if k > 0 and self._catch_up and unread is not None and remaining is not None:
            seconds_per_token = sum(s for _, s in self._catch_up) / sum(n for n, _ in self._catch_up)
            for b, row in enumerate(rows):
                if row.drafted or not unread[b] or not caps[b]:
                    continue
                # Saved: remaining tokens x (a plain step - the drafting step's seconds per token), per row.
                saved_s = remaining[b] * (step_s(0) - step_s(k) / expected(b, k)) / len(rows)
                if saved_s < unread[b] * seconds_per_token:
                    row.plain, caps[b] = True, 0
            if not any(caps):
                return [0] * len(caps)
        if k > 0:
            self._plain_in_a_row, self._explore_gap, self._probe_again = 0, self.explore_every, False
            return self._capped(k, rows, caps)
        if self._probe_again:  # the last probe only read a backlog (a draft model far behind): go on
            self._probe_again = False
        else:
            self._plain_in_a_row += 1
            if self._plain_in_a_row < self._explore_gap:
                return [0] * len(caps)
            # A probe of one drafted token; the next one, if drafting still does not pay, waits twice as long.
            self._plain_in_a_row = 0
            self._explore_gap = min(2 * self._explore_gap, self.max_explore_every)
        self._probing = True
        return [min(1, cap) for cap in caps]

    @staticmethod
    def _capped(k: int, rows: Sequence[_Row], caps: Sequence[int]) -> list[int]:
        return [min(k, cap, row.ramp) for row, cap in zip(rows, caps)]

    # ---- what the engine reports ------------------------------------------------------------

    def record(self, handles: Sequence[Hashable], asked: Sequence[int], drafted: Sequence[int],
               accepted: Sequence[int], *, draft_s: float, tokens: int, verify_s: float, caught_up: int = 0) -> None:
        """One step: each row's k (asked), drafts and accepted drafts, the proposer's time, the forward's tokens
        (every row's root, drafts, padding, lookahead window) and the target's time for the forward and
        verification; caught_up: committed tokens the proposer read this step (a draft model's
        catch-up; draft_s includes their time).

        Row b's positions 0..accepted-1 were tried and accepted; position `accepted` was tried and
        rejected if accepted < drafted; later ones were never judged.

        The proposer's time goes to one of two accounts. A step in which a row drafts again after
        steps without drafting (a request's first, the end of a plain streak: a probe) carries that
        row's backlog, the tokens committed while its draft model did not read; this is the cost of
        leaving plain decoding, once, not of drafting. Kept with the drafting costs, the probes'
        backlog made drafting look several times dearer than it is whenever a request decoded
        plainly for a while, so one request with a poor draft held the next ones plain
        (benchmarks/RESULTS.md, "-k auto after a plain streak"). Such a step's time beyond the drafting
        cost goes to the catch-up account; a step in which nothing was drafted is all catch-up.
        """
        resumed = False  # some row drafts after a step without drafting
        asking = 0
        for handle, row_asked, row_drafted, row_accepted in zip(handles, asked, drafted, accepted):
            row = self._row(handle)
            if row_asked > 0:
                asking += 1
                resumed |= row_drafted > 0 and not row.drafted_last
                row.asked = row.asked * self.decay + 1
                row.proposed = row.proposed * self.decay + (row_drafted > 0)
            row.drafted_last = row_drafted > 0
            if row_drafted > 0:
                self._record_acceptance(row, row_drafted, row_accepted)
        backlog = resumed and caught_up > STEADY_READ * asking
        widest = max(drafted, default=0)
        if widest > 0:
            self._drafted_steps += 1
            if not backlog:
                self._draft_s.add(float(widest), draft_s)
            elif (steady := self._draft_s.predictor()) is not None:
                self._catch_up.append((caught_up, max(0.0, draft_s - steady(widest))))
        elif caught_up > 0:
            self._catch_up.append((caught_up, draft_s))
            self._probe_again = self._probing  # a probe that drafted nothing has told nothing yet
        self._verify_s.add(float(tokens), verify_s)

    def _record_acceptance(self, row: _Row, drafted: int, accepted: int) -> None:
        judged = min(accepted + 1, drafted, self.max_k)
        for j in range(self.max_k):
            row.tried[j] *= self.decay
            row.accepted[j] *= self.decay
            self._all_tried[j] *= self.engine_decay
            self._all_accepted[j] *= self.engine_decay
        for j in range(judged):
            hit = 1.0 if j < accepted else 0.0
            row.tried[j] += 1
            row.accepted[j] += hit
            self._all_tried[j] += 1
            self._all_accepted[j] += hit
        row.drafted = True
        if accepted == drafted:
            row.ramp = min(2 * row.ramp, self.max_k)
