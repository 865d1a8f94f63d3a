"""-k auto's stop rule for the draft model, fitted and judged on recorded greedy answers (issue 62, item 4).

    python benchmarks/draft_stop_rule.py RUN [RUN ...] --costs COSTS [--k 8] [--keeps 0.2,0.35,0.5] [--thresholds 0.4]
        [--out DIR]

RUN: `specdec bench` folders whose greedy plain answers (the autoregressive rows at temperature 0)
the draft model replays; COSTS: a `specdec costs --draft` file (the target's forwards and the draft's,
timed in one process). No target model is loaded.

1. The draft reads every answer once, teacher-forced (analysis/draft_oracle.py: draft_guesses): at
   each position its guess given the true prefix, whether the answer took it, and its features.
2. Within each category the prompts alternate between a fitting half and a held-out half. On the
   fitting half a logistic C_i (proposers/stop_rules.py: LearnedStop) is fitted on every chain
   position i a chain started at any answer position reaches while its guesses agree.
3. The real DraftModelProposer replays the answers at k (analysis/replay.py: replay) with each rule:
   confidence thresholds (--thresholds) and the learned rule at each keep (--keeps); the best of each
   family on the fitting half, by replayed speed, is judged on the held-out half. Speed: decode only,
   against plain decoding, priced by COSTS.

Writes DIR/report.md, DIR/report.json and DIR/stop-rule.json (the learned rule, fitted on the fitting
half, with its chosen keep).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from specdec.analysis.candidates import fit_logistic
from specdec.analysis.draft_oracle import CountingRunner, draft_guesses
from specdec.analysis.replay import cost_table, draft_cost_table, recorded_turns, replay, tally
from specdec.bench.harness import read_results
from specdec.models.loader import load_model
from specdec.proposers.draft_model import CONTEXT_WINDOW, DEFAULT_CONFIDENCE, DraftModelProposer
from specdec.proposers.stop_rules import ConfidenceStop, LearnedStop

KEEPS = (0.2, 0.35, 0.5)


def halves(turns):
    """(fitting, held-out) turn indices: within each category, alternate prompts (a multi-turn prompt stays whole)."""
    order: dict[str, list[str]] = {}
    for turn in turns:
        seen = order.setdefault(turn.category, [])
        if turn.question_id not in seen:
            seen.append(turn.question_id)
    fitting = {question for questions in order.values() for question in questions[0::2]}
    first = [i for i, turn in enumerate(turns) if turn.question_id in fitting]
    return first, [i for i in range(len(turns)) if i not in set(first)]


def fitting_rows(guesses, k: int) -> tuple[np.ndarray, np.ndarray]:
    """x (stop features at chain position i), y (accepted) for every chain start and position its guesses reach."""
    x, y = [], []
    for guessed in guesses:
        for start in range(1, len(guessed.agree)):
            for i in range(min(k, len(guessed.agree) - start)):
                x.append([*guessed.features[start + i], np.log(i + 1)])
                y.append(guessed.agree[start + i])
                if not guessed.agree[start + i]:
                    break
    return np.array(x), np.array(y, dtype=float)


def replayed(groups, indices, runner, rule, k: int, cost, draft_cost, vocab_size: int) -> dict:
    """Decode-only speed, tau and drafted tokens per step of the draft method with `rule` over the turns `indices`."""
    steps_all, turns_all = [], []
    for turns, max_new_tokens in groups:
        chosen = [turn for i, turn in turns if i in indices]
        counting = CountingRunner(runner)
        # By hand: the factory builds a draft proposer for a target it loads; this one replays with no target.
        proposer = DraftModelProposer(counting, stop_rule=rule)
        steps_all += replay(chosen, proposer, k, False, max_new_tokens, vocab_size, counting)
        turns_all += chosen
    overall = tally(turns_all, steps_all, cost, draft_cost=draft_cost)["overall"]
    return {"speedup": round(overall.speedup, 4), "tau": round(overall.tau, 3),
            "drafted_per_step": round(overall.drafted / max(1, overall.steps), 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="bench result folders")
    parser.add_argument("--costs", required=True, help="a `specdec costs --draft` file")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--k", type=int, default=8, help="the longest chain (default: 8)")
    parser.add_argument("--out", default=None, help="a folder for report.md, report.json and stop-rule.json")
    parser.add_argument("--keeps", default=",".join(map(str, KEEPS)),
                        help=f"the keeps tried on the fitting half, comma-separated (default: {','.join(map(str, KEEPS))})")
    parser.add_argument("--thresholds", default=str(DEFAULT_CONFIDENCE),
                        help=f"the confidence thresholds tried on the fitting half (default: {DEFAULT_CONFIDENCE})")
    parser.add_argument("--keep", type=float, default=None,
                        help="judge the learned rule with this keep on the held-out half only, beside the threshold, "
                             "instead of choosing it on the fitting half (a third of the replays)")
    args = parser.parse_args()

    cost, label = cost_table(args.costs)
    found = draft_cost_table(args.costs)
    if found is None:
        raise SystemExit(f"{args.costs} has no draft entry: write it with `specdec costs --draft {args.draft}`")
    draft_cost, draft_label = found
    draft = load_model(args.draft, role="draft")
    runner, vocab_size = draft.runner, draft.runner.vocab_size
    turns, groups = [], []
    for run in args.runs:
        header, rows = read_results(Path(run) / "results.jsonl")
        start = len(turns)
        turns += recorded_turns(rows)
        groups.append((list(enumerate(turns[start:], start)), header.get("max_new_tokens")))
    fitting, held_out = halves(turns)
    print(f"{len(turns)} turns ({len(fitting)} fitting, {len(held_out)} held out); costs: {label}; {draft_label}",
          file=sys.stderr)

    guesses = draft_guesses([turns[i] for i in fitting], runner, CONTEXT_WINDOW, vocab_size)
    x, y = fitting_rows(guesses, args.k)
    scorer = fit_logistic(x, y)
    fitted = dict(mean=tuple(map(float, scorer.mean)), scale=tuple(map(float, scorer.scale)),
                  weights=tuple(map(float, scorer.weights)), bias=float(scorer.bias))
    print(f"fitted on {len(y)} drafted positions (accepted {y.mean():.3f}): weights {fitted['weights']}",
          file=sys.stderr)

    def judge(name: str, rule, half: str) -> dict:
        indices = fitting if half == "fitting" else held_out
        found = replayed(groups, set(indices), runner, rule, args.k, cost, draft_cost, vocab_size)
        print(f"{name}, {half} half: {found}", file=sys.stderr, flush=True)
        return found

    # Thresholds against the learned rule: each family's best (the threshold, the keep) chosen on the fitting
    # half, both judged on the held-out half (each replay runs the draft model over half the answers: minutes
    # on two cores). --keep: no choosing, the shipped threshold against that keep on the held-out half only.
    keeps = tuple(float(keep) for keep in args.keeps.split(",")) if args.keep is None else ()
    thresholds = tuple(float(value) for value in args.thresholds.split(",")) if args.keep is None else ()
    results = {}
    for value in thresholds:
        results[f"threshold {value}"] = {"fitting": judge(f"threshold {value}", ConfidenceStop(value), "fitting")}
    for keep in keeps:
        results[f"learned, keep {keep}"] = {"fitting": judge(f"keep {keep}", LearnedStop(**fitted, keep=keep),
                                                             "fitting")}

    def best(names: dict) -> float:
        return max(names, key=lambda value: results[names[value]]["fitting"]["speedup"])

    best_keep = args.keep if args.keep is not None else best({keep: f"learned, keep {keep}" for keep in keeps})
    best_threshold = DEFAULT_CONFIDENCE if args.keep is not None else \
        best({value: f"threshold {value}" for value in thresholds})
    results.setdefault(f"threshold {best_threshold}", {})["held out"] = judge(
        f"threshold {best_threshold}", ConfidenceStop(best_threshold), "held out")
    results.setdefault(f"learned, keep {best_keep}", {})["held out"] = judge(
        f"keep {best_keep}", LearnedStop(**fitted, keep=best_keep), "held out")
    report = {"costs": label, "draft_costs": draft_label, "k": args.k, "turns": len(turns),
              "fitting_turns": len(fitting), "positions": len(y), "rule": fitted, "results": results,
              "chosen": {"keep": best_keep, "threshold": best_threshold}}
    lines = [f"k = {args.k}; costs: {label}; {draft_label}", "",
             "| rule | fitting half: speedup (tau, drafted/step) | held out |", "|---|---|---|"]
    for name, row in results.items():
        cells = [f"{row[h]['speedup']:.3f}x ({row[h]['tau']:.2f}, {row[h]['drafted_per_step']:.2f})" if h in row
                 else "" for h in ("fitting", "held out")]
        chosen = args.keep is None and name in (f"learned, keep {best_keep}", f"threshold {best_threshold}")
        lines.append(f"| {name}{' (chosen)' if chosen else ''} | {cells[0]} | "
                     f"{cells[1]} |")
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.md").write_text("\n".join(lines) + "\n")
        (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / "stop-rule.json").write_text(LearnedStop(**fitted, keep=best_keep).to_json(
            fitted_on=[str(run) for run in args.runs], half="fitting", k=args.k, costs=label))
    return 0


if __name__ == "__main__":
    sys.exit(main())
