"""`pagedattn bench`: run the suites, one child process each, and write the results file. A kernel fault
poisons the CUDA context and a hang never returns: when the child dies in a case or makes no progress for
--case-timeout seconds, the case is recorded as crashed / timeout with what it had measured, and a fresh child
runs the rest. The child (`python -m pagedattn.bench.runner SUITE JSONL OPTIONS`) writes JSON lines: `plan`,
per case `start`, `partial` (after each measurement) and `case`; `done`. A lost CUDA context ends it (exit 3)
after the case's record.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagedattn.ops.attention import forced

from . import meta, report, schema, suites
from .common import CudaContextLost, Ctx, Recorder, assert_cuda_healthy, short_error

NO_GPU_MESSAGE = ("pagedattn bench: no CUDA GPU is available (torch {torch} reports torch.cuda.is_available() = "
                  "False; CUDA build: {cuda}).\nThe benchmark times kernels on an NVIDIA GPU, so there is nothing "
                  "to measure here.\nWithout a GPU you can still run `pagedattn bench report` (RESULTS.md from "
                  "perf/results) and `pagedattn bench compare A.json B.json`.")
MAX_ATTEMPTS = 8


def jsonable(obj):
    """Plain JSON: non-finite floats become null, unknown objects their str()."""
    return json.loads(json.dumps(obj, default=str), parse_constant=lambda name: None)  # NaN, Infinity


def read_jsonl(path: Path) -> list[dict]:
    events = []
    for line in Path(path).read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:  # a line cut short by a killed child
            pass
    return events


class SuiteRunner:
    def __init__(self, args, ceilings: dict):
        self.args, self.ceilings, self.proc = args, ceilings, None

    def stop(self) -> None:
        """Kill the running suite process and what it started (it lives in its own session)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def _attempt(self, suite: str, jsonl: Path, opts: dict) -> tuple[int, bool]:
        """One child until it exits or stalls: (its exit code, whether it was killed for a stall)."""
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedattn.bench.runner", suite, str(jsonl),
                                      json.dumps(opts)], start_new_session=True)
        size, last = -1, time.monotonic()
        while self.proc.poll() is None:
            if jsonl.stat().st_size != size:
                size, last = jsonl.stat().st_size, time.monotonic()
            elif time.monotonic() - last > self.args.case_timeout:
                print(f"  {suite}: no progress for {self.args.case_timeout:.0f} s; stopping that process")
                self.stop()
                return self.proc.returncode, True
            time.sleep(0.2)
        return self.proc.returncode, False

    def run(self, suite: str) -> dict:
        """Run one suite to completion (restarting children as needed); the suite's result dict."""
        t0, timeout = time.perf_counter(), self.args.case_timeout
        opts = {k: getattr(self.args, k) for k in ("device", "quick", "tiny", "case_timeout", "overrides")}
        opts.update(ceilings=self.ceilings, only=self.args.only if suite != "ceilings" else "")
        records, problem, plan, rc = {}, None, None, None
        with tempfile.NamedTemporaryFile(prefix="pagedattn-bench-", suffix=".jsonl") as log:
            jsonl = Path(log.name)
            for attempt in range(MAX_ATTEMPTS):
                n_before = len(records)
                rc, stalled = self._attempt(suite, jsonl, opts)
                events = read_jsonl(jsonl)
                plan = next((e for e in events if e["event"] == "plan"), None)
                records.update({e["id"]: e["record"] for e in events if e["event"] == "case"})
                if plan is None or any(e["event"] == "done" for e in events):
                    break
                started = [e["id"] for e in events if e["event"] == "start"]
                current = started[-1] if started and started[-1] not in records else None
                if current is None and len(records) == n_before:
                    problem = f"the suite process exited with code {rc} without progress"
                    break
                if current is not None:  # what it measured before it died, and why
                    partial = [e["record"] for e in events if e["event"] == "partial" and e["id"] == current]
                    params = next(c.get("params") for c in plan["cases"] if c["id"] == current)
                    rec = dict(partial[-1] if partial else schema.new_case(current, suite, params))
                    rec.update(status="timeout" if stalled else "crashed",
                               error=f"no progress for {timeout:.0f} s; process killed" if stalled else
                               f"the process died in this case (exit {rc})")
                    records[current] = rec
                    with jsonl.open("a") as f:
                        f.write(json.dumps({"event": "case", "id": current, "record": rec}) + "\n")
                    print("  " + report.describe(schema.derive(rec, self.ceilings)))
                if all(c["id"] in records for c in plan["cases"]):
                    break
                print(f"  {suite}: restarting in a fresh process (attempt {attempt + 2})")
            else:
                problem = f"gave up after {MAX_ATTEMPTS} processes"
        seconds = round(time.perf_counter() - t0, 1)
        if plan is None or plan["status"] != "ok":
            return {"status": plan["status"] if plan else "error", "cases": [], "seconds": seconds,
                    "reason": plan["reason"] if plan else f"the suite process exited with code {rc}"}
        cases = []
        for c in plan["cases"]:
            rec = records.get(c["id"]) or dict(schema.new_case(c["id"], suite, c.get("params")), status="error",
                                               error="not run: " + (problem or "suite aborted"))
            cases.append(jsonable(schema.derive(rec, self.ceilings)))
        status = "ok" if all(c["status"] in ("ok", "skipped") for c in cases) else "partial"
        return {"status": status, "reason": problem, "seconds": seconds, "cases": cases}


def _write_json(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(jsonable(results), indent=1) + "\n")
    os.replace(tmp, path)


def _ceilings(runner: SuiteRunner) -> dict:
    """The ceilings suite's two cases as the results file's `ceilings` (value in GB/s or TFLOP/s)."""
    out = {}
    for case in runner.run("ceilings")["cases"]:
        which, impl = case["id"].split("/", 1)[1], case.get("ours")
        if case["status"] == "ok" and impl:  # its value: the throughput (schema.derive)
            out[which] = {**impl, "work": case["work"], **case["extra"]}
            print(f"  {which}: " + report.fmt_value(out[which]["value"], schema.CEILING_UNIT[which]))
        else:
            out[which] = {"name": which, "error": case.get("error") or case["status"]}
            print(f"  {which}: FAILED: {out[which]['error']}")
    return out


def rule(title: str) -> None:
    print(f"── {title} " + "─" * max(3, 100 - len(title)), flush=True)


def run(args) -> int:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(NO_GPU_MESSAGE.format(torch=torch.__version__, cuda=torch.version.cuda or "none (CPU build)"),
              file=sys.stderr)
        return 2
    try:
        names = suites.parse(args.suite)
        args.overrides = json.loads(args.overrides or "{}")
    except ValueError as exc:
        print(f"pagedattn bench: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    metadata = meta.collect(args.device, args.quick, names, args.overrides)
    path = meta.results_name(metadata, Path(args.out))
    rule(f"pagedattn bench — {metadata['gpu']} ({metadata['sm_count']} SMs, {metadata['arch']}) — "
         f"{'quick' if args.quick else 'full'} — {', '.join(names)}")
    print(f"results: {path}" + (f" (overrides {args.overrides}: left out of RESULTS.md)" if args.overrides else ""))
    results = {"schema": schema.SCHEMA, "metadata": metadata, "ceilings": {}, "suites": {}}
    runner, interrupted = SuiteRunner(args, {}), False
    try:
        rule("ceilings")
        ceilings = _ceilings(runner)
        results["ceilings"] = {k: ceilings.get(k) for k in schema.CEILING_UNIT}
        runner.ceilings = {k: v for k, v in ceilings.items() if not v.get("error")}
        for name in names:
            rule(name)
            suite = results["suites"][name] = runner.run(name)
            if suite["status"] in ("skipped", "error"):
                print(f"  {name}: {suite['status']} — {suite.get('reason')}")
            else:
                print(report.markdown_table(*report.suite_table(results, name)))
            metadata["wall_seconds"] = round(time.perf_counter() - t0, 1)
            _write_json(path, results)
    except KeyboardInterrupt:
        runner.stop()
        interrupted = True
        print("interrupted: writing the suites finished so far")
    if metadata.get("clocks") is not None:
        metadata["clocks"]["end"] = meta.clocks()
    metadata.update(finished=meta.now(), wall_seconds=round(time.perf_counter() - t0, 1))
    errs = schema.validate(jsonable(results))
    if errs:  # never lose a run over a schema slip: write it, say so
        metadata["schema_errors"] = errs[:20]
        print("results do not validate:\n  " + "\n  ".join(errs[:20]))
    _write_json(path, results)
    rule("done")
    print(f"wrote {path} ({metadata['wall_seconds']:.0f} s)")
    bad = [f"{c['id']} ({c['status']})" for s in results["suites"].values() for c in s["cases"]
           if c["status"] not in ("ok", "skipped")]
    if bad:
        print(f"{len(bad)} case(s) not ok: " + ", ".join(bad[:12]) + (" ..." if len(bad) > 12 else ""))
    if not args.no_report and not interrupted:
        try:
            print(f"wrote {report.write_results_md(args.out, warn=print)}")
        except Exception as exc:  # noqa: BLE001 - the results file is safe; say what failed
            print(f"RESULTS.md not regenerated: {type(exc).__name__}: {exc} "
                  f"(retry with `pagedattn bench report --results {args.out}`)")
    return 130 if interrupted else 0


# -- the child: one suite in this process ------------------------------------------------------------
def _run_case(ctx, case, emit) -> str | None:
    """Run and record one case; the error when the CUDA context is lost (the process must end)."""
    rec = Recorder(case, ctx, lambda r: emit({"event": "partial", "id": case.id, "record": r}))
    t0, fatal = time.perf_counter(), None
    try:
        case.run(ctx, rec)
        ctx.sync()
    except CudaContextLost as exc:  # the harness saw it already: no second check
        rec.fail(exc)
        fatal = str(exc)
    except Exception as exc:  # noqa: BLE001 - one case's failure is data
        rec.fail(exc)
        try:
            assert_cuda_healthy(ctx)
        except CudaContextLost as lost:
            fatal = str(lost)
    record = rec.finish()
    record["seconds"] = round(time.perf_counter() - t0, 3)
    emit({"event": "case", "id": case.id, "record": record})
    print("  " + report.describe(record), flush=True)
    return fatal


def child(suite: str, jsonl: str, opts: dict) -> int:
    out = open(jsonl, "a", buffering=1)
    emit = lambda obj: out.write(json.dumps(jsonable(obj)) + "\n")  # noqa: E731
    done = {e["id"] for e in read_jsonl(Path(jsonl)) if e["event"] == "case"}
    only = [s for s in opts.pop("only").split(",") if s]
    ctx = Ctx.make(**opts)
    available, make_cases = suites.get(suite)
    plan = {"event": "plan", "suite": suite, "status": "ok", "reason": None, "cases": []}
    try:
        ok, reason = available(ctx)
        case_list = make_cases(ctx) if ok else []
    except Exception as exc:  # noqa: BLE001
        ok, reason = None, short_error(exc)
    if not ok:
        emit({**plan, "status": "skipped" if ok is False else "error", "reason": reason})
        emit({"event": "done"})
        return 0
    case_list = [c for c in case_list if not only or any(s in c.id for s in only)]
    if not done:
        emit({**plan, "cases": [{"id": c.id, "params": c.params} for c in case_list]})
    with forced(**ctx.overrides["attention"]) if "attention" in ctx.overrides else contextlib.nullcontext():
        for case in (c for c in case_list if c.id not in done):
            emit({"event": "start", "id": case.id, "time": time.time()})
            fatal = _run_case(ctx, case, emit)
            if fatal is not None:
                print(f"  CUDA context lost after {case.id} ({fatal}); continuing in a fresh process", flush=True)
                os._exit(3)
            gc.collect()
            if ctx.is_cuda:
                torch.cuda.empty_cache()
    emit({"event": "done"})
    return 0


if __name__ == "__main__":
    sys.exit(child(sys.argv[1], sys.argv[2], json.loads(sys.argv[3])))
