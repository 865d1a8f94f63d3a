"""specdec replay: a bench run's greedy answers through ngram and suffix decoding, with no model.

research_cli.py adds this command's parser beside bench, analyze and verify; the handler is here.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdec.cli_options import int_list, positive_int, results_path

EPILOG_REPLAY = """\
examples:
  specdec replay bench-results                   # ngram and suffix at the run's k, every step one step
  specdec replay benchmarks/results/agent-loop-kernels --k 4,8,16 \\
      --costs benchmarks/results/verify_cost_w4a8_kernels.json   # speed under a CPU's measured costs
  specdec replay bench-results --suffix-spec-factor 2 --suffix-min-prob 0.2   # tune, then bench the winner

Loads no model. At temperature 0 every lossless method writes plain decoding's
tokens, and a model-free draft is accepted exactly as far as it agrees with them,
so the greedy answers a `specdec bench` run recorded (run the bench with --stream
for agent loops and servers) tell what ngram and suffix decoding accept at each
step, for any k and option, in seconds. Where the results hold a greedy run of the
same method at the same fixed k, the replay is checked against it turn by turn.

The copy ceiling is an oracle that drafts the longest continuation seen anywhere
before (this prompt and answer; in a stream, every earlier prompt and answer):
no method that copies text accepts more. Speedups are decode only, predicted
from --costs (benchmarks/verify_cost.py's JSON: an n-token forward over a 1-token
step on one machine); without it every forward costs one step, roughly a GPU.
"""


def add_replay_command(sub) -> None:
    import argparse

    replay = sub.add_parser("replay", help="replay a bench run's greedy answers through ngram and suffix decoding "
                                           "(no model): exact acceptance, predicted speedup, the copy ceiling",
                            epilog=EPILOG_REPLAY, formatter_class=argparse.RawDescriptionHelpFormatter)
    replay.add_argument("results", help="a `specdec bench` OUT directory (or its results.jsonl)")
    replay.add_argument("--methods", default="ngram,suffix", help="comma-separated, of ngram and suffix "
                                                                   "(default: both)")
    replay.add_argument("--k", default=None,
                        help="comma-separated fixed draft lengths >= 1 (default: the run's fixed k, else 8)")
    replay.add_argument("--costs", help="benchmarks/verify_cost.py's JSON from the machine to predict for "
                                        "(default: every forward costs one step)")
    replay.add_argument("--ngram-max", type=positive_int, default=None, help="(default: the run's)")
    replay.add_argument("--ngram-min", type=positive_int, default=None, help="(default: the run's)")
    for name, field, kind, what in (("cache-requests", "cache_requests", int, "earlier answers kept"),
                                    ("max-depth", "max_depth", int, "longest match"),
                                    ("spec-factor", "spec_factor", float, "drafted tokens per matched token"),
                                    ("min-prob", "min_token_prob", float, "lowest estimated probability drafted")):
        replay.add_argument(f"--suffix-{name}", dest=f"suffix_{field}", type=kind, default=None,
                            help=f"{what} (default: the run's)")
    replay.add_argument("--markdown", help="also write the table to this path")
    replay.add_argument("--json", help="also write everything as JSON to this path")


def cmd_replay(args) -> int:
    from specdec.analysis.replay import cost_table, flat_cost, replay_json, replay_markdown, replay_rows
    from specdec.bench.harness import read_results
    from specdec.proposers.registry import build_proposer
    from specdec.proposers.suffix import SuffixOptions

    path = results_path(args.results)
    if not path.exists():
        raise ValueError(f"no bench results at {path} (a `specdec bench --out DIR` writes DIR/results.jsonl)")
    header, rows = read_results(path)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for method in methods:
        if method not in ("ngram", "suffix"):
            raise ValueError(f"replay drafts with the model-free methods ngram and suffix only, not {method!r} "
                             "(the others' drafts come from models)")
    if args.k is not None:
        ks = int_list(args.k)  # each >= 1
    else:
        ks = sorted({row["k"] for row in rows if row["method"] in methods and isinstance(row["k"], int)
                     and row["k"] > 0}) or [8]
    suffix = dict(header.get("suffix") or {})
    for field in ("cache_requests", "max_depth", "spec_factor", "min_token_prob"):
        if getattr(args, f"suffix_{field}") is not None:
            suffix[field] = getattr(args, f"suffix_{field}")
    options = SuffixOptions(**suffix)
    ngram = dict(ngram_max=args.ngram_max or header.get("ngram_max", 3),
                 ngram_min=args.ngram_min or header.get("ngram_min", 1),
                 ngram_tie_break=header.get("ngram_tie_break", "recent"))
    proposers = {method: (lambda method=method: build_proposer(method, suffix=options, **ngram)) for method in methods}
    cost, label = (cost_table(args.costs) if args.costs else
                   (flat_cost, "none given: every forward one step (roughly a GPU)"))
    report = replay_rows(rows, proposers, ks, bool(header.get("stream")), cost)
    text = replay_markdown(report, label)
    machine = header.get("machine", "?")
    print(f"{len(report[0].totals) - 1} categories of greedy answers from {args.results} "
          f"({header.get('target_model', header.get('target', '?'))}, {machine}"
          f"{', one stream' if header.get('stream') else ''})\n")
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(replay_json(report, label), indent=1) + "\n")
    return 0
