"""Host-side cost of the public ops without a GPU: the eager Python path on CPU tensors, with the
driver stubbed (the real Launcher packs its Params and calls a no-op C function through ctypes in
place of cuLaunchKernelEx) and the CUDA-only pieces (device queries, tensor maps, capture state)
replaced by constants. What it measures is the Python/torch work per call that perf/launch_overhead.py
measures on the GPU, minus the driver's own cost; CPU allocations stand in for the caching
allocator's (of the same order).

    python perf/host_profile.py            # µs of this thread's CPU time per call, best of 7 runs
    python perf/host_profile.py --profile [CASE]  # and a cProfile of one case (default: the decode call)
    python perf/host_profile.py --json     # and the results as one JSON line
"""
from __future__ import annotations

import cProfile
import ctypes
import pstats
import sys
import time

import torch

from pagedattn.bench.timing import host_loops


def stub_cuda():
    """Make the eager paths run on CPU tensors with a stubbed launch."""
    from pagedattn.codegen import launch
    from pagedattn.ops import attention, kv_write, workspace

    class FakeKernel:
        def __init__(self, spec):
            self.spec = spec

        def launcher(self, device):
            # cuLaunchKernel(Ex)'s stand-in: a C function that ignores its arguments and returns 0
            # (NULL: no Python error is set); called with the GIL held, as PyDLL does
            noop = ctypes.PyDLL(None).PyErr_Occurred
            noop.restype = ctypes.c_int
            lau = launch.Launcher.stand_in(noop, self.spec.PARAMS, device)
            lau.max_active_blocks = lambda threads: 4
            return lau

    def cpu_get(kind, device, stream, numel, dtype, capturing):
        key = (kind, device, stream)
        buf = workspace._BUFFERS.get(key)
        if buf is None or buf.tensor.numel() < numel:
            workspace._BUFFERS[key] = buf = workspace._Buffer(torch.zeros(max(numel, 1024), dtype=dtype), False)
        return buf

    attention.get_kernel = kv_write.get_kernel = FakeKernel
    attention._require_cuda = kv_write._require_cuda = lambda t: None
    attention.arch_for_device = lambda device: "sm_90a"
    attention.sm_count = kv_write.sm_count = lambda device: 132
    attention.tma_maps = lambda k, v, call, head_dim: (torch.zeros(256, dtype=torch.uint8), 2)
    attention._is_capturing = lambda: False
    workspace._raw_stream = lambda device: 0
    workspace._get = cpu_get
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.current_device = lambda: 0


# the rows printed (and in perf/results/host_profile_*.json): launch_overhead.api_cases' calls
NAMES = {"reshape_and_cache_flash": "reshape_and_cache_flash", "op reshape_and_cache_flash": "op_reshape_and_cache_flash",
         "flash_attn_varlen_func decode": "flash_attn_decode", "flash_attn_varlen_func decode split4":
         "flash_attn_decode_split4", "op flash_attn_varlen_func decode": "op_flash_attn_decode",
         "op flash_attn_varlen_func decode split4": "op_flash_attn_decode_split4",
         "flash_attn_with_kvcache decode (append 1)": "flash_attn_with_kvcache_decode",
         "torch.empty_like(key)": "torch_empty_like", "key.add(key)": "torch_add"}


def main(argv):
    from launch_overhead import api_cases  # noqa: PLC0415 - the script beside this one

    stub_cuda()
    torch.set_num_threads(1)
    calls = api_cases("cpu")
    all_cases = {name: calls[key][0] for name, key in NAMES.items()}
    results = {}
    for name, fn in all_cases.items():
        try:
            fn()
        except (AttributeError, RuntimeError) as exc:  # an older tree without the op
            print(f"{name:45s}    n/a ({type(exc).__name__})")
            continue
        n = 4000 if "kvcache" in name or name.startswith("op ") else 20000
        # this thread's CPU time per call (thread_time: other processes on a shared machine do not count),
        # the best of 7 runs
        loops = host_loops(fn, n, loops=7, warmup=500, sync=lambda: None, clock=time.thread_time)
        results[name] = min(host for host, _ in loops)
        print(f"{name:45s} {results[name]:6.2f} us")
    if "--json" in argv:  # one line of results, for perf/results/host_profile_*.json
        import json
        print(json.dumps(results))
    if "--profile" in argv:
        rest = argv[argv.index("--profile") + 1:]
        fn = all_cases[rest[0] if rest else "flash_attn_varlen_func decode"]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20000):
            fn()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main(sys.argv[1:])
