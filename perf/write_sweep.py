"""Write-path CTA shape sweep at T=65536, H=8, D=128 (the issue's large case): packs per thread on the
span path and warps per CTA on the head path, for NHD/HND x bf16/fp8_e4m3 x slots {random, pages}. Python-side only (the
kernel handles any CTA size), so one compiled variant serves every point. Writes <out>/write_sweep_*.json."""
from __future__ import annotations

import json
import sys
from datetime import date
from pathlib import Path

import torch

import pagedattn
from pagedattn import CacheSpec
from pagedattn.info import git_commit

from _timing import copy_ceiling_gbs, median_us  # perf/ is on sys.path when run as a script
from pagedattn.bench.write import page_slots
from pagedattn.ops import kv_write

VALUES = (1, 2, 4, 8)


def main(out_dir):
    T, H, D = 65536, 8, 128
    copy_gbs = copy_ceiling_gbs()
    key = torch.randn(T, H, D, dtype=torch.bfloat16, device="cuda")
    val = torch.randn_like(key)
    rows = []
    for layout in ("NHD", "HND"):
        for kv in ("auto", "fp8_e4m3"):
            spec = CacheSpec(T // 16 + 64, 16, H, D, torch.bfloat16 if kv == "auto" else torch.uint8, kv, layout)
            kc, vc = spec.allocate("cuda", fill=0.0)
            slot_sets = {"random": torch.randperm(spec.num_slots, device="cuda")[:T],
                         "pages": page_slots(spec.num_blocks, T, "cuda")}
            s = torch.tensor([0.05], device="cuda") if kv != "auto" else None
            nbytes = 2 * T * H * D * 2 + 2 * T * H * D * (2 if kv == "auto" else 1) + T * 8
            knob = "SPAN_PACKS_PER_THREAD" if layout == "NHD" else "HEAD_WARPS"
            default = getattr(kv_write, knob)
            for pattern, slots in slot_sets.items():
                for value in VALUES:
                    setattr(kv_write, knob, value)
                    kv_write._PLANS.clear()
                    us = median_us(lambda: pagedattn.reshape_and_cache_flash(key, val, kc, vc, slots, kv, s, s), reps=40)
                    gbs = nbytes / us / 1e3
                    rows.append(dict(layout=layout, kv=kv, slots=pattern, knob=knob, value=value, us=us, gbs=gbs,
                                     frac_copy=gbs / copy_gbs))
                    print(f"{layout} {kv:9s} {pattern:6s} {knob}={value}: {us:7.1f} us {gbs:6.0f} GB/s "
                          f"{gbs / copy_gbs:.0%}", flush=True)
            setattr(kv_write, knob, default)
            kv_write._PLANS.clear()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, commit=git_commit(),
                date=date.today().isoformat(), copy_gbs=copy_gbs, T=T, H=H, D=D)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"write_sweep_h200_{meta['date'].replace('-', '')}.json").write_text(
        json.dumps(dict(kind="write_sweep", metadata=meta, results=rows), indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "perf/results")
