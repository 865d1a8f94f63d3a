"""What scored copying's own work costs a step, with no model: `--method copy` (its search, score,
choice and calibration) replayed over the recorded runs candidate_scorer.py fits on, on the Zen 4's
fast-memory cost table, timed per step, and a digest of every step's drafted and accepted tokens.

An optimisation of the search must leave the digest as it was: the same choices, only cheaper.
Compare two commits on one machine in one sitting (the VM's speed drifts):

    python benchmarks/copy_search_cost.py                                   # this tree
    git worktree add /tmp/before OLD && PYTHONPATH=/tmp/before/src python benchmarks/copy_search_cost.py

The time includes the replay's own loop (a context tensor built per step, as the engine hands one);
benchmarks/proposal_overhead.py gives the live milliseconds per propose() on single prompts.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from candidate_scorer import RUNS, load  # noqa: E402

from specdec.analysis.replay import replay  # noqa: E402
from specdec.config import SpecConfig  # noqa: E402
from specdec.factory import proposer_for  # noqa: E402
from specdec.proposers.scored_copy import CopyOptions  # noqa: E402

FAST_COSTS = "benchmarks/results/draft-oracle-zen4/verify_cost_with_draft.json"


def one_pass(runs) -> tuple[float, int, str]:
    """(seconds in replay, steps, digest of every step's drafted and accepted counts)."""
    digest, steps, seconds = hashlib.sha256(), 0, 0.0
    config = SpecConfig(method="copy", k=8, options=(CopyOptions(costs=FAST_COSTS),))  # `--copy-costs FILE`
    for header, turns in runs:
        proposer = proposer_for(config, None)
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
    args = parser.parse_args()
    runs = [load(path) for path in RUNS]
    passes = [one_pass(runs) for _ in range(args.repeats)]
    digests = {digest for _, _, digest in passes}
    assert len(digests) == 1, f"the replay is not deterministic: {digests}"
    steps = passes[0][1]
    per_step = [seconds / steps * 1e3 for seconds, _, _ in passes]
    print(f"{steps} steps over {len(RUNS)} recorded runs: {statistics.median(per_step):.3f} ms a step "
          f"(median of {args.repeats}; min {min(per_step):.3f}), choices digest {digests.pop()}")


if __name__ == "__main__":
    main()
