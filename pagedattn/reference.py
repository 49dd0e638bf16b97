"""Pure-torch references (CPU or GPU): the oracles for tests. Written for clarity, not speed, and
independent of every kernel in this package."""
from __future__ import annotations

import torch

from .dtypes import FP8_MAX, NAME_TO_TORCH, normalize_kv_cache_dtype


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """saturate_to_finite(x / scale) in the fp8 format; `scale` broadcasts over x's last dims."""
    fmax = FP8_MAX[kv_cache_dtype]
    return (x.float() / scale).clamp(-fmax, fmax).to(NAME_TO_TORCH[kv_cache_dtype])


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto",
                            k_scale=None, v_scale=None) -> None:
    """Same signature and semantics as pagedattn.reshape_and_cache_flash, in plain torch."""
    kv_cache_dtype = normalize_kv_cache_dtype(kv_cache_dtype)
    slots = slot_mapping.long()
    keep = slots >= 0                       # slot < 0: padding, no destination
    tokens = torch.arange(slots.numel(), device=slots.device)[keep]
    block, offset = slots[keep] // key_cache.shape[1], slots[keep] % key_cache.shape[1]
    for src, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        x = src[tokens.to(src.device)]                       # [n, H, D]
        if kv_cache_dtype == "auto":
            cache[block, offset] = x.to(cache.dtype)
            continue
        q = quantize_fp8(x, scale.float().reshape(-1, 1), kv_cache_dtype)  # [1] or [H] scales
        cache[block, offset] = q.view(torch.uint8) if cache.dtype == torch.uint8 else q


def _descale_for(t, b: int, num_kv_heads: int) -> torch.Tensor:
    """[Hkv] factors of request b from a [1], [Hkv] or [B, Hkv] descale tensor."""
    t = t.float()
    if t.numel() == 1:
        return t.reshape(1).expand(num_kv_heads)
    return t[b] if t.dim() == 2 else t.reshape(num_kv_heads)


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, length: int, kv_cache_dtype: str = "auto",
              descale: torch.Tensor | None = None) -> torch.Tensor:
    """Logical keys 0..length-1 of one request as a float32 [length, Hkv, D] tensor, read through the
    block table; fp8 values are dequantised with `descale` ([Hkv] factors)."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_table_row.to(cache.device).long()[pos // block_size]
    x = cache[blocks, pos % block_size]  # [length, Hkv, D]
    if kv_cache_dtype not in (None, "auto") or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        name = normalize_kv_cache_dtype(kv_cache_dtype) if kv_cache_dtype not in (None, "auto") else \
            ("fp8_e4m3" if x.dtype == torch.float8_e4m3fn else "fp8_e5m2")
        x = x.view(NAME_TO_TORCH[name]) if x.dtype == torch.uint8 else x
        return x.float() * descale.float().reshape(1, -1, 1)
    return x.float()


def attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                   compute_dtype=torch.float32, window_size=(-1, -1), softcap: float = 0.0,
                   alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None):
    """One request: q [L, Hq, D], k/v [K, Hkv, D] -> (out [L, Hq, D] float, lse [Hq, L]).
    FlashAttention's semantics. Query i sits at bottom-right-aligned position p = K - L + i and sees
    keys j with p - left <= j <= p + right (window_size (left, right), -1 = unbounded; causal: right
    0). Scores: s = q.k * scale, then softcap * tanh(s / softcap) (softcap > 0), then
    - slope[h] * |p - j| (alibi_slopes [Hq]); sinks [Hq]: one extra logit per head in the softmax
    denominator only (the LSE includes it). Rows that see no key: out 0, lse -inf (or the sink)."""
    L, Hq, D = q.shape
    K, Hkv = k.shape[0], k.shape[1]
    group = Hq // Hkv
    qf = q.to(compute_dtype).transpose(0, 1)                                    # [Hq, L, D]
    kf = k.to(compute_dtype).repeat_interleave(group, dim=1).transpose(0, 1)    # [Hq, K, D]
    vf = v.to(compute_dtype).repeat_interleave(group, dim=1).transpose(0, 1)
    s = qf @ kf.transpose(1, 2)                                                 # [Hq, L, K]
    s = (s.float() if s.dtype in (torch.float16, torch.bfloat16) else s) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    pos = (K - L + torch.arange(L, device=q.device)).view(L, 1)                  # query positions
    j = torch.arange(K, device=q.device).view(1, K)
    if alibi_slopes is not None:
        s = s - alibi_slopes.to(s.dtype).view(Hq, 1, 1) * (pos - j).abs().to(s.dtype)
    left, right = window_size
    visible = torch.ones(L, K, dtype=torch.bool, device=q.device)
    if causal:
        visible &= j <= pos
    elif right >= 0:
        visible &= j <= pos + right
    if left >= 0:
        visible &= j >= pos - left
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # the sink joins the denominator as one more logit with no value row
        sink = sinks.to(s.dtype).view(Hq, 1, 1).expand(Hq, L, 1)
        lse = torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1)             # [Hq, L]
    else:
        lse = torch.logsumexp(s, dim=-1)                                        # [Hq, L]
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)                        # empty rows -> 0
    out = (p.to(compute_dtype) @ vf).float().transpose(0, 1)                    # [L, Hq, D]
    return out, lse.float()


def _slopes_for(alibi_slopes, b: int):
    """[Hq] ALiBi slopes of request b from [Hq] or [B, Hq]."""
    if alibi_slopes is None:
        return None
    return alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes


def paged_attention(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, causal=False,
                    softmax_scale=None, kv_cache_dtype="auto", k_descale=None, v_descale=None,
                    return_lse=False, compute_dtype=torch.float32, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, sinks=None):
    """Attention of packed varlen queries over a paged cache, K/V read through block_table.
    Returns out [total_q, Hq, D] (float32) and, with return_lse, lse [Hq, total_q] (natural log).
    window_size, softcap, alibi_slopes ([Hq] or [B, Hq]) and sinks ([Hq]): see attention_rows."""
    total_q, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    scale = softmax_scale if softmax_scale is not None else D ** -0.5
    out = torch.zeros(total_q, Hq, D, dtype=torch.float32, device=q.device)
    lse = torch.full((Hq, total_q), float("-inf"), dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.tolist()
    lens = seqused_k.tolist()
    for b in range(len(cu) - 1):
        q0, q1 = cu[b], cu[b + 1]
        if q1 == q0:
            continue
        feats = dict(window_size=window_size, softcap=softcap, alibi_slopes=_slopes_for(alibi_slopes, b),
                     sinks=sinks)
        kd = _descale_for(k_descale, b, Hkv) if k_descale is not None else None
        vd = _descale_for(v_descale, b, Hkv) if v_descale is not None else None
        k = gather_kv(k_cache, block_table[b], lens[b], kv_cache_dtype, kd)
        v = gather_kv(v_cache, block_table[b], lens[b], kv_cache_dtype, vd)
        o, s = attention_rows(q[q0:q1], k, v, scale, causal, compute_dtype, **feats)
        out[q0:q1] = o
        lse[:, q0:q1] = s
    return (out, lse) if return_lse else out


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, softmax_scale=None,
                     return_lse=False, compute_dtype=torch.float32, window_size=(-1, -1), softcap=0.0,
                     alibi_slopes=None, sinks=None):
    """Same as paged_attention for contiguous varlen K/V [total_k, Hkv, D]."""
    total_q, Hq, D = q.shape
    scale = softmax_scale if softmax_scale is not None else D ** -0.5
    out = torch.zeros(total_q, Hq, D, dtype=torch.float32, device=q.device)
    lse = torch.full((Hq, total_q), float("-inf"), dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        if cq[b + 1] == cq[b]:
            continue
        o, s = attention_rows(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]].float(), v[ck[b]:ck[b + 1]].float(),
                              scale, causal, compute_dtype, window_size=window_size, softcap=softcap,
                              alibi_slopes=_slopes_for(alibi_slopes, b), sinks=sinks)
        out[cq[b]:cq[b + 1]] = o
        lse[:, cq[b]:cq[b + 1]] = s
    return (out, lse) if return_lse else out
