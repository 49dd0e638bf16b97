"""flash_attn_varlen_func over a paged KV cache: validation, tile choice, split-KV, launch."""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import numbers
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .. import envs
from ..contract import CacheSpec, ContractError, check_scale_values, describe, kv_cache_dtype_name, traced
from ..dtypes import CUTLASS_TYPE, FP8_FORMAT, short
from ..registry import KernelSpec, UnsupportedError, arch_for_device, get_kernel, register, sm_count
from . import workspace
from .params import AttnParams

_is_capturing = torch.cuda.is_current_stream_capturing

HEAD_DIMS = (64, 80, 96, 128, 192, 256)
SMEM_LIMIT = 227 * 1024  # shared memory of one CTA on sm_90 (the variants built for sm_80 stay under its 163 KiB)
LOG2E = 1.4426950408889634


MODES = ("decode", "decode_tma", "prefill", "prefill_wgmma")
FEATURES = ("window", "softcap", "alibi", "sinks")
# Feature sets that bundles and `pagedattn list` cover, by the models that need them: Mistral/Qwen2
# sliding-window layers; Gemma 2/3 (softcap + window; softcap alone in global layers); gpt-oss (sinks,
# with and without a window); BLOOM/MPT/Baichuan (ALiBi).
FEATURE_SETS = ("none", "window", "softcap", "window+softcap", "sinks", "window+sinks", "alibi")


def tile_config(head_dim: int, mode: str, fp8: bool = False) -> dict:
    """THE choice of tile sizes per (head dim, mode). Decode packs few rows, so its warps split the KV
    range (kWarpsN); prefill's warps split the rows (kWarpsM). decode_tma is decode with each warp
    filling its own ring by TMA (sm_90, paged caches; see attn_traits.cuh); prefill_wgmma is prefill
    with warpgroup MMAs (sm_90a, 16-bit caches, head dims that are multiples of 64)."""
    return dict(kWgmma=mode == "prefill_wgmma", **_tiles(head_dim, mode, fp8))


def _tiles(head_dim: int, mode: str, fp8: bool) -> dict:
    if mode == "decode":
        # Measured on H200 (perf/results/history/attn_tile_sweep_*): with cp.async, decode is bound by
        # warps per SM, so the smallest sub-tile and two stages (68 KiB at d128: three CTAs) win.
        return dict(kBlockM=16, kBlockN=16, kWarpsM=1, kWarpsN=4, kStages=2, kMinBlocks=3, kTma=False)
    if mode == "decode_tma":
        # Measured on H200 (perf/results/decode_sweep_*): 16-bit caches, two ring slots in flight per
        # warp and two CTAs per SM; fp8 caches (more work per byte: widening) prefer more warps, three
        # CTAs with one slot in flight each.
        if fp8 and fp8_regs(head_dim, True):
            # fp8 operands converted in registers (attn_fp8_regs.cuh): sub-tiles of 4096 / head_dim keys
            # keep the 8 KiB slots of the 16-bit tiles
            return dict(kBlockM=16, kBlockN=4096 // head_dim, kWarpsM=1, kWarpsN=4, kStages=3, kMinBlocks=2,
                        kTma=True)
        if fp8:
            return dict(kBlockM=16, kBlockN=16, kWarpsM=1, kWarpsN=4, kStages=2, kMinBlocks=3, kTma=True)
        return dict(kBlockM=16, kBlockN=16, kWarpsM=1, kWarpsN=4, kStages=3, kMinBlocks=2, kTma=True)
    if mode == "prefill_wgmma":
        # Measured on H200, B=4 S=4096 causal d128 (perf/results/history/prefill_sweep_h200_*): more
        # warpgroups sharing each K/V stage win. rows x keys: 128x128 227 TFLOP/s, 192x128 300-309,
        # 256x64 325-333, 256x64 with three stages 339 (row tiles in reverse order). Head dims above
        # 128 keep two warpgroups (O needs the registers) and two stages (shared memory at d256).
        if head_dim <= 128:
            return dict(kBlockM=256, kBlockN=64, kWarpsM=16, kWarpsN=1, kStages=3, kMinBlocks=1, kTma=False)
        return dict(kBlockM=128, kBlockN=64, kWarpsM=8, kWarpsN=1, kStages=2, kMinBlocks=1, kTma=False)
    if head_dim <= 128:
        return dict(kBlockM=128, kBlockN=64, kWarpsM=4, kWarpsN=1, kStages=2, kMinBlocks=1, kTma=False)
    return dict(kBlockM=64, kBlockN=32, kWarpsM=4, kWarpsN=1, kStages=2, kMinBlocks=1, kTma=False)


def fp8_regs(head_dim: int, tma: bool) -> bool:
    """AttnTraits::kFp8Regs for an fp8 cache: TMA decode converts fp8 operands in registers when the
    rows split into 128-byte swizzled blocks."""
    return tma and head_dim % 128 == 0


def smem_bytes(cfg: dict, head_dim: int, fp8: bool) -> int:
    """Mirror of AttnTraits::kSmemBytes (attn_traits.cuh); the rendered source static_asserts it."""
    stage = cfg["kBlockN"] * cfg["kWarpsN"] * head_dim
    q = cfg["kBlockM"] * head_dim * 2
    elem_stages = (0 if fp8_regs(head_dim, cfg["kTma"]) else 1) if fp8 else cfg["kStages"]
    kv = (2 * cfg["kStages"] * stage if fp8 else 0) + 2 * elem_stages * stage * 2
    epilogue = cfg["kWarpsN"] * cfg["kBlockM"] * (head_dim + 2) * 4
    main = max(q + kv, epilogue)
    barriers = 8 * cfg["kWarpsN"] * cfg["kStages"] if cfg["kTma"] else 0
    return -(-main // 8) * 8 + barriers


@register
@dataclass(frozen=True)
class AttnFwdSpec(KernelSpec):
    """Paged FlashAttention forward: query dtype, cache dtype, head-dim tile, decode/prefill tiles."""
    FAMILY: ClassVar[str] = "attn_fwd"
    TEMPLATE: ClassVar[str] = "attn_fwd.cu.j2"
    ENTRY: ClassVar[str] = "attn_fwd_kernel"
    PARAMS: ClassVar = AttnParams
    SUPPORTED: ClassVar[dict] = {
        "dtype": ("fp16", "bf16"),
        "kv_cache_dtype": ("auto", "fp8_e4m3", "fp8_e5m2"),
        "head_dim": HEAD_DIMS,
        "mode": MODES,
        **{f: (False, True) for f in FEATURES},
        "features": FEATURE_SETS,  # derived (the property below): what AOT selections and `list` name
    }

    dtype: str
    kv_cache_dtype: str = field(metadata={"prefix": "kv"})
    head_dim: int = field(metadata={"prefix": "d"})
    mode: str
    # score and mask features (AttnFeatures in tile_scheduler.cuh); each appears in the name when on
    window: bool = False
    softcap: bool = False
    alibi: bool = False
    sinks: bool = False

    @property
    def features(self) -> str:
        """The feature set as AOT selections and FEATURE_SETS spell it: 'none' or e.g. 'window+softcap'."""
        return "+".join(f for f in FEATURES if getattr(self, f)) or "none"

    @classmethod
    def all_variants(cls):
        """Every tile/dtype variant with each feature set of FEATURE_SETS (any other combination still
        compiles on first use; these are the ones `pagedattn list`, bundles and the compile tests cover)."""
        for spec in super().all_variants():
            if spec.features == "none":
                for fs in FEATURE_SETS:
                    yield spec if fs == "none" else dataclasses.replace(spec, **{f: True for f in fs.split("+")})

    @property
    def tiles(self) -> dict:
        return tile_config(self.head_dim, self.mode, self.kv_cache_dtype != "auto")

    def context(self) -> dict:
        tiles = dict(self.tiles)
        # never promise more resident CTAs than shared memory allows: the register cap would be wasted
        tiles["kMinBlocks"] = max(1, min(tiles["kMinBlocks"], SMEM_LIMIT // self.dynamic_smem()))
        return {"Element": CUTLASS_TYPE[self.dtype], "kFp8": FP8_FORMAT[self.kv_cache_dtype],
                "kHeadDim": self.head_dim, "kSmemBytes": self.dynamic_smem(), **tiles,
                **{f: getattr(self, f) for f in FEATURES}}

    def check(self) -> None:
        if self.mode == "decode_tma" and self.kv_cache_dtype == "auto" and self.head_dim % 64:
            raise UnsupportedError(f"attn_fwd: mode=decode_tma needs head_dim a multiple of 64 for 16-bit "
                                   f"caches (128-byte swizzled TMA boxes), got {self.head_dim}")
        if self.mode == "prefill_wgmma" and (self.kv_cache_dtype != "auto" or self.head_dim % 64):
            raise UnsupportedError(f"attn_fwd: mode=prefill_wgmma needs a 16-bit cache and head_dim a multiple "
                                   f"of 64 (128-byte swizzled tiles), got {self.kv_cache_dtype}, {self.head_dim}")
        if self.dynamic_smem() > SMEM_LIMIT:
            raise UnsupportedError(f"attn_fwd: the {self.mode} tiles {self.tiles} need {self.dynamic_smem()} bytes "
                                   f"of shared memory at head_dim {self.head_dim}; a CTA gets at most {SMEM_LIMIT}")

    def supports_arch(self, arch: str) -> bool:
        return self.mode not in ("decode_tma", "prefill_wgmma") or arch == "sm_90a"

    def dynamic_smem(self) -> int:
        return smem_bytes(self.tiles, self.head_dim, self.kv_cache_dtype != "auto")

    @property
    def threads(self) -> int:
        return 32 * self.tiles["kWarpsM"] * self.tiles["kWarpsN"]


def kernel_head_dim(head_size: int) -> int:
    """Compiled head dims: 64, 80, 96, 128, 192, 256. Any other multiple of 8 up to 256 runs on the
    next larger one; the extra columns are zero-filled on load and never stored."""
    for d in HEAD_DIMS:
        if head_size <= d:
            return d
    raise UnsupportedError(f"attn_fwd: head_size={head_size} is not supported; at most 256 "
                           f"(compiled: {', '.join(map(str, HEAD_DIMS))})")


_UNSUPPORTED_KW = ("scheduler_metadata", "q_descale", "fa_version", "deterministic", "return_attn_probs",
                   "dropout_p", "q_v", "cp_world_size", "cp_rank", "cp_tot_seqused_k")
_UNSUPPORTED_OK = {"scheduler_metadata": (None,), "q_descale": (None,), "fa_version": (None, 2, 3),
                   "deterministic": (False, True, None), "return_attn_probs": (False, None),
                   "dropout_p": (0.0, 0, None), "q_v": (None,), "cp_world_size": (1, None),
                   "cp_rank": (0, None), "cp_tot_seqused_k": (None,)}


def _is_default(value, defaults) -> bool:
    """value is one of an unsupported keyword's harmless values. A tensor never is (comparing one with
    a tuple would be elementwise, and its truth value ambiguous)."""
    if isinstance(value, torch.Tensor):
        return False
    try:
        return any(value is ok or value == ok for ok in defaults)
    except (TypeError, ValueError, RuntimeError):  # a type whose == is not a bool (arrays)
        return False


def _given(x) -> str:
    """A scalar argument as given, for error messages (tensors by their metadata)."""
    if isinstance(x, torch.Tensor):
        return describe(x)
    text = repr(x)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({type(x).__name__})"


def _count_arg(name, x) -> None:
    if type(x) is int and x >= 0:  # the usual case, first: this runs on every call
        return
    if isinstance(x, torch.SymInt):  # traced (fake implementations): a guard, not a value
        if x < 0:
            raise ContractError(f"{name} must be a non-negative int, got {x}")
        return
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 0:
        raise ContractError(f"{name} must be a non-negative int, got {_given(x)}")


def check_scalars(max_seqlen_q, max_seqlen_k, softmax_scale, num_splits):
    """The scalar arguments, on every call (cheap). Returns softmax_scale as a float, or None for the
    default 1 / sqrt(D). A 0-d tensor scale is read with float() (a sync when it is on the GPU)."""
    if type(max_seqlen_q) is int and type(max_seqlen_k) is int and type(num_splits) is int and \
            max_seqlen_q >= 0 and max_seqlen_k >= 0 and num_splits >= 0:  # the usual call, at once
        if softmax_scale is None:
            return None
        if type(softmax_scale) is float and 0 < softmax_scale < math.inf:
            return softmax_scale
    _count_arg("max_seqlen_q", max_seqlen_q)
    _count_arg("max_seqlen_k", max_seqlen_k)
    _count_arg("num_splits", num_splits)
    if softmax_scale is None:
        return None
    if type(softmax_scale) is not float:
        if isinstance(softmax_scale, torch.Tensor):
            if softmax_scale.dim() != 0 or not softmax_scale.dtype.is_floating_point or \
                    softmax_scale.device.type == "meta":
                raise ContractError(f"softmax_scale must be a float or a 0-d floating tensor, got "
                                    f"{describe(softmax_scale)}")
        elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            raise ContractError(f"softmax_scale must be a float, got {_given(softmax_scale)}")
        softmax_scale = float(softmax_scale)
    if not 0 < softmax_scale < math.inf:  # NaN fails too
        raise ContractError(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    return softmax_scale


def _require_cuda(q) -> None:
    if q.device.type != "cuda":
        raise ContractError(f"flash_attn_varlen_func's kernels need CUDA tensors; q is on {q.device} (for "
                            "CPU tensors use pagedattn.reference.paged_attention / varlen_attention)")


def _on_device(name, t, q) -> None:
    if t.device != q.device:
        hint = "" if q.device.type == "cuda" else "; the kernels need CUDA tensors"
        raise ContractError(f"{name} is on {t.device}, q on {q.device}{hint}")


def _int32_vector(name, t, q, shape) -> None:
    """A contiguous int32 1-D tensor on q's device; `shape` says which, for the message."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
        hint = " (convert with .int())" if getattr(t, "dtype", None) == torch.int64 else ""
        raise ContractError(f"{name} must be a contiguous int32 {shape} tensor, got {describe(t)}{hint}")
    if t.numel() > 1 and t.stride(0) != 1:
        raise ContractError(f"{name} must be contiguous, got stride {t.stride(0)}")
    _on_device(name, t, q)


_NO_FEATURES = ((False, False, False, False), -1, -1, 0.0, None, 0, None)
_INT32_MAX = 2**31 - 1


def _head_vector(name, t, Hq, B, device, batched=False):
    """alibi_slopes / s_aux: float32 [Hq] (or [B, Hq] when batched) with contiguous heads, on q's
    device; returns the batch stride."""
    shapes = f"[{Hq}]" + (f" or [{B}, {Hq}]" if batched else "")
    if not isinstance(t, torch.Tensor):
        raise ContractError(f"{name} must be a float32 tensor {shapes}, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise ContractError(f"{name} must be float32 {shapes}, got {t.dtype}")
    if t.device != device:
        raise ContractError(f"{name} is on {t.device}, q on {device}")
    if t.dim() == 1 and t.shape[0] == Hq and (Hq <= 1 or t.stride(0) == 1):
        return 0
    if batched and t.dim() == 2 and tuple(t.shape) == (B, Hq) and (Hq <= 1 or t.stride(1) == 1):
        return t.stride(0)
    raise ContractError(f"{name} must have shape {shapes} with contiguous heads, got shape "
                        f"{tuple(t.shape)} strides {t.stride()}")


def features_of(call: _Call, device, causal, window_size, softcap, alibi_slopes, sinks):
    """The feature flags of one call (AttnFwdSpec's window/softcap/alibi/sinks) and their launch values
    (window_left, window_right, softcap, alibi_slopes, alibi batch stride, sinks), checked: every bad
    value is a ContractError naming the argument. FlashAttention's semantics: window (-1, -1) and
    softcap 0 are off; causal makes the window's right edge 0."""
    if alibi_slopes is None and sinks is None and (softcap.__class__ is float or softcap.__class__ is int) \
            and softcap == 0 and (window_size is None or window_size.__class__ in (tuple, list) and
                                  len(window_size) == 2 and window_size[0] == -1 == window_size[1]):
        return _NO_FEATURES
    left = right = -1
    if window_size is not None:
        if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or not all(
                isinstance(x, int) and not isinstance(x, bool) and -1 <= x <= _INT32_MAX for x in window_size):
            raise ContractError(f"window_size must be a pair of ints >= -1 (left, right; -1 = unbounded), "
                                f"got {window_size!r}")
        left, right = window_size  # with causal the kernel ignores right: the causal limit is the edge
    window = left >= 0 or (right >= 0 and not causal)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) \
            or softcap < 0:
        raise ContractError(f"softcap must be a finite float >= 0 (0 = off), got {softcap!r}")
    alibi_stride = 0
    if alibi_slopes is not None:
        alibi_stride = _head_vector("alibi_slopes", alibi_slopes, call.Hq, call.B, device, batched=True)
    if sinks is not None:
        _head_vector("s_aux (sinks)", sinks, call.Hq, call.B, device)
    flags = (window, softcap > 0, alibi_slopes is not None, sinks is not None)
    return flags, left, right, float(softcap), alibi_slopes, alibi_stride, sinks


def _check_aligned(name, t):
    if t.data_ptr() % 16:
        raise ContractError(f"{name} base pointer must be 16-byte aligned (address % 16 = {t.data_ptr() % 16})")


def _check_strides(name, t, what):
    """The kernels load 16-byte rows: a contiguous head dim, row and head strides multiples of 8."""
    if t.stride(2) != 1 or t.stride(0) % 8 or t.stride(1) % 8:
        raise ContractError(f"{name} needs a contiguous head dim and strides that are multiples of 8 "
                            f"elements{what}, got strides {t.stride()}")


@dataclass
class _Call:
    """Everything validated about one call."""
    B: int
    Hq: int
    Hkv: int
    D: int
    paged: bool
    kv_name: str
    k_strides: tuple
    v_strides: tuple
    num_blocks: int = 0
    block_size: int = 0


def _descale_strides(name, t, B, Hkv, device=None):
    """(batch stride, head stride) of a descale: one scale ([1] or 0-d), [Hkv] or [B, Hkv]. The
    device is checked last (given one), so that a wrong shape is named as such."""
    shapes = f"float32 [1], [{Hkv}] or [{B}, {Hkv}]"
    if t is None:
        raise ContractError(f"an fp8 KV cache needs {name} ({shapes})")
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
        raise ContractError(f"{name} must be a {shapes} tensor, got {describe(t)}")
    if t.numel() == 1:
        strides = (0, 0)
    elif t.dim() == 1 and t.numel() == Hkv:
        strides = (0, t.stride(0))
    elif t.dim() == 2 and tuple(t.shape) == (B, Hkv):
        strides = (t.stride(0), t.stride(1))
    else:
        raise ContractError(f"{name} must have shape [1], [{Hkv}] or [{B}, {Hkv}] (B, num_kv_heads), "
                            f"got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ContractError(f"{name} is on {t.device}, q on {device}")
    return strides


def _batch(n_cu, *others) -> None:
    """cu_seqlens_q's B against the other per-request tensors: (name, count, unit, expected)."""
    if any(count != want for _, count, _, want in others):
        have = " and ".join(f"{name} has {count} {unit}" for name, count, unit, _ in others)
        raise ContractError(f"cu_seqlens_q has {n_cu} entries (B = {n_cu - 1}) while {have}: they must "
                            "describe the same B requests")


def validate(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, out, kv_cache_dtype,
             k_descale, v_descale, pointers: bool = True) -> _Call:
    """Every check of a call's tensor metadata; no syncs. q's device is the reference: every tensor
    must be on it. That it is a GPU is checked after this (_require_cuda), so CPU tensors reach every
    check here and the value checks (check_values); q on any other device is refused at once.
    pointers=False (the fake implementations of pagedattn.ops.library: fake and meta tensors have no
    data) skips the base-pointer alignment and the device-type checks; the real op makes them."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ContractError(f"q must be a 3-D tensor [total_q, Hq, D], got {describe(q)}")
    if pointers and q.device.type not in ("cuda", "cpu"):
        _require_cuda(q)
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ContractError(f"q dtype {q.dtype} is not supported (fp16, bf16)")
    _, Hq, D = q.shape
    if D % 8 or not 0 < D <= 256:  # before the strides: a head size of 132 is the cause, not its stride
        raise ContractError(f"head size {D} (q.shape[2]) is not supported: a multiple of 8, at most 256")
    if Hq == 0:
        raise ContractError(f"q has no heads: shape {tuple(q.shape)}")
    _check_strides("q", q, "")
    if pointers:
        _check_aligned("q", q)
    want = kv_cache_dtype_name(kv_cache_dtype)
    _int32_vector("cu_seqlens_q", cu_seqlens_q, q, "[B + 1]")
    n_cu = cu_seqlens_q.numel()
    if n_cu == 0:
        raise ContractError("cu_seqlens_q is empty; it holds B + 1 offsets ([0] for an empty batch)")
    B = n_cu - 1
    paged = block_table is not None
    if paged:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2:
            hint = " (int64 tables are not accepted: convert with .int())" \
                if getattr(block_table, "dtype", None) == torch.int64 else ""
            raise ContractError(f"block_table must be an int32 [B, max_blocks_per_seq] tensor, got "
                                f"{describe(block_table)}{hint}")
        if block_table.shape[0] > 0 and block_table.shape[1] > 1 and block_table.stride(1) != 1:
            raise ContractError(f"block_table rows must be contiguous, got shape {tuple(block_table.shape)} "
                                f"strides {block_table.stride()}")
        _on_device("block_table", block_table, q)
        if seqused_k is None:
            raise ContractError("paged attention (a block_table) needs seqused_k: a contiguous int32 [B] tensor")
        _int32_vector("seqused_k", seqused_k, q, "[B]")
        _batch(n_cu, ("block_table", block_table.shape[0], "rows", B), ("seqused_k", seqused_k.numel(), "entries", B))
        if cu_seqlens_k is not None:
            raise ContractError("give either block_table + seqused_k (paged) or cu_seqlens_k (contiguous), not both")
        scale = "tensor"
        if isinstance(k_descale, torch.Tensor) and k_descale.numel() > 1:
            scale = "head"
        try:
            spec = CacheSpec.from_tensors(k, v, kv_cache_dtype=want, scale=scale, pointers=pointers)
        except ContractError as e:  # its messages say key_cache / value_cache: here they are k / v
            raise ContractError(f"k, v (the paged caches): {e}") from None
        if spec.layout not in ("NHD", "HND"):
            raise ContractError(f"cache layout {spec.layout} cannot be read by the flash kernels")
        _on_device("k", k, q)
        kv_name, Hkv, Dk = spec.kv_cache_dtype, spec.num_kv_heads, spec.head_size
        num_blocks, block_size = spec.num_blocks, spec.block_size
    else:
        if cu_seqlens_k is None:
            raise ContractError("give block_table + seqused_k (paged) or cu_seqlens_k (contiguous varlen)")
        _int32_vector("cu_seqlens_k", cu_seqlens_k, q, "[B + 1]")
        counts = [("cu_seqlens_k", cu_seqlens_k.numel(), "entries", B + 1)]
        if seqused_k is not None:
            _int32_vector("seqused_k", seqused_k, q, "[B]")
            counts.append(("seqused_k", seqused_k.numel(), "entries", B))
        _batch(n_cu, *counts)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                raise ContractError(f"{name} must be a 3-D tensor [total_k, Hkv, D] without a block_table, "
                                    f"got {describe(t)}")
            _on_device(name, t, q)
            _check_strides(name, t, "")
            if pointers:
                _check_aligned(name, t)
        if k.shape != v.shape or k.dtype != v.dtype:
            raise ContractError(f"k {tuple(k.shape)} {k.dtype} and v {tuple(v.shape)} {v.dtype} differ")
        if k.dtype in (torch.float16, torch.bfloat16):
            kv_name = "auto"
        elif k.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            kv_name = short(k.dtype)
        elif k.dtype == torch.uint8 and want != "auto":
            kv_name = want
        else:
            raise ContractError(f"k/v dtype {k.dtype} is not supported (fp16/bf16 like q; float8, or uint8 "
                                "with kv_cache_dtype='fp8_e4m3'/'fp8_e5m2')")
        if want not in ("auto", kv_name):
            raise ContractError(f"kv_cache_dtype={kv_cache_dtype!r} does not match k/v of dtype {k.dtype}")
        _, Hkv, Dk = k.shape
        if Hkv == 0:
            raise ContractError(f"k has no heads: shape {tuple(k.shape)}")
        num_blocks = block_size = 0
    if Dk != D:
        raise ContractError(f"head size differs: q has {D}, the KV cache {Dk}")
    if Hq % Hkv:
        raise ContractError(f"q has {Hq} heads, not a multiple of the {Hkv} KV heads of k/v (GQA shares each "
                            "KV head among Hq // Hkv query heads)")
    if kv_name == "auto" and k.dtype != q.dtype:
        raise ContractError(f"KV dtype {k.dtype} differs from q dtype {q.dtype}; fp8 caches need "
                            "kv_cache_dtype='fp8_e4m3'/'fp8_e5m2' (or float8 tensors)")
    if kv_name != "auto":
        shapes = [(_descale_strides(name, t, B, Hkv), tuple(t.shape))
                  for name, t in (("k_descale", k_descale), ("v_descale", v_descale))]
        if shapes[0][1] != shapes[1][1]:
            raise ContractError(f"k_descale {shapes[0][1]} and v_descale {shapes[1][1]} differ in shape")
        _on_device("k_descale", k_descale, q)
        _on_device("v_descale", v_descale, q)
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise ContractError(f"out must be None or a tensor like q, got {describe(out)}")
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ContractError(f"out must have q's shape {tuple(q.shape)} and dtype {q.dtype}, got shape "
                                f"{tuple(out.shape)} and {out.dtype}")
        _on_device("out", out, q)
        _check_strides("out", out, " (like q)")
        if pointers:
            _check_aligned("out", out)
    ks = k.stride()
    vs = v.stride()
    if paged:  # logical [num_blocks, block_size, Hkv, D]
        k_strides, v_strides = (ks[0], ks[1], ks[2]), (vs[0], vs[1], vs[2])
    else:      # [total_k, Hkv, D]
        k_strides, v_strides = (0, ks[0], ks[1]), (0, vs[0], vs[1])
    return _Call(B, Hq, Hkv, D, paged, kv_name, k_strides, v_strides, num_blocks, block_size)


_validate = validate  # flash_attn_varlen_func's validate= argument shadows the name


def _offsets(name, t, rows, of) -> list[int]:
    """Offsets that start at 0, never decrease and end at `rows` (the rows of `of`); their lengths."""
    cu = t.tolist()
    if cu[0] != 0:
        raise ContractError(f"{name}[0] = {cu[0]}; offsets start at 0")
    for i in range(1, len(cu)):
        if cu[i] < cu[i - 1]:
            raise ContractError(f"{name}[{i}] = {cu[i]} < {name}[{i - 1}] = {cu[i - 1]}; offsets never decrease")
    if cu[-1] != rows:
        raise ContractError(f"{name}[{len(cu) - 1}] = {cu[-1]}, but {of} has {rows} rows ({of}.shape[0])")
    return [b - a for a, b in zip(cu, cu[1:])]


def check_values(call: _Call, q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q,
                 max_seqlen_k, k_descale, v_descale) -> None:
    """validate=True / PAGEDATTN_DEBUG (syncs): the values the kernels trust, on a validated call.
    cu_seqlens_q (cu_seqlens_k) starts at 0, never decreases, ends at total_q (total_k); query lengths
    <= max_seqlen_q, key lengths (seqused_k, else cu_seqlens_k's) in [0, max_seqlen_k]; the table
    (check_tables); descales finite and > 0. Names the first offender."""
    lens_q = _offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0], "q")
    for b, n in enumerate(lens_q):
        if n > max_seqlen_q:
            raise ContractError(f"request {b}: q_len {n} (cu_seqlens_q) exceeds max_seqlen_q={max_seqlen_q}")
    used = seqused_k.tolist() if seqused_k is not None else None
    for b, n in enumerate(used or ()):
        if n < 0:
            raise ContractError(f"request {b}: seqused_k[{b}] = {n} is negative")
    lens_k, source = used, "seqused_k"
    if not call.paged:
        keys = _offsets("cu_seqlens_k", cu_seqlens_k, k.shape[0], "k")
        for b, n in enumerate(used or ()):
            if n > keys[b]:
                raise ContractError(f"request {b}: seqused_k[{b}] = {n} exceeds its {keys[b]} keys in cu_seqlens_k")
        if used is None:
            lens_k, source = keys, "cu_seqlens_k"
    for b, n in enumerate(lens_k):
        if n > max_seqlen_k:
            raise ContractError(f"request {b}: {n} keys ({source}) exceed max_seqlen_k={max_seqlen_k}")
    if call.paged:
        check_tables(block_table, seqused_k, call.num_blocks, call.block_size)
    if call.kv_name != "auto":
        check_scale_values("k_descale", k_descale)
        check_scale_values("v_descale", v_descale)


def check_tables(block_table, seqused_k, num_blocks, block_size) -> None:
    """PAGEDATTN_DEBUG: seqused_k within its block_table row, every block id it uses in
    [0, num_blocks) (syncs). Names the first offender."""
    width = block_table.shape[1]
    lens = seqused_k.long()
    over = (lens > width * block_size).nonzero()
    if over.numel():
        b = int(over[0, 0])
        raise ContractError(f"request {b}: seqused_k[{b}] = {int(lens[b])} exceeds its block_table capacity "
                            f"({width} blocks x {block_size})")
    used = torch.arange(width, device=lens.device)[None, :] < ((lens + block_size - 1) // block_size)[:, None]
    ids = block_table.long()
    bad = (used & ((ids < 0) | (ids >= num_blocks))).nonzero()
    if bad.numel():
        b, i = int(bad[0, 0]), int(bad[0, 1])
        raise ContractError(f"request {b}: block_table[{b}, {i}] = {int(ids[b, i])} is outside "
                            f"[0, {num_blocks}); {bad.shape[0]} bad entr(ies) in use")


def split_cost(ctas: int, splits: int, capacity: int, keys: int, fixed_keys: int = 128) -> float:
    """Relative run time of `ctas` x `splits` CTAs over `capacity` resident slots: whole waves (a
    partial last wave costs a full one) times the per-CTA work, 1/splits of a request's keys plus a
    fixed prologue/epilogue worth `fixed_keys` keys."""
    waves = -(-ctas * splits // capacity)
    return waves * (1.0 / splits + fixed_keys / max(keys, 1))


def choose_splits(num_splits: int, ctas: int, max_seqlen_k: int, spec: AttnFwdSpec, device: int) -> int:
    """num_splits=0: the split count with the least whole-wave cost (split_cost), so that a batch
    neither underfills the GPU nor leaves a mostly empty last wave (measured on H200: 512 decode CTAs
    over 396 slots ran 1.29 waves, i.e. two)."""
    return splits_for(num_splits, ctas, max_seqlen_k, stage_keys(spec), split_capacity(spec, device))


def stage_keys(spec: AttnFwdSpec) -> int:
    return spec.tiles["kBlockN"] * spec.tiles["kWarpsN"]


def split_capacity(spec: AttnFwdSpec, device: int) -> int:
    """Resident CTAs of one wave of this variant."""
    sms = sm_count(device)
    if spec.tiles["kTma"]:
        # TMA decode streams at near the SM's bandwidth share with one CTA per SM; a second resident
        # CTA adds little, so a wave is one CTA per SM (H200, perf/results/attn_quick_*: B=16 ctx 4096
        # 96 us with 1 split vs 110 with 2; B=1 ctx 32768 78 us with 16 splits vs 83 with 32).
        return sms
    return sms * max(1, SMEM_LIMIT // max(spec.dynamic_smem(), 1))


def splits_for(num_splits: int, ctas: int, max_seqlen_k: int, stage_keys: int, capacity: int) -> int:
    """choose_splits with the variant's constants already known (_Variant keeps them)."""
    max_steps = max(1, -(-max_seqlen_k // stage_keys))
    if num_splits > 0:
        return max(1, min(num_splits, max_steps, 256))
    return _best_splits(ctas, max_seqlen_k, max_steps, capacity)


@functools.lru_cache(maxsize=4096)
def _best_splits(ctas: int, max_seqlen_k: int, max_steps: int, capacity: int) -> int:
    """Memoised: the search runs once per batch shape, not on every call."""
    most = max(1, min(128, max_steps // 2))  # each split keeps at least two stages of keys
    return min(range(1, most + 1), key=lambda s: (split_cost(ctas, s, capacity, max_seqlen_k), s))


def _sig(t):
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device) if isinstance(t, torch.Tensor) else type(t)


class _Variant:
    """A variant of a plan with what every launch reads from its spec, looked up once."""
    __slots__ = ("spec", "launcher", "mode", "block_m", "threads", "stage_keys", "capacity", "head_dim")

    def __init__(self, spec: AttnFwdSpec, launcher, device: int):
        self.spec, self.launcher, self.mode, self.head_dim = spec, launcher, spec.mode, spec.head_dim
        self.block_m = spec.tiles["kBlockM"]
        self.threads = (spec.threads, 1, 1)
        self.stage_keys = stage_keys(spec)
        self.capacity = split_capacity(spec, device)


class _Plan:
    """What a call's tensor metadata decides, validated once and reused while it repeats."""
    __slots__ = ("call", "device", "dtype", "head_dim", "dbs", "dhs", "block_shift", "bt_stride",
                 "bt_width", "decode_mode", "prefill_mode", "wgmma_rows", "_kernels", "_tma", "group",
                 "tiles_per_row", "default_scale", "geometry")

    def __init__(self, call: _Call, q, block_table, k_descale, v_descale):
        self.call = call
        self.device = q.device.index if q.device.index is not None else torch.cuda.current_device()
        self.dtype = short(q.dtype)
        self.head_dim = kernel_head_dim(call.D)
        self.dbs = self.dhs = 0
        if call.kv_name != "auto":
            self.dbs, self.dhs = _descale_strides("k_descale", k_descale, call.B, call.Hkv, q.device)
            if _descale_strides("v_descale", v_descale, call.B, call.Hkv, q.device) != (self.dbs, self.dhs):
                raise ContractError("k_descale and v_descale must have the same shape")
        bs = call.block_size
        self.block_shift = bs.bit_length() - 1 if bs and bs & (bs - 1) == 0 else -1
        self.bt_stride = block_table.stride(0) if block_table is not None else 0
        self.bt_width = block_table.shape[1] if block_table is not None else 0
        arch = arch_for_device(self.device)
        self.decode_mode = "decode_tma" if tma_ok(call, arch, self.head_dim) else "decode"
        self.prefill_mode = "prefill_wgmma" if wgmma_ok(call, arch, self.head_dim) else "prefill"
        # prefill_wgmma's tiles are larger: it takes over once the rows overflow one SM80 prefill tile.
        # Measured on H200 (perf/results/prefill_modes_nvidia_h200_20261130_short_3eaa587.json, d128,
        # B=32 over 4096 keys): q_len 5-32 (20-128 rows) ran 17 % slower on wgmma, q_len 64 1.7x faster.
        self.wgmma_rows = tile_config(self.head_dim, "prefill")["kBlockM"]
        self._kernels: dict = {}
        self._tma: dict = {}
        self.group = call.Hq // call.Hkv
        self.tiles_per_row = call.B * call.Hkv  # CTAs of one row tile (gridDim.x)
        self.default_scale = 1.0 / math.sqrt(call.D)
        # AttnParams from k_block_stride to head_size: fixed by the metadata
        self.geometry = (*call.k_strides, *call.v_strides, self.bt_stride, self.bt_width, call.num_blocks,
                         call.block_size, self.block_shift, call.B, call.Hq, call.Hkv, self.group, call.D)

    def mode_for(self, rows: int) -> str:
        """The variant for a batch whose longest request has `rows` packed query rows."""
        if rows <= 16:
            return self.decode_mode
        return self.prefill_mode if rows > self.wgmma_rows else "prefill"

    def kernel(self, mode: str, flags: tuple = (False, False, False, False)) -> "_Variant":
        """The decode or prefill variant with these feature flags (FEATURES order)."""
        hit = self._kernels.get((mode, flags))
        if hit is None:
            spec = AttnFwdSpec(self.dtype, self.call.kv_name, self.head_dim, mode, *flags)
            hit = self._kernels[(mode, flags)] = _Variant(spec, get_kernel(spec).launcher(self.device), self.device)
        return hit

    def tma_maps(self, k, v, capturing: bool = False):
        """tma_maps for this plan's geometry, per cache (an engine alternates one cache per layer).
        Encoding copies host memory to the GPU, which a capturing stream cannot do: a capture needs
        one call with the same caches before it (a warm-up). Maps a capture used live as long as
        the process (workspace.keep_for_graphs): evicting them here would free what a graph reads."""
        key = (k.data_ptr(), v.data_ptr())
        hit = self._tma.get(key)
        if hit is None:
            if capturing:
                raise ContractError("flash_attn_varlen_func: the TMA descriptors of these k/v caches are built "
                                    "on first use, which cannot happen during CUDA-graph capture; run one "
                                    "eager call with the same caches before capturing (a warm-up)")
            if len(self._tma) >= 512:
                self._tma.clear()
            hit = self._tma[key] = tma_maps(k, v, self.call, self.head_dim)
        elif capturing:
            workspace.keep_for_graphs(hit[0])
        return hit


def tma_ok(call: _Call, arch: str, head_dim: int) -> bool:
    """decode_tma needs sm_90, a paged cache whose pages hold whole 16-key sub-tiles, strides the
    tensor map can describe (multiples of 16 bytes; bases are 16-byte aligned already) and, for 16-bit
    caches, a compiled head dim that is a multiple of 64."""
    fp8 = call.kv_name != "auto"
    width = 1 if fp8 else 2
    return (arch == "sm_90a" and call.paged and call.block_size % 16 == 0 and (fp8 or head_dim % 64 == 0)
            and all(x * width % 16 == 0 for x in (*call.k_strides, *call.v_strides, call.D)))


def wgmma_ok(call: _Call, arch: str, head_dim: int) -> bool:
    """prefill_wgmma: sm_90a, a 16-bit cache, a compiled head dim that is a multiple of 64."""
    return arch == "sm_90a" and call.kv_name == "auto" and head_dim % 64 == 0


_TMA_DTYPE = {torch.float16: "FLOAT16", torch.bfloat16: "BFLOAT16"}
# L2 promotion of the K/V tensor maps (CU_TENSOR_MAP_L2_PROMOTION_<this>): NONE, L2_64B, L2_128B, L2_256B.
# Boxes are 128 bytes wide. Measured on H200 (perf/results/history/decode_sweep_h200_promotion_64b556a):
# 256-byte promotion cost 6 % of decode bandwidth (B=64 ctx 4096: 269.7 us against 254.0 with 128 bytes,
# 254.2 with none; ncu: 26 % L2 "hits" on lines promoted while in flight, DRAM at 83 % against 90 %).
TMA_L2_PROMOTION = "L2_128B"


def tma_maps(k: torch.Tensor, v: torch.Tensor, call: _Call, head_dim: int) -> tuple[torch.Tensor, int]:
    """Device buffer holding the K and V CUtensorMaps (2 x 128 bytes) of a paged cache, and the
    tensor-map dimension of the slot within a page. `_Plan.tma_maps` keeps them per cache.

    Dimensions, innermost first, in increasing stride (the layouts differ only in the middle two):
    NHD (d, head, slot, block), HND (d, slot, head, block). A box is one page's kBlockN=16 slots of
    one head: 64 columns with 128-byte swizzle (16-bit caches), 128 columns with 128-byte swizzle (fp8
    with a head dim that is a multiple of 128: fp8_regs), or the whole row (other fp8, unswizzled)."""
    from cuda.bindings import driver as drv

    from ..codegen.load import check

    fp8 = call.kv_name != "auto"
    width = 1 if fp8 else 2
    dtype = getattr(drv.CUtensorMapDataType, "CU_TENSOR_MAP_DATA_TYPE_" + ("UINT8" if fp8 else _TMA_DTYPE[k.dtype]))
    plain = fp8 and not fp8_regs(head_dim, True)
    swizzle = drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE if plain else \
        drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B
    box_cols = head_dim if plain else (128 if fp8 else 64)
    blocks, bs, heads = call.num_blocks, call.block_size, call.Hkv
    maps = bytearray()
    for t, (s_block, s_row, s_head) in ((k, call.k_strides), (v, call.v_strides)):
        if s_head < s_row:    # NHD
            dims, strides, box, row_dim = (call.D, heads, bs, blocks), (s_head, s_row, s_block), (box_cols, 1, 16, 1), 2
        else:                 # HND
            dims, strides, box, row_dim = (call.D, bs, heads, blocks), (s_row, s_head, s_block), (box_cols, 16, 1, 1), 1
        tmap = check(drv.cuTensorMapEncodeTiled(
            dtype, 4, t.data_ptr(), [drv.cuuint64_t(x) for x in dims],
            [drv.cuuint64_t(x * width) for x in strides], [drv.cuuint32_t(x) for x in box],
            [drv.cuuint32_t(1)] * 4,
            drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
            getattr(drv.CUtensorMapL2promotion, "CU_TENSOR_MAP_L2_PROMOTION_" + TMA_L2_PROMOTION),
            drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
        maps += ctypes.string_at(int(tmap.getPtr()), 128)
    return torch.frombuffer(maps, dtype=torch.uint8).to(k.device), row_dim


MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y


_PLANS: dict[tuple, _Plan] = {}


def check_unsupported(unsupported: dict, who: str = "flash_attn_varlen_func") -> None:
    """FlashAttention keywords pagedattn accepts only at their harmless values."""
    for name, value in unsupported.items():
        if name not in _UNSUPPORTED_OK:
            raise TypeError(f"{who}() got an unexpected keyword argument {name!r}")
        if not _is_default(value, _UNSUPPORTED_OK[name]):
            raise NotImplementedError(f"pagedattn.{who} does not support {name}={value!r} yet")


def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None,
                           seqused_k=None, softmax_scale=None, causal=False, block_table=None,
                           return_softmax_lse=False, out=None, num_splits=0, k_descale=None,
                           v_descale=None, kv_cache_dtype=None, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, s_aux=None, sinks=None, validate: bool = False, **unsupported):
    """FlashAttention over packed variable-length queries and a paged (or contiguous) KV cache.

    Paged: k, v are caches [num_blocks, block_size, Hkv, D] (NHD or HND), block_table int32
    [B, max_blocks], seqused_k int32 [B]. Contiguous: k, v [total_k, Hkv, D] and cu_seqlens_k.
    q [total_q, Hq, D] fp16/bf16, cu_seqlens_q int32 [B + 1]. Causal masking is bottom-right aligned.
    fp8 caches (uint8 + kv_cache_dtype, or float8 tensors) need k_descale / v_descale ([1], [Hkv] or
    [B, Hkv]); they are dequantised inside the kernel. Returns out, or (out, lse [Hq, total_q]).
    num_splits: 0 = heuristic, 1 = no split-KV, >1 = that many splits (capped by the KV length).

    Validation runs once per distinct tensor metadata (shapes without total_q, strides, dtypes,
    devices); repeated calls only re-check the scalars, token counts and pointer alignment.
    validate=True (or PAGEDATTN_DEBUG=1) also checks the values on every call (check_values: offsets,
    lengths, block ids, descales; syncs).

    Under torch.compile this calls the custom op torch.ops.pagedattn.flash_attn_varlen_func (its
    .out overload when out is given; pagedattn.ops.library), whose fake implementation runs the same
    metadata checks; in eager it runs `attend` directly (the dispatcher would cost host time).
    """
    if unsupported:
        check_unsupported(unsupported)
    if s_aux is not None and sinks is not None:
        raise ContractError("give the sink logits once: s_aux (vLLM's name) or sinks, not both")
    if s_aux is not None:
        sinks = s_aux
    if torch.compiler.is_compiling() or traced(q):
        from . import library

        return library.varlen_op(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, seqused_k,
                                 softmax_scale, causal, block_table, return_softmax_lse, out, num_splits,
                                 k_descale, v_descale, kv_cache_dtype, window_size, softcap, alibi_slopes,
                                 sinks)
    out, lse = attend(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, seqused_k,
                      softmax_scale, causal, block_table, return_softmax_lse, out, num_splits, k_descale,
                      v_descale, kv_cache_dtype, window_size, softcap, alibi_slopes, sinks, validate)
    return (out, lse) if return_softmax_lse else out


def fake_attend(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, seqused_k, softmax_scale,
                causal, block_table, return_softmax_lse, out, num_splits, k_descale, v_descale,
                kv_cache_dtype, window_size, softcap, alibi_slopes, sinks):
    """What `attend` checks and returns, for tensors without data (the fake implementations of
    pagedattn.ops.library): the same checks in the same order, so the same ContractErrors."""
    check_scalars(max_seqlen_q, max_seqlen_k, softmax_scale, num_splits)
    call = _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, out, kv_cache_dtype,
                     k_descale, v_descale, pointers=False)
    features_of(call, q.device, causal, window_size, softcap, alibi_slopes, sinks)
    return outputs(q, call.Hq, return_softmax_lse, out)


def outputs(q, Hq, return_softmax_lse, out=None):
    """(out like q, lse float32 [Hq, total_q] or None): what attend allocates, fake or real."""
    if out is None:
        out = torch.empty_like(q)
    lse = torch.empty(Hq, q.shape[0], dtype=torch.float32, device=q.device) if return_softmax_lse else None
    return out, lse


def attend(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, seqused_k, softmax_scale,
           causal, block_table, return_softmax_lse, out, num_splits, k_descale, v_descale, kv_cache_dtype,
           window_size, softcap, alibi_slopes, sinks, validate=False):
    """flash_attn_varlen_func's implementation (the eager call and the custom op both run it):
    returns (out, lse or None)."""
    checked = check_call(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, seqused_k,
                         softmax_scale, causal, block_table, out, num_splits, k_descale, v_descale, kv_cache_dtype,
                         window_size, softcap, alibi_slopes, sinks, validate)
    return launch(checked, q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, seqused_k, causal,
                  block_table, return_softmax_lse, out, num_splits, k_descale, v_descale)


def check_call(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, seqused_k, softmax_scale,
               causal, block_table, out, num_splits, k_descale, v_descale, kv_cache_dtype, window_size, softcap,
               alibi_slopes, sinks, validate=False):
    """Every check of a call, before anything runs: (plan, softmax_scale, features) for `launch`.
    The metadata part is validated once per distinct signature (_PLANS)."""
    softmax_scale = check_scalars(max_seqlen_q, max_seqlen_k, softmax_scale, num_splits)
    debug = validate or envs.debug()
    try:
        # flat, one attribute lookup each: this runs on every call (a non-tensor fails here, below)
        sig = (q.shape[1:], q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
               v.shape, v.stride(), v.dtype, v.device, cu_seqlens_q.shape, cu_seqlens_q.stride(),
               cu_seqlens_q.dtype, cu_seqlens_q.device, _sig(cu_seqlens_k), _sig(seqused_k), _sig(block_table),
               None if out is None else _sig(out)[1:] + (out.shape[1:],), kv_cache_dtype,
               None if k_descale is None else _sig(k_descale), None if v_descale is None else _sig(v_descale))
        plan = _PLANS.get(sig)
    except (AttributeError, TypeError):  # not tensors: the full validation explains
        sig, plan = None, None
    if plan is not None and ((q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15 or
                             (out is not None and (out.shape[0] != q.shape[0] or out.data_ptr() & 15))):
        plan = None  # something only the full validation can name
    values = (q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
              k_descale, v_descale) if debug else None
    if plan is None:
        call = _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, out, kv_cache_dtype,
                         k_descale, v_descale)
        if debug:  # before the CUDA check: CPU tensors get the value checks too
            check_values(call, *values)
        features = features_of(call, q.device, causal, window_size, softcap, alibi_slopes, sinks)
        _require_cuda(q)
        plan = _Plan(call, q, block_table, k_descale, v_descale)
        if sig is not None:
            if len(_PLANS) > 256:
                _PLANS.clear()
            _PLANS[sig] = plan
        return plan, softmax_scale, features
    if debug:
        check_values(plan.call, *values)
    return plan, softmax_scale, features_of(plan.call, q.device, causal, window_size, softcap, alibi_slopes, sinks)


def launch(checked, q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, seqused_k, causal,
           block_table, return_softmax_lse, out, num_splits, k_descale, v_descale):
    """Allocate the outputs, choose variant and splits, launch: a call check_call accepted."""
    plan, softmax_scale, (flags, w_left, w_right, cap, alibi_slopes, alibi_stride, sinks) = checked
    call = plan.call
    total_q = q.shape[0]
    out, lse = outputs(q, call.Hq, return_softmax_lse, out)
    if total_q == 0 or call.B == 0:
        return out, lse
    group = plan.group
    # max_seqlen_q / max_seqlen_k choose the variant and size the grid. Every index stays inside the
    # tensors whatever they say (tile_scheduler.cuh); rows past an understated max_seqlen_q take a slow
    # out-of-line path (attn_fwd.cuh). A request's rows are at most total_q: no more row tiles than that.
    rows = max(0, int(max_seqlen_q)) * group
    variant = plan.kernel(plan.mode_for(rows), flags)
    m_blocks = -(-min(rows, total_q * group) // variant.block_m)
    m_blocks = min(max(1, m_blocks), MAX_GRID_Y)
    # splits divide the keys a tile can see: with a left window edge, at most the window and the rows.
    # The split plan depends on shapes and max_seqlen_k only (never on seqused_k's values): a CUDA
    # graph captured with it stays right for any lengths up to max_seqlen_k.
    keys = max(0, int(max_seqlen_k))
    if w_left >= 0:
        keys = min(keys, w_left + 1 + max(0, int(max_seqlen_q)) + (0 if causal or w_right < 0 else w_right))
    ctas = plan.tiles_per_row * m_blocks
    splits = splits_for(int(num_splits), ctas, keys, variant.stage_keys, variant.capacity)
    scale = softmax_scale if softmax_scale is not None else plan.default_scale
    capturing = _is_capturing() if splits > 1 or variant.mode == "decode_tma" else False
    o_ptr = lse_ptr = counters_ptr = 0
    if splits > 1:
        o_ptr, lse_ptr, counters_ptr = workspace.split_scratch(plan.device, splits, total_q, call.Hq,
                                                               variant.head_dim, ctas, capturing)
    maps_ptr = row_dim = 0
    if variant.mode == "decode_tma":
        maps, row_dim = plan.tma_maps(k, v, capturing)
        maps_ptr = maps.data_ptr()
    q_stride, out_stride = q.stride(), out.stride()
    values = (
        q.data_ptr(), out.data_ptr(), 0 if lse is None else lse.data_ptr(), k.data_ptr(), v.data_ptr(),
        0 if block_table is None else block_table.data_ptr(), cu_seqlens_q.data_ptr(),
        0 if seqused_k is None else seqused_k.data_ptr(), 0 if cu_seqlens_k is None else cu_seqlens_k.data_ptr(),
        0 if k_descale is None else k_descale.data_ptr(), 0 if v_descale is None else v_descale.data_ptr(),
        o_ptr, lse_ptr, maps_ptr, counters_ptr, 0 if alibi_slopes is None else alibi_slopes.data_ptr(),
        0 if sinks is None else sinks.data_ptr(), q_stride[0], q_stride[1], out_stride[0], out_stride[1],
        *plan.geometry, total_q, 0 if call.paged else k.shape[0], splits, int(bool(causal)),
        plan.dbs, plan.dhs, row_dim, w_left, w_right, alibi_stride, scale * LOG2E, cap)
    variant.launcher((plan.tiles_per_row, m_blocks, splits), variant.threads, values)
    return out, lse
