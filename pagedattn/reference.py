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
    num_tokens = slot_mapping.numel()
    block_size = key_cache.shape[1]
    num_heads = key_cache.shape[2]
    for src, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        for t in range(num_tokens):
            slot = int(slot_mapping[t])
            if slot < 0:
                continue
            block, offset = divmod(slot, block_size)
            x = src[t]  # [H, D]
            if kv_cache_dtype == "auto":
                cache[block, offset] = x.to(cache.dtype)
                continue
            s = scale.float().reshape(-1, 1).expand(num_heads, 1)
            q = quantize_fp8(x, s, kv_cache_dtype)
            if cache.dtype == torch.uint8:
                cache[block, offset] = q.view(torch.uint8)
            else:
                cache[block, offset] = q
