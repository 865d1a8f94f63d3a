"""Adaptive k (`--k auto`): each step's maximum draft length from what the last steps measured.

Leviathan et al. 2022 (arXiv 2211.17192, section 3.5 and Figure 3) give the best k
for a known acceptance rate and cost ratio c; neither is known in advance, and
acceptance moves from prompt to prompt and within one answer. So after every
step the engine tells an AdaptiveK what happened, and before the next one asks it for k:

  acceptance  per request and per draft position j: the rate at which draft j is
              accepted when drafts 0..j-1 were (a conditional rate; acceptance is
              bursty, so these rise with j where Leviathan's model has one i.i.d.
              alpha). Counted with exponentially decaying weights, so recent steps
              count most, and shrunk towards the engine's rates over all requests
              (which a new request starts from). The engine's rate at j is in turn
              shrunk towards its rate at j - 1, and its counts fade slowly: a deep
              position that was tried a few times and failed, and that k then stopped
              reaching, drifts back to the shallower rate and gets tried again,
              instead of being written off at 0 for good;
  costs       per engine (they belong to the models and the machine): the
              proposer's time to draft k tokens and the target's time to verify
              n tokens (per k or n where measured, a straight line elsewhere: a
              draft model's step has a fixed part, catching up on the tokens it
              has not seen, and a part per drafted token).
              Both are medians over the last steps, not means: a
              request's first step carries the draft's prefill of the whole prompt
              (ten times a draft step on the embedded pair), and one such outlier
              in a mean held k at 1 for twenty steps;
  catch-up    a draft model reads a long prompt in chunks before it can draft (its own
              prefill, draft_model.py), a cost plain decoding never pays. Once per
              request, before that reading starts, the controller weighs it: the
              time drafting is predicted to save over the request's remaining tokens
              against the reading's predicted time (seconds per token measured on
              earlier catch-ups). Where the saving is smaller the request decodes
              plainly from the start, exploration included: speculation that cannot
              pay back its draft's prefill is not begun;
  k           planning/theory.py's best_k: the argmax over k of predicted tokens/s,
              expected tokens (Equation 1, per-position rates) / (draft_s(k) + verify_s(k + 1)),
              k = 0 (plain decoding) included once a few drafted steps are measured:
              where no k is predicted to beat a plain step, the engine decodes plainly,
              and after `explore_every` such steps it drafts one token, so the rates
              can recover when the text changes. One token is the cheapest probe (on
              an AVX2 CPU, where verifying 5 tokens costs 2x a step, probing with 4
              cost ~20% of plain decoding's speed on prose); each probe that does not
              bring drafting back doubles the gap, up to `max_explore_every`;
  slow start  a request's k is capped, 2 at its first drafted step, doubling after each
              step whose drafts were all accepted (TCP's slow start): the rates a new
              request starts from are other requests' (code, say), and on an AVX2 CPU
              one wrong first guess of 7 drafts cost ~8 plain steps on a prose answer.

This only changes how many tokens are proposed, never how they are verified, so
speculation stays exactly as lossless as with a fixed k (tests pin it).
"""

from __future__ import annotations

from collections import deque

from specdec.planning.costs import RecentTimes
from specdec.planning.theory import best_k, expected_tokens_from_rates


class AdaptiveK:
    """Chooses the next step's maximum k; one per engine.

    >>> controller = AdaptiveK(max_k=8)
    >>> controller.start_request()
    >>> k = controller.next_k()                  # min(start_k, 2) until costs are measured (slow start)
    >>> controller.record(drafted=k, accepted=2, draft_s=0.04, verified_tokens=k + 1, verify_s=0.30)
    >>> 1 <= controller.next_k() <= 8
    True
    """

    def __init__(self, max_k: int = 8, start_k: int = 4, decay: float = 0.85, engine_decay: float = 0.995,
                 cost_window: int = 32, prior_weight: float = 2.0, prior_rate: float = 0.5,
                 explore_every: int = 8, max_explore_every: int = 64, ramp_start: int = 2) -> None:
        if isinstance(max_k, bool) or not isinstance(max_k, int) or max_k < 1:
            raise ValueError(f"max_k must be an integer >= 1, got {max_k!r}")
        if not all(0 < d < 1 for d in (decay, engine_decay)):
            raise ValueError("decay and engine_decay must lie in (0, 1)")
        self.max_k = max_k
        self.start_k = min(start_k, max_k)
        self.decay = decay  # per step, this request's counts
        self.engine_decay = engine_decay  # per step, the engine-wide counts (half-life ~140 steps)
        self.prior_weight = prior_weight  # trials a prior is worth, per position
        self.prior_rate = prior_rate  # the engine's rate at position 0 before anything is measured
        self.explore_every = explore_every  # plain steps in a row before drafting is tried again
        self.max_explore_every = max(max_explore_every, explore_every)  # the gap doubles up to this
        self._explore_gap = explore_every
        self.ramp_start = max(1, ramp_start)
        self._ramp = self.ramp_start  # this request's cap on k (slow start)
        self.min_draft_samples = 3  # drafted steps measured before plain decoding may be chosen
        self._plain_in_a_row = 0
        self._plain_request = False  # this request decodes plainly: its catch-up would not pay
        self._drafted_in_request = False
        # Engine-wide: costs, and acceptance counts per position over every request (the prior).
        self._draft_s = RecentTimes(cost_window)  # the proposer's seconds for a step, x = tokens drafted
        self._verify_s = RecentTimes(cost_window)  # seconds to verify n tokens, x = n
        self._catch_up: deque[tuple[int, float]] = deque(maxlen=cost_window)  # (tokens read, seconds)
        self._all_tried = [0.0] * max_k
        self._all_accepted = [0.0] * max_k
        # This request, decayed.
        self._tried = [0.0] * max_k
        self._accepted = [0.0] * max_k

    def rates(self) -> list[float]:
        """P(draft j accepted | drafts before it accepted), j = 0..max_k-1, for this request now.

        Two shrinkage steps, each (hits + w x prior) / (trials + w): the engine's rate
        at j towards its rate at j - 1 (prior_rate at j = 0), and this request's rate
        towards the engine's. A position with no trials takes its prior whole.
        """
        rates, engine_rate, w = [], self.prior_rate, self.prior_weight
        for j in range(self.max_k):
            engine_rate = (self._all_accepted[j] + w * engine_rate) / (self._all_tried[j] + w)
            rates.append((self._accepted[j] + w * engine_rate) / (self._tried[j] + w))
        return rates

    def start_request(self) -> None:
        self._tried = [0.0] * self.max_k
        self._accepted = [0.0] * self.max_k
        self._plain_request = self._drafted_in_request = False
        self._plain_in_a_row, self._explore_gap, self._ramp = 0, self.explore_every, self.ramp_start

    def next_k(self, catch_up_tokens: int = 0, remaining_tokens: int | None = None) -> int:
        """The next step's maximum k (0: a plain step).

        catch_up_tokens: committed tokens the proposer has not read yet (Proposer.unread_tokens;
        a draft model's prefill at a request's start); remaining_tokens: what the request may
        still emit. Both only matter before the request's first drafted step.
        """
        if self._plain_request:
            return 0
        draft, verify = self._draft_s.predictor(), self._verify_s.predictor()
        if draft is None or verify is None:
            return min(self.start_k, self._ramp)  # nothing measured yet
        # The step's cost: the proposer's time for k tokens (a fixed part, e.g. a draft model
        # catching up on the tokens it has not seen, plus a part per token) and verification.
        rates = self.rates()

        def step_s(k: int) -> float:
            return max((draft(k) if k else 0.0) + verify(k + 1), 1e-9)

        k = best_k(rates, 0.0, step_s, self.max_k,
                   min_k=0 if len(self._draft_s.samples) >= self.min_draft_samples else 1)
        if (k > 0 and not self._drafted_in_request and catch_up_tokens > 0 and remaining_tokens is not None
                and self._catch_up):
            # Saved: remaining tokens x (a plain step - the drafting step's seconds per token).
            saved_s = remaining_tokens * (step_s(0) - step_s(k) / expected_tokens_from_rates(rates[:k]))
            reading_s = catch_up_tokens * sum(s for _, s in self._catch_up) / sum(n for n, _ in self._catch_up)
            if saved_s < reading_s:
                self._plain_request = True
                return 0
        if k > 0:
            self._plain_in_a_row = 0
            self._explore_gap = self.explore_every
            return min(k, self._ramp)
        self._plain_in_a_row += 1
        if self._plain_in_a_row < self._explore_gap:
            return 0
        # A probe of one drafted token; the next one, if drafting still does not pay, waits twice as long.
        self._plain_in_a_row = 0
        self._explore_gap = min(2 * self._explore_gap, self.max_explore_every)
        return 1

    def record(self, *, drafted: int, accepted: int, draft_s: float, verified_tokens: int, verify_s: float,
               caught_up: int = 0) -> None:
        """One step: drafted and accepted tokens, the proposer's time, tokens verified and the target's time;
        caught_up: context tokens the proposer read in a catch-up step (it drafted nothing), whose
        time draft_s is (the catch-up's cost per token, for next_k).

        Positions 0..accepted-1 were tried and accepted; position `accepted` was
        tried and rejected if accepted < drafted; later ones were never judged.
        A draft model spends one forward per drafted token (the catch-up forward
        yields the first) plus its catch-up, an n-gram lookup almost nothing: the
        proposer's time is predicted per drafted count like verification's.
        """
        if drafted > 0:
            judged = min(accepted + 1, drafted, self.max_k)
            for j in range(self.max_k):
                self._tried[j] *= self.decay
                self._accepted[j] *= self.decay
                self._all_tried[j] *= self.engine_decay
                self._all_accepted[j] *= self.engine_decay
            for j in range(judged):
                hit = 1.0 if j < accepted else 0.0
                self._tried[j] += 1
                self._accepted[j] += hit
                self._all_tried[j] += 1
                self._all_accepted[j] += hit
            self._draft_s.add(float(drafted), draft_s)
            self._drafted_in_request = True
            if accepted == drafted:
                self._ramp = min(2 * self._ramp, self.max_k)
        elif caught_up > 0:
            self._catch_up.append((caught_up, draft_s))
        self._verify_s.add(float(verified_tokens), verify_s)
