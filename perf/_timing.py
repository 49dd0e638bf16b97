"""Timing helpers shared by the quick perf/ scripts: thin names over pagedattn/bench/timing.py, the one
timer module (the suites' Timer, the "rot" and "flush" methods, and the one-call-at-a-time median)."""
import torch

from pagedattn.bench.timing import L2Flush, flush_bytes, simple_median_us


def median_us(fn, reps=30, warmup=5, flush=False):
    """Median of CUDA-event times of `fn`, in microseconds, after `warmup` untimed calls; with
    flush=True the L2 is flushed before each call (outside the events), as triton's do_bench does."""
    flusher = None
    if flush:
        l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)
        flusher = L2Flush(flush_bytes(l2), "cuda")
    return simple_median_us(fn, reps=reps, warmup=warmup, flush=flusher)


def copy_ceiling_gbs(nbytes=2 * 2**30):
    """Device-to-device copy bandwidth, bytes read plus written."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / median_us(lambda: y.copy_(x), reps=10) / 1e3
