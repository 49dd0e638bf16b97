"""Measure `pagedattn precompile --preset default` (cold, into an empty folder) and its rerun.

    python perf/aot_precompile.py --arch sm_90a [--jobs N] [--output perf/results/aot_precompile_cpu2.json]

Records the wall time, kernels per family, bundle size on disk, the machine (CPU, cores, memory, load)
and the git commit. Default output: perf/results/aot_precompile_cpu<cores>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    from pagedattn import aot, ops  # noqa: F401 - ops registers the kernel families
    from pagedattn.bench.meta import host
    from pagedattn.codegen.bundle import expected_header
    from pagedattn.info import git_commit

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--preset", default="default")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--output", type=Path, default=None)
    ap.add_argument("--keep", type=Path, default=None, help="keep the bundle here")
    args = ap.parse_args()

    archs = aot.resolve_archs(args.arch)
    sel = aot.select(preset=args.preset)
    jobs = aot.plan(sel.specs, archs)
    tmp = Path(tempfile.mkdtemp(prefix="pagedattn-aot-perf-"))
    out = args.keep or tmp / "bundle"
    shutil.rmtree(out, ignore_errors=True)
    load_before, t0 = os.getloadavg(), time.perf_counter()
    cold = aot.precompile(jobs, out, n_jobs=args.jobs, progress=True)
    cold_wall, load_after, t0 = time.perf_counter() - t0, os.getloadavg(), time.perf_counter()
    warm = aot.precompile(jobs, out, n_jobs=args.jobs, progress=False)
    rerun_wall = time.perf_counter() - t0
    variants = json.loads((out / "manifest.json").read_text())["variants"]
    on_disk = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    per_family: dict[str, dict] = {}
    for v in variants:
        f = per_family.setdefault(v["family"], {"kernels": 0, "bytes": 0, "compile_seconds_sum": 0.0})
        f["kernels"] += 1
        f["bytes"] += v["size"]
        f["compile_seconds_sum"] = round(f["compile_seconds_sum"] + v["compile_seconds"], 2)
    status = (subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
              if shutil.which("git") else "")
    record = {
        "what": f"pagedattn precompile --arch {','.join(archs)} --preset {args.preset} (cold, empty --out; then a rerun)",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_commit": git_commit(),
        "git_dirty_files": len(status.splitlines()), "machine": host(), "toolchain": expected_header(),
        "preset": dict(aot.PRESETS[args.preset]), "archs": archs, "jobs": cold.jobs, "kernels": len(jobs),
        "variants_per_family": dict(Counter(s.FAMILY for s in sel.specs)), "compiled": cold.compiled,
        "failed": [f"{j.label}: {p}" for j, p in cold.failed], "wall_seconds": round(cold_wall, 2),
        "compile_seconds_sum": round(sum(v["compile_seconds"] for v in variants), 2),
        "rerun_wall_seconds": round(rerun_wall, 3), "rerun_compiled": warm.compiled,
        "bundle_bytes_cubins": cold.bundle_bytes, "bundle_bytes_on_disk": on_disk,
        "bundle_mib_on_disk": round(on_disk / 2**20, 2), "per_family": per_family,
        "slowest": [{"name": v["name"], "arch": v["arch"], "seconds": v["compile_seconds"]}
                    for v in sorted(variants, key=lambda v: -v["compile_seconds"])[:5]],
        "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in load_after],
    }
    output = args.output or ROOT / "perf" / "results" / f"aot_precompile_cpu{os.cpu_count()}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record[k] for k in ("kernels", "jobs", "wall_seconds", "compile_seconds_sum",
                                              "rerun_wall_seconds", "bundle_mib_on_disk", "failed")}, indent=1))
    print(f"written {output}")
    if args.keep is None:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if cold.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
