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
from pagedattn.bench.meta import write_quick
from pagedattn.bench.timing import host_loops
from pagedattn.ops.kv_write import KvWriteSpec

BATCH = 200            # calls queued behind one sleep kernel (the launch queue holds ~1000)
SLEEP_CYCLES = 40_000_000  # ~20 ms at 2 GHz: longer than BATCH calls at 100 µs each


def per_call_us(fn, n=20000):
    """Idle regime: median of 5 timed loops of n calls."""
    return _middle(host_loops(fn, n))


def busy_call_us(fn, n=10000):
    """Busy regime: median over batches of BATCH calls, each batch queued behind a sleep kernel."""
    return _middle(host_loops(fn, BATCH, loops=max(1, n // BATCH), before=lambda: torch.cuda._sleep(SLEEP_CYCLES)))


def _middle(loops) -> float:
    """The middle (upper middle of an even count) of the loops' host µs per call."""
    hosts = sorted(host for host, _ in loops)
    return hosts[len(hosts) // 2]


def main(out_dir="perf/results"):
    spec = CacheSpec(16, 16, 8, 128, torch.bfloat16)
    kc, vc = spec.allocate("cuda", fill=0.0)
    key = torch.randn(1, 8, 128, dtype=torch.bfloat16, device="cuda")
    slots = torch.tensor([3], device="cuda")
    pagedattn.reshape_and_cache_flash(key, key, kc, vc, slots)
    launcher = pagedattn.get_kernel(KvWriteSpec("bf16", "auto", "span")).launcher(0)
    values = (key.data_ptr(), key.data_ptr(), kc.data_ptr(), vc.data_ptr(), slots.data_ptr(), 0, 0,
              1024, 1024, *kc.stride()[:3], spec.num_slots, 16, 16, 8, 128, 0, 1, 1)
    # decode of 4 requests over 256 keys each (Hq=32, Hkv=8): the public attention op's host cost
    ak, av = CacheSpec(64, 16, 8, 128, torch.bfloat16).allocate("cuda", fill=0.0)
    q = torch.randn(4, 32, 128, dtype=torch.bfloat16, device="cuda")
    table = torch.arange(64, dtype=torch.int32, device="cuda").view(4, 16)
    cu_q = torch.arange(5, dtype=torch.int32, device="cuda")
    seq = torch.full((4,), 256, dtype=torch.int32, device="cuda")

    def attend(splits):
        return pagedattn.flash_attn_varlen_func(q, ak, av, 1, cu_q, 256, seqused_k=seq, block_table=table,
                                                num_splits=splits)

    ops = torch.ops.pagedattn

    def attend_op(splits):
        return ops.flash_attn_varlen_func(q, ak, av, 1, cu_q, 256, None, seq, None, False, table, splits, None,
                                          None, None, [-1, -1], 0.0, None, None)
    q4 = q.view(4, 1, 32, 128)
    k4 = torch.randn(4, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
    lens = torch.full((4,), 200, dtype=torch.int32, device="cuda")
    cases = {
        "raw_launcher": (lambda: launcher((1, 1, 1), (256, 1, 1), values), 20000),
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
    rounds = max(1, int(os.environ.get("LAUNCH_OVERHEAD_ROUNDS", "3")))
    samples = {}
    for _ in range(rounds):
        for name, (fn, n) in cases.items():
            samples.setdefault(f"{name}_us", []).append(per_call_us(fn, max(1000, n // rounds)))
            samples.setdefault(f"{name}_busy_us", []).append(busy_call_us(fn, max(BATCH, min(n, 10000) // rounds)))
    results = {key: statistics.median(values) for key, values in samples.items()}
    path = write_quick(out_dir, "launch_overhead", results, rounds={key: [round(v, 3) for v in values]
                                                                    for key, values in samples.items()})
    for k, v in results.items():
        print(f"{k:40s} {v:6.2f} us")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(*sys.argv[1:])
