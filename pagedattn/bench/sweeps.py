"""`pagedattn bench sweep KIND [CONFIG ...]`: the suites' cases under overrides (perf/README.md, "Quick
scripts", lists the kinds and their options), on the bench's data (attention.build, write.inputs), timer
(the Ctx's `Timer`, back to back) and oracle (pagedattn.reference). Each writes
<out>/<kind>_<gpu>_<date>.json. A kernel's tiles are fixed once it is built, so decode and prefill run
each CONFIG in a child process that forces the tiles of its modes (`config_forced`); the write sweep
passes `overrides=` to reshape_and_cache_flash per call and runs in this process.
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
# (name, B, ctx, kv cache dtype, num_splits[, q_len]); num_splits 0 = the heuristic
DECODE_CASES = [("B=64 ctx=4096", 64, 4096, "auto", 0), ("B=64 ctx=4096 fp8", 64, 4096, "fp8_e4m3", 0),
                ("B=16 ctx=4096", 16, 4096, "auto", 0), ("B=1 ctx=32768", 1, 32768, "auto", 0),
                ("B=1 ctx=32768 fp8", 1, 32768, "fp8_e4m3", 0)]
QUICK_CASES = ([("decode B=64 ctx=4096", 64, 4096, "auto", 0), ("decode B=16 ctx=4096", 16, 4096, "auto", 0),
                ("decode B=1 ctx=32768", 1, 32768, "auto", 0), ("decode fp8 B=64 ctx=4096", 64, 4096, "fp8_e4m3", 0),
                ("prefill B=4 S=4096 causal", 4, 4096, "auto", 0, 4096)]
               + [(f"decode B=16 ctx=4096 splits={sp}", 16, 4096, "auto", sp) for sp in (1, 2, 4, 8)]
               + [(f"decode B=1 ctx=32768 splits={sp}", 1, 32768, "auto", sp) for sp in (8, 16, 32, 64)])
PREFILL_MODES = ("prefill", "prefill_wgmma", "prefill_ws")  # what `sweep modes long|short` forces in turn


# -- the overrides ---------------------------------------------------------------------------------
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


def decode_points(opts: dict) -> list:
    """The decode sweep's points: DECODE_CASES, the forced-split B=1 points of --splits, the B=64 points
    of --variants; --cases keeps the named ones (and those added)."""
    only = [x for x in opts["cases"].split(";") if x]
    splits = [(f"B=1 ctx=32768 splits={n}", 1, 32768, "auto", int(n)) for n in opts["splits"].split(",") if n]
    variants = [(f"B=64 ctx=4096 {v}", 64, 4096, "auto", int(v.removeprefix("splits=")) if v.startswith("splits=") else 0)
                for v in opts["variants"].split(";") if v]
    return [c for c in DECODE_CASES if not only or c[0] in only] + splits + variants


# -- measurements ----------------------------------------------------------------------------------
def _ctx(budget_s: float = 0.2):
    from .common import Ctx

    ctx = Ctx.make("cuda", quick=False)
    ctx.timer.budget_s = budget_s
    return ctx


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


def attn_row(name: str, B: int, ctx: int, kv: str = "auto", splits: int = 0, q_len: int = 1, d: int = D,
             sdpa: bool = False, timer=None, features: dict | None = None) -> dict:
    """One decode / multi-token / prefill point, ours with the op's `features` (and with `sdpa` cuDNN and
    flash SDPA on an unpaged copy, bf16 only); words HND and seq in `name` pick that layout / an in-order
    table."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    timer = timer or _ctx().timer
    words = name.split()
    data = paged(B, ctx, kv, q_len, d, "HND" if "HND" in words else "NHD", "seq" if "seq" in words else "random")
    us = timer(ours(data, splits, **(features or {}))).us
    kv_bytes = 2 * B * ctx * HKV * d * (2 if kv == "auto" else 1)
    flops = 4 * B * HQ * d * sum(ctx - q_len + i + 1 for i in range(q_len))  # query i sees ctx-q_len+i+1 keys
    row = dict(case=name, B=B, ctx=ctx, kv=kv, splits=splits, us=us, kv_gbs=kv_bytes / us / 1e3,
               tflops=flops / us / 1e6, **({"d": d} if d != D else {}))
    if sdpa and kv == "auto":
        kk, vv = data.contiguous_kv(0)
        qq = data.q[0].view(B, q_len, HQ, d).transpose(1, 2)
        for backend, tag in ((SDPBackend.CUDNN_ATTENTION, "cudnn"), (SDPBackend.FLASH_ATTENTION, "flash")):
            try:
                with sdpa_kernel([backend]):
                    row[f"{tag}_us"] = timer(lambda k: F.scaled_dot_product_attention(
                        qq, kk, vv, enable_gqa=True, is_causal=q_len > 1)).us
            except Exception as exc:  # noqa: BLE001
                row[f"{tag}_us"], row[f"{tag}_error"] = None, str(exc)[:200]
    return row


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

    features = features or {}
    with attention.forced(prefill=prefill, multi=multi, tiles={prefill: tiles} if tiles and prefill else None):
        check = paged(batch, ctx, kv, q_len=q_len, d=d) if q_len <= 64 else paged(2, 517, kv, q_len=517, d=d)
        err = rel_l2(ours(check, **features)(0), reference_out(check, **features))
        attention._PLANS.clear()  # the mode read below is the timed call's
        row = attn_row("", batch, ctx, kv, q_len=q_len, d=d, features=features)
        mode = next(iter(attention._PLANS.values())).mode_for(q_len * HQ // HKV)
    return dict(head_dim=d, batch=batch, q_len=q_len, ctx=ctx, kv=kv, mode=mode, us=row["us"], tflops=row["tflops"],
                kv_gbs=row["kv_gbs"], rel_l2_err=err)


def modes_todo(configs: list[str]) -> list:
    """(name, measure) of `sweep modes`: each prefill forced in turn per head dim (long) and per short
    query length (short, also with multi-token decode forced), prefill_wgmma against prefill_ws (ws),
    prefill_ws with and without the consumers' ping-pong (wsab)."""
    long = [dict(d=d) for d in (64, 128, 192, 256)] if "long" in configs else []
    short = [dict(d=D, batch=32, q_len=n, ctx=4096) for n in (5, 8, 16, 32, 64)] if "short" in configs else []
    ws_points = [dict(d=D), dict(d=D, batch=1, q_len=16384, ctx=16384), dict(d=64), dict(d=256)]
    forced = [(pt, m) for pt in long + short for m in PREFILL_MODES] + \
             [(pt, m) for pt in (ws_points if "ws" in configs else []) for m in ("prefill_wgmma", "prefill_ws")]
    name = lambda pt: f"d{pt['d']} B={pt.get('batch', 4)} q_len={pt.get('q_len', 4096)}"  # noqa: E731
    todo = [(f"{name(pt)} {m}", lambda pt=pt, m=m: prefill_row(prefill=m, **pt)) for pt, m in forced]
    todo += [(f"{name(pt)} prefill_ws pingpong={pp}",
              lambda pt=pt, pp=pp: dict(prefill_row(prefill="prefill_ws", tiles={"kPingPong": pp}, **pt), ping_pong=pp))
             for i, pt in enumerate(ws_points if "wsab" in configs else []) for pp in (False, True) if pp or i < 2]
    return todo + [(f"d{pt['d']} q_len={pt['q_len']} multi", lambda pt=pt: prefill_row(multi=True, **pt))
                   for pt in short]


# -- the write sweep (issue 3; perf/README.md, "Write path", has the points and the WRITE_SWEEP_* knobs) --
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

    if path in ("default", "old"):
        return None if path == "default" else {"flat": False, **({"span_packs": span} if span else {})}
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
    if path != "flat":
        return "library default" if path == "default" else f"old path, {f'span packs/thread {span}' if span else 'defaults'}"
    text = f"items={items} threads={threads:3d}"
    if stream:
        text += f" stream={stream[0]:g}x{stream[1]}" + (f" minblocks={stream[2]}" if len(stream) > 2 else "")
    return text


def write_points(kv: str, layout: str, scale: str, T: int, dflt, quick: bool) -> list[tuple]:
    """(path, items, threads, stream, span) of one write config: the default, the old path, the flat
    shapes, and from MANY_TOKENS on the fp8 points of WRITE_SWEEP_STREAM / _MINB / _MAX_ITEMS / _SPAN."""
    from pagedattn.ops import kv_write

    flat = [(dflt.items, dflt.threads)] if quick else [(i, t) for i in (1, 2, 4) for t in (64, 128, 256, 512)]
    points = [("default",), ("old",)] + [("flat", i, t) for i, t in flat]
    if kv != "auto" and T >= kv_write.MANY_TOKENS:
        streams = [tuple(float(v) if i == 0 else int(v) for i, v in enumerate(x.split("x")))  # waves x packs[ x threads]
                   for x in os.environ.get("WRITE_SWEEP_STREAM", "").split(",") if x]
        max_items = int(os.environ.get("WRITE_SWEEP_MAX_ITEMS", "0"))
        points += [("flat", dflt.items, st[2] if len(st) > 2 else dflt.threads, st[:2]) for st in streams]
        points += [("flat", dflt.items, dflt.threads, (dflt.stream_waves, kv_write.FLAT_BUILD["fp8"]["stream_items"], mb))
                   for mb in _env_list("WRITE_SWEEP_MINB")]
        points += [("flat", max_items, t) for t in (128, 256)] if max_items > 4 else []
        if layout == "NHD" and scale == "tensor":
            points += [("old", None, None, None, sp) for sp in _env_list("WRITE_SWEEP_SPAN")]
    return [pt + (None,) * (5 - len(pt)) for pt in points]


def write_rows(copy_gbs: float):
    """Every point of the write sweep, measured (a generator: each row as it is measured)."""
    import torch

    from pagedattn.ops import kv_write

    from .write import inputs, ours_fn

    quick = bool(os.environ.get("WRITE_SWEEP_QUICK"))  # the default, the old path and the default flat shape
    max_items = int(os.environ.get("WRITE_SWEEP_MAX_ITEMS", "0"))
    ctx, sms = _ctx(0.1), torch.cuda.get_device_properties(0).multi_processor_count
    try:
        for (layout, kv, scale), T in ((c, T) for c in WRITE_CONFIGS for T in WRITE_TOKENS):
            for pattern in ("random", "pages") if T >= 4096 and not quick else ("random",):
                inp = inputs(ctx, dict(T=T, layout=layout, kv_cache_dtype=kv, scale=scale, slots=pattern))
                dflt = kv_write.write_config(inp.spec, T, sms)
                for path, items, threads, stream, span in write_points(kv, layout, scale, T, dflt, quick):
                    if pattern == "pages" and path == "flat" and items != dflt.items:
                        continue  # pages: old vs flat at the default packs per thread only
                    ov = write_point(path, items, threads, stream, span, max_items)
                    call = ours_fn(inp, ov)
                    kv_write._PLANS.clear()
                    call(0)
                    (plan,) = kv_write._PLANS.values()  # the path the write really took
                    took = "flat" if plan.base is None else plan.base_spec.path
                    assert path == "default" or (took == "flat") == (path == "flat"), f"forced {path}, ran {took}"
                    us = ctx.timer(call, inp.sets).us
                    gbs = inp.nbytes / us / 1e3
                    print(f"T={T:5d} {layout} {kv:9s} {scale:6s} {pattern:6s} {took:4s} "
                          f"{_write_shape(path, items, threads, stream, span):19s}: {us:8.2f} us {gbs:6.0f} GB/s "
                          f"{gbs / copy_gbs:4.0%}", flush=True)
                    yield dict(layout=layout, kv=kv, scale=scale, T=T, slots=pattern, path=took,
                               default=path == "default", overrides=ov, items=items, threads=threads, stream=stream,
                               span_packs=span, us=us, gbs=gbs, frac_copy=gbs / copy_gbs, sets=inp.sets)
                del inp  # free before the next config
                torch.cuda.empty_cache()
    finally:
        kv_write._PLANS.clear()


def write_meta() -> dict:
    """The write defaults the sweep compares against, for the results file."""
    import dataclasses

    import torch

    from pagedattn import CacheSpec
    from pagedattn.ops import kv_write

    from .write import BLOCK, H
    from .write import D as WD

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fp8_spec = CacheSpec(1, BLOCK, H, WD, torch.uint8, "fp8_e4m3")
    launch = {str(T): dataclasses.asdict(kv_write.write_config(fp8_spec, T, sms)) for T in WRITE_TOKENS}
    return dict(H=H, D=WD, block_size=BLOCK, tokens=list(WRITE_TOKENS), shape=f"H={H} D={WD} block {BLOCK}, bf16 input",
                defaults=dict(flat_for=sorted(kv_write.FLAT_FOR), build=kv_write.FLAT_BUILD, launch=launch))


def write_summary(rows: list[dict]) -> None:
    """Per config and T (random slots): the old path, the best flat point, and what the defaults run."""
    print("\nsummary (random slots): old path | best flat | library default")
    cell = lambda r: f"{r['us']:8.2f} us {r['frac_copy']:4.0%}"  # noqa: E731
    for k in sorted({(r["layout"], r["kv"], r["scale"], r["T"]) for r in rows}, key=lambda k: (-k[3], k)):
        pts = [r for r in rows if (r["layout"], r["kv"], r["scale"], r["T"]) == k and r["slots"] == "random"]
        old = next(r for r in pts if not r["default"] and r["path"] != "flat")
        best = min((r for r in pts if not r["default"] and r["path"] == "flat"), key=lambda r: r["us"])
        dflt = next(r for r in pts if r["default"])
        stream = " stream=%gx%d" % tuple(best["stream"][:2]) if best.get("stream") else ""
        print(f"T={k[3]:5d} {k[0]} {k[1]:9s} {k[2]:6s} {old['path']:4s} {cell(old)} | flat items={best['items']} "
              f"threads={best['threads']:3d}{stream} {cell(best)} | {dflt['path']:4s} {cell(dflt)}", flush=True)


# -- processes and the results file ----------------------------------------------------------------
def child(kind: str, config: str, opts: dict) -> None:
    """One configuration: print a `ROW <json>` line per measurement."""
    if opts["aot"] and aot_dir(opts["aot"], config).is_dir():
        os.environ["PAGEDATTN_AOT_DIR"] = ":".join(filter(None, [str(aot_dir(opts["aot"], config)),
                                                                 os.environ.get("PAGEDATTN_AOT_DIR", "")]))
    import torch

    from pagedattn.ops.attention import forced, tma

    if opts["tma_promotion"]:
        tma.TMA_L2_PROMOTION = opts["tma_promotion"]
    extra = {"tma_promotion": opts["tma_promotion"]} if opts["tma_promotion"] else {}
    with forced(**config_forced(kind, config)):
        for pt in decode_points(opts) if kind == "decode" else [None]:
            try:
                row = (attn_row(*pt, d=opts.get("d", D)) if kind == "decode" else prefill_row(D, "prefill_wgmma"))
            except Exception as exc:  # noqa: BLE001
                row = dict(error=str(exc)[:300], **({"case": pt[0]} if pt else {}))
            print("ROW " + json.dumps(dict(config=config, **row, **extra)), flush=True)
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
    text = f"{r.get('case') or r.get('mode', ''):28s} {r['us']:9.1f} us {r['kv_gbs']:6.0f} GB/s"
    return text + (f" {r['tflops']:6.1f} TFLOP/s err {r['rel_l2_err']:.1e}" if "rel_l2_err" in r else "")


def copy_ceiling_gbs() -> float:
    """The copy ceiling as the bench measures it (suites.ceiling_cases' copy case, same timer)."""
    from .common import Recorder
    from .suites import ceiling_cases

    ctx = _ctx(0.3)
    case = ceiling_cases(ctx)[0]
    rec = Recorder(case, ctx)
    case.run(ctx, rec)
    return rec.finish()["ours"]["value"]


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

    ceiling = copy_ceiling_gbs()
    meta = dict(copy_ceiling_gbs=ceiling, timing="pagedattn.bench.timing.Timer (back-to-back device time)", shape=SHAPE)
    save = lambda rows: meta_mod.write_quick(args.out, FILE_KIND[args.kind], rows, **meta)  # noqa: E731
    rows = []
    if args.kind in CONFIG_FORMAT:
        rows = run_children(args.kind, configs, opts)
        meta["config_format"] = CONFIG_FORMAT[args.kind]
    elif args.kind == "write":
        meta.update(write_meta(), copy_gbs=ceiling)
        for row in write_rows(ceiling):
            rows.append(row)
            save(rows)  # a killed run keeps what it had
        write_summary(rows)
    else:
        todo = modes_todo(configs) if args.kind == "modes" else [(c[0], lambda c=c: attn_row(*c, sdpa=True))
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


if __name__ == "__main__":  # a sweep's child process: `--child|--precompile KIND CONFIG OPTS_JSON`
    role, kind, config, opts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    child(kind, config, opts) if role == "--child" else precompile(kind, opts["aot"], config, opts)
