"""specdec replay: a bench run's greedy answers through ngram and suffix decoding with no model, and
through a draft model (its replay and its oracle) with the draft alone.

research_cli.py adds this command's parser beside bench, analyze and verify; the handler is here.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdec.cli_options import int_list, non_negative_float, positive_int, results_path
from specdec.config import QUANTIZATIONS

EPILOG_REPLAY = """\
examples:
  specdec replay bench-results                   # ngram and suffix at the run's k, every step one step
  specdec replay benchmarks/results/agent-loop-kernels --k 4,8,16 \\
      --costs benchmarks/results/verify_cost_w4a8_kernels.json   # speed under a CPU's measured costs
  specdec replay bench-results --suffix-spec-factor 2 --suffix-min-prob 0.2   # tune, then bench the winner
  specdec replay my-agent-run --fit my-scorer.json --costs costs.json
      # fit --method copy's scorer on your own answers, then: specdec serve ... --copy-scorer my-scorer.json
  specdec costs --draft qwen2.5-coder-0.5b       # this machine's costs -> costs.json
  specdec replay bench-results --draft qwen2.5-coder-0.5b --k 2,4,8 --costs costs.json
      # the draft model replayed, and the most any k rule could get from its guesses on this machine

Without --draft it loads no model. At temperature 0 every lossless method writes plain decoding's
tokens, and a model-free draft is accepted exactly as far as it agrees with them,
so the greedy answers a `specdec bench` run recorded (run the bench with --stream
for agent loops and servers) tell what ngram and suffix decoding accept at each
step, for any k and option, in seconds. Where the results hold a greedy run of the
same method at the same fixed k, the replay is checked against it turn by turn.

The copy ceiling is an oracle that drafts the longest continuation seen anywhere
before (this prompt and answer; in a stream, every earlier prompt and answer):
no method that copies text accepts more. Speedups are decode only, predicted
from --costs (`specdec costs`'s JSON: an n-token forward over a 1-token step on
one machine, which the label names); without it every forward costs one step,
roughly a GPU. A second table reads each method's speedup as a share of the copy
ceiling's at the same k (and of the ngram+draft oracle's, with --draft): how much
of what its kind could reach it gets, which moves less than the speedup itself
from one CPU's costs to another's. Where copy is replayed, three more rows say
where its choice loses: the matched ceiling (the best candidate any match of
the context's tail offers, at exactly its accepted length), and copy's score
with a perfect length rule or with a perfect choice of candidate.

With --draft the draft model (loaded alone, no target) drafts too: `draft` and
`ngram+draft` replayed at each fixed k, each of the draft's forwards priced
from the "draft" entry of --costs (`specdec costs --draft`, timed in the same
process as the target) or --draft-cost. The draft oracle knows how far the
draft's greedy guesses agree with the answer (one teacher-forced forward per
answer) and drafts each step exactly that many, at most k: no k rule gets more
from this draft's chains on that machine. The ngram+draft oracle also copies
the copy ceiling's continuations, whichever is cheaper step by step.
"""


def add_replay_command(sub) -> None:
    import argparse

    from specdec.cli_options import add_option_groups
    from specdec.config import option_groups
    from specdec.proposers.registry import ENTRIES, methods_reading
    from specdec.proposers.scored_copy import CopyOptions

    replay = sub.add_parser("replay", help="replay a bench run's greedy answers through ngram and suffix decoding "
                                           "(no model) or a draft model (no target): exact acceptance, predicted "
                                           "speedup, the copy ceiling and the draft's oracle",
                            epilog=EPILOG_REPLAY, formatter_class=argparse.RawDescriptionHelpFormatter)
    replay.add_argument("results", help="a `specdec bench` OUT directory (or its results.jsonl)")
    replayable = [name for name, method in ENTRIES.items() if method.replayable]
    with_draft = [name for name in replayable if ENTRIES[name].needs_draft_model]
    replay.add_argument("--methods", default=None,
                        help=f"comma-separated, of {', '.join(replayable)} ({' and '.join(with_draft)} need --draft; "
                             "default: all that can run)")
    replay.add_argument("--k", default=None,
                        help="comma-separated fixed draft lengths >= 1 (default: the run's fixed k, else 8)")
    replay.add_argument("--costs", help="the cost table of the machine to predict for, as `specdec costs` "
                                        "writes it (default: every forward costs one step)")
    # The replayable methods' knobs (copy's scorer aside: --copy-scorer, --fit), each defaulting to the run's.
    add_option_groups(replay, [kind for kind in option_groups().values() if kind is not CopyOptions
                               and any(ENTRIES[name].replayable for name in methods_reading(kind))], recorded=True)
    replay.add_argument("--copy-scorer", default=None, metavar="FILE",
                        help="copy's scorer, as --fit writes it (default: the one that ships)")
    replay.add_argument("--fit", default=None, metavar="FILE",
                        help="fit copy's scorer on these answers (at the first --k), write it to FILE and replay "
                             "copy with it: in-sample, so fit on one run and replay another to judge it")
    replay.add_argument("--draft", help="a draft model (embedded name or Hugging Face directory): replay it, and "
                                        "price its oracle; loads the draft only")
    replay.add_argument("--draft-quantize", default="auto", choices=["auto", *QUANTIZATIONS],
                        help="the draft's weights, as in bench (default: auto)")
    replay.add_argument("--draft-vocab", type=positive_int, default=None,
                        help="the draft's head scores only this many frequent tokens, as in bench")
    replay.add_argument("--draft-cost", type=non_negative_float, default=None,
                        help="every draft forward costs this many target steps (default: the --costs file's "
                             "draft entry; without either, draft forwards are free)")
    replay.add_argument("--markdown", help="also write the table to this path")
    replay.add_argument("--json", help="also write everything as JSON to this path")


def cmd_replay(args) -> int:
    from specdec.analysis.replay import (cost_table, draft_cost_table, flat_cost, replay_json, replay_markdown,
                                         replay_rows)
    from specdec.bench.harness import read_results, recorded_options
    from specdec.cli_options import options_from_args
    from specdec.proposers.registry import ENTRIES, build_proposer
    from specdec.proposers.scored_copy import CopyOptions

    path = results_path(args.results)
    if not path.exists():
        raise ValueError(f"no bench results at {path} (a `specdec bench --out DIR` writes DIR/results.jsonl)")
    header, rows = read_results(path)
    replayable = [name for name, method in ENTRIES.items() if method.replayable]
    model_free = tuple(name for name in replayable if not ENTRIES[name].needs_draft_model)
    with_draft = tuple(name for name in replayable if ENTRIES[name].needs_draft_model)
    methods = [m.strip() for m in (args.methods or ",".join(model_free + (with_draft if args.draft else ()))).split(",")
               if m.strip()]
    for method in methods:
        if method not in model_free + with_draft:
            raise ValueError(f"replay drafts with {', '.join(replayable)} only, not {method!r} "
                             "(heads read the target's features: bench them)")
        if method in with_draft and not args.draft:
            raise ValueError(f"{method} needs a draft model: --draft NAME (the bench run's was "
                             f"{header.get('draft_model') or header.get('draft') or 'not recorded'})")
    if args.k is not None:
        ks = int_list(args.k)  # each >= 1
    else:
        ks = sorted({row["k"] for row in rows if row["method"] in methods and isinstance(row["k"], int)
                     and row["k"] > 0}) or [8]
    options = options_from_args(args, recorded_options(header))  # the run's, as the flags change them
    cost, label = (cost_table(args.costs) if args.costs else
                   (flat_cost, "none given: every forward one step (roughly a GPU)"))
    draft_cost, oracles, vocab_size, runner = None, None, None, None
    if args.draft:
        from specdec.analysis.draft_oracle import CountingRunner, DraftOracles
        from specdec.models.loader import load_model

        if args.draft_cost is not None:
            draft_cost, draft_label = (lambda tokens: args.draft_cost), f"draft forwards {args.draft_cost} of a step"
        else:
            table = draft_cost_table(args.costs) if args.costs else None
            draft_cost, draft_label = table if table is not None else (None, "draft forwards free (no draft costs)")
        label += f"; {draft_label}"
        draft = load_model(args.draft, quantize=args.draft_quantize, head_vocab=args.draft_vocab, role="draft")
        _check_same_tokens(str(header.get("target") or ""), args.draft, draft.tokenizer)
        runner, vocab_size = CountingRunner(draft.runner), draft.runner.vocab_size
        oracles = DraftOracles(draft.runner, vocab_size, cost, draft_cost)
    if "copy" in methods:  # the scorer it chooses by: --fit's, --copy-scorer's or the shipped one
        options["copy"] = CopyOptions(scorer=_copy_scorer(args, header, rows, ks[0]))
        oracles = _with_copy_oracles(oracles, options["copy"], cost, header)
    # A method that sizes drafts by step costs prices them as the replay does (nothing is timed here).
    proposers = {method: (lambda method=method: build_proposer(method, draft_runner=runner, replay_cost=cost,
                                                                **options))
                 for method in methods}
    report = replay_rows(rows, proposers, ks, bool(header.get("stream")), cost, draft_cost=draft_cost,
                         max_new_tokens=header.get("max_new_tokens"), vocab_size=vocab_size, forwards=runner,
                         oracles=oracles)
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


def _with_copy_oracles(oracles, copy_options: CopyOptions, cost, header: dict):
    """replay_rows()'s oracles with copy's added (analysis/candidates.CopyOracles: the matched ceiling
    and where copy's score loses, in length or in choice)."""
    from specdec.analysis.candidates import CopyOracles
    from specdec.proposers.copy_candidates import load_scorer

    copy = CopyOracles(load_scorer(copy_options.scorer), cost, bool(header.get("stream")),
                       header.get("max_new_tokens"))
    if oracles is None:
        return copy
    return lambda turns, k, copies: oracles(turns, k, copies) + copy(turns, k, copies)


def _copy_scorer(args, header: dict, rows: list[dict], k: int) -> str | None:
    """The file of copy's scorer: --fit's (fitted and written here), --copy-scorer's, or None (the shipped one)."""
    from specdec.analysis.candidates import fit_scorer
    from specdec.analysis.replay import recorded_turns

    if args.fit is None:
        return args.copy_scorer
    turns = recorded_turns(rows)
    if not turns:
        raise ValueError("--fit needs greedy plain-decoding answers (bench runs autoregressive at --temperature 0)")
    scorer, about = fit_scorer([(turns, bool(header.get("stream")))], k)
    about["fitted on"] = [str(args.results)]
    Path(args.fit).write_text(scorer.to_json(**about))
    print(f"fitted copy's scorer on {about['steps']} steps of {about['turns']} answers -> {args.fit}")
    return args.fit


def _check_same_tokens(target: str, draft_name: str, draft_tokenizer) -> None:
    """The replay compares the draft's ids with the recorded answers' target ids: a draft with another
    tokenizer (which drafts through a bridge, proposers/cross_vocabulary.py) is benched, not replayed."""
    from transformers import AutoTokenizer

    from specdec.models.hub import cache_root
    from specdec.models.loader import same_vocabulary

    for place in (Path(target), cache_root() / target):
        if target and (place / "tokenizer_config.json").is_file():
            if not same_vocabulary(AutoTokenizer.from_pretrained(place), draft_tokenizer):
                raise ValueError(f"replay --draft reads the recorded answers in {target}'s tokens, which "
                                 f"{draft_name} does not share: bench it instead (specdec bench --draft {draft_name})")
            return
