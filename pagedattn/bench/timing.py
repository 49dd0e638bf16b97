"""Timing: CUDA events around each call, median of many, warm-up excluded; two methods.

Methods (`METHODS`; `Timer.measure(fn, sets, methods)` runs each and returns {method: Timing}):
- "rot": back to back, inputs rotated (`Timer.__call__`): the GPU runs the calls one after another
  and consecutive calls read different input sets, so each finds little of its input in L2.
- "flush": the L2 flushed before every call, as `triton.testing.do_bench` does: a buffer of
  `flush_bytes(l2)` (4x the L2, at least 256 MiB) is zeroed between calls, outside the event pair
  that times the call. The zeroed lines are still dirty in L2 when the call starts, so the call also
  pays for their write-back, exactly as under do_bench.
A kernel meant to sit at the memory limit should hold its number under both.

How one measurement goes (`fn(k)` runs the op on input set `k`; `before()` is the flush or nothing):

1. Warm-up: call `fn` over every input set, then keep calling for at least `warmup_s` of wall time
   (JIT compiles, autotuning, handle creation and clock ramp-up stay out of the numbers).
2. Probe a few calls for the host enqueue cost and the device time per call; from the larger of the
   two pick the number of repetitions that fits `budget_s` (clamped to [min_reps, max_reps]).
3. Time in batches: a sleep kernel first keeps the GPU busy while the host enqueues the whole batch,
   so the GPU then runs the calls back to back and the event pair around each call measures device
   time, not the host's launch overhead (host overhead is the jit suite's business). With "flush"
   each call of the batch is `before(); start.record(); fn(k); end.record()`.
4. Report the median (and p10 / p90 / min) over all calls, in microseconds.

Rotation: when a case's working set is small against the L2 (`rotation_sets`), the caller builds
several input sets and `fn(k)` uses set `k % sets`, so consecutive calls do not find their inputs in L2.

`CpuTimer` has the same interface with time.perf_counter; the CPU tests drive the suites through it.
`median_us` is the one-call-at-a-time variant the perf/ scripts and the demo use (`copy_ceiling_gbs` on it).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch

METHODS = ("rot", "flush")
FLUSH_MIN_BYTES = 256 * 2**20


@dataclass
class Timing:
    us: float         # median
    p10: float
    p90: float
    min: float
    reps: int
    sets: int
    method: str = "rot"

    @classmethod
    def from_samples(cls, samples_us: list[float], sets: int, method: str = "rot") -> "Timing":
        s = sorted(samples_us)
        n = len(s)

        def q(f):
            return s[min(n - 1, max(0, int(round(f * (n - 1)))))]
        return cls(us=statistics.median(s), p10=q(0.1), p90=q(0.9), min=s[0], reps=n, sets=sets,
                   method=method)

    def as_dict(self) -> dict:
        return asdict(self)


def rotation_sets(working_set_bytes: float, l2_bytes: int, *, factor: float = 4.0, cap: int = 64,
                  max_total_bytes: float = 8 * 2**30) -> int:
    """How many input sets to rotate through so that sets * working set >= factor * L2 (capped)."""
    if working_set_bytes <= 0:
        return cap
    want = math.ceil(factor * l2_bytes / working_set_bytes)
    by_memory = max(1, int(max_total_bytes // working_set_bytes))
    return max(1, min(want, cap, by_memory))


def flush_bytes(l2_bytes: int | None) -> int:
    """Bytes written between calls by the "flush" method: 4x the L2, at least 256 MiB (H200: 60 MiB L2)."""
    return max(FLUSH_MIN_BYTES, 4 * int(l2_bytes or 0))


class L2Flush:
    """Evicts the L2 by zeroing a buffer larger than it (what do_bench's `cache.zero_()` does)."""

    def __init__(self, nbytes: int, device):
        self.nbytes = int(nbytes)
        self.buf = torch.empty(max(1, self.nbytes // 4), dtype=torch.int32, device=device)

    def __call__(self) -> None:
        self.buf.zero_()


class Timer:
    """CUDA-event timer; see the module docstring."""

    def __init__(self, *, budget_s: float = 0.3, min_reps: int = 20, max_reps: int = 2000,
                 warmup_s: float = 0.05, warmup_calls: int = 3, batch: int = 100,
                 l2_bytes: int | None = None, flush_nbytes: int | None = None, device="cuda"):
        self.budget_s = budget_s
        self.min_reps = min_reps
        self.max_reps = max_reps
        self.warmup_s = warmup_s
        self.warmup_calls = warmup_calls
        self.batch = batch
        self.flush_nbytes = flush_nbytes or flush_bytes(l2_bytes)
        self.device = device
        self.flusher = None  # an L2Flush, made on first use (tests put a stand-in here)
        self._cycles_per_s: float | None = None

    def flush(self) -> None:
        if self.flusher is None:
            self.flusher = L2Flush(self.flush_nbytes, self.device)
        self.flusher()

    def measure(self, fn, sets: int = 1, methods=METHODS) -> dict:
        """{method: Timing} for each of `methods` (names from METHODS), in that order."""
        unknown = [m for m in methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown timing method(s) {unknown}; known: {METHODS}")
        return {m: self._measure(fn, sets, self.flush if m == "flush" else None, m) for m in methods}

    def __call__(self, fn, sets: int = 1) -> Timing:
        """The "rot" method alone."""
        return self._measure(fn, sets, None, "rot")

    @staticmethod
    def sync() -> None:
        torch.cuda.synchronize()

    # -- keeping the GPU ahead of the host --------------------------------------------------------
    def _calibrate_sleep(self) -> float:
        if self._cycles_per_s is None:
            try:
                cycles = 2_000_000
                torch.cuda._sleep(cycles)  # first call loads the kernel
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                torch.cuda._sleep(cycles)
                b.record()
                b.synchronize()
                self._cycles_per_s = cycles / max(a.elapsed_time(b) * 1e-3, 1e-6)
            except Exception:  # no _sleep in this torch: time without the head start
                self._cycles_per_s = 0.0
        return self._cycles_per_s

    def _sleep(self, seconds: float) -> None:
        rate = self._calibrate_sleep()
        if rate > 0 and seconds > 0:
            torch.cuda._sleep(int(min(seconds, 0.2) * rate))

    # -- the measurement ----------------------------------------------------------------------------
    def _measure(self, fn, sets: int, before, method: str) -> Timing:
        sets = max(1, int(sets))
        before = before or (lambda: None)
        k = 0
        # 1. warm-up
        t0 = time.perf_counter()
        while k < max(self.warmup_calls, sets) or time.perf_counter() - t0 < self.warmup_s:
            before()
            fn(k % sets)
            k += 1
            if k % 8 == 0:  # don't queue seconds of work on a slow op
                torch.cuda.synchronize()
            if k > 10_000:
                break
        torch.cuda.synchronize()
        # 2. probe host and device time per call
        n_probe = max(3, min(sets, 8))
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        h0 = time.perf_counter()
        e0.record()
        for _ in range(n_probe):
            before()
            fn(k % sets)
            k += 1
        e1.record()
        host = (time.perf_counter() - h0) / n_probe
        e1.synchronize()
        device = e0.elapsed_time(e1) * 1e-3 / n_probe
        per_call = max(host, device, 1e-7)
        reps = int(min(self.max_reps, max(self.min_reps, self.budget_s / per_call)))
        # 3. batches with a head start
        samples: list[float] = []
        while len(samples) < reps:
            nb = min(self.batch, reps - len(samples))
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(nb)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(nb)]
            self._sleep(host * nb * 1.3 + nb * 10e-6 + 50e-6)  # + the event records
            for j in range(nb):
                before()
                starts[j].record()
                fn(k % sets)
                ends[j].record()
                k += 1
            torch.cuda.synchronize()
            samples += [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
        return Timing.from_samples(samples, sets, method)

    def host_loop(self, fn, n: int) -> tuple[float, float]:
        """(host µs per call without syncing, µs per call including the final sync)."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6


class CpuTimer(Timer):
    """Same interface on the host clock (tests and `--device cpu` dry runs)."""

    @staticmethod
    def sync() -> None:
        pass

    def _measure(self, fn, sets: int, before, method: str) -> Timing:
        sets = max(1, int(sets))
        before = before or (lambda: None)
        for k in range(max(self.warmup_calls, sets)):
            before()
            fn(k % sets)
        t0 = time.perf_counter()
        fn(0)
        per_call = max(time.perf_counter() - t0, 1e-7)
        reps = int(min(self.max_reps, max(self.min_reps, self.budget_s / per_call)))
        samples = []
        for k in range(reps):
            before()
            t0 = time.perf_counter()
            fn(k % sets)
            samples.append((time.perf_counter() - t0) * 1e6)
        return Timing.from_samples(samples, sets, method)

    def host_loop(self, fn, n: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        us = (time.perf_counter() - t0) / n * 1e6
        return us, us


def median_us(fn, reps: int = 30, warmup: int = 5, flush: bool = False) -> float:
    """Median of CUDA-event times of `fn()`, one synchronised call at a time, in microseconds, after
    `warmup` untimed calls; with flush=True the L2 is flushed before each call (outside the events), as
    do_bench does. Includes any gap while the GPU waits for the host's launch: for quick scripts and the
    demo, not for the suites."""
    flusher = None
    if flush:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        flusher = L2Flush(flush_bytes(getattr(props, "L2_cache_size", 0)), "cuda")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        if flusher is not None:
            flusher()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return sorted(ts)[len(ts) // 2]


def copy_ceiling_gbs(nbytes: int = 2 * 2**30) -> float:
    """Device-to-device copy bandwidth (bytes read plus written) by median_us: the quick scripts' ceiling."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / median_us(lambda: y.copy_(x), reps=10) / 1e3


def probe_us(fn, sets: int = 1, calls: int = 10, warmup: int = 3) -> float:
    """Mean µs per call of `calls` back-to-back calls fn(k) after `warmup`: a quick comparison of
    configurations (peers.fastest), not a measurement."""
    sets = max(1, int(sets))
    for k in range(warmup):
        fn(k % sets)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for k in range(calls):
        fn(k % sets)
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / calls
