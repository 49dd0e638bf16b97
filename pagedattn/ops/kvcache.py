"""flash_attn_with_kvcache (FlashAttention's decode API) on the paged kernels: new K/V appended by
reshape_and_cache_flash, attention by flash_attn_varlen_func's implementation. Everything the two
need (slot_mapping, seqused_k, cu_seqlens_q) is built on the GPU from cache_seqlens and block_table,
without a host sync."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..contract import ContractError, describe, traced
from . import attention, kv_write
from .attention import _int32_vector
from .plans import PlanCache

_NOT_YET = {
    "rotary_cos": "rotary embedding: apply it to q and k before the call",
    "rotary_sin": "rotary embedding: apply it to q and k before the call",
    "cache_batch_idx": "cache_batch_idx: index the caches (or the block_table rows) before the call",
    "cache_leftpad": "cache_leftpad",
}
_RANGES = PlanCache()   # _range's tensors


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, k_descale=None, v_descale=None, kv_cache_dtype=None,
                            s_aux=None, sinks=None, max_seqlen_k=None, validate: bool = False, **unsupported):
    """FlashAttention's flash_attn_with_kvcache (FA2's argument order) over a paged cache.

    q [B, Sq, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D] (NHD or HND) with block_table
    int32 [B, max_blocks], or [B, S_cache, Hkv, D] without one (one block per request). cache_seqlens:
    int or int32 [B], the keys already cached (None: the whole capacity). k, v [B, Snew, Hkv, D]:
    appended at positions cache_seqlens[b] ... + Snew - 1 through block_table (positions past a row's
    capacity are dropped; validate=True names them), then attention over cache_seqlens + Snew keys,
    causal bottom-right aligned. Returns out [B, Sq, Hq, D], or (out, lse [B, Hq, Sq]).

    window_size, softcap, alibi_slopes, sinks (s_aux), num_splits: as flash_attn_varlen_func.
    pagedattn keywords: fp8 caches take k_descale / v_descale (also the write's scales) and
    kv_cache_dtype; max_seqlen_k (int, default the block table's capacity) bounds every request's
    keys and fixes the split plan. Rotary embedding, cache_batch_idx and cache_leftpad raise
    NotImplementedError. Under torch.compile: torch.ops.pagedattn.flash_attn_with_kvcache.
    """
    for name, given in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                        ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if given is not None:
            raise NotImplementedError(f"pagedattn.flash_attn_with_kvcache does not support {_NOT_YET[name]}")
    if unsupported:
        attention.check_unsupported(unsupported, "flash_attn_with_kvcache")
    if s_aux is not None and sinks is not None:
        raise ContractError("give the sink logits once: s_aux (vLLM's name) or sinks, not both")
    sinks = s_aux if s_aux is not None else sinks
    block_table, cache_seqlens, max_seqlen_k = prepare(q, k_cache, k, v, cache_seqlens, block_table, max_seqlen_k)
    if torch.compiler.is_compiling() or traced(q):
        out, lse = torch.ops.pagedattn.flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, bool(causal),
            list(window_size) if window_size is not None else [-1, -1], float(softcap), alibi_slopes,
            num_splits, k_descale, v_descale, kv_cache_dtype, sinks, max_seqlen_k)
    else:
        out, lse = run(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal,
                       window_size, softcap, alibi_slopes, num_splits, k_descale, v_descale, kv_cache_dtype,
                       sinks, max_seqlen_k, return_softmax_lse, validate)
    return (out, lse) if return_softmax_lse else out


def prepare(q, k_cache, k, v, cache_seqlens, block_table, max_seqlen_k):
    """The arguments FlashAttention lets one leave out, made explicit (no sync): (block_table,
    cache_seqlens int32 [B], max_seqlen_k)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ContractError(f"q must be a 4-D tensor [B, Sq, Hq, D], got {describe(q)}")
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        raise ContractError(f"k_cache must be a 4-D tensor [num_blocks, block_size, Hkv, D] (with a block_table) "
                            f"or [B, S_cache, Hkv, D], got {describe(k_cache)}")
    B = q.shape[0]
    if block_table is None:  # a contiguous cache: request b owns block b, of S_cache slots
        if k_cache.shape[0] != B:
            raise ContractError(f"without a block_table, k_cache [B, S_cache, Hkv, D] needs B = {B} rows (q's "
                                f"batch), got shape {tuple(k_cache.shape)}")
        block_table = _range(q.device, B, 1).view(B, 1)
    elif not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
        raise ContractError(f"block_table must be an int32 [B, max_blocks_per_seq] tensor, got {describe(block_table)}")
    capacity = block_table.shape[1] * k_cache.shape[1]
    if (k is None) != (v is None):
        raise ContractError("give both k and v (the new tokens) or neither")
    if isinstance(cache_seqlens, bool):
        raise ContractError(f"cache_seqlens must be an int or an int32 [B] tensor, got {cache_seqlens!r}")
    if cache_seqlens is None:
        if k is not None:
            raise ContractError("appending k/v needs cache_seqlens (where each request's new tokens go)")
        cache_seqlens = torch.full((B,), capacity, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= capacity:
            raise ContractError(f"cache_seqlens={cache_seqlens} is outside [0, {capacity}] (the cache capacity)")
        cache_seqlens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=q.device)
    if max_seqlen_k is None:
        max_seqlen_k = capacity
    return block_table, cache_seqlens, max_seqlen_k


def _range(device, count: int, step: int, dtype=torch.int32) -> torch.Tensor:
    """[0, step, 2 * step, ...] of `count` entries, kept per (device, count, step, dtype) when built
    outside capture and compilation (a tensor made during capture holds nothing until replay)."""
    def build():
        if step == 0:
            return torch.zeros(count, dtype=dtype, device=device)
        return torch.arange(0, count * step, step, dtype=dtype, device=device)

    if torch.compiler.is_compiling():  # traced: a graph input would be a guarded constant
        return build()
    key = (device, count, step, dtype)
    hit = _RANGES.get(key)
    if hit is None:
        hit = build()
        if not isinstance(hit, FakeTensor) and not (hit.is_cuda and torch.cuda.is_current_stream_capturing()):
            _RANGES.remember(key, hit)
    return hit


def run(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, window_size, softcap,
        alibi_slopes, num_splits, k_descale, v_descale, kv_cache_dtype, sinks, max_seqlen_k,
        return_softmax_lse, validate=False, fake=False):
    """The implementation, for the eager call, the custom op and (fake=True: checks and output
    metadata only) its fake implementation. Returns (out [B, Sq, Hq, D], lse [B, Hq, Sq] or None)."""
    B, Sq, Hq, D = q.shape
    _int32_vector("cache_seqlens", cache_seqlens, q, "[B]")
    if cache_seqlens.shape[0] != B:
        raise ContractError(f"cache_seqlens has {cache_seqlens.shape[0]} entries, q's batch is {B}")
    s_new = 0
    if k is not None:
        shape = (B, k.shape[1] if k.dim() == 4 else -1, k_cache.shape[2], k_cache.shape[3])
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or tuple(t.shape) != shape:
                raise ContractError(f"{name} (the new tokens) must be [B, Snew, Hkv, D] = {list(shape)} like the "
                                    f"cache, got {describe(t)}")
        s_new = shape[1]
    seqused = cache_seqlens + s_new if s_new else cache_seqlens
    q_rows = q.reshape(B * Sq, Hq, D)
    # the fake implementation needs only metadata: empty tensors of the same shapes and dtypes
    cu_q = torch.empty(B + 1, dtype=torch.int32, device=q.device) if fake else _range(q.device, B + 1, Sq)
    attn = (q_rows, k_cache, v_cache, Sq, cu_q, max_seqlen_k, None, seqused)
    flags = (softmax_scale, causal, block_table, None, num_splits, k_descale, v_descale, kv_cache_dtype,
             window_size, softcap, alibi_slopes, sinks)
    # every check of the attention comes first: nothing is written when the call is refused
    if fake:
        out, lse = attention.fake_attend(*attn, softmax_scale, causal, block_table, return_softmax_lse, None,
                                         *flags[4:])
    else:
        checked = attention.check_call(*attn, *flags, validate)
    if validate and not fake:
        over = (seqused > block_table.shape[1] * k_cache.shape[1]).nonzero()
        if over.numel():
            b = int(over[0, 0])
            raise ContractError(f"request {b}: cache_seqlens[{b}] + Snew = {int(seqused[b])} exceeds its "
                                f"block_table capacity ({block_table.shape[1]} blocks x {k_cache.shape[1]})")
    if s_new:
        key, value = k.reshape(B * s_new, *shape[2:]), v.reshape(B * s_new, *shape[2:])
        slots = torch.empty(B * s_new, dtype=torch.int64, device=q.device) if fake else \
            _slots(cache_seqlens, block_table, k_cache.shape[1], s_new, k_cache.shape[0] * k_cache.shape[1])
        try:
            if fake:
                kv_write.check_metadata(key, value, k_cache, v_cache, slots, kv_cache_dtype or "auto", k_descale,
                                        v_descale, pointers=False)
            else:
                kv_write.reshape_and_cache_flash(key, value, k_cache, v_cache, slots, kv_cache_dtype or "auto",
                                                 k_descale, v_descale, validate=validate)
        except ContractError as e:
            raise ContractError(f"appending k/v to the cache: {e}") from None
    if not fake:
        out, lse = attention.launch(checked, *attn, causal, block_table, return_softmax_lse, None, num_splits,
                                    k_descale, v_descale)
    out = out.view(B, Sq, Hq, D)
    if lse is not None:
        lse = lse.view(Hq, B, Sq).permute(1, 0, 2)
    return out, lse


def _slots(cache_seqlens, block_table, block_size: int, s_new: int, num_slots: int = 0) -> torch.Tensor:
    """[B * s_new] cache slots of the new tokens (int32; int64 for a cache of num_slots >= 2^31):
    position cache_seqlens[b] + i goes to slot block_table[b, pos // block_size] * block_size +
    pos % block_size; -1 (skipped) past the row. Eight tensor ops for one token per request (each
    costs a launch on the GPU): the slot is written as (entry - block) * block_size + pos."""
    width = block_table.shape[1]
    if width == 0:
        raise ContractError("block_table has no columns: there is nowhere to append k/v")
    pos = cache_seqlens[:, None]
    if s_new > 1:
        pos = pos + _range(cache_seqlens.device, s_new, 1)  # [B, s_new]
    if num_slots >= 2**31:
        pos = pos.long()
    # torch functions, not operators: Tensor.__floordiv__ and friends are Python wrappers
    blk = torch.div(pos, block_size, rounding_mode="floor")
    slots = torch.add(pos, torch.sub(block_table.gather(1, blk.clamp(0, width - 1).long()), blk), alpha=block_size)
    return torch.where(torch.lt(blk, width), slots, -1).view(-1)
