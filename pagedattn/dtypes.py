"""One map between torch dtypes, our short names and the C++ element types."""
from __future__ import annotations

import torch

# short name -> C++ element type as the kernels see it: CUDA's own types in the copy kernels (fp8 as
# raw bytes), CUTLASS's in the CuTe MMA kernels.
CUDA_TYPE = {"fp16": "__half", "bf16": "__nv_bfloat16", "fp32": "float",
             "fp8_e4m3": "uint8_t", "fp8_e5m2": "uint8_t"}
CUTLASS_TYPE = {"fp16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t"}
# kv_cache_dtype -> pagedattn::Fp8Format enumerator (numeric.cuh)
FP8_FORMAT = {"auto": "kNone", "fp8_e4m3": "kE4M3", "fp8_e5m2": "kE5M2"}

TORCH_TO_NAME = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
}
NAME_TO_TORCH = {v: k for k, v in TORCH_TO_NAME.items()}

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
_KV_ALIASES = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}

FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


def normalize_kv_cache_dtype(kv_cache_dtype: str | None) -> str:
    key = "auto" if kv_cache_dtype is None else kv_cache_dtype.lower() if isinstance(kv_cache_dtype, str) else None
    if key not in _KV_ALIASES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported; "
                         f"use one of {sorted(_KV_ALIASES)}")
    return _KV_ALIASES[key]


def short(dtype: torch.dtype) -> str:
    try:
        return TORCH_TO_NAME[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not supported; use one of "
                         f"{[str(d) for d in TORCH_TO_NAME]}") from None
