"""legacy suite: `pagedattn.legacy.paged_attention_v1 / _v2 / paged_attention` (issue 7) at the decode
shapes of issue 4 on the legacy cache layout (`to_legacy`), v2 partitions of 512 tokens. The same KV as
an NHD cache feeds the reference and the peers, which are measured once per shape and block size and
shared by the v1 / v2 / auto cases.
"""
from __future__ import annotations

import torch

import pagedattn.legacy
from pagedattn.legacy import allocate_partials, num_partitions

from . import attention
from . import peers as peerlib
from .common import Case, Ctx, Recorder

NAME = "legacy"
BLOCK_SIZES = (16, 32)
VARIANTS = ("v1", "v2", "auto")
# the decode shapes of issue 4 (the decode suite's list grew with issue 17; legacy keeps these)
SHAPES = ({"B": 1, "ctx": 32768, "kv": "auto"}, {"B": 16, "ctx": 4096, "kv": "auto"},
          {"B": 64, "ctx": 4096, "kv": "auto"}, {"B": 64, "ctx": 4096, "kv": "fp8_e4m3"})
TINY_SHAPES = ({"B": 2, "ctx": 80, "kv": "auto"}, {"B": 3, "ctx": 48, "kv": "fp8_e4m3"})
_MEMO: dict = {"key": None}


def _legacy():
    """The module the cases call (tests put a stand-in here)."""
    return pagedattn.legacy


def cases(ctx: Ctx) -> list[Case]:
    out = []
    shapes = TINY_SHAPES if ctx.tiny else SHAPES
    block_sizes = (16,) if (ctx.quick or ctx.tiny) else BLOCK_SIZES
    dims = attention._dims(ctx)
    for shape in shapes:
        cache = "bf16" if shape["kv"] == "auto" else shape["kv"]
        for bs in block_sizes:
            for variant in VARIANTS:
                params = {"B": shape["B"], "q_len": 1, "ctx": shape["ctx"], "kv_cache_dtype": shape["kv"],
                          "cache": cache, "dtype": "bf16", "layout": "legacy", "variant": variant,
                          **dims, "bs": bs}
                out.append(Case(f"legacy/B{shape['B']}/ctx{shape['ctx']}/{cache}/bs{bs}/{variant}", NAME,
                                params, lambda ctx, rec, p=params: run_case(ctx, rec, p)))
    return out


def to_legacy(kc: torch.Tensor, vc: torch.Tensor):
    """NHD caches [N, bs, H, D] -> legacy K [N, H, D//x, bs, x], V [N, H, D, bs] (fp8 as uint8)."""
    fp8 = kc.dtype in attention.FP8_DTYPES
    k = kc.view(torch.uint8) if fp8 else kc
    v = vc.view(torch.uint8) if fp8 else vc
    n, bs, h, d = k.shape
    x = 16 // k.element_size()
    k_leg = k.reshape(n, bs, h, d // x, x).permute(0, 2, 3, 1, 4).contiguous()
    v_leg = v.permute(0, 2, 3, 1).contiguous()
    return k_leg, v_leg


def _shared(ctx: Ctx, p: dict) -> dict:
    """The data, its legacy layout, the reference and the peers' records of this case's shape and
    block size: made for its first variant, kept for the next ones."""
    key = (p["B"], p["ctx"], p["kv_cache_dtype"], p["bs"], ctx.tiny)
    if _MEMO.get("key") != key:
        _MEMO.clear()
        if ctx.is_cuda:
            torch.cuda.empty_cache()
        kv_bytes = 2 * p["B"] * p["ctx"] * p["hkv"] * p["d"] * (1 if p["kv_cache_dtype"] != "auto" else 2)
        sets = ctx.sets_for(kv_bytes, cap=8)
        data = attention.build(ctx, p, sets)
        _MEMO.update(key=key, data=data, legacy_kv=to_legacy(data.kc, data.vc), ref=attention.reference_out(
            data, causal=False), sets=sets, kv_bytes=kv_bytes, peers={})
    return _MEMO


def run_case(ctx: Ctx, rec: Recorder, p: dict) -> None:
    shared = _shared(ctx, p)
    data, sets, fp8 = shared["data"], shared["sets"], p["kv_cache_dtype"] != "auto"
    rec.work("GB/s", shared["kv_bytes"], "copy")
    rec.extra(sets=sets, partitions=num_partitions(p["ctx"]))
    out = torch.empty(data.B, data.hq, data.d, dtype=torch.bfloat16, device=data.q[0].device)
    legacy = _legacy()
    op = {"v1": legacy.paged_attention_v1, "v2": legacy.paged_attention_v2, "auto": legacy.paged_attention}
    scratch = allocate_partials(out, data.ctx_len) if p["variant"] == "v2" else ()
    opts = {"alibi_slopes": None, "kv_cache_dtype": "fp8" if fp8 else "auto",
            "k_scale": data.k_descale, "v_scale": data.v_descale}

    def fn(k):  # the case's variant on input set k (v2 with its partial-result scratch)
        return op[p["variant"]](out, *scratch, data.q[k], *shared["legacy_kv"], data.hkv, data.scale,
                                data.tables[k], data.seqused, data.bs, data.ctx_len, **opts)

    def check_and_time():  # correctness once, then timing (a failure is the case's error; the peers still run)
        out.fill_(float("nan"))
        picked = fn(0)
        ctx.sync()
        if isinstance(picked, str):  # paged_attention says which one it chose
            rec.extra(picked=picked)
            rec.note(f"auto picked {picked}")
        rec.check_close(out, shared["ref"], attention.TOLERANCE)
        rec.ours(f"legacy {p['variant']}", fn, sets)
    rec.attempt("pagedattn.legacy", check_and_time)

    if not shared["peers"]:  # the peers: measured once per shape and block size
        rec.peer("pagedattn flash", lambda: attention.ours_fn(data), sets)
        if not ctx.is_cuda:
            rec.peer_failed("sdpa cudnn", "needs CUDA")
        else:
            kv_sets = [data.contiguous_kv(s) for s in range(sets)]
            peerlib.fastest_peer(ctx, rec, "sdpa cudnn", peerlib.sdpa_candidates(data, data.q, lambda k: kv_sets[k]),
                                 shared["ref"], sets, context=peerlib.sdpa_backend("cudnn"), methods=("rot",))
        shared["peers"].update(rec.record["peers"])
    else:
        rec.record["peers"].update({name: dict(impl) for name, impl in shared["peers"].items()})
    rec.note("peers measured once per shape and block size, shared by v1/v2/auto")
    if fp8:
        rec.note("sdpa reads a bf16 dequantised copy")
