"""Fresh-process measurements for the jit suite (run as `python path/to/_jit_worker.py`, not with -m,
so that `import pagedattn` below is really the first import of the package).

For each workload: build its inputs, synchronise, then time its first call (with a sync) and note which
kernel variants this process compiled and how long each compile took (from the cache entries' meta.json).
With an empty PAGEDATTN_CACHE_DIR that is the cold path; run again on the same folder it is the warm path
(disk hit, no compile). One JSON line per workload goes to --out as soon as it is done, so a timeout
keeps what finished.
"""
import sys

if sys.path and sys.path[0].rstrip("/").endswith("bench"):
    sys.path.pop(0)  # this folder's modules must not shadow top-level names

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

T_START = time.perf_counter()


def _entries(root: Path) -> dict[str, dict]:
    out = {}
    for meta in root.glob("*/meta.json") if root.is_dir() else ():
        try:
            out[meta.parent.name] = json.loads(meta.read_text())
        except (OSError, ValueError):
            pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = open(args.out, "a", buffering=1)
    emit = lambda obj: (out.write(json.dumps(obj) + "\n"), out.flush())  # noqa: E731

    t0 = time.perf_counter()
    import torch

    t_torch, t0 = time.perf_counter() - t0, time.perf_counter()
    import pagedattn  # noqa: F401
    from pagedattn import envs
    from pagedattn.codegen.cache import kernel_cache

    t_import = time.perf_counter() - t0
    torch.zeros(1, device="cuda").add_(1)
    torch.cuda.synchronize()  # context creation stays out of the first-call times
    root = envs.cache_dir()
    emit({"event": "start", "import_torch_s": t_torch, "import_pagedattn_s": t_import, "cache_dir": str(root),
          "pid": os.getpid()})

    from pagedattn.bench.jit import WORKLOADS

    for name in args.workloads.split(","):
        rec = {"event": "workload", "workload": name}
        try:
            work = WORKLOADS[name]("cuda")
            torch.cuda.synchronize()
            before, compiles0 = _entries(root), kernel_cache().compiles
            t0 = time.perf_counter()
            work["fn"]()
            torch.cuda.synchronize()
            rec["first_call_s"] = time.perf_counter() - t0
            rec["compiles"] = kernel_cache().compiles - compiles0
            rec["variants"] = {m.get("variant", k): m.get("compile_seconds")
                               for k, m in _entries(root).items() if k not in before}
            rec["origins"] = sorted({a.origin for a in kernel_cache()._memory.values()})
        except Exception as exc:  # noqa: BLE001
            rec["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}"
        emit(rec)
    emit({"event": "done", "total_s": time.perf_counter() - T_START})
    return 0


if __name__ == "__main__":
    sys.exit(main())
