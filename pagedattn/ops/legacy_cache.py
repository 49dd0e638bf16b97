"""reshape_and_cache on the legacy layout: validation at the API boundary, variant choice, launch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .. import envs
from ..contract import CacheSpec, ContractError, check_scale_values, describe
from ..dtypes import CUDA_TYPE, FP8_FORMAT, short
from ..registry import KernelSpec, get_kernel, register
from .kv_write import check_new_tokens, check_slots
from .params import LegacyCacheWriteParams

INPUT_DTYPES = (torch.float16, torch.bfloat16)


@register
@dataclass(frozen=True)
class LegacyCacheWriteSpec(KernelSpec):
    """Legacy cache write (reshape_and_cache): input dtype and what the cache stores."""
    FAMILY: ClassVar[str] = "legacy_cache_write"
    TEMPLATE: ClassVar[str] = "legacy_cache_write.cu.j2"
    PARAMS: ClassVar = LegacyCacheWriteParams
    SUPPORTED: ClassVar[dict] = {
        "dtype": ("fp16", "bf16"),
        "kv_cache_dtype": ("auto", "fp8_e4m3", "fp8_e5m2"),
    }

    dtype: str
    kv_cache_dtype: str

    def context(self) -> dict:
        cache = self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        return {"Element": CUDA_TYPE[self.dtype], "CacheElement": CUDA_TYPE[cache],
                "kFp8": FP8_FORMAT[self.kv_cache_dtype]}


def geometry(spec: CacheSpec, key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple:
    """The LegacyCacheGeometry fields, flattened in order (the launcher packs flat values)."""
    ks, vs = key_cache.stride(), value_cache.stride()
    return (ks[0], ks[1], vs[0], vs[1], spec.num_blocks, spec.num_kv_heads, spec.head_size,
            spec.block_size)


def check_scale(name: str, scale, spec: CacheSpec, device: torch.device) -> None:
    """fp8 caches take one float32 scale per tensor, on the cache's device."""
    if scale is None:
        raise ContractError(f"kv_cache_dtype={spec.kv_cache_dtype!r} needs {name} (a float32 tensor "
                            "with one element: dequantised = stored * scale)")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        raise ContractError(f"{name} must be a float32 tensor, got {describe(scale)}")
    if scale.numel() != 1:
        raise ContractError(f"{name} must hold one element (the legacy kernels take per-tensor "
                            f"scales), got shape {tuple(scale.shape)}")
    if scale.device != device:
        raise ContractError(f"{name} is on {scale.device}, the cache on {device}")


def validate_inputs(spec: CacheSpec, key, value, key_cache, slot_mapping, k_scale, v_scale) -> int:
    """Every check of the writer, before any kernel runs. Returns the number of tokens to write."""
    num_tokens = check_new_tokens(spec, key, value, key_cache, slot_mapping, INPUT_DTYPES,
                                  "the legacy writer")
    if spec.is_fp8:
        check_scale("k_scale", k_scale, spec, key_cache.device)
        check_scale("v_scale", v_scale, spec, key_cache.device)
    return num_tokens


def write_legacy(spec: CacheSpec, key, value, key_cache, value_cache, slot_mapping, k_scale=None,
                 v_scale=None, validate: bool | None = None) -> None:
    """The writer on caches already checked against `spec` (layout "legacy")."""
    spec.require_layout(("legacy",), "reshape_and_cache")
    num_tokens = validate_inputs(spec, key, value, key_cache, slot_mapping, k_scale, v_scale)
    if validate or (validate is None and envs.debug()):
        check_slots(slot_mapping, spec.num_slots)
        if spec.is_fp8:
            check_scale_values("k_scale", k_scale)
            check_scale_values("v_scale", v_scale)
    if key_cache.device.type != "cuda":  # even with no token, like reshape_and_cache_flash
        raise ContractError(f"reshape_and_cache runs on CUDA tensors; key_cache is on {key_cache.device} "
                            "(for CPU tensors use pagedattn.legacy_reference.reshape_and_cache)")
    if num_tokens == 0:
        return
    kernel = get_kernel(LegacyCacheWriteSpec(short(key.dtype), spec.kv_cache_dtype))
    chunks = spec.num_kv_heads * spec.head_size // spec.x
    threads = min(max(32, -(-chunks // 32) * 32), 512)
    kernel.launcher(key_cache.device.index)(
        (num_tokens, 1, 1), (threads, 1, 1),
        (key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
         slot_mapping.data_ptr(),
         k_scale.data_ptr() if spec.is_fp8 else 0, v_scale.data_ptr() if spec.is_fp8 else 0,
         key.stride(0), value.stride(0)) + geometry(spec, key_cache, value_cache) +
        (int(slot_mapping.dtype == torch.int64), 0))


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto",
                      k_scale=None, v_scale=None, *, validate: bool | None = None) -> None:
    """Write new K/V tokens into a legacy paged cache (vLLM's `reshape_and_cache` semantics).

    key, value: [T_pad, H, D] fp16/bf16, (H, D) dense; only the first slot_mapping.numel() tokens are
    read; slot < 0 skips a token. key_cache: [num_blocks, H, D // x, block_size, x] with
    x = 16 // element size; value_cache: [num_blocks, H, D, block_size].
    kv_cache_dtype: "auto" | "fp8" | "fp8_e4m3" | "fp8_e5m2"; fp8 caches are uint8 or float8 and need
    float32 k_scale / v_scale of one element: stored = saturate_to_finite(x / scale).
    validate=True (or PAGEDATTN_DEBUG=1) also checks every slot < num_blocks * block_size and the
    scales finite and > 0 (syncs).
    """
    spec = CacheSpec.from_legacy_tensors(key_cache, value_cache, kv_cache_dtype=kv_cache_dtype)
    write_legacy(spec, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                 validate=validate)
