"""The benchmark loop: every (prompt, repeat, temperature, method) once, one JSONL row each.

In the spirit of Spec-Bench (Xia et al. 2024): one target, every method on the
same prompts in the same process, plain decoding through the same engine as
the baseline, the chat template applied, multi-turn prompts answered turn by
turn with the method's own earlier answers. The loop is interleaved (all
methods of one prompt before the next prompt) so that a machine that slows down
halfway slows every method alike. Rows are appended as they finish; a rerun
skips the rows already in the file, so an interrupted run resumes.
"""

from __future__ import annotations

import gzip
import json
import platform
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from specdec.bench.prompt_sets import BenchPrompt
from specdec.bench.quality import humaneval_passes, target_log_likelihood
from specdec.engine import SpecEngine
from specdec.engine.request import chat_template_ids
from specdec.proposers.registry import TREE_METHODS  # the methods --tree-size sizes (their entries)
from specdec.sampling import SamplingParams

AUTOREGRESSIVE = "autoregressive"
RESULTS_VERSION = 1


@dataclass(frozen=True)
class MethodSpec:
    method: str
    k: int | str  # 0 for plain decoding; "auto" for adaptive k
    lenience: float = 1.0  # < 1: the lossy lenient acceptance rule
    tree_size: int | str | None = None  # a tree method's nodes per step, "auto"; None: the method's default

    @property
    def label(self) -> str:
        label = self.method if self.k == 0 else f"{self.method} k={self.k}"
        if self.tree_size is not None:
            label += f" tree={self.tree_size}"
        return label if self.lenience == 1.0 else f"{label} l={self.lenience:g}"


def method_grid(methods: list[str], ks: list[int | str], leniences: list[float] = (1.0,),
                tree_sizes: list[int | str | None] = (None,)) -> list[MethodSpec]:
    """autoregressive once (always, first: it is the baseline), every other method at every k and lenience,
    and a tree method at every tree size (several sizes: each its own row in the report)."""
    if not ks or any(k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 1) for k in ks):
        raise ValueError(f"k values must be integers >= 1 or auto, got {ks}")
    if not leniences or any(not 0 < lenience <= 1 for lenience in leniences):
        raise ValueError(f"lenience values must lie in (0, 1], got {list(leniences)}")
    sized = len(tree_sizes) > 1  # one size stays the run's option, out of the labels
    grid = [MethodSpec(AUTOREGRESSIVE, 0)]
    for method in dict.fromkeys(methods):
        if method != AUTOREGRESSIVE:
            sizes = dict.fromkeys(tree_sizes) if sized and method in TREE_METHODS else [None]
            grid.extend(MethodSpec(method, k, lenience, size) for lenience in dict.fromkeys(leniences)
                        for k in dict.fromkeys(ks) for size in sizes)
    return grid


@dataclass
class BenchPlan:
    prompts: list[BenchPrompt]
    methods: list[MethodSpec]
    temperatures: list[float]
    repeats: int = 1
    max_new_tokens: int = 128
    top_p: float = 1.0
    seed: int = 0
    run_info: dict = field(default_factory=dict)  # models, backend, machine: stored with the rows
    quality: bool = False  # score every answer under the target (and run HumanEval's tests): bench/quality.py
    # False: every generation starts with empty cross-request caches (suffix decoding's), so a row
    # measures one request alone. True: each (repeat, temperature) pass runs the prompts in order as
    # one stream of consecutive requests, as a server sees them: what earlier prompts wrote counts.
    stream: bool = False

    def __post_init__(self) -> None:
        check_plan(self.prompts, self.temperatures, self.repeats, self.max_new_tokens)

    def jobs(self) -> list[tuple[BenchPrompt, int, float, MethodSpec]]:
        if self.stream:
            return [(prompt, repeat, temperature, spec) for repeat in range(self.repeats)
                    for temperature in self.temperatures for prompt in self.prompts for spec in self.methods]
        return [(prompt, repeat, temperature, spec) for prompt in self.prompts for repeat in range(self.repeats)
                for temperature in self.temperatures for spec in self.methods]


def check_plan(prompts, temperatures, repeats: int, max_new_tokens: int) -> None:
    """What every bench plan (local engines or endpoints) needs before it runs."""
    if any(t < 0 for t in temperatures) or not temperatures:
        raise ValueError(f"temperatures must be >= 0, got {temperatures}")
    if repeats < 1 or max_new_tokens < 1:
        raise ValueError("repeats and max_new_tokens must be >= 1")
    if not prompts:
        raise ValueError("no prompts to run")


def row_key(row: dict) -> tuple:
    return (row["question_id"], row["method"], row["k"], float(row.get("lenience", 1.0)), float(row["temperature"]),
            row["repeat"], row.get("tree_size"))


def job_key(prompt: BenchPrompt, repeat: int, temperature: float, spec: MethodSpec) -> tuple:
    """The row_key of the row this job will write."""
    return prompt.question_id, spec.method, spec.k, float(spec.lenience), float(temperature), repeat, spec.tree_size


def read_results(path: str | Path) -> tuple[dict, list[dict]]:
    """(run info, generation rows) of a results file; ({}, []) when it does not exist yet. An archived
    run's results.jsonl.gz (benchmarks/results) is read where there is no plain one."""
    path = Path(path)
    packed = path.with_name(path.name + ".gz")
    if not path.exists() and packed.exists():
        path = packed
    if not path.exists():
        return {}, []
    info, rows = {}, []
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{number} is not JSON; is this a `specdec bench` results file?") from None
        if record.get("kind") == "run":
            info = record
        elif record.get("kind") == "generation":
            rows.append(record)
    return info, rows


def recorded_options(info: dict) -> dict[str, dict]:
    """Option group -> the fields a run's header recorded for it ({} where none). Runs before the
    options were recorded by group kept n-gram's flat (ngram_max, ...) and suffix decoding's whole."""
    if "options" in info:
        return dict(info["options"])
    legacy = {"ngram": {field: info[f"ngram_{field}"] for field in ("max", "min", "tie_break") if f"ngram_{field}" in info}}
    if isinstance(info.get("suffix"), dict):
        legacy["suffix"] = info["suffix"]
    return legacy


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        return chat_template_ids(tokenizer, messages)
    # No template (a base model): the turns as plain text, answers in between.
    return tokenizer("\n\n".join(m["content"] for m in messages) + "\n\n")["input_ids"]


def _seed(base: int, question_id: str, repeat: int, turn: int) -> int:
    """The same seed for every method on one (prompt, repeat, turn): differences come from the method."""
    return (base * 1_000_003 + zlib.crc32(f"{question_id}/{repeat}/{turn}".encode())) % (2**63)


def run_prompt(engine: SpecEngine, prompt: BenchPrompt, params: SamplingParams, max_new_tokens: int,
               seed_of_turn: Callable[[int], int | None], quality: bool = False) -> list[dict]:
    """All turns of one prompt with one engine; each turn sees the engine's own earlier answers.

    quality: each answer is also scored under the target, after its timing is taken.
    """
    messages: list[dict] = []
    turns = []
    for index, user_text in enumerate(prompt.turns):
        messages.append({"role": "user", "content": user_text})
        result = engine.generate(_chat_ids(engine.tokenizer, messages), replace(params, seed=seed_of_turn(index)),
                                 max_new_tokens=max_new_tokens)
        messages.append({"role": "assistant", "content": result.text})
        stats = result.stats
        turns.append(dict(
            prompt_tokens=stats.prompt_tokens, prompt_tokens_reused=stats.prompt_tokens_reused,
            tokens=stats.generated_tokens, seconds=stats.total_time_s,
            prefill_seconds=stats.prefill_time_s, decode_seconds=stats.decode_time_s,
            first_token_seconds=stats.first_token_s,
            target_forwards=stats.target_forwards, drafted_tokens=stats.drafted_tokens,
            accepted_tokens=stats.accepted_tokens, accepted_per_step=stats.accepted_per_step,
            drafted_per_position=stats.drafted_per_position, accepted_per_position=stats.accepted_per_position,
            finish_reason=result.finish_reason, token_ids=result.token_ids, text=result.text,
        ))
        if engine.proposer is None:  # plain decoding's texts are what `specdec analyze` measures alpha on
            turns[-1]["prompt_ids"] = result.prompt_token_ids
        if quality:
            turns[-1]["target_logprob"] = target_log_likelihood(engine.target, result.prompt_token_ids,
                                                                result.token_ids)
    return turns


def summarise_turns(turns: list[dict]) -> dict:
    """Sums over the turns of one prompt: the numbers the report reads."""
    total = {name: sum(t[name] for t in turns) for name in
             ("tokens", "seconds", "decode_seconds", "target_forwards", "drafted_tokens", "accepted_tokens")}
    for name in ("drafted_per_position", "accepted_per_position"):
        width = max((len(t[name]) for t in turns), default=0)
        total[name] = [sum(t[name][j] for t in turns if j < len(t[name])) for j in range(width)]
    if turns and all("target_logprob" in t for t in turns):
        total["target_logprob"] = sum(t["target_logprob"] for t in turns)
    return total


def run_bench(plan: BenchPlan, engines: dict[MethodSpec, SpecEngine], out_path: str | Path,
              progress: bool = True) -> list[dict]:
    """Run the plan's jobs not yet in out_path; append a row per job; return all rows."""
    from tqdm.auto import tqdm

    out_path = Path(out_path)
    info, rows = read_results(out_path)
    run_info = {"kind": "run", "version": RESULTS_VERSION, "max_new_tokens": plan.max_new_tokens,
                "top_p": plan.top_p, "seed": plan.seed, "stream": plan.stream, "python": platform.python_version(),
                **plan.run_info}
    if info:
        for name in ("target", "draft", "backend", "max_new_tokens", "top_p", "seed", "stream"):
            if name in info and name in run_info and info[name] != run_info[name]:
                raise ValueError(f"{out_path} was recorded with {name}={info[name]!r}, not {run_info[name]!r}; "
                                 "pass another --out to start a new results file")
    done = {row_key(r) for r in rows}
    pending = [job for job in plan.jobs() if job_key(*job) not in done]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("a") as sink:
        if not info:
            sink.write(json.dumps(run_info) + "\n")
        if not pending:
            return rows
        warm = SamplingParams(temperature=0.0)
        for engine in engines.values():  # allocations, kernel choice, caches: not part of any row
            engine.generate(_chat_ids(engine.tokenizer, [{"role": "user", "content": "Say hi."}]), warm,
                            max_new_tokens=8)
        bar = tqdm(pending, desc="bench", unit="gen", file=sys.stderr, disable=not progress, dynamic_ncols=True)
        stream_pass = None
        for prompt, repeat, temperature, spec in bar:
            # A resumed stream restarts its pass's caches at the first pending prompt.
            if not plan.stream or stream_pass != (repeat, temperature):
                for engine in (engines.values() if plan.stream else [engines[spec]]):
                    engine.forget_earlier_requests()
                stream_pass = (repeat, temperature)
            params = SamplingParams(temperature=temperature, top_p=plan.top_p if temperature > 0 else 1.0,
                                    lenience=spec.lenience)
            row = dict(kind="generation", question_id=prompt.question_id, category=prompt.category,
                       method=spec.method, k=spec.k, lenience=spec.lenience, label=spec.label,
                       temperature=float(temperature), repeat=repeat)
            if spec.tree_size is not None:
                row["tree_size"] = spec.tree_size
            try:
                turns = run_prompt(engines[spec], prompt, params, plan.max_new_tokens,
                                   lambda turn: _seed(plan.seed, prompt.question_id, repeat, turn), plan.quality)
            except ValueError as error:  # e.g. a prompt longer than the context: recorded, the run goes on
                row["error"] = str(error)
                turns = []
            row.update(summarise_turns(turns), turns=turns)
            if plan.quality and turns and prompt.category == "humaneval":
                row["passed"] = humaneval_passes(prompt.question_id, turns[-1]["text"])
            rows.append(row)
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            if row["seconds"] > 0:
                bar.set_postfix_str(f"{spec.label} T={temperature:g} {row['tokens'] / row['seconds']:.1f} tok/s")
    return rows
