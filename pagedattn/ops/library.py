"""torch.library custom ops: torch.ops.pagedattn.{reshape_and_cache_flash, flash_attn_varlen_func (and
its .out overload), flash_attn_with_kvcache}.

Each op runs the same implementation as its public function, and its fake implementation runs the same
metadata checks (with pointers=False: fake tensors have no data), so a traced call fails at trace
time with the eager ContractError. torch.compile traces the public functions into these ops; in eager
the public functions skip the dispatcher (host cost: perf/launch_overhead.py measures both).

The varlen op always returns (out, lse): lse costs one float per query row and head, and a fixed
schema keeps the fake and real outputs alike. Schemas carry no defaults: the public functions fill
them in. PAGEDATTN_DEBUG still adds the value checks (syncs) inside the real ops; validate= does not
exist here.

Registration is `torch.library.Library.define` with the schema inferred from each function's
annotations (torch.library.infer_schema, as custom_op does) and the function itself as the
CompositeExplicitAutograd kernel: the dispatcher calls it directly. torch.library.custom_op would wrap
it in Python autograd, redispatch, Dynamo-disable and output-alias layers, about 40 µs a call (the ops
have no autograd formula either way). The mutating ops bump their outputs' version counters
themselves, as custom_op's ADInplaceOrView kernel would.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from . import attention, kv_write, kvcache

_LIB = torch.library.Library("pagedattn", "FRAGMENT")


def _op(name: str, mutates_args: tuple = ()):
    """Define torch.ops.pagedattn.<name> (`name` may carry an overload: "op.out") from the decorated
    function's annotations, with the function as its kernel."""
    def register(fn):
        _LIB.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args))
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        return fn
    return register


def _fake(name: str):
    return torch.library.register_fake(f"pagedattn::{name}", lib=_LIB)


def _bump(*mutated: Tensor) -> None:
    for t in mutated:
        torch.autograd.graph.increment_version(t)


@_op("reshape_and_cache_flash", mutates_args=("key_cache", "value_cache"))
def reshape_and_cache_flash(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                            slot_mapping: Tensor, kv_cache_dtype: str, k_scale: Optional[Tensor],
                            v_scale: Optional[Tensor]) -> None:
    kv_write.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                     k_scale, v_scale)
    _bump(key_cache, value_cache)


@_fake("reshape_and_cache_flash")
def _(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    kv_write.check_metadata(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale,
                            v_scale, pointers=False)


@_op("flash_attn_varlen_func")
def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, max_seqlen_q: int, cu_seqlens_q: Tensor,
                           max_seqlen_k: int, cu_seqlens_k: Optional[Tensor], seqused_k: Optional[Tensor],
                           softmax_scale: Optional[float], causal: bool, block_table: Optional[Tensor],
                           num_splits: int, k_descale: Optional[Tensor], v_descale: Optional[Tensor],
                           kv_cache_dtype: Optional[str], window_size: Sequence[int], softcap: float,
                           alibi_slopes: Optional[Tensor], sinks: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    # the public function: its steady path, then attend
    return attention.flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k,
                                            seqused_k, softmax_scale, causal, block_table, True, None, num_splits,
                                            k_descale, v_descale, kv_cache_dtype, tuple(window_size), softcap,
                                            alibi_slopes, None, sinks)


@_fake("flash_attn_varlen_func")
def _(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, seqused_k, softmax_scale, causal,
      block_table, num_splits, k_descale, v_descale, kv_cache_dtype, window_size, softcap, alibi_slopes, sinks):
    return attention.fake_attend(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, seqused_k,
                                 softmax_scale, causal, block_table, True, None, num_splits, k_descale,
                                 v_descale, kv_cache_dtype, tuple(window_size), softcap, alibi_slopes, sinks)


@_op("flash_attn_varlen_func.out", mutates_args=("out",))
def flash_attn_varlen_func_out(q: Tensor, k: Tensor, v: Tensor, max_seqlen_q: int, cu_seqlens_q: Tensor,
                               max_seqlen_k: int, cu_seqlens_k: Optional[Tensor], seqused_k: Optional[Tensor],
                               softmax_scale: Optional[float], causal: bool, block_table: Optional[Tensor],
                               num_splits: int, k_descale: Optional[Tensor], v_descale: Optional[Tensor],
                               kv_cache_dtype: Optional[str], window_size: Sequence[int], softcap: float,
                               alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], out: Tensor) -> Tensor:
    lse = attention.flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k,
                                           seqused_k, softmax_scale, causal, block_table, True, out, num_splits,
                                           k_descale, v_descale, kv_cache_dtype, tuple(window_size), softcap,
                                           alibi_slopes, None, sinks)[1]
    _bump(out)
    return lse


@_fake("flash_attn_varlen_func.out")
def _(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, seqused_k, softmax_scale, causal,
      block_table, num_splits, k_descale, v_descale, kv_cache_dtype, window_size, softcap, alibi_slopes, sinks,
      out):
    return attention.fake_attend(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, seqused_k,
                                 softmax_scale, causal, block_table, True, out, num_splits, k_descale,
                                 v_descale, kv_cache_dtype, tuple(window_size), softcap, alibi_slopes, sinks)[1]


def varlen_op(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, seqused_k, softmax_scale,
              causal, block_table, return_softmax_lse, out, num_splits, k_descale, v_descale, kv_cache_dtype,
              window_size, softcap, alibi_slopes, sinks):
    """flash_attn_varlen_func's traced path: the op (its .out overload when out is given), returning what
    the public function returns."""
    args = (q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, seqused_k, softmax_scale,
            bool(causal), block_table, num_splits, k_descale, v_descale, kv_cache_dtype,
            list(window_size) if window_size is not None else [-1, -1], float(softcap), alibi_slopes, sinks)
    if out is None:
        out, lse = torch.ops.pagedattn.flash_attn_varlen_func.default(*args)
    else:
        lse = torch.ops.pagedattn.flash_attn_varlen_func.out(*args, out)
    return (out, lse) if return_softmax_lse else out


@_op("flash_attn_with_kvcache", mutates_args=("k_cache", "v_cache"))
def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor],
                            v: Optional[Tensor], cache_seqlens: Tensor, block_table: Tensor,
                            softmax_scale: Optional[float], causal: bool, window_size: Sequence[int],
                            softcap: float, alibi_slopes: Optional[Tensor], num_splits: int,
                            k_descale: Optional[Tensor], v_descale: Optional[Tensor],
                            kv_cache_dtype: Optional[str], sinks: Optional[Tensor],
                            max_seqlen_k: int) -> tuple[Tensor, Tensor]:
    result = kvcache.run(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal,
                         tuple(window_size), softcap, alibi_slopes, num_splits, k_descale, v_descale,
                         kv_cache_dtype, sinks, max_seqlen_k, True)
    if k is not None:
        _bump(k_cache, v_cache)
    return result


@_fake("flash_attn_with_kvcache")
def _(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, window_size, softcap,
      alibi_slopes, num_splits, k_descale, v_descale, kv_cache_dtype, sinks, max_seqlen_k):
    return kvcache.run(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal,
                       tuple(window_size), softcap, alibi_slopes, num_splits, k_descale, v_descale,
                       kv_cache_dtype, sinks, max_seqlen_k, True, fake=True)
