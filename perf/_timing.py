"""Timing helpers shared by the quick perf/ scripts (the full harness has pagedattn/bench/timing.py)."""
import torch


def median_us(fn, reps=30, warmup=5):
    """Median of CUDA-event times of `fn`, in microseconds, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return sorted(ts)[len(ts) // 2]


def copy_ceiling_gbs(nbytes=2 * 2**30):
    """Device-to-device copy bandwidth, bytes read plus written."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / median_us(lambda: y.copy_(x), reps=10) / 1e3
