"""Write-path sweep (issue 3): the one-CTA-per-token paths (span/head, at their defaults) against the flat
path at packs per thread {1, 2, 4} x threads per CTA {64, 128, 256, 512}, and the library's defaults,
at T=65536 (also with page-contiguous slots) and T=256, H=8, D=128, bf16 input, block size 16, for
NHD/HND x {bf16 cache, fp8_e4m3 per-tensor scale, fp8_e4m3 per-head scales}. The path and CTA shape
are forced through the module constants of pagedattn.ops.kv_write (FLAT_FOR, FLAT_ITEMS[_FEW],
FLAT_THREADS[_FEW]); both are launch-time choices (packs per thread up to the compiled FLAT_MAX_ITEMS),
so one variant per dtype serves every point. Timed as the bench suite times (pagedattn.bench.timing.
Timer: device time per call, the host kept ahead; inputs rotated through enough sets to miss L2 at
T=256). One line per point, a summary per config; writes <out>/write_sweep_*.json.
What to read: frac_copy at T=65536 (goal >= 0.80 for HND and fp8; NHD bf16 >= 0.90) and us at T=256
(goal <= 6 us) of flat against old, to set FLAT_FOR / FLAT_MIN_TOKENS / FLAT_ITEMS[_FEW] /
FLAT_THREADS[_FEW] (the T=65536 rows for the plain names, T=256 for _FEW)."""
from __future__ import annotations

import json
import os
import sys
from datetime import date
from pathlib import Path

import torch

import pagedattn
from pagedattn import CacheSpec
from pagedattn.info import git_commit

from _timing import copy_ceiling_gbs  # perf/ is on sys.path when run as a script
from pagedattn.bench.timing import Timer, rotation_sets
from pagedattn.bench.write import page_slots
from pagedattn.ops import kv_write
from pagedattn.registry import get_kernel

H, D, BLOCK = 8, 128, 16
TOKENS = (65536, 256)
CONFIGS = [  # (layout, kv_cache_dtype, scale)
    ("NHD", "auto", "tensor"), ("NHD", "fp8_e4m3", "tensor"), ("NHD", "fp8_e4m3", "head"),
    ("HND", "auto", "tensor"), ("HND", "fp8_e4m3", "tensor"), ("HND", "fp8_e4m3", "head"),
]
ITEMS = (1, 2, 4)  # <= FLAT_MAX_ITEMS
QUICK = bool(os.environ.get("WRITE_SWEEP_QUICK"))  # default, old path and the default flat shape only
THREADS = (64, 128, 256, 512)
TIMER = Timer(budget_s=0.1)
L2_BYTES = 60 * 2**20  # H200 (rotation at T=256 only: T=65536 is far larger)
KNOBS = ("FLAT_FOR", "FLAT_MIN_TOKENS", "FLAT_ITEMS", "FLAT_ITEMS_FEW", "FLAT_THREADS", "FLAT_THREADS_FEW",
         "FLAT_STREAM_WAVES", "FLAT_STREAM_ITEMS", "FLAT_MAX_ITEMS", "SPAN_PACKS_PER_THREAD",
         "FLAT_STREAM_MIN_BLOCKS")
# Streaming points (fp8 configs, many tokens): WRITE_SWEEP_STREAM="1x4,2x4,1x2" = (resident waves x packs per
# batch) of the capped grid, at the default packs per thread and threads; every other flat point runs
# the one-shot schedule (FLAT_STREAM_WAVES = 0). Empty: one-shot and default points only.
# WRITE_SWEEP_MAX_ITEMS=8: compile the flat variants with kItems = 8 (FLAT_MAX_ITEMS) and add one-shot points
# of 8 packs per thread. WRITE_SWEEP_SPAN="2,8": the span path (NHD, one scale) also at these packs per thread.
MAX_ITEMS = int(os.environ.get("WRITE_SWEEP_MAX_ITEMS", "0"))
# WRITE_SWEEP_MINB="0,4,6": the default streaming shape again with FLAT_STREAM_MIN_BLOCKS at these values
MIN_BLOCKS = [int(x) for x in os.environ.get("WRITE_SWEEP_MINB", "").split(",") if x]
SPAN_PACKS = [int(x) for x in os.environ.get("WRITE_SWEEP_SPAN", "").split(",") if x]
# A third number is the threads per CTA of that point ("1x1x128"; default FLAT_THREADS).
STREAMS = [tuple(float(v) if i == 0 else int(v) for i, v in enumerate(x.split("x")))
           for x in os.environ.get("WRITE_SWEEP_STREAM", "").split(",") if x]
ALL = frozenset((layout, kind) for layout in ("NHD", "HND") for kind in ("copy", "fp8", "fp8_head"))


def _force(path: str, items: int | None = None, threads: int | None = None, defaults=None,
           stream: tuple | None = None, span: int | None = None) -> None:
    """Make every following write take `path` ("old": span/head; "flat") with this CTA shape, or
    ("default") whatever the module's defaults choose."""
    if path == "default":
        for k, v in defaults.items():
            setattr(kv_write, k, v)
        kv_write._PLANS.clear()
        get_kernel.cache_clear()
        return
    kv_write.FLAT_FOR = ALL if path == "flat" else frozenset()
    kv_write.FLAT_MIN_TOKENS = 1
    if items is not None:
        kv_write.FLAT_ITEMS = kv_write.FLAT_ITEMS_FEW = items
    if threads is not None:
        kv_write.FLAT_THREADS = kv_write.FLAT_THREADS_FEW = threads
    kv_write.FLAT_STREAM_WAVES, kv_write.FLAT_STREAM_ITEMS = stream[:2] if stream else (0, defaults["FLAT_STREAM_ITEMS"])
    kv_write.FLAT_STREAM_MIN_BLOCKS = stream[2] if stream and len(stream) > 2 else defaults["FLAT_STREAM_MIN_BLOCKS"]
    kv_write.FLAT_MAX_ITEMS = max(MAX_ITEMS, defaults["FLAT_MAX_ITEMS"]) if items and items > 4 else defaults["FLAT_MAX_ITEMS"]
    kv_write.SPAN_PACKS_PER_THREAD = span or defaults["SPAN_PACKS_PER_THREAD"]
    kv_write._PLANS.clear()
    get_kernel.cache_clear()  # a variant's source depends on FLAT_STREAM_ITEMS


def _ran(path: str) -> str:
    """The path the last write really took (from its cached plan)."""
    (plan,) = kv_write._PLANS.values()
    took = "flat" if plan.base is None else plan.base_spec.path
    assert path == "default" or (took == "flat") == (path == "flat"), f"forced {path}, ran {took}"
    return took


def main(out_dir):
    copy_gbs = copy_ceiling_gbs()
    defaults = {k: getattr(kv_write, k) for k in KNOBS}
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
                if QUICK:  # the library's own flat shape for this T only
                    many = T >= kv_write.MANY_TOKENS
                    flat_points = [(defaults["FLAT_ITEMS" if many else "FLAT_ITEMS_FEW"],
                                    defaults["FLAT_THREADS" if many else "FLAT_THREADS_FEW"])]
                points = [("default", None, None, None, None), ("old", None, None, None, None)] + \
                    [("flat", i, t, None, None) for i, t in flat_points]
                if fp8 and T >= kv_write.MANY_TOKENS:
                    points += [("flat", defaults["FLAT_ITEMS"], st[2] if len(st) > 2 else defaults["FLAT_THREADS"],
                                st[:2], None) for st in STREAMS]
                    points += [("flat", defaults["FLAT_ITEMS"], defaults["FLAT_THREADS"],
                                (defaults["FLAT_STREAM_WAVES"], defaults["FLAT_STREAM_ITEMS"], mb), None)
                               for mb in MIN_BLOCKS]
                    if MAX_ITEMS > 4:
                        points += [("flat", MAX_ITEMS, t, None, None) for t in (128, 256)]
                    if layout == "NHD" and scale == "tensor":
                        points += [("old", None, None, None, sp) for sp in SPAN_PACKS]
                for pattern, slots in slot_sets.items():
                    def call(k, slots=slots):
                        pagedattn.reshape_and_cache_flash(keys[k], vals[k], kc, vc, slots[k], kv, s, s)
                    for path, items, threads, stream, span in points:
                        if pattern == "pages" and path == "flat" and items != defaults["FLAT_ITEMS"]:
                            continue  # pages: old vs flat at the default packs per thread only
                        _force(path, items, threads, defaults, stream, span)
                        call(0)
                        took = _ran(path)
                        us = TIMER(call, sets).us
                        gbs = nbytes / us / 1e3
                        rows.append(dict(layout=layout, kv=kv, scale=scale, T=T, slots=pattern, path=took,
                                         default=path == "default",
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
        for k, v in defaults.items():
            setattr(kv_write, k, v)
        kv_write._PLANS.clear()
    _summary(rows)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, commit=git_commit(),
                date=date.today().isoformat(), copy_gbs=copy_gbs, H=H, D=D, block_size=BLOCK,
                tokens=list(TOKENS), defaults={k: sorted(v) if isinstance(v, frozenset) else v
                                                for k, v in defaults.items()})
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
