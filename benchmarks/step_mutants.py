"""Mutants of the shared step (engine/step.py): which tests each one fails.

Each mutant is one changed line of engine/step.py, applied in a throwaway git worktree of HEAD (the
checkout itself is never touched). Against each, the single-request tests (tests/engine/test_engine.py)
and the batched ones (tests/engine/test_batch.py) run, and with --suite the whole unit suite, which
names the failing tests. A mutant every test lets through is a hole in the tests
(docs/history.md, "One engine: SpecEngine is a BatchEngine of one row (issue 39, items 1 and 2)").

  python benchmarks/step_mutants.py                 # the two engine files, every mutant (~10 min, 2 cores)
  python benchmarks/step_mutants.py --suite --only tree   # the unit suite, mutants whose name has "tree"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEP = "src/specdec/engine/step.py"
MUTANTS = {  # name: (the line as it is, the mutant)
    "rollback keeps one rejected draft": ("target.truncate([length + a for length, a in zip(lengths, accepted)]",
                                          "target.truncate([length + a + 1 for length, a in zip(lengths, accepted)]"),
    "draft probabilities dropped (point masses)": (
        "probs = None if proposal.probs is None else proposal.probs[b:b + 1, :width]", "probs = None"),
    "a row verified against the next row's logits": (
        "logits[b:b + 1, :width + 1]", "logits[(b + 1) % batch:(b + 1) % batch + 1, :width + 1]"),
    "tree nodes one position deeper": ("offsets[b, 1:n] = torch.tensor(tree_depths(parents))",
                                       "offsets[b, 1:n] = torch.tensor(tree_depths(parents)) + 1"),
    "the proposer not told what was accepted": ("proposer.on_verified(torch.tensor(accepted))",
                                                "proposer.on_verified(torch.tensor(accepted) * 0)"),
}
UNIT = "not integration and not isa and not vllm"


def pytest(tree: Path, targets: list[str]) -> tuple[str, list[str]]:
    """(pytest's last line, the failed tests) for targets in tree, importing tree's own sources."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "-m", UNIT,
                          *targets], cwd=tree, env=env, capture_output=True, text=True)
    lines = out.stdout.strip().splitlines()
    failed = sorted(set(re.findall(r"^FAILED (\S+)", out.stdout, re.M)))
    return (lines[-1] if lines else out.stderr.strip()[-300:]), failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", action="store_true", help="run the whole unit suite against each mutant")
    parser.add_argument("--only", default="", help="only the mutants whose name contains this")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), "HEAD"], cwd=REPO, check=True)
        try:
            original = (tree / STEP).read_text()
            for name, (line, mutant) in MUTANTS.items():
                if args.only not in name:
                    continue
                if original.count(line) != 1:
                    raise SystemExit(f"{STEP} no longer holds the line of mutant {name!r} once: update MUTANTS")
                (tree / STEP).write_text(original.replace(line, mutant))
                row = {"mutant": name}
                if args.suite:
                    row["unit suite"], row["failed"] = pytest(tree, ["tests"])
                else:
                    row["single-request tests"] = pytest(tree, ["tests/engine/test_engine.py"])[0]
                    row["batched tests"] = pytest(tree, ["tests/engine/test_batch.py"])[0]
                print(json.dumps(row), flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)


if __name__ == "__main__":
    main()
