"""What compiling the kernels costs, measured on this machine's CPU (issue 19; no GPU needed).

    python perf/compile_costs.py times [--out perf/results] [--tag NAME] [--repeat 1] [--commit SHA]
    python perf/compile_costs.py registers [--arch sm_90a] 'attn_fwd:dtype=bf16 head_dim=128 mode=decode_tma' ...
    python perf/compile_costs.py precompile [--arch sm_90a] [--preset default] [--jobs N] [--output F] [--keep DIR]
    python perf/compile_costs.py bundle-load BUNDLE_DIR [--out perf/results] [--reps 5]

times: the cold NVRTC compile of attention variants (goal <= 6 s each on 2 cores), one at a time in this process
  with the package as installed (to compare builds, run once per build with its install on PYTHONPATH,
  interleaved), split into NVRTC's phases (`-time`); writes OUT/compile_times_cpu<cores>_<date>[_<tag>].json.
registers: ptxas' registers, stack frame and spills of kernel variants (`-Xptxas -v`, not cached), to check a
  template change for register pressure and local memory before it reaches a GPU.
precompile: `pagedattn precompile` cold into an empty folder, then its rerun: wall times, kernels per family,
  bundle size, the machine and its load, the commit; default output perf/results/aot_precompile_cpu<cores>.json.
bundle-load: bundle.read_checked (read, xz-decompress, size and sha256 check) of every entry of a bundle, the
  median of --reps (goals: <= 50 ms per kernel, <= 40 MiB on disk); with --out OUT/bundle_load_cpu<cores>_<date>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = [("sm_80", "bf16", "auto", 128, "decode", ()), ("sm_80", "bf16", "auto", 128, "prefill", ()),
            ("sm_90a", "bf16", "auto", 128, "decode_tma", ()), ("sm_90a", "bf16", "auto", 128, "multi_tma", ()),
            ("sm_90a", "bf16", "fp8_e4m3", 128, "decode_tma", ()), ("sm_90a", "bf16", "auto", 128, "prefill_ws", ()),
            ("sm_90a", "bf16", "auto", 128, "decode_tma", (True, True, False, True))]


def _compile(kernel, arch: str, *options: str):
    from pagedattn.codegen.compile import compile_source, nvrtc_options
    from pagedattn.codegen.toolchain import toolchain

    return compile_source(kernel.source, variant=kernel.name, arch=arch,
                          options=nvrtc_options(arch, toolchain()) + list(options))


def _write(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print("wrote", path)


def times(args) -> int:
    import pagedattn
    from pagedattn.bench.meta import host
    from pagedattn.ops.attention import AttnFwdSpec
    from pagedattn.registry import Kernel

    rows = []
    for arch, dtype, kv, d, mode, flags in VARIANTS * args.repeat:
        k = Kernel(AttnFwdSpec.for_arch(arch, dtype, kv, d, mode, tuple(flags) or (False,) * 4))
        with tempfile.TemporaryDirectory() as tmp:
            r = _compile(k, arch, f"-time={tmp}/time.csv")
            phases = {}
            for line in Path(tmp, "time.csv").read_text().splitlines()[1:]:
                _, phase, ms, _ = (x.strip() for x in line.split(","))
                phases[phase] = phases.get(phase, 0.0) + float(ms) / 1e3
        rows.append(dict(variant=k.name, arch=arch, seconds=round(r.seconds, 2), phases_s=phases))
        print(f"{k.name:58s} {arch:7s} {r.seconds:6.1f} s  " + "  ".join(f"{p} {s:.1f}" for p, s in phases.items()),
              flush=True)
    meta = host()
    meta.update(package=str(Path(pagedattn.__file__).parent), commit=args.commit or meta["commit"], tag=args.tag)
    name = f"compile_times_cpu{os.cpu_count()}_{meta['date'].replace('-', '')}{'_' + args.tag if args.tag else ''}"
    _write(Path(args.out) / f"{name}.json", dict(kind="compile_times", metadata=meta, results=rows))
    return 0


def registers(args) -> int:
    from pagedattn.aot import parse_variant
    from pagedattn.registry import Kernel

    for text in args.variants:
        kernel = Kernel(parse_variant(text))
        print(kernel.name)
        for line in re.findall(r"(Used \d+ registers.*|\d+ bytes stack frame.*)", _compile(kernel, args.arch,
                                                                                           "-Xptxas=-v").log):
            print("   ", line.strip())
    return 0


def precompile(args) -> int:
    from pagedattn import aot, ops  # noqa: F401 - ops registers the kernel families
    from pagedattn.bench.meta import host
    from pagedattn.codegen.bundle import expected_header
    from pagedattn.info import git_commit

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
        f.update(kernels=f["kernels"] + 1, bytes=f["bytes"] + v["size"],
                 compile_seconds_sum=round(f["compile_seconds_sum"] + v["compile_seconds"], 2))
    status = (subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
              if shutil.which("git") else "")
    record = {
        "what": f"pagedattn precompile --arch {','.join(archs)} --preset {args.preset} (cold, empty --out; then a "
                "rerun)",
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
    print(json.dumps({k: record[k] for k in ("kernels", "jobs", "wall_seconds", "compile_seconds_sum",
                                              "rerun_wall_seconds", "bundle_mib_on_disk", "failed")}, indent=1))
    _write(args.output or ROOT / "perf" / "results" / f"aot_precompile_cpu{os.cpu_count()}.json", record)
    if args.keep is None:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if cold.failed else 0


def bundle_load(args) -> int:
    from pagedattn.bench.meta import host
    from pagedattn.codegen import bundle

    manifest = bundle.read_manifest(args.folder)
    if manifest is None:
        raise SystemExit(f"{args.folder}: not a bundle this install can read")
    rows = []
    for v in manifest["variants"]:
        seconds = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            _, why = bundle.read_checked(args.folder, v)
            seconds.append(time.perf_counter() - t0)
            if why:
                raise SystemExit(f"{v['name']}: {why}")
        rows.append({"name": v["name"], "arch": v["arch"], "size": v["size"],
                     "stored_size": v.get("stored_size", v["size"]), "ms": 1e3 * statistics.median(seconds)})
    ms = [r["ms"] for r in rows]
    summary = {"kernels": len(rows), "stored_mib": sum(r["stored_size"] for r in rows) / 2**20,
               "cubin_mib": sum(r["size"] for r in rows) / 2**20, "median_ms": statistics.median(ms), "max_ms": max(ms)}
    print(json.dumps(summary, indent=1))
    if args.out:
        meta = dict(host(), folder=str(args.folder))
        _write(args.out / f"bundle_load_cpu{os.cpu_count()}_{meta['date'].replace('-', '')}.json",
               {"metadata": meta, "summary": summary, "kernels": rows})
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("times", help="cold NVRTC compile time of attention variants, per phase")
    p.add_argument("--out", default="perf/results")
    p.add_argument("--tag", default="")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--commit", default=None, help="the commit of the installed build (default: this checkout's)")
    p.set_defaults(func=times)
    p = sub.add_parser("registers", help="ptxas' registers, stack frame and spills of kernel variants")
    p.add_argument("variants", nargs="+", metavar="'FAMILY:FIELD=VALUE ...'")
    p.add_argument("--arch", default="sm_90a")
    p.set_defaults(func=registers)
    p = sub.add_parser("precompile", help="`pagedattn precompile` cold and rerun")
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--preset", default="default")
    p.add_argument("--jobs", type=int, default=None)
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--keep", type=Path, default=None, help="keep the bundle here")
    p.set_defaults(func=precompile)
    p = sub.add_parser("bundle-load", help="reading every kernel of a bundle")
    p.add_argument("folder", type=Path)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--reps", type=int, default=5)
    p.set_defaults(func=bundle_load)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
