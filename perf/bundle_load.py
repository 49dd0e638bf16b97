"""Cost of reading kernels from an AOT bundle (issue 19: <= 50 ms per kernel; <= 40 MiB on disk): times
bundle.read_checked (read, xz-decompress, size and sha256 check) of every entry, --reps times each (median), on
this machine's CPU; no GPU needed. With --out writes OUT/bundle_load_cpu<cores>_<date>.json.

    python perf/bundle_load.py BUNDLE_DIR [--out perf/results] [--reps 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from pagedattn.bench.meta import host
from pagedattn.codegen import bundle


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    manifest = bundle.read_manifest(args.folder)
    if manifest is None:
        raise SystemExit(f"{args.folder}: not a bundle this install can read")
    rows = []
    for v in manifest["variants"]:
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            _, why = bundle.read_checked(args.folder, v)
            times.append(time.perf_counter() - t0)
            if why:
                raise SystemExit(f"{v['name']}: {why}")
        rows.append({"name": v["name"], "arch": v["arch"], "size": v["size"],
                     "stored_size": v.get("stored_size", v["size"]), "ms": 1e3 * statistics.median(times)})
    ms = [r["ms"] for r in rows]
    summary = {"kernels": len(rows), "stored_mib": sum(r["stored_size"] for r in rows) / 2**20,
               "cubin_mib": sum(r["size"] for r in rows) / 2**20, "median_ms": statistics.median(ms), "max_ms": max(ms)}
    print(json.dumps(summary, indent=1))
    if args.out:
        meta = dict(host(), folder=str(args.folder))
        path = args.out / f"bundle_load_cpu{os.cpu_count()}_{meta['date'].replace('-', '')}.json"
        path.write_text(json.dumps({"metadata": meta, "summary": summary, "kernels": rows}, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
