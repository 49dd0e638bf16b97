"""flash_attn_with_kvcache (FlashAttention's decode API) on the paged kernels: two launches, no host
sync. The write kernel's append mode (kv_write.Appender) puts the new K/V at positions cache_seqlens[b]
... through block_table and writes seqused_k = cache_seqlens + Snew; flash_attn_varlen_func's
implementation then attends over it (cu_seqlens_q a kept arange).

A call whose tensor metadata and scalars repeat a validated call's (one guard check, steady.py) takes
the steady path: allocate seqused_k and out, launch both kernels with the new addresses."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .. import envs
from ..contract import ContractError, describe, traced
from . import attention, kv_write, steady
from .attention import _int32_vector
from .plans import PlanCache

_NOT_YET = {
    "rotary_cos": "rotary embedding: apply it to q and k before the call",
    "rotary_sin": "rotary embedding: apply it to q and k before the call",
    "cache_batch_idx": "cache_batch_idx: index the caches (or the block_table rows) before the call",
    "cache_leftpad": "cache_leftpad",
}
_RANGES = PlanCache()   # _range's tensors
_STEADY = steady.Guards()  # form 0: no new k/v, form 1: with them; each entry's plan is a _Steady
_FULL_WINDOW = (-1, -1)
# stand-ins in a guard's tensors: v_cache is k_cache, v is k, no k_descale, no v_descale, v_descale is k_descale
_V_CACHE_IS_K, _V_IS_K, _NO_K_DESCALE, _NO_V_DESCALE, _V_DESCALE_IS_K = steady.ABSENT[:5]
_is_compiling = steady.is_dynamo_compiling
_debug, _ENVIRON, _DEBUG_KEY = envs.debug, envs.ENVIRON, envs.DEBUG_KEY


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
    # The steady state, in eager, no features: one guard says the tensors have a validated call's
    # metadata, kv_cache_dtype and the scalars are that call's; then two launches with new addresses.
    form = None
    if rotary_cos is None and rotary_sin is None and cache_batch_idx is None and cache_leftpad is None \
            and alibi_slopes is None and s_aux is None and sinks is None and not unsupported and not validate \
            and (window_size is _FULL_WINDOW or window_size.__class__ is tuple and window_size == _FULL_WINDOW) \
            and softcap.__class__ is float and softcap == 0.0 and block_table is not None \
            and isinstance(cache_seqlens, torch.Tensor) and not _is_compiling() \
            and (_DEBUG_KEY not in _ENVIRON or not _debug()):
        form = k is not None
        v_meta = _V_CACHE_IS_K if v_cache is k_cache else v_cache  # a guard takes each tensor once
        descales = (_NO_K_DESCALE if k_descale is None else k_descale,
                    _NO_V_DESCALE if v_descale is None else _V_DESCALE_IS_K if v_descale is k_descale else v_descale)
        meta = (q, k_cache, v_meta, k, _V_IS_K if v is k else v, cache_seqlens, block_table, *descales) if form \
            else (q, k_cache, v_meta, cache_seqlens, block_table, *descales)
        scalars = (softmax_scale, causal, num_splits, return_softmax_lse, max_seqlen_k)
        for check, kv_name, entry in _STEADY.forms[form]:
            if check.check(*meta) and (kv_name is kv_cache_dtype or kv_cache_dtype.__class__ is str and
                                       kv_name == kv_cache_dtype):
                form = None  # known: nothing to remember
                if entry.scalars == scalars and _plain_scalars(scalars):
                    done = entry.call(q, k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale)
                    if done is not None:
                        return done if return_softmax_lse else done[0]
                break
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
        kept = {} if form is not None else None
        out, lse = run(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal,
                       window_size, softcap, alibi_slopes, num_splits, k_descale, v_descale, kv_cache_dtype,
                       sinks, max_seqlen_k, return_softmax_lse, validate, keep=kept)
        if kept:  # a steady-state call whose metadata no guard knew: one does now
            _STEADY.add(form, steady.guard(meta), kv_cache_dtype, _Steady(scalars, q, **kept))
    return (out, lse) if return_softmax_lse else out


def _plain_scalars(scalars) -> bool:
    """The scalars of a steady call are of the types the validated call's were (an equal 1.0 and
    True, or a numpy int, must take the checks)."""
    softmax_scale, causal, num_splits, lse, max_seqlen_k = scalars
    return (softmax_scale is None or type(softmax_scale) is float) and causal.__class__ is bool and \
        type(num_splits) is int and lse.__class__ is bool and (max_seqlen_k is None or type(max_seqlen_k) is int)


class _Steady:
    """A validated call's launches (Appender, attention _Launch) and the tensors it keeps (cu_seqlens_q)."""
    __slots__ = ("scalars", "writer", "plan", "run", "cu_q", "shape", "lse_shape")

    def __init__(self, scalars, q, writer, checked, run, cu_q):
        self.scalars, self.writer, self.plan, self.run, self.cu_q = scalars, writer, checked[0], run, cu_q
        self.shape = tuple(q.shape)
        B, Sq, Hq, _ = self.shape
        self.lse_shape = (Hq, B, Sq)

    def call(self, q, k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale):
        """(out, lse or None); None (nothing launched) where only the full validation can say why."""
        if (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()) & 15:
            return None
        plan = self.plan
        seqused = cache_seqlens
        if self.writer is not None:
            shape = (cache_seqlens.shape[0],)
            seqused = plan.here(shape, (1,), torch.int32) if plan.current() == plan.device else \
                plan.empty(shape, (1,), torch.int32)
            self.writer.launch(k, v, k_cache, v_cache, k_descale, v_descale, cache_seqlens, block_table, seqused)
        # q's 4-D address: the plan's strides are those of its [B * Sq, Hq, D] view
        out, lse = self.run.run(plan, q, k_cache, v_cache, self.cu_q, None, seqused, block_table, None, k_descale,
                                v_descale)
        out = out.view(self.shape)
        return out, None if lse is None else lse.view(self.lse_shape).permute(1, 0, 2)


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
        return_softmax_lse, validate=False, fake=False, keep=None):
    """The implementation, for the eager call, the custom op and (fake=True: checks and output
    metadata only) its fake implementation. Returns (out [B, Sq, Hq, D], lse [B, Hq, Sq] or None).
    keep (a dict): filled with what a _Steady needs, when q and the new k/v are views of their
    flattened forms (the steady path passes their own addresses)."""
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
    # with new tokens the write kernel writes seqused_k (cache_seqlens + Snew) for the attention
    seqused = torch.empty(B, dtype=torch.int32, device=q.device) if s_new else cache_seqlens
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
        ends = cache_seqlens + s_new
        over = (ends > block_table.shape[1] * k_cache.shape[1]).nonzero()
        if over.numel():
            b = int(over[0, 0])
            raise ContractError(f"request {b}: cache_seqlens[{b}] + Snew = {int(ends[b])} exceeds its "
                                f"block_table capacity ({block_table.shape[1]} blocks x {k_cache.shape[1]})")
    writer = None
    if s_new:
        key, value = k.reshape(B * s_new, *shape[2:]), v.reshape(B * s_new, *shape[2:])
        try:
            writer = kv_write.appender(key, value, k_cache, v_cache, cache_seqlens, block_table,
                                       kv_cache_dtype or "auto", k_descale, v_descale, pointers=not fake)
            if validate and not fake:  # the slots the kernel computes, checked against the cache
                kv_write.check_slots(_slots(cache_seqlens, block_table, k_cache.shape[1], s_new,
                                            k_cache.shape[0] * k_cache.shape[1]), k_cache.shape[0] * k_cache.shape[1])
        except ContractError as e:
            raise ContractError(f"appending k/v to the cache: {e}") from None
        if not fake:
            writer.launch(key, value, k_cache, v_cache, k_descale, v_descale, cache_seqlens, block_table, seqused)
        if keep is not None and (key.data_ptr() != k.data_ptr() or value.data_ptr() != v.data_ptr()):
            keep = None  # copies: the steady path could not pass k and v themselves
    if not fake:
        if keep is not None and q_rows.data_ptr() == q.data_ptr():
            keep.update(writer=writer, checked=checked, cu_q=cu_q,
                        run=attention.launch_of(checked, q_rows, k_cache, v_cache, None, Sq, max_seqlen_k,
                                                num_splits, causal, return_softmax_lse))
        out, lse = attention.launch(checked, *attn, causal, block_table, return_softmax_lse, None, num_splits,
                                    k_descale, v_descale)
    out = out.view(B, Sq, Hq, D)
    if lse is not None:
        lse = lse.view(Hq, B, Sq).permute(1, 0, 2)
    return out, lse


def _slots(cache_seqlens, block_table, block_size: int, s_new: int, num_slots: int = 0) -> torch.Tensor:
    """[B * s_new] cache slots of the new tokens (int32; int64 for a cache of num_slots >= 2^31), as
    the write kernel's append mode computes them (validate=True checks them; the tests' reference):
    position cache_seqlens[b] + i goes to slot block_table[b, pos // block_size] * block_size +
    pos % block_size; -1 (skipped) past the row. The slot is written as (entry - block) * block_size + pos."""
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
