"""`pagedattn bench`: run the suites, one child process each (child.py), and write the results file.

A kernel fault poisons the CUDA context and a hang never returns: when the child dies inside a case or
makes no progress for --case-timeout seconds, that case is recorded as crashed / timeout with what it had
measured, and a fresh child runs the remaining cases. The results file is rewritten after every suite.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import report, schema, suites
from .child import jsonable

NO_GPU_MESSAGE = ("pagedattn bench: no CUDA GPU is available (torch {torch} reports "
                  "torch.cuda.is_available() = False; CUDA build: {cuda}).\n"
                  "The benchmark times kernels on an NVIDIA GPU, so there is nothing to measure here.\n"
                  "Without a GPU you can still run `pagedattn bench report` (RESULTS.md and plots from "
                  "perf/results) and `pagedattn bench compare A.json B.json`.")
MAX_ATTEMPTS = 8


class SuiteRunner:
    def __init__(self, args, console, ceilings: dict):
        self.args = args
        self.console = console
        self.ceilings = ceilings
        self.proc: subprocess.Popen | None = None

    def stop(self) -> None:
        """Kill the running suite process (Ctrl-C: it lives in its own session and would not see it)."""
        if self.proc is not None and self.proc.poll() is None:
            self._kill(self.proc)
            self.proc.wait()

    def say(self, text: str, style: str | None = None) -> None:
        self.console.print(text, style=style, markup=False, highlight=False)

    def _command(self, suite: str, jsonl: str, skip_file: str) -> list[str]:
        cmd = [sys.executable, "-m", "pagedattn.bench.child", "--suite", suite, "--jsonl", jsonl,
               "--skip-file", skip_file, "--device", self.args.device,
               "--ceilings", json.dumps({k: v for k, v in self.ceilings.items() if v})]
        if self.args.quick:
            cmd.append("--quick")
        if self.args.tiny:
            cmd.append("--tiny")
        if self.args.no_flex:
            cmd.append("--no-flex")
        cmd += ["--case-timeout", str(self.args.case_timeout)]
        if self.args.only and suite != "ceilings":
            cmd += ["--only", self.args.only]
        return cmd

    def run(self, suite: str) -> dict:
        """Run one suite to completion (restarting children as needed); the suite's result dict."""
        t_suite = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f"pagedattn-bench-{suite.strip('_')}-"))
        jsonl, skip_file = tmp / "log.jsonl", tmp / "skip.json"
        jsonl.touch()
        plan = None
        records: dict[str, dict] = {}
        partials: dict[str, dict] = {}
        problems: list[str] = []
        offset = 0
        timeout = self.args.case_timeout
        for attempt in range(1, MAX_ATTEMPTS + 1):
            skip_file.write_text(json.dumps(sorted(records)))
            proc = subprocess.Popen(self._command(suite, str(jsonl), str(skip_file)), start_new_session=True)
            self.proc = proc
            current, fatal, done, timed_out = None, None, False, False
            last_progress = time.monotonic()
            n_before = len(records)
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
                    except ValueError:
                        continue
                    last_progress = time.monotonic()
                    kind = ev.get("event")
                    if kind == "plan" and plan is None:
                        plan = ev
                    elif kind == "start":
                        current = ev["id"]
                    elif kind == "partial":
                        partials[ev["id"]] = ev["record"]
                    elif kind == "case":
                        records[ev["id"]] = ev["record"]
                        current = None
                    elif kind == "fatal":
                        fatal = ev.get("error")
                    elif kind == "done":
                        done = True
                if rc is not None:
                    if not complete:
                        break
                    continue  # drain what the child wrote before it exited
                if time.monotonic() - last_progress > timeout:
                    timed_out = True
                    self.say(f"  {suite}: no progress for {timeout:.0f} s in {current or 'setup'}; "
                             "stopping that process", style="bold red")
                    self._kill(proc)
                    proc.wait()
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
                rec = partials.get(current) or schema.new_case(current, suite, params)
                rec = dict(rec)
                rec["status"] = "timeout" if timed_out else "crashed"
                rec["error"] = (f"no progress for {timeout:.0f} s; process killed" if timed_out
                                else f"the process died in this case (exit {_rc_text(rc)})"
                                + (f": {fatal}" if fatal else ""))
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
        return self._assemble(suite, plan, records, problems, time.perf_counter() - t_suite)

    def _assemble(self, suite, plan, records, problems, seconds) -> dict:
        if plan is None:
            return {"status": "error", "reason": "; ".join(problems) or "no plan", "seconds": seconds,
                    "cases": []}
        if plan.get("status") in ("skipped", "error"):
            return {"status": plan["status"], "reason": plan.get("reason"), "seconds": seconds,
                    "cases": []}
        cases = []
        for c in plan["cases"]:
            rec = records.get(c["id"])
            if rec is None:
                rec = schema.new_case(c["id"], suite, c.get("params"))
                rec.update(status="error", error="not run: " + ("; ".join(problems) or "suite aborted"))
            for key, value in schema.new_case(c["id"], suite).items():
                rec.setdefault(key, value)
            cases.append(jsonable(schema.derive(rec, self.ceilings)))
        status = "ok" if all(c["status"] in ("ok", "skipped") for c in cases) else "partial"
        return {"status": status, "reason": "; ".join(problems) or None, "seconds": round(seconds, 1),
                "cases": cases}

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the child's own session: it and what it started
        except OSError:
            proc.kill()


def _rc_text(rc) -> str:
    if rc is None:
        return "?"
    if rc < 0:
        try:
            return f"{rc} ({signal.Signals(-rc).name})"
        except ValueError:
            return str(rc)
    return str(rc)


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
    t0 = time.perf_counter()
    metadata = metamod.collect(args.device, args.quick, names)
    uuid, index = metadata.pop("_uuid", None), metadata.pop("_index", None)
    out_dir = Path(args.out)
    path = metamod.results_name(metadata, out_dir)
    console.print(Rule(f"pagedattn bench — {metadata['gpu']} ({metadata['sm_count']} SMs, "
                       f"{metadata['arch']}) — {'quick' if args.quick else 'full'} — {', '.join(names)}"))
    console.print(f"results: {path}", markup=False)
    results = {"schema": schema.SCHEMA, "metadata": metadata, "ceilings": {"copy": None, "matmul": None},
               "suites": {}}

    ceilings: dict = {}
    runner = SuiteRunner(args, console, ceilings)
    console.print(Rule("ceilings"))
    try:
        ceil = runner.run("ceilings")
    except KeyboardInterrupt:
        runner.stop()
        console.print("interrupted", style="red")
        return 130
    for case in ceil["cases"]:
        which = case["id"].split("/", 1)[1]
        impl = case.get("ours")
        if case["status"] == "ok" and impl:
            impl = dict(impl)
            impl["value"] = schema.throughput(case["unit"], case["work"], impl["us"])
            impl["work"] = case["work"]
            impl.update({k: v for k, v in (case.get("extra") or {}).items() if k != "traceback"})
            ceilings[which] = impl
        else:
            ceilings[which] = {"name": which, "error": case.get("error") or case["status"]}
    results["ceilings"] = {k: ceilings.get(k) for k in schema.CEILINGS}
    for k in schema.CEILINGS:
        c = ceilings.get(k) or {}
        unit = schema.CEILING_UNIT[k]
        console.print(f"  {k}: {report.fmt_value(c.get('value'), unit) if not c.get('error') else 'FAILED: ' + c['error']}",
                      markup=False)
    if metadata.get("clocks") is not None:
        metadata["clocks"]["after_ceilings"] = metamod.clocks(uuid, index)
    runner.ceilings = {k: v for k, v in ceilings.items() if not v.get("error")}

    interrupted = False
    for name in names:
        console.print(Rule(name))
        try:
            results["suites"][name] = runner.run(name)
        except KeyboardInterrupt:
            runner.stop()
            interrupted = True
            console.print(f"interrupted during {name}: writing the suites finished so far", style="red")
            break
        suite = results["suites"][name]
        if suite["status"] in ("skipped", "error"):
            console.print(f"  {name}: {suite['status']} — {suite.get('reason')}", markup=False)
        else:
            header, rows = report.suite_table(results, name)
            console.print(report.console_table(f"{name} — {results['metadata']['gpu']}", header, rows))
        metadata["wall_seconds"] = round(time.perf_counter() - t0, 1)
        _write_json(path, results)

    if metadata.get("clocks") is not None:
        metadata["clocks"]["end"] = metamod.clocks(uuid, index)
    metadata["finished"] = metamod.now()
    metadata["wall_seconds"] = round(time.perf_counter() - t0, 1)
    errs = schema.validate(jsonable(results))
    if errs:  # never lose a run over a schema slip: write it, say so
        metadata["schema_errors"] = errs[:20]
        console.print("results do not validate:\n  " + "\n  ".join(errs[:20]), style="red", markup=False)
    _write_json(path, results)
    console.print(Rule("done"))
    console.print(f"wrote {path} ({metadata['wall_seconds']:.0f} s)", markup=False)
    bad = [c for s in results["suites"].values() for c in s["cases"] if c["status"] not in ("ok", "skipped")]
    if bad:
        console.print(f"{len(bad)} case{'s' if len(bad) != 1 else ''} not ok: " + ", ".join(f"{c['id']} ({c['status']})" for c in bad[:12])
                      + (" ..." if len(bad) > 12 else ""), style="yellow", markup=False)
    if not args.no_report:
        try:
            regenerate(out_dir, console, include_samples=False)
        except Exception as exc:  # noqa: BLE001 - the results file is safe; say what failed
            console.print(f"RESULTS.md / plots not regenerated: {type(exc).__name__}: {exc} "
                          f"(retry with `pagedattn bench report --results {out_dir}`)", style="red",
                          markup=False)
    return 130 if interrupted else 0


def regenerate(results_dir: Path, console, include_samples: bool = False) -> None:
    results_dir = Path(results_dir)
    md = results_dir.parent / "RESULTS.md"
    plots = results_dir.parent / "plots"
    warn = lambda m: console.print(m, style="yellow", markup=False)  # noqa: E731
    md, made = report.write_results_md(results_dir, md, plots, include_samples=include_samples, warn=warn)
    console.print(f"wrote {md} and {len(made)} plot{'s' if len(made) != 1 else ''} in {plots}", markup=False)
