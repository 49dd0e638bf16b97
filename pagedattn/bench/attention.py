"""decode, prefill, features and sweep suites: `pagedattn.flash_attn_varlen_func` over a paged cache against
torch SDPA and FA4 (perf/README.md, "What is measured": cases, work counted, peers, goals). Every case is
checked once against `pagedattn.reference` (float32, relative L2 <= TOLERANCE), then timed under both
methods of timing.py. A cache dtype the op does not list is reported skipped ("unsupported by pagedattn").
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch

import pagedattn
from pagedattn import reference
from pagedattn.dtypes import FP8_MAX

from . import peers as peerlib
from .common import Case, Ctx, Recorder, short_error, shuffled_tables
from .timing import METHODS, rotation_sets

HQ, HKV, D, BLOCK = 32, 8, 128, 16
TINY = {"hq": 4, "hkv": 2, "d": 64, "bs": 16}
TOLERANCE = 2e-2
# decode (issue 17): goal_us at most (µs, under both methods); vs (peer, ratio): ours at least `ratio` times
# the peer's speed; HND and other block sizes within 3 % of ours on NHD bs16
BASE_PEER, WITHIN_3PCT = "pagedattn NHD bs16", 1 / 1.03
DECODE = (
    {"B": 1, "ctx": 32768, "goal_us": 40.0},
    {"B": 1, "ctx": 131072, "vs": ("sdpa cudnn", 0.85)},
    {"B": 16, "ctx": 4096, "goal_us": 70.0, "vs": ("sdpa cudnn", 1.0)},
    {"B": 64, "ctx": 4096, "goal_us": 245.0, "vs": ("sdpa cudnn", 1.0)},
    {"B": 128, "ctx": 2048, "goal_us": 245.0, "vs": ("sdpa cudnn", 1.0)},
    {"B": 64, "ctx": 4096, "kv": "fp8_e4m3", "goal_us": 130.0},
    {"B": 64, "ctx": 4096, "kv": "fp8_e5m2", "goal_us": 130.0},
    {"B": 64, "ctx": 4096, "layout": "HND", "vs": (BASE_PEER, WITHIN_3PCT)},
    *({"B": 64, "ctx": 4096, "bs": bs, "vs": (BASE_PEER, WITHIN_3PCT)} for bs in (32, 64, 128)),
)
TINY_DECODE = ({"B": 2, "ctx": 80}, {"B": 3, "ctx": 48, "kv": "fp8_e4m3"}, {"B": 2, "ctx": 48, "kv": "fp8_e5m2"},
               {"B": 2, "ctx": 80, "layout": "HND", "vs": (BASE_PEER, WITHIN_3PCT)},
               {"B": 2, "ctx": 80, "bs": 32, "vs": (BASE_PEER, WITHIN_3PCT)})
# prefill, chunked prefill (q queries over ctx keys, the last q new; causal unless "causal": False), multi-token
# decode (q <= 64); issue 16's goals: "tflops" / "us" (ours at least / at most), "vs" ((peer, ratio), ...: ours at
# least `ratio` times the peer's speed), "base" (the params of ours in another configuration, peer BF16)
BF16, _AHEAD, _S4K = "pagedattn bf16", (("sdpa cudnn", 1.0), ("fa4 paged", 1.0)), {"B": 4, "q": 4096, "ctx": 4096}
PREFILL = ({**_S4K, "goal": {"tflops": 560.0, "vs": _AHEAD}}, {**_S4K, "kv": "fp8_e4m3", "goal": {
               "vs": ((BF16, 0.9),), "base": {"kv_cache_dtype": "auto", "cache": "bf16"}}},
           {"B": 1, "q": 16384, "ctx": 16384, "goal": {"tflops": 580.0, "vs": _AHEAD}},
           {**_S4K, "causal": False, "goal": {"tflops": 600.0, "vs": _AHEAD}},
           {"B": 8, "q": 512, "ctx": 8192, "goal": {"tflops": 500.0, "vs": _AHEAD}},
           *({**_S4K, "d": d, "goal": {"vs": (("sdpa cudnn", 0.9),)}} for d in (64, 256)),
           # d96 (Phi-3): not one of the goals; its prefill runs on the 128 tile (heuristics.wgmma_head_dim),
           # held to the same ratio as d64 and d256
           {**_S4K, "d": 96, "goal": {"vs": (("sdpa cudnn", 0.9),)}},
           *({"B": 32, "q": q, "ctx": 4096, "goal": {"us": us}} for q, us in ((8, 150.0), (32, 170.0))))
TINY_PREFILL = ({"B": 2, "q": 40, "ctx": 40}, {"B": 2, "q": 24, "ctx": 40, "causal": False})
# features (issue 14): each variant against the plain kernel (PLAIN) at the goal's shape, or (`base`) at the
# window's keys, a ratio goal each; head dim 512 against the copy ceiling: (id, shape, features, goal)
PLAIN = "pagedattn plain"
FEATURES = (
    ("decode/B16/ctx32768/window4096", dict(B=16, ctx=32768, q_len=1), dict(window_size=(4096, 0)),
     dict(base=dict(B=16, ctx=4096, q_len=1), ratio=1 / 1.15)),
    ("decode/B16/ctx4096/softcap", dict(B=16, ctx=4096, q_len=1), dict(softcap=30.0), dict(ratio=1 / 1.05)),
    ("decode/B16/ctx4096/alibi", dict(B=16, ctx=4096, q_len=1), dict(alibi_slopes="head"), dict(ratio=1 / 1.05)),
    ("decode/B16/ctx4096/sinks", dict(B=16, ctx=4096, q_len=1), dict(s_aux="head"), dict(ratio=1 / 1.05)),
    ("prefill/B4/S4096/softcap", dict(B=4, ctx=4096, q_len=4096), dict(softcap=30.0), dict(ratio=1 / 1.15)),
    ("decode/B16/ctx4096/d512", dict(B=16, ctx=4096, q_len=1, d=512), {}, dict(fraction=0.85)),
)
TINY_FEATURES = (
    ("decode/B2/ctx200/window64", dict(B=2, ctx=200, q_len=1), dict(window_size=(64, 0)),
     dict(base=dict(B=2, ctx=64, q_len=1), ratio=1 / 1.15)),
    ("decode/B2/ctx80/sinks", dict(B=2, ctx=80, q_len=1), dict(s_aux="head"), dict(ratio=1 / 1.05)),
)
# sweep (not in "all"): ours alone at the tile and mode studies' shapes, to run under --overrides:
# (id, B, q_len, ctx, head dim, num_splits[, other params]); prefill/mha: one query head per KV head, where
# prefill_ws's pairs of row tiles (kWsPair) end in different steps; decode at head dims 80 and 96, whose
# 16-bit caches decode by cp.async (decode_tma takes multiples of 64)
SWEEP = ([(f"decode/B1/ctx32768/splits{n}", 1, 1, 32768, D, n) for n in (8, 16, 32, 64)]
         + [(f"decode/B16/ctx4096/splits{n}", 16, 1, 4096, D, n) for n in (1, 2, 4, 8)]
         + [(f"prefill/d{d}/B4/S4096", 4, 4096, 4096, d, 0) for d in (64, 80, 96, 128, 192, 256)]
         + [(f"decode/d{d}/B64/ctx4096", 64, 1, 4096, d, 0) for d in (80, 96, 128)]
         + [(f"short/B32/q{q}/ctx4096", 32, q, 4096, D, 0) for q in (5, 8, 16, 32, 64)]
         + [("prefill/B1/S16384", 1, 16384, 16384, D, 0), ("prefill/B16/S1024", 16, 1024, 1024, D, 0),
            ("prefill/B8/q512/ctx8192", 8, 512, 8192, D, 0),
            ("prefill/mha/B4/S4096", 4, 4096, 4096, D, 0, dict(hq=32, hkv=32))])
TINY_SWEEP = (("decode/B2/ctx80/splits2", 2, 1, 80, 64, 2), ("short/B2/q5/ctx48", 2, 5, 48, 64, 0))


def _dims(ctx: Ctx) -> dict:
    return dict(TINY) if ctx.tiny else {"hq": HQ, "hkv": HKV, "d": D, "bs": BLOCK}


def _params(ctx: Ctx, B: int, q_len: int, L: int, kv: str = "auto", **more) -> dict:
    return {"B": B, "q_len": q_len, "ctx": L, "kv_cache_dtype": kv, "cache": "bf16" if kv == "auto" else kv,
            "dtype": "bf16", "causal": True, "layout": "NHD", **_dims(ctx), **more}


def _case(cid: str, suite: str, params: dict, goals: dict | None = None) -> Case:
    return Case(cid, suite, params, lambda ctx, rec: run_case(ctx, rec, params, goals))


def decode_cases(ctx: Ctx) -> list[Case]:
    """DECODE's cases, each with the peers it runs: "all" (bf16), "torch" (fp8 e4m3: SDPA on a bf16 copy,
    gather), "none" (fp8 e5m2), "base" (another layout or block size: ours on a plain NHD cache)."""
    out, plain_bs = [], _dims(ctx)["bs"]
    for s in (TINY_DECODE if ctx.tiny else DECODE):
        kv, layout, bs = s.get("kv", "auto"), s.get("layout", "NHD"), s.get("bs", plain_bs)
        cid = (f"decode/B{s['B']}/ctx{s['ctx']}/{'bf16' if kv == 'auto' else kv}"
               + (f"/{layout}" if layout != "NHD" else "") + (f"/bs{bs}" if bs != plain_bs else ""))
        peers = ("base" if layout != "NHD" or bs != plain_bs
                 else {"auto": "all", "fp8_e4m3": "torch"}.get(kv, "none"))
        params = _params(ctx, s["B"], 1, s["ctx"], kv, layout=layout, bs=bs, peers=peers)
        out.append(_case(cid, "decode", params, {"us": s.get("goal_us"), "vs": (s["vs"],) if "vs" in s else ()}))
    return out


def prefill_cases(ctx: Ctx) -> list[Case]:
    out = []
    for s in (TINY_PREFILL if ctx.tiny else PREFILL):
        kv, causal, d, goal = s.get("kv", "auto"), s.get("causal", True), s.get("d"), dict(s.get("goal", {}))
        kind = "prefill" if s["q"] == s["ctx"] else "chunk" if s["q"] > 64 else "multi"
        cid = (f"{kind}/B{s['B']}/" + (f"S{s['q']}" if kind == "prefill" else f"q{s['q']}/ctx{s['ctx']}")
               + ("/causal" if causal else "/noncausal") + (f"/d{d}" if d else "") + ("" if kv == "auto" else f"/{kv}"))
        base = {"peers": "base", "base": goal.pop("base"), "base_name": BF16} if "base" in goal else {}
        more = {"peers": "all" if kv == "auto" else "none", **({"d": d} if d else {}), **base}
        params = _params(ctx, s["B"], s["q"], s["ctx"], kv, causal=causal, **more)
        out.append(_case(cid, "prefill", params, goal))
    return out


def feature_cases(ctx: Ctx) -> list[Case]:
    out = []
    for cid, shape, feats, goal in (TINY_FEATURES if ctx.tiny else FEATURES):
        params = _params(ctx, shape["B"], shape["q_len"], shape["ctx"], d=shape.get("d", _dims(ctx)["d"]),
                         peers="base" if "ratio" in goal else "ours", features=feats)
        goals = {"fraction": goal.get("fraction")}
        if "ratio" in goal:
            params.update(base=goal.get("base", {}), base_name=PLAIN)
            goals["vs"] = ((PLAIN, goal["ratio"]),)
        out.append(_case(cid, "features", params, goals))
    return out


def sweep_cases(ctx: Ctx) -> list[Case]:
    return [_case(cid, "sweep", _params(ctx, B, q_len, L, peers="ours", num_splits=splits, d=d, **dict(*more)))
            for cid, B, q_len, L, d, splits, *more in (TINY_SWEEP if ctx.tiny else SWEEP)]


# -- data ------------------------------------------------------------------------------------------
class PagedData(SimpleNamespace):
    """One case's inputs (`build`): B, q_len, ctx_len, hq, hkv, d, bs, kv (cache dtype), scale; per input set
    q [B * q_len, Hq, D] and tables int32 [B, nb]; the caches kc, vc [num_blocks, bs, Hkv, D] (HND: a view of
    [num_blocks, Hkv, bs, D]); seqused, cu_q; k_descale, v_descale (fp8) or None."""

    def gathered_kv(self, s: int, dtype=torch.bfloat16):
        """[B, Hkv, ctx, D] views of set s's pages (gathered as bytes for fp8, then dequantised)."""
        out = []
        for cache, descale in ((self.kc, self.k_descale), (self.vc, self.v_descale)):
            fp8 = cache.element_size() == 1
            g = (cache.view(torch.uint8) if fp8 else cache)[self.tables[s].long()]  # [B, nb, bs, Hkv, D]
            g = g.reshape(self.B, -1, self.hkv, self.d)[:, :self.ctx_len]  # reshape: an HND cache is a permuted view
            g = (g.view(cache.dtype) if fp8 else g).to(dtype)
            out.append((g * descale.to(dtype) if descale is not None else g).transpose(1, 2))
        return out

    def contiguous_kv(self, s: int, dtype=torch.bfloat16):
        """Unpaged copies [B, Hkv, ctx, D] of set s's KV (dequantised for fp8)."""
        return [x.contiguous() for x in self.gathered_kv(s, dtype)]


def build(ctx: Ctx, p: dict, sets: int, gen_seed: int = 0) -> PagedData:
    dev = ctx.device
    B, q_len, L, hq, hkv, d, bs, kv = (p[k] for k in ("B", "q_len", "ctx", "hq", "hkv", "d", "bs", "kv_cache_dtype"))
    nb = math.ceil(L / bs)
    num_blocks = B * nb * sets + max(B * nb * sets // 4, 8)
    torch.manual_seed(gen_seed)
    hnd = p.get("layout") == "HND"
    shape = (num_blocks, hkv, bs, d) if hnd else (num_blocks, bs, hkv, d)
    kd = vd = None
    if kv == "auto":
        kc, vc = (torch.randn(shape, dtype=torch.bfloat16, device=dev) for _ in range(2))
    else:
        kd = torch.tensor([4.0 / FP8_MAX[kv]], dtype=torch.float32, device=dev)
        vd = kd.clone()
        kc, vc = (reference.quantize_fp8(torch.randn(shape, device=dev), kd, kv) for _ in range(2))
    if hnd:  # the logical [num_blocks, bs, Hkv, D] whatever the memory order
        kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
    return PagedData(B=B, q_len=q_len, ctx_len=L, hq=hq, hkv=hkv, d=d, bs=bs, kv=kv, scale=1 / math.sqrt(d),
                     causal=p.get("causal", True),
                     q=[torch.randn(B * q_len, hq, d, dtype=torch.bfloat16, device=dev) for _ in range(sets)],
                     kc=kc, vc=vc, tables=shuffled_tables(num_blocks, B, nb, sets, dev), k_descale=kd, v_descale=vd,
                     seqused=torch.full((B,), L, dtype=torch.int32, device=dev),
                     cu_q=torch.arange(0, B * q_len + 1, q_len, dtype=torch.int32, device=dev))


def reference_out(data: PagedData, s: int = 0, causal: bool | None = None, **features) -> torch.Tensor:
    """float32 output of input set `s` by pagedattn.reference (the one oracle), matmuls in full fp32;
    `features` are the op's feature arguments (window_size, softcap, alibi_slopes, s_aux)."""
    kw = {("sinks" if k == "s_aux" else k): v for k, v in features.items()}
    if data.kv != "auto":
        kw.update(kv_cache_dtype=data.kv, k_descale=data.k_descale, v_descale=data.v_descale)
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        return reference.paged_attention(data.q[s], data.kc, data.vc, data.cu_q, data.seqused, data.tables[s],
                                         causal=data.causal if causal is None else causal,
                                         softmax_scale=data.scale, **kw)
    finally:
        torch.set_float32_matmul_precision(prev)


# -- a case: ours checked and timed, then the peers -------------------------------------------------
def ours_fn(data: PagedData, num_splits: int = 0, **features):
    """fn(k): pagedattn.flash_attn_varlen_func on input set k of `data`, as the suites call it."""
    fa = pagedattn.flash_attn_varlen_func  # looked up per case: tests put stand-ins there
    if data.kv != "auto":  # the caches are float8 tensors: their dtype names the format
        features.update(k_descale=data.k_descale, v_descale=data.v_descale)

    def ours(k):
        res = fa(data.q[k], data.kc, data.vc, data.q_len, data.cu_q, data.ctx_len, seqused_k=data.seqused,
                 causal=data.causal, block_table=data.tables[k], softmax_scale=data.scale, return_softmax_lse=False,
                 num_splits=num_splits, **features)
        return res[0] if isinstance(res, (tuple, list)) else res
    return ours


def feature_kwargs(feats: dict, hq: int, device) -> dict:
    """The op's feature arguments of params "features", per-head tensors drawn for "head"."""
    kw = dict(feats)
    if kw.get("alibi_slopes") == "head":
        kw["alibi_slopes"] = (2.0 ** (-8.0 * torch.arange(1, hq + 1) / hq)).float().to(device)
    if kw.get("s_aux") == "head":
        kw["s_aux"] = torch.randn(hq, generator=torch.Generator().manual_seed(7)).float().to(device)
    return kw


def _sets(ctx: Ctx, p: dict) -> int:
    """Input sets of params `p`: KV bytes + q read and out written (bf16) rotated past the L2."""
    kv_bytes = 2 * p["B"] * p["ctx"] * p["hkv"] * p["d"] * (1 if p["kv_cache_dtype"] != "auto" else 2)
    return rotation_sets(kv_bytes + 2 * 2 * p["B"] * p["q_len"] * p["hq"] * p["d"], ctx.l2_bytes, cap=8)


def run_case(ctx: Ctx, rec: Recorder, p: dict, goals: dict | None = None) -> None:
    """One case of params `p` (`features`: the op's feature arguments; `peers`: all | torch | none | ours |
    base: ours at params `p` | `base`, named `base_name`) with `goals` us / tflops / fraction (targets, not in
    tiny runs) and vs (peer, ratio)."""
    B, sq, L, hq, hkv, d = p["B"], p["q_len"], p["ctx"], p["hq"], p["hkv"], p["d"]
    kv, supported = p["kv_cache_dtype"], pagedattn.ops.attention.AttnFwdSpec.SUPPORTED["kv_cache_dtype"]
    feats = feature_kwargs(p.get("features") or {}, hq, ctx.device)
    kv_bytes = 2 * B * L * hkv * d * (1 if kv != "auto" else 2)
    if sq == 1 or sq <= 64 and sq < L // 8:  # decode, multi-token decode: bound by the KV bytes (a window's only)
        rec.work("GB/s", kv_bytes * min(L, feats.get("window_size", (L,))[0] + 1) // L, "copy")
    else:  # query i sees L - sq + i + 1 keys (bottom-right causal), or all L
        keys = sq * (L - sq) + sq * (sq + 1) / 2 if p.get("causal", True) else sq * L
        rec.work("TFLOP/s", 4 * B * hq * d * keys, "matmul")
    if kv not in supported:
        return rec.skip(f"unsupported by pagedattn: kv_cache_dtype {kv!r} (supported: {', '.join(supported)})")
    sets = _sets(ctx, p)
    data = build(ctx, p, sets)
    rec.extra(sets=sets, kv_bytes=kv_bytes, num_blocks=data.kc.shape[0], methods=list(METHODS))
    # correctness once, then timing (a failure is the case's error; the peers still run). The reference holds
    # [Hq, q_len, ctx] float32 scores per sequence: beyond 4096 x 4096 the check runs at B=1, 4096.
    big = sq * L > 4096 * 4096
    checked = build(ctx, dict(p, B=1, q_len=min(sq, 4096), ctx=min(L, 4096)), 1, gen_seed=2) if big else data
    ref = None
    with rec.attempt("float32 reference"):
        ref = reference_out(checked, **feats)
    with rec.attempt("pagedattn"):
        try:
            out = ours_fn(checked, p.get("num_splits", 0), **feats)(0)
        except (pagedattn.UnsupportedError, NotImplementedError) as exc:
            return rec.skip(f"unsupported by pagedattn: {short_error(exc)}")
        ctx.sync()
        if tuple(out.shape) != tuple(checked.q[0].shape):
            rec.check(False, "rel_l2", f"output shape {tuple(out.shape)}, expected {tuple(checked.q[0].shape)}")
        elif ref is not None:
            rec.check_close(out, ref, TOLERANCE)
        del out
        ours = ours_fn(data, p.get("num_splits", 0), **feats)
        rec.ours("pagedattn" + (" " + "+".join(feats) if feats else ""), ours, sets, methods=METHODS)
    role, ref = p.get("peers", "all"), None if big else ref  # ref: the peers' check
    if role == "base":  # ours on a plain NHD cache, default block size (or at `base`): what a case is held to
        base = dict(p, layout="NHD", bs=_dims(ctx)["bs"], features={}, **p.get("base", {}))
        base_sets = _sets(ctx, base)
        rec.peer(p.get("base_name", BASE_PEER), lambda: ours_fn(build(ctx, base, base_sets, gen_seed=1)),
                 base_sets, methods=METHODS)
    elif role == "none":
        rec.note("no peers: they would read the same bf16 copy as the fp8_e4m3 case")
    elif role in ("all", "torch"):
        peerlib.torch_peers(ctx, rec, data, ref, sets, fa4=role == "all")
    if kv != "auto" and role in ("all", "torch"):
        rec.note("torch peers read a bf16 dequantised copy (torch has no fp8-KV attention)")
    goals = goals or {}
    for key, unit in (("us", "us"), ("tflops", "TFLOP/s"), ("fraction", "fraction")):
        if goals.get(key) is not None and not ctx.tiny:
            rec.target(goals[key], unit)
    for peer, ratio in goals.get("vs", ()):
        rec.goal_ratio(peer, ratio)
