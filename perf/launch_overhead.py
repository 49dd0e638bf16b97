"""Steady-state host cost of one kernel launch (µs), through the raw launcher and the public API.

Tiny problem (one token), no synchronisation inside the timed loop; the GPU queue never fills at
these sizes. Writes perf/results/launch_overhead_<gpu>_<date>.json.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch

import pagedattn
from pagedattn import CacheSpec
from pagedattn.ops.kv_write import KvWriteSpec


def per_call_us(fn, n=20000):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return sorted(best)[len(best) // 2]


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
    results = {
        "raw_launcher_us": per_call_us(lambda: launcher((1, 1, 1), (256, 1, 1), values)),
        "reshape_and_cache_flash_us": per_call_us(
            lambda: pagedattn.reshape_and_cache_flash(key, key, kc, vc, slots)),
        "flash_attn_decode_us": per_call_us(lambda: attend(1), n=5000),
        "flash_attn_decode_split4_us": per_call_us(lambda: attend(4), n=5000),
        "torch_empty_like_us": per_call_us(lambda: torch.empty_like(key)),
        "torch_add_us": per_call_us(lambda: key.add(key)),
    }
    from pagedattn.info import git_commit

    commit = git_commit()
    meta = {"gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
            "torch": torch.__version__, "cuda": torch.version.cuda, "pagedattn": pagedattn.__version__,
            "commit": commit, "date": date.today().isoformat(), "python": sys.version.split()[0]}
    try:
        meta["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    doc = {"kind": "launch_overhead", "metadata": meta, "results": results}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = meta["gpu"].replace(" ", "_").lower()
    path = out / f"launch_overhead_{name}_{meta['date'].replace('-', '')}.json"
    path.write_text(json.dumps(doc, indent=1))
    for k, v in results.items():
        print(f"{k:30s} {v:6.2f} us")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(*sys.argv[1:])
