"""Pure-torch references for the legacy layout (pagedattn.legacy): the oracles of its tests. Written
for clarity, not speed, and independent of every kernel in this package.

Layout: key_cache [num_blocks, H, D // x, block_size, x] (x = 16 // element size), value_cache
[num_blocks, H, D, block_size]. Semantics, shared with the kernels:
  - writer: slot < 0 or slot >= num_blocks * block_size skips the token; fp8 stores
    saturate_to_finite(x / scale).
  - reader: token positions whose block-table entry lies outside [0, num_blocks) are masked; a
    sequence with no visible token has output 0; seq_len is clamped to what the table maps (and to
    `max_tokens` when given); ALiBi adds slope[h] * (pos - seq_len + 1) with the unclamped seq_len.
"""
from __future__ import annotations

import torch

from .contract import fp8_view
from .dtypes import normalize_kv_cache_dtype
from .reference import quantize_fp8


def legacy_x(dtype: torch.dtype) -> int:
    """The layout's x: elements per 16 bytes."""
    return 16 // dtype.itemsize


def _store(src: torch.Tensor, cache: torch.Tensor, kv_cache_dtype: str, scale) -> torch.Tensor:
    """src converted to what `cache` holds (same shape as src)."""
    if kv_cache_dtype == "auto":
        return src.to(cache.dtype)
    q = quantize_fp8(src, scale.float().reshape(()), kv_cache_dtype)
    return q.view(torch.uint8) if cache.dtype == torch.uint8 else q


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto",
                      k_scale=None, v_scale=None) -> None:
    """Same signature and semantics as pagedattn.legacy.reshape_and_cache, in plain torch."""
    kv_cache_dtype = normalize_kv_cache_dtype(kv_cache_dtype)
    num_blocks, num_heads, chunks, block_size, x = key_cache.shape
    for t in range(slot_mapping.numel()):
        slot = int(slot_mapping[t])
        if slot < 0 or slot >= num_blocks * block_size:
            continue
        block, offset = divmod(slot, block_size)
        k = _store(key[t], key_cache, kv_cache_dtype, k_scale)      # [H, D]
        v = _store(value[t], value_cache, kv_cache_dtype, v_scale)  # [H, D]
        key_cache[block, :, :, offset, :] = k.reshape(num_heads, chunks, x)
        value_cache[block, :, :, offset] = v


def dequantize(cache: torch.Tensor, kv_cache_dtype: str, scale) -> torch.Tensor:
    """The cache's values in float64 (fp8: stored value * scale)."""
    kv_cache_dtype = normalize_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        return cache.double()
    return fp8_view(cache, kv_cache_dtype).double() * float(scale.reshape(()))


def gather(key_cache, value_cache, block_table_row, seq_len: int, kv_cache_dtype="auto", k_scale=None,
           v_scale=None):
    """One sequence's first seq_len tokens through its block-table row, dequantised to float64:
    (K [L, H, D], V [L, H, D], visible [L] bool). Positions in invalid blocks read block 0 and are
    marked not visible."""
    num_blocks, num_heads, chunks, block_size, x = key_cache.shape
    pos = torch.arange(seq_len, device=key_cache.device)
    blocks = block_table_row.long()[pos // block_size]
    offsets = pos % block_size
    visible = (blocks >= 0) & (blocks < num_blocks)
    blocks = torch.where(visible, blocks, torch.zeros_like(blocks))
    k = key_cache[blocks, :, :, offsets, :].reshape(seq_len, num_heads, chunks * x)
    v = value_cache[blocks, :, :, offsets]                                            # [L, H, D]
    return (dequantize(k, kv_cache_dtype, k_scale), dequantize(v, kv_cache_dtype, v_scale), visible)


def paged_attention(query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                    alibi_slopes=None, kv_cache_dtype="auto", k_scale=None, v_scale=None,
                    max_tokens: int | None = None) -> torch.Tensor:
    """Decode attention over a legacy cache in float64: [num_seqs, num_heads, head_size]."""
    num_seqs, num_heads, head_size = query.shape
    block_size = key_cache.shape[3]
    group = num_heads // num_kv_heads
    capacity = block_tables.shape[1] * block_size
    if max_tokens is not None:
        capacity = min(capacity, max_tokens)
    out = torch.zeros(num_seqs, num_heads, head_size, dtype=torch.float64, device=query.device)
    for s in range(num_seqs):
        seq_len = max(int(seq_lens[s]), 0)
        length = min(seq_len, capacity)
        if length == 0:
            continue
        k, v, visible = gather(key_cache, value_cache, block_tables[s], length, kv_cache_dtype,
                               k_scale, v_scale)
        k = k.repeat_interleave(group, dim=1)                 # [L, num_heads, D]
        v = v.repeat_interleave(group, dim=1)
        q = query[s].double()                                 # [num_heads, D]
        logits = scale * torch.einsum("hd,lhd->hl", q, k)     # [num_heads, L]
        if alibi_slopes is not None:
            pos = torch.arange(length, device=query.device, dtype=torch.float64)
            logits = logits + alibi_slopes.double()[:, None] * (pos - seq_len + 1)[None, :]
        logits = logits.masked_fill(~visible[None, :], float("-inf"))
        if not bool(visible.any()):
            continue
        probs = torch.softmax(logits, dim=-1)
        v = torch.where(visible[:, None, None], v, torch.zeros_like(v))  # masked rows may hold NaN
        out[s] = torch.einsum("hl,lhd->hd", probs, v)
    return out
