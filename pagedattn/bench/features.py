"""features suite: the attention variants of issue 14 (window, softcap, ALiBi, sinks) against the plain
kernel timed in the same process (a ratio goal each, CASES), and head dim 512 against the copy ceiling.
Checked once against pagedattn.reference; timed under both methods.
"""
from __future__ import annotations

import torch

from .attention import TOLERANCE, _dims, _ours_fn, _params, build, flash_fn, reference_out
from .attention import available  # noqa: F401 - the suite table asks this module (suites.py)
from .common import Case, Ctx, Recorder
from .timing import METHODS

SOFTCAP = 30.0
# (id, shape, features of ours, (peer shape, ratio goal) or fraction-of-copy goal)
CASES = (
    ("decode/B16/ctx32768/window4096", dict(B=16, ctx=32768, q_len=1), dict(window_size=(4096, 0)),
     dict(peer=dict(B=16, ctx=4096, q_len=1), ratio=1 / 1.15)),
    ("decode/B16/ctx4096/softcap", dict(B=16, ctx=4096, q_len=1), dict(softcap=SOFTCAP),
     dict(peer=dict(B=16, ctx=4096, q_len=1), ratio=1 / 1.05)),
    ("decode/B16/ctx4096/alibi", dict(B=16, ctx=4096, q_len=1), dict(alibi_slopes="head"),
     dict(peer=dict(B=16, ctx=4096, q_len=1), ratio=1 / 1.05)),
    ("decode/B16/ctx4096/sinks", dict(B=16, ctx=4096, q_len=1), dict(s_aux="head"),
     dict(peer=dict(B=16, ctx=4096, q_len=1), ratio=1 / 1.05)),
    ("prefill/B4/S4096/softcap", dict(B=4, ctx=4096, q_len=4096), dict(softcap=SOFTCAP),
     dict(peer=dict(B=4, ctx=4096, q_len=4096), ratio=1 / 1.15)),
    ("decode/B16/ctx4096/d512", dict(B=16, ctx=4096, q_len=1, d=512), {}, dict(fraction=0.85)),
)
TINY_CASES = (
    ("decode/B2/ctx200/window64", dict(B=2, ctx=200, q_len=1), dict(window_size=(64, 0)),
     dict(peer=dict(B=2, ctx=64, q_len=1), ratio=1 / 1.15)),
    ("decode/B2/ctx80/sinks", dict(B=2, ctx=80, q_len=1), dict(s_aux="head"),
     dict(peer=dict(B=2, ctx=80, q_len=1), ratio=1 / 1.05)),
)
PLAIN = "pagedattn plain"


def cases(ctx: Ctx) -> list[Case]:
    out = []
    for cid, shape, feats, goal in (TINY_CASES if ctx.tiny else CASES):
        params = _params(ctx, shape["B"], shape["q_len"], shape["ctx"], "auto", layout="NHD",
                         d=shape.get("d", _dims(ctx)["d"]))
        params["features"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in feats.items()}
        out.append(Case(cid, "features", params,
                        lambda ctx, rec, p=params, f=feats, g=goal: run_case(ctx, rec, p, f, g)))
    return out


def _feature_kwargs(feats: dict, hq: int, device) -> dict:
    """The call's feature arguments, with per-head tensors drawn for "head"."""
    kw = dict(feats)
    if kw.get("alibi_slopes") == "head":
        kw["alibi_slopes"] = (2.0 ** (-8.0 * torch.arange(1, hq + 1) / hq)).float().to(device)
    if kw.get("s_aux") == "head":
        kw["s_aux"] = torch.randn(hq, generator=torch.Generator().manual_seed(7)).float().to(device)
    return kw


def _cache_bytes(p: dict) -> int:
    return 2 * p["B"] * p["ctx"] * p["hkv"] * p["d"] * 2


def run_case(ctx: Ctx, rec: Recorder, p: dict, feats: dict, goal: dict) -> None:
    B, sq, L, hkv, hq, d = p["B"], p["q_len"], p["ctx"], p["hkv"], p["hq"], p["d"]
    if sq == 1:  # the bytes of K/V a decode must read: the window's, not the history's
        keys = min(L, feats["window_size"][0] + 1) if "window_size" in feats else L
        rec.work("GB/s", 2 * B * keys * hkv * d * 2, "copy")
    else:
        rec.work("TFLOP/s", 4 * B * hq * d * sq * L / 2, "matmul")
    fa = flash_fn()
    sets = ctx.sets_for(_cache_bytes(p), cap=8)
    data = build(ctx, p, sets)
    kw = _feature_kwargs(feats, hq, ctx.device)
    ours = _ours_fn(fa, data, **kw)
    rec.extra(sets=sets, methods=list(METHODS))

    def check_and_time():
        rec.check_close(ours(0), reference_out(data, **kw), TOLERANCE)
        rec.ours("pagedattn " + "+".join(feats) if feats else "pagedattn", ours, sets, methods=METHODS)
    if not rec.attempt("pagedattn", check_and_time):
        return
    if "fraction" in goal:
        return rec.target(goal["fraction"], "fraction")
    peer_p = dict(p, **goal["peer"])
    peer_sets = ctx.sets_for(_cache_bytes(peer_p), cap=8)
    rec.peer(PLAIN, lambda: _ours_fn(fa, build(ctx, peer_p, peer_sets)), sets=peer_sets, methods=METHODS)
    rec.extra(peer_shape={k: peer_p[k] for k in ("B", "q_len", "ctx")}, peer_sets=peer_sets)
    rec.goal_ratio(PLAIN, goal["ratio"])
