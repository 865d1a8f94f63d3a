"""Theory next to measurement: predicted tau and speedup per k beside what `specdec bench` measured.

Two predictions per (category, k):
  Leviathan   (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)) (Theorem 3.8): verification
              costs one target step whatever k is;
  with costs  expected tokens x target step / (k draft steps + the measured
              (k + 1)-token verification pass): the same alpha, the real price of
              scoring k + 1 tokens on this machine.
The ratio measured / predicted says how much of the promise survived. What is
left between 'with costs' and 'measured' is what the closed form leaves out:
alpha varies along a text (accepts cluster), the loop's own overhead, and the
draft's catch-up over tokens it did not propose.
"""

from __future__ import annotations

import math

from specdec.analysis.measure import ForwardTimes
from specdec.bench.report import is_fixed_k
from specdec.planning.theory import expected_tokens_per_loop, optimal_k, walltime_speedup


def prediction_rows(alpha: dict[str, dict], costs: ForwardTimes, ks: list[int],
                    measured: dict[str, dict[int, dict]] | None = None) -> list[dict]:
    """alpha: category -> {'alpha': ...}; measured: category -> k -> report stats (decode_speedup, tau)."""
    rows = []
    for category, entry in alpha.items():
        a = min(entry["alpha"], 1.0)
        for k in ks:
            tau = expected_tokens_per_loop(a, k)
            with_costs = tau * costs.target_step_s / (k * costs.draft_step_s + costs.verify_s(k))
            row = dict(category=category, k=k, alpha=a, tau_predicted=tau,
                       speedup_leviathan=walltime_speedup(a, k, costs.c), speedup_with_costs=with_costs,
                       optimal_k=optimal_k(a, costs.c, max_k=16))
            got = (measured or {}).get(category, {}).get(k)
            if got:
                # Decode only: the closed forms know nothing of the prefill both methods share.
                speedup = got.get("decode_speedup", got["speedup"])
                row.update(tau_measured=got["mean_accepted_length"], speedup_measured=speedup,
                           measured_over_leviathan=speedup / row["speedup_leviathan"],
                           measured_over_with_costs=speedup / with_costs)
            rows.append(row)
    return rows


def measured_by_category(temperature_block: dict, method: str = "draft") -> dict[str, dict[int, dict]]:
    """A bench report's temperature block -> category -> k -> stats, for one method."""
    labels = {label: meta["k"] for label, meta in temperature_block["methods"].items()
              if meta["method"] == method and is_fixed_k(meta)}
    return {category: {k: cells[label] for label, k in labels.items() if label in cells}
            for category, cells in temperature_block["categories"].items()}


def _fmt(value, pattern: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, pattern)


def render(rows: list[dict], costs: ForwardTimes, temperature: float, markdown: bool = False) -> str:
    header = ["category", "k", "alpha", "tau pred", "tau meas", "speedup Leviathan", "with costs", "measured*",
              "meas/Lev", "meas/costs", "best k"]
    body = [[r["category"], str(r["k"]), f"{r['alpha']:.3f}", f"{r['tau_predicted']:.2f}",
             _fmt(r.get("tau_measured"), ".2f"), f"{r['speedup_leviathan']:.2f}x", f"{r['speedup_with_costs']:.2f}x",
             _fmt(r.get("speedup_measured"), ".2f") + ("x" if "speedup_measured" in r else ""),
             _fmt(r.get("measured_over_leviathan"), ".2f"), _fmt(r.get("measured_over_with_costs"), ".2f"),
             str(r["optimal_k"])] for r in rows]
    verify = ", ".join(f"{w}: {1000 * s:.1f}" for w, s in sorted(costs.target_verify_s.items()))
    title = (f"temperature {temperature:g}: c = {costs.c:.3f} (draft step {1000 * costs.draft_step_s:.1f} ms / "
             f"target step {1000 * costs.target_step_s:.1f} ms at context {costs.context}); "
             f"target pass ms by tokens scored: {verify}")
    if markdown:
        lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body]) + "\n"
    widths = [max(len(x) for x in column) for column in zip(header, *body)]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(header, widths))]
    return "\n".join(lines + ["  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in body])
