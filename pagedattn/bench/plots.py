"""PNG plots from results files (matplotlib Figure + Agg canvas, no pyplot state): per GPU and measured suite,
the throughput of ours and each peer against the ceiling."""
from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from . import report, schema

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def suite_plot(data: dict, suite: str, path: Path) -> Path | None:
    cases = [c for c in data["suites"].get(suite, {}).get("cases", []) if c.get("unit") in ("GB/s", "TFLOP/s")]
    if not cases:
        return None
    value = lambda impl: None if not impl or impl.get("error") else impl.get("value")  # noqa: E731
    series = [("ours", [value(c.get("ours")) for c in cases])]
    series += [(name, [value(c["peers"].get(name)) for c in cases]) for name in report.peer_names(cases)]
    fig = Figure(figsize=(max(6.0, 0.3 * len(cases) * len(series) + 3), 4.8))
    ax = fig.add_subplot()
    width, heights = 0.8 / len(series), []
    for j, (name, values) in enumerate(series):  # grouped bars, one group per case
        xs = [i - 0.4 + width * (j + 0.5) for i, v in enumerate(values) if v]
        ax.bar(xs, [v for v in values if v], width=width, color=COLORS[j % len(COLORS)], label=name)
        heights += [v for v in values if v]
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([report.case_label(c) for c in cases], rotation=40, ha="right", fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    unit, ceiling = cases[0]["unit"], cases[0].get("ceiling")
    ceil = schema.ceiling_value(data.get("ceilings"), ceiling)
    if ceil:
        ax.axhline(ceil, color="black", linestyle="--", linewidth=1,
                   label=f"{ceiling} ceiling {report.fmt_value(ceil, unit)}")
        heights.append(ceil)
    if heights and max(heights) / max(min(heights), 1e-12) > 50:
        ax.set_yscale("log")
    ax.set_ylabel(unit)
    ax.set_title(f"{suite} — {report.gpu_label(data['metadata'])}, {str(data['metadata'].get('date', ''))[:10]}",
                 fontsize=10)
    ax.legend(fontsize=7)
    FigureCanvasAgg(fig)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def make_all(files: list[tuple[Path, dict]], plots_dir) -> list[Path]:
    made = [suite_plot(data, suite, Path(plots_dir) / f"{key}_{suite}.png") for suite in report.MEASURED_SUITES
            for key, (_, data) in report.latest_per_gpu(files, suite).items()]
    return [p for p in made if p]
