"""`specdec bench --endpoint URL ...`: does speculative decoding pay on *your* server?

The same prompt suites as the local bench, sent to running OpenAI-compatible servers (vLLM,
SGLang, llama-server, `specdec serve`) as streamed chat completions, so each server applies its
own chat template; a multi-turn prompt's later turns carry that server's own earlier answers.
The first endpoint is the reference: every other one is reported as a ratio to it, measured in
the same run. The run is interleaved as the local bench's is (every endpoint on one prompt
before the next prompt) and the order of the endpoints rotates from prompt to prompt, so a
machine that slows down, or a server that warms up, does not favour whichever runs first.
Generations run one at a time: what a server's /metrics counted in between belongs to the one
generation (vLLM's spec_decode counters give acceptance where the answer itself does not).

Rows go to OUT/results.jsonl in the local bench's format (a run header, one row per
generation, appended as they finish; a rerun skips the rows already there), then
OUT/report.md, OUT/report.json and PNG plots (bench/endpoint_report.py).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from specdec.bench.openai_client import (Endpoint, EndpointError, add_api_key_args, client, get_json,
                                         parse_endpoints, resolve_model, stream_chat, vllm_spec_counters)
from specdec.bench.prompt_sets import BenchPrompt

ENDPOINT_RESULTS_VERSION = 1


@dataclass
class EndpointPlan:
    prompts: list[BenchPrompt]
    endpoints: list[Endpoint]  # resolved (model known); the first is the reference
    temperatures: list[float]
    repeats: int = 1
    max_new_tokens: int = 128
    top_p: float = 1.0
    seed: int = 0
    run_info: dict = field(default_factory=dict)  # stored in the header row

    def __post_init__(self) -> None:
        from specdec.bench.harness import check_plan

        if not self.endpoints:
            raise ValueError("no endpoint to benchmark")
        check_plan(self.prompts, self.temperatures, self.repeats, self.max_new_tokens)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")

    def jobs(self) -> list[tuple[BenchPrompt, float, int, Endpoint]]:
        """prompt x temperature x repeat, every endpoint in turn, the order rotated one step per group."""
        jobs, group = [], 0
        for prompt in self.prompts:
            for temperature in self.temperatures:
                for repeat in range(self.repeats):
                    shift = group % len(self.endpoints)
                    jobs += [(prompt, temperature, repeat, e)
                             for e in self.endpoints[shift:] + self.endpoints[:shift]]
                    group += 1
        return jobs


def row_key(row: dict) -> tuple:
    return row["question_id"], row["endpoint"], float(row["temperature"]), row["repeat"]


def _counter_delta(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    return {name: after[name] - before[name] for name in after}


def _acceptance(chat, counters: dict | None) -> dict:
    """drafted / accepted tokens and verification steps of one generation, where the server tells:
    specdec's `speculative` block, else vLLM's counters (steps = drafts: tau = 1 + accepted / steps)."""
    if chat.speculative and "drafted_tokens" in chat.speculative:
        spec = chat.speculative
        return dict(acceptance_source="specdec", drafted_tokens=spec["drafted_tokens"],
                    accepted_tokens=spec["accepted_tokens"], verify_steps=spec.get("target_forwards"))
    if counters is not None:
        return dict(acceptance_source="vllm-metrics", drafted_tokens=int(counters["num_draft_tokens"]),
                    accepted_tokens=int(counters["num_accepted_tokens"]), verify_steps=int(counters["num_drafts"]))
    return dict(acceptance_source=None, drafted_tokens=None, accepted_tokens=None, verify_steps=None)


def timed_turn(http, endpoint: Endpoint, messages: list[dict], *, temperature: float, top_p: float,
               max_tokens: int, seed: int, read_counters: bool) -> dict:
    """One streamed generation and what it measured: tokens, wall time, TTFT, ITL, acceptance."""
    sampling = dict(max_tokens=max_tokens, temperature=temperature, seed=seed)
    if temperature > 0 and top_p < 1:
        sampling["top_p"] = top_p
    before = vllm_spec_counters(http, endpoint) if read_counters else None
    chat = stream_chat(http, endpoint, messages, **sampling)
    after = vllm_spec_counters(http, endpoint) if read_counters else None
    times = chat.chunk_times
    tokens = chat.completion_tokens
    # A chunk may carry several tokens (servers batch them): ITL spreads the decode time over the tokens.
    itl = (times[-1] - times[0]) / (tokens - 1) if times and tokens > 1 else None
    return dict(
        prompt_tokens=chat.prompt_tokens, tokens=tokens, tokens_from_usage=chat.tokens_from_usage,
        seconds=chat.end - chat.start,
        ttft_seconds=None if chat.first_token is None else chat.first_token - chat.start,
        itl_seconds=itl, chunks=len(times),
        chunk_gaps_ms=[round(1000 * (b - a), 3) for a, b in zip(times, times[1:])],
        finish_reason=chat.finish_reason, text=chat.text,
        **_acceptance(chat, _counter_delta(before, after)),
    )


def _seed(base: int, question_id: str, repeat: int, turn: int) -> int:
    from specdec.bench.harness import _seed as harness_seed  # the local bench's seeds, the same per prompt

    return harness_seed(base, question_id, repeat, turn)


def run_endpoint_prompt(http, endpoint: Endpoint, prompt: BenchPrompt, temperature: float, repeat: int, *,
                        top_p: float, max_new_tokens: int, seed: int, read_counters: bool) -> list[dict]:
    """All turns of one prompt on one endpoint; each later turn sees that endpoint's own answers."""
    messages, turns = [], []
    for index, user_text in enumerate(prompt.turns):
        messages.append({"role": "user", "content": user_text})
        turn = timed_turn(http, endpoint, messages, temperature=temperature, top_p=top_p,
                          max_tokens=max_new_tokens, seed=_seed(seed, prompt.question_id, repeat, index),
                          read_counters=read_counters)
        messages.append({"role": "assistant", "content": turn["text"]})
        turns.append(turn)
    return turns


def summarise(turns: list[dict]) -> dict:
    """Sums over the turns; acceptance only when every turn reported it."""
    total = {name: sum(t[name] for t in turns) for name in ("tokens", "seconds")}
    for name in ("drafted_tokens", "accepted_tokens", "verify_steps"):
        values = [t[name] for t in turns]
        total[name] = sum(values) if turns and None not in values else None
    total["tokens_per_s"] = total["tokens"] / total["seconds"] if total["seconds"] > 0 else 0.0
    return total


def _endpoint_info(http, endpoint: Endpoint) -> dict:
    """What the header row records about one server: its address (without credentials), model, and any
    setup it publishes."""
    info = dict(label=endpoint.label, url=endpoint.redacted_url(), model=endpoint.model,
                vllm_counters=vllm_spec_counters(http, endpoint) is not None)
    try:
        listing = get_json(http, endpoint, "/v1/models")
        entry = next((m for m in listing.get("data", []) if m.get("id") == endpoint.model), {})
        info.update({name: entry[name] for name in ("speculative", "max_model_len", "owned_by") if name in entry})
    except (ValueError, AttributeError):
        pass  # the listing is optional
    return info


def _check_header(info: dict, run_info: dict, out_path: Path) -> None:
    recorded = [(e["label"], e["model"]) for e in info.get("endpoints", [])]
    wanted = [(e["label"], e["model"]) for e in run_info["endpoints"]]
    if recorded != wanted:
        raise ValueError(f"{out_path} was recorded with endpoints {recorded}, not {wanted}; "
                         "pass another --out to start a new results file")
    for name in ("max_new_tokens", "top_p", "seed"):
        if name in info and info[name] != run_info[name]:
            raise ValueError(f"{out_path} was recorded with {name}={info[name]!r}, not {run_info[name]!r}; "
                             "pass another --out to start a new results file")


def run_endpoint_bench(plan: EndpointPlan, out_path: str | Path, progress: bool = True, http=None) -> list[dict]:
    """Run the plan's generations not yet in out_path, appending one row each; return all rows.

    A 4xx on one generation (a prompt longer than the server's context) is recorded in its row and
    the run goes on; a server that cannot be reached stops the run (rerun to resume)."""
    from tqdm.auto import tqdm

    from specdec.bench.harness import read_results

    out_path = Path(out_path)
    own_client = http is None
    http = http or client()
    try:
        info, rows = read_results(out_path)
        if info and info.get("bench") != "endpoints":
            raise ValueError(f"{out_path} holds a local `specdec bench` run; pass another --out")
        endpoints = {e.label: _endpoint_info(http, e) for e in plan.endpoints}
        run_info = {"kind": "run", "bench": "endpoints", "version": ENDPOINT_RESULTS_VERSION,
                    "endpoints": list(endpoints.values()), "reference": plan.endpoints[0].label,
                    "max_new_tokens": plan.max_new_tokens, "top_p": plan.top_p, "seed": plan.seed,
                    **plan.run_info}
        if info:
            _check_header(info, run_info, out_path)
        done = {row_key(r) for r in rows}
        pending = [job for job in plan.jobs()
                   if (job[0].question_id, job[3].label, float(job[1]), job[2]) not in done]
        out_path.parent.mkdir(parents=True, exist_ok=True)
        with out_path.open("a") as sink:
            if not info:
                sink.write(json.dumps(run_info) + "\n")
            if not pending:
                return rows
            for endpoint in plan.endpoints:  # connections, the server's own warm-up: not part of any row
                stream_chat(http, endpoint, [{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0.0)
            bar = tqdm(pending, desc="bench", unit="gen", file=sys.stderr, disable=not progress,
                       dynamic_ncols=True)
            for prompt, temperature, repeat, endpoint in bar:
                row = dict(kind="generation", question_id=prompt.question_id, category=prompt.category,
                           endpoint=endpoint.label, temperature=float(temperature), repeat=repeat)
                try:
                    turns = run_endpoint_prompt(
                        http, endpoint, prompt, temperature, repeat, top_p=plan.top_p,
                        max_new_tokens=plan.max_new_tokens, seed=plan.seed,
                        read_counters=endpoints[endpoint.label]["vllm_counters"])
                except EndpointError as error:
                    if error.status >= 500:
                        raise
                    row["error"], turns = str(error), []
                row.update(summarise(turns), turns=turns)
                rows.append(row)
                sink.write(json.dumps(row) + "\n")
                sink.flush()
                if row["seconds"] > 0:
                    bar.set_postfix_str(f"{endpoint.label} T={temperature:g} {row['tokens_per_s']:.1f} tok/s")
        return rows
    finally:
        if own_client:
            http.close()


# ---- command -----------------------------------------------------------------------------------


def add_endpoint_bench_args(parser) -> None:
    """--endpoint, --endpoint-model, --api-key, --api-key-env on `specdec bench`."""
    parser.add_argument("--endpoint", action="append", default=None, metavar="[LABEL=]URL",
                        help="benchmark a running OpenAI-compatible server (vLLM, SGLang, llama-server, specdec "
                             "serve) instead of local models: http://HOST:PORT or .../v1, optionally named "
                             "LABEL=URL. Repeat it to compare servers; the first is the reference that the "
                             "others' tokens/s are divided by")
    _add_client_args(parser)


def _add_client_args(parser) -> None:
    parser.add_argument("--endpoint-model", action="append", default=None, metavar="NAME",
                        help="the model name to request (default: the one GET /v1/models lists); once for all "
                             "endpoints or once per endpoint, in order")
    add_api_key_args(parser, "in --endpoint order")


def _temperatures(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(not v >= 0 for v in values):
        raise ValueError(f"temperatures must be comma-separated floats >= 0, got {text!r}")
    return values


def wants_endpoint_bench(args) -> bool:
    """--endpoint given, or --report-only on a directory that an endpoint run wrote."""
    if getattr(args, "endpoint", None):
        return True
    results = Path(args.out) / "results.jsonl"
    if not getattr(args, "report_only", False) or not results.exists():
        return False
    with results.open() as lines:
        try:
            header = json.loads(lines.readline())
        except json.JSONDecodeError:
            return False
    return isinstance(header, dict) and header.get("bench") == "endpoints"


def cmd_bench_endpoints(args) -> int:
    """specdec bench --endpoint ...: run (unless --report-only), then write the report and plots."""
    from specdec.bench.endpoint_report import write_endpoint_report
    from specdec.bench.harness import read_results
    from specdec.bench.prompt_sets import load_prompts

    out_dir = Path(args.out)
    results = out_dir / "results.jsonl"
    if not args.report_only:
        endpoints = parse_endpoints(args.endpoint, args.endpoint_model, args.api_keys)
        temperatures = _temperatures(args.temperature)
        prompts = load_prompts([s.strip() for s in args.prompts.split(",") if s.strip()], args.per_category)
        with client() as http:
            endpoints = [resolve_model(http, e) for e in endpoints]
            plan = EndpointPlan(prompts, endpoints, temperatures, args.repeats, args.max_new_tokens, args.top_p,
                                args.seed, dict(prompts=len(prompts), prompt_sets=args.prompts))
            print(f"bench: {len(prompts)} prompts x {len(endpoints)} endpoints x {len(temperatures)} temperatures "
                  f"x {args.repeats} repeats -> {results}\n" +
                  "".join(f"  {e.label}: {e.redacted_url()} model {e.model!r}{' (reference)' if i == 0 else ''}\n"
                          for i, e in enumerate(endpoints)), end="", file=sys.stderr, flush=True)
            run_endpoint_bench(plan, results, progress=not args.quiet, http=http)
    elif not results.exists():
        raise ValueError(f"--report-only: no results in {results}")
    info, rows = read_results(results)
    return write_endpoint_report(info, rows, out_dir, plots=not args.no_plots)
