"""The report builder: exact numbers on hand-made rows, and a full render of a recorded run."""

import json
import statistics
from pathlib import Path

import pytest

from specdec.bench.harness import read_results
from specdec.bench.plots import write_plots
from specdec.bench.report import OVERALL, build_report, to_markdown, to_text

RECORDED = Path(__file__).parent / "data" / "small_results.jsonl"


def _row(qid, category, method, k, tokens, seconds, *, temperature=0.0, repeat=0, forwards=None, drafted=0,
         accepted=0, per_position=((), ()), token_ids=None):
    turn = dict(tokens=tokens, token_ids=token_ids or list(range(tokens)))
    return dict(kind="generation", question_id=qid, category=category, method=method, k=k,
                label=method if k == 0 else f"{method} k={k}", temperature=temperature, repeat=repeat,
                tokens=tokens, seconds=seconds, decode_seconds=seconds * 0.9, target_forwards=forwards or tokens,
                drafted_tokens=drafted, accepted_tokens=accepted, drafted_per_position=list(per_position[0]),
                accepted_per_position=list(per_position[1]), turns=[turn])


@pytest.fixture
def rows():
    return [
        # prompt a: plain 10 tok/s and 20 tok/s over two repeats -> median 15; draft 30 tok/s -> 2.0x
        _row("a", "code", "autoregressive", 0, 100, 10.0),
        _row("a", "code", "autoregressive", 0, 100, 5.0, repeat=1),
        _row("a", "code", "draft", 2, 100, 100 / 30, forwards=40, drafted=80, accepted=60,
             per_position=((40, 40), (35, 25))),
        _row("a", "code", "draft", 2, 100, 100 / 30, repeat=1, forwards=40, drafted=80, accepted=60,
             per_position=((40, 40), (35, 25))),
        # prompt b: plain 10 tok/s; draft 10 tok/s -> 1.0x, and its tokens differ from plain's
        _row("b", "chat", "autoregressive", 0, 50, 5.0),
        _row("b", "chat", "draft", 2, 50, 5.0, forwards=50, drafted=100, accepted=0, per_position=((50, 50), (0, 0)),
             token_ids=[7] * 50),
        _row("b", "chat", "draft", 2, 50, 5.0, repeat=1, forwards=50, drafted=100, accepted=0,
             per_position=((50, 50), (0, 0))),
        # a failed generation is listed, not counted
        dict(_row("c", "chat", "draft", 2, 0, 0.0), error="the prompt has 999 tokens but ..."),
    ]


def test_speedup_is_the_mean_of_per_prompt_median_ratios(rows):
    report = build_report(rows, {"target": "t", "draft": "d"})
    block = report["temperatures"]["0"]
    overall = block["categories"][OVERALL]["draft k=2"]
    assert overall["speedup"] == pytest.approx(statistics.fmean([30 / 15, 10 / 10]))
    assert overall["speedup_std"] == pytest.approx(statistics.pstdev([2.0, 1.0]))
    assert (overall["speedup_min"], overall["speedup_max"]) == pytest.approx((1.0, 2.0))
    assert block["categories"]["code"]["draft k=2"]["speedup"] == pytest.approx(2.0)
    assert block["categories"]["chat"]["draft k=2"]["speedup"] == pytest.approx(1.0)
    assert overall["decode_speedup"] == pytest.approx(1.5)  # every row here spends 90% of its time decoding
    assert overall["mean_accepted_length"] == pytest.approx(300 / 180)
    assert overall["acceptance_rate"] == pytest.approx(120 / 360)
    assert overall["acceptance_per_position"] == pytest.approx([70 / 180, 50 / 180])
    assert block["categories"][OVERALL]["autoregressive"]["speedup"] == pytest.approx(1.0)
    assert report["failed"] == [{"question_id": "c", "error": "the prompt has 999 tokens but ..."}]


def test_greedy_equality_names_the_prompts_that_differ(rows):
    report = build_report(rows)
    assert report["greedy_equality"] == {"draft k=2": {"identical": 1, "total": 2, "differing": ["b"]}}


def test_renders_name_every_method_and_category(rows):
    report = build_report(rows, {"target": "t", "draft": "d", "max_new_tokens": 100})
    text, markdown = to_text(report), to_markdown(report, ["speedup.png"])
    for needle in ("draft k=2", "code", "chat", "1.50x ±0.50", "1/2", "failed: c"):
        assert needle in text and needle.replace("failed: c", "failed: `c`") in markdown
    assert "![speedup.png](speedup.png)" in markdown
    json.dumps(report)  # JSON-able


def test_a_recorded_run_reports_and_plots(tmp_path):
    info, rows = read_results(RECORDED)
    assert info["kind"] == "run" and len(rows) == 2 * 5 * 2 * 2  # prompts x methods x temperatures x repeats
    report = build_report(rows, info)
    assert set(report["temperatures"]) == {"0", "0.7"}
    assert report["greedy_equality"] and all(cell["identical"] == cell["total"] == 2
                                             for cell in report["greedy_equality"].values())
    for block in report["temperatures"].values():
        assert block["labels"][0] == "autoregressive"
        assert set(block["categories"]) == {"one", "two", OVERALL}
        for stats in block["categories"][OVERALL].values():
            assert stats["prompts"] == 2 and stats["generations"] == 4 and stats["speedup"] > 0
    paths = write_plots(report, tmp_path)
    assert sorted(p.name for p in paths) == ["figure1-draft.png", "figure1-ngram.png", "speedup.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def test_a_file_that_is_not_results_is_refused(tmp_path):
    bad = tmp_path / "results.jsonl"
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match="not JSON"):
        read_results(bad)


def _variant(row, *, k=None, lenience=1.0, **extra):
    """A copy of a hand-made row as another k (e.g. auto) and/or lenience, labelled as the harness labels it."""
    from specdec.bench.harness import MethodSpec

    k = row["k"] if k is None else k
    return dict(row, k=k, lenience=lenience, label=MethodSpec(row["method"], k, lenience).label, **extra)


def test_auto_k_and_lossy_rows_get_their_own_labels_quality_and_percentiles(rows, tmp_path):
    from specdec.bench.report import is_fixed_k

    plain = [r for r in rows if r["method"] == "autoregressive"]
    draft = [r for r in rows if r["method"] == "draft" and not r.get("error")]
    scored = [dict(r, target_logprob=-0.5 * r["tokens"]) for r in plain]
    auto = [_variant(r, k="auto", target_logprob=-0.5 * r["tokens"]) for r in draft]
    lossy = [_variant(r, lenience=0.5, target_logprob=-0.9 * r["tokens"], token_ids=[9]) for r in draft]
    lossy[0]["passed"], lossy[2]["passed"] = True, False
    report = build_report([*scored, *draft, *auto, *lossy])
    block = report["temperatures"]["0"]
    assert block["labels"] == ["autoregressive", "draft k=2", "draft k=auto", "draft k=2 l=0.5"]
    assert [is_fixed_k(block["methods"][label]) for label in block["labels"]] == [False, True, False, False]
    # Lossy rows are left out of the greedy-equality count (they are measured for drift instead).
    assert set(report["greedy_equality"]) == {"draft k=2", "draft k=auto"}
    overall = block["categories"][OVERALL]
    assert overall["draft k=2 l=0.5"]["mean_logprob"] == pytest.approx(-0.9)
    assert overall["autoregressive"]["mean_logprob"] == pytest.approx(-0.5)
    assert (overall["draft k=2 l=0.5"]["humaneval_passed"], overall["draft k=2 l=0.5"]["humaneval_tested"]) == (1, 2)
    assert "mean_logprob" not in overall["draft k=2"]  # nothing scored, nothing claimed
    # Per-prompt seconds (median over repeats): prompt a 100/30 s, prompt b 5 s.
    assert overall["draft k=auto"]["prompt_seconds_p50"] == pytest.approx((100 / 30 + 5) / 2)
    assert overall["draft k=auto"]["prompt_seconds_p90"] == pytest.approx(100 / 30 + 0.9 * (5 - 100 / 30))
    text = to_text(report)
    assert "Quality drift" in text and "draft k=2 l=0.5 (lossy)" in text and "-0.400" in text and "50% (1/2)" in text
    # auto against the best fixed k per category; here auto and k=2 ran in the same times.
    from specdec.bench.report import _adaptive_tables

    adaptive = _adaptive_tables(block)["draft"]
    assert [row[0] for row in adaptive] == ["code", "chat", OVERALL]
    assert adaptive[0] == ["code", "2", "2.00x", "-", "2.00x", "1.00", "-"]
    assert "draft k=auto against fixed k" in text
    paths = write_plots(report, tmp_path)  # auto and lossy rows stay out of the k-curves; scored rows get quality.png
    assert sorted(p.name for p in paths) == ["quality.png", "speedup.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)
