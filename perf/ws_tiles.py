"""Tile variants of the warp-specialised prefill against each other, at the prefill goals' shapes
(bf16, Hq=32, Hkv=8, block 16, causal; issue 16): one `bench.sweeps.prefill_row` per (variant, point),
prefill_ws forced, its tile_config answer overridden by the variant's fields (e.g. kStages=3).

Each variant runs in its own process (tile_config is replaced in-process): first all of them at once,
a small checked call each, so their kernels compile in parallel; then the timed points one process at a
time, so that the timings do not overlap. Kernel time is the Timer's (back to back).

    python perf/ws_tiles.py [OUT_DIR] [--variants 'stages2:kStages=2;stages3:kStages=3'] [--d 128] [--kv fp8_e4m3]
                            [--softcap 30]
writes OUT_DIR/ws_tiles_<gpu>_<date>.json (default perf/results) and prints a table.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing as mp

POINTS = [dict(batch=4, q_len=4096, ctx=4096), dict(batch=1, q_len=16384, ctx=16384),
          dict(batch=16, q_len=1024, ctx=1024), dict(batch=8, q_len=512, ctx=8192)]


def parse_variants(text: str) -> dict[str, dict]:
    """'name:field=int,field=int;name2:...' -> {name: {field: int}} ('default' with no fields: tile_config's)."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(";"))):
        name, _, fields = item.partition(":")
        out[name] = {k: (v == "True") if v in ("True", "False") else int(v)
                     for k, v in (f.split("=") for f in filter(None, fields.split(",")))}
    return out


def _row(args):
    d, kv, tiles, point, features = args
    from pagedattn.bench.sweeps import prefill_row
    return prefill_row(d, prefill="prefill_ws", multi=False, tiles=tiles or None, kv=kv, features=features,
                       **point)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default="perf/results")
    ap.add_argument("--variants", default="default:;stages3:kStages=3")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--kv", default="auto", help="cache dtype: auto (16-bit), fp8_e4m3 or fp8_e5m2 (head dim 128)")
    ap.add_argument("--softcap", type=float, default=0.0, help="the op's softcap (0: off)")
    ap.add_argument("--points", type=int, default=len(POINTS), help="the first N of the points only")
    args = ap.parse_args(argv)
    features = {"softcap": args.softcap} if args.softcap else {}
    variants = parse_variants(args.variants)
    ctx = mp.get_context("spawn")
    small = dict(batch=1, q_len=256, ctx=256)
    with cf.ProcessPoolExecutor(len(variants), mp_context=ctx) as pool:  # compile every variant at once
        list(pool.map(_row, [(args.d, args.kv, tiles, small, features) for tiles in variants.values()]))
    rows = []
    for name, tiles in variants.items():
        for point in POINTS[:args.points]:
            with cf.ProcessPoolExecutor(1, mp_context=ctx) as pool:
                row = pool.submit(_row, (args.d, args.kv, tiles, point, features)).result()
            rows.append(dict(variant=name, tiles=tiles, features=features, **row))
            print(f"{name:12s} B{point['batch']:<3d} q{point['q_len']:<6d} k{point['ctx']:<6d} "
                  f"{row['us']:9.1f} us {row['tflops']:7.1f} TFLOP/s  err {row['rel_l2_err']:.1e}", flush=True)
    from pagedattn.bench.meta import write_quick
    name = "ws_tiles" + ("" if args.kv == "auto" else f"_{args.kv}") + ("_softcap" if features else "")
    print("wrote", write_quick(args.out, name, rows,
                               variants=variants))


if __name__ == "__main__":
    main()
