"""Does a kernel compiled in an NVRTC program (aot.build.programs) have the SASS of its own compile?

    python tests/tools/program_sass.py [--preset default] [--ops FAMILY,...] [--arch sm_90a] [--jobs N] [--out DIR]

Compiles every program of the preset's partition and every kernel alone (worker processes), disassembles
both with nvdisasm (from the CUDA toolkit on PATH, or NVDISASM=...) and compares each kernel's
instructions, with label and internal-symbol numbering, the program's namespaces and whitespace
normalised. Prints the kernels that differ and writes program_sass_<arch>_<date>.json under --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


def _sass(cubin: bytes, nvdisasm: str) -> dict[str, list[str]]:
    """{kernel: normalised instructions} of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    kernels: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"\s*\.text\.(\S+):", line)
        if m:
            current = kernels.setdefault(m.group(1), [])
        elif current is not None and re.search(r"/\*[0-9a-f]{4,}\*/", line):
            ins = re.sub(r"/\*[0-9a-f]+\*/", "", line)
            ins = re.sub(r"__internal_\d+_", "__internal_", ins)
            ins = re.sub(r"N\d+pagedattn_program_\d+(\d+\w+?)E", r"\1", ins)  # a type of the program's namespace
            current.append(" ".join(ins.split()))
    for name, lines in kernels.items():  # labels by order of appearance
        labels: dict[str, str] = {}
        kernels[name] = [re.sub(r"\.L_x_\d+", lambda m: labels.setdefault(m.group(0), f"L{len(labels)}"), x)
                         for x in lines]
    return kernels


def _compile(names, arch, sources, options):
    from pagedattn.codegen.compile import compile_program

    result = compile_program(list(sources), variants=list(names), arch=arch, options=list(options))
    return result.cubin, result.seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="default")
    ap.add_argument("--ops", default=None, help="families, comma-separated (default: all)")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--out", default="perf/results")
    args = ap.parse_args(argv)
    nvdisasm = os.environ.get("NVDISASM") or shutil.which("nvdisasm") or "/usr/local/cuda/bin/nvdisasm"
    from pagedattn import aot
    from pagedattn.aot.build import programs

    ops = args.ops.split(",") if args.ops else None
    jobs = aot.plan(aot.select(preset=args.preset, ops=ops).specs, [args.arch])
    parts = programs(jobs)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.jobs) as pool:
        grouped = [pool.submit(_compile, [j.name for j in p], args.arch, [j.source for j in p], p[0].options)
                   for p in parts]
        alone = {j.name: pool.submit(_compile, [j.name], args.arch, [j.source], j.options) for j in jobs}
        program_s = sum(f.result()[1] for f in grouped)
        alone_s = sum(f.result()[1] for f in alone.values())
        differ = []
        for part, fut in zip(parts, grouped):
            together = _sass(fut.result()[0], nvdisasm)
            for job in part:
                own = _sass(alone[job.name].result()[0], nvdisasm)[job.name]
                if own != together[job.name]:
                    differ.append({"kernel": job.name, "program": [j.name for j in part],
                                   "instructions": [len(own), len(together[job.name])]})
    record = {"what": "SASS of every kernel of the preset compiled in its NVRTC program vs alone "
                      "(tests/tools/program_sass.py)", "preset": args.preset, "arch": args.arch,
              "kernels": len(jobs), "programs": len(parts), "differ": differ,
              "compile_seconds_programs": round(program_s, 1), "compile_seconds_alone": round(alone_s, 1),
              "wall_seconds": round(time.perf_counter() - t0, 1),
              "commit": os.environ.get("PAGEDATTN_GIT_COMMIT", ""), "host_cpus": os.cpu_count()}
    for d in differ:
        print("DIFFERS", d["kernel"], d["instructions"], "in", d["program"])
    print(f"{len(jobs) - len(differ)} of {len(jobs)} kernels have their own SASS in {len(parts)} programs; "
          f"compile-seconds {program_s:.0f} as programs, {alone_s:.0f} alone")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"program_sass_{args.arch}_{datetime.date.today():%Y%m%d}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print("wrote", path)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
