"""Reading results files: loading, per-suite tables, RESULTS.md, `bench compare`, progress lines."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

from . import schema

MEASURED_SUITES = ("write", "decode", "prefill", "legacy")
SUITE_TITLES = {
    "write": "write: reshape_and_cache_flash (H=8, D=128, bf16 in, block 16)",
    "decode": "decode: flash_attn_varlen_func, paged (Hq=32, Hkv=8, D=128, block 16)",
    "prefill": "prefill: flash_attn_varlen_func, paged, causal (Hq=32, Hkv=8, D=128, block 16)",
    "features": "features: window, softcap, ALiBi, sinks against the plain kernel; head dim 512 (Hq=32, Hkv=8)",
    "legacy": "legacy: paged_attention v1 / v2 / auto (legacy cache layout)",
    "jit": "jit: compile, first-call and host costs",
    "sweep": "sweep: ours alone at the tile and mode studies' shapes (Hq=32, Hkv=8, block 16)",
}
MARK = {True: " ✓", False: " ✗"}


# -- loading ---------------------------------------------------------------------------------------
def load(path) -> dict:
    data = json.loads(Path(path).read_text())
    schema.check(data, str(path))
    return data


def gpu_key(meta: dict) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", str(meta.get("gpu", "gpu")).lower().replace("nvidia", "")).strip("-")
    cap = str(meta.get("capability", "")).replace(".", "")
    return f"{slug or 'gpu'}_sm{cap}" if cap and cap != "-" else slug or "gpu"


def gpu_label(meta: dict) -> str:
    name = str(meta.get("gpu", "?"))
    mark = " [SAMPLE]" if meta.get("sample") and "sample" not in name.lower() else ""
    return f"{name} (sm {meta.get('capability', '?')}){mark}"


def load_folder(folder, include_samples: bool = False, warn=None) -> list[tuple[Path, dict]]:
    """Every valid results file in `folder` measured with the library's defaults, oldest first. Files
    marked sample are left out unless asked for, and so are runs under --overrides; invalid files are
    reported through `warn` and left out."""
    out = []
    for path in sorted(Path(folder).glob("*.json")):
        try:
            data = json.loads(path.read_text())
            if not (isinstance(data, dict) and str(data.get("schema", "")).startswith("pagedattn-bench/")):
                continue  # another tool's JSON (e.g. perf/aot_precompile.py's) shares the folder
            schema.check(data, str(path))
        except (OSError, ValueError) as exc:  # schema.SchemaError is a ValueError
            if warn:
                warn(f"skipping {path}: {str(exc).splitlines()[0]}")
            continue
        if (include_samples or not data["metadata"].get("sample")) and not data["metadata"].get("overrides"):
            out.append((path, data))
    return sorted(out, key=lambda pr: (str(pr[1]["metadata"].get("date", "")), pr[0].name))


def latest_per_gpu(files: list[tuple[Path, dict]], suite: str | None = None) -> dict[str, tuple[Path, dict]]:
    """gpu key -> the newest file (that has cases in `suite`, when given); `files` oldest first."""
    return {gpu_key(data["metadata"]): (path, data) for path, data in files
            if suite is None or data["suites"].get(suite, {}).get("cases")}


# -- formatting ------------------------------------------------------------------------------------
VALUE_FORMATS = {"GB/s": "{:,.0f} GB/s", "TFLOP/s": "{:.1f} TFLOP/s", "s": "{:.2f} s", "ms": "{:.1f} ms",
                 "us": "{:.2f} µs"}


def fmt_us(us) -> str:
    if us is None:
        return "-"
    if us >= 1e4:
        return f"{us / 1e6:.2f} s" if us >= 1e6 else f"{us / 1e3:.2f} ms"
    return f"{us:.0f} µs" if us >= 100 else f"{us:.1f} µs" if us >= 10 else f"{us:.2f} µs"


def fmt_value(value, unit) -> str:
    return "-" if value is None or unit is None else VALUE_FORMATS.get(unit, "{:g} " + unit).format(value)


def fmt_frac(f) -> str:
    return "-" if f is None else f"{100 * f:.0f}%"


def fmt_ratio(r) -> str:
    return "-" if r is None else f"{r:.2f}×"


def fmt_target(t) -> str:
    if not t:
        return ""
    unit, v = t.get("unit"), t.get("value")
    goal = (f"≥ {100 * v:.0f}%" if unit == "fraction"
            else f"{'≤' if unit in ('us', 's', 'ms') else '≥'} {v:g} {'µs' if unit == 'us' else unit}")
    return goal + MARK.get(t.get("met"), " ?")


def goals_cell(case: dict) -> str:
    """The target and the relative goals: "≥ 1× sdpa cudnn ✓" = ours at least as fast as the peer."""
    parts = [fmt_target(case.get("target"))]
    for g in case.get("goals") or []:
        parts.append(f"≥ {g.get('value', 0):.2g}× {g.get('peer')}{MARK.get(g.get('met'), ' ?')}")
    return "; ".join(p for p in parts if p)


def method_us(impl: dict | None, method: str):
    """The median under one timing method (a file from before the methods: "rot" is its `us`)."""
    if not impl or impl.get("error"):
        return None
    entry = (impl.get("methods") or {}).get(method)
    return entry.get("us") if entry is not None else impl.get("us") if method == impl.get("method", "rot") else None


def fmt_methods(impl: dict | None) -> str:
    """'50.1 / 52.3 µs': the medians under each method (rot / flush), one unit when they share it."""
    parts = [fmt_us(method_us(impl, m)) for m in schema.METHODS]
    units = {p.rsplit(" ", 1)[-1] for p in parts if " " in p}
    if len(units) == 1 and all(" " in p for p in parts):
        return " / ".join(p.rsplit(" ", 1)[0] for p in parts) + f" {units.pop()}"
    return " / ".join(parts)


def fmt_check(c) -> str:
    if not c:
        return "-"
    if c.get("ok"):
        return f"ok ({c['rel_l2']:.1e})" if isinstance(c.get("rel_l2"), float) else "ok"
    return "FAIL: " + (c.get("detail") or "")[:120]


def case_label(case: dict) -> str:
    """The case id without its suite prefix."""
    return case["id"].split("/", 1)[-1]


def time_cell(impl: dict, unit: str | None) -> str:
    """The value for the jit suite's units (s, ms, µs), else the median time."""
    return fmt_value(impl.get("value"), unit) if unit in ("s", "ms", "us") else fmt_us(impl.get("us"))


def ours_cell(case: dict) -> str:
    ours = case.get("ours")
    return "-" if not ours or ours.get("error") else time_cell(ours, case.get("unit"))


def peer_cell(case: dict, name: str) -> str:
    peer = case.get("peers", {}).get(name)
    if peer is None:
        return ""
    if peer.get("error"):
        return "n/a"
    t = fmt_methods(peer) if peer.get("methods") else time_cell(peer, case.get("unit"))
    r = case.get("ratios", {}).get(name)
    return f"{t} (ours {fmt_ratio(r)})" if r is not None else t


def status_cell(case: dict) -> str:
    st, msg = case.get("status"), case.get("error") or ""
    return "" if st == "ok" else f"{st.upper()}: {msg[:160]}" if msg else st.upper()


def peer_names(cases: list[dict]) -> list[str]:
    return list(dict.fromkeys(n for c in cases for n in c.get("peers", {})))


def _jit_detail(c: dict) -> str:
    ex = c.get("extra") or {}
    parts = [", ".join(f"{k} {v:.1f} s" if isinstance(v, (int, float)) else k for k, v in ex["variants"].items())
             if ex.get("variants") else f"{ex['compiles']} compiles" if ex.get("compiles") is not None else ""]
    n = ex.get("launches_per_call")  # the launcher cases of older runs
    parts.append(f"{n} launch{'es' if n != 1 else ''} per call" if n else "")
    parts.append(f"get_kernel().launcher() {ex['lookup_us']:.2f} µs" if ex.get("lookup_us") is not None else "")
    return "; ".join(p for p in parts if p)


def suite_table(data: dict, suite: str) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of one suite of one results file, the same for markdown and the console. Cases
    timed under both methods get a time column per method (throughput, ratios and goals from the worse),
    the fraction of the ceiling per method and the floor (the work at the ceiling)."""
    cases = data["suites"].get(suite, {}).get("cases", [])
    peers = peer_names(cases)
    if suite == "jit":
        return (["case", "ours", "goal (H200)", "peer", "detail", "status"],
                [[case_label(c), ours_cell(c), fmt_target(c.get("target")),
                  "; ".join(f"{n}: {peer_cell(c, n)}" for n in c.get("peers", {})), _jit_detail(c), status_cell(c)]
                 for c in cases])
    unit = next((c.get("unit") for c in cases if c.get("unit")), "") or "value"
    of = "of " + next((c.get("ceiling") for c in cases if c.get("ceiling")), "ceiling")
    methods = any((impl or {}).get("methods") for c in cases for impl in [c.get("ours"), *c.get("peers", {}).values()])
    if methods:
        header = ["case", *(f"us_{m}" for m in schema.METHODS), f"{unit} (worse)", f"{of} (rot / flush)", "floor"]
    else:
        header = ["case", "ours", unit, of]
    rows = []
    for c in cases:
        ours = c.get("ours") or {}
        if methods:
            per = [(ours.get("methods") or {}).get(m) or {} for m in schema.METHODS]
            fracs = " / ".join(fmt_frac(e.get("fraction")) for e in per) if any(per) else "-"
            row = [case_label(c), *(fmt_us(method_us(ours, m)) for m in schema.METHODS),
                   fmt_value(ours.get("value"), c.get("unit")), fracs, fmt_us(c.get("floor_us"))]
        else:
            row = [case_label(c), ours_cell(c), fmt_value(ours.get("value"), c.get("unit")),
                   fmt_frac(ours.get("fraction"))]
        rows.append(row + [goals_cell(c), fmt_check(c.get("check"))] + [peer_cell(c, n) for n in peers]
                    + [status_cell(c)])
    return header + ["goal (H200)", "check"] + peers + ["status"], rows


def _kept_columns(header: list[str], rows: list[list[str]]) -> list[int]:
    """The first column, and those not empty in every row (e.g. "status" when all are ok)."""
    return [i for i in range(len(header)) if i == 0 or any(r[i] for r in rows)]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    keep = _kept_columns(header, rows)
    line = lambda cells: "| " + " | ".join(str(cells[i]).replace("|", "\\|").replace("\n", " ")  # noqa: E731
                                           for i in keep) + " |"
    return "\n".join([line(header), "|" + "|".join(" --- " for _ in keep) + "|"] + [line(r) for r in rows])


# -- RESULTS.md ------------------------------------------------------------------------------------
def _ceiling(data: dict, which: str):
    return (data.get("ceilings", {}).get(which) or {}).get("value")


INTRO = ("Generated by `pagedattn bench` from every results file in `perf/results/` (files marked "
         "`\"sample\": true` and runs under `--overrides` are ignored); do not edit by hand. How to run and "
         "read: [README.md](README.md).")
LEGEND = ("Times are medians of CUDA-event timings (µs); `ours N×` = the peer's time over ours (above 1: ours "
          "is faster); `of copy` / `of matmul` = fraction of the ceiling measured in the same run. `n/a`: the "
          "peer could not run (reason in the JSON). Where a suite shows `us_rot` / `us_flush`, each case is "
          "timed back to back with rotated inputs and with the L2 flushed before every call (as "
          "`triton.testing.do_bench`); throughput, `N×` and goals use the worse of the two, and `floor` is "
          "the case's bytes (or flops) at the ceiling.")
RUNS_HEADER = ["file", "GPU", "SMs", "date (UTC)", "commit", "mode", "copy ceiling", "bf16 matmul ceiling", "software"]


def _run_row(path: Path, data: dict) -> list[str]:
    m = data["metadata"]
    commit = (m.get("git_commit") or "-")[:10] + ("+dirty" if m.get("git_dirty") else "")
    return [f"`{path.name}`", gpu_label(m), str(m.get("sm_count")), m.get("date", "-")[:19], commit,
            "quick" if m.get("quick") else "full", fmt_value(_ceiling(data, "copy"), "GB/s"),
            fmt_value(_ceiling(data, "matmul"), "TFLOP/s"),
            f"torch {m.get('torch')}, CUDA {m.get('cuda')}, driver {m.get('driver')}"]


def render_markdown(files: list[tuple[Path, dict]], plots_rel: str | None = "plots",
                    history: list[tuple[Path, dict]] = ()) -> str:
    """RESULTS.md: the runs, per suite and GPU the newest run with that suite (a suite that no current
    run has, e.g. jit, from `history`, marked older), and ours across architectures."""
    out = ["# pagedattn performance results", "", INTRO, ""]
    if not files:
        return "\n".join(out + ["No results yet: run `pagedattn bench --suite all` on a GPU.", ""])
    out += ["## Runs", "", markdown_table(RUNS_HEADER, [_run_row(p, d) for p, d in files]), "", LEGEND, ""]
    for suite in schema.SUITES:
        latest = latest_per_gpu(files, suite)
        older = {k: v for k, v in latest_per_gpu(history, suite).items() if k not in latest}
        if latest or older:
            out += [f"## {SUITE_TITLES.get(suite, suite)}", ""]
        for key, (path, data) in {**latest, **older}.items():
            m = data["metadata"]
            where = f"`{path.name}`"
            if key in older:
                commit = (m.get("git_commit") or "-")[:10]
                where = (f"`history/{path.name}` ({m.get('date', '-')[:10]}, commit {commit}: the newest run with "
                         "this suite, older than the runs above)")
            out += [f"### {gpu_label(m)} — {where}", "", markdown_table(*suite_table(data, suite)), ""]
            if plots_rel and key not in older and suite in MEASURED_SUITES:
                out += [f"![{suite} on {key}]({plots_rel}/{key}_{suite}.png)", ""]
    return "\n".join(out + ["## Across architectures (ours, newest run per GPU)", "", across_table(files), ""])


def across_table(files: list[tuple[Path, dict]]) -> str:
    """Per case id of the measured suites: ours (fraction of its ceiling) on each GPU's newest run."""
    latest = latest_per_gpu(files)
    by_key = {k: {} for k in latest}
    for s in MEASURED_SUITES:  # a suite may come from its own run
        for k, (_, data) in latest_per_gpu(files, s).items():
            by_key[k].update({c["id"]: c for c in data["suites"][s]["cases"]})
    rows = [["copy ceiling"] + [fmt_value(_ceiling(d, "copy"), "GB/s") for _, d in latest.values()],
            ["bf16 matmul ceiling"] + [fmt_value(_ceiling(d, "matmul"), "TFLOP/s") for _, d in latest.values()]]
    for cid in dict.fromkeys(cid for cases in by_key.values() for cid in cases):
        cells = [by_key[k].get(cid) for k in latest]
        rows.append([cid] + ["-" if c is None else f"{fmt_us(c['ours']['us'])} ({fmt_frac(c['ours'].get('fraction'))})"
                             if (c.get("ours") or {}).get("us") else c.get("status", "-") for c in cells])
    return markdown_table(["case"] + [gpu_label(d["metadata"]) for _, d in latest.values()], rows)


def write_results_md(results_dir, md_path, plots_dir=None, include_samples: bool = False,
                     warn=None) -> tuple[Path, list[Path]]:
    """Regenerate RESULTS.md (and the plots, when matplotlib is there) from every results file."""
    files = load_folder(results_dir, include_samples=include_samples, warn=warn)
    history = load_folder(Path(results_dir) / "history", include_samples=include_samples, warn=warn)
    md_path, plots, plots_rel = Path(md_path), [], None
    if plots_dir is not None and files:
        try:
            from . import plots as plotting

            plots = plotting.make_all(files, plots_dir)
            plots_rel = str(Path(plots_dir).resolve().relative_to(md_path.parent.resolve()))
        except ImportError as exc:
            if warn:
                warn(f"no plots: {exc} (pip install matplotlib)")
        except ValueError:  # the plots are not below RESULTS.md's folder
            plots_rel = str(Path(plots_dir).resolve())
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(render_markdown(files, plots_rel, history))
    return md_path, plots


# -- compare ---------------------------------------------------------------------------------------
def compare(a: dict, b: dict, peers: bool = False) -> tuple[list[str], list[list[str]], list[str]]:
    """Case-by-case: (header, rows, summary lines). speed = A's time / B's time (above 1: B faster)."""
    header = ["suite", "case", "impl", "A", "B", "B speed vs A", "A of ceiling", "B of ceiling"]
    rows: list[list[str]] = []
    for name, unit in schema.CEILING_UNIT.items():
        va, vb = _ceiling(a, name), _ceiling(b, name)
        rows.append(["ceiling", name, "torch", fmt_value(va, unit), fmt_value(vb, unit),
                     fmt_ratio(vb / va) if va and vb else "-", "", ""])
    per_suite: dict[str, list[float]] = {}
    cases_a, cases_b = ({c["id"]: c for c in schema.all_cases(x)} for x in (a, b))
    for cid in (i for i in cases_a if i in cases_b):
        ca, cb = cases_a[cid], cases_b[cid]
        impls = [("ours", ca.get("ours"), cb.get("ours"))]
        impls += [(n, ca["peers"].get(n), cb["peers"].get(n)) for n in (peer_names([ca, cb]) if peers else [])]
        for label, ia, ib in impls:
            ia, ib = ia or {}, ib or {}
            ua, ub = (None if i.get("error") else i.get("us") for i in (ia, ib))
            speed = ua / ub if ua and ub else None
            if speed and label == "ours":
                per_suite.setdefault(ca["suite"], []).append(speed)
            missing = lambda c: c.get("status") if label == "ours" else "n/a"  # noqa: E731
            rows.append([ca["suite"], case_label(ca), ia.get("name", label) if label == "ours" else label,
                         time_cell(ia, ca.get("unit")) if ua else missing(ca),
                         time_cell(ib, cb.get("unit")) if ub else missing(cb),
                         fmt_ratio(speed), fmt_frac(ia.get("fraction")), fmt_frac(ib.get("fraction"))])
    summary = [f"A = {gpu_label(a['metadata'])}, {a['metadata'].get('date', '')[:10]}; "
               f"B = {gpu_label(b['metadata'])}, {b['metadata'].get('date', '')[:10]}",
               "B speed vs A = A's time / B's time: above 1, B is faster."]
    for suite, speeds in per_suite.items():
        gm = math.exp(sum(math.log(s) for s in speeds) / len(speeds))
        summary.append(f"{suite}: geometric mean B speed vs A = {gm:.2f}× over {len(speeds)} case(s)")
    for side, mine, other in (("A", cases_a, cases_b), ("B", cases_b, cases_a)):
        only = [i for i in mine if i not in other]
        if only:
            summary.append(f"only in {side} ({len(only)}): {', '.join(only[:8])}{' ...' if len(only) > 8 else ''}")
    return header, rows, summary


# -- progress --------------------------------------------------------------------------------------
def describe(case: dict) -> str:
    """One line for the progress output: the case's row of its suite's table."""
    header, (row,) = suite_table({"suites": {case["suite"]: {"cases": [case]}}}, case["suite"])
    return f"{case['id']}: " + "; ".join(f"{h} {v}" for h, v in zip(header[1:], row[1:]) if v)
