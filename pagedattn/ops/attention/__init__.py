"""flash_attn_varlen_func over a paged KV cache: the kernel family, the plan cache, dispatch, launch.

The steps live in small modules, re-exported here (every `pagedattn.ops.attention.X` keeps working),
and ../steady.py (the steady state: one C++ guard check of a validated call's metadata, shared with
the write):
  tiles.py       tile sizes per (head dim, mode, cache dtype, arch) and their shared memory
  heuristics.py  mode choice and split count, pure functions (MAX_SPLITS)
  validate.py    the checks of a call: keywords, scalars, tensor metadata, values
  tma.py         the CUtensorMaps of decode_tma
This module keeps what reads the device or a monkeypatchable name at run time (tests and perf sweeps
replace `tile_config`, `tma_ok`, `wgmma_ok`, `tma_maps`, `sm_count` here): the spec, the plan and
the launch."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ... import envs
from ..plans import PlanCache
from ...codegen.launch import STREAM_OFFSET, Prepared
from ...contract import ContractError, traced
from ...dtypes import CUTLASS_TYPE, FP8_FORMAT, short
from ...registry import KernelSpec, UnsupportedError, arch_for_device, get_kernel, register, sm_count
from .. import steady, workspace
from ..params import AttnParams
# re-exported: `from pagedattn.ops.attention import X` finds every name of the former single module
from .heuristics import MAX_SPLITS, _best_splits, mode_for, split_cost, splits_for  # noqa: F401
from .heuristics import MULTI_ROWS, WS_FP8_HEAD_DIM, NARROW_HEAD_DIMS, multi_mode, prefill_mode, tma_ok  # noqa: F401
from .heuristics import wave_capacity, wgmma_head_dim, wgmma_ok  # noqa: F401
from . import overrides
from .overrides import FORCED_MULTI_ROWS, forced  # noqa: F401
from .tiles import HEAD_DIMS, MODES, SM90_MODES, TMA_MODES, WGMMA_MODES, SMALL_SMEM_ARCH, SMEM_LIMIT, SMEM_PER_CTA, _tiles  # noqa: F401
from .tiles import fp8_regs, smem_bytes, smem_limit, smem_plan, tile_config, ws_pair  # noqa: F401
from .tma import TMA_L2_PROMOTION, tma_maps  # noqa: F401
from .validate import _INT32_MAX, _NO_FEATURES, _UNSUPPORTED_OK, _batch, _Call, _check_aligned  # noqa: F401
from .validate import _check_strides, _count_arg, _descale_strides, _given, _head_vector  # noqa: F401
from .validate import _int32_vector, _is_default, _offsets, _on_device, _require_cuda  # noqa: F401
from .validate import check_scalars, check_tables, check_unsupported, check_values  # noqa: F401
from .validate import features_of, validate  # noqa: F401

_is_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)
_is_compiling = steady.is_dynamo_compiling
_debug, _ENVIRON, _DEBUG_KEY = envs.debug, envs.ENVIRON, envs.DEBUG_KEY
_validate = validate  # flash_attn_varlen_func's validate= argument shadows the name

LOG2E = 1.4426950408889634


FEATURES = ("window", "softcap", "alibi", "sinks")
# Feature sets that bundles and `pagedattn list` cover, by the models that need them: Mistral/Qwen2
# sliding-window layers; Gemma 2/3 (softcap + window; softcap alone in global layers); gpt-oss (sinks,
# with and without a window); BLOOM/MPT/Baichuan (ALiBi).
FEATURE_SETS = ("none", "window", "softcap", "window+softcap", "sinks", "window+sinks", "alibi")


@register
@dataclass(frozen=True)
class AttnFwdSpec(KernelSpec):
    """Paged FlashAttention forward: query dtype, cache dtype, head-dim tile, decode/prefill tiles."""
    FAMILY: ClassVar[str] = "attn_fwd"
    TEMPLATE: ClassVar[str] = "attn_fwd.cu.j2"
    PARAMS: ClassVar = AttnParams
    SUPPORTED: ClassVar[dict] = {
        "dtype": ("fp16", "bf16"),
        "kv_cache_dtype": ("auto", "fp8_e4m3", "fp8_e5m2"),
        "head_dim": HEAD_DIMS,
        "mode": MODES,
        **{f: (False, True) for f in FEATURES},
        "small_smem": (False, True),
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
    # the tiles of the 99 KiB archs (sm_86, sm_89: tile_config with SMALL_SMEM_ARCH), only where the
    # default tiles do not fit there; `for_arch` sets it. Off, the name and the source are the defaults'.
    small_smem: bool = False

    @classmethod
    def for_arch(cls, arch: str, dtype: str, kv_cache_dtype: str, head_dim: int, mode: str,
                 flags: tuple = (False, False, False, False)) -> "AttnFwdSpec":
        """The variant the plan builds for `arch`: the one whose tiles are tile_config's for it."""
        fp8 = kv_cache_dtype != "auto"
        small = tile_config(head_dim, mode, fp8, arch) != tile_config(head_dim, mode, fp8)
        return cls(dtype, kv_cache_dtype, head_dim, mode, *flags, small_smem=small)

    @property
    def features(self) -> str:
        """The feature set as AOT selections and FEATURE_SETS spell it: 'none' or e.g. 'window+softcap'."""
        return "+".join(f for f in FEATURES if getattr(self, f)) or "none"

    @classmethod
    def all_variants(cls):
        """Every tile/dtype variant with each feature set of FEATURE_SETS (any other combination still
        compiles on first use; these are the ones `pagedattn list`, bundles and the compile tests cover),
        but those no plan picks (`dispatched`)."""
        for spec in super().all_variants():
            if not spec.dispatched:
                continue
            if spec.features == "none":
                for fs in FEATURE_SETS:
                    yield spec if fs == "none" else dataclasses.replace(spec, **{f: True for f in fs.split("+")})

    def program_group(self) -> tuple:
        """One mode and one kind of cache per NVRTC program: NVVM optimises a program as a whole, and
        those kernels come out of one with the SASS of their own compiles (nvdisasm, the default preset's
        programs checked on sm_90a), where a warp-specialised prefill that shared one with fp8 prefills
        did not (other register allocation)."""
        return self.mode, self.kv_cache_dtype == "auto"

    @property
    def dispatched(self) -> bool:
        """Whether some plan picks this variant: all but prefill_ws with an fp8 cache at a head dim other
        than WS_FP8_HEAD_DIM (heuristics.prefill_mode; check() refuses those anyway) and the narrow ones
        (opt-in: plans run those head dims on the 128 tile)."""
        return not (self.mode == "prefill_ws" and self.kv_cache_dtype != "auto" and self.head_dim != WS_FP8_HEAD_DIM
                    or self.narrow)

    @property
    def tile_arch(self) -> str:
        """The arch whose shared memory these tiles were chosen for (the defaults: sm_90a's, which
        also fit sm_80's for every mode sm_80 runs)."""
        return SMALL_SMEM_ARCH if self.small_smem else "sm_90a"

    @property
    def smem_limit(self) -> int:
        return smem_limit(self.tile_arch)

    @property
    def tiles(self) -> dict:
        return tile_config(self.head_dim, self.mode, self.kv_cache_dtype != "auto", self.tile_arch)

    @property
    def default_tiles(self) -> dict:
        """The tiles of sm_90a and sm_80 (those of this variant unless small_smem)."""
        return tile_config(self.head_dim, self.mode, self.kv_cache_dtype != "auto")

    def context(self) -> dict:
        tiles = dict(self.tiles)
        # never promise more resident CTAs than shared memory allows: the register cap would be wasted
        tiles["kMinBlocks"] = max(1, min(tiles["kMinBlocks"], self.smem_limit // self.dynamic_smem()))
        tiles["kWsPair"] = self.pair  # rendered only where the kernel can run it
        return {"Element": CUTLASS_TYPE[self.dtype], "kFp8": FP8_FORMAT[self.kv_cache_dtype],
                "kHeadDim": self.head_dim, "smem_plan": self.smem_plan(), "max_splits": MAX_SPLITS, **tiles,
                **{f: getattr(self, f) for f in FEATURES}}

    @property
    def pair(self) -> bool:
        """prefill_ws in clusters of two CTAs with K/V multicast (tiles.ws_pair)."""
        return ws_pair(self.tiles, self.kv_cache_dtype != "auto")

    @classmethod
    def runs_head_size(cls, head_size: int) -> bool:
        """Whether some compiled head dim runs queries of this head size (a multiple of 8 up to the largest:
        kernel_head_dim)."""
        return head_size % 8 == 0 and 0 < head_size <= HEAD_DIMS[-1]

    def serves_head_size(self, head_size: int) -> bool:
        """Whether a plan for head size `head_size` may launch this variant: one compiled at its kernel
        head dim, or a warpgroup-MMA prefill at the head dim those run it on (wgmma_head_dim: 80 and 96 on
        the 128 tile). What `pagedattn precompile --head-sizes` / `--model-config` select by."""
        try:
            d = kernel_head_dim(head_size)
        except UnsupportedError:
            return False
        return self.head_dim == d or (self.mode in WGMMA_MODES and
                                      self.head_dim == wgmma_head_dim(d, self.kv_cache_dtype != "auto"))

    @property
    def narrow(self) -> bool:
        """A TMA mode of a 16-bit cache at a head dim that is not a multiple of 64 (NARROW_HEAD_DIMS: 32- or
        16-column panels): opt-in (overrides.forced(narrow=True); the plans run those head dims' decode
        by cp.async and their prefill on the 128 tile)."""
        return self.mode in TMA_MODES and self.kv_cache_dtype == "auto" and self.head_dim % 64 != 0

    def check(self) -> None:
        if self.narrow and self.head_dim not in NARROW_HEAD_DIMS:
            narrow = ", ".join(map(str, NARROW_HEAD_DIMS))
            raise UnsupportedError(f"attn_fwd: mode={self.mode} needs head_dim a multiple of 64 for 16-bit caches "
                                   f"(128-byte swizzled TMA boxes), or one of {narrow}, got {self.head_dim}")
        if self.mode == "multi_tma" and self.kv_cache_dtype != "auto":
            raise UnsupportedError(f"attn_fwd: mode=multi_tma needs a 16-bit cache (fp8 operands in registers "
                                   f"take one 16-row MMA tile per warp), got {self.kv_cache_dtype}; "
                                   f"mode=multi runs fp8 caches")
        if self.mode == "prefill_ws" and self.kv_cache_dtype != "auto" and self.head_dim != WS_FP8_HEAD_DIM:
            raise UnsupportedError(f"attn_fwd: mode=prefill_ws takes fp8 caches at head_dim {WS_FP8_HEAD_DIM} "
                                   f"only, got {self.head_dim}; mode=prefill_wgmma runs the others")
        if self.mode in WGMMA_MODES and self.head_dim % 64 and not self.narrow:
            raise UnsupportedError(f"attn_fwd: mode={self.mode} needs head_dim a multiple of 64 (128-byte "
                                   f"swizzled tiles), got {self.head_dim}")
        if self.small_smem:
            fp8 = self.kv_cache_dtype != "auto"
            if self.mode not in ("decode", "prefill") or \
                    tile_config(self.head_dim, self.mode, fp8, SMALL_SMEM_ARCH) == self.default_tiles:
                raise UnsupportedError(f"attn_fwd: small_smem is for the decode/prefill tiles that do not fit "
                                       f"{SMALL_SMEM_ARCH}'s shared memory; {self.mode} at head_dim "
                                       f"{self.head_dim} uses its default tiles there")
        if self.dynamic_smem() > self.smem_limit:
            raise UnsupportedError(f"attn_fwd: the {self.mode} tiles {self.tiles} need {self.dynamic_smem()} bytes "
                                   f"of shared memory at head_dim {self.head_dim}; a CTA gets at most "
                                   f"{self.smem_limit}")

    def supports_arch(self, arch: str) -> bool:
        """sm_90a-only modes aside, a variant is built for the archs whose tile_config it holds (so a
        default tile too large for sm_86/sm_89 is never built there: its small_smem twin is)."""
        if self.mode in SM90_MODES and arch != "sm_90a":
            return False
        try:
            return tile_config(self.head_dim, self.mode, self.kv_cache_dtype != "auto", arch) == self.tiles
        except UnsupportedError:  # no tile fits that arch
            return False

    def smem_plan(self) -> dict:
        """The shared-memory regions of this variant (tiles.smem_plan), as the source renders them."""
        return smem_plan(self.tiles, self.head_dim, self.kv_cache_dtype != "auto")

    def dynamic_smem(self) -> int:
        return self.smem_plan()["Bytes"]

    @property
    def threads(self) -> int:
        """Threads of a CTA (AttnTraits::kCtaThreads): the computing warps, and prefill_ws's producer
        warpgroup."""
        t = self.tiles
        return 32 * t["kWarpsM"] * t["kWarpsN"] * t["kWarpsD"] + (128 if t["kTma"] and t["kWgmma"] else 0)


def kernel_head_dim(head_size: int) -> int:
    """Compiled head dims: 64, 80, 96, 128, 192, 256, 512. Any other multiple of 8 up to 512 runs on
    the next larger one; the extra columns are zero-filled on load and never stored."""
    for d in HEAD_DIMS:
        if head_size <= d:
            return d
    raise UnsupportedError(f"attn_fwd: head_size={head_size} is not supported; at most {HEAD_DIMS[-1]} "
                           f"(compiled: {', '.join(map(str, HEAD_DIMS))})")


def choose_splits(num_splits: int, ctas: int, max_seqlen_k: int, spec: AttnFwdSpec, device: int) -> int:
    """num_splits=0: the split count with the least whole-wave cost (split_cost), so that a batch
    neither underfills the GPU nor leaves a mostly empty last wave (measured on H200: 512 decode CTAs
    over 396 slots ran 1.29 waves, i.e. two)."""
    return splits_for(num_splits, ctas, max_seqlen_k, stage_keys(spec), split_capacity(spec, device),
                      persistent=spec.mode == "prefill_ws")


def stage_keys(spec: AttnFwdSpec) -> int:
    return spec.tiles["kBlockN"] * spec.tiles["kWarpsN"]


def split_capacity(spec: AttnFwdSpec, device: int) -> int:
    """Resident CTAs of one wave of this variant (heuristics.wave_capacity on this device)."""
    return wave_capacity(sm_count(device), spec.tiles["kTma"], spec.dynamic_smem(), spec.smem_limit)


def _sig(t):
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device) if isinstance(t, torch.Tensor) else type(t)


class _Variant:
    """A variant of a plan with what every launch reads from its spec, looked up once."""
    __slots__ = ("spec", "launcher", "mode", "block_m", "threads", "stage_keys", "capacity", "head_dim", "pair")

    def __init__(self, spec: AttnFwdSpec, launcher, device: int):
        self.spec, self.launcher, self.mode, self.head_dim = spec, launcher, spec.mode, spec.head_dim
        self.pair = spec.pair
        self.block_m = spec.tiles["kBlockM"]
        self.threads = (spec.threads, 1, 1)
        self.stage_keys = stage_keys(spec)
        self.capacity = split_capacity(spec, device)
        if self.pair:  # whole clusters of two, as many as fit at once (the persistent grid waits for none)
            clusters = launcher.max_active_clusters(spec.threads, 2)
            self.capacity = min(self.capacity // 2, clusters or self.capacity) * 2


class _Plan:
    """What a call's tensor metadata decides, validated once and reused while it repeats."""
    __slots__ = ("call", "device", "dtype", "head_dim", "dbs", "dhs", "block_shift", "bt_stride",
                 "bt_width", "arch", "decode_mode", "multi_mode", "multi_rows", "prefill_mode", "wgmma_rows",
                 "wgmma_dim", "_kernels", "_tma", "group", "tiles_per_row", "default_scale", "geometry", "launches",
                 "empty", "here", "current", "_maps_ptr")

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
        self.arch = arch = arch_for_device(self.device)
        f = overrides.current()  # what a benchmark or test forces (overrides.py), else the dispatch below
        tma = f.tma is not False and tma_ok(call, arch, self.head_dim, bool(f.narrow))
        self.decode_mode = "decode_tma" if tma else "decode"
        self.multi_mode = None if f.multi is False else multi_mode(call, self.head_dim, tma)
        self.multi_rows = FORCED_MULTI_ROWS if f.multi else MULTI_ROWS
        # the warpgroup-MMA prefills' head dim: 80 and 96 run on the 128 tile (heuristics.wgmma_head_dim), whose
        # TMA maps are encoded for 128 (an fp8 cache's decode_tma keeps its own: tma_maps per head dim); forced
        # narrow, as they are where TMA reads the cache (prefill_ws's narrow panels)
        fp8 = call.kv_name != "auto"
        narrow = bool(f.narrow) and tma
        self.wgmma_dim = wd = wgmma_head_dim(self.head_dim, fp8, narrow)
        wide_tma = tma if wd == self.head_dim else f.tma is not False and tma_ok(call, arch, wd)
        self.prefill_mode = f.prefill or prefill_mode(wgmma_ok(call, arch, wd, narrow), wide_tma, fp8, wd)
        # prefill_wgmma's tiles are larger: it takes over once the rows overflow one SM80 prefill tile.
        # Measured on H200 (perf/results/prefill_modes_nvidia_h200_20261130_short_3eaa587.json, d128,
        # B=32 over 4096 keys): q_len 5-32 (20-128 rows) ran 17 % slower on wgmma, q_len 64 1.7x faster.
        # A forced prefill other than the SM80 one takes every row count above one decode tile.
        self.wgmma_rows = 16 if f.prefill not in (None, "prefill") else \
            tile_config(self.head_dim, "prefill", False, arch)["kBlockM"]
        self._kernels: dict = {}
        self._tma: dict = {}
        self._maps_ptr: dict = {}
        self.group = call.Hq // call.Hkv
        self.tiles_per_row = call.B * call.Hkv  # CTAs of one row tile (gridDim.x)
        self.default_scale = 1.0 / math.sqrt(call.D)
        # AttnParams from k_block_stride to head_size: fixed by the metadata
        self.geometry = (*call.k_strides, *call.v_strides, self.bt_stride, self.bt_width, call.num_blocks,
                         call.block_size, self.block_shift, call.B, call.Hq, call.Hkv, self.group, call.D)
        self.launches = PlanCache()   # _Launch by batch shape and scalars (_Launch.key)
        self.empty = steady.empty_fn(q.device)
        # outputs on the current device without the dispatcher (steady.empty_here), inline in _Launch.run
        self.here, self.current = steady.empty_here(q.device, self.device)

    def mode_for(self, rows: int) -> str:
        """The variant for a batch whose longest request has `rows` packed query rows."""
        return mode_for(rows, self.decode_mode, self.prefill_mode, self.wgmma_rows, self.multi_mode, self.multi_rows)

    def kernel(self, mode: str, flags: tuple = (False, False, False, False)) -> "_Variant":
        """The decode or prefill variant with these feature flags (FEATURES order)."""
        hit = self._kernels.get((mode, flags))
        if hit is None:
            head_dim = self.wgmma_dim if mode in WGMMA_MODES else self.head_dim
            spec = AttnFwdSpec.for_arch(self.arch, self.dtype, self.call.kv_name, head_dim, mode, flags)
            hit = self._kernels[(mode, flags)] = _Variant(spec, get_kernel(spec).launcher(self.device), self.device)
        return hit

    def tma_maps(self, k, v, head_dim: int, capturing: bool = False):
        """tma_maps for this plan's geometry, per cache (an engine alternates one cache per layer) and per
        kernel head dim (an fp8 cache at head dim 80 or 96 is read by decode_tma at its own and by
        prefill_ws on the 128 tile, with boxes of other widths). Encoding copies host memory to the GPU,
        which a capturing stream cannot do: a capture needs one call with the same caches before it (a
        warm-up). Maps a capture used live as long as the process (workspace.keep_for_graphs): evicting
        them here would free what a graph reads."""
        key = (k.data_ptr(), v.data_ptr(), head_dim)
        hit = self._tma.get(key)
        if hit is None:
            if capturing:
                raise ContractError("flash_attn_varlen_func: the TMA descriptors of these k/v caches are built "
                                    "on first use, which cannot happen during CUDA-graph capture; run one "
                                    "eager call with the same caches before capturing (a warm-up)")
            if len(self._tma) >= 512:
                self._tma.clear()
                self._maps_ptr.clear()
            hit = self._tma[key] = tma_maps(k, v, self.call, head_dim)
        elif capturing:
            workspace.keep_for_graphs(hit[0])
        return hit

    def maps_ptr(self, k, v, kp: int, vp: int, head_dim: int, capturing: bool) -> int:
        """The device address of tma_maps(k, v, head_dim) (k, v at addresses kp, vp)."""
        if not capturing:
            hit = self._maps_ptr.get((kp, vp, head_dim))
            if hit is not None:
                return hit
        ptr = self._maps_ptr[(kp, vp, head_dim)] = self.tma_maps(k, v, head_dim, capturing)[0].data_ptr()
        return ptr


class _Launch(Prepared):
    """One batch shape of a plan (total_q, max_seqlen_q / _k, num_splits, causal, scale, features,
    whether LSE is returned): the variant, grid and splits chosen, the output shapes, and the launch
    with every Params field but the addresses packed once (a Prepared launch). A call of this shape
    allocates the outputs, fills in the addresses and launches."""
    __slots__ = ("empty_batch", "splits", "ctas", "tma", "capture", "head_dim", "total_q", "dtype", "out_shape",
                 "out_stride", "lse_shape", "scratch")

    def __init__(self, plan: _Plan, q, k, v, out, max_seqlen_q, max_seqlen_k, num_splits, causal, scale,
                 features, lse: bool):
        flags, w_left, w_right, cap, _, alibi_stride, _ = features
        call = plan.call
        self.total_q = total_q = q.shape[0]
        self.dtype = q.dtype
        self.out_shape, self.out_stride = tuple(q.shape), (torch.empty_like(q) if out is None else out).stride()
        self.lse_shape = (call.Hq, total_q) if lse else None
        # split-KV scratch addresses as last handed out: (stream, workspace.GENERATION, o, lse, counters)
        self.scratch = (None, -1, 0, 0, 0)
        self.empty_batch = total_q == 0 or call.B == 0
        if self.empty_batch:
            return
        group = plan.group
        # max_seqlen_q / max_seqlen_k choose the variant and size the grid. Every index stays inside the
        # tensors whatever they say (tile_scheduler.cuh); rows past an understated max_seqlen_q take a slow
        # out-of-line path (attn_fwd.cuh). A request's rows are at most total_q: no more row tiles than that.
        rows = max(0, int(max_seqlen_q)) * group
        variant = plan.kernel(plan.mode_for(rows), flags)
        m_blocks = -(-min(rows, total_q * group) // variant.block_m)
        m_blocks = min(max(1, m_blocks), MAX_GRID_Y)
        if variant.pair and m_blocks % 2:  # pairs of row tiles in one column (ws_pair_item): an empty one more
            # (MAX_GRID_Y is odd: there one less, its rows then taking the rows-past-grid path)
            m_blocks = m_blocks + 1 if m_blocks < MAX_GRID_Y else m_blocks - 1
        # splits divide the keys a tile can see: with a left window edge, at most the window and the rows.
        # The split plan depends on shapes and max_seqlen_k only (never on seqused_k's values): a CUDA
        # graph captured with it stays right for any lengths up to max_seqlen_k.
        keys = max(0, int(max_seqlen_k))
        if w_left >= 0:
            keys = min(keys, w_left + 1 + max(0, int(max_seqlen_q)) + (0 if causal or w_right < 0 else w_right))
        self.ctas = plan.tiles_per_row * m_blocks
        self.splits = splits = splits_for(int(num_splits), self.ctas, keys, variant.stage_keys, variant.capacity,
                                          persistent=variant.mode == "prefill_ws")
        self.head_dim = variant.head_dim
        self.tma = variant.mode in TMA_MODES
        self.capture = splits > 1 or self.tma   # what reads the capture state
        row_dim = plan.tma_maps(k, v, self.head_dim, _is_capturing())[1] if self.tma else 0
        scale = scale if scale is not None else plan.default_scale
        q_stride = q.stride()
        tail = (q_stride[0], q_stride[1], self.out_stride[0], self.out_stride[1], *plan.geometry, total_q,
                0 if call.paged else k.shape[0], splits, int(bool(causal)), plan.dbs, plan.dhs, row_dim, w_left,
                w_right, alibi_stride, scale * LOG2E, cap, m_blocks)
        # the warp-specialised prefill is persistent: a CTA per SM (at most one per work item) walks the
        # logical grid (tiles_per_row, m_blocks, splits) (tile_scheduler.cuh, ws_slot)
        if variant.mode == "prefill_ws":
            if self.ctas * splits + variant.capacity >= 2**31:  # the kernel counts work items in 32 bits
                raise ContractError(f"flash_attn_varlen_func: {self.ctas * splits} work items (row tiles x KV heads "
                                    f"x requests x splits) are more than one launch takes; split the batch")
            # (kWsPair: whole clusters of two, the items and the capacity being even)
            grid = (min(self.ctas * splits, variant.capacity), 1, 1)
        else:
            grid = (plan.tiles_per_row, m_blocks, splits)
        super().__init__(variant.launcher, grid, variant.threads, _ADDRESSES, tail)

    def run(self, plan: _Plan, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, out, k_descale,
            v_descale, alibi_slopes=None, sinks=None):
        """Allocate what is not given, launch; (out, lse). None when a base address is not 16-byte
        aligned or out has another number of rows: what only the full validation can name."""
        qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
        if out is None:
            out = plan.here(self.out_shape, self.out_stride, self.dtype) if plan.current() == plan.device else \
                plan.empty(self.out_shape, self.out_stride, self.dtype)
        elif out.shape[0] != self.total_q:
            return None
        op = out.data_ptr()
        if (qp | kp | vp | op) & 15:
            return None
        lse = None if self.lse_shape is None else plan.empty(self.lse_shape, (self.total_q, 1), torch.float32)
        if self.empty_batch:
            return out, lse
        stream = self._stream(self._device)
        o_ptr = lse_ptr = counters = maps = 0
        if self.capture:
            # CUDA never captures the legacy default stream (0): no capture query on it
            capturing = stream != 0 and _is_capturing()
            if self.splits > 1:
                scratch = self.scratch
                if capturing or scratch[0] != stream or scratch[1] != workspace.GENERATION:
                    o_ptr, lse_ptr, counters = workspace.split_scratch(plan.device, self.splits, self.total_q,
                                                                       plan.call.Hq, self.head_dim, self.ctas,
                                                                       capturing, stream)
                    if not capturing:  # kept only outside capture: a capture's new buffers need an eager zeroing
                        self.scratch = (stream, workspace.GENERATION, o_ptr, lse_ptr, counters)
                else:
                    o_ptr, lse_ptr, counters = scratch[2:]
            if self.tma:
                maps = plan._maps_ptr.get((kp, vp, self.head_dim), 0) if not capturing else 0
                if not maps:
                    maps = plan.maps_ptr(k, v, kp, vp, self.head_dim, capturing)
        # Prepared.__call__, inline (this runs on every steady-state call)
        try:
            buf, config, argv = self._local.state
        except AttributeError:
            buf, config, argv = self._thread_buffer()
        self._pack_head(buf, STREAM_OFFSET, stream, qp, op, 0 if lse is None else lse.data_ptr(), kp, vp,
                        0 if block_table is None else block_table.data_ptr(), cu_seqlens_q.data_ptr(),
                        0 if seqused_k is None else seqused_k.data_ptr(),
                        0 if cu_seqlens_k is None else cu_seqlens_k.data_ptr(),
                        0 if k_descale is None else k_descale.data_ptr(),
                        0 if v_descale is None else v_descale.data_ptr(), o_ptr, lse_ptr, maps, counters,
                        0 if alibi_slopes is None else alibi_slopes.data_ptr(), 0 if sinks is None else sinks.data_ptr())
        err = self._launch(config, self._func, argv, None)
        if err:
            self._launcher._failed(err, config, argv)
        return out, lse


_ADDRESSES = 17  # AttnParams' leading pointer fields, q ... sinks: what a _Launch fills in per call
MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y


_PLANS = steady.Plans()
_GUARD_FORMS = _PLANS.steady.forms  # the two lists, cleared in place
_FULL_WINDOW = (-1, -1)
_ABSENT_OUT, _ABSENT_K_DESCALE, _ABSENT_V_DESCALE, _V_DESCALE_IS_K = steady.ABSENT[:4]


def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None,
                           seqused_k=None, softmax_scale=None, causal=False, block_table=None,
                           return_softmax_lse=False, out=None, num_splits=0, k_descale=None,
                           v_descale=None, kv_cache_dtype=None, window_size=_FULL_WINDOW, softcap=0.0,
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
    metadata checks; in eager it runs directly (the dispatcher would cost host time): a call whose
    metadata, scalars and batch shape repeat a validated call's only reads addresses and launches.
    """
    # The steady state of a paged step, in eager, without features or debug checks: the tensors'
    # metadata is that of a validated call when one guard (steady.py) says so, the scalars when they
    # are ints / a float and their batch shape has a _Launch; then only addresses are read.
    form = None
    if cu_seqlens_k is None and alibi_slopes is None and sinks is None and s_aux is None and not unsupported \
            and not validate and (window_size is _FULL_WINDOW or window_size.__class__ is tuple and
                                  window_size == _FULL_WINDOW) \
            and softcap.__class__ is float and softcap == 0.0 and not _is_compiling() \
            and (_DEBUG_KEY not in _ENVIRON or not _debug()):
        form = out is not None or k_descale is not None or v_descale is not None
        meta = (q, k, v, cu_seqlens_q, seqused_k, block_table, _ABSENT_OUT if out is None else out,
                _ABSENT_K_DESCALE if k_descale is None else k_descale,
                _ABSENT_V_DESCALE if v_descale is None else _V_DESCALE_IS_K if v_descale is k_descale else
                v_descale) if form else \
            (q, k, v, cu_seqlens_q, seqused_k, block_table)
        for check, kv_name, plan in _GUARD_FORMS[form]:
            if check.check(*meta) and (kv_name is kv_cache_dtype or kv_cache_dtype.__class__ is str and
                                       kv_name == kv_cache_dtype):
                form = None  # known: nothing to remember
                if type(max_seqlen_q) is int and type(max_seqlen_k) is int and type(num_splits) is int and \
                        causal.__class__ is bool and (softmax_scale is None or type(softmax_scale) is float):
                    run = plan.launches.get((q.numel(), max_seqlen_q, max_seqlen_k, num_splits, causal,
                                             softmax_scale, return_softmax_lse, None))
                    if run is not None:
                        done = run.run(plan, q, k, v, cu_seqlens_q, None, seqused_k, block_table, out, k_descale,
                                       v_descale)
                        if done is not None:
                            return done if return_softmax_lse else done[0]
                break
    if unsupported:
        check_unsupported(unsupported)
    if s_aux is not None and sinks is not None:
        raise ContractError("give the sink logits once: s_aux (vLLM's name) or sinks, not both")
    if s_aux is not None:
        sinks = s_aux
    if torch.compiler.is_compiling() or traced(q):
        from .. import library

        return library.varlen_op(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, seqused_k,
                                 softmax_scale, causal, block_table, return_softmax_lse, out, num_splits,
                                 k_descale, v_descale, kv_cache_dtype, window_size, softcap, alibi_slopes,
                                 sinks)
    checked = check_call(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, seqused_k,
                         softmax_scale, causal, block_table, out, num_splits, k_descale, v_descale, kv_cache_dtype,
                         window_size, softcap, alibi_slopes, sinks, validate)
    out, lse = launch(checked, q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, seqused_k, causal,
                      block_table, return_softmax_lse, out, num_splits, k_descale, v_descale)
    if form is not None:  # a steady-state call whose metadata no guard knew: one does now
        _PLANS.steady.add(form, steady.guard(meta, (0, 6) if form else (0,)), kv_cache_dtype, checked[0])
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
        _PLANS.remember(sig, plan)
        return plan, softmax_scale, features
    if debug:
        check_values(plan.call, *values)
    return plan, softmax_scale, features_of(plan.call, q.device, causal, window_size, softcap, alibi_slopes, sinks)


def launch(checked, q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, seqused_k, causal,
           block_table, return_softmax_lse, out, num_splits, k_descale, v_descale):
    """Allocate the outputs, choose variant and splits, launch: a call check_call accepted. The
    choice is kept per batch shape (plan.launches)."""
    features = checked[2]
    run = launch_of(checked, q, k, v, out, max_seqlen_q, max_seqlen_k, num_splits, causal, return_softmax_lse)
    return run.run(checked[0], q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, out, k_descale,
                   v_descale, features[4], features[6])


def launch_of(checked, q, k, v, out, max_seqlen_q, max_seqlen_k, num_splits, causal, return_softmax_lse):
    """The _Launch of a call check_call accepted (kept per batch shape in plan.launches): its run()
    launches with the call's addresses (flash_attn_with_kvcache's steady path keeps it)."""
    plan, softmax_scale, features = checked
    flags, w_left, w_right, cap, _, alibi_stride, _ = features
    lse = bool(return_softmax_lse)
    # q.numel() stands for total_q (a plan fixes Hq and D, both > 0) and costs less than q.shape[0]
    key = (q.numel(), max_seqlen_q, max_seqlen_k, num_splits, bool(causal), softmax_scale, lse,
           None if features is _NO_FEATURES else (flags, w_left, w_right, cap, alibi_stride))
    run = plan.launches.get(key)
    if run is None:
        run = plan.launches.remember(key, _Launch(plan, q, k, v, out, max_seqlen_q, max_seqlen_k, num_splits,
                                                  causal, softmax_scale, features, lse))
    return run
