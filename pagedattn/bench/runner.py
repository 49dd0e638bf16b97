"""`pagedattn bench`: run the suites, one child process each, and write the results file.

A kernel fault poisons the CUDA context and a hang never returns: when the child dies inside a case or
makes no progress for --case-timeout seconds, that case is recorded as crashed / timeout with what it had
measured, and a fresh child runs the remaining cases. The results file is rewritten after every suite.
The child (`python -m pagedattn.bench.runner SUITE JSONL SKIP OPTIONS`, `child` below) writes JSON lines:
`plan` (the case ids), per case `start`, `partial` (after each measurement) and `case`; `fatal` when the
CUDA context is lost (then exit code 3); `done`.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import report, schema, suites

NO_GPU_MESSAGE = ("pagedattn bench: no CUDA GPU is available (torch {torch} reports "
                  "torch.cuda.is_available() = False; CUDA build: {cuda}).\n"
                  "The benchmark times kernels on an NVIDIA GPU, so there is nothing to measure here.\n"
                  "Without a GPU you can still run `pagedattn bench report` (RESULTS.md and plots from "
                  "perf/results) and `pagedattn bench compare A.json B.json`.")
MAX_ATTEMPTS = 8
CHILD_OPTIONS = ("device", "quick", "tiny", "no_flex", "case_timeout", "only")


def jsonable(obj):
    """Plain JSON: non-finite floats become null, unknown objects their str()."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj if obj is None or isinstance(obj, (str, int, bool)) else str(obj)


def _rc_text(rc) -> str:
    try:
        return f"{rc} ({signal.Signals(-rc).name})" if rc is not None and rc < 0 else str(rc)
    except ValueError:
        return str(rc)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child's own session: it and what it started
    except OSError:
        proc.kill()
    proc.wait()


class SuiteRunner:
    def __init__(self, args, console, ceilings: dict):
        self.args, self.console, self.ceilings, self.proc = args, console, ceilings, None

    def stop(self) -> None:
        """Kill the running suite process (Ctrl-C: it lives in its own session and would not see it)."""
        if self.proc is not None and self.proc.poll() is None:
            _kill(self.proc)

    def say(self, text: str, style: str | None = None) -> None:
        self.console.print(text, style=style, markup=False, highlight=False)

    def run(self, suite: str) -> dict:
        """Run one suite to completion (restarting children as needed); the suite's result dict."""
        t_suite, timeout = time.perf_counter(), self.args.case_timeout
        tmp = Path(tempfile.mkdtemp(prefix=f"pagedattn-bench-{suite.strip('_')}-"))
        jsonl, skip_file = tmp / "log.jsonl", tmp / "skip.json"
        jsonl.touch()
        opts = {k: getattr(self.args, k) for k in CHILD_OPTIONS}
        opts.update(ceilings={k: v for k, v in self.ceilings.items() if v},
                    only=self.args.only if suite != "ceilings" else "")
        plan, records, partials, problems, offset = None, {}, {}, [], 0
        for attempt in range(1, MAX_ATTEMPTS + 1):
            skip_file.write_text(json.dumps(sorted(records)))
            self.proc = proc = subprocess.Popen(
                [sys.executable, "-m", "pagedattn.bench.runner", suite, str(jsonl), str(skip_file), json.dumps(opts)],
                start_new_session=True)
            current, fatal, done, timed_out = None, None, False, False
            last_progress, n_before = time.monotonic(), len(records)
            while True:
                rc = proc.poll()
                with open(jsonl, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                complete = chunk[:chunk.rfind(b"\n") + 1]
                offset += len(complete)
                for line in complete.decode("utf-8", "replace").splitlines():
                    try:
                        ev = json.loads(line)
                    except ValueError:  # a line cut short by a killed child
                        continue
                    last_progress, kind = time.monotonic(), ev["event"]
                    if kind == "plan" and plan is None:
                        plan = ev
                    elif kind == "start":
                        current = ev["id"]
                    elif kind == "partial":
                        partials[ev["id"]] = ev["record"]
                    elif kind == "case":
                        records[ev["id"]], current = ev["record"], None
                    elif kind == "fatal":
                        fatal = ev["error"]
                    done = done or kind == "done"
                if rc is not None:
                    if not complete:
                        break
                    continue  # drain what the child wrote before it exited
                if time.monotonic() - last_progress > timeout:
                    timed_out = True
                    self.say(f"  {suite}: no progress for {timeout:.0f} s in {current or 'setup'}; "
                             "stopping that process", style="bold red")
                    _kill(proc)
                    continue
                time.sleep(0.2)
            rc = proc.returncode
            if done:
                break
            if plan is None:
                problems.append(f"the suite process exited with code {_rc_text(rc)} before listing its cases")
                break
            if current is not None:
                params = next((c.get("params") for c in plan["cases"] if c["id"] == current), None)
                rec = dict(partials.get(current) or schema.new_case(current, suite, params))
                rec["status"] = "timeout" if timed_out else "crashed"
                rec["error"] = (f"no progress for {timeout:.0f} s; process killed" if timed_out else
                                f"the process died in this case (exit {_rc_text(rc)})" + (f": {fatal}" if fatal else ""))
                records[current] = rec
                self.say("  " + report.describe(schema.derive(rec, self.ceilings)), style="red")
            elif len(records) == n_before:
                problems.append(f"the suite process exited with code {_rc_text(rc)} without progress")
                break
            remaining = [c["id"] for c in plan["cases"] if c["id"] not in records]
            if not remaining:
                break
            self.say(f"  {suite}: restarting in a fresh process for {len(remaining)} remaining case(s) "
                     f"(attempt {attempt + 1})", style="yellow")
        else:
            problems.append(f"gave up after {MAX_ATTEMPTS} processes")
        shutil.rmtree(tmp, ignore_errors=True)
        seconds, reason = time.perf_counter() - t_suite, "; ".join(problems) or None
        if plan is None or plan["status"] in ("skipped", "error"):
            return {"status": plan["status"] if plan else "error", "reason": plan["reason"] if plan else reason or "no plan",
                    "seconds": seconds, "cases": []}
        cases = []
        for c in plan["cases"]:
            rec = records.get(c["id"])
            if rec is None:
                rec = schema.new_case(c["id"], suite, c.get("params"))
                rec.update(status="error", error="not run: " + (reason or "suite aborted"))
            for key, value in schema.new_case(c["id"], suite).items():
                rec.setdefault(key, value)
            cases.append(jsonable(schema.derive(rec, self.ceilings)))
        status = "ok" if all(c["status"] in ("ok", "skipped") for c in cases) else "partial"
        return {"status": status, "reason": reason, "seconds": round(seconds, 1), "cases": cases}


def _write_json(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(jsonable(results), indent=1) + "\n")
    os.replace(tmp, path)


def run(args) -> int:
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(NO_GPU_MESSAGE.format(torch=torch.__version__, cuda=torch.version.cuda or "none (CPU build)"),
              file=sys.stderr)
        return 2
    try:
        names = suites.parse(args.suite)
    except ValueError as exc:
        print(f"pagedattn bench: {exc}", file=sys.stderr)
        return 2

    from rich.console import Console
    from rich.rule import Rule

    from . import meta as metamod

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    say = lambda text, style=None: console.print(text, style=style, markup=False)  # noqa: E731
    t0 = time.perf_counter()
    metadata = metamod.collect(args.device, args.quick, names)
    uuid, index = metadata.pop("_uuid", None), metadata.pop("_index", None)
    out_dir = Path(args.out)
    path = metamod.results_name(metadata, out_dir)
    console.print(Rule(f"pagedattn bench — {metadata['gpu']} ({metadata['sm_count']} SMs, "
                       f"{metadata['arch']}) — {'quick' if args.quick else 'full'} — {', '.join(names)}"))
    say(f"results: {path}")
    results = {"schema": schema.SCHEMA, "metadata": metadata, "ceilings": {}, "suites": {}}
    ceilings: dict = {}
    runner = SuiteRunner(args, console, ceilings)
    console.print(Rule("ceilings"))
    try:
        ceil = runner.run("ceilings")
    except KeyboardInterrupt:
        runner.stop()
        say("interrupted", style="red")
        return 130
    for case in ceil["cases"]:
        which, impl = case["id"].split("/", 1)[1], case.get("ours")
        if case["status"] == "ok" and impl:
            ceilings[which] = {**impl, "value": schema.throughput(case["unit"], case["work"], impl["us"]),
                               "work": case["work"],
                               **{k: v for k, v in (case.get("extra") or {}).items() if k != "traceback"}}
        else:
            ceilings[which] = {"name": which, "error": case.get("error") or case["status"]}
    results["ceilings"] = {k: ceilings.get(k) for k in schema.CEILINGS}
    for k in schema.CEILINGS:
        c = ceilings.get(k) or {}
        say(f"  {k}: " + ("FAILED: " + c["error"] if c.get("error") else report.fmt_value(c.get("value"),
                                                                                          schema.CEILING_UNIT[k])))
    if metadata.get("clocks") is not None:
        metadata["clocks"]["after_ceilings"] = metamod.clocks(uuid, index)
    runner.ceilings = {k: v for k, v in ceilings.items() if not v.get("error")}

    interrupted = False
    for name in names:
        console.print(Rule(name))
        try:
            suite = results["suites"][name] = runner.run(name)
        except KeyboardInterrupt:
            runner.stop()
            interrupted = True
            say(f"interrupted during {name}: writing the suites finished so far", style="red")
            break
        if suite["status"] in ("skipped", "error"):
            say(f"  {name}: {suite['status']} — {suite.get('reason')}")
        else:
            console.print(report.console_table(f"{name} — {metadata['gpu']}", *report.suite_table(results, name)))
        metadata["wall_seconds"] = round(time.perf_counter() - t0, 1)
        _write_json(path, results)

    if metadata.get("clocks") is not None:
        metadata["clocks"]["end"] = metamod.clocks(uuid, index)
    metadata.update(finished=metamod.now(), wall_seconds=round(time.perf_counter() - t0, 1))
    errs = schema.validate(jsonable(results))
    if errs:  # never lose a run over a schema slip: write it, say so
        metadata["schema_errors"] = errs[:20]
        say("results do not validate:\n  " + "\n  ".join(errs[:20]), style="red")
    _write_json(path, results)
    console.print(Rule("done"))
    say(f"wrote {path} ({metadata['wall_seconds']:.0f} s)")
    bad = [c for s in results["suites"].values() for c in s["cases"] if c["status"] not in ("ok", "skipped")]
    if bad:
        say(f"{len(bad)} case{'s' if len(bad) != 1 else ''} not ok: " + ", ".join(
            f"{c['id']} ({c['status']})" for c in bad[:12]) + (" ..." if len(bad) > 12 else ""), style="yellow")
    if not args.no_report:
        try:
            regenerate(out_dir, console)
        except Exception as exc:  # noqa: BLE001 - the results file is safe; say what failed
            say(f"RESULTS.md / plots not regenerated: {type(exc).__name__}: {exc} "
                f"(retry with `pagedattn bench report --results {out_dir}`)", style="red")
    return 130 if interrupted else 0


def regenerate(results_dir: Path, console, include_samples: bool = False) -> None:
    results_dir = Path(results_dir)
    plots = results_dir.parent / "plots"
    md, made = report.write_results_md(results_dir, results_dir.parent / "RESULTS.md", plots,
                                       include_samples=include_samples,
                                       warn=lambda m: console.print(m, style="yellow", markup=False))
    console.print(f"wrote {md} and {len(made)} plot{'s' if len(made) != 1 else ''} in {plots}", markup=False)


# -- the child: one suite in this process ------------------------------------------------------------
def child(suite: str, jsonl: str, skip_file: str, opts: dict) -> int:
    import gc

    import torch
    from rich.console import Console

    from .common import Ctx, CudaContextLost, Recorder, assert_cuda_healthy, short_error

    out = open(jsonl, "a", buffering=1)
    emit = lambda obj: (out.write(json.dumps(jsonable(obj)) + "\n"), out.flush())  # noqa: E731
    con = Console(highlight=False, soft_wrap=True)
    say = lambda text: con.print(text, markup=False)  # noqa: E731
    skip = set(json.loads(Path(skip_file).read_text())) if os.path.exists(skip_file) else set()
    ctx = Ctx.make(opts["device"], opts["quick"], opts["tiny"], opts["ceilings"], say,
                   case_timeout_s=opts["case_timeout"], no_flex=opts["no_flex"])
    available, make_cases = suites.get(suite)
    plan = {"event": "plan", "suite": suite, "status": "ok", "reason": None, "cases": []}
    try:
        ok, reason = available(ctx)
    except Exception as exc:  # noqa: BLE001
        ok, reason = False, f"availability check failed: {short_error(exc)}"
    try:
        case_list = make_cases(ctx) if ok else []
    except Exception as exc:  # noqa: BLE001
        ok, reason = None, short_error(exc)
        say(f"  {suite}: ERROR building the case list — {reason}")
    if not ok:
        emit({**plan, "status": "skipped" if ok is False else "error", "reason": reason})
        emit({"event": "done"})
        return 0
    only = [s for s in opts["only"].split(",") if s]
    case_list = [c for c in case_list if not only or any(s in c.id for s in only)]
    emit({**plan, "cases": [{"id": c.id, "params": c.params} for c in case_list]})
    for case in case_list:
        if case.id in skip:
            continue
        emit({"event": "start", "id": case.id, "time": time.time()})
        rec = Recorder(case, ctx, lambda r, cid=case.id: emit({"event": "partial", "id": cid, "record": r}))
        t0, fatal = time.perf_counter(), None
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
        frames = [ln.strip() for ln in (record["extra"].get("traceback") or "").splitlines()
                  if ln.strip().startswith("File ")] if record["status"] == "error" else []
        if frames:  # where it failed: the innermost frame
            say("    at " + frames[-1][:300])
        del rec, record
        gc.collect()
        if fatal is not None:
            emit({"event": "fatal", "id": case.id, "error": fatal})
            say(f"  CUDA context lost after {case.id} ({fatal}); continuing in a fresh process")
            sys.stdout.flush()
            os._exit(3)
        if ctx.is_cuda:
            torch.cuda.empty_cache()
    emit({"event": "done"})
    return 0


if __name__ == "__main__":
    sys.exit(child(*sys.argv[1:4], json.loads(sys.argv[4])))
