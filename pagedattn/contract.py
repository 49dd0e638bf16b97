"""The cache-layout contract shared by the writer and the readers.

A `CacheSpec` names everything a kernel must agree on about a paged KV cache. Caches are always
indexed logically as `[num_blocks, block_size, num_kv_heads, head_size]`; the layout says how that maps
to memory: NHD is the plain contiguous tensor, HND a permuted view of `[num_blocks, H, block_size, D]`
storage (as vLLM allocates it).

The third layout, "legacy", is the one of vLLM's historical `reshape_and_cache` and
`paged_attention_v1/v2` (pagedattn.legacy): K `[num_blocks, H, D // x, block_size, x]` with
x = 16 bytes / element size, V `[num_blocks, H, D, block_size]`. It is not a view of the logical shape,
so the flash kernels refuse it (`from_tensors` raises on it) and the legacy kernels refuse NHD/HND
(`from_legacy_tensors` raises on them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .dtypes import FP8_MAX, NAME_TO_TORCH, normalize_kv_cache_dtype, short

LAYOUTS = ("NHD", "HND", "legacy")
FLASH_LAYOUTS = ("NHD", "HND")       # read by the flash kernels, written by reshape_and_cache_flash
SCALE_GRANULARITIES = ("tensor", "head")
FP8_STORAGE = {"fp8_e4m3": (torch.uint8, torch.float8_e4m3fn),
               "fp8_e5m2": (torch.uint8, torch.float8_e5m2)}
PLAIN_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class ContractError(ValueError):
    """A tensor does not match the cache-layout contract."""


def describe(t) -> str:
    """What an argument was, for error messages: a tensor's dtype, shape and device, else its type."""
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"
    return "None" if t is None else type(t).__name__


def kv_cache_dtype_name(kv_cache_dtype) -> str:
    """normalize_kv_cache_dtype, refusing with a ContractError."""
    try:
        return normalize_kv_cache_dtype(kv_cache_dtype)
    except ValueError as e:
        raise ContractError(str(e)) from None


def check_scale_values(name: str, t: torch.Tensor) -> None:
    """validate=True / PAGEDATTN_DEBUG (syncs): every fp8 scale finite and > 0, else the kernels
    quietly write or read NaN / inf. Names the first bad element."""
    bad = ~(torch.isfinite(t) & (t > 0))
    if bool(bad.any()):
        i = tuple(int(x) for x in bad.nonzero()[0]) if t.dim() else ()  # a 0-d tensor has no nonzero rows
        where = f"{name}[{', '.join(map(str, i))}]" if i else name
        raise ContractError(f"{where} = {float(t[i])}: fp8 scales must be finite and > 0")


def _same_dtype_and_device(key_cache, value_cache) -> None:
    if key_cache.dtype != value_cache.dtype:
        raise ContractError(f"key_cache ({key_cache.dtype}) and value_cache ({value_cache.dtype}) "
                            "differ in dtype")
    if key_cache.device != value_cache.device:
        raise ContractError(f"key_cache ({key_cache.device}) and value_cache ({value_cache.device}) "
                            "are on different devices")


@dataclass(frozen=True)
class CacheSpec:
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype                # storage dtype: fp16/bf16/fp32, or uint8/float8 for fp8 caches
    kv_cache_dtype: str = "auto"      # auto | fp8_e4m3 | fp8_e5m2
    layout: str = "NHD"               # NHD | HND | legacy
    scale: str = "tensor"             # fp8 scale granularity: tensor | head

    def __post_init__(self):
        object.__setattr__(self, "kv_cache_dtype", kv_cache_dtype_name(self.kv_cache_dtype))
        for name in ("num_blocks", "block_size", "num_kv_heads", "head_size"):
            value = getattr(self, name)
            if not isinstance(value, (int, torch.SymInt)) or value <= 0:  # SymInt: fake tensors, traced
                raise ContractError(f"CacheSpec.{name} must be a positive int, got {value!r}")
        if self.layout not in LAYOUTS:
            raise ContractError(f"CacheSpec.layout={self.layout!r}; supported: {LAYOUTS}")
        if self.scale not in SCALE_GRANULARITIES:
            raise ContractError(f"CacheSpec.scale={self.scale!r}; supported: {SCALE_GRANULARITIES}")
        if self.kv_cache_dtype == "auto":
            if self.dtype not in PLAIN_CACHE_DTYPES:
                raise ContractError(
                    f"kv_cache_dtype='auto' needs a fp16/bf16/fp32 cache, got {self.dtype}; "
                    "an fp8 cache needs kv_cache_dtype='fp8_e4m3' or 'fp8_e5m2'")
        elif self.dtype not in FP8_STORAGE[self.kv_cache_dtype]:
            raise ContractError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} needs a cache of dtype "
                f"{' or '.join(map(str, FP8_STORAGE[self.kv_cache_dtype]))}, got {self.dtype}")
        if self.layout == "legacy":
            if self.head_size % self.x:
                raise ContractError(f"the legacy layout splits head_size into chunks of x = {self.x} "
                                    f"elements; head_size={self.head_size} is not a multiple")
            if self.is_fp8 and self.scale != "tensor":
                raise ContractError("the legacy kernels take per-tensor fp8 scales (scale='tensor')")

    # -- derived --------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def is_fp8(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def cache_dtype_name(self) -> str:
        """Element type name of what is stored: fp16/bf16/fp32/fp8_e4m3/fp8_e5m2."""
        return self.kv_cache_dtype if self.is_fp8 else short(self.dtype)

    @property
    def fp8_max(self) -> float:
        return FP8_MAX[self.kv_cache_dtype]

    @property
    def x(self) -> int:
        """Elements per 16-byte chunk: the innermost K dimension of the legacy layout."""
        return 16 // self.dtype.itemsize

    @property
    def key_shape(self) -> tuple[int, ...]:
        if self.layout == "legacy":
            n, b, h, d = self.shape
            return (n, h, d // self.x, b, self.x)
        return self.shape

    @property
    def value_shape(self) -> tuple[int, ...]:
        if self.layout == "legacy":
            n, b, h, d = self.shape
            return (n, h, d, b)
        return self.shape

    def require_layout(self, allowed: tuple[str, ...], op: str) -> None:
        """Raise unless this spec's layout is one `op` reads or writes."""
        if self.layout not in allowed:
            other = ("pagedattn.legacy (reshape_and_cache, paged_attention_v1/v2)"
                     if self.layout == "legacy" else
                     "the flash path (reshape_and_cache_flash and the flash attention kernels)")
            raise ContractError(f"{op} works on {' / '.join(allowed)} caches, not on a "
                                f"{self.layout!r} cache; that layout belongs to {other}")

    def strides(self) -> tuple[int, int, int, int]:
        """Element strides of the logical [num_blocks, block_size, H, D] view."""
        self.require_layout(FLASH_LAYOUTS, "CacheSpec.strides")
        n, b, h, d = self.shape
        if self.layout == "NHD":
            return (b * h * d, h * d, d, 1)
        return (b * h * d, d, b * d, 1)

    # -- allocation and inference ---------------------------------------------------------------
    def allocate(self, device="cuda", fill: float | None = None):
        """(key_cache, value_cache) with the logical shape and this spec's physical layout."""
        def one(shape):
            n, b, h, d = self.shape
            if self.layout == "legacy":
                t = torch.empty(shape, dtype=self.dtype, device=device)
            elif self.layout == "NHD":
                t = torch.empty((n, b, h, d), dtype=self.dtype, device=device)
            else:
                t = torch.empty((n, h, b, d), dtype=self.dtype, device=device).permute(0, 2, 1, 3)
            if fill is not None:
                if self.dtype == torch.uint8:
                    # NaN in the fp8 format (e4m3: 0x7F, e5m2: 0x7F is NaN too)
                    t.view(torch.uint8).fill_(0x7F)
                else:
                    t.fill_(fill)
            return t
        return one(self.key_shape), one(self.value_shape)

    @classmethod
    def from_tensors(cls, key_cache: torch.Tensor, value_cache: torch.Tensor, *,
                     kv_cache_dtype: str | None = "auto", scale: str = "tensor",
                     pointers: bool = True) -> "CacheSpec":
        """Infer and validate the spec of a (key_cache, value_cache) pair. pointers=False (fake or
        meta tensors, which have no data) skips the base-pointer alignment check."""
        for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
            if not isinstance(t, torch.Tensor):
                raise ContractError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if name == "key_cache" and t.dim() == 5:
                raise ContractError(
                    f"key_cache has the 5-D legacy layout {tuple(t.shape)} [num_blocks, H, D // x, "
                    "block_size, x] of reshape_and_cache; this op reads NHD/HND caches. Legacy caches "
                    "are read by pagedattn.legacy.paged_attention_v1/v2")
            if t.dim() != 4:
                raise ContractError(f"{name} must be 4-D [num_blocks, block_size, num_kv_heads, "
                                    f"head_size], got shape {tuple(t.shape)}")
        if key_cache.shape != value_cache.shape:
            raise ContractError(f"key_cache {tuple(key_cache.shape)} and value_cache "
                                f"{tuple(value_cache.shape)} differ in shape")
        if 0 in key_cache.shape:  # else CacheSpec's own check names a field, not the argument
            raise ContractError(f"key_cache has an empty dim: shape {tuple(key_cache.shape)} [num_blocks, "
                                "block_size, num_kv_heads, head_size]")
        _same_dtype_and_device(key_cache, value_cache)
        if key_cache.stride() != value_cache.stride():
            raise ContractError(f"key_cache strides {key_cache.stride()} and value_cache strides "
                                f"{value_cache.stride()} differ: K and V must share one layout")
        n, b, h, d = key_cache.shape
        stride = key_cache.stride()
        if stride[3] != 1:
            raise ContractError(f"key_cache / value_cache head dim must be contiguous (stride 1), got strides {stride}")
        layout = None
        for candidate in LAYOUTS:
            spec_strides = cls._layout_strides(candidate, b, h, d)
            if all(s == e or size == 1 for s, e, size in zip(stride, spec_strides, key_cache.shape)):
                layout = candidate
                break
        if layout is None:
            raise ContractError(
                f"key_cache / value_cache strides {stride} are neither NHD {cls._layout_strides('NHD', b, h, d)} nor "
                f"HND {cls._layout_strides('HND', b, h, d)} for shape {tuple(key_cache.shape)}")
        for name, t in (("key_cache", key_cache), ("value_cache", value_cache)) if pointers else ():
            if t.data_ptr() % 16:
                raise ContractError(f"{name} base pointer is not 16-byte aligned "
                                    f"(address % 16 = {t.data_ptr() % 16})")
        if key_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and \
                kv_cache_dtype_name(kv_cache_dtype) == "auto":
            kv_cache_dtype = short(key_cache.dtype)
        return cls(n, b, h, d, key_cache.dtype, kv_cache_dtype or "auto", layout, scale)

    @staticmethod
    def _layout_strides(layout, b, h, d):
        return (b * h * d, h * d, d, 1) if layout == "NHD" else (b * h * d, d, b * d, 1)

    @classmethod
    def from_legacy_tensors(cls, key_cache: torch.Tensor, value_cache: torch.Tensor, *,
                            kv_cache_dtype: str | None = "auto") -> "CacheSpec":
        """Infer and validate the spec of a legacy pair: K [N, H, D // x, block_size, x], V [N, H, D,
        block_size], x = 16 bytes / element size. Inner dims dense; block and head strides free
        (multiples of 16 bytes)."""
        for name, t, dims in (("key_cache", key_cache, 5), ("value_cache", value_cache, 4)):
            if not isinstance(t, torch.Tensor):
                raise ContractError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != dims:
                hint = ""
                if name == "key_cache" and t.dim() == 4:
                    hint = (": a 4-D key cache is the NHD/HND layout of reshape_and_cache_flash, read "
                            "by the flash kernels, not by the legacy ones")
                raise ContractError(f"legacy {name} must be {dims}-D, got shape {tuple(t.shape)}{hint}")
        _same_dtype_and_device(key_cache, value_cache)
        n, h, dx, b, x = key_cache.shape
        elem = key_cache.element_size()
        if x * elem != 16:
            raise ContractError(f"legacy key_cache's last dim must be x = 16 // {elem} = {16 // elem} "
                                f"for {key_cache.dtype}, got shape {tuple(key_cache.shape)}")
        d = dx * x
        if 0 in key_cache.shape:
            raise ContractError(f"legacy key_cache has an empty dim: shape {tuple(key_cache.shape)}")
        if tuple(value_cache.shape) != (n, h, d, b):
            raise ContractError(f"legacy value_cache must have shape [num_blocks, H, D, block_size] = "
                                f"{(n, h, d, b)} to match key_cache {tuple(key_cache.shape)}, got "
                                f"{tuple(value_cache.shape)}")
        ks, vs = key_cache.stride(), value_cache.stride()
        if ks[2:] != (b * x, x, 1) and dx * b > 1:
            raise ContractError(f"legacy key_cache's [D // x, block_size, x] part must be dense "
                                f"(strides [*, *, {b * x}, {x}, 1]), got strides {ks}")
        if vs[2:] != (b, 1) and d * b > 1:
            raise ContractError(f"legacy value_cache's [D, block_size] part must be dense "
                                f"(strides [*, *, {b}, 1]), got strides {vs}")
        for name, t, strides in (("key_cache", key_cache, ks[:2]), ("value_cache", value_cache, vs[:2])):
            if t.data_ptr() % 16:
                raise ContractError(f"{name} base pointer is not 16-byte aligned "
                                    f"(address % 16 = {t.data_ptr() % 16})")
            if any((s * elem) % 16 for s in strides):
                raise ContractError(f"{name}'s block and head strides {strides} must be multiples of "
                                    "16 bytes")
        if key_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and \
                kv_cache_dtype_name(kv_cache_dtype) == "auto":
            kv_cache_dtype = short(key_cache.dtype)
        return cls(n, b, h, d, key_cache.dtype, kv_cache_dtype or "auto", "legacy", "tensor")

    def check_tensors(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
        """Raise unless the pair was made for exactly this spec."""
        if self.layout == "legacy":
            other = CacheSpec.from_legacy_tensors(key_cache, value_cache,
                                                  kv_cache_dtype=self.kv_cache_dtype)
        else:
            other = CacheSpec.from_tensors(key_cache, value_cache, kv_cache_dtype=self.kv_cache_dtype,
                                           scale=self.scale)
        if other != self:
            diff = [f"{f}: {getattr(other, f)!r} != {getattr(self, f)!r}"
                    for f in self.__dataclass_fields__ if getattr(other, f) != getattr(self, f)]
            raise ContractError("key_cache / value_cache do not match this CacheSpec (" + "; ".join(diff) + ")")

    # -- the ops, reached through the contract --------------------------------------------------
    def write(self, key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None,
              validate: bool | None = None) -> None:
        """reshape_and_cache_flash (or, for a legacy spec, reshape_and_cache) on caches made for
        this spec (checked)."""
        self.check_tensors(key_cache, value_cache)
        if self.layout == "legacy":
            from .ops.legacy_cache import write_legacy

            write_legacy(self, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                         validate=validate)
            return
        from .ops.kv_write import write_with_spec

        write_with_spec(self, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                        validate=validate)


def fp8_view(t: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """A float8 view of an fp8 cache stored as uint8 (vLLM's convention) or float8."""
    return t.view(NAME_TO_TORCH[kv_cache_dtype]) if t.dtype == torch.uint8 else t


def traced(t) -> bool:
    """t is a tensor subclass of a tracing mode (fake, functional, proxy): the public functions then
    call their torch.ops.pagedattn op, whose fake implementation handles it."""
    return isinstance(t, torch.Tensor) and type(t) is not torch.Tensor
