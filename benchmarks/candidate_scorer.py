"""Choose among copy candidates by a learned score, on recorded greedy answers (issue 60, item 1).

Every step's candidates (analysis/candidates.py: every earlier occurrence of the context's tail
in the prompt, the answer so far and, in a stream, every earlier prompt and answer) are collected
from each run's answers; a logistic hazard, and a regression tree (--tree-depth), are fitted on
half of the prompts and choose, on the other half, the candidate and length with the most expected tokens per unit of verification cost.
Two folds: prompts are split per category (all runs' question ids of a category, sorted, every
other one), each half scored by the fit on the other, so every prompt has a held-out number; the
in-sample fit (on all prompts) is shown beside it. Beside them, replayed exactly
(analysis/replay.py): ngram at k (the bench's fixed k), ngram's `-k auto` length rule
(follow_match, at most k; the controller that moves k with measured times is not replayed),
suffix decoding at k (the run's options), a rule over the same candidates (the longest
match, then the most recent, drafted in full: ngram's rule with every match length and source),
and `--method copy` itself (proposers/scored_copy.py, its online calibration included) with the
fold's held-out fit and with the scorer the package ships (fitted on all of these runs: in-sample),
and with --copy-trees (held-out): trees of the diverging candidates, sized by the cost table.
Each as a fraction of the copy ceiling's decode-only speedup, per category, under each cost table;
"matched ceiling" is the best any candidate offers (a copy must follow a match of the tail).
Between the logistic chooser and the matched ceiling, two half-oracles say where it loses
(analysis/candidates.half_oracle_choosers): its candidate drafted exactly as far as the answer
follows it, and its length drafted from the candidate the answer follows furthest.

    python benchmarks/candidate_scorer.py \\
        --costs fast=benchmarks/results/draft-oracle-zen4/verify_cost_with_draft.json \\
        --costs slow=benchmarks/results/draft-oracle-zen4/verify_cost_with_draft_slow.json \\
        --costs zen3=benchmarks/results/verify_cost_zen3_w4a8.json \\
        --costs flat=flat --out benchmarks/results/candidates
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from specdec.analysis import candidates as cand
from specdec.analysis.replay import (Tally, cheapest_path, copyable_lengths, cost_table, flat_cost, recorded_turns,
                                     replay, step_time)
from specdec.bench.harness import read_results, recorded_options
from specdec.config import SpecConfig
from specdec.factory import proposer_for
from specdec.planning.costs import interpolated, tree_cost_ratios
from specdec.proposers.copy_candidates import load_scorer
from specdec.proposers.scored_copy import ScoredCopyProposer
from specdec.proposers.step_costs import StepCosts
from specdec.proposers.suffix import SuffixOptions

RUNS = ("benchmarks/results/agent-loop-zen3", "benchmarks/results/suffix/agentic-stream.jsonl",
        "benchmarks/results/draft-oracle-zen4", "benchmarks/results/model-free-zen4")


# The two yardsticks: the eight categories of the bench suites (peers.py's) and the agentic ones.
GROUPS = {"bench suites": ("code-edit", "extraction", "humaneval", "math", "mt-bench", "rag", "retrieval-qa",
                           "translation"),
          "agentic": ("log-summary", "multi-edit", "sql", "sql-loop", "tool-call", "tool-loop")}


def group_of(category: str) -> str:
    return next((name for name, members in GROUPS.items() if category in members), "other")


def load(path: str):
    p = Path(path)
    header, rows = read_results(p / "results.jsonl" if p.is_dir() else p)
    return header, recorded_turns(rows)


def folds(runs) -> dict[str, int]:
    """question id -> 0 or 1: per category, the sorted ids of every run, alternately."""
    by_category: dict[str, set[str]] = {}
    for _, turns, _ in runs:
        for turn in turns:
            by_category.setdefault(turn.category, set()).add(turn.question_id)
    return {qid: index % 2 for ids in by_category.values() for index, qid in enumerate(sorted(ids))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--costs", action="append", required=True,
                        help="NAME=verify_cost.json, or NAME=flat: every forward one step, roughly a GPU (repeatable)")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--tree-depth", type=int, default=8)
    parser.add_argument("--out", default=None)
    parser.add_argument("--write-scorer", default=None, help="also write the scorer fitted on every run (the one "
                                                             "the package ships: src/specdec/data/copy_scorer.json)")
    parser.add_argument("--prior-costs", default="benchmarks/results/draft-oracle-zen4/verify_cost_with_draft.json",
                        help="the cost table --write-scorer records as --method copy's prior (until the engine "
                             "has measured its own)")
    args = parser.parse_args()
    k = args.k
    tables = {name: flat_cost if path == "flat" else cost_table(path)[0]
              for name, path in (c.split("=", 1) for c in args.costs)}
    tree_tables = {name: None if path == "flat" else tree_cost_ratios(path)
                   for name, path in (c.split("=", 1) for c in args.costs)}

    runs = []
    started = time.time()
    for path in args.runs.split(","):
        header, turns = load(path)
        stream = bool(header.get("stream"))
        runs.append((header, turns, cand.collect(turns, k, stream)))
    collected = time.time() - started
    fold = folds(runs)
    everything = [tc for _, _, cs in runs for tc in cs]
    x, y = cand.training_set(everything, k)
    halves = {held: cand.training_set([tc for tc in everything if fold[tc.turn.question_id] != held], k)
              for held in (0, 1)}
    fits = {"in-sample": cand.fit_logistic(x, y), **{held: cand.fit_logistic(*halves[held]) for held in (0, 1)}}
    trees = {"in-sample": cand.fit_tree(x, y, args.tree_depth),
             **{held: cand.fit_tree(*halves[held], args.tree_depth) for held in (0, 1)}}
    for name, scorers in (("logistic", fits), ("tree", trees)):
        losses = []
        for held in (0, 1):
            xe, ye = halves[1 - held]  # the held-out half: fitted on the other
            p = np.clip(scorers[held].probability(xe), 1e-6, 1 - 1e-6)
            losses.append(float(-np.mean(ye * np.log(p) + (1 - ye) * np.log(1 - p))))
        print(f"{name}: held-out log loss per hazard row {losses[0]:.4f} / {losses[1]:.4f} (folds 0 / 1)")
    print(f"collected {sum(len(tc.steps) for tc in everything)} steps, {len(x)} hazard rows in {collected:.1f}s; "
          f"accepted share {y.mean():.3f}")
    print("in-sample weights:", {f: round(float(w), 3) for f, w in
                                 zip(cand.HAZARD_FEATURES, fits["in-sample"].weights)})

    report = {}
    for cost_name, cost in tables.items():
        # A table that times trees prices a tree's step apart (and the proposer chooses by it).
        trees_timed = tree_tables[cost_name]
        pricing = StepCosts(cost, measured=False, tree_prior=trees_timed and interpolated(trees_timed))
        # per row label -> category -> Tally, over every run's turns
        totals: dict[str, dict[str, Tally]] = {}

        def add(label, turn, steps, time_):
            for key in (turn.category, group_of(turn.category), "overall"):
                totals.setdefault(label, {}).setdefault(key, Tally()).add(turn, steps, time_)

        for header, turns, cs in runs:
            stream, cap = bool(header.get("stream")), header.get("max_new_tokens")
            options = SuffixOptions(**recorded_options(header).get("suffix", {}))
            def live(scorer, trees=False):  # --method copy as it runs (its calibration too), at these fixed costs
                # Built by hand, not by the factory: a fold's fitted scorer and this cost table live in
                # memory, and CopyOptions takes either only as a file.
                proposer = ScoredCopyProposer(scorer, step_costs=pricing, trees=trees)
                return replay(turns, proposer, k, stream, cap)

            def method(name, k_, *options):  # the proposer `specdec generate --method NAME -k K` drafts with
                return replay(turns, proposer_for(SpecConfig(method=name, k=k_, options=options), None), k, stream, cap)

            by_fold = {held: live(fits[held]) for held in (0, 1)}
            trees_by_fold = {held: live(fits[held], trees=True) for held in (0, 1)}
            replayed = {
                f"ngram k={k}": method("ngram", k),
                f"ngram auto rule, k<={k}": method("ngram", "auto"),  # -k auto: follow_match
                f"suffix k={k}": method("suffix", k, options),
                "copy (the proposer), held-out": [by_fold[fold[turn.question_id]][index]
                                                  for index, turn in enumerate(turns)],
                "copy (the proposer), shipped scorer": live(load_scorer()),
                "copy --copy-trees, held-out": [trees_by_fold[fold[turn.question_id]][index]
                                                for index, turn in enumerate(turns)],
            }
            choosers = {
                "longest match, most recent": lambda step, cap_: (0, min(int(step.lengths[0]), cap_)),
                "logistic, in-sample": cand.scored_chooser(fits["in-sample"], cost),
                f"tree (depth {args.tree_depth}), in-sample": cand.scored_chooser(trees["in-sample"], cost),
            }
            halves_known = {held: cand.half_oracle_choosers(fits[held], cost) for held in (0, 1)}
            held_choosers = {"logistic, held-out": {held: cand.scored_chooser(fits[held], cost) for held in (0, 1)},
                             **{f"logistic held-out: {name}": {held: halves_known[held][name] for held in (0, 1)}
                                for name in halves_known[0]},
                             f"tree (depth {args.tree_depth}), held-out":
                                 {held: cand.scored_chooser(trees[held], cost) for held in (0, 1)}}
            lengths = copyable_lengths(turns, k, stream)
            for index, (turn, tc) in enumerate(zip(turns, cs)):
                for label, steps in replayed.items():
                    add(label, turn, steps[index], step_time(steps[index], cost, tree_cost=pricing.tree_cost))
                for label, choose in choosers.items():
                    steps = cand.walk(tc, choose, k, cap)
                    add(label, turn, steps, step_time(steps, cost))
                for label, by_fold in held_choosers.items():
                    steps = cand.walk(tc, by_fold[fold[turn.question_id]], k, cap)
                    add(label, turn, steps, step_time(steps, cost))
                time_, steps = cand.matched_ceiling(tc, k, cost)
                add("matched ceiling", turn, steps, time_)
                time_, steps = cheapest_path(turn, [(lengths[index], 0.0)], cost)
                add("copy ceiling", turn, steps, time_)
        ceiling = totals["copy ceiling"]
        categories = sorted(c for c in ceiling if c not in (*GROUPS, "overall")) + [*GROUPS, "overall"]
        lines = [f"### costs: {cost_name}, k = {k}: fraction of the copy ceiling's decode-only speedup "
                 "(speedup in brackets)", "",
                 "| row | " + " | ".join(categories) + " |", "|---|" + "---|" * len(categories)]
        for label, by_category in totals.items():
            cells = []
            for c in categories:
                s = by_category[c].speedup
                cells.append(f"{s / ceiling[c].speedup:.2f} ({s:.2f}x)")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        text = "\n".join(lines)
        print("\n" + text)
        report[cost_name] = dict(table=text, rows={label: {c: dict(speedup=t.speedup, tau=t.tau, turns=t.turns,
                                                                   tokens=t.tokens, steps=t.steps, drafted=t.drafted)
                                                          for c, t in by_category.items()}
                                                   for label, by_category in totals.items()})
    if args.write_scorer:
        scorer, about = cand.fit_scorer([(turns, bool(header.get("stream"))) for header, turns, _ in runs], k)
        prior = json.loads(Path(args.prior_costs).read_text())
        about["fitted on"] = args.runs.split(",")
        about["cost prior"] = dict(ratio=prior["results"][0]["ratio"], measured=args.prior_costs,
                                   on=f"{prior.get('cpu', '?')} {prior.get('isa', '')}".strip(),
                                   format=prior["results"][0].get("format", "?"))
        Path(args.write_scorer).write_text(scorer.to_json(**about))
        print(f"wrote {args.write_scorer}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report["folds"] = {qid: f for qid, f in sorted(fold.items())}
        report["weights"] = {str(name): dict(zip(cand.HAZARD_FEATURES,
                                                 map(float, fit.weights)), bias=fit.bias)
                             for name, fit in fits.items()}
        (out / "candidates.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / "candidates.md").write_text("\n\n".join(report[c]["table"] for c in tables) + "\n")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
