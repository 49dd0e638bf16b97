import gzip
import os
import re
import shutil
import tempfile

import pytest

# Tests never touch the user's cache; each session gets its own unless the caller set one, and
# everything a session writes for itself (that cache, the NVRTC memo of _nvrtc_farm) is removed at its end.
_SESSION_DIR = tempfile.mkdtemp(prefix="pagedattn-test-")
os.environ.setdefault("PAGEDATTN_CACHE_DIR", os.path.join(_SESSION_DIR, "cache"))
os.environ["PAGEDATTN_TEST_NVRTC_MEMO"] = os.path.join(_SESSION_DIR, "nvrtc")
os.mkdir(os.environ["PAGEDATTN_TEST_NVRTC_MEMO"])
# One torch thread per process (and per child process: the bench and fuzz CLIs' workers), unless the
# caller says otherwise: the tests' tensors are tiny, and on a small machine OpenMP workers spinning
# beside the NVRTC farm's compiles cost more than they save (2 cores: pytest 3:41 -> 2:57, 436 -> 365 CPU-s).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import _nvrtc_farm  # noqa: E402

_nvrtc_farm.install()  # before the test modules import compile_source

HAS_CUDA = torch.cuda.is_available()


def pytest_configure(config):
    config.addinivalue_line("markers", "compiles(*jobs): the test compiles these (spec, arch) kernels (or (spec, "
                                       "arch, extra options)); without arguments its `spec` and `arch` "
                                       "parameters (see _nvrtc_farm)")


def pytest_unconfigure(config):
    if os.getpid() == _nvrtc_farm.OWNER:
        shutil.rmtree(_SESSION_DIR, ignore_errors=True)


def _test_key(nodeid: str) -> str:
    """A node id without the folders of its file ("test_x.py::name[params]"), however pytest was invoked."""
    path, sep, rest = nodeid.partition("::")
    return os.path.basename(path) + sep + rest


def _passed_before(path: str, rerun: str | None = None) -> set[str]:
    """The tests a -v log (plain or .gz) of an earlier run reports PASSED, as _test_key names them,
    less those whose name the regex `rerun` matches."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as log:
        passed = {_test_key(m.group(1)) for m in re.finditer(r"PASSED (\S+::.*?) *$", log.read(), re.M)}
    return {key for key in passed if not (rerun and re.search(rerun, key))}


def pytest_collection_modifyitems(config, items):
    # PAGEDATTN_TEST_SKIP_PASSED=<log>: leave out what that earlier run passed (an interrupted GPU grid
    # continued on the same code: perf/h200.sh's tests stage with a log carried from the first part).
    # PAGEDATTN_TEST_RERUN=<regex>: tests whose name it matches run again all the same (what a kernel
    # change since that run touches, e.g. 'softcap|cap[1-9]').
    log = os.environ.get("PAGEDATTN_TEST_SKIP_PASSED")
    if log:
        passed = _passed_before(log, os.environ.get("PAGEDATTN_TEST_RERUN"))
        done = [item for item in items if _test_key(item.nodeid) in passed]
        if done:
            config.hook.pytest_deselected(items=done)
            items[:] = [item for item in items if _test_key(item.nodeid) not in passed]
    # The tests that compile run last (in their order), so that the others run while the farm compiles
    # (a module's tests stay together where all of them or none compile: module fixtures are built once).
    items[:] = sorted(items, key=lambda item: item.get_closest_marker("compiles") is not None)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _declared_jobs(items):
    """(spec, arch, extra NVRTC options) of the `compiles` markers of the tests that will run, in their
    order, once. A marker names (spec, arch) pairs, or (spec, arch, options) for a compile with options
    added to the JIT's (the front-end checks' -fdevice-syntax-only builds)."""
    seen = set()
    for item in items:
        if item.get_closest_marker("skip"):
            continue
        for mark in item.iter_markers("compiles"):
            params = getattr(item, "callspec", None)
            jobs = mark.args or [(params.params["spec"], params.params["arch"])]
            for spec, arch, *extra in jobs:
                job = (spec, arch, tuple(extra[0]) if extra else ())
                if spec.supports_arch(arch) and job not in seen:
                    seen.add(job)
                    yield job


@pytest.fixture(scope="session", autouse=True)
def _nvrtc_farm_session(request):
    """Compile every declared kernel once, in parallel processes, while the tests run."""
    workers = int(os.environ.get("PAGEDATTN_TEST_JOBS") or len(os.sched_getaffinity(0)))
    jobs = [_nvrtc_farm.kernel_job(spec, arch, extra) for spec, arch, extra in _declared_jobs(request.session.items)]
    pool = _nvrtc_farm.start(jobs, workers) if jobs and workers > 1 else None
    yield
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


def pytest_terminal_summary(terminalreporter):
    s = _nvrtc_farm.stats
    if any(s.values()):
        times = _nvrtc_farm.timings()
        from pagedattn.info import plural

        terminalreporter.write_line(f"NVRTC: {plural(s['farmed'], 'kernel')} compiled by the farm, {s['nvrtc']} in "
                                    f"the test process, {plural(s['reused'], 'compile')} reused; "
                                    f"{plural(len(times), 'compile')} took "
                                    f"{sum(t[3] for t in times):.0f} s of CPU ({sum(t[2] for t in times):.0f} s wall)")
        if terminalreporter.config.option.durations:
            for variant, arch, wall, cpu in times[:terminalreporter.config.option.durations]:
                terminalreporter.write_line(f"{cpu:8.2f}s CPU {wall:8.2f}s wall  nvrtc {variant} ({arch})")


@pytest.fixture
def real_nvrtc(monkeypatch):
    """Every compile of the test runs NVRTC, none reuses the session's (for tests of determinism)."""
    from pagedattn.codegen import cache, compile

    monkeypatch.setattr(compile, "compile_source", _nvrtc_farm.real_compile_source)
    monkeypatch.setattr(cache, "compile_source", _nvrtc_farm.real_compile_source)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache dir and an empty in-memory front, restored afterwards."""
    from pagedattn.codegen import cache

    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", str(tmp_path / "cache"))
    fresh = cache.KernelCache()
    monkeypatch.setattr(cache, "_CACHE", fresh)
    return fresh


@pytest.fixture
def pagedattn_log(caplog):
    """caplog sees the 'pagedattn' logger (it does not propagate to the root)."""
    import logging

    logger = logging.getLogger("pagedattn")
    logger.addHandler(caplog.handler)
    caplog.handler.setLevel(logging.WARNING)
    yield caplog
    logger.removeHandler(caplog.handler)
