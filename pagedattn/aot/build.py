"""The compile plan (one Job per spec and arch, with the run-time cache key) and the runner that
compiles the missing ones into a bundle, in worker processes, with progress.

Parallelism. Measured on the 2-core CI machine (kv_write variants, sm_90a, NVRTC 13.0, cuda-bindings
13.4): NVRTC does *not* hold the GIL -- a pure-Python counting thread kept 98 % of its speed while
another thread compiled -- yet two threads compiling at once took longer than compiling one after the
other (4 compiles: serial 4.4 s, 2 threads 5.2 s, each compile slowing from 1.1 s to 2-3 s): NVRTC
serializes compiles inside one process. Two worker processes did the same 4 compiles in 2.3 s (1.9x).
Hence a ProcessPoolExecutor; `--jobs 1` compiles in this process.

Programs. Kernels whose sources share a preamble compile up to PROGRAM_SIZE at a time as one NVRTC program
(codegen.compile.program_source: the headers are parsed once; 4 attention variants 20.3 s one by one,
11.1 s as one program on 2 cores; 8: 44.1 and 23.9 s; the default preset on the H200 host, 4 a program:
538 compile-seconds against 843 alone). The partition depends on the selection only, not
on --jobs, so the same selection always gives the same bundle bytes.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from ..info import human_bytes, plural
from .selection import command_for, spec_fields

# -- the compile plan ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    spec: object
    name: str
    arch: str
    source: str
    options: tuple
    key: str

    @property
    def label(self) -> str:
        return f"{self.name} ({self.arch})"


def plan(specs, archs) -> list[Job]:
    """One job per (spec, arch), with exactly the cache key the run-time lookup will compute."""
    from ..codegen.cache import cache_key, key_material
    from ..codegen.compile import nvrtc_options
    from ..codegen.toolchain import toolchain
    from ..registry import get_kernel

    tc = toolchain()
    jobs = []
    options = {arch: nvrtc_options(arch, tc, debug=False) for arch in archs}
    for spec in specs:
        kernel = get_kernel(spec)
        for arch in archs:
            if not spec.supports_arch(arch):
                continue
            key = cache_key(key_material(kernel.name, kernel.source, arch, options[arch]))
            jobs.append(Job(spec, kernel.name, arch, kernel.source, tuple(options[arch]), key))
    return jobs


def _compile_program(names: tuple, arch: str, sources: tuple, options: tuple) -> list:
    """Runs in a worker process: [(ok, cubin, seconds, log)] per kernel, never raises. Kernels compile as
    one program (one cubin for all, each kernel's seconds its share); when that fails, one by one, so
    that each failure has its own log and the others still compile."""
    from ..codegen.compile import compile_program
    from ..codegen.errors import CompileError

    try:
        result = compile_program(list(sources), variants=list(names), arch=arch, options=list(options))
        return [(True, result.cubin, result.seconds / len(names), result.log)] * len(names)
    except CompileError as exc:
        if len(names) > 1:
            return [_compile_program((n,), arch, (s,), options)[0] for n, s in zip(names, sources)]
        return [(False, b"", 0.0, f"NVRTC failed to compile {names[0]} for {arch}\n\n{exc.log}")]
    except BaseException:  # noqa: BLE001 - reported per variant, the run goes on
        return [(False, b"", 0.0, traceback.format_exc())] * len(names)


# Kernels per NVRTC program. A model of the H200 host's default preset (attention: ~2.6 s a program and ~3 s
# a kernel, from the 4-kernel programs' 41-45 s runs), 16 jobs: 4 a program 41 s, 5: 37, 6: 36, 8: 42 (whole
# rounds of ~15-20 s programs); bigger programs also save more on fewer cores.
PROGRAM_SIZE = 6


def programs(todo: list[Job], per_program: int = PROGRAM_SIZE) -> list[list[Job]]:
    """The jobs as NVRTC programs: jobs of one arch, options, preamble (codegen.compile.program_key) and
    spec.program_group() together, in plan order, at most per_program each and evenly filled (9 jobs at
    6: 5 + 4); the largest sources first, so that the slowest programs start first."""
    from ..codegen.compile import program_key

    classes: dict[tuple, list[Job]] = {}
    for job in todo:
        classes.setdefault((job.arch, job.options, program_key(job.source), job.spec.program_group()),
                           []).append(job)
    out = []
    for jobs in classes.values():
        per = -(-len(jobs) // -(-len(jobs) // per_program))
        out += [jobs[i:i + per] for i in range(0, len(jobs), per)]
    return sorted(out, key=lambda p: -sum(len(j.source) for j in p))


@dataclass
class Summary:
    total: int = 0
    compiled: int = 0
    present: int = 0
    failed: list[tuple[Job, Path]] = field(default_factory=list)
    seconds: float = 0.0
    jobs: int = 1
    programs: int = 0
    bundle_kernels: int = 0
    bundle_bytes: int = 0
    discarded: str | None = None
    pruned: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (f"compiled {self.compiled}, already present {self.present}, failed "
                f"{len(self.failed)} in {self.seconds:.1f} s ({plural(self.programs, 'NVRTC program')}, "
                f"{plural(self.jobs, 'job')}); bundle: {plural(self.bundle_kernels, 'kernel')}, "
                f"{human_bytes(self.bundle_bytes)}")


class _Progress:
    """A rich progress bar on a terminal; one line per finished kernel otherwise (CI, docker build)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.bar = total, 0, None
        self.enabled = enabled and total > 0
        if not self.enabled:
            return
        from rich.console import Console

        self.console = Console(stderr=True)
        if self.console.is_terminal:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            self.bar = Progress(TextColumn("[bold]precompile"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                TextColumn("{task.description}"), console=self.console)
            self.task = self.bar.add_task("", total=total)

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def advance(self, job: Job, ok: bool, seconds: float) -> None:
        self.done += 1
        if not self.enabled:
            return
        status = f"{seconds:.1f} s" if ok else "FAILED"
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=f"{job.label} {status}")
        else:
            print(f"[{self.done}/{self.total}] {job.label} {status}", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()


def default_jobs() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _log_path(out: Path, job: Job) -> Path:
    from ..codegen.bundle import LOGS

    return out / LOGS / f"{job.name}-{job.arch}.log"


def precompile(jobs: list[Job], out, *, n_jobs: int | None = None, progress: bool = True,
               per_program: int | None = None) -> Summary:
    """Compile every job whose kernel the bundle at `out` lacks (or holds corrupt) and record it in
    the manifest. Failures are logged to out/logs/<variant>-<arch>.log and do not stop the others.
    per_program: kernels per NVRTC program at most (default PROGRAM_SIZE; 1: each alone)."""
    from filelock import FileLock

    from ..codegen.bundle import BundleWriter, write_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    n_jobs = max(1, n_jobs or default_jobs())
    with FileLock(str(out / ".precompile.lock")):   # two runs into one folder take turns
        writer = BundleWriter(out)
        summary = Summary(total=len(jobs), discarded=writer.discarded)
        todo, seen = [], set()
        for job in jobs:
            if writer.present(job.key):
                summary.present += 1
            elif job.key not in seen:
                seen.add(job.key)
                todo.append(job)
        summary.jobs = min(n_jobs, len(todo)) or 1

        def finish(program: list[Job], results: list) -> None:
            stored: dict[bytes, list[dict]] = {}  # cubin -> its kernels: the program's, or one compiled alone
            for job, (ok, cubin, seconds, log_text) in zip(program, results):
                log_path = _log_path(out, job)
                if ok:
                    stored.setdefault(cubin, []).append(dict(name=job.name, family=job.spec.FAMILY,
                                                             spec=spec_fields(job.spec), arch=job.arch,
                                                             key=job.key, compile_seconds=seconds))
                    summary.compiled += 1
                    log_path.unlink(missing_ok=True)
                    log_path.with_suffix(".cu").unlink(missing_ok=True)
                else:
                    log_path.parent.mkdir(parents=True, exist_ok=True)
                    write_file(log_path.with_suffix(".cu"), job.source.encode())
                    write_file(log_path, (f"variant: {job.name}\narch: {job.arch}\n"
                                          f"rebuild: {command_for(job.spec, job.arch, out)}\n"
                                          f"source: {log_path.with_suffix('.cu')}\n\n{log_text}\n").encode())
                    summary.failed.append((job, log_path))
            for cubin, kernels in stored.items():
                writer.add_program(kernels, cubin)

        batches = programs(todo, per_program or PROGRAM_SIZE)
        summary.programs = len(batches)
        summary.jobs = min(summary.jobs, len(batches)) or 1
        pool = _Pool(batches, summary.jobs) if summary.jobs > 1 else None   # forks here
        clean = False
        try:
            with _Progress(len(todo), progress) as bar:
                results = pool.results() if pool else (
                    (p, _compile_program(tuple(j.name for j in p), p[0].arch, tuple(j.source for j in p),
                                         p[0].options)) for p in batches)
                last_save = time.monotonic()
                for program, result in results:
                    finish(program, result)
                    for job, (ok, _, seconds, _) in zip(program, result):
                        bar.advance(job, ok, seconds)
                    if time.monotonic() - last_save > 1.0:   # an interrupted run keeps its work
                        writer.save()
                        last_save = time.monotonic()
            clean = True
        finally:
            if pool:
                pool.close(wait=clean)
            if writer.dirty:
                writer.save()
        summary.pruned = writer.prune()
        summary.bundle_kernels = len(writer.entries)
        summary.bundle_bytes = writer.size()
    summary.seconds = time.perf_counter() - t0
    return summary


class _Pool:
    """Worker processes with every job submitted at construction.

    fork: workers inherit the imported modules and the loaded NVRTC (spawn would re-import torch,
    ~1 s per worker). A fork-context ProcessPoolExecutor forks all its workers at the first submit,
    which happens here, before the progress bar starts its refresh thread: no thread is forked."""

    def __init__(self, programs: list[list[Job]], workers: int):
        from concurrent.futures import ProcessPoolExecutor

        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
        self.executor = ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
        self.futures = {self.executor.submit(_compile_program, tuple(j.name for j in p), p[0].arch,
                                             tuple(j.source for j in p), p[0].options): p
                        for p in programs}

    def results(self):
        from concurrent.futures import as_completed

        for fut in as_completed(self.futures):
            program = self.futures[fut]
            try:
                result = fut.result()
            except BaseException:  # noqa: BLE001 - a worker died (OOM kill, signal)
                result = [(False, b"", 0.0, traceback.format_exc())] * len(program)
            yield program, result

    def close(self, wait: bool) -> None:
        self.executor.shutdown(wait=wait, cancel_futures=True)
