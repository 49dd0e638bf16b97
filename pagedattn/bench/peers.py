"""The attention peers, each at its best configuration (perf/README.md says which): a list of candidates
`(variant, factory)`, `factory()` -> fn(k) -> out [total_q, Hq, D] for input set k (or raises). `fastest` runs
each once, rejects those that fail or disagree with the float32 reference, probes the rest (Timer.probe) and
keeps the fastest; the record names it and what each candidate did. FA4 is optional (unavailable: the reason).
"""
from __future__ import annotations

import inspect

import torch.nn.functional as F

from .common import Ctx, Recorder, rel_l2, short_error
from .timing import METHODS

WRONG = 5e-2  # relative L2 above which a candidate's output is wrong (ours passes at 2e-2)
FA4 = "fa4 paged"


def causal_kwargs(q_len: int, k_len: int) -> dict:
    """SDPA's arguments for our causal mask, aligned bottom-right: `is_causal` is top-left aligned, the same
    only when q_len == k_len; shorter queries over a longer history take torch's lower-right bias."""
    if q_len == k_len:
        return {"is_causal": True}
    from torch.nn.attention.bias import causal_lower_right  # noqa: PLC0415

    return {"attn_mask": causal_lower_right(q_len, k_len)}


def sdpa_candidates(data, q_sets, kv_of, repeat: bool = True):
    """SDPA configurations. `kv_of(k)` gives input set k's (K, V) [B, Hkv, L, D]: contiguous copies, or pages
    gathered inside the timing (gather+sdpa: repeat=False). Decode offers enable_gqa ([B, Hq, 1, D]) and the
    group folded into the query length (exact for one query, no mask); prefill enable_gqa and KV repeated to
    Hq heads beforehand."""
    B, sq, hq, hkv, d, scale = data.B, data.q_len, data.hq, data.hkv, data.d, data.scale

    def sdpa(qs, out_shape, kv=kv_of, transpose=False, **kw):
        def factory():
            def fn(k):
                o = F.scaled_dot_product_attention(qs[k], *kv(k), scale=scale, **kw)
                return (o.transpose(1, 2) if transpose else o).reshape(out_shape)
            return fn
        return factory
    if sq == 1:
        return [("enable_gqa", sdpa([q.view(B, hq, 1, d) for q in q_sets], (B, hq, d), enable_gqa=True)),
                ("gqa folded into q_len", sdpa([q.view(B, hkv, hq // hkv, d) for q in q_sets], (B, hq, d)))]
    qp = [q.view(B, sq, hq, d).transpose(1, 2).contiguous() for q in q_sets]
    causal = causal_kwargs(sq, data.ctx_len) if data.causal else {}
    out = [("enable_gqa", sdpa(qp, (B * sq, hq, d), transpose=True, enable_gqa=True, **causal))]
    if repeat:
        def repeated():
            kv = [[x.repeat_interleave(hq // hkv, dim=1) for x in kv_of(k)] for k in range(len(q_sets))]
            return sdpa(qp, (B * sq, hq, d), kv=lambda k: kv[k], transpose=True, **causal)()
        out.append(("kv repeated to Hq heads (outside timing)", repeated))
    return out


def fa4_candidates(data):
    """flash_attn.cute.flash_attn_varlen_func over our paged cache; raises ImportError without it."""
    from flash_attn.cute import flash_attn_varlen_func as fa4  # noqa: PLC0415 - optional peer

    params = inspect.signature(fa4).parameters
    if "page_table" not in params:
        raise ImportError("this flash_attn.cute.flash_attn_varlen_func has no page_table argument")
    any_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())

    def make(num_splits: int):
        kw = {k: v for k, v in {"cu_seqlens_q": data.cu_q, "max_seqlen_q": data.q_len, "max_seqlen_k": data.ctx_len,
                                "seqused_k": data.seqused, "softmax_scale": data.scale, "causal": data.causal,
                                "num_splits": num_splits}.items() if any_kw or k in params}

        def fn(k):
            res = fa4(data.q[k], data.kc, data.vc, page_table=data.tables[k], **kw)
            return res[0] if isinstance(res, (tuple, list)) else res
        return lambda: fn
    return [("paged, num_splits=0 (its heuristic)", make(0)), ("paged, num_splits=1", make(1))]


def fastest(ctx: Ctx, candidates, ref, info: dict, sets: int = 1):
    """The fastest candidate whose output matches `ref` (off CUDA: the first that runs); `info` gets variant,
    rel_l2 and candidates (what each did). Raises RuntimeError when none can run."""
    tried, best = [], None
    for variant, factory in candidates:
        try:
            fn = factory()
            out = fn(0)
            ctx.sync()
            err = rel_l2(out, ref) if ref is not None else None
            del out
            if err is not None and not err <= WRONG:
                tried.append(f"{variant}: wrong output (relative L2 {err:.2e})")
                continue
            us = ctx.timer.probe(fn, sets) if ctx.is_cuda else None
        except Exception as exc:  # noqa: BLE001 - a configuration that cannot run is data
            tried.append(f"{variant}: {short_error(exc, 200)}")
            continue
        tried.append(f"{variant}: {us:.1f} us" if us is not None else f"{variant}: runs")
        if best is None or (us is not None and us < best[0]):
            best = (us if us is not None else 0.0, variant, fn, err)
        if not ctx.is_cuda:
            break
    info["candidates"] = "; ".join(tried)
    if best is None:
        raise RuntimeError(info["candidates"])
    _, info["variant"], fn, info["rel_l2"] = best
    return fn


def fastest_peer(ctx: Ctx, rec: Recorder, name: str, candidates, ref, sets: int, context=None) -> None:
    """Time peer `name` at its fastest correct configuration (`fastest` of `candidates()`, which may raise: the
    peer is unavailable); the record names it."""
    info: dict = {}
    impl = rec.peer(name, lambda: fastest(ctx, candidates(), ref, info, sets), sets, context=context,
                    methods=METHODS)
    if not impl.get("error"):
        impl.update({k: v for k, v in info.items() if v is None or isinstance(v, (str, int, float))})


def torch_peers(ctx: Ctx, rec: Recorder, data, ref, sets: int, fa4: bool = True) -> None:
    """cuDNN and flash SDPA on unpaged copies, SDPA after a gather of the pages, and with `fa4` FA4 on our
    paged cache (unavailable when flash_attn.cute does not import: the error); all but the gather need CUDA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kv_sets = [data.contiguous_kv(s) for s in range(sets)]
    unpaged = sdpa_candidates(data, data.q, lambda k: kv_sets[k])
    gathered = [(f"gather then sdpa {variant}, default backend", factory)
                for variant, factory in sdpa_candidates(data, data.q, data.gathered_kv, repeat=False)]
    peers = [("sdpa cudnn", lambda: unpaged, lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION])),
             ("sdpa flash", lambda: unpaged, lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION])),
             ("gather+sdpa", lambda: gathered, None)] + ([(FA4, lambda: fa4_candidates(data), None)] if fa4 else [])
    for name, candidates, context in peers:
        if name != "gather+sdpa" and not ctx.is_cuda:
            rec.peer_failed(name, "needs CUDA")
        else:
            fastest_peer(ctx, rec, name, candidates, ref, sets, context=context)
