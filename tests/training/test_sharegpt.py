"""The ShareGPT corpus (training/sharegpt.py): read record by record up to the torn tail, turns
normalized to user / assistant, a stable 1% held out, and conversations that share 13 words with a
bench prompt kept out of training. The last tests read the real package (`make models` installs it)."""

from __future__ import annotations

import hashlib
import json

import pytest

from specdec.bench.prompt_sets import PROMPT_SETS, mt_bench, sharegpt
from specdec.training.sharegpt import (HELD_OUT_EVERY, Conversation, CorpusCounts, bench_word_runs, conversation,
                                       held_out_conversations, read_records, training_conversations, word_runs)


def record(index: int, *turns: tuple[str, str]) -> dict:
    return {"id": f"conv{index}_0", "conversations": [{"from": speaker, "value": text} for speaker, text in turns]}


def write_torn(path, records: list[dict], keep_of_last: int = 40) -> None:
    """A JSON array cut inside its last record, as the package ships it."""
    text = json.dumps(records, indent=2)
    path.write_text(text[:text.rindex(f'"id": "{records[-1]["id"]}"') + keep_of_last])


@pytest.mark.parametrize("chunk_chars", [16, 97, 1 << 20])
def test_every_whole_record_is_read_and_the_torn_one_dropped(tmp_path, chunk_chars):
    records = [record(i, ("human", f"question {i} " + "word " * (i * 7)), ("gpt", f"answer {i}")) for i in range(30)]
    path = tmp_path / "torn.json"
    write_torn(path, records)
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())
    assert list(read_records(path, chunk_chars=chunk_chars)) == records[:-1]
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps(records))
    assert list(read_records(whole, chunk_chars=chunk_chars)) == records
    (tmp_path / "empty.json").write_text("[\n]")
    assert list(read_records(tmp_path / "empty.json", chunk_chars=chunk_chars)) == []


def test_turns_alternate_user_first_and_end_on_an_answer():
    found = conversation(record(1, ("gpt", "hello, how can I help"), ("system", "be brief"), ("human", "  Q1 "),
                                ("gpt", "A1"), ("human", ""), ("user", "Q2"), ("chatgpt", "A2"), ("human", "Q3")))
    assert found == Conversation("conv1_0", (("user", "Q1"), ("assistant", "A1"), ("user", "Q2"), ("assistant", "A2")))
    assert found.messages[1] == {"role": "assistant", "content": "A1"}
    cut = conversation(record(2, ("human", "Q1"), ("gpt", "A1"), ("gpt", "A1 again"), ("human", "Q2"), ("gpt", "A2")))
    assert cut.turns == (("user", "Q1"), ("assistant", "A1"))  # two answers in a row: kept up to there
    assert conversation(record(3, ("human", "only a question"))) is None
    assert conversation({"id": "x"}) is None


def test_the_held_out_share_is_a_stable_hash_of_the_id():
    ids = [f"conversation-{index}" for index in range(5000)]
    held = [name for name in ids if Conversation(name, (("user", "q"), ("assistant", "a"))).held_out]
    expected = [name for name in ids if int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % HELD_OUT_EVERY == 0]
    assert held == expected and 25 <= len(held) <= 80


def test_a_conversation_sharing_thirteen_words_with_a_bench_prompt_is_not_trained_on(tmp_path):
    bench = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences"
    records = [record(0, ("human", f"Please: {bench.upper()}!"), ("gpt", "Aloha")),  # case and punctuation differ
               record(1, ("human", " ".join(bench.split()[:12]) + " and more"), ("gpt", "twelve words only")),
               record(2, ("human", "something else"), ("gpt", bench))]  # in an answer: the question is what counts
    path = tmp_path / "corpus.json"
    path.write_text(json.dumps(records))
    counts = CorpusCounts()
    kept = training_conversations(word_runs(bench), path, counts=counts)
    assert [found.id for found in kept] == ["conv1_0", "conv2_0"]
    assert (counts.records, counts.kept, counts.contaminated) == (3, 2, 1)
    assert training_conversations(word_runs(bench), path, limit=1) == kept[:1]


@pytest.mark.integration
def test_the_packaged_corpus_trains_apart_from_its_held_out_set_and_the_bench():
    counts = CorpusCounts()
    others = {name: prompts for name, prompts in PROMPT_SETS.items() if name != "sharegpt"}
    excluded = bench_word_runs(others)
    assert word_runs(mt_bench()[0].turns[0]) <= excluded
    kept = training_conversations(excluded, counts=counts)
    held = held_out_conversations()
    assert counts.records == 17_671  # the package's whole records (its last one is cut off)
    assert counts.kept + counts.held_out + counts.contaminated + counts.unusable == counts.records
    assert counts.held_out == len(held) and 100 < len(held) < 300
    assert not {found.id for found in kept} & {found.id for found in held}
    assert sum(len(text) for found in kept for role, text in found.turns if role == "assistant") > 70_000_000
    prompts = sharegpt()
    assert {prompt.category for prompt in prompts} == {"chat", "chat-code"}
    assert all(1 <= len(prompt.turns) <= 2 and max(map(len, prompt.turns)) <= 2000 for prompt in prompts)
    assert {prompt.question_id.removeprefix("sharegpt/") for prompt in prompts} <= {found.id for found in held}
