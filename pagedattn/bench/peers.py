"""The attention peers, each at its best configuration (perf/README.md says which configurations).

A peer is a list of candidates `(variant, factory)`; `factory()` returns fn(k) -> out [total_q, Hq, D] for
input set k, or raises. `fastest` runs each once, rejects those that fail or disagree with the float32
reference, probes the rest (Timer.probe) and keeps the fastest; the record names the variant chosen
and what each candidate did. FA4 is optional: when it does not import, the peer is reported as
unavailable with the reason.
"""
from __future__ import annotations

import inspect

import torch.nn.functional as F

from .common import Ctx, Recorder, rel_l2, short_error
from .timing import METHODS

WRONG = 5e-2  # relative L2 above which a candidate's output is wrong (ours passes at 2e-2)
FA4 = "fa4 paged"


# -- SDPA on contiguous KV -------------------------------------------------------------------------
def causal_kwargs(q_len: int, k_len: int) -> dict:
    """SDPA's arguments for our causal mask, aligned bottom-right: `is_causal` is top-left aligned, the
    same only when q_len == k_len; shorter queries over a longer history take torch's lower-right bias."""
    if q_len == k_len:
        return {"is_causal": True}
    from torch.nn.attention.bias import causal_lower_right  # noqa: PLC0415

    return {"attn_mask": causal_lower_right(q_len, k_len)}


def sdpa_candidates(data, q_sets, kv_of, repeat: bool = True):
    """SDPA configurations for the current backend. `kv_of(k)` gives input set k's (K, V) [B, Hkv, L, D]:
    contiguous copies, or pages gathered inside the timing (gather+sdpa: then repeat=False, no KV
    repeated to Hq heads beforehand). Decode offers enable_gqa and the group folded into the query
    length (exact for one query token, no causal mask); prefill enable_gqa and KV repeated to Hq heads."""
    B, sq, hq, hkv, d, g = data.B, data.q_len, data.hq, data.hkv, data.d, data.hq // data.hkv
    scale = data.scale
    if sq == 1:
        def gqa():
            qg = [q.view(B, hq, 1, d) for q in q_sets]

            def fn(k):
                o = F.scaled_dot_product_attention(qg[k], *kv_of(k), scale=scale, enable_gqa=True)
                return o.reshape(B, hq, d)
            return fn

        def folded():
            qf = [q.view(B, hkv, g, d) for q in q_sets]

            def fn(k):
                o = F.scaled_dot_product_attention(qf[k], *kv_of(k), scale=scale)
                return o.reshape(B, hq, d)
            return fn
        return [("enable_gqa", gqa), ("gqa folded into q_len", folded)]
    qp = [q.view(B, sq, hq, d).transpose(1, 2).contiguous() for q in q_sets]
    causal = causal_kwargs(sq, data.ctx_len)

    def gqa_prefill():
        def fn(k):
            o = F.scaled_dot_product_attention(qp[k], *kv_of(k), scale=scale, enable_gqa=True, **causal)
            return o.transpose(1, 2).reshape(B * sq, hq, d)
        return fn

    def repeated():
        kv = [[x.repeat_interleave(g, dim=1) for x in kv_of(k)] for k in range(len(q_sets))]

        def fn(k):
            o = F.scaled_dot_product_attention(qp[k], *kv[k], scale=scale, **causal)
            return o.transpose(1, 2).reshape(B * sq, hq, d)
        return fn
    candidates = [("enable_gqa", gqa_prefill)]
    return candidates + [("kv repeated to Hq heads (outside timing)", repeated)] if repeat else candidates


# -- FA4 on the paged cache ---------------------------------------------------------------
def _only_known(fn, kwargs: dict) -> dict:
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def fa4_candidates(data):
    """flash_attn.cute.flash_attn_varlen_func over our paged cache; raises ImportError without it."""
    from flash_attn.cute import flash_attn_varlen_func as fa4  # noqa: PLC0415 - optional peer

    if "page_table" not in inspect.signature(fa4).parameters:
        raise ImportError("this flash_attn.cute.flash_attn_varlen_func has no page_table argument")

    def make(num_splits: int):
        def factory():
            kw = _only_known(fa4, {"cu_seqlens_q": data.cu_q, "max_seqlen_q": data.q_len,
                                   "max_seqlen_k": data.ctx_len, "seqused_k": data.seqused,
                                   "softmax_scale": data.scale, "causal": True, "num_splits": num_splits})

            def fn(k):
                res = fa4(data.q[k], data.kc, data.vc, page_table=data.tables[k], **kw)
                return res[0] if isinstance(res, (tuple, list)) else res
            return fn
        return factory
    return [("paged, num_splits=0 (its heuristic)", make(0)), ("paged, num_splits=1", make(1))]


# -- choosing -------------------------------------------------------------------------------------
def fastest(ctx: Ctx, candidates, ref, info: dict, sets: int = 1):
    """The fastest candidate whose output matches `ref` (any that runs, off CUDA); `info` gets
    variant, rel_l2 and candidates (what each did). Raises RuntimeError when none can run."""
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
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            tried.append(f"{variant}: {type(exc).__name__}: {first}")
            continue
        tried.append(f"{variant}: {us:.1f} us" if us is not None else f"{variant}: runs")
        if best is None or (us is not None and us < best[0]):
            best = (us if us is not None else 0.0, variant, fn, err)
        if not ctx.is_cuda:
            break  # no timing to compare: the first that runs
    info["candidates"] = "; ".join(tried)
    if best is None:
        raise RuntimeError(info["candidates"])
    _, info["variant"], fn, info["rel_l2"] = best
    return fn


# -- running the peers of a case ------------------------------------------------------------------
def sdpa_backend(name: str):
    """A context factory: SDPA inside it runs on backend `name` (cudnn, flash)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[name]
    return lambda: sdpa_kernel([backend])


def fastest_peer(ctx: Ctx, rec: Recorder, name: str, candidates, ref, sets: int, context=None,
                 methods=METHODS) -> None:
    """Time peer `name` at its fastest correct configuration (peers.fastest); the record names it."""
    info: dict = {}
    impl = rec.peer(name, lambda: fastest(ctx, candidates, ref, info, sets), sets, context=context,
                    methods=methods)
    if not impl.get("error"):
        impl.update({k: v for k, v in info.items() if v is None or isinstance(v, (str, int, float))})


def torch_peers(ctx: Ctx, rec: Recorder, data, ref, sets: int) -> None:
    """cuDNN and flash SDPA on unpaged copies (CUDA only), and SDPA after a gather of the pages."""
    kv_sets = [data.contiguous_kv(s) for s in range(sets)]
    for backend in ("cudnn", "flash"):
        if not ctx.is_cuda:
            rec.peer_failed(f"sdpa {backend}", "needs CUDA")
            continue
        fastest_peer(ctx, rec, f"sdpa {backend}", sdpa_candidates(data, data.q, lambda k: kv_sets[k]),
                     ref, sets, context=sdpa_backend(backend))
    gather = [(f"gather then sdpa {variant}, default backend", factory) for variant, factory
              in sdpa_candidates(data, data.q, data.gathered_kv, repeat=False)]
    fastest_peer(ctx, rec, "gather+sdpa", gather, ref, sets)


def fa4_peer(ctx: Ctx, rec: Recorder, data, ref, sets: int) -> None:
    """FA4 on our paged cache, when flash_attn.cute imports."""
    if not ctx.is_cuda:
        return rec.peer_failed(FA4, "needs CUDA")
    try:
        cands = fa4_candidates(data)
    except Exception as exc:  # noqa: BLE001 - ImportError, or the package breaks on import
        return rec.peer_failed(FA4, f"not available: {short_error(exc, 300)}")
    fastest_peer(ctx, rec, FA4, cands, ref, sets)
