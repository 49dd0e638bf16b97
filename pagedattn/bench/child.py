"""One suite in its own process (`python -m pagedattn.bench.child`), driven by the runner. It writes JSON
lines: `plan` (the case ids), per case `start`, `partial` (after each measurement) and `case`; `fatal`
when the CUDA context is lost (then exit code 3: the runner starts a fresh child); `done`.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time


def jsonable(obj):
    """Plain JSON: non-finite floats become null, unknown objects their str()."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    return str(obj)


class Emitter:
    def __init__(self, path: str):
        self._f = open(path, "a", buffering=1)

    def __call__(self, obj: dict) -> None:
        self._f.write(json.dumps(jsonable(obj)) + "\n")
        self._f.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pagedattn.bench.child")
    ap.add_argument("--suite", required=True)
    ap.add_argument("--jsonl", required=True)
    ap.add_argument("--skip-file")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--ceilings", default="{}")
    ap.add_argument("--case-timeout", type=float, default=600.0)
    ap.add_argument("--only", default="", help="comma-separated substrings: run matching case ids only")
    args = ap.parse_args(argv)

    from rich.console import Console

    emit = Emitter(args.jsonl)
    con = Console(highlight=False, soft_wrap=True)

    def say(text: str) -> None:
        con.print(text, markup=False)

    import torch  # noqa: F401

    from . import report, suites
    from .common import Ctx, CudaContextLost, Recorder, assert_cuda_healthy, short_error

    skip = set()
    if args.skip_file and os.path.exists(args.skip_file):
        skip = set(json.loads(open(args.skip_file).read()))
    ctx = Ctx.make(args.device, args.quick, args.tiny, json.loads(args.ceilings), say,
                   case_timeout_s=args.case_timeout, no_flex=args.no_flex)
    available, make_cases = suites.get(args.suite)
    try:
        ok, reason = available(ctx)
    except Exception as exc:  # noqa: BLE001
        ok, reason = False, f"availability check failed: {short_error(exc)}"
    if not ok:
        emit({"event": "plan", "suite": args.suite, "status": "skipped", "reason": reason, "cases": []})
        emit({"event": "done"})
        return 0
    try:
        case_list = make_cases(ctx)
    except Exception as exc:  # noqa: BLE001
        emit({"event": "plan", "suite": args.suite, "status": "error", "reason": short_error(exc),
              "cases": []})
        emit({"event": "done"})
        say(f"  {args.suite}: ERROR building the case list — {short_error(exc)}")
        return 0
    only = [s for s in args.only.split(",") if s]
    if only:
        case_list = [c for c in case_list if any(s in c.id for s in only)]
    emit({"event": "plan", "suite": args.suite, "status": "ok", "reason": None,
          "cases": [{"id": c.id, "params": c.params} for c in case_list]})

    for case in case_list:
        if case.id in skip:
            continue
        emit({"event": "start", "id": case.id, "time": time.time()})
        rec = Recorder(case, ctx, lambda r, cid=case.id: emit({"event": "partial", "id": cid, "record": r}))
        t0 = time.perf_counter()
        fatal = None
        try:
            case.run(ctx, rec)
            ctx.sync()
        except CudaContextLost as exc:
            rec.fail(exc)
            fatal = str(exc)
        except Exception as exc:  # noqa: BLE001 - one case's failure is data
            rec.fail(exc)
            if ctx.is_cuda:
                try:
                    assert_cuda_healthy()
                except CudaContextLost as lost:
                    fatal = str(lost)
        record = rec.finish()
        record["seconds"] = round(time.perf_counter() - t0, 3)
        emit({"event": "case", "id": case.id, "record": record})
        say("  " + report.describe(record))
        tb = record["extra"].get("traceback") if record["status"] == "error" else None
        if tb:  # where it failed: the innermost frame
            frames = [ln.strip() for ln in tb.splitlines() if ln.strip().startswith("File ")]
            if frames:
                say("    at " + frames[-1][:300])
        del rec, record
        gc.collect()
        if ctx.is_cuda and fatal is None:
            torch.cuda.empty_cache()
        if fatal is not None:
            emit({"event": "fatal", "id": case.id, "error": fatal})
            say(f"  CUDA context lost after {case.id} ({fatal}); continuing in a fresh process")
            sys.stdout.flush()
            os._exit(3)
    emit({"event": "done"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
