"""`specdec demo`: speculative vs plain decoding of the same target, side by side.

Both runs use one loaded target runner and the same prompts, greedy, so the
speedup is a ratio measured in one run and the texts must be identical.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass

from specdec.cli_options import add_method_args, add_model_args, config_from_args, positive_int
from specdec.engine import SpecEngine
from specdec.sampling import SamplingParams

_MERGE = """def merge_sorted(left, right):
    merged = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            merged.append(left[i])
            i += 1
        else:
            merged.append(right[j])
            j += 1
    merged.extend(left[i:])
    merged.extend(right[j:])
    return merged"""
_MEETING = ("Minutes, 12 March. Present: Ana Lopez (chair), Tom Becker (treasurer), Priya Nair (secretary) "
            "and Omar Haddad (events lead). Ana Lopez opened the meeting. Tom Becker reported that the budget "
            "is on track. Priya Nair will circulate the minutes by Friday, and Omar Haddad will book the hall "
            "for the spring fair.")

# The kinds of work a chat user asks for: writing new code and prose, and answers that
# reuse their input (edits, extraction), where the bench suites show speculation paying most.
DEMO_PROMPTS: list[tuple[str, str]] = [
    ("code", "Write a Python function `is_prime(n)` that returns True when n is a prime number."),
    ("code-edit", f"Add type hints to this function. Keep its body exactly as it is.\n\n```python\n{_MERGE}\n```"),
    ("extraction", f"From these minutes, list each person with their role and their task, one per line.\n\n"
                   f"{_MEETING}"),
    ("prose", "Explain in a short paragraph why the sky is blue."),
    ("prose", "Write a short note to a colleague asking to move our meeting to Thursday."),
]


@dataclass
class DemoRow:
    category: str
    prompt: str
    plain_tokens_per_s: float
    spec_tokens_per_s: float
    mean_accepted_length: float
    acceptance_rate: float
    identical: bool
    text: str

    @property
    def speedup(self) -> float:
        return self.spec_tokens_per_s / self.plain_tokens_per_s if self.plain_tokens_per_s else 0.0


def compare(plain: SpecEngine, spec: SpecEngine, prompts, max_new_tokens: int, out=sys.stdout) -> list[DemoRow]:
    params = SamplingParams(temperature=0.0)
    # Warm-up: first forwards pay for allocations and kernel selection.
    for engine in (plain, spec):
        engine.generate(prompts[0][1], params, max_new_tokens=4, chat=True)
    rows = []
    for index, (category, prompt) in enumerate(prompts, 1):
        print(f"\n[{index}/{len(prompts)}] ({category}) {prompt}", file=out, flush=True)
        baseline = plain.generate(prompt, params, max_new_tokens=max_new_tokens, chat=True)
        print("  speculative: ", end="", file=out, flush=True)
        text_parts, stats = [], None
        for chunk in spec.stream(prompt, params, max_new_tokens=max_new_tokens, chat=True):
            text_parts.append(chunk.text)
            print(chunk.text.replace("\n", "\n    "), end="", file=out, flush=True)
            stats = chunk.stats or stats
        text = "".join(text_parts)
        row = DemoRow(category, prompt, baseline.stats.tokens_per_s, stats.tokens_per_s,
                      stats.mean_accepted_length, stats.acceptance_rate, text == baseline.text, text)
        print(f"\n  plain {row.plain_tokens_per_s:.2f} tok/s | speculative {row.spec_tokens_per_s:.2f} tok/s "
              f"| speedup {row.speedup:.2f}x | identical: {'yes' if row.identical else 'NO'}", file=out, flush=True)
        rows.append(row)
    return rows


def format_table(rows: list[DemoRow]) -> str:
    header = f"{'category':<11}{'plain tok/s':>12}{'spec tok/s':>12}{'tau':>7}{'accept':>9}{'speedup':>9}  identical"
    lines = [header, "-" * len(header)]
    groups = {}
    for row in rows:
        groups.setdefault(row.category, []).append(row)
    groups["all"] = rows
    for name, group in groups.items():
        same = sum(r.identical for r in group)
        lines.append(
            f"{name:<11}{statistics.mean(r.plain_tokens_per_s for r in group):>12.2f}"
            f"{statistics.mean(r.spec_tokens_per_s for r in group):>12.2f}"
            f"{statistics.mean(r.mean_accepted_length for r in group):>7.2f}"
            f"{statistics.mean(r.acceptance_rate for r in group):>9.1%}"
            f"{statistics.mean(r.speedup for r in group):>8.2f}x  {same}/{len(group)}"
        )
    lines.append("tau = tokens per target forward; speedup = mean of per-prompt tok/s ratios, same runner, same run.")
    return "\n".join(lines)


def add_demo_command(sub) -> None:
    import argparse

    demo = sub.add_parser("demo", help="speculative vs plain decoding on built-in prompts, with a speedup table",
                          formatter_class=argparse.RawDescriptionHelpFormatter,
                          epilog="examples:\n  specdec demo -k 4 --max-new-tokens 64\n"
                                 "  specdec demo --method ngram -k 8\n")
    add_model_args(demo)
    add_method_args(demo)
    demo.add_argument("--max-new-tokens", type=positive_int, default=64, help="per prompt (default: 64)")
    demo.add_argument("--prompts", type=positive_int, default=None, help="use only the first N built-in prompts")
    demo.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")


def cmd_demo(args) -> int:
    from specdec.factory import load_engine, plain_engine

    config = config_from_args(args)
    spec, target, draft = load_engine(config)
    plain = plain_engine(target)
    prompts = DEMO_PROMPTS[: args.prompts] if args.prompts else DEMO_PROMPTS
    proposer = f"draft {draft.name}" if draft is not None else "no draft model"
    print(f"target {target.describe()} | method {config.method} ({proposer}) | k={config.k} | greedy | "
          f"{args.max_new_tokens} new tokens | device {spec.target.device}", flush=True)
    rows = compare(plain, spec, prompts, args.max_new_tokens)
    print("\n" + format_table(rows))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([row.__dict__ | {"speedup": row.speedup} for row in rows], handle, indent=2)
    return 0 if all(row.identical for row in rows) else 1
