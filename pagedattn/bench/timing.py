"""The one timer of the bench and the perf/ scripts (perf/README.md, "Timing", says how it measures).
`Timer.measure(fn, sets, methods)`: device time by CUDA events, "rot" back to back with the inputs rotated
over `sets`, "flush" the L2 flushed before every call (as do_bench); `CpuTimer` the same on the host clock
(CPU tests). `median_us`: one synchronised call at a time. `host_loops`: the host's cost of a call.
"""
from __future__ import annotations

import math
import statistics
import time
import torch

METHODS = ("rot", "flush")


def timing(samples_us: list[float], sets: int, method: str) -> dict:
    """A timing of `samples_us`: the median `us`, p10, p90, min, reps, sets and method."""
    s = sorted(samples_us)
    q = lambda f: s[round(f * (len(s) - 1))]  # noqa: E731
    return {"us": statistics.median(s), "p10": q(0.1), "p90": q(0.9), "min": s[0], "reps": len(s), "sets": sets,
            "method": method}


def rotation_sets(working_set_bytes: float, l2_bytes: int, *, factor: float = 4.0, cap: int = 64,
                  max_total_bytes: float = 8 * 2**30) -> int:
    """How many input sets to rotate through so that sets * working set >= factor * L2 (capped)."""
    if working_set_bytes <= 0:
        return cap
    want = math.ceil(factor * l2_bytes / working_set_bytes)
    return max(1, min(want, cap, int(max_total_bytes // working_set_bytes)))


def _event():
    return torch.cuda.Event(enable_timing=True)


def _device_us(fn) -> float:
    """µs between CUDA events recorded before and after `fn()` (waiting for the second)."""
    a, b = _event(), _event()
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3


class Timer:
    """CUDA-event timer: warm-up, a probe of host and device time per call, then batches of timed calls
    queued behind a sleep kernel (the head start keeps the GPU ahead of the host)."""

    def __init__(self, *, budget_s: float = 0.3, min_reps: int = 20, max_reps: int = 2000, warmup_s: float = 0.05,
                 batch: int = 100, l2_bytes: int | None = None, flush_nbytes: int | None = None, device="cuda"):
        self.budget_s, self.min_reps, self.max_reps, self.warmup_s, self.batch = (budget_s, min_reps, max_reps,
                                                                                   warmup_s, batch)
        # the "flush" method zeroes 4x the L2 between calls, at least 256 MiB (H200: 60 MiB L2)
        self.flush_nbytes = flush_nbytes or max(256 * 2**20, 4 * int(l2_bytes or 0))
        self.device, self.flush_buf = device, None  # the buffer: made on first use
        self._cycles_per_s: float | None = None

    def flush(self) -> None:
        """Evict the L2 by zeroing a buffer larger than it (do_bench's `cache.zero_()`)."""
        if self.flush_buf is None:
            self.flush_buf = torch.empty(max(1, self.flush_nbytes // 4), dtype=torch.int32, device=self.device)
        self.flush_buf.zero_()

    def measure(self, fn, sets: int = 1, methods=METHODS) -> dict:
        """{method: its `timing`} for each of `methods` (names from METHODS), in that order."""
        unknown = [m for m in methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown timing method(s) {unknown}; known: {METHODS}")
        return {m: self._measure(fn, max(1, int(sets)), self.flush if m == "flush" else (lambda: None), m)
                for m in methods}

    def probe(self, fn, sets: int = 1, calls: int = 10, warmup: int = 3) -> float:
        """Mean µs per call of `calls` back-to-back calls after `warmup`: a quick comparison of
        configurations (peers.fastest), not a measurement."""
        def burst(n: int):
            for k in range(n):
                fn(k % sets)
        burst(warmup)
        torch.cuda.synchronize()
        return _device_us(lambda: burst(calls)) / calls

    def _reps(self, per_call_s: float) -> int:
        return int(min(self.max_reps, max(self.min_reps, self.budget_s / max(per_call_s, 1e-7))))

    def _sleep(self, seconds: float) -> None:
        """Keep the GPU busy for `seconds` (torch.cuda._sleep, calibrated once; none in this torch: no head start)."""
        if self._cycles_per_s is None:
            try:
                torch.cuda._sleep(2_000_000)  # the first call loads the kernel
                us = _device_us(lambda: torch.cuda._sleep(2_000_000))
                self._cycles_per_s = 2_000_000 / max(us * 1e-6, 1e-6)
            except Exception:  # noqa: BLE001
                self._cycles_per_s = 0.0
        if self._cycles_per_s > 0 and seconds > 0:
            torch.cuda._sleep(int(min(seconds, 0.2) * self._cycles_per_s))

    def _measure(self, fn, sets: int, before, method: str) -> dict:
        k, t0 = 0, time.perf_counter()
        while (k < max(3, sets) or time.perf_counter() - t0 < self.warmup_s) and k <= 10_000:
            before()
            fn(k % sets)
            k += 1
            if k % 8 == 0:  # don't queue seconds of work on a slow op
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        n_probe = max(3, min(sets, 8))
        e0, e1, h0 = _event(), _event(), time.perf_counter()
        e0.record()
        for _ in range(n_probe):
            before()
            fn(k % sets)
            k += 1
        e1.record()
        host = (time.perf_counter() - h0) / n_probe
        e1.synchronize()
        reps, samples = self._reps(max(host, e0.elapsed_time(e1) * 1e-3 / n_probe)), []
        while len(samples) < reps:
            nb = min(self.batch, reps - len(samples))
            starts, ends = [_event() for _ in range(nb)], [_event() for _ in range(nb)]
            self._sleep(host * nb * 1.3 + nb * 10e-6 + 50e-6)  # + the event records
            for j in range(nb):
                before()
                starts[j].record()
                fn(k % sets)
                ends[j].record()
                k += 1
            torch.cuda.synchronize()
            samples += [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
        return timing(samples, sets, method)


class CpuTimer(Timer):
    """The same interface on the host clock (tests and `--device cpu` dry runs)."""

    def _measure(self, fn, sets: int, before, method: str) -> dict:
        for k in range(max(3, sets)):
            before()
            fn(k % sets)
        t0 = time.perf_counter()
        fn(0)
        samples = []
        for k in range(self._reps(time.perf_counter() - t0)):
            before()
            t0 = time.perf_counter()
            fn(k % sets)
            samples.append((time.perf_counter() - t0) * 1e6)
        return timing(samples, sets, method)


def median_us(fn, reps: int = 30, warmup: int = 5, before=lambda: None) -> float:
    """Median µs of CUDA-event times of `fn()`, one synchronised call at a time after `warmup` untimed calls;
    `before()` runs untimed before each (perf/multigpu.py: a barrier). Includes any wait for the host: for
    the demo and the quick scripts, not the suites."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        before()
        ts.append(_device_us(fn))
    return sorted(ts)[len(ts) // 2]


def host_loops(fn, calls: int, loops: int = 5, warmup: int = 200, before=lambda: None, sync=None,
               clock=time.perf_counter) -> list[float]:
    """The host's cost of `fn()` (perf/launch_overhead.py): µs per call of each loop of `calls` calls with no
    sync inside. `before()` runs untimed before each loop (a sleep kernel keeping the GPU busy); off the GPU
    pass sync=lambda: None (and clock=time.thread_time)."""
    sync = sync or torch.cuda.synchronize
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(loops):
        before()
        t0 = clock()
        for _ in range(calls):
            fn()
        out.append((clock() - t0) / calls * 1e6)
        sync()
    return out
