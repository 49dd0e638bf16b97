"""reshape_and_cache_flash: validation at the API boundary, variant choice, launch."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .. import envs
from . import steady
from .plans import PlanCache
from ..contract import CacheSpec, ContractError, check_scale_values, describe, traced
from ..dtypes import CUDA_TYPE, FP8_FORMAT, short
from ..registry import KernelSpec, UnsupportedError, get_kernel, register, sm_count
from .params import KvWriteParams


# -- compile-time choices: the flat variants' shape (measurements: perf/README.md, "Write path") ------
# kItems: the most packs per thread of the one-shot body; kStreamItems: the streaming body's batch
# (0: none); __launch_bounds__(max_threads, min_blocks). Per cache dtype: "copy" (auto) or "fp8".
FLAT_BUILD = {
    "copy": dict(max_items=4,     # perf/results/history/write_sweep_h200_items8_5cf134a.json
                 stream_items=0,  # copies do not stream: perf/results/history/write_sweep_h200_stream_2af0687.json
                 max_threads=512, # perf/results/write_sweep_h200_20261130_flat.json
                 min_blocks=0),
    "fp8": dict(max_items=2,      # perf/results/history/write_sweep_h200_minblocks_8813aaf.json
                stream_items=1,   # perf/results/history/write_sweep_h200_stream_shapes_a72ae13.json
                max_threads=256,  # perf/results/history/write_sweep_h200_minblocks_8813aaf.json
                min_blocks=4),    # perf/results/history/write_sweep_h200_minblocks_8813aaf.json (5 spills)
}
BUILD_FIELDS = tuple(FLAT_BUILD["copy"])
_BUILD_RULES = {"max_items": (lambda v: v >= 2, "the one-shot body takes 2 or more"),
                "stream_items": (lambda v: v >= 0, "0 (no streaming body) or the packs per batch"),
                "max_threads": (lambda v: 32 <= v <= 512 and v % 32 == 0, "whole warps, at most 512"),
                "min_blocks": (lambda v: v >= 0, "0 (no minimum) or CTAs per SM")}


def _build_kind(kv_cache_dtype: str) -> str:
    return "copy" if kv_cache_dtype == "auto" else "fp8"


@register
@dataclass(frozen=True)
class KvWriteSpec(KernelSpec):
    """One cache-write variant: input dtype, what the cache stores, and the copy path."""
    FAMILY: ClassVar[str] = "kv_write"
    TEMPLATE: ClassVar[str] = "kv_write.cu.j2"
    PARAMS: ClassVar = KvWriteParams
    SUPPORTED: ClassVar[dict] = {
        "dtype": ("fp16", "bf16", "fp32"),
        "kv_cache_dtype": ("auto", "fp8_e4m3", "fp8_e5m2"),
        "path": ("span", "head", "flat"),
    }

    dtype: str
    kv_cache_dtype: str
    path: str   # span: NHD + one scale; head: HND or per-head scales; flat: any, rows 16-byte aligned
    # flash_attn_with_kvcache's write (Appender): slots from cache_seqlens + block_table, seqused_k written.
    # Like the tuning fields below it is not part of the AOT matrix (its kernels compile on first use, or
    # by `pagedattn precompile --variant 'kv_write:...,append=True'`).
    append: bool = False
    # The flat variants' compile-time shape (FLAT_BUILD: kItems, kStreamItems, __launch_bounds__).
    # None is the default of the cache dtype; a value equal to it is stored as None, so only the others
    # appear in the name (kv_write_bf16_fp8e4m3_flat_stream2). span/head have none of them.
    max_items: int | None = field(default=None, metadata={"prefix": "items"})
    stream_items: int | None = field(default=None, metadata={"prefix": "stream"})
    max_threads: int | None = field(default=None, metadata={"prefix": "threads"})
    min_blocks: int | None = field(default=None, metadata={"prefix": "minblocks"})

    def __post_init__(self):
        if self.path == "flat":
            for name, default in FLAT_BUILD[_build_kind(self.kv_cache_dtype)].items():
                if getattr(self, name) == default:
                    object.__setattr__(self, name, None)
        super().__post_init__()

    def check(self) -> None:
        given = [n for n in BUILD_FIELDS if getattr(self, n) is not None]
        if given and self.path != "flat":
            raise UnsupportedError(f"kv_write: {', '.join(given)} shape the flat path only, not path={self.path}")
        for name, value in self.build.items():
            ok, rule = _BUILD_RULES[name]
            if not (isinstance(value, int) and ok(value)):
                raise UnsupportedError(f"kv_write: {name}={value!r}; {rule}")

    @property
    def build(self) -> dict:
        """The flat variant's compile-time shape, defaults filled in (span/head: {})."""
        if self.path != "flat":
            return {}
        defaults = FLAT_BUILD[_build_kind(self.kv_cache_dtype)]
        return {n: defaults[n] if getattr(self, n) is None else getattr(self, n) for n in BUILD_FIELDS}

    def context(self) -> dict:
        cache = self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        b = self.build
        bounds = "1024"
        if b:
            bounds = f"{b['max_threads']}, {b['min_blocks']}" if b["min_blocks"] else str(b["max_threads"])
        return {
            "Element": CUDA_TYPE[self.dtype],
            "CacheElement": CUDA_TYPE[cache],
            "kFp8": FP8_FORMAT[self.kv_cache_dtype],
            "path": self.path,
            "append": self.append,
            "kSpan": "true" if self.path == "span" else "false",
            "kItems": b.get("max_items", FLAT_BUILD["copy"]["max_items"]),
            "kStreamItems": b.get("stream_items", 0),
            "launch_bounds": bounds,
        }


# -- launch-time choices: one WriteConfig per (cache, token count), from write_config ----------------
@dataclass(frozen=True)
class WriteConfig:
    """How one write is launched. write_config picks it; tests and `pagedattn bench sweep write` change fields
    through `reshape_and_cache_flash(..., overrides={...})`."""
    flat: bool            # take the flat path where rows allow it (flat_tokens, 16-byte aligned bases)
    items: int            # flat: packs per thread (capped at the variant's max_items unless it streams)
    threads: int          # flat: threads per CTA (capped at the variant's max_threads)
    stream_waves: float   # flat, variants with a streaming body: grid capped at this many resident
                          # waves (0: never capped, one-shot)
    sm_count: int         # the device's SMs, the unit of a wave
    span_packs: int       # span: 16-byte packs per thread
    head_warps: int       # head: warps per CTA (heads strided over them)


# Launch-time defaults (measurements: perf/README.md, "Write path"):
MANY_TOKENS = 1024  # from here on the many-token shapes: perf/results/h200_sm90_20261130_write.json
FLAT_FOR = frozenset({("NHD", "copy"), ("NHD", "fp8"), ("NHD", "fp8_head"),   # (layout, kind) taking flat:
                      ("HND", "copy"), ("HND", "fp8"), ("HND", "fp8_head")})  # write_sweep_h200_20261130_flat.json
FLAT_MIN_TOKENS = 1       # perf/results/write_sweep_h200_20261130_flat.json
STREAM_FOR = frozenset({"fp8", "fp8_head"})  # kinds that stream: history/write_sweep_h200_stream_2af0687.json
STREAM_WAVES = 1          # perf/results/history/write_sweep_h200_stream_shapes_a72ae13.json
MANY = dict(items=4, threads=256, span_packs=4, head_warps=4)  # write_sweep_h200_20261130_flat.json, _write.json
FEW = dict(items=1, threads=128, span_packs=1, head_warps=8)   # (the T=256 rows of the same files)


def write_kind(spec: CacheSpec) -> tuple[str, str]:
    """The (layout, kind) entry of FLAT_FOR that a write of this cache falls under."""
    kind = "copy" if not spec.is_fp8 else "fp8_head" if spec.scale == "head" else "fp8"
    return spec.layout, kind


def write_config(spec: CacheSpec, num_tokens: int, sm_count: int) -> WriteConfig:
    """THE launch choice of a write of `num_tokens` tokens into this cache: path, CTA shape, schedule.
    Pure: the plan memoises it per token count."""
    many = num_tokens >= MANY_TOKENS
    kind = write_kind(spec)
    return WriteConfig(flat=kind in FLAT_FOR and num_tokens >= FLAT_MIN_TOKENS,
                       stream_waves=STREAM_WAVES if many and kind[1] in STREAM_FOR else 0,
                       sm_count=sm_count, **(MANY if many else FEW))


LAUNCH_FIELDS = tuple(f.name for f in dataclasses.fields(WriteConfig))


def split_overrides(overrides) -> tuple[dict, dict]:
    """(compile-time, launch-time) parts of an overrides mapping; an unknown name is a ContractError."""
    if overrides is None:
        return {}, {}
    if not isinstance(overrides, Mapping):
        raise ContractError(f"overrides must be a mapping of field names to values, got {describe(overrides)}")
    unknown = sorted(set(overrides) - set(BUILD_FIELDS) - set(LAUNCH_FIELDS))
    if unknown:
        raise ContractError(f"overrides: unknown {', '.join(map(str, unknown))}; compile-time: "
                            f"{', '.join(BUILD_FIELDS)}; launch-time: {', '.join(LAUNCH_FIELDS)}")
    return ({k: v for k, v in overrides.items() if k in BUILD_FIELDS},
            {k: v for k, v in overrides.items() if k in LAUNCH_FIELDS})


_MAX_GRID = (1 << 31) - 1


def base_path(spec: CacheSpec) -> str:
    """The one-CTA-per-token path a write takes when it does not take flat."""
    return "span" if spec.layout == "NHD" and (spec.scale == "tensor" or not spec.is_fp8) else "head"


def flat_tokens(spec: CacheSpec, elem_bytes: int) -> range:
    """Token counts the flat path can launch for this cache and input element size (empty when its
    head rows cannot be 16-byte aligned)."""
    if spec.head_size * elem_bytes % 16:
        return range(0)
    token_packs = 2 * spec.num_kv_heads * spec.head_size * elem_bytes // 16
    # grid <= 2^31 - 1 even for CTAs of one warp and one pack per thread
    return range(1, min(_MAX_GRID, _MAX_GRID * 32 // token_packs) + 1)  # int32 num_tokens


def rows_aligned(key, value) -> bool:
    """Every (token, head) row of key and value starts on 16 bytes (given D * element size % 16 == 0)."""
    return not any((t.data_ptr() | t.stride(0) * t.element_size()) & 15 for t in (key, value))


def write_path(spec: CacheSpec, elem_bytes: int, num_tokens: int, aligned: bool,
               config: WriteConfig | None = None) -> str:
    """The one place a write's path is chosen: flat when the config asks for it (write_config's by
    default), flat_tokens() admits the token count and the rows are aligned (rows_aligned), else
    base_path. (_Plan/_launch apply exactly this, split into the part fixed by tensor metadata and the
    per-call part: token count and base pointers.)"""
    config = config or write_config(spec, num_tokens, 1)
    if config.flat and aligned and num_tokens in flat_tokens(spec, elem_bytes):
        return "flat"
    return base_path(spec)


def base_threads(spec: CacheSpec, path: str, elem_bytes: int, config: WriteConfig) -> int:
    """Threads per CTA of span/head."""
    if path == "head":
        return 32 * min(spec.num_kv_heads, config.head_warps)
    packs = -(-spec.num_kv_heads * spec.head_size * elem_bytes // 16)  # per tensor
    per_tensor = -(-packs // config.span_packs)
    return 2 * min(max(32, -(-per_tensor // 32) * 32), 512)


def flat_grid(packs: int, items: int, threads: int, max_ctas: int = 0):
    """(grid, block) of a flat launch of `packs` 16-byte packs at `items` packs per thread: whole
    warps, no more threads than packs / items; the kernel reads items back from the grid size.
    max_ctas > 0 caps the grid, and a cap below packs / (items * threads) makes a variant with a
    streaming body stream."""
    threads = max(32, min(threads, -(-packs // (32 * items)) * 32))
    grid = -(-packs // (threads * items))
    if max_ctas > 0:
        grid = min(grid, max_ctas)
    return (grid, 1, 1), (threads, 1, 1)


def flat_launch(config: WriteConfig, variant: KvWriteSpec, packs: int, resident=None):
    """(grid, block) of a flat write under `config` on `variant`. resident(threads): CTAs of that
    size one SM holds (the loaded kernel's occupancy), for the streaming cap."""
    b = variant.build
    threads = min(config.threads, b["max_threads"])
    items = config.items if b["stream_items"] else min(config.items, b["max_items"])
    cap = 0
    if b["stream_items"] and config.stream_waves > 0:
        cap = max(1, int(config.sm_count * resident(threads) * config.stream_waves))
    return flat_grid(packs, items, threads, cap)


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
    """The checks every cache writer shares: new K/V tokens and their slot_mapping against the cache
    (slot_mapping None: an append, whose slots come from a block table; every token is written).
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
    if slot_mapping is None:
        return key.shape[0]
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


class _Shape:
    """The launch of one token count: its config, the flat (grid, block) (None: never flat), the
    span/head block, and the Prepared launches of the steady path ([flat, base], built on first use).
    `elements`: num_tokens * H * D, the fewest elements key / value can have (the steady path compares
    numel(), which costs less than shape[0])."""
    __slots__ = ("num_tokens", "elements", "config", "flat", "base_block", "runs")

    def __init__(self, num_tokens, elements, config, flat, base_block):
        self.num_tokens, self.elements, self.config, self.flat, self.base_block = \
            num_tokens, elements, config, flat, base_block
        self.runs = [None, None]


_ADDRESSES = 10  # KvWriteParams' leading pointers (key ... seqused_out): what a Prepared launch fills in per call
_NO_APPEND = (0, 0, 0, 0)


class _Plan:
    """Everything about a call that depends only on tensor metadata (and the overrides): validated
    once, reused. Kernels load on first use (a flat-only workload never compiles span/head)."""
    __slots__ = ("spec", "device", "elem", "base_spec", "base", "flat_spec", "flat", "flat_tokens",
                 "token_packs", "launch_overrides", "strides", "tail", "is_fp8", "num_slots", "slot64", "append",
                 "shapes")

    def __init__(self, spec: CacheSpec, key, value, key_cache, slot_mapping, scale_stride, overrides=None,
                 append=_NO_APPEND):
        """append: (append_tokens, table_width, table_stride, batch) for an Appender's plan (the append
        variants), else zeros."""
        build, self.launch_overrides = split_overrides(overrides)
        self.elem = elem = key.element_size()
        dtype = short(key.dtype)
        self.spec = spec
        self.device = key_cache.device.index
        try:
            mode = append is not _NO_APPEND
            self.base_spec = KvWriteSpec(dtype, spec.kv_cache_dtype, base_path(spec), mode)
            self.flat_spec = KvWriteSpec(dtype, spec.kv_cache_dtype, "flat", mode, **build)
        except UnsupportedError as exc:
            raise ContractError(f"overrides: {exc}") from None
        self.base = self.flat = None
        # write_path, metadata part: the token range (empty: never flat) with the token strides'
        # alignment folded in; _launch checks the count and the base pointers.
        strides_ok = not any(t.stride(0) * elem % 16 for t in (key, value))
        self.flat_tokens = flat_tokens(spec, elem) if strides_ok else range(0)
        self.token_packs = 2 * spec.num_kv_heads * spec.head_size * elem // 16
        self.strides = (key.stride(0), value.stride(0))  # the signature's (a plan serves one)
        bs, ps, hs, _ = key_cache.stride()
        # Params after the pointers: strides, CacheGeometry, scale_stride (then slot_is_int64, num_tokens
        # and the append fields)
        self.tail = (bs, ps, hs, spec.num_slots, spec.num_blocks, spec.block_size, spec.num_kv_heads,
                     spec.head_size, scale_stride)
        self.is_fp8 = spec.is_fp8
        self.num_slots = spec.num_slots
        self.slot64 = int(slot_mapping is not None and slot_mapping.dtype == torch.int64)
        self.append = append  # append_tokens, table_width, table_stride, batch (Appender); zeros otherwise
        self.shapes: dict[int, _Shape] = {}  # num_tokens -> its launch (engines repeat a few counts)

    def shape(self, num_tokens: int) -> _Shape:
        shape = self.shapes.get(num_tokens)
        if shape is None:
            if len(self.shapes) >= 1024:
                self.shapes.clear()
            config = write_config(self.spec, num_tokens, sm_count(self.device))
            if self.launch_overrides:
                config = dataclasses.replace(config, **self.launch_overrides)
            flat = None
            if config.flat and num_tokens in self.flat_tokens:
                flat = flat_launch(config, self.flat_spec, num_tokens * self.token_packs,
                                   lambda threads: self.flat_launcher().max_active_blocks(threads))
            block = (base_threads(self.spec, self.base_spec.path, self.elem, config), 1, 1)
            elements = num_tokens * self.spec.num_kv_heads * self.spec.head_size
            shape = self.shapes[num_tokens] = _Shape(num_tokens, elements, config, flat, block)
        return shape

    def prepared(self, shape: _Shape, flat: bool):
        """The Prepared launch of `shape` on the flat path or span/head: every Params field after the
        pointers (token strides, geometry, slot width, token count) packed once, as _launch packs them."""
        run = shape.runs[not flat]
        if run is None:
            n = shape.num_tokens
            tail = (*self.strides, *self.tail, self.slot64, n, *self.append)
            if flat:
                run = self.flat_launcher().prepare(*shape.flat, _ADDRESSES, tail)
            else:
                run = self.base_launcher().prepare((n, 1, 1), shape.base_block, _ADDRESSES, tail)
            shape.runs[not flat] = run
        return run

    def base_launcher(self):
        if self.base is None:
            self.base = get_kernel(self.base_spec).launcher(self.device)
        return self.base

    def flat_launcher(self):
        if self.flat is None:
            self.flat = get_kernel(self.flat_spec).launcher(self.device)
        return self.flat


def write_with_spec(spec: CacheSpec, key, value, key_cache, value_cache, slot_mapping,
                    k_scale=None, v_scale=None, validate: bool | None = None, overrides=None) -> None:
    num_tokens, scale_stride = validate_inputs(spec, key, value, key_cache, slot_mapping,
                                               k_scale, v_scale)
    split_overrides(overrides)
    _require_cuda(key_cache)
    plan = _Plan(spec, key, value, key_cache, slot_mapping, scale_stride, overrides)
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
    params = (kp, vp, key_cache.data_ptr(), value_cache.data_ptr(), slot_mapping.data_ptr(),
              k_scale.data_ptr() if plan.is_fp8 else 0, v_scale.data_ptr() if plan.is_fp8 else 0, 0, 0, 0,
              key.stride(0), value.stride(0)) + plan.tail + (plan.slot64, num_tokens) + _NO_APPEND
    shape = plan.shape(num_tokens)
    if shape.flat is not None and not (kp | vp) & 15:  # write_path == "flat"
        plan.flat_launcher()(*shape.flat, params)
    else:
        plan.base_launcher()((num_tokens, 1, 1), shape.base_block, params)


def _scale_sig(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device) \
        if isinstance(t, torch.Tensor) else type(t)


_PLANS = steady.Plans()
_GUARD_FORMS = _PLANS.steady.forms  # the two lists, cleared in place
_VALUE_IS_KEY, _NO_K_SCALE, _NO_V_SCALE, _V_SCALE_IS_K = steady.ABSENT[:4]
_is_compiling = steady.is_dynamo_compiling
_debug, _ENVIRON, _DEBUG_KEY = envs.debug, envs.ENVIRON, envs.DEBUG_KEY


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto",
                            k_scale=None, v_scale=None, *, validate: bool | None = None,
                            overrides=None) -> None:
    """Write new K/V tokens into a paged cache (vLLM's `reshape_and_cache_flash` semantics).

    key, value: [T_pad, H, D] fp16/bf16/fp32, (H, D) dense; only the first slot_mapping.numel()
    tokens are read. slot < 0 skips a token. Caches: [num_blocks, block_size, H, D], NHD or HND.
    kv_cache_dtype: "auto" | "fp8" | "fp8_e4m3" | "fp8_e5m2"; fp8 needs float32 k_scale/v_scale of
    shape [1] or 0-d (per tensor) or [H] (per head): stored = saturate_to_finite(x / scale).
    validate=True (or PAGEDATTN_DEBUG=1) also checks every slot < num_blocks*block_size and the
    scales finite and > 0 (syncs).
    overrides (tuning: tests, `pagedattn bench sweep write`): a mapping that replaces fields of the launch
    choice (WriteConfig: flat, items, threads, stream_waves, sm_count, span_packs, head_warps) and of
    the flat variant (KvWriteSpec: max_items, stream_items, max_threads, min_blocks), e.g.
    {"flat": False} or {"items": 2, "threads": 128}. The results are the same, only the speed differs.

    Validation runs once per distinct tensor metadata (shapes without T, strides, dtypes, devices);
    later calls with the same metadata only re-check what can change (token counts, alignment): one
    guard check (pagedattn/ops/steady.py) recognises them, then a Prepared launch packs the addresses.

    Under torch.compile this calls the custom op torch.ops.pagedattn.reshape_and_cache_flash
    (pagedattn.ops.library; PAGEDATTN_DEBUG still applies, validate= and overrides= do not); in eager
    it runs here.
    """
    # The steady state, in eager, without overrides or debug checks: one guard (steady.py) says the
    # tensors have a validated call's metadata (token counts aside), then only the token counts and
    # the base pointers are read. Form 1: with scales (stand-ins for None and for v_scale is k_scale).
    form = None
    if overrides is None and not validate and not _is_compiling() and (_DEBUG_KEY not in _ENVIRON or not _debug()):
        form = k_scale is not None or v_scale is not None
        meta = (key, _VALUE_IS_KEY if value is key else value, key_cache, value_cache, slot_mapping,
                _NO_K_SCALE if k_scale is None else k_scale,
                _NO_V_SCALE if v_scale is None else _V_SCALE_IS_K if v_scale is k_scale else v_scale) if form else \
            (key, _VALUE_IS_KEY if value is key else value, key_cache, value_cache, slot_mapping)
        for check, kv_name, plan in _GUARD_FORMS[form]:
            if not (check.check(*meta) and (kv_name is kv_cache_dtype or kv_cache_dtype.__class__ is str and
                                            kv_name == kv_cache_dtype)):
                continue
            form = None  # known: nothing to remember
            shape = plan.shapes.get(slot_mapping.numel())
            # rows: key and value [T, H, D] (H, D fixed by the guard, > 0): T >= num_tokens, value's T == key's
            elements = key.numel()
            kcp, vcp = key_cache.data_ptr(), value_cache.data_ptr()
            if (shape is not None and shape.elements <= elements and (value is key or value.numel() == elements)
                    and not (kcp | vcp) & 15):
                kp, vp = key.data_ptr(), value.data_ptr()
                flat = shape.flat is not None and not (kp | vp) & 15  # write_path == "flat"
                run = shape.runs[not flat] or plan.prepared(shape, flat)
                ks, vs = (k_scale.data_ptr(), v_scale.data_ptr()) if plan.is_fp8 else (0, 0)
                run.launch(kp, vp, kcp, vcp, slot_mapping.data_ptr(), ks, vs, 0, 0, 0)  # a Prepared launch
                return
            break
    if torch.compiler.is_compiling() or traced(key_cache):
        torch.ops.pagedattn.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
                                                    kv_cache_dtype or "auto", k_scale, v_scale)
        return
    try:
        sig = (key.shape[1:], key.stride(), key.dtype, key.device, value.shape[1:], value.stride(),
               value.dtype, value.device, key_cache.shape, key_cache.stride(), key_cache.dtype, key_cache.device,
               value_cache.shape, value_cache.stride(), value_cache.dtype, value_cache.device,
               # one entry (or none) is contiguous whatever its stride, more are only with stride 1
               slot_mapping.dim(), slot_mapping.stride() if slot_mapping.numel() > 1 else None,
               slot_mapping.dtype, slot_mapping.device,
               kv_cache_dtype, _scale_sig(k_scale), _scale_sig(v_scale),
               None if overrides is None else tuple(sorted(overrides.items())))
        plan = _PLANS.get(sig)
    except (AttributeError, TypeError):  # not tensors (or overrides not a mapping): the slow path explains
        sig = plan = None
    if plan is not None:
        num_tokens = slot_mapping.numel()
        if (num_tokens <= key.shape[0] and key.shape[0] == value.shape[0]
                and not (key_cache.data_ptr() | value_cache.data_ptr()) & 15):
            _launch(plan, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                    num_tokens, validate)
        else:
            plan = None
    if plan is None:
        spec, num_tokens, scale_stride = check_metadata(key, value, key_cache, value_cache, slot_mapping,
                                                        kv_cache_dtype, k_scale, v_scale)
        split_overrides(overrides)
        _require_cuda(key_cache)
        plan = _Plan(spec, key, value, key_cache, slot_mapping, scale_stride, overrides)
        _PLANS.remember(sig, plan)
        _launch(plan, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, num_tokens,
                validate)
    if form is not None:  # a steady-state call whose metadata no guard knew: one does now
        # token counts vary (dim 0 of key, value, slot_mapping), except for a slot_mapping of one entry
        # (or none) with another stride, which is contiguous only at that size
        dynamic = (0, 1, 4) if slot_mapping.stride(0) == 1 else (0, 1)
        _PLANS.steady.add(form, steady.guard(meta, dynamic), kv_cache_dtype, plan)


def check_metadata(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale,
                   pointers: bool = True):
    """Every metadata check of a write, no syncs: (CacheSpec, num_tokens, scale_stride). The eager
    call and the fake implementation of torch.ops.pagedattn.reshape_and_cache_flash (pointers=False:
    no base-pointer checks on tensors without data) both run it; slot_mapping None: an append
    (Appender)."""
    scale = "tensor"
    if isinstance(k_scale, torch.Tensor) and k_scale.numel() > 1:
        scale = "head"
    spec = CacheSpec.from_tensors(key_cache, value_cache, kv_cache_dtype=kv_cache_dtype, scale=scale,
                                  pointers=pointers)
    num_tokens, scale_stride = validate_inputs(spec, key, value, key_cache, slot_mapping, k_scale, v_scale)
    return spec, num_tokens, scale_stride


class Appender:
    """flash_attn_with_kvcache's write: B * s_new new tokens, token b * s_new + i at position
    cache_seqlens[b] + i of request b through its block_table row (the kernel's append mode: no
    slot_mapping; positions past the row are skipped), and seqused_out[b] = cache_seqlens[b] + s_new
    written for the attention that follows. Built once per tensor metadata (every check here);
    launch() then only reads addresses."""
    __slots__ = ("plan", "shape")

    def __init__(self, key, value, key_cache, value_cache, cache_seqlens, block_table, kv_cache_dtype, k_scale,
                 v_scale, pointers: bool = True):
        """key, value [B * s_new, H, D]; cache_seqlens int32 [B]; block_table int32 [B, width] (checked
        by the caller, as for the attention)."""
        spec, num_tokens, scale_stride = check_metadata(key, value, key_cache, value_cache, None, kv_cache_dtype,
                                                        k_scale, v_scale, pointers)
        batch, width = block_table.shape
        if batch and num_tokens % batch:
            raise ContractError(f"{num_tokens} new tokens do not divide among {batch} requests")
        if block_table.stride(0) >= 2**31:
            raise ContractError(f"block_table's row stride {block_table.stride(0)} does not fit in 32 bits")
        self.plan = None
        if not pointers:  # the fake implementation: the checks only
            return
        _require_cuda(key_cache)
        s_new = num_tokens // batch if batch else 0
        self.plan = plan = _Plan(spec, key, value, key_cache, None, scale_stride,
                                 append=(s_new, width, block_table.stride(0) if batch > 1 else width, batch))
        self.shape = plan.shape(num_tokens) if num_tokens else None

    def launch(self, key, value, key_cache, value_cache, k_scale, v_scale, cache_seqlens, block_table,
               seqused_out) -> None:
        """Write the tokens and seqused_out (tensors with the metadata this Appender was built for)."""
        shape = self.shape
        if shape is None:
            return
        kp, vp = key.data_ptr(), value.data_ptr()
        flat = shape.flat is not None and not (kp | vp) & 15  # write_path == "flat"
        run = shape.runs[not flat] or self.plan.prepared(shape, flat)
        ks, vs = (k_scale.data_ptr(), v_scale.data_ptr()) if self.plan.is_fp8 else (0, 0)
        run.launch(kp, vp, key_cache.data_ptr(), value_cache.data_ptr(), 0, ks, vs, cache_seqlens.data_ptr(),
                   block_table.data_ptr(), seqused_out.data_ptr())


_APPENDERS = PlanCache()


def appender(key, value, key_cache, value_cache, cache_seqlens, block_table, kv_cache_dtype, k_scale, v_scale,
             pointers: bool = True) -> Appender:
    """The Appender of these tensors' metadata, kept per signature (pointers=False: the checks only,
    for tensors without data)."""
    if not pointers:
        return Appender(key, value, key_cache, value_cache, cache_seqlens, block_table, kv_cache_dtype, k_scale,
                        v_scale, pointers=False)
    sig = (*(_scale_sig(t) for t in (key, value, key_cache, value_cache, cache_seqlens, block_table, k_scale,
                                     v_scale)), kv_cache_dtype)
    hit = _APPENDERS.get(sig)
    if hit is None or (key_cache.data_ptr() | value_cache.data_ptr()) & 15:  # the checks name it
        hit = _APPENDERS.remember(sig, Appender(key, value, key_cache, value_cache, cache_seqlens, block_table,
                                                kv_cache_dtype, k_scale, v_scale))
    return hit
