"""Replay recorded greedy answers through the model-free proposers, with no model: what each
would accept at every step, exactly, and the most that any method copying text could.

At temperature 0 every lossless method writes plain decoding's tokens, whatever it drafts, and a
point-mass draft (ngram, suffix) is accepted exactly as far as it agrees with them. So the greedy
answers of a `specdec bench` run (results.jsonl keeps every turn's prompt_ids and token_ids) are
all it takes to know what ngram or suffix decoding would accept, for any k and any of their
options: seconds on any machine, not the hour of a bench run. A recorded run of the same method
and fixed k checks the replay itself: its accepted tokens per step must come out the same. A draft
model's greedy chain is accepted the same way, so replay() drives it too, loaded alone, without
the target (analysis/draft_oracle.py: its forwards priced, and its oracle).

Two things follow from the same answers:
  replay        each proposer drafts from the context as the engine would give it (prompt and
                committed tokens; in a stream, earlier requests' answers reach suffix decoding's
                cache), and a draft tree's accepted length is its longest root path that the
                answer continues.
  copy ceiling  an oracle that, at each step, drafts the longest continuation of the answer
                (at most k tokens) that occurs anywhere in what was seen: this request's prompt
                and answer so far, and in a stream every earlier prompt and answer. A method
                that only copies what it has seen (ngram: the context; suffix: the context and
                earlier answers) drafts paths that occur there, so it can accept no more at any
                step, and taking the longest at every step is the fewest steps: if a span occurs,
                so does its tail, so the furthest reachable position only moves forward.

Speed follows from the step costs a machine measured (`specdec costs`: the time of a forward
over n tokens over a 1-token step): a step that drafts d tokens costs cost(1 + d)
target steps, and plain decoding one per token. The ceiling's speedup is the cheapest way
through the answer that the oracle allows (a dynamic programme over how many tokens each step
takes): no copying method, however well it scores its candidates, decodes faster on that
machine. Without a cost table every step costs one step, as verification roughly does on a GPU.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec.planning.costs import cost_ratios, interpolated
from specdec.proposers.base import Proposer, ProposeContext
from specdec.proposers.batched import BatchProposer, as_batch
from specdec.sampling.params import SamplingParams

CostFn = Callable[[int], float]  # rows of a forward -> its time in 1-token steps

COPY_CEILING = "copy ceiling"
MATCHED_CEILING = "matched ceiling"  # analysis/candidates.CopyOracles' row
NGRAM_DRAFT_ORACLE = "ngram+draft oracle"  # analysis/draft_oracle.py's row, where a draft model is replayed
YARDSTICKS = (COPY_CEILING, NGRAM_DRAFT_ORACLE)  # each replayed method's speedup is read as a share of theirs


@dataclass(frozen=True)
class RecordedTurn:
    """One greedy answer of a bench run: the tokens it was given and the tokens it wrote."""

    category: str
    question_id: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    ended_by_eos: bool  # the last token is the end of text (else the run hit max_new_tokens)


@dataclass
class TurnSteps:
    """What each decode step after the prefill drafted and accepted (the prefill writes token 0), and
    the tokens of each forward a draft model ran in it (model-free proposers run none)."""

    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    draft_reads: list[tuple[int, ...]] = field(default_factory=list)
    trees: list[bool] = field(default_factory=list)  # whether each step verified a tree (empty: chains only)


def recorded_turns(rows: Iterable[dict], method: str = "autoregressive") -> list[RecordedTurn]:
    """The temperature-0 turns of `method` (first repeat), in the order the run wrote them."""
    turns = []
    for row in rows:
        if row.get("kind") != "generation" or row["method"] != method or row["temperature"] != 0:
            continue
        if row.get("repeat", 0) != 0:
            continue
        for turn in row["turns"]:
            if "prompt_ids" not in turn or "token_ids" not in turn:
                raise ValueError("these results keep no token ids (written by an older specdec bench); rerun the bench")
            if not turn["token_ids"]:
                continue
            turns.append(RecordedTurn(row["category"], row["question_id"], tuple(turn["prompt_ids"]),
                                      tuple(turn["token_ids"]), turn.get("finish_reason") == "eos"))
    return turns


def accepted_length(tokens: Sequence[int], parents: Sequence[int] | None, truth: Sequence[int]) -> int:
    """The longest root path of a draft (a chain when parents is None) that `truth` continues."""
    if parents is None:
        parents = range(-1, len(tokens) - 1)
    depth: list[int] = []  # per node: its depth if its whole path follows the answer, else 0
    for token, parent in zip(tokens, parents):
        if parent >= 0 and depth[parent] == 0:  # an ancestor left the answer
            depth.append(0)
            continue
        d = 1 if parent < 0 else depth[parent] + 1
        depth.append(d if d <= len(truth) and truth[d - 1] == token else 0)
    return max(depth, default=0)


def _committed(accepted: int, remaining: int, ended_by_eos: bool) -> tuple[int, int]:
    """(accepted, committed) of a step with `remaining` answer tokens left, as the engine counts
    them: the step also writes the target's own next token, except where the answer ends."""
    if ended_by_eos and accepted >= remaining:  # the end of text was drafted and accepted
        return remaining, remaining
    accepted = min(accepted, remaining - 1)
    return accepted, accepted + 1


def replay(turns: Sequence[RecordedTurn], proposer: Proposer | BatchProposer, k: int, stream: bool,
           max_new_tokens: int | None = None, vocab_size: int | None = None, forwards=None) -> list[TurnSteps]:
    """Each turn's steps as the engine would run them with `proposer` at a fixed k, greedy.

    The proposer is driven as the engine's step drives it (engine/step.py): one row, each step's k
    capped by the tokens the request may still write (max_new_tokens, the bench run's; None: k as
    it is), no proposal where that cap is 0. forwards: the CountingRunner (analysis/draft_oracle.py)
    a draft model's proposer runs on; each step records the forwards it noted, for their time.
    vocab_size: the target's logits' width, which a draft model's logits are cut or padded to
    (default: one past the largest token seen, enough for a point-mass proposer).

    stream: one stream of requests (`bench --stream`, a server): a proposer that learns across
    requests (suffix decoding's end_request) keeps every earlier answer. Otherwise it forgets
    them at each new prompt, as `specdec bench` does without --stream (turns of one multi-turn
    prompt still follow each other).
    """
    if vocab_size is None:
        vocab_size = 1 + max(max(t.prompt_ids + t.output_ids) for t in turns) if turns else 1
    batch = as_batch(proposer)
    reads = [] if forwards is None else forwards.reads  # tokens of each draft forward, as they are run
    params = SamplingParams(temperature=0.0)
    results = []
    previous_question = None
    for turn in turns:
        if not stream and turn.question_id != previous_question:
            batch.forget_earlier_requests()
        previous_question = turn.question_id
        batch.start_row(0)
        answer = turn.output_ids
        context = list(turn.prompt_ids) + [answer[0]]
        steps = TurnSteps()
        position = 1
        while position < len(answer):
            reads_before = len(reads)
            # The engine's cap: k + 1 tokens must fit in what the request may still write.
            cap = k if max_new_tokens is None else min(k, max_new_tokens - position - 1)
            width, count, tokens, parents = 0, 0, [], None
            if cap >= 1:
                ctx = ProposeContext(torch.tensor([context]), params, None, vocab_size)
                proposal = batch.propose([ctx], [cap])
                width, count = proposal.token_ids.shape[1], int(proposal.num_tokens[0])
                tokens = proposal.token_ids[0, :count].tolist()
                tree = proposal.tree()
                parents = None if tree is None else tree[:count]
            accepted, committed = _committed(accepted_length(tokens, parents, answer[position:]),
                                             len(answer) - position, turn.ended_by_eos)
            if width:  # as the step: a proposal of no tokens (a draft reading its prompt) is not verified
                batch.on_verified(torch.tensor([accepted]))
            context += answer[position:position + committed]
            position += committed
            steps.drafted.append(count)
            steps.trees.append(parents is not None)
            steps.accepted.append(accepted)
            steps.draft_reads.append(tuple(reads[reads_before:]))
        batch.end_row(0, list(turn.prompt_ids), list(answer))
        results.append(steps)
    return results


class _SeenSpans:
    """Every span of at most `longest` tokens of the texts added so far, as a set of tuples."""

    def __init__(self, longest: int) -> None:
        self.longest = longest
        self.spans: set[tuple[int, ...]] = set()

    def add(self, text: Sequence[int], start: int = 0) -> None:
        """The spans of text that end at positions >= start (the earlier ones are in already)."""
        for end in range(max(start, 0), len(text)):
            for length in range(1, min(self.longest, end + 1) + 1):
                self.spans.add(tuple(text[end - length + 1:end + 1]))

    def longest_at(self, answer: Sequence[int], position: int, also: _SeenSpans | None = None) -> int:
        """The longest answer[position:position + L] (L <= longest) seen here or in `also`; a seen
        span's prefixes were seen too."""
        length = 0
        while length < self.longest and position + length < len(answer):
            span = tuple(answer[position:position + length + 1])
            if span not in self.spans and (also is None or span not in also.spans):
                break
            length += 1
        return length


def copyable_lengths(turns: Sequence[RecordedTurn], k: int, stream: bool) -> list[list[int]]:
    """Per turn and answer position p >= 1: the longest answer[p:p + L], L <= k, that occurs in this
    turn's prompt and answer[:p], or (stream) in any earlier turn's prompt or answer."""
    lengths = []
    earlier = _SeenSpans(k)
    previous_question = None
    for turn in turns:
        if not stream and turn.question_id != previous_question:
            earlier = _SeenSpans(k)
        previous_question = turn.question_id
        seen = _SeenSpans(k)  # this turn's context; the earlier turns' spans stay in `earlier`
        context = list(turn.prompt_ids) + [turn.output_ids[0]]
        seen.add(context)
        row = [0]  # position 0: the prefill's token
        for position in range(1, len(turn.output_ids)):
            row.append(seen.longest_at(turn.output_ids, position, also=earlier))
            context.append(turn.output_ids[position])
            seen.add(context, len(context) - 1)
        lengths.append(row)
        earlier.add(turn.prompt_ids)
        earlier.add(turn.output_ids)
    return lengths


def ceiling_steps(turn: RecordedTurn, lengths: Sequence[int]) -> TurnSteps:
    """The oracle's steps: each drafts, and so accepts, the longest copyable continuation."""
    steps = TurnSteps()
    position = 1
    while position < len(turn.output_ids):
        accepted, committed = _committed(lengths[position], len(turn.output_ids) - position, turn.ended_by_eos)
        steps.drafted.append(accepted)
        steps.accepted.append(accepted)
        position += committed
    return steps


def ceiling_cost(turn: RecordedTurn, lengths: Sequence[int], cost: CostFn) -> float:
    """The least decode time (in 1-token steps) of any copying method through this answer: each
    step may take 0..lengths[p] drafted tokens, all accepted, at cost(1 + drafted)."""
    return cheapest_path(turn, [(lengths, 0.0)], cost)[0]


def cheapest_path(turn: RecordedTurn, sources: Sequence[tuple[Sequence[int], float]],
                  cost: CostFn) -> tuple[float, TurnSteps]:
    """The least decode time through this answer, and its steps, when each step may draft from any
    one source: (lengths, per_token) lets a step take 0..lengths[p] of its drafted tokens, all
    accepted, at cost(1 + drafted) + drafted * per_token (a draft model's forwards; a copy's are free).

    A dynamic programme from the answer's end: the oracle that knows where each source's guesses
    stop agreeing with the answer, and picks each step's source and length to be cheapest overall."""
    n = len(turn.output_ids)
    best = [0.0] * (n + 1)
    choice = [(0, 0)] * (n + 1)  # per position: (accepted, committed) of the cheapest step from there
    for position in range(n - 1, 0, -1):
        best[position] = float("inf")
        for lengths, per_token in sources:
            for take in range(lengths[position] + 1):
                accepted, committed = _committed(take, n - position, turn.ended_by_eos)
                time = cost(1 + accepted) + accepted * per_token + best[position + committed]
                if time < best[position]:
                    best[position], choice[position] = time, (accepted, committed)
    steps = TurnSteps()
    position = 1
    while position < n:
        accepted, committed = choice[position]
        steps.drafted.append(accepted)
        steps.accepted.append(accepted)
        position += committed
    return best[1] if n > 1 else 0.0, steps


def cost_table(path: str | Path) -> tuple[CostFn, str]:
    """cost(rows) from a cost file (`specdec costs`, analysis/machine_costs.py; its first result):
    the measured ratio of an n-token forward to a 1-token step, linear between measured n and
    beyond the last two. The label names the machine the file was measured on, and the bandwidth
    its process read the weights at where the file has it (analysis/machine_costs.py: why)."""
    points, data, result = cost_ratios(path)
    where = data.get("gpu") or f"{data.get('cpu', '?')} {data.get('isa') or ''}".strip()
    read = f", weights read at {result['read_gb_s']:.0f} GB/s" if "read_gb_s" in result else ""
    return interpolated(points), f"{where}, {result.get('format', '?')}{read}"


def draft_cost_table(path: str | Path) -> tuple[CostFn, str] | None:
    """draft_cost(tokens): a draft model's forward over that many tokens in target steps, from the
    draft that `specdec costs --draft` timed in the same process as the target (its
    "draft" entry over results[0]'s 1-token step); None where the file has no draft."""
    data = json.loads(Path(path).read_text())
    if "draft" not in data:
        return None
    try:
        step = float(data["results"][0]["step_ms"]["1"])
        points = sorted((int(rows), float(ms) / step) for rows, ms in data["draft"]["step_ms"].items())
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as error:
        raise ValueError(f"{path}: its draft entry needs step_ms, and results[0] the 1-token step") from error
    if len(points) < 2:
        raise ValueError(f"{path}: the draft needs at least two measured forwards")
    return interpolated(points), f"{data['draft'].get('format', 'draft')}: {points[0][1]:.2f} of a target step"


def flat_cost(rows: int) -> float:
    """Every forward costs one step, whatever its rows: roughly a GPU's verification."""
    return 1.0


@dataclass
class Tally:
    """A category's totals: answer tokens, decode steps, drafted tokens, and decode time in steps."""

    turns: int = 0
    tokens: int = 0
    steps: int = 0
    drafted: int = 0
    time: float = 0.0

    def add(self, turn: RecordedTurn, steps: TurnSteps, time: float) -> None:
        self.turns += 1
        self.tokens += len(turn.output_ids)
        self.steps += len(steps.accepted)
        self.drafted += sum(steps.drafted)
        self.time += time

    @property
    def tau(self) -> float:  # tokens per target forward, the prefill's included (as `specdec bench`)
        return self.tokens / (self.steps + self.turns) if self.steps + self.turns else 0.0

    @property
    def speedup(self) -> float:  # decode only: plain decoding takes one step per token after the first
        return (self.tokens - self.turns) / self.time if self.time else 1.0


def step_time(steps: TurnSteps, cost: CostFn, draft_cost: CostFn | None = None,
              tree_cost: CostFn | None = None) -> float:
    """A turn's decode time in 1-token target steps: each step's verification, cost(1 + drafted) (a
    tree's tree_cost(1 + drafted) where one is given), and each draft-model forward it ran,
    draft_cost(tokens read) (None: a draft model's forwards are free)."""
    trees = steps.trees if len(steps.trees) == len(steps.drafted) else [False] * len(steps.drafted)
    verify = sum((tree_cost if tree and tree_cost else cost)(1 + d) for d, tree in zip(steps.drafted, trees))
    if draft_cost is None:
        return verify
    return verify + sum(draft_cost(tokens) for reads in steps.draft_reads for tokens in reads)


def tally(turns: Sequence[RecordedTurn], steps: Sequence[TurnSteps], cost: CostFn,
          times: Sequence[float] | None = None, draft_cost: CostFn | None = None) -> dict[str, Tally]:
    """Per category and "overall": totals; times (decode time per turn) default to step_time()."""
    totals: dict[str, Tally] = {}
    for index, (turn, turn_steps) in enumerate(zip(turns, steps)):
        time = times[index] if times is not None else step_time(turn_steps, cost, draft_cost)
        for key in (turn.category, "overall"):
            totals.setdefault(key, Tally()).add(turn, turn_steps, time)
    return totals


def recorded_steps(rows: Iterable[dict], method: str, k: int) -> list[list[int]] | None:
    """A recorded greedy run of `method` at fixed k: its accepted tokens per decode step, per turn
    (the prefill's entry dropped), in run order; None when the results hold no such run."""
    found = []
    for row in rows:
        if (row.get("kind") == "generation" and row["method"] == method and row["k"] == k
                and row["temperature"] == 0 and row.get("repeat", 0) == 0 and row.get("lenience", 1.0) == 1.0):
            found += [turn["accepted_per_step"][1:] for turn in row["turns"] if turn.get("token_ids")]
    return found or None


def _clipped_at_end(accepted: list[int], answer_length: int) -> list[int]:
    """A recorded turn's accepted tokens per step, its last step's cut to the tokens the answer had
    left: where the end of text was drafted and accepted, the engine also counts the drafts after it
    that the target happened to agree with, and the answer has no tokens there to replay."""
    if not accepted:
        return accepted
    left = answer_length - 1 - sum(a + 1 for a in accepted[:-1])
    return accepted[:-1] + [min(accepted[-1], left)]


@dataclass(frozen=True)
class ReplayRow:
    """One line of the report: a method at a k (or the copy ceiling) and its per-category tallies."""

    label: str
    k: int
    totals: dict[str, Tally]
    recorded_check: str | None = None  # "14/14 turns identical to the recorded run", where one exists
    bound: bool = False  # a ceiling or an oracle (what no method of its kind beats), not a replayed method


Oracles = Callable[[Sequence[RecordedTurn], int, list[list[int]]], list["ReplayRow"]]


def replay_rows(rows: Sequence[dict], proposers: dict[str, Callable[[], Proposer | BatchProposer]], ks: Sequence[int],
                stream: bool, cost: CostFn, *, draft_cost: CostFn | None = None, max_new_tokens: int | None = None,
                vocab_size: int | None = None, forwards=None, oracles: Oracles | None = None) -> list[ReplayRow]:
    """Every proposer at every k, then the copy ceiling at every k, over the run's greedy answers;
    then oracles(turns, k, the copy ceiling's lengths)'s rows (a draft model's: analysis/draft_oracle.py).
    draft_cost prices a draft model's forwards (None: free); max_new_tokens, vocab_size and forwards as replay()'s."""
    turns = recorded_turns(rows)
    if not turns:
        raise ValueError("the results hold no greedy plain-decoding answers (bench runs autoregressive at "
                         "--temperature 0 as its baseline; include 0 in --temperature)")
    report = []
    for k in ks:
        for method, make in proposers.items():
            steps = replay(turns, make(), k, stream, max_new_tokens, vocab_size, forwards)
            recorded = recorded_steps(rows, method, k)
            check = None
            if recorded is not None:
                same = sum(a.accepted == _clipped_at_end(b, len(turn.output_ids))
                           for a, b, turn in zip(steps, recorded, turns))
                check = f"{same}/{len(recorded)} turns identical to the recorded run"
            report.append(ReplayRow(method, k, tally(turns, steps, cost, draft_cost=draft_cost), check))
        lengths = copyable_lengths(turns, k, stream)
        oracle = [ceiling_steps(turn, row) for turn, row in zip(turns, lengths)]
        cheapest = [ceiling_cost(turn, row, cost) for turn, row in zip(turns, lengths)]
        report.append(ReplayRow(COPY_CEILING, k, tally(turns, oracle, cost, cheapest), bound=True))
        if oracles is not None:
            report += [dataclasses.replace(row, bound=True) for row in oracles(turns, k, lengths)]
    return report


def shares_of_yardsticks(report: Sequence[ReplayRow]) -> list[dict[str, dict[str, float]]]:
    """Per row of the report: {yardstick: {category: the row's speedup / the yardstick's}}, against
    each of YARDSTICKS replayed at the same k; empty for the bounds themselves. Why: how much of
    the most its kind could reach a method gets moves less from one CPU's costs to another's than
    its bare speedup does (docs/benchmarks.md, "Replay as the yardstick")."""
    yardsticks = {(row.label, row.k): row for row in report if row.bound and row.label in YARDSTICKS}
    shares = []
    for row in report:
        found = {} if row.bound else {label: yardsticks[label, row.k] for label in YARDSTICKS
                                      if (label, row.k) in yardsticks}
        shares.append({label: {category: tally.speedup / bound.totals[category].speedup
                               for category, tally in row.totals.items()}
                       for label, bound in found.items()})
    return shares


def replay_markdown(report: Sequence[ReplayRow], costs_label: str) -> str:
    """The report as a Markdown table: predicted decode speedup (tau) per category."""
    categories = [c for c in report[0].totals if c != "overall"] + ["overall"]
    lines = [f"Predicted decode-only speedup over plain decoding (tau), costs: {costs_label}", "",
             "| method | k | " + " | ".join(categories) + " | drafted/step |",
             "|---|---|" + "---|" * (len(categories) + 1)]
    for row in report:
        cells = [f"{row.totals[c].speedup:.2f}x ({row.totals[c].tau:.2f})" for c in categories]
        overall = row.totals["overall"]
        lines.append(f"| {row.label} | {row.k} | " + " | ".join(cells) +
                     f" | {overall.drafted / max(overall.steps, 1):.2f} |")
    lines += _shares_markdown(report, categories)
    checks = [f"- {row.label} k={row.k}: {row.recorded_check}" for row in report if row.recorded_check]
    if checks:
        lines += ["", "Replay against the recorded greedy runs of the same method and k:", *checks]
    lines += ["", "tau = tokens per target forward (the prefill's included); the copy ceiling drafts, at each "
                  "step, the longest continuation seen anywhere before it (this prompt and answer, and in a "
                  "stream every earlier one): no method that copies can accept more, and its speedup is the "
                  "cheapest path the ceiling allows under these costs."]
    if any(row.label.endswith("oracle") for row in report):
        lines += ["", "A draft oracle drafts, at each step, exactly as many of the draft model's greedy guesses as "
                      "the answer continues (at most k), paying one draft forward a token and the prompt's window "
                      "once: no k rule gets more from this draft's chains. The ngram+draft oracle may copy the "
                      "copy ceiling's continuation instead, step by step, whichever is cheaper."]
    if any(row.label == MATCHED_CEILING for row in report):
        lines += ["", "The matched ceiling drafts, at each step, the best continuation of any earlier occurrence of "
                      "the context's tail at exactly its accepted length: no copy keyed on a match (ngram, suffix, "
                      "copy) accepts more. \"copy's score\" rows know half of it: its candidate drafted exactly as "
                      "far as the answer follows it (what a perfect length rule would give), or its length drafted "
                      "from the candidate the answer follows furthest (a perfect choice of candidate)."]
    return "\n".join(lines)


def _shares_markdown(report: Sequence[ReplayRow], categories: Sequence[str]) -> list[str]:
    """The second table: each replayed method's speedup as a share of the yardsticks' at its k."""
    shares = shares_of_yardsticks(report)
    present = [label for label in YARDSTICKS if any(label in row for row in shares)]
    if not present:
        return []
    whose = " / ".join(label + "'s" for label in present)
    lines = ["", f"Each method's speedup as a share of the {whose} at the same k:", "",
             "| method | k | " + " | ".join(categories) + " |", "|---|---|" + "---|" * len(categories)]
    for row, share in zip(report, shares):
        if share:
            cells = [" / ".join(f"{share[label][c]:.0%}" if label in share else "-" for label in present)
                     for c in categories]
            lines.append(f"| {row.label} | {row.k} | " + " | ".join(cells) + " |")
    return lines


def replay_json(report: Sequence[ReplayRow], costs_label: str) -> dict:
    """Everything replay_markdown shows, per row and category; `share_of` maps each yardstick to the
    row's speedup over its (replayed methods only; empty for the bounds)."""
    shares = shares_of_yardsticks(report)
    return dict(costs=costs_label, rows=[
        dict(label=row.label, k=row.k, recorded_check=row.recorded_check, bound=row.bound,
             categories={c: dict(tau=t.tau, speedup=t.speedup, turns=t.turns, tokens=t.tokens, steps=t.steps,
                                 drafted=t.drafted, share_of={label: by_category[c]
                                                              for label, by_category in share.items()})
                         for c, t in row.totals.items()})
        for row, share in zip(report, shares)])
