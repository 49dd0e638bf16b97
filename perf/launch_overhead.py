"""Steady-state host cost of one kernel launch (µs), through the raw launcher, the public API and
the torch.ops.pagedattn ops (the dispatcher: what a compiled graph's op call costs in eager).

Tiny problems (one token per request), no synchronisation inside the timed loop. Two regimes:
  idle: the GPU drains the queue as fast as the host fills it (launches meet an idle GPU);
  busy: each batch of BATCH calls queues behind a torch.cuda._sleep kernel that outlasts it, so
        every launch is made while the GPU is busy (issue 15's budget: <= 10 µs per decode call,
        <= 8 µs per write call); only the calls are timed, the queue is drained between batches.
The cases run round-robin ROUNDS times (env LAUNCH_OVERHEAD_ROUNDS, default 3), each round a share of
the calls, and a case reports the median of its rounds (each round's figure is kept in the metadata):
a transient slowdown of the host (seen on the H200 host: one run's decode at 14.4 µs busy, the next at
9.7) then moves one round, not the result.
Writes perf/results/launch_overhead_<gpu>_<date>.json.
"""
from __future__ import annotations

import os
import statistics
import sys

import torch

import pagedattn
from pagedattn import CacheSpec

BATCH = 200            # calls queued behind one sleep kernel (the launch queue holds ~1000)
SLEEP_CYCLES = 40_000_000  # ~20 ms at 2 GHz: longer than BATCH calls at 100 µs each


def api_cases(device) -> dict:
    """{name: (the call, calls to time)}: the public API, the torch ops and two torch controls on tiny
    problems (shared with perf/host_profile.py): a write of one token, a decode of 4 requests over 256
    keys each (Hq=32, Hkv=8, D=128)."""
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


def main(out_dir="perf/results"):
    from pagedattn.bench.jit import capture_launches
    from pagedattn.bench.meta import write_quick
    from pagedattn.bench.timing import host_loops

    cases = api_cases("cuda")
    # the raw launchers: the write's and the decode's launch as the op made it, replayed (the driver's
    # cost and the pack, without the op's Python)
    # cost and the pack, without the op's Python); decode_out keeps the output the decode replays write
    (write, *_), _ = capture_launches(cases["reshape_and_cache_flash"][0])
    (decode, *_), decode_out = capture_launches(cases["flash_attn_decode"][0])
    cases = {"raw_launcher": (write.replay, 20000), "raw_launcher_decode": (decode.replay, 5000), **cases}
    # the middle (upper middle of an even count) of the loops' host µs per call
    middle = lambda loops: sorted(host for host, _ in loops)[len(loops) // 2]  # noqa: E731
    rounds = max(1, int(os.environ.get("LAUNCH_OVERHEAD_ROUNDS", "3")))
    samples = {}
    for _ in range(rounds):
        for name, (fn, n) in cases.items():
            # idle: median of 5 timed loops; busy: over batches of BATCH calls, each behind a sleep kernel
            samples.setdefault(f"{name}_us", []).append(middle(host_loops(fn, max(1000, n // rounds))))
            busy = max(BATCH, min(n, 10000) // rounds)
            samples.setdefault(f"{name}_busy_us", []).append(middle(host_loops(
                fn, BATCH, loops=max(1, busy // BATCH), before=lambda: torch.cuda._sleep(SLEEP_CYCLES))))
    results = {key: statistics.median(values) for key, values in samples.items()}
    path = write_quick(out_dir, "launch_overhead", results,
                       rounds={key: [round(v, 3) for v in values] for key, values in samples.items()})
    for k, v in results.items():
        print(f"{k:40s} {v:6.2f} us")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(*sys.argv[1:])
