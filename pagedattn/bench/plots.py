"""PNG plots from results files (matplotlib Figure + Agg canvas, no pyplot state): per GPU and suite,
the jit suite, and ours as a fraction of each GPU's own ceiling across architectures.
"""
from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from . import report, schema

OURS_COLOR = "#1f77b4"
PEER_COLORS = ["#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def _title(name: str, m: dict) -> str:
    return f"{name} — {report.gpu_label(m)}, {str(m.get('date', ''))[:10]}"


def _bars(ax, series, value, every: bool = False) -> list[float]:
    """Grouped bars: series [(label, color, [item per position])], value(item) -> height or None (no bar;
    0 too unless `every`, which also gives a series without bars its legend entry)."""
    width, heights = 0.8 / len(series), []
    for j, (label, color, items) in enumerate(series):
        xs, ys = [], []
        for i, item in enumerate(items):
            v = value(item)
            if v is not None if every else v:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(v)
        if ys or every:
            ax.bar(xs, ys, width=width, color=color, label=label)
        heights += ys
    return heights


def suite_plot(data: dict, suite: str, path: Path) -> Path | None:
    cases = [c for c in data["suites"].get(suite, {}).get("cases", []) if c.get("unit") in ("GB/s", "TFLOP/s")]
    if not cases:
        return None
    unit, n = cases[0]["unit"], len(cases)
    series = [("ours", OURS_COLOR, [(c.get("ours") or {}) for c in cases])]
    series += [(name, PEER_COLORS[i % len(PEER_COLORS)], [c["peers"].get(name) or {} for c in cases])
               for i, name in enumerate(report.peer_names(cases))]
    fig = Figure(figsize=(max(6.0, 0.55 * n * max(1, len(series)) / 2 + 3), 4.8))
    ax = fig.add_subplot()
    values = _bars(ax, series, lambda impl: None if impl.get("error") else impl.get("value"))
    ceiling_name = cases[0].get("ceiling")
    ceil = schema.ceiling_value(data.get("ceilings"), ceiling_name)
    if ceil:
        ax.axhline(ceil, color="black", linestyle="--", linewidth=1,
                   label=f"{ceiling_name} ceiling {report.fmt_value(ceil, unit)}")
        values.append(ceil)
    if values and max(values) / max(min(values), 1e-12) > 50:
        ax.set_yscale("log")
    ax.set_xticks(range(n))
    ax.set_xticklabels([report.case_label(c) for c in cases], rotation=40, ha="right", fontsize=8)
    for i, c in enumerate(cases):
        if c.get("status") != "ok":
            ax.annotate(c["status"], (i, 0), xycoords=("data", "axes fraction"), ha="center", va="bottom",
                        fontsize=7, color="red", rotation=90)
    ax.set_ylabel(unit)
    ax.set_title(_title(suite, data["metadata"]), fontsize=10)
    ax.legend(fontsize=7, loc="best")
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def jit_plot(data: dict, path: Path) -> Path | None:
    cases = data["suites"].get("jit", {}).get("cases", [])
    groups = [("cold", "first call, empty cache (s)"), ("warm", "first call, disk hit (ms)"),
              ("host", "host µs per API call"), ("launcher", "raw launcher µs per launch")]
    present = [(g, t, cs) for g, t in groups if (cs := [c for c in cases if c["id"].startswith(f"jit/{g}/")])]
    if not present:
        return None
    fig = Figure(figsize=(11, 2.2 + 1.6 * len(present)))
    for ax, (g, title, cs) in zip(fig.subplots(len(present), 1, squeeze=False)[:, 0], present):
        vals = [((c.get("ours") or {}).get("value") or 0.0) if c.get("status") == "ok" else 0.0 for c in cs]
        ax.barh(range(len(cs)), vals, color=OURS_COLOR, label="ours")
        peer_vals = [next((p.get("value") for p in c.get("peers", {}).values() if not p.get("error")), None)
                     for c in cs]
        if any(v is not None for v in peer_vals):
            ax.scatter([v for v in peer_vals if v is not None], [i for i, v in enumerate(peer_vals) if v is not None],
                       color=PEER_COLORS[0], zorder=3, label="torch equivalent")
        if g in ("host", "launcher"):
            ax.axvline(6.0, color="black", linestyle="--", linewidth=1, label="goal 6 µs")
        ax.set_yticks(range(len(cs)))
        ax.set_yticklabels([c["id"].split("/", 2)[2] for c in cs], fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(_title("jit", data["metadata"]), fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def across_plot(files: list[tuple[Path, dict]], path: Path) -> Path | None:
    latest = [data for _, data in report.latest_per_gpu(files).values()]
    if not latest:
        return None
    suites = [s for s in report.MEASURED_SUITES if any(d["suites"].get(s, {}).get("cases") for d in latest)]
    fig = Figure(figsize=(12, 3.2 * (len(suites) + 1)))
    axes = fig.subplots(len(suites) + 1, 1, squeeze=False)[:, 0]
    gpus = lambda items: [(report.gpu_label(d["metadata"]), PEER_COLORS[j % len(PEER_COLORS)], item)  # noqa: E731
                          for j, (d, item) in enumerate(zip(latest, items))]
    ceilings = [[((d["ceilings"].get("copy") or {}).get("value") or 0) / 1000,
                 ((d["ceilings"].get("matmul") or {}).get("value") or 0) / 100] for d in latest]
    _bars(axes[0], gpus(ceilings), lambda v: v, every=True)
    axes[0].set_xticks([0, 1])
    axes[0].set_xticklabels(["copy (TB/s)", "bf16 matmul (100 TFLOP/s)"])
    axes[0].set_title("ceilings measured in each run", fontsize=9)
    axes[0].legend(fontsize=7)
    for ax, suite in zip(axes[1:], suites):
        by_id = [{c["id"]: c for c in d["suites"].get(suite, {}).get("cases", [])} for d in latest]
        ids = list(dict.fromkeys(cid for cases in by_id for cid in cases))
        _bars(ax, gpus([[by.get(cid) for cid in ids] for by in by_id]),
              lambda c: ((c or {}).get("ours") or {}).get("fraction"), every=True)
        ax.set_xticks(range(len(ids)))
        ax.set_xticklabels([cid.split("/", 1)[1] for cid in ids], rotation=40, ha="right", fontsize=7)
        ax.set_ylabel("fraction of ceiling")
        ax.set_title(f"{suite}: ours as a fraction of the GPU's own ceiling", fontsize=9)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)


def make_all(files: list[tuple[Path, dict]], plots_dir) -> list[Path]:
    plots_dir = Path(plots_dir)
    made = [jit_plot(data, plots_dir / f"{key}_{suite}.png") if suite == "jit"
            else suite_plot(data, suite, plots_dir / f"{key}_{suite}.png")
            for suite in report.MEASURED_SUITES + ("jit",) for key, (_, data) in report.latest_per_gpu(files, suite).items()]
    return [p for p in made + [across_plot(files, plots_dir / "across_arch.png")] if p]
