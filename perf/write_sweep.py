"""Write-path sweep (issue 3; perf/README.md, "Write path", has what it measures and the env knobs):
the span/head path and the flat path at packs per thread x threads per CTA, and the library's defaults,
at T=65536 (also page-contiguous slots) and T=256, for NHD/HND x {bf16, fp8_e4m3 per tensor, per head}.
Each point is an `overrides=` mapping of reshape_and_cache_flash; timed by the bench's Timer. Writes
<out>/write_sweep_*.json.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from datetime import date
from pathlib import Path

import torch

from pagedattn import CacheSpec
from pagedattn.info import git_commit

from pagedattn.bench.timing import Timer, copy_ceiling_gbs, rotation_sets
from pagedattn.bench.write import page_slots
from pagedattn.ops import kv_write

H, D, BLOCK = 8, 128, 16
TOKENS = (65536, 256)
CONFIGS = [  # (layout, kv_cache_dtype, scale)
    ("NHD", "auto", "tensor"), ("NHD", "fp8_e4m3", "tensor"), ("NHD", "fp8_e4m3", "head"),
    ("HND", "auto", "tensor"), ("HND", "fp8_e4m3", "tensor"), ("HND", "fp8_e4m3", "head"),
]
ITEMS = (1, 2, 4)  # <= the flat variants' max_items
QUICK = bool(os.environ.get("WRITE_SWEEP_QUICK"))  # default, old path and the default flat shape only
THREADS = (64, 128, 256, 512)
TIMER = Timer(budget_s=0.1)
L2_BYTES = 60 * 2**20  # H200 (rotation at T=256 only: T=65536 is far larger)
# extra points (perf/README.md): streaming (waves x packs per batch[ x threads]), flat kItems=8, min blocks, span
STREAMS = [tuple(float(v) if i == 0 else int(v) for i, v in enumerate(x.split("x")))
           for x in os.environ.get("WRITE_SWEEP_STREAM", "").split(",") if x]
MAX_ITEMS = int(os.environ.get("WRITE_SWEEP_MAX_ITEMS", "0"))
MIN_BLOCKS = [int(x) for x in os.environ.get("WRITE_SWEEP_MINB", "").split(",") if x]
SPAN_PACKS = [int(x) for x in os.environ.get("WRITE_SWEEP_SPAN", "").split(",") if x]


ONE_SHOT = dict(stream_items=0, max_items=4, max_threads=512, min_blocks=0)  # the flat copy variants' build


def point(path: str, items: int | None = None, threads: int | None = None, stream: tuple | None = None,
          span: int | None = None) -> dict | None:
    """The overrides that make a write take `path` ("old": span/head; "flat") with this CTA shape;
    None for "default" (whatever the library chooses). A flat point without `stream` runs the
    one-shot schedule on a variant without a streaming body, as the copy variants are built."""
    if path == "default":
        return None
    if path == "old":
        return {"flat": False, **({"span_packs": span} if span else {})}
    ov = {"flat": True, **ONE_SHOT, "stream_waves": 0}
    if items is not None:
        ov["items"] = items
        ov["max_items"] = max(MAX_ITEMS, 4) if items > 4 else 4
    if threads is not None:
        ov["threads"] = threads
    if stream:
        build = kv_write.FLAT_BUILD["fp8"]
        ov.update(stream_waves=stream[0], stream_items=stream[1], max_items=build["max_items"],
                  max_threads=build["max_threads"],
                  min_blocks=stream[2] if len(stream) > 2 else build["min_blocks"])
    return ov


def _ran(path: str) -> str:
    """The path the last write really took (from its cached plan)."""
    (plan,) = kv_write._PLANS.values()
    took = "flat" if plan.base is None else plan.base_spec.path
    assert path == "default" or (took == "flat") == (path == "flat"), f"forced {path}, ran {took}"
    return took


def main(out_dir):
    copy_gbs = copy_ceiling_gbs()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fp8_spec = CacheSpec(1, BLOCK, H, D, torch.uint8, "fp8_e4m3")  # the defaults, recorded in the metadata
    rows = []
    try:
        for layout, kv, scale in CONFIGS:
            fp8 = kv != "auto"
            elem_c = 1 if fp8 else 2
            for T in TOKENS:
                # a cache of at least 256 MiB, as the bench suite sizes it (T=256 not L2-resident)
                num_blocks = -(-max(4 * T, 256 * 2**20 // (H * D * elem_c)) // BLOCK)
                spec = CacheSpec(num_blocks, BLOCK, H, D, torch.uint8 if fp8 else torch.bfloat16, kv,
                                 layout, scale)
                kc, vc = spec.allocate("cuda", fill=0.0)
                nbytes = 2 * T * H * D * 2 + 2 * T * H * D * elem_c + T * 8
                sets = rotation_sets(nbytes, L2_BYTES)
                keys = [torch.randn(T, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(sets)]
                vals = [torch.randn_like(keys[0]) for _ in range(sets)]
                s = torch.rand(1 if scale == "tensor" else H, device="cuda") + 0.05 if fp8 else None
                slot_sets = {"random": [torch.randperm(spec.num_slots, device="cuda")[:T] for _ in range(sets)]}
                if T >= 4096 and not QUICK:
                    slot_sets["pages"] = [page_slots(spec.num_blocks, T, "cuda") for _ in range(sets)]
                flat_points = [(i, t) for i in ITEMS for t in THREADS]
                dflt = kv_write.write_config(spec, T, sms)
                if QUICK:  # the library's own flat shape for this T only
                    flat_points = [(dflt.items, dflt.threads)]
                points = [("default", None, None, None, None), ("old", None, None, None, None)] + \
                    [("flat", i, t, None, None) for i, t in flat_points]
                if fp8 and T >= kv_write.MANY_TOKENS:
                    points += [("flat", dflt.items, st[2] if len(st) > 2 else dflt.threads, st[:2], None)
                               for st in STREAMS]
                    points += [("flat", dflt.items, dflt.threads,
                                (dflt.stream_waves, kv_write.FLAT_BUILD["fp8"]["stream_items"], mb), None)
                               for mb in MIN_BLOCKS]
                    if MAX_ITEMS > 4:
                        points += [("flat", MAX_ITEMS, t, None, None) for t in (128, 256)]
                    if layout == "NHD" and scale == "tensor":
                        points += [("old", None, None, None, sp) for sp in SPAN_PACKS]
                for pattern, slots in slot_sets.items():
                    for path, items, threads, stream, span in points:
                        if pattern == "pages" and path == "flat" and items != dflt.items:
                            continue  # pages: old vs flat at the default packs per thread only
                        ov = point(path, items, threads, stream, span)

                        def call(k, slots=slots, ov=ov):
                            kv_write.reshape_and_cache_flash(keys[k], vals[k], kc, vc, slots[k], kv, s, s,
                                                             overrides=ov)
                        kv_write._PLANS.clear()
                        call(0)
                        took = _ran(path)
                        us = TIMER(call, sets).us
                        gbs = nbytes / us / 1e3
                        rows.append(dict(layout=layout, kv=kv, scale=scale, T=T, slots=pattern, path=took,
                                         default=path == "default", overrides=ov,
                                         items=items, threads=threads, stream=stream, span_packs=span, us=us, gbs=gbs, frac_copy=gbs / copy_gbs,
                                         sets=sets))
                        shape = (f"items={items} threads={threads:3d}" + (f" stream={stream[0]:g}x{stream[1]}" + (f" minblocks={stream[2]}" if len(stream) > 2 else "")
                                                            if stream else "")
                                 if path == "flat" else
                                 "library default    " if path == "default" else
                                 f"old path, span packs/thread {span}" if span else "old path, defaults ")
                        print(f"T={T:5d} {layout} {kv:9s} {scale:6s} {pattern:6s} {took:4s} {shape}: {us:8.2f} us "
                              f"{gbs:6.0f} GB/s {gbs / copy_gbs:4.0%}", flush=True)
                kc = vc = keys = vals = None  # free before the next config
                torch.cuda.empty_cache()
    finally:
        kv_write._PLANS.clear()
    _summary(rows)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, commit=git_commit(),
                date=date.today().isoformat(), copy_gbs=copy_gbs, H=H, D=D, block_size=BLOCK,
                tokens=list(TOKENS), defaults=dict(
                    flat_for=sorted(kv_write.FLAT_FOR), build=kv_write.FLAT_BUILD,
                    launch={str(T): dataclasses.asdict(kv_write.write_config(fp8_spec, T, sms)) for T in TOKENS}))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"write_sweep_h200_{meta['date'].replace('-', '')}.json").write_text(
        json.dumps(dict(kind="write_sweep", metadata=meta, results=rows), indent=1))


def _summary(rows):
    """Per config and T (random slots): the old path, the best flat point, and what the defaults run."""
    print("\nsummary (random slots): old path | best flat | library default")
    keys = sorted({(r["layout"], r["kv"], r["scale"], r["T"]) for r in rows}, key=lambda k: (-k[3], k))
    for k in keys:
        pts = [r for r in rows if (r["layout"], r["kv"], r["scale"], r["T"]) == k and r["slots"] == "random"]
        old = next(r for r in pts if not r["default"] and r["path"] != "flat")
        best = min((r for r in pts if not r["default"] and r["path"] == "flat"), key=lambda r: r["us"])
        dflt = next(r for r in pts if r["default"])
        print(f"T={k[3]:5d} {k[0]} {k[1]:9s} {k[2]:6s} {old['path']:4s} {old['us']:8.2f} us {old['frac_copy']:4.0%}"
              f" | flat items={best['items']} threads={best['threads']:3d}"
              f"{' stream=%gx%d' % tuple(best['stream'][:2]) if best.get('stream') else ''} {best['us']:8.2f} us "
              f"{best['frac_copy']:4.0%} | {dflt['path']:4s} {dflt['us']:8.2f} us {dflt['frac_copy']:4.0%}",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "perf/results")
