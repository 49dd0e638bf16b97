"""What compiling the kernels costs, measured on this machine's CPU (issue 19; no GPU needed).

    python perf/compile_costs.py times [--out perf/results] [--tag NAME] [--repeat 1] [--commit SHA]
    python perf/compile_costs.py precompile [--arch sm_90a] [--preset default] [--jobs N] [--out perf/results]

times: the cold NVRTC compile of attention variants (goal <= 6 s each on 2 cores) in this process, split into
  NVRTC's phases (`-time`); to compare builds, run once per build with its install on PYTHONPATH, interleaved.
precompile: `pagedattn precompile` cold into an empty folder, then its rerun: wall times, kernels and NVRTC
  seconds per family, the slowest kernels, bundle size, the machine's load.
Reading a bundle's kernels (goal <= 50 ms each) is timed by `pagedattn bundle verify DIR`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pagedattn
from pagedattn import aot, ops  # noqa: F401 - ops registers the kernel families
from pagedattn.bench.meta import write_quick
from pagedattn.codegen.bundle import expected_header
from pagedattn.codegen.compile import compile_source, nvrtc_options
from pagedattn.codegen.toolchain import toolchain
from pagedattn.ops.attention import AttnFwdSpec
from pagedattn.registry import Kernel

VARIANTS = [("sm_80", "bf16", "auto", 128, "decode", ()), ("sm_80", "bf16", "auto", 128, "prefill", ()),
            ("sm_90a", "bf16", "auto", 128, "decode_tma", ()), ("sm_90a", "bf16", "auto", 128, "multi_tma", ()),
            ("sm_90a", "bf16", "fp8_e4m3", 128, "decode_tma", ()), ("sm_90a", "bf16", "auto", 128, "prefill_ws", ()),
            ("sm_90a", "bf16", "auto", 128, "decode_tma", (True, True, False, True))]


def times(args) -> int:
    rows = []
    for arch, dtype, kv, d, mode, flags in VARIANTS * args.repeat:
        k = Kernel(AttnFwdSpec.for_arch(arch, dtype, kv, d, mode, tuple(flags) or (False,) * 4))
        with tempfile.TemporaryDirectory() as tmp:
            r = compile_source(k.source, variant=k.name, arch=arch,
                               options=nvrtc_options(arch, toolchain()) + [f"-time={tmp}/time.csv"])
            phases = {}
            for line in Path(tmp, "time.csv").read_text().splitlines()[1:]:
                _, phase, ms, _ = (x.strip() for x in line.split(","))
                phases[phase] = phases.get(phase, 0.0) + float(ms) / 1e3
        rows.append(dict(variant=k.name, arch=arch, seconds=round(r.seconds, 2), phases_s=phases))
        print(f"{k.name:58s} {arch:7s} {r.seconds:6.1f} s  " + "  ".join(f"{p} {s:.1f}" for p, s in phases.items()),
              flush=True)
    path = write_quick(args.out, "compile_times", rows, suffix="_" + args.tag if args.tag else "", gpu=False,
                       package=str(Path(pagedattn.__file__).parent), tag=args.tag,
                       **({"commit": args.commit} if args.commit else {}))
    print("wrote", path)
    return 0


def precompile(args) -> int:
    archs = aot.resolve_archs(args.arch)
    jobs = aot.plan(aot.select(preset=args.preset).specs, archs)
    out = Path(args.bundle) if args.bundle else Path(tempfile.mkdtemp(prefix="pagedattn-aot-perf-")) / "bundle"
    load_before, t0 = os.getloadavg(), time.perf_counter()
    cold = aot.precompile(jobs, out, n_jobs=args.jobs, progress=True)
    cold_wall, load_after, t0 = time.perf_counter() - t0, os.getloadavg(), time.perf_counter()
    warm = aot.precompile(jobs, out, n_jobs=args.jobs, progress=False)
    rerun_wall = time.perf_counter() - t0
    variants = json.loads((out / "manifest.json").read_text())["variants"]
    on_disk = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    if not args.bundle:
        shutil.rmtree(out.parent, ignore_errors=True)
    families = {v["family"]: [w for w in variants if w["family"] == v["family"]] for v in variants}
    per_family = {family: {"kernels": len(vs), "bytes": sum(v["size"] for v in {w["file"]: w for w in vs}.values()),
                           "compile_seconds_sum": round(sum(v["compile_seconds"] for v in vs), 2)}
                  for family, vs in families.items()}
    record = {
        "what": f"pagedattn precompile --arch {','.join(archs)} --preset {args.preset} (cold, empty --out; then a "
                "rerun)", "toolchain": expected_header(), "preset": dict(aot.PRESETS[args.preset]), "archs": archs,
        "jobs": cold.jobs, "programs": cold.programs, "kernels": len(jobs), "compiled": cold.compiled,
        "failed": [f"{j.label}: {p}" for j, p in cold.failed], "wall_seconds": round(cold_wall, 2),
        "compile_seconds_sum": round(sum(v["compile_seconds"] for v in variants), 2),
        "rerun_wall_seconds": round(rerun_wall, 3), "rerun_compiled": warm.compiled,
        "bundle_bytes_cubins": cold.bundle_bytes, "bundle_mib_on_disk": round(on_disk / 2**20, 2),
        "per_family": per_family, "slowest": [{"name": v["name"], "arch": v["arch"], "seconds": v["compile_seconds"]}
                                              for v in sorted(variants, key=lambda v: -v["compile_seconds"])[:5]],
        "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in load_after],
    }
    print(json.dumps({k: record[k] for k in ("kernels", "programs", "jobs", "wall_seconds", "compile_seconds_sum",
                                              "rerun_wall_seconds", "bundle_mib_on_disk", "failed")}, indent=1))
    print("wrote", write_quick(args.out, "aot_precompile", record, gpu=False))
    return 1 if cold.failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    t = sub.add_parser("times", help="cold NVRTC compile time of attention variants, per phase")
    t.add_argument("--tag", default="")
    t.add_argument("--repeat", type=int, default=1)
    t.add_argument("--commit", default=None, help="the commit of the installed build (default: this checkout's)")
    p = sub.add_parser("precompile", help="`pagedattn precompile` cold and rerun")
    p.add_argument("--preset", default="default")
    p.add_argument("--jobs", type=int, default=None)
    p.add_argument("--bundle", default=None, help="build into (and keep) this folder, not a temporary one")
    p.add_argument("--arch", default="sm_90a")
    for parser in (t, p):
        parser.add_argument("--out", default="perf/results")
    args = ap.parse_args(argv)
    return {"times": times, "precompile": precompile}[args.what](args)


if __name__ == "__main__":
    raise SystemExit(main())
