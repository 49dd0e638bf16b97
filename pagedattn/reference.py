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
