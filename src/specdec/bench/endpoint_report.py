"""From `specdec bench --endpoint` rows to a report: per temperature, category and endpoint.

tokens/s is each generation's completion tokens over its wall time (request sent to stream
closed); the ratio to the reference (the first endpoint) follows the local report's rule:
per prompt, the median over repeats, then the mean of the per-prompt ratios. TTFT is the time
to the first non-empty content chunk; ITL spreads the time from the first to the last content
chunk over the tokens after the first (a server may send several tokens per chunk).
Acceptance comes from the server where it tells (specdec's `speculative` block, vLLM's
spec_decode counters): acceptance rate = accepted / drafted tokens, tau = 1 + accepted /
verification steps. At temperature 0 the report counts the prompts whose every turn's text
equals the reference's: the same model speculated or not should write the same answer.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from specdec.bench.report import OVERALL, _quantile


def _median_rates(rows: list[dict]) -> dict[str, float]:
    by_prompt: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        by_prompt[row["question_id"]].append(row["tokens_per_s"])
    return {qid: statistics.median(rates) for qid, rates in by_prompt.items()}


def _cell(rows: list[dict], reference_rate: dict[str, float]) -> dict:
    """The numbers of one (temperature, category, endpoint) cell."""
    rates = _median_rates(rows)
    ratios = [rate / reference_rate[qid] for qid, rate in rates.items() if reference_rate.get(qid)]
    turns = [t for r in rows for t in r["turns"]]
    ttft = sorted(t["ttft_seconds"] for t in turns if t.get("ttft_seconds") is not None)
    itl = sorted(t["itl_seconds"] for t in turns if t.get("itl_seconds") is not None)
    known = [r for r in rows if r.get("drafted_tokens") is not None]
    drafted = sum(r["drafted_tokens"] for r in known)
    accepted = sum(r["accepted_tokens"] for r in known)
    steps = sum(r["verify_steps"] or 0 for r in known)
    return dict(
        prompts=len(rates), generations=len(rows), tokens=sum(r["tokens"] for r in rows),
        tokens_per_s_p50=statistics.median(r["tokens_per_s"] for r in rows),
        ratio=statistics.fmean(ratios) if ratios else math.nan,
        ratio_std=statistics.pstdev(ratios) if len(ratios) > 1 else 0.0,
        ttft_ms_p50=1000 * _quantile(ttft, 0.5), ttft_ms_p99=1000 * _quantile(ttft, 0.99),
        itl_ms_p50=1000 * _quantile(itl, 0.5),
        acceptance_rate=accepted / drafted if known and drafted else None,
        mean_accepted_length=1 + accepted / steps if known and steps else None,
        acceptance_source=known[0]["turns"][0]["acceptance_source"] if known and known[0]["turns"] else None,
    )


def _identical(rows: list[dict], reference: str) -> dict[str, dict]:
    """At temperature 0, repeat 0: per endpoint, the prompts whose every turn's text is the reference's."""
    texts = {r["question_id"]: [t["text"] for t in r["turns"]] for r in rows
             if r["endpoint"] == reference and r["temperature"] == 0 and r["repeat"] == 0}
    out: dict[str, dict] = {}
    for row in rows:
        if row["endpoint"] == reference or row["temperature"] != 0 or row["repeat"] != 0 \
                or row["question_id"] not in texts:
            continue
        cell = out.setdefault(row["endpoint"], {"identical": 0, "total": 0, "differing": []})
        cell["total"] += 1
        if [t["text"] for t in row["turns"]] == texts[row["question_id"]]:
            cell["identical"] += 1
        else:
            cell["differing"].append(row["question_id"])
    return out


def build_endpoint_report(rows: list[dict], info: dict) -> dict:
    """JSON-able: {run, reference, endpoints, failed, temperatures: {T: {categories: {cat: {label: cell}}}},
    identical_at_t0: {label: {identical, total, differing}}}."""
    endpoints = [e["label"] for e in info.get("endpoints", [])] or list(dict.fromkeys(r["endpoint"] for r in rows))
    reference = info.get("reference", endpoints[0] if endpoints else None)
    good = [r for r in rows if not r.get("error") and r["tokens"] > 0 and r["seconds"] > 0]
    report: dict = {"run": {k: v for k, v in info.items() if k != "kind"}, "reference": reference,
                    "endpoints": endpoints, "temperatures": {},
                    "failed": [{"question_id": r["question_id"], "endpoint": r["endpoint"], "error": r["error"]}
                               for r in rows if r.get("error")]}
    for temperature in sorted({r["temperature"] for r in good}):
        at_t = [r for r in good if r["temperature"] == temperature]
        reference_rate = _median_rates([r for r in at_t if r["endpoint"] == reference])
        cells: dict[str, dict] = {}
        for category in [*dict.fromkeys(r["category"] for r in at_t), OVERALL]:
            chosen = [r for r in at_t if category in (OVERALL, r["category"])]
            cells[category] = {label: _cell([r for r in chosen if r["endpoint"] == label], reference_rate)
                               for label in endpoints if any(r["endpoint"] == label for r in chosen)}
        report["temperatures"][f"{temperature:g}"] = {"categories": cells}
    report["identical_at_t0"] = _identical(good, reference)
    return report


# ---- rendering --------------------------------------------------------------------------------


def _number(value, digits: int = 1, suffix: str = "") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}{suffix}"


def _tables(report: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    reference = report["reference"]
    header = ["category", "endpoint", "gens", "tok/s p50", f"vs {reference}", "TTFT p50 ms", "TTFT p99 ms",
              "ITL p50 ms", "accept", "tau"]
    tables = []
    for temperature, block in report["temperatures"].items():
        rows = []
        for category, cells in block["categories"].items():
            for label, cell in cells.items():
                ratio = "1.00x (ref)" if label == reference else \
                    f"{_number(cell['ratio'], 2)}x ±{cell['ratio_std']:.2f}"
                rows.append([category, label, str(cell["generations"]), _number(cell["tokens_per_s_p50"]), ratio,
                             _number(cell["ttft_ms_p50"]), _number(cell["ttft_ms_p99"]), _number(cell["itl_ms_p50"], 2),
                             _number(cell["acceptance_rate"], 2), _number(cell["mean_accepted_length"], 2)])
        tables.append((f"temperature {temperature}", header, rows))
    return tables


def _identity_lines(report: dict) -> list[str]:
    lines = []
    for label, cell in report["identical_at_t0"].items():
        line = f"temperature 0: {label} wrote the same text as {report['reference']} on {cell['identical']}/" \
               f"{cell['total']} prompts"
        if cell["differing"]:
            line += f" (differing: {', '.join(cell['differing'][:5])}{' ...' if len(cell['differing']) > 5 else ''})"
        lines.append(line)
    return lines


def _setup(speculative: dict | None) -> str:
    """specdec's published setup: ", draft k=3", ", autoregressive", ", draft k=3 lenience 0.05 LOSSY"."""
    if not speculative:
        return ""
    text = f", {speculative.get('method')}"
    text += f" k={speculative.get('k')}" if speculative.get("method") != "autoregressive" else ""
    return text + (f" lenience {speculative['lenience']:g} LOSSY" if speculative.get("lossy") else "")


def _run_line(report: dict) -> str:
    endpoints = report["run"].get("endpoints", [])
    parts = [f"{e['label']} = {e['url']} ({e['model']}{_setup(e.get('speculative'))})" for e in endpoints]
    run = report["run"]
    settings = [f"{name} {run[name]}" for name in ("max_new_tokens", "prompts", "prompt_sets") if name in run]
    return "; ".join(parts + settings)


NOTES = ("tok/s = completion tokens / wall time per generation; vs = mean over prompts of tok/s over the "
         "reference's on the same prompt, same run; TTFT = time to the first content chunk; ITL = (last chunk - "
         "first chunk) / (tokens - 1); accept = accepted / drafted tokens and tau = 1 + accepted / verification "
         "steps, where the server reports them (specdec's `speculative` block, vLLM's spec_decode counters)")


def to_text(report: dict) -> str:
    out = [_run_line(report)]
    for title, header, rows in _tables(report):
        widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
        out += ["", title, "  ".join(h.ljust(w) for h, w in zip(header, widths))]
        out += ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in rows]
    out += ["", *_identity_lines(report)]
    out += [f"failed: {f['endpoint']} {f['question_id']}: {f['error']}" for f in report["failed"]]
    return "\n".join(out + ["", NOTES])


def to_markdown(report: dict, plots: list[str] = ()) -> str:
    out = ["# specdec bench: endpoints", "", _run_line(report), ""]
    for title, header, rows in _tables(report):
        out += [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(row) + " |" for row in rows] + [""]
    out += [f"- {line}" for line in _identity_lines(report)]
    out += [f"- failed: {f['endpoint']} `{f['question_id']}`: {f['error']}" for f in report["failed"]]
    out += [""] + [f"![{plot}]({plot})\n" for plot in plots] + [NOTES]
    return "\n".join(out) + "\n"


# ---- plots ------------------------------------------------------------------------------------


def endpoint_plots(report: dict, directory: Path) -> list[Path]:
    """throughput.png: tokens/s per category and endpoint, one panel per temperature;
    latency.png: TTFT (p50, p99) and ITL (p50) per endpoint over all categories."""
    from specdec.bench.plots import _pyplot

    plt = _pyplot()
    blocks = report["temperatures"]
    if not blocks:
        return []
    endpoints = report["endpoints"]
    fig, axes = plt.subplots(len(blocks), 1, figsize=(11, 3.6 * len(blocks)), squeeze=False)
    width = 0.8 / max(len(endpoints), 1)
    for ax, (temperature, block) in zip(axes[:, 0], blocks.items()):
        categories = list(block["categories"])
        for i, label in enumerate(endpoints):
            cells = [block["categories"][c].get(label) for c in categories]
            xs = [j + (i - (len(endpoints) - 1) / 2) * width for j in range(len(categories))]
            bars = ax.bar(xs, [c["tokens_per_s_p50"] if c else 0 for c in cells], width, label=label)
            if label != report["reference"]:
                ax.bar_label(bars, [f"{c['ratio']:.2f}x" if c and not math.isnan(c["ratio"]) else "" for c in cells],
                             fontsize=7)
        ax.set_xticks(range(len(categories)), categories, rotation=20)
        ax.set_ylabel("tokens/s (median)")
        ax.set_title(f"temperature {temperature} (labels: ratio to {report['reference']})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths = [directory / "throughput.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / len(blocks)
    for i, (temperature, block) in enumerate(blocks.items()):
        overall = block["categories"][OVERALL]
        xs = [j + (i - (len(blocks) - 1) / 2) * width for j in range(len(endpoints))]
        cells = [overall.get(label) or {} for label in endpoints]
        bars = axes[0].bar(xs, [c.get("ttft_ms_p50", 0) for c in cells], width, label=f"T={temperature}")
        axes[0].scatter(xs, [c.get("ttft_ms_p99", 0) for c in cells], marker="_", s=200,
                        color=bars.patches[0].get_facecolor(), zorder=3)
        axes[1].bar(xs, [c.get("itl_ms_p50", 0) for c in cells], width, label=f"T={temperature}")
    axes[0].set(ylabel="ms", title="time to first token (bars p50, dashes p99)")
    axes[1].set(ylabel="ms per token", title="inter-token latency (p50)")
    for ax in axes:
        ax.set_xticks(range(len(endpoints)), endpoints)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(directory / "latency.png")
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def write_endpoint_report(info: dict, rows: list[dict], out_dir: str | Path, plots: bool = True) -> int:
    """OUT/report.json, OUT/report.md and the plots; the tables on stdout."""
    import sys

    out_dir = Path(out_dir)
    report = build_endpoint_report(rows, info)
    plot_names = [p.name for p in endpoint_plots(report, out_dir)] if plots else []
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    (out_dir / "report.md").write_text(to_markdown(report, plot_names))
    print(to_text(report))
    print(f"\nwrote {out_dir / 'report.md'}, {out_dir / 'report.json'}"
          + (f" and {', '.join(plot_names)}" if plot_names else ""), file=sys.stderr, flush=True)
    return 0
