"""reshape_and_cache_flash: validation at the API boundary, variant choice, launch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .. import envs
from .plans import PlanCache
from ..contract import CacheSpec, ContractError, check_scale_values, describe, traced
from ..dtypes import CUDA_TYPE, FP8_FORMAT, short
from ..registry import KernelSpec, get_kernel, register, sm_count
from .params import KvWriteParams



@register
@dataclass(frozen=True)
class KvWriteSpec(KernelSpec):
    """One cache-write variant: input dtype, what the cache stores, and the copy path."""
    FAMILY: ClassVar[str] = "kv_write"
    TEMPLATE: ClassVar[str] = "kv_write.cu.j2"
    ENTRY: ClassVar[str] = "kv_write_kernel"
    PARAMS: ClassVar = KvWriteParams
    SUPPORTED: ClassVar[dict] = {
        "dtype": ("fp16", "bf16", "fp32"),
        "kv_cache_dtype": ("auto", "fp8_e4m3", "fp8_e5m2"),
        "path": ("span", "head", "flat"),
    }

    dtype: str
    kv_cache_dtype: str
    path: str   # span: NHD + one scale; head: HND or per-head scales; flat: any, rows 16-byte aligned

    def context(self) -> dict:
        cache = self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        return {
            "Element": CUDA_TYPE[self.dtype],
            "CacheElement": CUDA_TYPE[cache],
            "kFp8": FP8_FORMAT[self.kv_cache_dtype],
            "path": self.path,
            "kSpan": "true" if self.path == "span" else "false",
            "kItems": flat_max_items(self.kv_cache_dtype),
            "kStreamItems": stream_items(self.kv_cache_dtype) if self.path == "flat" else 0,
            "launch_bounds": (flat_bounds(self.kv_cache_dtype) if self.path == "flat" else "1024"),
        }


# CTA shape of span/head. A CTA writes one token and spends most of its short life waiting (the slot
# id, then the K/V packs). With many tokens, small CTAs with several packs per thread -- many CTAs per
# SM -- keep more bytes in flight; with few tokens the GPU is far from full and one pack per thread
# finishes first.
# Measured on H200, H=8 D=128 bf16 NHD: T=65536 1 pack/thread 79 % of copy, 4 packs 90 %
# (perf/results/h200_sm90_20261130_write.json, history/write_sweep_*.json); T=256 5.8 us with 1 pack,
# 7.2 us with 4 (h200_sm90_20261130.json vs _write.json).
MANY_TOKENS = 1024         # from here on, the many-token shapes below
SPAN_PACKS_PER_THREAD = 4  # span path, many tokens: threads per tensor = packs / 4, whole warps
HEAD_WARPS = 4             # head path, many tokens: warps per CTA, heads strided over them

# The flat path (kv_write.cuh): no CTA per token; each thread takes `items` 16-byte packs of the flat
# (token, K/V, head, pack) space and issues all their loads before any store. Which writes take it is
# the table FLAT_FOR of (layout, kind) pairs, kind "copy" (cache dtype = input dtype), "fp8" (one
# scale) or "fp8_head" (per-head scales); perf/write_sweep.py (stage writesweep) measures each pair
# both ways. Whatever the table says, flat needs every head row 16-byte aligned (D * element size %
# 16 == 0, key/value base pointers and token strides multiples of 16 bytes); other writes take
# span/head, as do writes of fewer than FLAT_MIN_TOKENS tokens.
# Measured on H200 (write_sweep, H=8 D=128 bf16 input, block 16, random slots; fraction of the copy
# ceiling at T=65536, us at T=256), old path -> flat at the defaults below:
#   NHD copy     92 % -> 92 %, 5.76 -> 5.57 us      HND copy     79 % -> 93 %, 5.76 -> 5.60 us
#   NHD fp8      73 % -> 60 %, 5.82 -> 5.95 us      HND fp8      44 % -> 60 %, 6.18 -> 5.98 us
#   NHD fp8_head 44 % -> 60 %, 6.14 -> 5.95 us      HND fp8_head 44 % -> 60 %, 6.21 -> 5.98 us
# so NHD fp8 with one scale stayed on span (one slot and one scale per CTA) until the streaming schedule
# below passed it. Packs per thread: 4 from MANY_TOKENS on (2: 48 %, 1: 39 % for one-shot fp8; copy
# 93 / 87 / 57 %); 1 below (fp8 at T=256: 2 packs 6.3 us, 1 pack 5.95). Threads per CTA matter little
# (64-256 within 1 %; 512 is worse everywhere).
FLAT_FOR = frozenset({("NHD", "copy"), ("NHD", "fp8"), ("NHD", "fp8_head"),
                      ("HND", "copy"), ("HND", "fp8"), ("HND", "fp8_head")})
FLAT_MIN_TOKENS = 1
FLAT_MAX_ITEMS = 4         # kItems compiled into the flat variants: they run 1, 2 or this many packs
                           # per thread (changing it at run time: clear registry.get_kernel too)
FLAT_ITEMS = 4             # packs per thread from MANY_TOKENS tokens on (run time; others round up)
FLAT_ITEMS_FEW = 1         # below MANY_TOKENS
FLAT_THREADS = 256         # threads per CTA from MANY_TOKENS tokens on
FLAT_THREADS_FEW = 128     # below MANY_TOKENS
FLAT_MAX_THREADS = 512     # __launch_bounds__ of the flat variants
# Streaming schedule of the flat path (kv_write.cuh, kStream), fp8 only: from MANY_TOKENS tokens on,
# the writes of the kinds in FLAT_STREAM_FOR get a grid capped at FLAT_STREAM_WAVES resident waves
# (occupancy calculator); each thread loops over batches of FLAT_STREAM_ITEMS items (an item: two packs
# of one head row where rows pair up, one 16-byte fp8 store) and loads batch i + 1 while it converts
# batch i, so the per-thread setup (cursor divisions, scale loads, inverses) is paid once.
# Why: ncu of the one-shot HND fp8 write (perf/results/ncu/ncu_write_HND_fp8_e0eb45b.txt) showed
# issue slots 70 % busy and DRAM 47 %: about 240 instructions per 16-byte pack, 70 of them conversion.
# The streaming body is compiled only into the variants of these kinds, and those variants are built
# for occupancy: one-shot bodies of at most FLAT_STREAM_ONESHOT_ITEMS packs (more streams), CTAs of at
# most FLAT_STREAM_MAX_THREADS threads, __launch_bounds__ asking for FLAT_STREAM_MIN_BLOCKS CTAs per SM
# (ptxas sizes a kernel for its largest body). Measured on H200 (write_sweep, T=65536, fraction of
# copy; perf/results/history/write_sweep_h200_*):
#   one-shot, 4 packs/thread (e0eb45b):         fp8 54 % in every layout/scale (NHD fp8 span 78 %)
#   streaming, batches of 1 item, min blocks 4:  NHD fp8 87, NHD fp8_head 90, HND fp8 82, HND fp8_head 84 %
#   worse: min blocks 5 (48 registers, spills) 76-83 %, min blocks 6 58 %; one-pack items 61-65 %;
#          batches of 2 items 68-72 %, of 4 items 55-60 %; one-shot 8 packs/thread 35 %
FLAT_STREAM_FOR = frozenset({"fp8", "fp8_head"})
FLAT_STREAM_WAVES = 1
FLAT_STREAM_ITEMS = 1
FLAT_STREAM_ONESHOT_ITEMS = 2
FLAT_STREAM_MAX_THREADS = 256
FLAT_STREAM_MIN_BLOCKS = 4


def stream_items(kv_cache_dtype: str) -> int:
    """Batch size of the streaming body compiled into the flat variant of this kv_cache_dtype (0: none)."""
    kinds = {"copy"} if kv_cache_dtype == "auto" else {"fp8", "fp8_head"}
    return FLAT_STREAM_ITEMS if kinds & FLAT_STREAM_FOR and FLAT_STREAM_WAVES > 0 else 0


def flat_max_items(kv_cache_dtype: str) -> int:
    """kItems of the flat variant: the most packs per thread of its one-shot schedule."""
    return min(FLAT_MAX_ITEMS, FLAT_STREAM_ONESHOT_ITEMS) if stream_items(kv_cache_dtype) else FLAT_MAX_ITEMS


def flat_max_threads(kv_cache_dtype: str) -> int:
    return FLAT_STREAM_MAX_THREADS if stream_items(kv_cache_dtype) else FLAT_MAX_THREADS


def flat_bounds(kv_cache_dtype: str) -> str:
    """__launch_bounds__ arguments of the flat variant."""
    if stream_items(kv_cache_dtype) and FLAT_STREAM_MIN_BLOCKS:
        return f"{FLAT_STREAM_MAX_THREADS}, {FLAT_STREAM_MIN_BLOCKS}"
    return str(flat_max_threads(kv_cache_dtype))


_MAX_GRID = (1 << 31) - 1


def base_path(spec: CacheSpec) -> str:
    """The one-CTA-per-token path a write takes when it does not take flat."""
    return "span" if spec.layout == "NHD" and (spec.scale == "tensor" or not spec.is_fp8) else "head"


def write_kind(spec: CacheSpec) -> tuple[str, str]:
    """The (layout, kind) entry of FLAT_FOR that a write of this cache falls under."""
    kind = "copy" if not spec.is_fp8 else "fp8_head" if spec.scale == "head" else "fp8"
    return spec.layout, kind


def flat_tokens(spec: CacheSpec, elem_bytes: int) -> range:
    """Token counts for which a write of this cache and input element size takes the flat path
    (empty when FLAT_FOR does not name it or its head rows cannot be 16-byte aligned)."""
    if write_kind(spec) not in FLAT_FOR or spec.head_size * elem_bytes % 16:
        return range(0)
    token_packs = 2 * spec.num_kv_heads * spec.head_size * elem_bytes // 16
    # grid <= 2^31 - 1 even for CTAs of one warp and one pack per thread
    return range(max(FLAT_MIN_TOKENS, 1), min(_MAX_GRID, _MAX_GRID * 32 // token_packs) + 1)  # int32 num_tokens


def rows_aligned(key, value) -> bool:
    """Every (token, head) row of key and value starts on 16 bytes (given D * element size % 16 == 0)."""
    return not any((t.data_ptr() | t.stride(0) * t.element_size()) & 15 for t in (key, value))


def write_path(spec: CacheSpec, elem_bytes: int, num_tokens: int, aligned: bool) -> str:
    """The one place a write's path is chosen: flat when flat_tokens() admits the token count and the
    rows are aligned (rows_aligned), else base_path. (_Plan/_launch apply exactly this, split into
    the part fixed by tensor metadata and the per-call part: token count and base pointers.)"""
    if aligned and num_tokens in flat_tokens(spec, elem_bytes):
        return "flat"
    return base_path(spec)


def _threads(spec: CacheSpec, path: str, elem_bytes: int, many_tokens: bool) -> int:
    """Threads per CTA of span/head."""
    if path == "head":
        return 32 * min(spec.num_kv_heads, HEAD_WARPS if many_tokens else 8)
    packs = -(-spec.num_kv_heads * spec.head_size * elem_bytes // 16)  # per tensor
    per_tensor = -(-packs // SPAN_PACKS_PER_THREAD) if many_tokens else packs
    return 2 * min(max(32, -(-per_tensor // 32) * 32), 512)


def _flat_shape(num_tokens: int, token_packs: int, many: tuple[int, int], few: tuple[int, int],
                stream_ctas: int = 0):
    """(grid, block) of a flat launch; many/few: (items, threads) from MANY_TOKENS tokens on / below.
    Whole warps, no more threads than packs / items; the kernel reads items back from the grid size.
    stream_ctas > 0 (many tokens only): the grid is capped there, and a cap below packs / (items *
    threads) makes the kernel stream (see FLAT_STREAM_FOR)."""
    many_tokens = num_tokens >= MANY_TOKENS
    items, threads = many if many_tokens else few
    packs = num_tokens * token_packs
    threads = max(32, min(threads, -(-packs // (32 * items)) * 32))
    grid = -(-packs // (threads * items))
    if many_tokens and stream_ctas > 0:
        grid = min(grid, stream_ctas)
    return (grid, 1, 1), (threads, 1, 1)


def _check_scale(name, scale, spec: CacheSpec, device) -> int:
    """Validate an fp8 scale tensor; return its stride over heads (0 tensor, 1 head). One scale may
    be [1] or 0-d (vLLM's layer scales are 0-d): the kernel reads the same single float."""
    if scale is None:
        raise ContractError(f"kv_cache_dtype={spec.kv_cache_dtype!r} needs {name} (float32 [1] or [H])")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        raise ContractError(f"{name} must be a float32 tensor, got {describe(scale)}")
    if spec.scale == "tensor":
        if scale.numel() != 1:
            raise ContractError(f"{name} must hold one scale ([1] or 0-d) for scale granularity 'tensor', "
                                f"got shape {tuple(scale.shape)}")
    elif scale.dim() != 1 or scale.numel() != spec.num_kv_heads or scale.stride(0) != 1:
        raise ContractError(f"{name} must be a contiguous [{spec.num_kv_heads}] tensor for scale granularity "
                            f"'head', got shape {tuple(scale.shape)} strides {scale.stride()}")
    if scale.device != device:
        raise ContractError(f"{name} is on {scale.device}, the cache on {device}")
    return 0 if spec.scale == "tensor" else 1


def check_new_tokens(spec: CacheSpec, key, value, key_cache, slot_mapping,
                     input_dtypes=(torch.float16, torch.bfloat16, torch.float32), who="the writer") -> int:
    """The checks every cache writer shares: new K/V tokens and their slot_mapping against the cache.
    Returns the number of tokens to write."""
    h, d = spec.num_kv_heads, spec.head_size
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise ContractError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3 or tuple(t.shape[1:]) != (h, d):
            raise ContractError(f"{name} must have shape [T, {h}, {d}] to match the cache, "
                                f"got {tuple(t.shape)}")
        if t.dtype not in input_dtypes:
            names = ", ".join(short(x) for x in input_dtypes)
            raise ContractError(f"{name} dtype {t.dtype} is not supported by {who} ({names})")
        if t.device != key_cache.device:
            raise ContractError(f"{name} is on {t.device}, the cache on {key_cache.device}")
        if t.stride(2) != 1 or (h > 1 and t.stride(1) != d):
            raise ContractError(f"{name}'s (H, D) part must be dense (strides [*, {d}, 1]), "
                                f"got strides {t.stride()}")
    if key.dtype != value.dtype:
        raise ContractError(f"key ({key.dtype}) and value ({value.dtype}) differ in dtype")
    if key.shape[0] != value.shape[0]:
        raise ContractError(f"key has {key.shape[0]} tokens, value {value.shape[0]}")
    if not spec.is_fp8 and key.dtype != spec.dtype:
        raise ContractError(f"kv_cache_dtype='auto' needs the cache dtype ({spec.dtype}) to equal the "
                            f"input dtype ({key.dtype})")
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ContractError(f"slot_mapping must be an int64 (or int32) tensor, got "
                            f"{getattr(slot_mapping, 'dtype', type(slot_mapping).__name__)}")
    if slot_mapping.device != key_cache.device:
        raise ContractError(f"slot_mapping is on {slot_mapping.device}, the cache on {key_cache.device}")
    if slot_mapping.dim() != 1 or (slot_mapping.numel() > 1 and slot_mapping.stride(0) != 1):
        raise ContractError(f"slot_mapping must be a contiguous 1-D tensor, got shape "
                            f"{tuple(slot_mapping.shape)} strides {slot_mapping.stride()}")
    num_tokens = slot_mapping.numel()
    if num_tokens > key.shape[0]:
        raise ContractError(f"slot_mapping has {num_tokens} entries but key/value only {key.shape[0]} "
                            "tokens")
    return num_tokens


def validate_inputs(spec: CacheSpec, key, value, key_cache, slot_mapping, k_scale, v_scale):
    """Every check happens here, before any kernel runs. Returns (num_tokens, scale_stride)."""
    num_tokens = check_new_tokens(spec, key, value, key_cache, slot_mapping)
    scale_stride = 0
    if spec.is_fp8:
        scale_stride = _check_scale("k_scale", k_scale, spec, key_cache.device)
        _check_scale("v_scale", v_scale, spec, key_cache.device)
    return num_tokens, scale_stride


def _require_cuda(key_cache) -> None:
    if key_cache.device.type != "cuda":
        raise ContractError(f"reshape_and_cache_flash runs on CUDA tensors; key_cache is on {key_cache.device} "
                            "(for CPU tensors use pagedattn.reference.reshape_and_cache_flash)")


def check_slots(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Debug check (syncs): every slot < num_slots. Names the first bad token."""
    bad = (slot_mapping >= num_slots).nonzero()
    if bad.numel():
        t = int(bad[0, 0])
        raise ContractError(f"slot_mapping[{t}] = {int(slot_mapping[t])} is outside the cache "
                            f"(num_blocks * block_size = {num_slots}); {bad.numel()} bad token(s)")


class _Plan:
    """Everything about a call that depends only on tensor metadata: validated once, reused."""
    __slots__ = ("spec", "device", "base_spec", "base", "block_few", "block_many", "flat", "flat_tokens",
                 "flat_shape", "tail", "is_fp8", "num_slots", "slot64", "flat_grids")

    def __init__(self, spec: CacheSpec, key, value, key_cache, slot_mapping, scale_stride):
        elem = key.element_size()
        dtype = short(key.dtype)
        self.spec = spec
        self.device = key_cache.device.index
        # the span/head variant: loaded on first use (a flat-only workload never compiles it)
        self.base_spec = KvWriteSpec(dtype, spec.kv_cache_dtype, base_path(spec))
        self.base = None
        self.block_few = (_threads(spec, self.base_spec.path, elem, False), 1, 1)
        self.block_many = (_threads(spec, self.base_spec.path, elem, True), 1, 1)
        # write_path, metadata part: the token range (empty: never flat) with the token strides'
        # alignment folded in; _launch checks the count and the base pointers.
        strides_ok = not any(t.stride(0) * elem % 16 for t in (key, value))
        self.flat_tokens = flat_tokens(spec, elem) if strides_ok else range(0)
        self.flat = None
        if self.flat_tokens:
            self.flat = get_kernel(KvWriteSpec(dtype, spec.kv_cache_dtype, "flat")).launcher(self.device)
        # token_packs, (items, threads) with many / few tokens, the streaming grid cap (0: none)
        stream_ctas = 0
        if (self.flat is not None and write_kind(spec)[1] in FLAT_STREAM_FOR
                and stream_items(spec.kv_cache_dtype) > 0):
            sms = sm_count(self.device)
            threads = min(FLAT_THREADS, flat_max_threads(spec.kv_cache_dtype))
            stream_ctas = max(1, int(sms * self.flat.max_active_blocks(threads) * FLAT_STREAM_WAVES))
        cap = flat_max_threads(spec.kv_cache_dtype)
        self.flat_shape = (2 * spec.num_kv_heads * spec.head_size * elem // 16,
                           (min(FLAT_ITEMS, FLAT_MAX_ITEMS), min(FLAT_THREADS, cap)),
                           (min(FLAT_ITEMS_FEW, FLAT_MAX_ITEMS), min(FLAT_THREADS_FEW, cap)), stream_ctas)
        bs, ps, hs, _ = key_cache.stride()
        # Params after the 7 pointers: strides, CacheGeometry, scale_stride (slot_is_int64, num_tokens per call)
        self.tail = (bs, ps, hs, spec.num_slots, spec.num_blocks, spec.block_size, spec.num_kv_heads,
                     spec.head_size, scale_stride)
        self.is_fp8 = spec.is_fp8
        self.num_slots = spec.num_slots
        self.slot64 = int(slot_mapping.dtype == torch.int64)
        self.flat_grids: dict[int, tuple] = {}  # num_tokens -> _flat_shape (engines repeat a few counts)

    def base_launcher(self):
        if self.base is None:
            self.base = get_kernel(self.base_spec).launcher(self.device)
        return self.base


def write_with_spec(spec: CacheSpec, key, value, key_cache, value_cache, slot_mapping,
                    k_scale=None, v_scale=None, validate: bool | None = None) -> None:
    num_tokens, scale_stride = validate_inputs(spec, key, value, key_cache, slot_mapping,
                                               k_scale, v_scale)
    _require_cuda(key_cache)
    plan = _Plan(spec, key, value, key_cache, slot_mapping, scale_stride)
    _launch(plan, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, num_tokens,
            validate)


def _launch(plan, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, num_tokens,
            validate):
    if validate or (validate is None and envs.debug()):
        check_slots(slot_mapping, plan.num_slots)
        if plan.is_fp8:
            check_scale_values("k_scale", k_scale)
            check_scale_values("v_scale", v_scale)
    if num_tokens == 0:
        return
    kp, vp = key.data_ptr(), value.data_ptr()
    head = (kp, vp, key_cache.data_ptr(), value_cache.data_ptr(), slot_mapping.data_ptr(),
            k_scale.data_ptr() if plan.is_fp8 else 0, v_scale.data_ptr() if plan.is_fp8 else 0,
            key.stride(0), value.stride(0)) + plan.tail
    if num_tokens in plan.flat_tokens and not (kp | vp) & 15:  # write_path == "flat"
        shape = plan.flat_grids.get(num_tokens)
        if shape is None:
            if len(plan.flat_grids) >= 1024:
                plan.flat_grids.clear()
            shape = plan.flat_grids[num_tokens] = _flat_shape(num_tokens, *plan.flat_shape)
        grid, block = shape
        plan.flat(grid, block, head + (plan.slot64, num_tokens))
        return
    plan.base_launcher()((num_tokens, 1, 1), plan.block_many if num_tokens >= MANY_TOKENS else plan.block_few,
                         head + (plan.slot64, num_tokens))


def _scale_sig(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device) \
        if isinstance(t, torch.Tensor) else type(t)


_PLANS = PlanCache()


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto",
                            k_scale=None, v_scale=None, *, validate: bool | None = None) -> None:
    """Write new K/V tokens into a paged cache (vLLM's `reshape_and_cache_flash` semantics).

    key, value: [T_pad, H, D] fp16/bf16/fp32, (H, D) dense; only the first slot_mapping.numel()
    tokens are read. slot < 0 skips a token. Caches: [num_blocks, block_size, H, D], NHD or HND.
    kv_cache_dtype: "auto" | "fp8" | "fp8_e4m3" | "fp8_e5m2"; fp8 needs float32 k_scale/v_scale of
    shape [1] or 0-d (per tensor) or [H] (per head): stored = saturate_to_finite(x / scale).
    validate=True (or PAGEDATTN_DEBUG=1) also checks every slot < num_blocks*block_size and the
    scales finite and > 0 (syncs).

    Validation runs once per distinct tensor metadata (shapes without T, strides, dtypes, devices);
    later calls with the same metadata only re-check what can change (token counts, alignment).

    Under torch.compile this calls the custom op torch.ops.pagedattn.reshape_and_cache_flash
    (pagedattn.ops.library; PAGEDATTN_DEBUG still applies, validate= does not); in eager it runs here.
    """
    if torch.compiler.is_compiling() or traced(key_cache):
        torch.ops.pagedattn.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
                                                    kv_cache_dtype or "auto", k_scale, v_scale)
        return
    try:
        sig = (key.shape[1:], key.stride(), key.dtype, key.device, value.shape[1:], value.stride(),
               value.dtype, value.device, key_cache.shape, key_cache.stride(), key_cache.dtype, key_cache.device,
               value_cache.shape, value_cache.stride(), value_cache.dtype, value_cache.device,
               slot_mapping.dim(), slot_mapping.stride(), slot_mapping.dtype, slot_mapping.device,
               kv_cache_dtype, _scale_sig(k_scale), _scale_sig(v_scale))
        plan = _PLANS.get(sig)
    except (AttributeError, TypeError):  # not tensors: the slow path explains
        plan = None
    if plan is not None:
        num_tokens = slot_mapping.numel()
        if (num_tokens <= key.shape[0] and key.shape[0] == value.shape[0]
                and not (key_cache.data_ptr() | value_cache.data_ptr()) & 15):
            _launch(plan, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                    num_tokens, validate)
            return
    spec, num_tokens, scale_stride = check_metadata(key, value, key_cache, value_cache, slot_mapping,
                                                    kv_cache_dtype, k_scale, v_scale)
    _require_cuda(key_cache)
    plan = _Plan(spec, key, value, key_cache, slot_mapping, scale_stride)
    _PLANS.remember(sig, plan)
    _launch(plan, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, num_tokens,
            validate)


def check_metadata(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale,
                   pointers: bool = True):
    """Every metadata check of a write, no syncs: (CacheSpec, num_tokens, scale_stride). The eager
    call and the fake implementation of torch.ops.pagedattn.reshape_and_cache_flash (pointers=False:
    no base-pointer checks on tensors without data) both run it."""
    scale = "tensor"
    if isinstance(k_scale, torch.Tensor) and k_scale.numel() > 1:
        scale = "head"
    spec = CacheSpec.from_tensors(key_cache, value_cache, kv_cache_dtype=kv_cache_dtype, scale=scale,
                                  pointers=pointers)
    num_tokens, scale_stride = validate_inputs(spec, key, value, key_cache, slot_mapping, k_scale, v_scale)
    return spec, num_tokens, scale_stride
