"""Other ways to score suffix decoding's candidates, replayed on a bench run's greedy answers.

Each variant is suffix decoding with one change; `specdec replay`'s machinery (analysis/replay.py)
runs it over the recorded answers, as the engine would, and predicts its decode-only speedup from
a machine's measured step costs. None loads a model. The variants (benchmarks/RESULTS.md,
"Replaying greedy answers"):

  spec factor F       draft up to ceil(F x match length) tokens (shipped: 1, vLLM's default)
  min prob P          no node below probability P (shipped: 0.1)
  anchor N            each cached answer is stored after its prompt's last N tokens, so an
                      answer's start matches the end of the next prompt (a chat template's tail)
  merged tree N       the best-first trees of every matched suffix (both tries) merged into one
                      tree of N nodes, each path at its highest probability among them
  support a           a candidate's probabilities times n / (n + a), n = its matched suffix's
                      count of continuations: a suffix seen once is weak evidence

    python benchmarks/suffix_variants.py benchmarks/results/agent-loop-zen3 \\
        --costs benchmarks/results/verify_cost_zen3_w4a8.json [--k 8]
"""

from __future__ import annotations

import argparse
import math

from pathlib import Path

from specdec.analysis.replay import cost_table, flat_cost, recorded_turns, replay, tally
from specdec.bench.harness import read_results, recorded_options
from specdec.config import SpecConfig
from specdec.factory import proposer_for
from specdec.proposers.suffix import SuffixDraft, SuffixOptions, SuffixProposer, speculate


# Anchored and Scored change suffix decoding's code, not its options: subclasses, which no SpecConfig
# names, so they are built by hand; the variants that are options go through the factory (main).
class Anchored(SuffixProposer):
    """Cached answers start with their prompt's last `anchor` tokens."""

    def __init__(self, options: SuffixOptions, anchor: int) -> None:
        super().__init__(None, options)
        self.anchor = anchor

    def end_request(self, prompt_ids, output_ids) -> None:
        self.cache.add(list(prompt_ids[len(prompt_ids) - self.anchor:]) + list(output_ids))


class Scored(SuffixProposer):
    """best_draft over the same candidates, scored another way."""

    def __init__(self, options: SuffixOptions, merged_nodes: int = 0, support: float = 0.0) -> None:
        super().__init__(None, options)
        self.merged_nodes, self.support = merged_nodes, support

    def candidates(self):
        local = self.local._open
        return [(m, local[m]) for m in range(1, len(local))] + [m for m in self.cursor.matches if m[0] > 0]

    def best_draft(self, max_k: int) -> SuffixDraft | None:
        drafts = []
        for match_len, node in self.candidates():
            children = node.kids()
            if not children:
                continue
            budget = min(max_k, math.ceil(self.options.spec_factor * match_len))
            weight = 1.0
            if self.support:
                seen = sum(child.count for child in children.values())
                weight = seen / (seen + self.support)
            draft = speculate(node, match_len, budget, self.options.min_token_prob / weight)
            if draft.token_ids:
                drafts.append(SuffixDraft(draft.token_ids, draft.parents, [p * weight for p in draft.probs],
                                          match_len))
        if not drafts:
            return None
        if not self.merged_nodes:
            return max(drafts, key=lambda d: (d.score, d.match_len))
        paths: dict[tuple[int, ...], float] = {}
        for draft in drafts:
            keys: list[tuple[int, ...]] = []
            for token, parent, probability in zip(draft.token_ids, draft.parents, draft.probs):
                keys.append((keys[parent] if parent >= 0 else ()) + (token,))
                paths[keys[-1]] = max(paths.get(keys[-1], 0.0), probability)
        # A path's probability never exceeds its prefix's, so the best N are a tree (ties: shorter first).
        chosen = sorted(paths, key=lambda key: (-paths[key], len(key)))[:self.merged_nodes]
        kept = set(chosen)
        chosen = sorted((key for key in chosen if all(key[:i] in kept for i in range(1, len(key)))), key=len)
        index = {key: i for i, key in enumerate(chosen)}
        return SuffixDraft([key[-1] for key in chosen], [index[key[:-1]] if len(key) > 1 else -1 for key in chosen],
                           [paths[key] for key in chosen], 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="a `specdec bench` OUT directory (or its results.jsonl)")
    parser.add_argument("--costs", help="benchmarks/verify_cost.py's JSON (default: every forward one step)")
    parser.add_argument("--k", type=int, default=8)
    args = parser.parse_args()
    path = Path(args.results)
    header, rows = read_results(path / "results.jsonl" if path.is_dir() else path)
    if not rows:
        raise SystemExit(f"no bench results at {path}")
    turns = recorded_turns(rows)
    cost, label = cost_table(args.costs) if args.costs else (flat_cost, "every forward one step")
    base = SuffixOptions(**recorded_options(header).get("suffix", {}))

    def shipped(**changes):  # the proposer `specdec generate --method suffix -k K` with these options drafts with
        return proposer_for(SpecConfig(method="suffix", k=args.k, options=(SuffixOptions(**{**base.__dict__, **changes}),)),
                            None)

    variants = {"as shipped": shipped}
    for factor in (2.0, 4.0):
        variants[f"spec factor {factor:g}"] = lambda factor=factor: shipped(spec_factor=factor)
    for probability in (0.05, 0.2):
        variants[f"min prob {probability:g}"] = lambda p=probability: shipped(min_token_prob=p)
    for anchor in (3, 5):
        variants[f"anchor {anchor}"] = lambda anchor=anchor: Anchored(base, anchor)
    for nodes in (4, 8, 16):
        variants[f"merged tree {nodes}"] = lambda nodes=nodes: Scored(base, merged_nodes=nodes)
    for support in (0.5, 1.0, 2.0):
        variants[f"support {support:g}"] = lambda support=support: Scored(base, support=support)
    categories = None
    print(f"decode-only speedup predicted (tau), k={args.k}, costs: {label}\n")
    for name, make in variants.items():
        totals = tally(turns, replay(turns, make(), args.k, bool(header.get("stream"))), cost)
        if categories is None:
            categories = [c for c in totals if c != "overall"] + ["overall"]
            print("| variant | " + " | ".join(categories) + " |\n|---|" + "---|" * len(categories))
        print(f"| {name} | " + " | ".join(f"{totals[c].speedup:.2f}x ({totals[c].tau:.2f})" for c in categories) + " |")


if __name__ == "__main__":
    main()
