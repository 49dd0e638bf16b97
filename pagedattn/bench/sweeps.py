"""`pagedattn bench sweep KIND [CONFIG ...]`: configuration sweeps on the bench's data, timer and oracle
(perf/README.md, "Quick scripts", lists the kinds and their options). Each writes
<out>/<kind>_<gpu>_<date>.json. A kernel's tiles are fixed once it is built, so decode and prefill run
each CONFIG in a child process that forces the tiles of its modes (`config_forced`); the write sweep
changes launch fields per call (`overrides=` of reshape_and_cache_flash) and runs in this process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

KINDS = ("decode", "prefill", "modes", "quick", "write")
DEFAULTS = {"decode": ["4,2,3,cp", "4,3,2,tma", "4,4,1,tma", "4,6,1,tma", "2,4,3,tma", "2,6,2,tma", "8,3,1,tma"],
            "prefill": ["default", "256,64,16,3", "192,128,12,2", "128,128,8,2"],
            "modes": ["long", "short"], "quick": [], "write": []}
CONFIG_FORMAT = {"decode": "kWarpsN,kStages,kMinBlocks,loader,kBlockN",
                 "prefill": "kBlockM,kBlockN,kWarpsM,kStages (mode prefill_wgmma)"}
FILE_KIND = {"decode": "decode_sweep", "prefill": "prefill_sweep", "modes": "prefill_modes", "quick": "attn_quick",
             "write": "write_sweep"}
SHAPE = "Hq=32 Hkv=8 block 16 NHD, bf16 query, shuffled table (bench/attention.build); D=128 unless named"
HQ, HKV, D, BS = 32, 8, 128, 16
# (name, B, ctx, kv cache dtype, num_splits); 0 = the heuristic
DECODE_CASES = [("B=64 ctx=4096", 64, 4096, "auto", 0), ("B=64 ctx=4096 fp8", 64, 4096, "fp8_e4m3", 0),
                ("B=16 ctx=4096", 16, 4096, "auto", 0), ("B=1 ctx=32768", 1, 32768, "auto", 0),
                ("B=1 ctx=32768 fp8", 1, 32768, "fp8_e4m3", 0)]


# -- the override ----------------------------------------------------------------------------------
def config_forced(kind: str, config: str) -> dict:
    """The `forced(...)` options of CONFIG: its tiles for the modes of `kind` (decode: every decode
    mode; prefill: prefill_wgmma) and, for the `cp` loader, decode off TMA."""
    from pagedattn.ops.attention import MODES

    if config == "default":
        return {}
    vals = config.split(",")
    if kind == "decode":
        warps, stages, min_blocks, loader, block_n = (vals + ["tma", "16"][len(vals) - 3:])[:5]
        fields = dict(kWarpsN=int(warps), kStages=int(stages), kMinBlocks=int(min_blocks), kBlockN=int(block_n))
        return dict(tiles={m: fields for m in MODES if m.startswith("decode")},
                    **(dict(tma=False) if loader == "cp" else {}))
    return dict(tiles={"prefill_wgmma": dict(zip(("kBlockM", "kBlockN", "kWarpsM", "kStages"), map(int, vals)))})


def aot_dir(root: str, config: str) -> Path:
    return Path(root) / ("cfg_" + config.replace(",", "_"))


# -- data and measurements -------------------------------------------------------------------------
def paged(B: int, ctx: int, kv: str = "auto", q_len: int = 1, d: int = D, layout: str = "NHD",
          table_order: str = "random", device: str = "cuda"):
    """The bench's paged inputs (attention.build, one input set) at the sweeps' heads and block size."""
    import torch

    from .attention import build
    from .common import Ctx

    p = dict(B=B, q_len=q_len, ctx=ctx, hq=HQ, hkv=HKV, d=d, bs=BS, kv_cache_dtype=kv, layout=layout)
    data = build(Ctx(torch.device(device)), p, sets=1)
    if table_order == "seq":  # request b owns consecutive pages, in order
        data.tables[0] = torch.arange(data.tables[0].numel(), dtype=torch.int32, device=device).view(B, -1)
    return data


def ours(data, num_splits: int = 0, **features):
    """fn(k): pagedattn.flash_attn_varlen_func on input set k of `data` (the bench's call)."""
    from .attention import _ours_fn, flash_fn

    return _ours_fn(flash_fn(), data, num_splits, **features)


def decode_points(opts: dict) -> list:
    """(name, B, ctx, kv cache dtype, num_splits) of a decode sweep: DECODE_CASES, the forced-split B=1
    points of --splits, the B=64 points of --variants; --cases keeps the named ones (and those added)."""
    cases = list(DECODE_CASES)
    splits = [n for n in opts["splits"].split(",") if n]
    cases += [(f"B=1 ctx=32768 splits={n}", 1, 32768, "auto", int(n)) for n in splits]
    variants = [v for v in opts["variants"].split(";") if v]
    cases += [(f"B=64 ctx=4096 {v}", 64, 4096, "auto", int(v[7:]) if v.startswith("splits=") else 0)
              for v in variants]
    only = [x for x in opts["cases"].split(";") if x]
    return [c for c in cases if not only or c[0] in only or c[0].startswith("B=1 ctx=32768 splits")
            or c[0].startswith("B=64 ctx=4096 ") and c[0][14:] in variants]


def decode_row(config: str, opts: dict, name: str, B: int, ctx: int, kv: str, splits: int) -> dict:
    from .timing import Timer

    words = name.split()
    d = opts.get("d", D)
    data = paged(B, ctx, kv, d=d, layout="HND" if "HND" in words else "NHD",
                 table_order="seq" if "seq" in words else "random")
    us = Timer(budget_s=0.2)(ours(data, splits)).us
    row = dict(config=config, case=name, us=us, kv_gbs=2 * B * ctx * HKV * d * (2 if kv == "auto" else 1) / us / 1e3)
    if d != D:
        row["d"] = d
    if opts["tma_promotion"]:
        row["tma_promotion"] = opts["tma_promotion"]
    return row


PREFILL_MODES = ("prefill", "prefill_wgmma", "prefill_ws")  # what `sweep modes long|short` forces in turn


def prefill_row(d: int, prefill: str | None = None, batch: int = 4, q_len: int = 4096, ctx: int = 4096,
                multi: bool | None = False, tiles: dict | None = None, kv: str = "auto",
                features: dict | None = None) -> dict:
    """One prefill point with the dispatch's choice of prefill (None) or with `prefill` forced
    ("prefill", "prefill_wgmma", "prefill_ws"), and multi-token decode off (multi=False), as the
    dispatch has it (None) or forced up to 256 packed rows (True); checked first (short queries as
    timed, long ones on B=2 S=517) against pagedattn.reference. `tiles` overrides tile_config's
    answer for the forced mode (e.g. {"kPingPong": False} for prefill_ws); `kv` the cache dtype;
    `features` the op's feature arguments (e.g. {"softcap": 30.0})."""
    from pagedattn.ops import attention

    from .attention import reference_out
    from .common import rel_l2
    from .timing import Timer

    features = features or {}
    # forced: this prefill (also for rows the dispatch would give the SM80 prefill), multi-token decode
    # off or up to FORCED_MULTI_ROWS rows, the tiles over the forced mode's
    with attention.forced(prefill=prefill, multi=multi, tiles={prefill: tiles} if tiles and prefill else None):
        check = paged(batch, ctx, kv, q_len=q_len, d=d) if q_len <= 64 else paged(2, 517, kv, q_len=517, d=d)
        err = rel_l2(ours(check, **features)(0), reference_out(check, **features))
        attention._PLANS.clear()  # the mode read below is the timed call's
        us = Timer(budget_s=0.2)(ours(paged(batch, ctx, kv, q_len=q_len, d=d), **features)).us
        plan = next(iter(attention._PLANS.values()))
        mode = plan.mode_for(q_len * HQ // HKV)
    flops = 4 * batch * HQ * d * sum(ctx - q_len + i + 1 for i in range(q_len))  # query i sees ctx-q_len+i+1 keys
    elem = 1 if kv != "auto" else 2  # cache bytes per element
    return dict(head_dim=d, batch=batch, q_len=q_len, ctx=ctx, kv=kv, mode=mode, us=us, tflops=flops / us / 1e6,
                kv_gbs=2 * batch * ctx * HKV * d * elem / us / 1e3, rel_l2_err=err)


def quick_row(name: str, B: int, ctx: int, kv: str, splits: int, q_len: int, ceiling: float) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .timing import median_us

    data = paged(B, ctx, kv, q_len=q_len)
    fn = ours(data, splits)
    us = median_us(lambda: fn(0))
    kv_bytes = 2 * B * ctx * HKV * D * (2 if kv == "auto" else 1)
    flops = 4 * B * HQ * D * q_len * ctx * (0.5 if q_len > 1 else 1)
    row = dict(case=name, B=B, ctx=ctx, kv=kv, splits=splits, us=us, kv_gbs=kv_bytes / us / 1e3,
               frac_copy=kv_bytes / us / 1e3 / ceiling, tflops=flops / us / 1e6)
    if kv == "auto":  # SDPA on an unpaged copy of the same KV
        kk, vv = data.contiguous_kv(0)
        qq = data.q[0].view(B, q_len, HQ, D).transpose(1, 2)
        for be, tag in ((SDPBackend.CUDNN_ATTENTION, "cudnn"), (SDPBackend.FLASH_ATTENTION, "flash")):
            try:
                with sdpa_kernel([be]):
                    row[f"{tag}_us"] = median_us(lambda: F.scaled_dot_product_attention(
                        qq, kk, vv, enable_gqa=True, is_causal=q_len > 1))
            except Exception as exc:  # noqa: BLE001
                row[f"{tag}_us"], row[f"{tag}_error"] = None, str(exc)[:200]
    return row


QUICK_CASES = ([("decode B=64 ctx=4096", 64, 4096, "auto", 0, 1), ("decode B=16 ctx=4096", 16, 4096, "auto", 0, 1),
                ("decode B=1 ctx=32768", 1, 32768, "auto", 0, 1),
                ("decode fp8 B=64 ctx=4096", 64, 4096, "fp8_e4m3", 0, 1),
                ("prefill B=4 S=4096 causal", 4, 4096, "auto", 0, 4096)]
               + [(f"decode B=16 ctx=4096 splits={sp}", 16, 4096, "auto", sp, 1) for sp in (1, 2, 4, 8)]
               + [(f"decode B=1 ctx=32768 splits={sp}", 1, 32768, "auto", sp, 1) for sp in (8, 16, 32, 64)])


# -- processes and the results file ----------------------------------------------------------------
def child(kind: str, config: str, opts: dict) -> None:
    """One configuration: print a `ROW <json>` line per measurement."""
    if opts["aot"] and aot_dir(opts["aot"], config).is_dir():
        os.environ["PAGEDATTN_AOT_DIR"] = ":".join(filter(None, [str(aot_dir(opts["aot"], config)),
                                                                 os.environ.get("PAGEDATTN_AOT_DIR", "")]))
    import torch

    from pagedattn.ops.attention import forced

    if opts["tma_promotion"]:
        from pagedattn.ops.attention import tma
        tma.TMA_L2_PROMOTION = opts["tma_promotion"]
    points = decode_points(opts) if kind == "decode" else [None]
    with forced(**config_forced(kind, config)):
        for pt in points:
            try:
                row = decode_row(config, opts, *pt) if kind == "decode" else \
                    dict(config=config, **prefill_row(D, "prefill_wgmma"))
            except Exception as exc:  # noqa: BLE001
                row = dict(config=config, error=str(exc)[:300], **({"case": pt[0]} if pt else {}))
            print("ROW " + json.dumps(row), flush=True)
            torch.cuda.empty_cache()


def precompile(kind: str, root: str, config: str, opts: dict) -> None:
    """This config's sm_90a kernels into aot_dir(root, config), off the GPU (in a child: tiles are fixed)."""
    from pagedattn import aot
    from pagedattn.ops.attention import AttnFwdSpec, forced

    options = config_forced(kind, config)
    with forced(**options):
        if kind == "decode":
            mode = "decode" if options.get("tma") is False else "decode_tma"
            specs = [AttnFwdSpec("bf16", kv, opts.get("d", D), mode) for kv in sorted({c[3] for c in decode_points(opts)})]
        else:
            specs = [AttnFwdSpec("bf16", "auto", D, "prefill_wgmma")]
        summary = aot.precompile(aot.plan(specs, ["sm_90a"]), aot_dir(root, config), n_jobs=1, progress=False)
    print(config, summary.compiled, "compiled", len(summary.failed), "failed", flush=True)


def run_children(kind: str, configs: list[str], opts: dict, role: str = "--child") -> list[dict]:
    rows = []
    for config in configs:
        cmd = [sys.executable, "-m", "pagedattn.bench.sweeps", role, kind, config, json.dumps(opts)]
        try:
            proc = subprocess.run(cmd, capture_output=role != "--precompile", text=True, timeout=300)
        except subprocess.TimeoutExpired as exc:
            proc = subprocess.CompletedProcess(exc.cmd, -9, exc.stdout or "", "timed out after 300 s")
        got = [json.loads(line[4:]) for line in (proc.stdout or "").splitlines() if line.startswith("ROW ")]
        if role == "--child" and (proc.returncode or not got):
            got.append(dict(config=config, error=(proc.stderr or proc.stdout)[-600:]))
        for r in got:
            rows.append(r)
            print(f"{config:16s} {describe(r)}", flush=True)
    return rows


def describe(r: dict) -> str:
    if "us" not in r:
        return f"{r.get('case', '')} ERROR {r.get('error', '')[-300:]}"
    text = f"{r.get('case', r.get('mode', '')):28s} {r['us']:9.1f} us {r['kv_gbs']:6.0f} GB/s"
    return text + (f" {r['tflops']:6.1f} TFLOP/s err {r['rel_l2_err']:.1e}" if "rel_l2_err" in r else "")


def modes_todo(configs: list[str]) -> list:
    """(name, measure) of `sweep modes`: each prefill forced in turn per head dim (long) and per short
    query length (short, also with multi-token decode forced), prefill_wgmma against prefill_ws (ws),
    prefill_ws with and without the consumers' ping-pong (wsab)."""
    long = [dict(d=d) for d in (64, 128, 192, 256)] if "long" in configs else []
    short = [dict(d=D, batch=32, q_len=n, ctx=4096) for n in (5, 8, 16, 32, 64)] if "short" in configs else []
    ws_points = [dict(d=D), dict(d=D, batch=1, q_len=16384, ctx=16384), dict(d=64), dict(d=256)]
    ws = ws_points if "ws" in configs else []
    forced = [(pt, m) for pt in long + short for m in PREFILL_MODES] + \
             [(pt, m) for pt in ws for m in ("prefill_wgmma", "prefill_ws")]
    name = lambda pt: f"d{pt['d']} B={pt.get('batch', 4)} q_len={pt.get('q_len', 4096)}"  # noqa: E731
    todo = [(f"{name(pt)} {m}", lambda pt=pt, m=m: prefill_row(prefill=m, **pt)) for pt, m in forced]
    todo += [(f"{name(pt)} prefill_ws pingpong={pp}",
              lambda pt=pt, pp=pp: dict(prefill_row(prefill="prefill_ws", tiles={"kPingPong": pp}, **pt), ping_pong=pp))
             for i, pt in enumerate(ws_points if "wsab" in configs else []) for pp in (False, True) if pp or i < 2]
    return todo + [(f"d{pt['d']} q_len={pt['q_len']} multi", lambda pt=pt: prefill_row(multi=True, **pt))
                   for pt in short]


# -- the write sweep (issue 3; perf/README.md, "Write path", has the points and the WRITE_SWEEP_* knobs) --
WRITE_H, WRITE_D = 8, 128
WRITE_TOKENS = (65536, 256)
WRITE_CONFIGS = [(layout, kv, scale) for layout in ("NHD", "HND")  # (layout, kv_cache_dtype, scale)
                 for kv, scale in (("auto", "tensor"), ("fp8_e4m3", "tensor"), ("fp8_e4m3", "head"))]
ONE_SHOT = dict(stream_items=0, max_items=4, max_threads=512, min_blocks=0)  # the flat copy variants' build


def _env_list(name: str, conv=int) -> list:
    return [conv(x) for x in os.environ.get(name, "").split(",") if x]


def write_point(path: str, items=None, threads=None, stream=None, span=None, max_items: int = 0) -> dict | None:
    """The overrides that make a write take `path` ("old": span/head; "flat") with this CTA shape;
    None for "default" (whatever the library chooses). A flat point without `stream` runs the
    one-shot schedule on a variant without a streaming body, as the copy variants are built."""
    from pagedattn.ops import kv_write

    if path == "default":
        return None
    if path == "old":
        return {"flat": False, **({"span_packs": span} if span else {})}
    ov = {"flat": True, **ONE_SHOT, "stream_waves": 0}
    if items is not None:
        ov.update(items=items, max_items=max(max_items, 4) if items > 4 else 4)
    if threads is not None:
        ov["threads"] = threads
    if stream:
        build = kv_write.FLAT_BUILD["fp8"]
        ov.update(stream_waves=stream[0], stream_items=stream[1], max_items=build["max_items"],
                  max_threads=build["max_threads"], min_blocks=stream[2] if len(stream) > 2 else build["min_blocks"])
    return ov


def _write_shape(path: str, items, threads, stream, span) -> str:
    if path == "default":
        return "library default"
    if path == "old":
        return f"old path, span packs/thread {span}" if span else "old path, defaults"
    text = f"items={items} threads={threads:3d}"
    if stream:
        text += f" stream={stream[0]:g}x{stream[1]}" + (f" minblocks={stream[2]}" if len(stream) > 2 else "")
    return text


def write_rows(copy_gbs: float):
    """Every point of the write sweep, measured (a generator: each row as it is measured)."""
    import torch

    from pagedattn import CacheSpec
    from pagedattn.ops import kv_write

    from .timing import Timer, rotation_sets
    from .write import page_slots

    quick = bool(os.environ.get("WRITE_SWEEP_QUICK"))  # the default, the old path and the default flat shape
    streams = [tuple(float(v) if i == 0 else int(v) for i, v in enumerate(x.split("x")))  # waves x packs[ x threads]
               for x in os.environ.get("WRITE_SWEEP_STREAM", "").split(",") if x]
    max_items = int(os.environ.get("WRITE_SWEEP_MAX_ITEMS", "0"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    timer, H, D, BLOCK = Timer(budget_s=0.1), WRITE_H, WRITE_D, BS
    try:
        for layout, kv, scale in WRITE_CONFIGS:
            fp8 = kv != "auto"
            for T in WRITE_TOKENS:
                # a cache of at least 256 MiB, as the bench suite sizes it (T=256 not L2-resident)
                num_blocks = -(-max(4 * T, 256 * 2**20 // (H * D * (1 if fp8 else 2))) // BLOCK)
                spec = CacheSpec(num_blocks, BLOCK, H, D, torch.uint8 if fp8 else torch.bfloat16, kv, layout, scale)
                kc, vc = spec.allocate("cuda", fill=0.0)
                nbytes = 2 * T * H * D * 2 + 2 * T * H * D * (1 if fp8 else 2) + T * 8
                sets = rotation_sets(nbytes, 60 * 2**20)  # H200's L2 (rotation at T=256 only)
                keys = [torch.randn(T, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(sets)]
                vals = [torch.randn_like(keys[0]) for _ in range(sets)]
                s = torch.rand(1 if scale == "tensor" else H, device="cuda") + 0.05 if fp8 else None
                slot_sets = {"random": [torch.randperm(spec.num_slots, device="cuda")[:T] for _ in range(sets)]}
                if T >= 4096 and not quick:
                    slot_sets["pages"] = [page_slots(spec.num_blocks, T, "cuda") for _ in range(sets)]
                dflt = kv_write.write_config(spec, T, sms)
                flat = [(dflt.items, dflt.threads)] if quick else [(i, t) for i in (1, 2, 4) for t in (64, 128, 256, 512)]
                points = [("default",), ("old",)] + [("flat", i, t) for i, t in flat]
                if fp8 and T >= kv_write.MANY_TOKENS:
                    points += [("flat", dflt.items, st[2] if len(st) > 2 else dflt.threads, st[:2]) for st in streams]
                    points += [("flat", dflt.items, dflt.threads,
                                (dflt.stream_waves, kv_write.FLAT_BUILD["fp8"]["stream_items"], mb))
                               for mb in _env_list("WRITE_SWEEP_MINB")]
                    points += [("flat", max_items, t) for t in (128, 256)] if max_items > 4 else []
                    if layout == "NHD" and scale == "tensor":
                        points += [("old", None, None, None, sp) for sp in _env_list("WRITE_SWEEP_SPAN")]
                for pattern, slots in slot_sets.items():
                    for pt in points:
                        path, items, threads, stream, span = pt + (None,) * (5 - len(pt))
                        if pattern == "pages" and path == "flat" and items != dflt.items:
                            continue  # pages: old vs flat at the default packs per thread only
                        ov = write_point(path, items, threads, stream, span, max_items)

                        def call(k, slots=slots, ov=ov):
                            kv_write.reshape_and_cache_flash(keys[k], vals[k], kc, vc, slots[k], kv, s, s, overrides=ov)
                        kv_write._PLANS.clear()
                        call(0)
                        (plan,) = kv_write._PLANS.values()  # the path the write really took
                        took = "flat" if plan.base is None else plan.base_spec.path
                        assert path == "default" or (took == "flat") == (path == "flat"), f"forced {path}, ran {took}"
                        us = timer(call, sets).us
                        gbs = nbytes / us / 1e3
                        shape = _write_shape(path, items, threads, stream, span)
                        print(f"T={T:5d} {layout} {kv:9s} {scale:6s} {pattern:6s} {took:4s} {shape:19s}: {us:8.2f} us "
                              f"{gbs:6.0f} GB/s {gbs / copy_gbs:4.0%}", flush=True)
                        yield dict(layout=layout, kv=kv, scale=scale, T=T, slots=pattern, path=took,
                                   default=path == "default", overrides=ov, items=items, threads=threads,
                                   stream=stream, span_packs=span, us=us, gbs=gbs, frac_copy=gbs / copy_gbs, sets=sets)
                kc = vc = keys = vals = None  # free before the next config
                torch.cuda.empty_cache()
    finally:
        kv_write._PLANS.clear()


def write_meta() -> dict:
    """The write defaults the sweep compares against, for the results file."""
    import dataclasses

    import torch

    from pagedattn import CacheSpec
    from pagedattn.ops import kv_write

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fp8_spec = CacheSpec(1, BS, WRITE_H, WRITE_D, torch.uint8, "fp8_e4m3")
    launch = {str(T): dataclasses.asdict(kv_write.write_config(fp8_spec, T, sms)) for T in WRITE_TOKENS}
    return dict(H=WRITE_H, D=WRITE_D, block_size=BS, tokens=list(WRITE_TOKENS),
                defaults=dict(flat_for=sorted(kv_write.FLAT_FOR), build=kv_write.FLAT_BUILD, launch=launch))


def write_summary(rows: list[dict]) -> None:
    """Per config and T (random slots): the old path, the best flat point, and what the defaults run."""
    print("\nsummary (random slots): old path | best flat | library default")
    for k in sorted({(r["layout"], r["kv"], r["scale"], r["T"]) for r in rows}, key=lambda k: (-k[3], k)):
        pts = [r for r in rows if (r["layout"], r["kv"], r["scale"], r["T"]) == k and r["slots"] == "random"]
        old = next(r for r in pts if not r["default"] and r["path"] != "flat")
        best = min((r for r in pts if not r["default"] and r["path"] == "flat"), key=lambda r: r["us"])
        dflt = next(r for r in pts if r["default"])
        stream = " stream=%gx%d" % tuple(best["stream"][:2]) if best.get("stream") else ""
        print(f"T={k[3]:5d} {k[0]} {k[1]:9s} {k[2]:6s} {old['path']:4s} {old['us']:8.2f} us {old['frac_copy']:4.0%}"
              f" | flat items={best['items']} threads={best['threads']:3d}{stream} {best['us']:8.2f} us "
              f"{best['frac_copy']:4.0%} | {dflt['path']:4s} {dflt['us']:8.2f} us {dflt['frac_copy']:4.0%}", flush=True)


def run(args) -> int:
    """`pagedattn bench sweep` (bench/__init__.py parses the arguments)."""
    opts = dict(splits=args.splits, variants=args.variants, cases=args.cases, tma_promotion=args.tma_promotion,
                aot=args.aot, d=getattr(args, "d", D))
    configs = args.configs or DEFAULTS[args.kind]
    if args.precompile:
        if args.kind not in CONFIG_FORMAT:
            raise SystemExit(f"pagedattn bench sweep: --precompile is for {' and '.join(CONFIG_FORMAT)}")
        run_children(args.kind, configs, dict(opts, aot=args.precompile), role="--precompile")
        return 0
    from . import meta as meta_mod
    from .timing import Timer, copy_ceiling_gbs

    how = "median_us (synchronised)" if args.kind == "quick" else "Timer (back-to-back device time)"
    ceiling = copy_ceiling_gbs()
    meta = dict(copy_ceiling_gbs=ceiling, timing=f"{Timer.__module__}.{how}", shape=SHAPE)
    save = lambda rows: meta_mod.write_quick(args.out, FILE_KIND[args.kind], rows, **meta)  # noqa: E731
    rows = []
    if args.kind in CONFIG_FORMAT:
        rows = run_children(args.kind, configs, opts)
        meta["config_format"] = CONFIG_FORMAT[args.kind]
    elif args.kind == "write":
        meta.update(write_meta(), shape=f"H={WRITE_H} D={WRITE_D} block {BS}, bf16 input", copy_gbs=ceiling)
        for row in write_rows(ceiling):
            rows.append(row)
            save(rows)  # a killed run keeps what it had
        write_summary(rows)
    else:
        todo = modes_todo(configs) if args.kind == "modes" else [(c[0], lambda c=c: quick_row(*c, ceiling))
                                                                 for c in QUICK_CASES]
        for name, measure in todo:
            try:
                rows.append(measure())
            except Exception as exc:  # noqa: BLE001 - one failing point must not hide the others
                rows.append(dict(case=name, error=str(exc)[:300]))
            print(f"{name:34s} {describe(rows[-1])}", flush=True)
            save(rows)
    for r in rows:
        if "kv_gbs" in r:
            r["frac_copy"] = r["kv_gbs"] / ceiling
    print(f"copy ceiling {ceiling:.0f} GB/s; wrote {save(rows)}")
    return 0


def _main(role: str, kind: str, config: str, opts: str) -> None:
    """A sweep's child process: `--child|--precompile KIND CONFIG OPTS_JSON`."""
    opts = json.loads(opts)
    if role == "--child":
        child(kind, config, opts)
    else:
        precompile(kind, opts["aot"], config, opts)


if __name__ == "__main__":
    _main(*sys.argv[1:5])
