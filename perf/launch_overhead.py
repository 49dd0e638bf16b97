"""Steady-state host cost of one call (µs) on tiny problems: the raw launcher, the public API, the
torch.ops.pagedattn ops (the dispatcher: a compiled graph's op call in eager) and two torch controls.

    python perf/launch_overhead.py [OUT_DIR]    # OUT_DIR/launch_overhead_<gpu>_<date>.json (default perf/results)

GPU, no sync inside the timed loop, idle (launches meet an idle GPU) and busy (each batch of BATCH calls queued
behind a torch.cuda._sleep kernel; issue 15's budget: <= 10 µs per decode call, <= 8 µs per write). The cases run
round-robin LAUNCH_OVERHEAD_ROUNDS times (default 3) and report the median round, so that a transient slowdown of
the host moves one round, not the result (one H200 run's busy decode read 14.4 µs, the next 9.7).
"""
from __future__ import annotations

import os
import statistics
import sys

import torch

import pagedattn
from pagedattn import CacheSpec
from pagedattn.bench.jit import capture_launches
from pagedattn.bench.meta import write_quick
from pagedattn.bench.timing import host_loops

BATCH = 200  # calls queued behind one sleep kernel (the launch queue holds ~1000)
SLEEP_CYCLES = 40_000_000  # ~20 ms at 2 GHz: longer than BATCH calls at 100 µs each


def api_cases(device) -> dict:
    """{name: (the call, calls to time)}: a write of one token, a decode of 4 requests over 256 keys each
    (Hq=32, Hkv=8, D=128), through the public API and the torch ops, and two torch controls."""
    kc, vc = CacheSpec(16, 16, 8, 128, torch.bfloat16).allocate(device, fill=0.0)
    key = torch.randn(1, 8, 128, dtype=torch.bfloat16, device=device)
    slots = torch.tensor([3], device=device)
    ak, av = CacheSpec(64, 16, 8, 128, torch.bfloat16).allocate(device, fill=0.0)
    q = torch.randn(4, 32, 128, dtype=torch.bfloat16, device=device)
    table = torch.arange(64, dtype=torch.int32, device=device).view(4, 16)
    cu_q = torch.arange(5, dtype=torch.int32, device=device)
    seq = torch.full((4,), 256, dtype=torch.int32, device=device)
    q4, k4 = q.view(4, 1, 32, 128), torch.randn(4, 1, 8, 128, dtype=torch.bfloat16, device=device)
    lens = torch.full((4,), 200, dtype=torch.int32, device=device)
    ops = torch.ops.pagedattn

    def attend(splits):
        return pagedattn.flash_attn_varlen_func(q, ak, av, 1, cu_q, 256, seqused_k=seq, block_table=table,
                                                num_splits=splits)

    def attend_op(splits):
        return ops.flash_attn_varlen_func(q, ak, av, 1, cu_q, 256, None, seq, None, False, table, splits, None,
                                          None, None, [-1, -1], 0.0, None, None)
    return {
        "reshape_and_cache_flash": (lambda: pagedattn.reshape_and_cache_flash(key, key, kc, vc, slots), 20000),
        "flash_attn_decode": (lambda: attend(1), 5000),
        "flash_attn_decode_split4": (lambda: attend(4), 5000),
        "flash_attn_decode_heuristic": (lambda: attend(0), 5000),
        "op_reshape_and_cache_flash": (lambda: ops.reshape_and_cache_flash(key, key, kc, vc, slots, "auto", None,
                                                                           None), 5000),
        "op_flash_attn_decode": (lambda: attend_op(1), 5000),
        "op_flash_attn_decode_split4": (lambda: attend_op(4), 5000),
        "flash_attn_with_kvcache_decode": (lambda: pagedattn.flash_attn_with_kvcache(
            q4, ak, av, k4, k4, cache_seqlens=lens, block_table=table, num_splits=1), 5000),
        "torch_empty_like": (lambda: torch.empty_like(key), 20000),
        "torch_add": (lambda: key.add(key), 20000),
    }


def gpu(out_dir="perf/results"):
    cases = api_cases("cuda")
    # the raw launchers: the write's and the decode's launch as the op made it, replayed (the driver's cost
    # and the pack, without the op's Python); decode_out keeps the output the decode replays write
    (write, *_), _ = capture_launches(cases["reshape_and_cache_flash"][0])
    (decode, *_), decode_out = capture_launches(cases["flash_attn_decode"][0])
    cases = {"raw_launcher": (write, 20000), "raw_launcher_decode": (decode, 5000), **cases}
    rounds = max(1, int(os.environ.get("LAUNCH_OVERHEAD_ROUNDS", "3")))
    samples = {}
    for _ in range(rounds):
        for name, (fn, n) in cases.items():
            # idle: 5 timed loops; busy: batches of BATCH calls, each behind a sleep kernel; the median loop each
            idle = host_loops(fn, max(1000, n // rounds))
            busy = host_loops(fn, BATCH, loops=max(1, max(BATCH, min(n, 10000) // rounds) // BATCH),
                              before=lambda: torch.cuda._sleep(SLEEP_CYCLES))
            samples.setdefault(f"{name}_us", []).append(statistics.median_high(idle))
            samples.setdefault(f"{name}_busy_us", []).append(statistics.median_high(busy))
    results = {key: statistics.median(values) for key, values in samples.items()}
    path = write_quick(out_dir, "launch_overhead", results,
                       rounds={key: [round(v, 3) for v in values] for key, values in samples.items()})
    for k, v in results.items():
        print(f"{k:40s} {v:6.2f} us")
    print(f"wrote {path}")


if __name__ == "__main__":
    gpu(*sys.argv[1:2])
