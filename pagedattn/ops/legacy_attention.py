"""paged_attention_v1 / v2 on the legacy layout: kernel families, validation, launches.

The public functions (and the v1/v2 rule) live in pagedattn/legacy.py; this module turns one checked
call into launches. v1 and v2 run the SAME compiled attention kernel (legacy_attention.cuh): the
launch picks the grid and `partition_size` (0 = the whole sequence). v2 adds the reduce kernel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .. import envs
from .plans import PlanCache
from ..contract import CacheSpec, ContractError, check_scale_values, describe
from ..dtypes import CUDA_TYPE, FP8_FORMAT, short
from ..registry import KernelSpec, UnsupportedError, get_kernel, register
from .legacy_cache import check_scale, geometry
from .params import LegacyAttentionParams, LegacyReduceParams

PARTITION_SIZE = 512          # tokens per v2 partition (vLLM's value)
THREADS = 128                 # 4 warps per CTA, for both kernels
HEAD_SIZES = (64, 80, 96, 112, 128, 192, 256)
BLOCK_SIZES = (8, 16, 32)
MAX_GRID_YZ = 65535
V1_MAX_SEQ_LEN = 8192         # vLLM's rule: past this, always v2
INT32_MAX = 2**31 - 1


@register
@dataclass(frozen=True)
class LegacyAttentionSpec(KernelSpec):
    """Legacy paged attention, v1 and v2 (one kernel): query dtype, cache dtype, head and block size."""
    FAMILY: ClassVar[str] = "legacy_attn"
    TEMPLATE: ClassVar[str] = "legacy_attention.cu.j2"
    PARAMS: ClassVar = LegacyAttentionParams
    SUPPORTED: ClassVar[dict] = {
        "dtype": ("fp16", "bf16"),
        "kv_cache_dtype": ("auto", "fp8_e4m3", "fp8_e5m2"),
        "head_size": HEAD_SIZES,
        "block_size": BLOCK_SIZES,
    }

    dtype: str
    kv_cache_dtype: str
    head_size: int = field(metadata={"prefix": "d"})
    block_size: int = field(metadata={"prefix": "bs"})

    def context(self) -> dict:
        cache = self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        return {"Element": CUDA_TYPE[self.dtype], "CacheElement": CUDA_TYPE[cache],
                "kFp8": FP8_FORMAT[self.kv_cache_dtype], "kHeadDim": self.head_size,
                "kBlockSize": self.block_size, "kThreads": THREADS}


@register
@dataclass(frozen=True)
class LegacyReduceSpec(KernelSpec):
    """Legacy paged attention v2's reduce: merges the 512-token partitions of each (sequence, head)."""
    FAMILY: ClassVar[str] = "legacy_reduce"
    TEMPLATE: ClassVar[str] = "legacy_reduce.cu.j2"
    PARAMS: ClassVar = LegacyReduceParams
    SUPPORTED: ClassVar[dict] = {"dtype": ("fp16", "bf16"), "head_size": HEAD_SIZES}

    dtype: str
    head_size: int = field(metadata={"prefix": "d"})

    def context(self) -> dict:
        return {"Element": CUDA_TYPE[self.dtype], "kHeadDim": self.head_size, "kThreads": THREADS}


def num_partitions(max_seq_len: int) -> int:
    """Partitions of a v2 launch for sequences up to max_seq_len tokens (at least one)."""
    return max(1, -(-max_seq_len // PARTITION_SIZE))


@dataclass
class AttentionCall:
    """One validated call: everything the launches need."""
    cache: CacheSpec
    spec: LegacyAttentionSpec
    out: torch.Tensor
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    alibi_slopes: torch.Tensor | None
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    scale: float
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return self.query.shape[0]

    @property
    def num_heads(self) -> int:
        return self.query.shape[1]

    @property
    def table_tokens(self) -> int:
        return min(self.block_tables.shape[1] * self.cache.block_size, INT32_MAX)


def _tensor(name, t, *, dtypes, dim, device):
    if not isinstance(t, torch.Tensor):
        raise ContractError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ContractError(f"{name} must be {' or '.join(map(str, dtypes))}, got {describe(t)}")
    if t.dim() != dim:
        raise ContractError(f"{name} must be {dim}-D, got {describe(t)}")
    if device is not None and t.device != device:
        raise ContractError(f"{name} is on {t.device}, the cache on {device}")


def check_call(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
               block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale) -> AttentionCall:
    """Every check shared by v1 and v2, before any kernel runs."""
    cache = CacheSpec.from_legacy_tensors(key_cache, value_cache, kv_cache_dtype=kv_cache_dtype)
    device = key_cache.device
    for name, t in (("query", query), ("out", out)):
        _tensor(name, t, dtypes=(torch.float16, torch.bfloat16), dim=3, device=device)
        if t.stride(2) != 1:
            raise ContractError(f"{name}'s head dim must be contiguous, got strides {t.stride()}")
    if tuple(out.shape) != tuple(query.shape) or out.dtype != query.dtype:
        raise ContractError(f"out {tuple(out.shape)} {out.dtype} must match query "
                            f"{tuple(query.shape)} {query.dtype}")
    num_seqs, num_heads, head_size = query.shape
    if head_size != cache.head_size:
        raise ContractError(f"query head_size {head_size} != cache head_size {cache.head_size}")
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or \
            num_kv_heads != cache.num_kv_heads:
        raise ContractError(f"num_kv_heads={num_kv_heads!r} but the cache holds {cache.num_kv_heads} "
                            "KV heads")
    if num_heads % num_kv_heads:
        raise ContractError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads} "
                            "(GQA shares each KV head among num_heads // num_kv_heads query heads)")
    if not cache.is_fp8 and cache.dtype != query.dtype:
        raise ContractError(f"kv_cache_dtype='auto' needs the cache dtype ({cache.dtype}) to equal the "
                            f"query dtype ({query.dtype})")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size != cache.block_size:
        raise ContractError(f"block_size={block_size!r} but the cache has blocks of {cache.block_size}")
    if head_size not in HEAD_SIZES:  # the spec would say so too, without naming the argument
        raise UnsupportedError(f"query head_size {head_size} is not supported by the legacy kernels; "
                               f"supported: {', '.join(map(str, HEAD_SIZES))}")
    spec = LegacyAttentionSpec(short(query.dtype), cache.kv_cache_dtype, head_size, block_size)
    if num_seqs > MAX_GRID_YZ:
        raise ContractError(f"{num_seqs} sequences in one call; the launch grid holds {MAX_GRID_YZ}")

    _tensor("block_tables", block_tables, dtypes=(torch.int32,), dim=2, device=device)
    if block_tables.shape[0] != num_seqs or (block_tables.shape[1] > 1 and block_tables.stride(1) != 1):
        raise ContractError(f"block_tables must be [num_seqs={num_seqs}, max_blocks_per_seq] with "
                            f"contiguous rows, got shape {tuple(block_tables.shape)} strides "
                            f"{block_tables.stride()}")
    _tensor("seq_lens", seq_lens, dtypes=(torch.int32,), dim=1, device=device)
    if seq_lens.numel() != num_seqs or (num_seqs > 1 and seq_lens.stride(0) != 1):
        raise ContractError(f"seq_lens must be a contiguous [num_seqs={num_seqs}] tensor, got shape "
                            f"{tuple(seq_lens.shape)} strides {seq_lens.stride()}")
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 0:
        raise ContractError(f"max_seq_len must be a non-negative int, got {max_seq_len!r}")
    if max_seq_len > block_tables.shape[1] * block_size:
        raise ContractError(f"max_seq_len={max_seq_len} exceeds what block_tables can map "
                            f"({block_tables.shape[1]} blocks of {block_size} tokens)")
    if max_seq_len > INT32_MAX - PARTITION_SIZE:
        raise ContractError(f"max_seq_len={max_seq_len} does not fit the kernels' int32 positions")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ContractError(f"scale must be a finite float, got {scale!r}")
    if alibi_slopes is not None:
        _tensor("alibi_slopes", alibi_slopes, dtypes=(torch.float32,), dim=1, device=device)
        if alibi_slopes.numel() != num_heads or (num_heads > 1 and alibi_slopes.stride(0) != 1):
            raise ContractError(f"alibi_slopes must be a contiguous float32 [num_heads={num_heads}], got "
                                f"shape {tuple(alibi_slopes.shape)}")
    if cache.is_fp8:
        check_scale("k_scale", k_scale, cache, device)
        check_scale("v_scale", v_scale, cache, device)
    return AttentionCall(cache, spec, out, query, key_cache, value_cache, block_tables, seq_lens,
                         alibi_slopes, k_scale if cache.is_fp8 else None,
                         v_scale if cache.is_fp8 else None, float(scale), max_seq_len)


def check_partials(call: AttentionCall, exp_sums, max_logits, tmp_out) -> int:
    """v2's scratch buffers; returns their partition stride."""
    need = num_partitions(call.max_seq_len)
    if need > MAX_GRID_YZ:
        raise ContractError(f"max_seq_len={call.max_seq_len} needs {need} partitions of {PARTITION_SIZE}; "
                            f"the v2 launch grid holds {MAX_GRID_YZ}")
    device = call.key_cache.device
    for name, t in (("exp_sums", exp_sums), ("max_logits", max_logits)):
        _tensor(name, t, dtypes=(torch.float32,), dim=3, device=device)
        if tuple(t.shape[:2]) != (call.num_seqs, call.num_heads) or t.shape[2] < need \
                or not t.is_contiguous():
            raise ContractError(f"{name} must be a contiguous float32 [num_seqs={call.num_seqs}, "
                                f"num_heads={call.num_heads}, >= {need} partitions], got shape "
                                f"{tuple(t.shape)}")
    if exp_sums.shape != max_logits.shape:
        raise ContractError(f"exp_sums {tuple(exp_sums.shape)} and max_logits "
                            f"{tuple(max_logits.shape)} differ in shape")
    stride = exp_sums.shape[2]
    _tensor("tmp_out", tmp_out, dtypes=(call.out.dtype,), dim=4, device=device)
    want = (call.num_seqs, call.num_heads, stride, call.query.shape[2])
    if tuple(tmp_out.shape) != want or not tmp_out.is_contiguous():
        raise ContractError(f"tmp_out must be a contiguous {call.out.dtype} tensor of shape {want}, "
                            f"got {tuple(tmp_out.shape)}")
    return stride


def check_tables(call: AttentionCall) -> None:
    """Debug check (syncs): 0 <= seq_len <= max_seq_len, every block id a sequence uses lies in
    [0, num_blocks), fp8 scales finite and > 0. Names the first offender."""
    if call.cache.is_fp8:
        check_scale_values("k_scale", call.k_scale)
        check_scale_values("v_scale", call.v_scale)
    lens = call.seq_lens.long()
    bad = ((lens < 0) | (lens > call.max_seq_len)).nonzero()
    if bad.numel():
        s = int(bad[0, 0])
        raise ContractError(f"seq_lens[{s}] = {int(lens[s])} is outside [0, max_seq_len="
                            f"{call.max_seq_len}]")
    bs, n = call.cache.block_size, call.cache.num_blocks
    used = torch.arange(call.block_tables.shape[1], device=lens.device)[None, :] < \
        ((lens + bs - 1) // bs)[:, None]
    ids = call.block_tables.long()
    bad = (used & ((ids < 0) | (ids >= n))).nonzero()
    if bad.numel():
        s, j = int(bad[0, 0]), int(bad[0, 1])
        raise ContractError(f"block_tables[{s}, {j}] = {int(ids[s, j])} is outside the cache "
                            f"(num_blocks = {n}); {bad.shape[0]} bad entr(ies) in use")


def _require_cuda(call: AttentionCall) -> None:
    if call.key_cache.device.type != "cuda":
        raise ContractError(f"the legacy attention kernels run on CUDA tensors; key_cache is on "
                            f"{call.key_cache.device} (for CPU tensors use pagedattn.legacy_reference.paged_attention)")


def use_v1(num_seqs: int, num_heads: int, max_seq_len: int) -> bool:
    """vLLM's rule: v1 when max_seq_len <= 8192 and either one partition covers every sequence or
    there are already more than 512 (sequence, head) CTAs to fill the GPU. Otherwise v2, whose
    partitions add parallelism at the cost of a second (reduce) pass."""
    return max_seq_len <= V1_MAX_SEQ_LEN and (num_partitions(max_seq_len) == 1 or num_seqs * num_heads > 512)


def allocate_partials(query: torch.Tensor, max_seq_len: int):
    """(exp_sums, max_logits, tmp_out) scratch for paged_attention_v2."""
    num_seqs, num_heads, head_size = query.shape
    parts = num_partitions(max_seq_len)
    exp_sums = torch.empty((num_seqs, num_heads, parts), dtype=torch.float32, device=query.device)
    max_logits = torch.empty_like(exp_sums)
    tmp_out = torch.empty((num_seqs, num_heads, parts, head_size), dtype=query.dtype, device=query.device)
    return exp_sums, max_logits, tmp_out


class Plan:
    """Everything about a call that depends only on its metadata (shapes, strides, dtypes, devices and
    the scalar arguments): made once by the checked path, reused by later calls with the same
    metadata, which only fill in the pointers."""
    __slots__ = ("version", "attn", "reduce", "grid", "reduce_grid", "tail", "reduce_tail", "is_fp8",
                 "empty")

    def __init__(self, call: AttentionCall, version: str, partition_stride: int | None):
        v2 = version == "v2"
        parts = num_partitions(call.max_seq_len) if v2 else 1
        max_tokens = call.table_tokens  # v2's last partition takes the tokens past max_seq_len's grid
        device = call.key_cache.device.index
        q, o = call.query, call.out
        self.version = version
        self.empty = call.num_seqs == 0
        self.is_fp8 = call.cache.is_fp8
        self.grid = (call.num_heads, call.num_seqs, parts)
        # LegacyAttentionParams after its 12 pointers
        self.tail = (q.stride(0), q.stride(1), o.stride(0), o.stride(1), call.block_tables.stride(0)) + \
            geometry(call.cache, call.key_cache, call.value_cache) + \
            (call.scale * math.log2(math.e), call.num_heads // call.cache.num_kv_heads, max_tokens,
             PARTITION_SIZE if v2 else 0, partition_stride or 0)
        self.attn = self.reduce = None
        if not self.empty:
            self.attn = get_kernel(call.spec).launcher(device)
        self.reduce_grid = (call.num_heads, call.num_seqs, 1)
        self.reduce_tail = (o.stride(0), o.stride(1), max_tokens, PARTITION_SIZE, partition_stride or 0, parts)
        if v2 and not self.empty:
            self.reduce = get_kernel(LegacyReduceSpec(call.spec.dtype, call.spec.head_size)).launcher(device)

    def launch(self, out, query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes, k_scale,
               v_scale, exp_sums=None, max_logits=None, tmp_out=None) -> None:
        if self.empty:
            return
        scales = (k_scale.data_ptr(), v_scale.data_ptr()) if self.is_fp8 else (0, 0)
        partials = (exp_sums.data_ptr(), max_logits.data_ptr(), tmp_out.data_ptr()) \
            if self.reduce is not None else (0, 0, 0)
        self.attn(self.grid, (THREADS, 1, 1),
                  (out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                   block_tables.data_ptr(), seq_lens.data_ptr(),
                   alibi_slopes.data_ptr() if alibi_slopes is not None else 0) + scales + partials + self.tail)
        if self.reduce is not None:
            self.reduce(self.reduce_grid, (THREADS, 1, 1),
                        (out.data_ptr(),) + partials + (seq_lens.data_ptr(),) + self.reduce_tail)


_PLANS = PlanCache()


def _meta(a):
    """What a plan depends on for one argument: a tensor's metadata, or a scalar's type and value."""
    if isinstance(a, torch.Tensor):
        return (a.shape, a.stride(), a.dtype, a.device)
    return (type(a), a)


def run(version: str, out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
        block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, partials=None,
        validate: bool | None = None) -> str:
    """paged_attention_v1 ("v1"), _v2 ("v2", with `partials`) or the rule's choice ("auto").

    The first call with given metadata runs every check (check_call, check_partials, and with
    validate / PAGEDATTN_DEBUG also check_tables) and keeps a Plan; later calls with the same
    metadata re-check only the caches' 16-byte alignment. Returns the version that ran."""
    args = (out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
            max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale)
    debug = validate or (validate is None and envs.debug())
    plan = key = None
    if not debug:
        try:
            key = (version,) + tuple(map(_meta, args)) + tuple(map(_meta, partials or ()))
            plan = _PLANS.get(key)
        except TypeError:  # an unhashable argument: the checked path explains
            key = None
    if plan is None or (key_cache.data_ptr() | value_cache.data_ptr()) & 15:
        call = check_call(*args)
        chosen = version
        if version == "auto":
            chosen = "v1" if use_v1(call.num_seqs, call.num_heads, max_seq_len) else "v2"
            if chosen == "v2":
                partials = allocate_partials(query, max_seq_len)
        stride = check_partials(call, *partials) if chosen == "v2" else None
        if debug:
            check_tables(call)
        _require_cuda(call)
        plan = Plan(call, chosen, stride)
        _PLANS.remember(key, plan)
    elif version == "auto" and plan.version == "v2":
        partials = allocate_partials(query, max_seq_len)
    plan.launch(out, query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes, k_scale, v_scale,
                *(partials if plan.version == "v2" else ()))
    return plan.version
