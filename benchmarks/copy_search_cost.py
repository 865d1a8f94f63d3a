"""What scored copying's own work costs a step, with no model: `--method copy` (its search, score,
choice and calibration) replayed over the recorded runs candidate_scorer.py fits on, on the Zen 4's
fast-memory cost table, timed per step, and a digest of every step's drafted and accepted tokens.

An optimisation of the search must leave the digest as it was: the same choices, only cheaper.
--against COMMIT loads that commit's copy proposer (proposers/copy_candidates.py and scored_copy.py,
read with `git show`) beside this tree's, in the same process, and alternates passes of the two
(the order swapped each repeat), so a slow minute of the VM falls on both:

    python benchmarks/copy_search_cost.py                      # this tree alone
    python benchmarks/copy_search_cost.py --against 90f49bf    # an interleaved A/B against a commit

The time includes the replay's own loop (a context tensor built per step, as the engine hands one);
benchmarks/proposal_overhead.py gives the live milliseconds per propose() on single prompts.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from candidate_scorer import RUNS, load  # noqa: E402

from specdec.analysis.replay import replay  # noqa: E402
from specdec.config import SpecConfig  # noqa: E402
from specdec.factory import proposer_for  # noqa: E402
from specdec.proposers.scored_copy import CopyOptions  # noqa: E402

FAST_COSTS = "benchmarks/results/draft-oracle-zen4/verify_cost_with_draft.json"
ROOT = Path(__file__).resolve().parent.parent


def this_tree():
    """`--method copy --copy-costs FAST_COSTS -k 8`, built by the factory as `specdec generate` builds it."""
    config = SpecConfig(method="copy", k=8, options=(CopyOptions(costs=FAST_COSTS),))
    return lambda: proposer_for(config, None)


def at_commit(commit: str):
    """That commit's ScoredCopyProposer at the same costs. Built by hand, not by the factory: the
    factory builds this tree's proposer, and the commit's two modules are loaded under other names."""
    modules = {}
    for name in ("copy_candidates", "scored_copy"):
        source = subprocess.run(["git", "show", f"{commit}:src/specdec/proposers/{name}.py"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout
        source = source.replace("from specdec.proposers.copy_candidates import", "from _at_commit_copy_candidates import")
        module = types.ModuleType(f"_at_commit_{name}")
        sys.modules[module.__name__] = module  # dataclasses look their module up while the class is made
        exec(compile(source, f"{commit}:{name}.py", "exec"), module.__dict__)
        modules[name] = module
    step_costs = CopyOptions(costs=FAST_COSTS).new_step_costs
    # By hand: the factory would build this tree's proposer, not the commit's.
    return lambda: modules["scored_copy"].ScoredCopyProposer(modules["copy_candidates"].load_scorer(),
                                                             step_costs=step_costs())


def one_pass(runs, make_proposer) -> tuple[float, int, str]:
    """(seconds in replay, steps, digest of every step's drafted and accepted counts)."""
    digest, steps, seconds = hashlib.sha256(), 0, 0.0
    for header, turns in runs:
        proposer = make_proposer()
        start = time.perf_counter()
        replayed = replay(turns, proposer, 8, bool(header.get("stream")), header.get("max_new_tokens"))
        seconds += time.perf_counter() - start
        for turn in replayed:
            digest.update(repr((turn.drafted, turn.accepted)).encode())
            steps += len(turn.drafted)
    return seconds, steps, digest.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="passes over the runs (the median is reported)")
    parser.add_argument("--against", metavar="COMMIT", help="alternate with that commit's copy proposer")
    args = parser.parse_args()
    runs = [load(path) for path in RUNS]
    makers = {"this tree": this_tree()}
    if args.against:
        makers[args.against] = at_commit(args.against)
    passes: dict[str, list[tuple[float, int, str]]] = {label: [] for label in makers}
    for repeat in range(args.repeats):
        for label in (list(makers) if repeat % 2 == 0 else list(makers)[::-1]):
            passes[label].append(one_pass(runs, makers[label]))
    steps = passes["this tree"][0][1]
    digests = {digest for rows in passes.values() for _, _, digest in rows}
    for label, rows in passes.items():
        per_step = [seconds / steps * 1e3 for seconds, _, _ in rows]
        print(f"{label:>12}: {statistics.median(per_step):.3f} ms a step (median of {args.repeats}; "
              f"min {min(per_step):.3f}) over {steps} steps of {len(RUNS)} recorded runs")
    if args.against:
        ratios = [mine[0] / theirs[0] for mine, theirs in zip(passes["this tree"], passes[args.against])]
        print(f"this tree / {args.against}: {statistics.median(ratios):.2f}x a step (median of the paired passes)")
    print("choices digest " + (digests.pop() if len(digests) == 1 else f"DIFFERS: {sorted(digests)}"))


if __name__ == "__main__":
    main()
