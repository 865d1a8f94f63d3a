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
from dataclasses import dataclass, field

from specdec.planning.costs import RecentTimes
from specdec.planning.theory import expected_tokens_from_rates
from specdec.proposers.base import PROPOSER, Source

# Committed tokens a drafting row's proposer reads in a step when it also drafted in the step before:
# that step's last draft (never fed) and the target's bonus token. More is a backlog (see record).
STEADY_READ = 2


@dataclass
class _Rates:
    """Decayed trials and hits per draft position of one source: a request's, or the engine's."""

    tried: list[float]
    accepted: list[float]

    @classmethod
    def zeros(cls, positions: int) -> _Rates:
        return cls([0.0] * positions, [0.0] * positions)


@dataclass
class _Track:
    """One request's record of one source (proposers/base.py: Source)."""

    rates: _Rates
    asked: float = 0.0  # decayed: steps it was asked to draft with this source,
    proposed: float = 0.0  # and of those, steps it drafted anything (an n-gram finds no match at times)
    drafted: bool = False  # it has drafted with it: its catch-up was weighed, or needed no weighing
    drafted_last: bool = False  # it drafted with it in the last step it took part in


@dataclass
class _Row:
    """One request's state: its record of each source, its slow-start cap."""

    ramp: int
    tracks: dict[Source, _Track] = field(default_factory=dict)
    barred: set[Source] = field(default_factory=set)  # sources whose catch-up would not pay


class AdaptiveK:
    """Chooses each row's k for the next step, and where a composite proposer offers a row several
    sources, which one drafts it; one per engine.

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
        self.cost_window = cost_window
        # Per source name (Source.name): the proposer's seconds, x = the widest row's drafts; drafting steps.
        self._draft_s: dict[str, RecentTimes] = {}
        self._drafted_steps: dict[str, int] = {}
        self._verify_s = RecentTimes(cost_window)  # the target's seconds, x = the forward's tokens
        self._catch_up: deque[tuple[int, float]] = deque(maxlen=cost_window)  # (tokens read, seconds)
        self._engine_rates: dict[Source, _Rates] = {}  # every request's, per source: a new request's prior
        self._rows: dict[Hashable, _Row] = {}
        self._plain_in_a_row = 0
        self._explore_gap = explore_every
        self._probing = False  # the last choice was a probe (drafting tried after a plain streak)
        self._probe_again = False  # that probe only read the proposer's backlog: probe at the next step
        self.sources: list[Source] = []  # the source of each row of the last choice (what record() takes)

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
            self._rows[handle] = _Row(self.ramp_start)
        return self._rows[handle]

    def _track(self, row: _Row, source: Source) -> _Track:
        if source not in row.tracks:
            row.tracks[source] = _Track(_Rates.zeros(self.max_k))
        return row.tracks[source]

    def _costs(self, name: str) -> RecentTimes:
        if name not in self._draft_s:
            self._draft_s[name] = RecentTimes(self.cost_window)
        return self._draft_s[name]

    def rates(self, handle: Hashable, source: Source = PROPOSER) -> list[float]:
        """P(draft j accepted | drafts before it accepted), j = 0..max_k-1, for this request's drafts
        from `source` now.

        Two shrinkage steps, each (hits + w x prior) / (trials + w). The engine's rate at j is shrunk
        towards its rate at j - 1 (prior_rate at j = 0), so a deep position tried a few times drifts
        back and is tried again. This request's rate at j is shrunk towards the engine's at j = 0,
        and deeper towards its own rate at j - 1 times the engine's ratio of j to j - 1: the engine
        knows the draft's shape over positions, the request its own level. A request whose first
        drafts are all accepted thus tries deeper ones soon, even after requests whose drafts failed
        early and never reached them (docs/history.md, "-k auto after a plain streak"). A
        position with no trials takes its prior whole; no prior exceeds the larger of its two sources.
        """
        own = self._track(self._row(handle), source).rates
        engine = self._engine_rates.get(source) or _Rates.zeros(self.max_k)
        rates, w = [], self.prior_weight
        engine_rate = self.prior_rate
        for j in range(self.max_k):
            before = engine_rate
            engine_rate = (engine.accepted[j] + w * engine_rate) / (engine.tried[j] + w)
            prior = engine_rate if j == 0 else min(rates[-1] * engine_rate / before, max(rates[-1], engine_rate))
            rates.append((own.accepted[j] + w * prior) / (own.tried[j] + w))
        return rates

    # ---- the choice -------------------------------------------------------------------------

    def choose(self, handles: Sequence[Hashable], caps: Sequence[int], unread: Sequence[int] | None = None,
               remaining: Sequence[int] | None = None,
               sources: Sequence[Sequence[Source] | None] | None = None) -> list[int]:
        """Each row's k (0..its cap) for the next step; self.sources: each row's source for it.

        caps: what each row may draft (its remaining tokens, the context); unread: committed tokens
        each row's proposer has not read yet (a draft model's prefill, Proposer.unread_tokens);
        remaining: what each row may still emit. The last two only matter before a row first drafts
        with a source that reads a backlog. sources: the sources a composite proposer offers each
        row, its preferred first (BatchProposer.sources); None: one source.

        Where a row is offered several sources, it takes the one that alone would emit the most
        tokens a second (its own rates, each source's measured cost); a source not measured yet is
        tried first, since its first steps measure it. With one row this is the best (source, k).
        """
        self._probing = False
        asked = (caps, unread, remaining, sources)
        rows = [self._row(handle) for handle in handles]
        offered = [tuple(source for source in ((sources[b] if sources is not None else None) or (PROPOSER,))
                         if source not in row.barred) for b, row in enumerate(rows)]
        caps = [min(cap, self.max_k) if offer else 0 for offer, cap in zip(offered, caps)]
        self.sources = [offer[0] if offer else PROPOSER for offer in offered]
        verify = self._verify_s.predictor() if any(caps) else None
        if verify is None:  # nothing may draft, or a plain step is measured first: this one
            return [0] * len(caps)
        # Each proposer's cost, once per choice (a median over its recent steps; None: never measured).
        draft_s = {source.name: self._costs(source.name).predictor() for offer in offered for source in offer}
        if self._take_unmeasured(offered, caps, unread, draft_s):  # nothing drafted from it yet
            return self._capped(self.start_k, rows, caps)
        choice = _StepChoice(self, handles, rows, offered, caps, unread, verify, draft_s)
        for b, offer in enumerate(offered):
            if caps[b] and len(offer) > 1:  # ties: the preferred (earlier) source
                self.sources[b] = max(offer, key=lambda source: choice.alone_per_s(b, source))
        choice.price(self.sources)
        measured = all(self._drafted_steps.get(name, 0) >= self.min_draft_samples for name in choice.names)
        k = max(range(0 if measured else 1, self.max_k + 1), key=lambda k: (choice.tokens_per_s(k), -k))  # ties: smaller
        if k > 0 and self._bar_unpaid_backlogs(choice, k, unread, remaining):
            return self.choose(handles, *asked)  # again without them: the rows' other sources, or a plain step
        if k > 0:
            self._plain_in_a_row, self._explore_gap, self._probe_again = 0, self.explore_every, False
            return self._capped(k, rows, caps)
        return self._plain_or_probe(caps)

    def _take_unmeasured(self, offered: list, caps: Sequence[int], unread: Sequence[int] | None,
                         draft_s: dict) -> bool:
        """A source never measured is tried first (its first steps measure it), unless it would first read
        a backlog (a draft model's prompt, benchmarks/RESULTS.md, "ngram+draft: each row's source chosen
        by -k auto (issue 38, item 5)") while a measured source is on offer: that one drafts, and the new
        one waits for a step the others cannot draft. Sets self.sources where one is tried; leaves each
        row's offer its measured sources (or all, where none is). True where a row tries one."""
        unmeasured = False
        for b, offer in enumerate(offered):
            known = tuple(source for source in offer if draft_s[source.name] is not None)
            new = [source for source in offer if source not in known and not (
                known and source.reads_backlog and unread is not None and unread[b] > STEADY_READ)]
            if new and caps[b]:
                self.sources[b], unmeasured = new[0], True
            offered[b] = known or offer
        return unmeasured

    def _bar_unpaid_backlogs(self, choice: _StepChoice, k: int, unread: Sequence[int] | None,
                             remaining: Sequence[int] | None) -> bool:
        """Bar, for the rest of its request, a source that would first read a backlog (a draft model's
        prompt) which the tokens it saves over the request's remaining length do not pay for. True
        where one was barred (choose again)."""
        if not (self._catch_up and unread is not None and remaining is not None):
            return False
        barred = False
        for b, (row, source) in enumerate(zip(choice.rows, self.sources)):
            if not source.reads_backlog or self._track(row, source).drafted or not unread[b] or not choice.caps[b]:
                continue
            # Saved: remaining tokens x (seconds per token without this source: a plain step, or the
            # row's other sources - the drafting step's seconds per token), per row.
            without_s = min([choice.step_s(0)] + [1 / choice.alone_per_s(b, other)
                                                  for other in choice.offered[b] if other != source])
            saved_s = remaining[b] * (without_s - choice.step_s(k) / choice.expected(b, k)) / len(choice.rows)
            if saved_s < unread[b] * choice.catch_up_s:
                row.barred.add(source)
                barred = True
        return barred

    def _plain_or_probe(self, caps: Sequence[int]) -> list[int]:
        """Drafting does not pay this step: a plain one, or after a streak of them a probe of one
        drafted token; the next one, if drafting still does not pay, waits twice as long."""
        if self._probe_again:  # the last probe only read a backlog (a draft model far behind): go on
            self._probe_again = False
        else:
            self._plain_in_a_row += 1
            if self._plain_in_a_row < self._explore_gap:
                return [0] * len(caps)
            self._plain_in_a_row = 0
            self._explore_gap = min(2 * self._explore_gap, self.max_explore_every)
        self._probing = True
        return [min(1, cap) for cap in caps]

    @staticmethod
    def _capped(k: int, rows: Sequence[_Row], caps: Sequence[int]) -> list[int]:
        return [min(k, cap, row.ramp) for row, cap in zip(rows, caps)]

    # ---- what the engine reports ------------------------------------------------------------

    def record(self, handles: Sequence[Hashable], asked: Sequence[int], drafted: Sequence[int],
               accepted: Sequence[int], *, draft_s: float, tokens: int, verify_s: float, caught_up: int = 0,
               sources: Sequence[Source] | None = None) -> None:
        """One step: each row's k (asked), drafts and accepted drafts, the proposer's time, the forward's tokens
        (every row's root, drafts, padding, lookahead window) and the target's time for the forward and
        verification; caught_up: committed tokens the proposer read this step (a draft model's
        catch-up; draft_s includes their time); sources: the source each row drafted from (the
        choice's self.sources; None: one source).

        Row b's positions 0..accepted-1 were tried and accepted; position `accepted` was tried and
        rejected if accepted < drafted; later ones were never judged.

        The proposer's time goes to one of two accounts. A step in which a row drafts again after
        steps without drafting (a request's first, the end of a plain streak: a probe) carries that
        row's backlog, the tokens committed while its draft model did not read; this is the cost of
        leaving plain decoding, once, not of drafting. Kept with the drafting costs, the probes'
        backlog made drafting look several times dearer than it is whenever a request decoded
        plainly for a while, so one request with a poor draft held the next ones plain
        (docs/history.md, "-k auto after a plain streak"). Such a step's time beyond the drafting
        cost goes to the catch-up account; a step in which nothing was drafted is all catch-up. The
        drafting cost is kept per source name, under the widest row's source.
        """
        used = list(sources) if sources is not None else [PROPOSER] * len(handles)
        resumed = False  # some row drafts from a source it did not draft from in its last step
        asking = 0
        for handle, source, row_asked, row_drafted, row_accepted in zip(handles, used, asked, drafted, accepted):
            row = self._row(handle)
            track = self._track(row, source)
            if row_asked > 0:
                asking += 1
                resumed |= row_drafted > 0 and not track.drafted_last
                track.asked = track.asked * self.decay + 1
                track.proposed = track.proposed * self.decay + (row_drafted > 0)
            for other in row.tracks.values():
                other.drafted_last = False
            track.drafted_last = row_drafted > 0
            if row_drafted > 0:
                self._record_acceptance(row, source, row_drafted, row_accepted)
        backlog = resumed and caught_up > STEADY_READ * asking
        widest = max(drafted, default=0)
        if widest > 0:
            name = used[list(drafted).index(widest)].name
            self._drafted_steps[name] = self._drafted_steps.get(name, 0) + 1
            costs = self._costs(name)
            if not backlog:
                costs.add(float(widest), draft_s)
            elif (steady := costs.predictor()) is not None:
                self._catch_up.append((caught_up, max(0.0, draft_s - steady(widest))))
        elif caught_up > 0:
            self._catch_up.append((caught_up, draft_s))
            self._probe_again = self._probing  # a probe that drafted nothing has told nothing yet
        self._verify_s.add(float(tokens), verify_s)

    def _record_acceptance(self, row: _Row, source: Source, drafted: int, accepted: int) -> None:
        own = self._track(row, source)
        engine = self._engine_rates.setdefault(source, _Rates.zeros(self.max_k))
        judged = min(accepted + 1, drafted, self.max_k)
        for j in range(self.max_k):
            own.rates.tried[j] *= self.decay
            own.rates.accepted[j] *= self.decay
            engine.tried[j] *= self.engine_decay
            engine.accepted[j] *= self.engine_decay
        for j in range(judged):
            hit = 1.0 if j < accepted else 0.0
            own.rates.tried[j] += 1
            own.rates.accepted[j] += hit
            engine.tried[j] += 1
            engine.accepted[j] += hit
        own.drafted = True
        if accepted == drafted:
            row.ramp = min(2 * row.ramp, self.max_k)


class _StepChoice:
    """One choice's prices (AdaptiveK.choose): each row's tokens per second with each source alone,
    and, once the rows' sources are chosen (price()), the whole step's tokens per second at each k."""

    def __init__(self, controller: AdaptiveK, handles: Sequence[Hashable], rows: list[_Row], offered: list,
                 caps: list[int], unread: Sequence[int] | None, verify, draft_s: dict) -> None:
        self.controller, self.handles, self.rows, self.offered, self.caps = controller, handles, rows, offered, caps
        self.unread, self.verify, self.draft_s = unread, verify, draft_s
        self.extra = controller.extra_tokens
        catch_up = controller._catch_up
        self.catch_up_s = sum(s for _, s in catch_up) / sum(n for n, _ in catch_up) if catch_up else 0.0

    def proposes(self, row: _Row, source: Source) -> float:
        track = self.controller._track(row, source)
        return (track.proposed + 1) / (track.asked + 1)

    def switch_s(self, b: int, source: Source) -> float:
        """Going back to a source that reads a backlog (a draft model, after steps the lookup drafted)
        first reads what the other source committed: counted in the step that switches, so a row
        does not flip between two sources of about the same speed, paying a catch-up each time."""
        if (len(self.offered[b]) < 2 or not source.reads_backlog or self.unread is None
                or not self.controller._track(self.rows[b], source).drafted):
            return 0.0
        return max(0, self.unread[b] - STEADY_READ) * self.catch_up_s

    def alone_per_s(self, b: int, source: Source) -> float:
        rates = self.controller.rates(self.handles[b], source)
        p, draft, switch = self.proposes(self.rows[b], source), self.draft_s[source.name], self.switch_s(b, source)
        verify, extra = self.verify, self.extra
        return max((1 - p + p * expected_tokens_from_rates(rates[:k])) /
                   ((1 - p) * verify(1) + p * (draft(k) + switch + verify(k + 1 + extra)))
                   for k in range(1, self.caps[b] + 1))

    def price(self, sources: Sequence[Source]) -> None:
        """The rows' chosen sources: what the whole step costs and yields at each k follows."""
        caps = self.caps
        self.names = {source.name for source, cap in zip(sources, caps) if cap}
        self.drafts = [self.draft_s[name] for name in self.names]
        self.rates = [self.controller.rates(handle, source) for handle, source in zip(self.handles, sources)]
        self.switch = max((self.switch_s(b, source) for b, source in enumerate(sources) if caps[b]), default=0.0)
        # A row asked to draft proposes something with probability p_b: else it commits one token, and
        # where no row proposes the forward is a plain one; where any does, every row pays its width.
        self.p_propose = [self.proposes(row, source) if cap else 0.0
                          for row, source, cap in zip(self.rows, sources, caps)]
        self.none_proposes = math.prod(1 - p for p in self.p_propose)

    def step_s(self, k: int) -> float:
        widest = max(min(k, cap) for cap in self.caps)
        tokens = len(self.rows) * (widest + 1 + (self.extra if widest else 0))
        return max((sum(draft(widest) for draft in self.drafts) + self.switch if widest else 0.0)
                   + self.verify(tokens), 1e-9)

    def expected(self, b: int, k: int) -> float:
        return expected_tokens_from_rates(self.rates[b][:min(k, self.caps[b])])

    def tokens_per_s(self, k: int) -> float:
        if k == 0:
            return len(self.rows) / self.step_s(0)
        tokens = sum(1 - p + p * self.expected(b, k) for b, p in enumerate(self.p_propose))
        return tokens / (self.none_proposes * self.step_s(0) + (1 - self.none_proposes) * self.step_s(k))

