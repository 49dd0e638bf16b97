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


def suite_plot(data: dict, suite: str, path: Path) -> Path | None:
    cases = [c for c in data["suites"].get(suite, {}).get("cases", []) if c.get("unit") in ("GB/s", "TFLOP/s")]
    if not cases:
        return None
    unit = cases[0]["unit"]
    peers = report.peer_names(cases)
    series = [("ours", OURS_COLOR, [(c.get("ours") or {}) for c in cases])]
    for i, name in enumerate(peers):
        series.append((name, PEER_COLORS[i % len(PEER_COLORS)], [c["peers"].get(name) or {} for c in cases]))
    n = len(cases)
    width = 0.8 / len(series)
    fig = Figure(figsize=(max(6.0, 0.55 * n * max(1, len(series)) / 2 + 3), 4.8))
    ax = fig.add_subplot()
    values = []
    for j, (label, color, impls) in enumerate(series):
        xs, ys = [], []
        for i, impl in enumerate(impls):
            v = None if impl.get("error") else impl.get("value")
            if v:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(v)
        values += ys
        if ys:
            ax.bar(xs, ys, width=width, color=color, label=label)
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
        if c.get("status") not in ("ok",):
            ax.annotate(c["status"], (i, 0), xycoords=("data", "axes fraction"), ha="center", va="bottom",
                        fontsize=7, color="red", rotation=90)
    ax.set_ylabel(unit)
    m = data["metadata"]
    ax.set_title(f"{suite} — {report.gpu_label(m)}, {str(m.get('date', ''))[:10]}", fontsize=10)
    ax.legend(fontsize=7, loc="best")
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def jit_plot(data: dict, path: Path) -> Path | None:
    cases = data["suites"].get("jit", {}).get("cases", [])
    groups = [("cold", "first call, empty cache (s)"), ("warm", "first call, disk hit (ms)"),
              ("host", "host µs per API call"), ("launcher", "raw launcher µs per launch")]
    present = [(g, t, [c for c in cases if c["id"].startswith(f"jit/{g}/")]) for g, t in groups]
    present = [p for p in present if p[2]]
    if not present:
        return None
    fig = Figure(figsize=(11, 2.2 + 1.6 * len(present)))
    axes = fig.subplots(len(present), 1, squeeze=False)[:, 0]
    for ax, (g, title, cs) in zip(axes, present):
        labels = [c["id"].split("/", 2)[2] for c in cs]
        vals = [((c.get("ours") or {}).get("value") or 0.0) if c.get("status") == "ok" else 0.0 for c in cs]
        ax.barh(range(len(cs)), vals, color=OURS_COLOR, label="ours")
        peer_vals = [next((p.get("value") for p in c.get("peers", {}).values() if not p.get("error")), None)
                     for c in cs]
        if any(v is not None for v in peer_vals):
            ax.scatter([v for v in peer_vals if v is not None],
                       [i for i, v in enumerate(peer_vals) if v is not None], color=PEER_COLORS[0],
                       zorder=3, label="torch equivalent")
        if g in ("host", "launcher"):
            ax.axvline(6.0, color="black", linestyle="--", linewidth=1, label="goal 6 µs")
        ax.set_yticks(range(len(cs)))
        ax.set_yticklabels(labels, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    m = data["metadata"]
    fig.suptitle(f"jit — {report.gpu_label(m)}, {str(m.get('date', ''))[:10]}", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def across_plot(files: list[tuple[Path, dict]], path: Path) -> Path | None:
    latest = report.latest_per_gpu(files)
    if not latest:
        return None
    keys = list(latest)
    suites = [s for s in report.MEASURED_SUITES
              if any(latest[k][1]["suites"].get(s, {}).get("cases") for k in keys)]
    fig = Figure(figsize=(12, 3.2 * (len(suites) + 1)))
    axes = fig.subplots(len(suites) + 1, 1, squeeze=False)[:, 0]
    width = 0.8 / len(keys)
    # ceilings
    ax = axes[0]
    for j, k in enumerate(keys):
        c = latest[k][1]["ceilings"]
        copy = (c.get("copy") or {}).get("value") or 0
        mm = (c.get("matmul") or {}).get("value") or 0
        ax.bar([0 - 0.4 + width * (j + 0.5), 1 - 0.4 + width * (j + 0.5)], [copy / 1000, mm / 100],
               width=width, color=PEER_COLORS[j % len(PEER_COLORS)],
               label=report.gpu_label(latest[k][1]["metadata"]))
    ax.set_xticks([0, 1])
    ax.set_xticklabels(["copy (TB/s)", "bf16 matmul (100 TFLOP/s)"])
    ax.set_title("ceilings measured in each run", fontsize=9)
    ax.legend(fontsize=7)
    for ax, suite in zip(axes[1:], suites):
        ids: list[str] = []
        for k in keys:
            for c in latest[k][1]["suites"].get(suite, {}).get("cases", []):
                if c["id"] not in ids:
                    ids.append(c["id"])
        for j, k in enumerate(keys):
            cases = {c["id"]: c for c in latest[k][1]["suites"].get(suite, {}).get("cases", [])}
            xs, ys = [], []
            for i, cid in enumerate(ids):
                ours = (cases.get(cid) or {}).get("ours") or {}
                if ours.get("fraction") is not None:
                    xs.append(i - 0.4 + width * (j + 0.5))
                    ys.append(ours["fraction"])
            ax.bar(xs, ys, width=width, color=PEER_COLORS[j % len(PEER_COLORS)],
                   label=report.gpu_label(latest[k][1]["metadata"]))
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
    made: list[Path] = []
    for suite in report.MEASURED_SUITES + ("jit",):
        for key, (_, data) in report.latest_per_gpu(files, suite).items():
            target = plots_dir / f"{key}_{suite}.png"
            p = jit_plot(data, target) if suite == "jit" else suite_plot(data, suite, target)
            if p:
                made.append(p)
    p = across_plot(files, plots_dir / "across_arch.png")
    if p:
        made.append(p)
    return made
