"""Prompt sets: the packaged HumanEval and MT-bench, the project's own, and user JSONL."""

import json

import pytest

from specdec.bench.harness import MethodSpec, method_grid
from specdec.bench.prompt_sets import BenchPrompt, humaneval, load_prompts, mt_bench, read_jsonl, select, written


def test_humaneval_and_mt_bench_come_from_their_packages():
    coding = humaneval()
    assert len(coding) == 164 and coding[0].question_id == "HumanEval/0"
    assert "def has_close_elements" in coding[0].turns[0]
    chat = mt_bench()
    assert len(chat) == 80 and all(len(p.turns) == 2 for p in chat)
    assert {p.question_id.rsplit("-", 1)[1] for p in chat} == {
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def test_the_projects_own_tasks_cover_the_spec_bench_categories():
    prompts = written()
    assert {p.category for p in prompts} == {"code-edit", "extraction", "retrieval-qa", "translation", "math", "rag"}
    rag = [p for p in prompts if p.category == "rag"]
    # Long-context: each carries a 3,200-character document (about 700-850 tokens) and a question.
    assert len(rag) == 3 and all(len(p.turns[0]) > 3300 and "Question:" in p.turns[0] for p in rag)


def test_the_agentic_suite_is_series_of_requests_over_shared_artefacts():
    prompts = load_prompts(["agentic"], None)
    assert [p.category for p in prompts][:2] == ["multi-edit", "tool-call"]
    assert {p.category for p in prompts} == {"multi-edit", "tool-call", "sql", "log-summary"}
    assert len(next(p for p in prompts if p.category == "multi-edit").turns) == 3
    schema = [p.turns[0].split("Question:")[0] for p in prompts if p.category == "sql"]
    assert len(schema) == 4 and len(set(schema)) == 1  # one schema, several questions
    assert len({p.question_id for p in prompts}) == len(prompts)


def test_the_agent_loops_are_20_requests_over_one_artefact_each_in_order():
    prompts = load_prompts(["agent-loop"], None)
    assert [p.category for p in prompts] == ["sql-loop"] * 20 + ["tool-loop"] * 20
    agentic = load_prompts(["agentic"], None)
    for category, loop in (("sql", "sql-loop"), ("tool-call", "tool-loop")):
        suite = [p.turns for p in agentic if p.category == category]
        looped = [p.turns for p in prompts if p.category == loop]
        assert looped[:4] == suite  # the suite's requests open the loop
        assert len({turns[0].rsplit("\n", 1)[1] for turns in looped}) == 20  # 20 different requests
        assert len({turns[0].rsplit("\n", 1)[0] for turns in looped}) == 1  # one schema or tool
    assert len({p.question_id for p in prompts}) == 40


def test_select_spreads_over_a_category():
    prompts = [BenchPrompt(f"q{i}", "c" if i < 8 else "d", ("x",)) for i in range(10)]
    assert [p.question_id for p in select(prompts, 2)] == ["q0", "q4", "q8", "q9"]
    assert select(prompts, None) == prompts
    picked = select(mt_bench(), 8)  # one per MT-bench sub-category
    assert len({p.question_id.rsplit("-", 1)[1] for p in picked}) == 8


def test_user_jsonl_in_spec_bench_format(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"question_id": 7, "category": "legal", "turns": ["one", "two"]}) + "\n\n"
                    + json.dumps({"turns": ["three"]}) + "\n")
    prompts = read_jsonl(path)
    assert prompts == [BenchPrompt("7", "legal", ("one", "two")), BenchPrompt("mine/3", "mine", ("three",))]
    assert load_prompts([str(path), "specdec"], per_category=1)[0].category == "legal"


@pytest.mark.parametrize("content,message", [
    ("{not json\n", "mine.jsonl:1: not JSON"),
    ('{"turns": []}\n', "non-empty list"),
    ('{"turns": "hello"}\n', "non-empty list"),
    ("\n", "no prompts"),
])
def test_bad_jsonl_names_the_line(tmp_path, content, message):
    path = tmp_path / "mine.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        read_jsonl(path)


def test_unknown_set_and_duplicate_ids_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_prompts(["no-such-set"])
    path = tmp_path / "dup.jsonl"
    path.write_text('{"question_id": "x", "turns": ["a"]}\n{"question_id": "x", "turns": ["b"]}\n')
    with pytest.raises(ValueError, match="appears twice"):
        load_prompts([str(path)])


def test_method_grid_runs_plain_once_and_every_method_at_every_k():
    grid = method_grid(["draft", "autoregressive", "ngram", "draft"], [2, 4, 2])
    assert grid == [MethodSpec("autoregressive", 0), MethodSpec("draft", 2), MethodSpec("draft", 4),
                    MethodSpec("ngram", 2), MethodSpec("ngram", 4)]
    assert grid[1].label == "draft k=2"
    with pytest.raises(ValueError):
        method_grid(["draft"], [0])


def test_method_grid_sweeps_tree_sizes_of_tree_methods_only():
    grid = method_grid(["ngram", "eagle3-tree"], [4], tree_sizes=[10, "auto"])
    assert grid == [MethodSpec("autoregressive", 0), MethodSpec("ngram", 4), MethodSpec("eagle3-tree", 4, 1.0, 10),
                    MethodSpec("eagle3-tree", 4, 1.0, "auto")]
    assert [spec.label for spec in grid[2:]] == ["eagle3-tree k=4 tree=10", "eagle3-tree k=4 tree=auto"]
    assert method_grid(["eagle3-tree"], [4], tree_sizes=[10])[1] == MethodSpec("eagle3-tree", 4)  # the run's option
