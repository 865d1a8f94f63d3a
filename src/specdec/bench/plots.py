"""PNG plots of a bench report (matplotlib, no screen needed).

speedup.png          speedup per category and method, one panel per temperature;
figure1-<method>.png the three panels of Chen et al. 2023 (arXiv 2302.01318),
                     Figure 1, for one method over k (k = 0 is plain decoding):
                     time to generate N tokens vs k with its spread over prompts,
                     accepted tokens / (k + 1) vs k, and time per loop vs k.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from specdec.bench.report import OVERALL, is_fixed_k


def _model_names(report: dict) -> str:
    run = report["run"]
    return " / ".join(Path(str(run[name])).name for name in ("target", "draft") if run.get(name))


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plots need matplotlib: pip install 'specdec[bench]' (or pass --no-plots)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def speedup_plot(report: dict, path: Path) -> Path:
    plt = _pyplot()
    blocks = report["temperatures"]
    fig, axes = plt.subplots(len(blocks), 1, figsize=(11, 3.6 * len(blocks)), squeeze=False)
    for ax, (temperature, block) in zip(axes[:, 0], blocks.items()):
        categories = list(block["categories"])
        labels = [label for label in block["labels"] if block["methods"][label]["k"] != 0]
        width = 0.8 / max(len(labels), 1)
        for i, label in enumerate(labels):
            cells = [block["categories"][c].get(label) for c in categories]
            xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(categories))]
            ax.bar(xs, [s["speedup"] if s else 0 for s in cells], width,
                   yerr=[s["speedup_std"] if s else 0 for s in cells], capsize=2, label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(categories)), categories, rotation=20)
        ax.set_ylabel("speedup over plain")
        ax.set_title(f"temperature {temperature}")
        ax.legend(fontsize=7, ncol=min(len(labels), 6))
    fig.suptitle(f"specdec bench: {_model_names(report)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _k_series(block: dict, method: str) -> list[tuple[int, dict]]:
    """(k, overall stats) for plain decoding (k = 0) and every k of one method, ascending."""
    overall = block["categories"][OVERALL]
    series = [(0, overall[label]) for label in block["labels"] if block["methods"][label]["k"] == 0]
    series += sorted(((meta["k"], overall[label]) for label, meta in block["methods"].items()
                      if meta["method"] == method and meta.get("tree_size") is None and label in overall
                      and is_fixed_k(meta)), key=lambda x: x[0])
    return series


def figure1_plot(report: dict, method: str, path: Path) -> Path:
    """Chen et al. Figure 1 for `method`: one line per temperature."""
    plt = _pyplot()
    n_tokens = report["run"].get("max_new_tokens", 128)
    fig, (ax_time, ax_accept, ax_loop) = plt.subplots(1, 3, figsize=(14, 4))
    for temperature, block in report["temperatures"].items():
        series = _k_series(block, method)
        if len(series) < 2:
            continue
        ks = [k for k, _ in series]
        # Time for N tokens per prompt = N x its seconds per token; median and the 10..90% band.
        per_prompt = [[n_tokens * ms / 1000 for ms in s["ms_per_token"]] for _, s in series]
        middle = [statistics.median(v) for v in per_prompt]
        low = [sorted(v)[int(0.1 * (len(v) - 1))] for v in per_prompt]
        high = [sorted(v)[int(round(0.9 * (len(v) - 1)))] for v in per_prompt]
        line, = ax_time.plot(ks, middle, marker="o", label=f"T={temperature}")
        ax_time.fill_between(ks, low, high, alpha=0.2, color=line.get_color())
        ax_accept.plot(ks[1:], [s["mean_accepted_length"] / (k + 1) for k, s in series[1:]], marker="o",
                       label=f"T={temperature}")
        ax_loop.plot(ks, [s["ms_per_loop"] for _, s in series], marker="o", label=f"T={temperature}")
    ax_time.set(xlabel="k (0 = plain decoding)", ylabel=f"seconds for {n_tokens} tokens",
                title="time to generate (median, 10-90% of prompts)")
    ax_accept.set(xlabel="k", ylabel="accepted tokens / (k + 1)", title="tokens per loop / (k + 1)", ylim=(0, 1.05))
    ax_loop.set(xlabel="k (0 = plain decoding)", ylabel="ms per loop", title="time per loop (draft + verify)")
    all_ks = sorted({k for block in report["temperatures"].values() for k, _ in _k_series(block, method)})
    for ax in (ax_time, ax_accept, ax_loop):
        ax.set_xticks(all_ks if ax is not ax_accept else [k for k in all_ks if k > 0])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{method}: {_model_names(report)} (after Chen et al. 2023, Figure 1)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _scored(block: dict) -> list[tuple[str, dict]]:
    """(label, overall stats) of every method whose answers were scored under the target."""
    overall = block["categories"][OVERALL]
    return [(label, overall[label]) for label in block["labels"] if "mean_logprob" in overall.get(label, {})]


def quality_plot(report: dict, path: Path) -> Path:
    """Speed against quality: speedup (x) and mean log-likelihood per token under the target (y), one point
    per method; lossy settings in red. Exact methods sit at plain decoding's height up to sampling noise."""
    plt = _pyplot()
    blocks = {t: b for t, b in report["temperatures"].items() if len(_scored(b)) >= 2}
    fig, axes = plt.subplots(1, len(blocks), figsize=(5.5 * len(blocks), 4.2), squeeze=False)
    for ax, (temperature, block) in zip(axes[0], blocks.items()):
        for label, stats in _scored(block):
            lossy = block["methods"][label].get("lenience", 1.0) < 1
            ax.scatter(stats["speedup"], stats["mean_logprob"], color="tab:red" if lossy else "tab:blue")
            ax.annotate(label + (" (lossy)" if lossy else ""), (stats["speedup"], stats["mean_logprob"]),
                        textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_xlabel("speedup over plain")
        ax.set_ylabel("mean log-likelihood per token under the target")
        ax.set_title(f"temperature {temperature}")
        ax.margins(x=0.25, y=0.2)
    fig.suptitle(f"speed vs quality: {_model_names(report)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(report: dict, directory: str | Path) -> list[Path]:
    """speedup.png, figure1-<method>.png for each method measured at two or more k, and quality.png
    when answers were scored (bench --quality)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = [speedup_plot(report, directory / "speedup.png")]
    methods = {meta["method"] for block in report["temperatures"].values() for meta in block["methods"].values()
               if is_fixed_k(meta)}
    for method in sorted(methods):
        if any(len(_k_series(block, method)) >= 3 for block in report["temperatures"].values()):
            paths.append(figure1_plot(report, method, directory / f"figure1-{method.replace('+', '-')}.png"))
    if any(len(_scored(block)) >= 2 for block in report["temperatures"].values()):
        paths.append(quality_plot(report, directory / "quality.png"))
    return paths
