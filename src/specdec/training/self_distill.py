"""Training data the target wrote itself (self-distillation: Medusa-2, Cai et al. 2024 Section
2.3.2; EAGLE's data regeneration, Li et al. 2024 Section 4).

A head learns to predict the target. Trained on a corpus's text, it learns the corpus's
next tokens, which the target does not always choose; trained on the target's own answers,
every window is a path the target really takes at temperature 0, which is what drafting
must guess. The prompts come from what every Python install carries (corpus.py): tasks
written from the standard library's functions (write it, add type hints to it, explain
it) and its documentation topics. The bench suites are never used: that would be
training on the test set.

Answers are generated with the batched engine, n-gram drafting on (lossless: the same
answers as plain decoding, faster where they copy), and appended to a JSONL cache as each
one finishes, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import ast
import json
import random
import sys
import sysconfig
from pathlib import Path

import torch


def distill_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` chat prompts, shuffled deterministically: code to write, code to edit or explain
    (short standard-library functions, quoted), and documentation topics to explain."""
    import pydoc_data.topics

    prompts = [f"Explain the Python topic '{name}' with a short example."
               for name, text in sorted(pydoc_data.topics.topics.items()) if len(text.strip()) > 200]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        source = path.read_text(encoding="utf-8", errors="replace")
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = (ast.get_docstring(node) or "").strip().split("\n")[0]
            code = ast.get_source_segment(source, node) or ""
            if doc and 3 <= code.count("\n") <= 25:
                prompts.append(f"Write a Python function `{node.name}` that does this: {doc}")
                prompts.append(f"Add type hints to this function and keep its behaviour:\n\n```python\n{code}\n```")
                prompts.append(f"Explain what this function does, step by step:\n\n```python\n{code}\n```")
    random.Random(seed).shuffle(prompts)
    return prompts[:count]


def _done(cache: Path) -> dict[int, dict]:
    """The answers already in the cache, by prompt index (a torn last line from a kill is skipped)."""
    done = {}
    if cache.is_file():
        for line in cache.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[int(row["index"])] = row
    return done


@torch.inference_mode()
def generate_answers(runner, tokenizer, prompts: list[str], cache: Path, *, max_new_tokens: int = 256,
                     slots: int = 4, eos_token_ids: frozenset[int] | None = None, progress: bool = True
                     ) -> list[tuple[str, str]]:
    """(prompt, the target's greedy answer) for every prompt that fits the target's context,
    generating only the ones `cache` lacks."""
    from tqdm.auto import tqdm

    from specdec.engine.batch import BatchEngine
    from specdec.proposers.registry import build_proposer
    from specdec.sampling import SamplingParams

    cache.parent.mkdir(parents=True, exist_ok=True)
    done = {index: row for index, row in _done(cache).items()
            if index < len(prompts) and row["prompt"] == prompts[index]}  # a changed prompt is asked again
    todo = [index for index in range(len(prompts)) if index not in done]
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="target answers", unit="answer",
               disable=not progress, file=sys.stderr)
    if todo:
        batch_runner = runner.with_batch_size(slots)
        engine = BatchEngine(batch_runner, build_proposer("ngram", slots=slots), tokenizer, k=4,
                             eos_token_ids=eos_token_ids)
        texts: dict[int, list[str]] = {}
        queue = list(todo)
        chat = bool(getattr(tokenizer, "chat_template", None))  # a base model answers the bare prompt
        with cache.open("a") as sink:
            while queue or engine.running:
                while queue and engine.free_slots:
                    index = queue.pop(0)
                    try:
                        request = engine.make_request(prompts[index], SamplingParams(temperature=0.0),
                                                      max_new_tokens=max_new_tokens, chat=chat)
                    except ValueError:  # longer than the target's context: recorded, never asked again
                        done[index] = {"index": index, "prompt": prompts[index], "answer": "", "finish": "too long"}
                        sink.write(json.dumps(done[index]) + "\n")
                        bar.update(1)
                        continue
                    texts[index] = []
                    engine.add(index, request)
                for update in engine.step():
                    texts[update.handle].append(update.text)
                    if update.finish_reason is not None:
                        answer = "".join(texts.pop(update.handle))
                        row = {"index": update.handle, "prompt": prompts[update.handle],
                               "answer": "" if update.error else answer, "finish": update.finish_reason}
                        sink.write(json.dumps(row) + "\n")
                        sink.flush()
                        done[update.handle] = row
                        bar.update(1)
    bar.close()
    return [(prompts[index], done[index]["answer"]) for index in range(len(prompts)) if done[index]["answer"]]
