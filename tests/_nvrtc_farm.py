"""One NVRTC compile per distinct kernel in a test session, started up front in parallel processes.

NVRTC serialises compiles inside one process, each takes 10-40 s on a small CPU, and the compile, cache
and AOT tests ask for many of the same kernels. conftest.py installs `compile_source` below in place of
`pagedattn.codegen.compile.compile_source` before the test modules import it, and hands the kernels that
the selected tests declare (marker `compiles`) to `start`: worker processes compile them while other
tests run. A test that needs one of them waits for it; any other compile runs where it is asked for, as
before. Every result is kept in a session folder (`PAGEDATTN_TEST_NVRTC_MEMO`), keyed like the JIT cache
by (source, arch, options), so forked or spawned processes (AOT workers, the race test) reuse it too.

Every cubin still comes from NVRTC with the caller's exact source and options; only repeats are saved.
A failed farm compile is repeated by the caller, so it gets NVRTC's error itself.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import pickle
import time
from pathlib import Path

from pagedattn.codegen import cache as _cache
from pagedattn.codegen import compile as _compile

ENV = "PAGEDATTN_TEST_NVRTC_MEMO"
OWNER = os.getpid()  # the pytest process
WAIT_S = 900  # longest wait for a farm compile before compiling here instead

real_compile_source = _compile.compile_source
_memory: dict[str, object] = {}
stats = {"nvrtc": 0, "reused": 0, "farmed": 0}


def job_key(source: str, arch: str, options) -> str:
    return hashlib.sha256(json.dumps([source, arch, list(options)]).encode()).hexdigest()


def _folder() -> Path | None:
    where = os.environ.get(ENV)
    return Path(where) if where else None


def _store(key: str, result, variant: str, arch: str, cpu_s: float) -> None:
    _memory[key] = result
    folder = _folder()
    if folder is not None:
        tmp = folder / f"{key}.{os.getpid()}.tmp"
        tmp.write_bytes(pickle.dumps(result))
        os.replace(tmp, folder / f"{key}.pkl")
        (folder / f"{key}.time").write_text(json.dumps([variant, arch, round(result.seconds, 2), round(cpu_s, 2)]))


def timings() -> list[tuple[str, str, float, float]]:
    """(variant, arch, wall seconds, CPU seconds) of every NVRTC run of this session, slowest first."""
    folder = _folder()
    if folder is None or not folder.is_dir():
        return []
    return sorted((tuple(json.loads(p.read_text())) for p in folder.glob("*.time")), key=lambda t: -t[3])


def _claim(key: str) -> bool:
    """True for the one process (farm worker or caller) that compiles `key`; False: another one does."""
    try:
        os.close(os.open(_folder() / f"{key}.claimed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def _lookup(key: str):
    """A result of this session, waiting for it while another process compiles it; None: compile here
    (a queued job that no farm worker has started yet is taken over, so no caller waits on the queue)."""
    hit = _memory.get(key)
    if hit is not None:
        return hit
    folder = _folder()
    if folder is None:
        return None
    done, failed = folder / f"{key}.pkl", folder / f"{key}.failed"
    if not done.exists() and _claim(key):
        return None
    deadline = time.monotonic() + WAIT_S
    while not done.exists() and not failed.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    if not done.exists():
        return None
    _memory[key] = pickle.loads(done.read_bytes())
    return _memory[key]


def compile_source(source: str, *, variant: str, arch: str, options: list[str],
                   source_path: str | None = None):
    """`pagedattn.codegen.compile.compile_source`, once per (source, arch, options) in a session."""
    key = job_key(source, arch, options)
    result = _lookup(key)
    if result is not None:
        stats["reused"] += 1
        return result
    cpu0 = time.process_time()
    try:
        result = real_compile_source(source, variant=variant, arch=arch, options=options,
                                     source_path=source_path)
    except BaseException:
        if _folder() is not None:
            (_folder() / f"{key}.failed").touch()  # whoever waits for it compiles it and sees the error
        raise
    stats["nvrtc"] += 1
    _store(key, result, variant, arch, time.process_time() - cpu0)
    return result


def install() -> None:
    """Route the library's compiles (JIT cache, AOT, direct calls) through `compile_source`."""
    _compile.compile_source = compile_source
    _cache.compile_source = compile_source


def _farm_job(key: str, source: str, variant: str, arch: str, options: list[str]) -> None:
    """Worker: compile one job into the session folder, or mark it failed (the caller repeats it)."""
    folder = _folder()
    if not _claim(key):
        return  # a caller took it over
    cpu0 = time.process_time()
    try:
        result = real_compile_source(source, variant=variant, arch=arch, options=options)
    except BaseException:
        (folder / f"{key}.failed").touch()
        return
    _store(key, result, variant, arch, time.process_time() - cpu0)


def kernel_job(spec, arch: str, extra=()):
    """(source, variant, arch, options) of `Kernel(spec)` as the JIT cache and the tests compile it, with
    `extra` options after the JIT's."""
    from pagedattn.codegen.toolchain import toolchain
    from pagedattn.registry import Kernel

    k = Kernel(spec)
    return k.source, k.name, arch, _compile.nvrtc_options(arch, toolchain()) + list(extra)


# NVRTC CPU seconds on 2 cores by family (--durations lists them): attention 20-60, writes ~4, legacy <= 3
_COST = (("attn_fwd_", 3), ("kv_write_", 2))


def _expected_cost(variant: str) -> int:
    return next((cost for prefix, cost in _COST if variant.startswith(prefix)), 1)


def start(jobs, workers: int):
    """Queue `jobs` (see `kernel_job`) on `workers` forked processes, the slowest families first (no long
    compile left alone at the end); returns the pool (shut it down)."""
    from concurrent.futures import ProcessPoolExecutor

    folder = _folder()
    todo = {}
    for source, variant, arch, options in sorted(jobs, key=lambda job: -_expected_cost(job[1])):
        key = job_key(source, arch, options)
        if key not in todo and not (folder / f"{key}.pkl").exists():
            todo[key] = (source, variant, arch, options)
    if not todo:
        return None
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
    pool = ProcessPoolExecutor(max_workers=max(1, min(workers, len(todo))), mp_context=ctx)
    for key, job in todo.items():
        future = pool.submit(_farm_job, key, *job)
        # a worker that dies (or a pool shut down) must not leave a caller waiting for the job
        future.add_done_callback(lambda f, key=key: (f.cancelled() or f.exception()) and
                                 (folder / f"{key}.failed").touch())
    stats["farmed"] = len(todo)
    return pool
