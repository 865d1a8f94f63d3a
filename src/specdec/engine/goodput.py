"""Goodput-driven speculation for a batch (`specdec serve -k auto`): each step, each row's k.

A fixed k pays at one client and costs at many: on a CPU a batch fills the cores
from a few rows on, and then every rejected draft is a token of compute thrown
away (benchmarks/results/serve: 0.79x plain throughput at 16 clients). vLLM's
answer, speculative_disable_by_batch_size, switches drafting off for everyone
above N rows. SmartSpec (Liu et al. 2024, arXiv 2406.14066) instead chooses k
per step to maximise goodput, the expected committed tokens per second of the
whole batch, from each row's own acceptance; this does the same:

  acceptance  per row, Leviathan et al.'s alpha, from that request's own drafted
              and accepted tokens with exponentially decaying weights (recent steps
              count most), starting from the engine's rate over all requests;
  costs       measured, not assumed: the target's forward time as a function of
              the rows and tokens in it, t(R, T) = plain(R) + per_token (T - R),
              where plain(R) is the median of this engine's plain steps at R rows
              and per_token the median extra cost of a token in the forward; the
              proposer's time per drafted position (a draft model runs one forward
              per position for every row; copying costs about nothing);
  choice      the step's k maximising sum_b E_b(k_b) / (t_target + t_draft), with
              E_b(k) = 1 + alpha_b + ... + alpha_b^k and k_b = min(k, the row's cap:
              its remaining tokens, the context), k = 0 (plain decoding) included.
              The verify forward is rectangular ([rows, widest + 1], padded), so a row
              drafting less than the widest saves nothing: only the widest counts in
              t_target, and every row's expected tokens in the numerator. Lookahead
              decoding's window tokens (extra_tokens per row) count in t_target too.
  probes      after `explore_every` steps at k = 0 one step drafts one token, so the
              rates can recover when the text changes. Each probe that does not
              bring drafting back doubles the wait before the next, up to
              `max_explore_every` (as AdaptiveK does for one request): where drafting
              never pays (a draft model slower than its worth on this machine) the
              probes cost a fraction of a percent instead of one step in sixteen.
              A probe is one step: where a draft model must first read a row's
              prompt (a chunk per step, draft_model.py), the probe reads and the
              next one drafts. Letting probes go on until they drafted measured
              no better on the Zen 4 EPYC (draft -k auto 0.96x / 0.94x plain at
              1 / 2 clients, against 0.96x / 0.96x with one-step probes:
              benchmarks/results/serve-goodput), so the simpler rule stays.

It only chooses how many tokens each row drafts, never how they are verified, so
every row's output stays exactly what verification makes of it: greedy output
equals plain decoding's, sampled output follows the target's distribution.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass
class _RowAcceptance:
    drafted: float = 0.0  # decayed counts
    accepted: float = 0.0


def _expected_tokens(alpha: float, k: int) -> float:
    """1 + alpha + ... + alpha^k: tokens a step commits with k drafts (Leviathan et al., Equation 1)."""
    return sum(alpha ** j for j in range(k + 1))


class GoodputK:
    def __init__(self, max_k: int, *, decay: float = 0.8, prior_alpha: float = 0.6, prior_weight: float = 4.0,
                 explore_every: int = 16, max_explore_every: int = 512, window: int = 64, extra_tokens: int = 0) -> None:
        if isinstance(max_k, bool) or not isinstance(max_k, int) or max_k < 1:
            raise ValueError(f"max_k must be an integer >= 1, got {max_k!r}")
        self.max_k, self.decay, self.explore_every = max_k, decay, explore_every
        # Tokens each drafting row adds to the verify forward besides its drafts (lookahead decoding's
        # Jacobi window): they cost like drafts and commit nothing by themselves.
        self.extra_tokens = extra_tokens
        self.max_explore_every = max(explore_every, max_explore_every)
        self._explore_gap = explore_every  # idle steps before the next probe; doubles after each fruitless one
        self._engine = _RowAcceptance(prior_weight, prior_weight * prior_alpha)  # all requests: a new row's start
        self._rows: dict[Hashable, _RowAcceptance] = {}
        self._plain: dict[int, deque[float]] = {}  # rows -> recent plain step times
        self._per_token: deque[float] = deque(maxlen=window)  # extra seconds per verified draft token
        self._draft_per_position: deque[float] = deque(maxlen=window)  # proposer seconds per drafted position
        self._window = window
        self._idle_steps = 0  # consecutive steps where drafting was predicted not to pay

    # ---- what the engine reports ------------------------------------------------------------

    def record_row(self, handle: Hashable, drafted: int, accepted: int) -> None:
        """One step of one row: its drafts and how many were accepted."""
        row = self._rows.setdefault(handle, _RowAcceptance(self._engine.drafted, self._engine.accepted))
        if drafted:
            row.drafted = row.drafted * self.decay + drafted
            row.accepted = row.accepted * self.decay + accepted
            self._engine.drafted = self._engine.drafted * 0.98 + drafted
            self._engine.accepted = self._engine.accepted * 0.98 + accepted

    def record_step(self, rows: int, tokens: int, target_s: float, drafted_positions: int, propose_s: float) -> None:
        """One step: the target's forward over `rows` rows and `tokens` tokens took target_s; the
        proposer drafted `drafted_positions` positions (the widest row's drafts) in propose_s. A step
        whose proposer drafted nothing (a draft model only reading a prompt) is not a drafting cost."""
        if tokens == rows:
            self._plain.setdefault(rows, deque(maxlen=self._window)).append(target_s)
        else:
            plain = self._plain_s(rows)
            if plain is not None:
                self._per_token.append(max(0.0, target_s - plain) / (tokens - rows))
        if drafted_positions:
            self._draft_per_position.append(propose_s / drafted_positions)

    def forget(self, handle: Hashable) -> None:
        """The request left: drop its rates."""
        self._rows.pop(handle, None)

    # ---- the choice -------------------------------------------------------------------------

    def alpha(self, handle: Hashable) -> float:
        row = self._rows.get(handle, self._engine)
        return min(0.99, row.accepted / row.drafted) if row.drafted > 0 else 0.0

    def choose(self, handles: Sequence[Hashable], caps: Sequence[int]) -> list[int]:
        """Each row's k (0..cap) for the next step."""
        rows = len(handles)
        plain = self._plain_s(rows)
        if plain is None or rows == 0:  # never measured plain at this batch size: this step measures it
            return [0] * rows
        per_token = statistics.median(self._per_token) if self._per_token else plain / 4
        per_position = statistics.median(self._draft_per_position) if self._draft_per_position else 0.0
        alphas = [self.alpha(handle) for handle in handles]
        best_k, best_value = 0, rows / plain
        for k in range(1, self.max_k + 1):
            ks = [min(k, cap) for cap in caps]
            widest = max(ks)
            # The verify forward is rectangular, [rows, widest + 1]: padding costs as much as drafts.
            seconds = plain + per_token * rows * (widest + self.extra_tokens) + per_position * widest
            value = sum(_expected_tokens(alpha, kb) for alpha, kb in zip(alphas, ks)) / seconds
            if value > best_value * (1 + 1e-9):
                best_k, best_value = k, value
        if best_k == 0:
            self._idle_steps += 1
            if self._idle_steps >= self._explore_gap:  # probe with one draft so the rates can recover
                self._idle_steps, best_k = 0, 1
                self._explore_gap = min(2 * self._explore_gap, self.max_explore_every)  # if it brings nothing back
        else:
            self._idle_steps = 0
            self._explore_gap = self.explore_every
        return [min(best_k, cap) for cap in caps]

    def _plain_s(self, rows: int) -> float | None:
        """The median plain step at this many rows; None until one was measured (choose() then
        returns k = 0 for every row: that step measures it)."""
        times = self._plain.get(rows)
        return statistics.median(times) if times else None
