"""From bench rows to a report: per category and overall, per temperature and method.

Speedup follows docs/architecture.md ("Words"): tokens/s of the method over tokens/s of plain
decoding, same prompts, same run. Per prompt, repeats are reduced to their
median tokens/s first (these machines are noisy); the reported speedup is the
mean of the per-prompt ratios (Spec-Bench's convention) with its standard
deviation, min and max, next to the ratio of summed tokens over summed time.

At temperature 0 every exact method must reproduce plain decoding token for
token; the report counts the prompts where it does (all turns, repeat 0).
Lossy settings (lenience < 1) are kept out of that count; their drift is
reported instead (bench/quality.py): mean log-likelihood under the target and
HumanEval pass@1, next to the speedup.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from specdec.bench.harness import AUTOREGRESSIVE

OVERALL = "overall"


def is_fixed_k(meta: dict) -> bool:
    """A bench report's method entry with one fixed k >= 1 and exact verification (what the k-curves plot)."""
    return isinstance(meta["k"], int) and meta["k"] > 0 and meta.get("lenience", 1.0) == 1.0


def _median_rate(rows: list[dict], seconds: str = "seconds") -> float:
    return statistics.median(r["tokens"] / r[seconds] for r in rows)


def _method_stats(rows: list[dict], plain_rate: dict[str, float], plain_decode_rate: dict[str, float]) -> dict:
    """Numbers of one (temperature, category, method) cell."""
    by_prompt: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_prompt[row["question_id"]].append(row)
    ratios = [_median_rate(group) / plain_rate[qid] for qid, group in by_prompt.items() if qid in plain_rate]
    # Decode only (prefill left out): what the closed forms of planning/theory.py predict.
    decode_ratios = [_median_rate(group, "decode_seconds") / plain_decode_rate[qid]
                     for qid, group in by_prompt.items() if qid in plain_decode_rate]
    tokens = sum(r["tokens"] for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    forwards = sum(r["target_forwards"] for r in rows)
    drafted = sum(r["drafted_tokens"] for r in rows)
    accepted = sum(r["accepted_tokens"] for r in rows)
    width = max((len(r["drafted_per_position"]) for r in rows), default=0)
    per_position = []
    for j in range(width):
        d = sum(r["drafted_per_position"][j] for r in rows if j < len(r["drafted_per_position"]))
        a = sum(r["accepted_per_position"][j] for r in rows if j < len(r["accepted_per_position"]))
        per_position.append(a / d if d else 0.0)
    # Chen et al. Figure 1: time for N tokens (spread over prompts) and time per loop.
    seconds_per_token = [r["seconds"] / r["tokens"] for r in rows if r["tokens"]]
    prompt_seconds = sorted(statistics.median(r["seconds"] for r in group) for group in by_prompt.values())
    return dict(
        prompts=len(by_prompt), generations=len(rows), tokens=tokens, seconds=seconds, drafted_tokens=drafted,
        tokens_per_s=tokens / seconds if seconds else 0.0,
        speedup=statistics.fmean(ratios) if ratios else math.nan,
        speedup_std=statistics.pstdev(ratios) if len(ratios) > 1 else 0.0,
        speedup_min=min(ratios, default=math.nan), speedup_max=max(ratios, default=math.nan),
        decode_speedup=statistics.fmean(decode_ratios) if decode_ratios else math.nan,
        mean_accepted_length=tokens / forwards if forwards else 0.0,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        acceptance_per_position=per_position,
        ms_per_loop=1000 * sum(r["decode_seconds"] for r in rows) / forwards if forwards else 0.0,
        ms_per_token=[1000 * s for s in seconds_per_token],
        drafted_per_step=drafted / forwards if forwards else 0.0,
        prompt_seconds_p50=_quantile(prompt_seconds, 0.5), prompt_seconds_p90=_quantile(prompt_seconds, 0.9),
        **_quality(rows),
    )


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default); nan for no values."""
    if not sorted_values:
        return math.nan
    position = q * (len(sorted_values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def _quality(rows: list[dict]) -> dict:
    """Mean log-likelihood per token under the target and HumanEval pass@1, where measured (bench/quality.py)."""
    scored = [r for r in rows if "target_logprob" in r]
    out: dict = {}
    if scored:
        out["mean_logprob"] = sum(r["target_logprob"] for r in scored) / max(sum(r["tokens"] for r in scored), 1)
    tested = [r for r in rows if "passed" in r]
    if tested:
        out["humaneval_passed"] = sum(bool(r["passed"]) for r in tested)
        out["humaneval_tested"] = len(tested)
    return out


def _greedy_equality(rows: list[dict]) -> dict[str, dict]:
    """At temperature 0: per method, the prompts whose every turn equals plain decoding's tokens."""
    plain = {r["question_id"]: [t["token_ids"] for t in r["turns"]] for r in rows
             if r["method"] == AUTOREGRESSIVE and r["temperature"] == 0 and r["repeat"] == 0}
    out: dict[str, dict] = {}
    for row in rows:
        if row["method"] == AUTOREGRESSIVE or row["temperature"] != 0 or row["repeat"] != 0:
            continue
        if row.get("lenience", 1.0) != 1.0:  # lossy by design: measured by the quality table instead
            continue
        if row["question_id"] not in plain:
            continue
        cell = out.setdefault(row["label"], {"identical": 0, "total": 0, "differing": []})
        cell["total"] += 1
        if [t["token_ids"] for t in row["turns"]] == plain[row["question_id"]]:
            cell["identical"] += 1
        else:
            cell["differing"].append(row["question_id"])
    return out


def same_variant(a: dict, b: dict) -> bool:
    """Two report methods that differ at most in k (same method, same tree size)."""
    return a["method"] == b["method"] and a.get("tree_size") == b.get("tree_size")


def _label_order(row: dict) -> tuple:
    """Plain first; then by method, exact before lossy, fixed k ascending, auto last."""
    k, size = row["k"], row.get("tree_size")
    return (row["method"] != AUTOREGRESSIVE, row["method"], -row.get("lenience", 1.0), isinstance(k, str),
            k if isinstance(k, int) else 0, isinstance(size, str), size if isinstance(size, int) else -1)


def build_report(rows: list[dict], run_info: dict | None = None) -> dict:
    """JSON-able: {run, failed, temperatures: {T: {methods, categories: {cat: {label: stats}}}}, greedy_equality}."""
    good = [r for r in rows if not r.get("error") and r["tokens"] > 0 and r["seconds"] > 0]
    failed = sorted({(r["question_id"], r["error"]) for r in rows if r.get("error")})
    report: dict = {"run": {k: v for k, v in (run_info or {}).items() if k != "kind"},
                    "failed": [{"question_id": q, "error": e} for q, e in failed], "temperatures": {}}
    for temperature in sorted({r["temperature"] for r in good}):
        at_t = [r for r in good if r["temperature"] == temperature]
        plain_rows: dict[str, list[dict]] = defaultdict(list)
        for row in at_t:
            if row["method"] == AUTOREGRESSIVE:
                plain_rows[row["question_id"]].append(row)
        plain_rate = {qid: _median_rate(group) for qid, group in plain_rows.items()}
        plain_decode_rate = {qid: _median_rate(group, "decode_seconds") for qid, group in plain_rows.items()}
        labels = list(dict.fromkeys(r["label"] for r in sorted(at_t, key=_label_order)))
        categories = list(dict.fromkeys(r["category"] for r in at_t))
        cells: dict[str, dict[str, dict]] = {}
        for category in [*categories, OVERALL]:
            in_category = [r for r in at_t if category in (OVERALL, r["category"])]
            cells[category] = {}
            for label in labels:
                chosen = [r for r in in_category if r["label"] == label]
                if chosen:
                    cells[category][label] = _method_stats(chosen, plain_rate, plain_decode_rate)
        methods = {r["label"]: {"method": r["method"], "k": r["k"], "lenience": r.get("lenience", 1.0),
                                "tree_size": r.get("tree_size")} for r in at_t}
        report["temperatures"][f"{temperature:g}"] = {"labels": labels, "methods": methods, "categories": cells}
    report["greedy_equality"] = _greedy_equality(good)
    return report


# ---- rendering --------------------------------------------------------------------------------


def _speedup_text(stats: dict) -> str:
    return f"{stats['speedup']:.2f}x ±{stats['speedup_std']:.2f}"


def _tables(report: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of every table; rendered as text or Markdown."""
    tables = []
    for temperature, block in report["temperatures"].items():
        categories = [c for c in block["categories"] if c != OVERALL]
        header = ["method", *categories, OVERALL, "tau", "accept"]
        body = []
        for label in block["labels"]:
            overall = block["categories"][OVERALL].get(label)
            if overall is None:
                continue
            body.append([label, *(_speedup_text(block["categories"][c][label]) if label in block["categories"][c]
                                  else "-" for c in categories),
                         _speedup_text(overall), f"{overall['mean_accepted_length']:.2f}",
                         f"{overall['acceptance_rate']:.1%}" if overall["drafted_tokens"] else "-"])
        tables.append((f"Speedup over plain decoding, temperature {temperature} (mean of per-prompt ratios ± std)",
                       header, body))
        detail_header = ["method", "tok/s", "speedup", "min..max", "decode only", "s/prompt p50", "p90", "tau",
                         "drafted/step", "accept", "ms/loop", "accept per position"]
        detail = []
        for label in block["labels"]:
            s = block["categories"][OVERALL].get(label)
            if s is None:
                continue
            detail.append([label, f"{s['tokens_per_s']:.2f}", _speedup_text(s),
                           f"{s['speedup_min']:.2f}..{s['speedup_max']:.2f}", f"{s['decode_speedup']:.2f}x",
                           f"{s['prompt_seconds_p50']:.1f}", f"{s['prompt_seconds_p90']:.1f}",
                           f"{s['mean_accepted_length']:.2f}", f"{s['drafted_per_step']:.2f}",
                           f"{s['acceptance_rate']:.1%}" if s["drafted_tokens"] else "-", f"{s['ms_per_loop']:.1f}",
                           " ".join(f"{a:.2f}" for a in s["acceptance_per_position"]) or "-"])
        tables.append((f"All prompts, temperature {temperature}", detail_header, detail))
        for method, adaptive_rows in _adaptive_tables(block).items():
            tables.append((f"{method} k=auto against fixed k, temperature {temperature} (speedup; best = the best "
                           "fixed k of that category, chosen after the fact)",
                           ["category", "best fixed k", "best", "k=4", "auto", "auto / best", "auto / k=4"],
                           adaptive_rows))
        quality = _quality_table(block)
        if quality:
            tables.append((f"Quality drift, temperature {temperature}: mean log-likelihood per token under the "
                           "target (higher = closer to what the target prefers) and HumanEval pass@1",
                           ["method", "speedup", "mean log-lik", "vs plain", "HumanEval pass@1"], quality))
    if report["greedy_equality"]:
        rows = [[label, f"{cell['identical']}/{cell['total']}", ", ".join(cell["differing"]) or "-"]
                for label, cell in report["greedy_equality"].items()]
        tables.append(("Temperature 0: output identical to plain decoding (prompts, all turns)",
                       ["method", "identical", "differing prompts"], rows))
    return tables


def _adaptive_tables(block: dict) -> dict[str, list[list[str]]]:
    """Per method that ran with k=auto and with fixed k (exact verification): one row per category."""
    tables = {}
    for auto_label, meta in block["methods"].items():
        if meta["k"] != "auto" or meta.get("lenience", 1.0) != 1.0:
            continue
        fixed = {m["k"]: label for label, m in block["methods"].items()
                 if same_variant(m, meta) and is_fixed_k(m)}
        if not fixed:
            continue
        rows = []
        for category, cells in block["categories"].items():
            if auto_label not in cells or not any(label in cells for label in fixed.values()):
                continue
            best_k = max((k for k, label in fixed.items() if label in cells),
                         key=lambda k: cells[fixed[k]]["speedup"])
            best, auto = cells[fixed[best_k]]["speedup"], cells[auto_label]["speedup"]
            k4 = cells[fixed[4]]["speedup"] if 4 in fixed and fixed[4] in cells else None
            rows.append([category, str(best_k), f"{best:.2f}x", f"{k4:.2f}x" if k4 else "-", f"{auto:.2f}x",
                         f"{auto / best:.2f}", f"{auto / k4:.2f}" if k4 else "-"])
        size = meta.get("tree_size")
        tables[meta["method"] if size is None else f"{meta['method']} tree={size}"] = rows
    return tables


def _quality_table(block: dict) -> list[list[str]]:
    overall = block["categories"][OVERALL]
    plain = next((overall[label] for label in block["labels"] if block["methods"][label]["k"] == 0
                  and label in overall), {})
    rows = []
    for label in block["labels"]:
        s = overall.get(label)
        if s is None or "mean_logprob" not in s:
            continue
        drift = f"{s['mean_logprob'] - plain['mean_logprob']:+.3f}" if "mean_logprob" in plain else "-"
        passed = (f"{s['humaneval_passed'] / s['humaneval_tested']:.0%} ({s['humaneval_passed']}/"
                  f"{s['humaneval_tested']})" if s.get("humaneval_tested") else "-")
        lossy = " (lossy)" if block["methods"][label].get("lenience", 1.0) < 1 else ""
        speedup = "1.00x" if block["methods"][label]["k"] == 0 else _speedup_text(s)
        rows.append([label + lossy, speedup, f"{s['mean_logprob']:.3f}", drift, passed])
    return rows


def _run_line(report: dict) -> str:
    run = report["run"]
    parts = [f"{name} {run[name]}" for name in ("target", "draft", "backend", "device", "machine",
                                                  "max_new_tokens", "prompts") if run.get(name) is not None]
    return "; ".join(parts)


def to_text(report: dict) -> str:
    out = [_run_line(report)] if report["run"] else []
    for title, header, rows in _tables(report):
        widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
        out += ["", title, "  ".join(h.ljust(w) for h, w in zip(header, widths))]
        out += ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in rows]
    for failure in report["failed"]:
        out.append(f"failed: {failure['question_id']}: {failure['error']}")
    out.append("\ntau = mean accepted length (tokens per target forward); accept = accepted / drafted tokens; "
               "decode only = the speedup without the prefill")
    return "\n".join(out)


def to_markdown(report: dict, plots: list[str] = ()) -> str:
    out = ["# specdec bench report", ""]
    if report["run"]:
        out += [_run_line(report), ""]
    for title, header, rows in _tables(report):
        out += [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(row) + " |" for row in rows]
        out.append("")
    for failure in report["failed"]:
        out.append(f"- failed: `{failure['question_id']}`: {failure['error']}")
    for plot in plots:
        out += [f"![{plot}]({plot})", ""]
    out.append("tau = mean accepted length (tokens per target forward); accept = accepted / drafted tokens; "
               "speedup = tokens/s over plain decoding's on the same prompt in the same run.")
    return "\n".join(out) + "\n"
