"""Launch choices of flash_attn_varlen_func as pure functions: which mode (decode or prefill, and
whether the sm_90a TMA / warpgroup-MMA loaders apply) and how many KV splits.

Nothing here reads a device or a tensor: the plan (`_Plan` in the package) asks these with what a
call's metadata and the device say, so every rule can be tested on the CPU."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from .tiles import MAX_HEAD_DIM_MULTI, MAX_HEAD_DIM_PER_GROUP

if TYPE_CHECKING:
    from .validate import _Call

# Multi-token decode (modes multi / multi_tma) takes batches whose longest request packs more than one
# 16-row decode tile and at most this many rows (q_len x query heads per KV head); above, prefill.
# Measured on the H200 (perf/results/prefill_modes_nvidia_h200_20261201_short_9cedf39.json: B=32 over
# 4096 keys, d128, group 4, multi forced against both prefills): multi_tma takes 140 us up to 32 rows
# (one tile), 269 us at 64 rows (two tiles, each streaming K/V) against prefill's 336 us, and 528 us
# at 128 rows against 340: the crossing lies between 64 and 128 rows.
MULTI_ROWS = 64
# Where the warp-specialised prefill (prefill_ws) serves the plan, it takes every batch above this many
# rows, multi-token decode the ones between 17 and this. Measured on the H200
# (perf/results/prefill_modes_nvidia_h200_20261201_short_ws_18f14b0.json, B=32 over 4096 keys, d128,
# group 4): 32 rows multi_tma 137.6 us / prefill_ws 150.9; 64 rows 262.0 / 154.1; 128 rows (SM80
# prefill) 321.4 / 159.5.
WS_ROWS = 32
# prefill_ws takes fp8 caches at this head dim only (AttnTraits: the raw stages need the shared memory)
WS_FP8_HEAD_DIM = 128
# The TMA modes (decode_tma, multi_tma, prefill_ws) compile these head dims that are not multiples of 64 as
# they are for 16-bit caches (32- and 16-column panels, the 64- and 32-byte swizzles), opt-in: forced
# narrow (tma_ok, wgmma_head_dim). prefill_ws at 80: P V is a 64 x 80 wgmma, one of CuTe's extended shapes
# (attn_fwd.cu.j2 defines CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED for it).
NARROW_HEAD_DIMS = (80, 96)

# THE cap on KV splits: a forced num_splits is clamped to it, the heuristic stops at half of it, and
# the in-kernel combine (split_combine.cuh) holds MAX_SPLITS split LSEs per row (rendered in)
# (tests/test_attention_tiles.py checks that the two agree).
MAX_SPLITS = 256


def tma_ok(call: _Call, arch: str, head_dim: int, narrow: bool = False) -> bool:
    """decode_tma needs sm_90, a paged cache whose pages hold whole 16-key sub-tiles, strides the
    tensor map can describe (multiples of 16 bytes; bases are 16-byte aligned already) and, for 16-bit
    caches, a compiled head dim that is a multiple of 64 (above 256, where warps split O's columns,
    16-bit caches only: fp8 operands in registers take whole rows per warp), or (`narrow`, opt-in) one
    of NARROW_HEAD_DIMS."""
    fp8 = call.kv_name != "auto"
    width = 1 if fp8 else 2
    return (arch == "sm_90a" and call.paged and call.block_size % 16 == 0
            and (head_dim <= MAX_HEAD_DIM_PER_GROUP or not fp8)
            and (fp8 or head_dim % 64 == 0 or (narrow and head_dim in NARROW_HEAD_DIMS))
            and all(x * width % 16 == 0 for x in (*call.k_strides, *call.v_strides, call.D)))


def wgmma_ok(call: _Call, arch: str, head_dim: int, narrow: bool = False) -> bool:
    """prefill_wgmma: sm_90a, a compiled head dim that is a multiple of 64, at most 256 (any cache:
    fp8 stages are widened in shared memory for the MMAs); `narrow` (opt-in, where TMA reads the cache:
    prefill_ws alone takes them) one of NARROW_HEAD_DIMS too."""
    return arch == "sm_90a" and head_dim <= MAX_HEAD_DIM_PER_GROUP and \
        (head_dim % 64 == 0 or (narrow and head_dim in NARROW_HEAD_DIMS))


def wgmma_head_dim(head_dim: int, fp8: bool, narrow: bool = False) -> int:
    """The compiled head dim of a plan's warpgroup-MMA prefills (prefill_ws, prefill_wgmma), given its
    own. 80 and 96 (not multiples of 64, which the 128-byte swizzled tiles need) run on the 128 tile:
    the TMA boxes (or cp.async copies) zero-fill the columns past the head size and the epilogue skips
    them, as for head sizes 112 and 120 (GPU-tested: test_ws_prefill_matches_reference,
    test_fp8_ws_prefill_matches_reference, test_fp8_wgmma_prefill_matches_reference). The alternative on
    sm_90a is the SM80 prefill: measured on H200
    (perf/results/ldsm_ab_h200_20261204_405b778_cute_r1.json, B=4 S=4096 causal) 2903 us at d80 and
    3149 us at d96 (118 and 131 TFLOP/s), where d128 prefill_ws takes 1071-1094 us for more work
    (perf/results/h200_sm90_20261204_prefill_lazymax_a86d5b9.json, ws_softmax_lazy/call4_93f0a37/).
    fp8 caches too: prefill_ws at 128 reads the cache with TMA maps of its own, beside decode_tma's at 80
    or 96 (_Plan.tma_maps keeps maps per head dim).
    narrow (opt-in: overrides.forced(narrow=True), where TMA reads the cache): the head dims of
    NARROW_HEAD_DIMS as they are, in prefill_ws's 32- or 16-column panels (attn_wgmma.cuh), not yet
    run on a GPU."""
    if head_dim % 64 == 0 or head_dim > 128 or (narrow and not fp8 and head_dim in NARROW_HEAD_DIMS):
        return head_dim
    return 128


def prefill_mode(wgmma: bool, tma: bool, fp8: bool, head_dim: int) -> str:
    """The prefill of a plan's long queries, given wgmma_ok's and tma_ok's answers: prefill_ws (the
    warp-specialised wgmma prefill, fed by TMA) for a cache TMA can read (fp8: at WS_FP8_HEAD_DIM),
    else prefill_wgmma where warpgroup MMAs apply, else prefill. With an fp8 cache prefill_ws runs its
    MMAs in fp16 (its producer widens e4m3 pairs with one conversion each): measured on the H200 at B=4
    S=4096 causal d128 e4m3, 1331 us against prefill_wgmma's 1693-1812 and bf16 prefill_ws's 1150
    (perf/results/ws_fp8_half/)."""
    if not wgmma:
        return "prefill"
    return "prefill_ws" if tma and (not fp8 or head_dim == WS_FP8_HEAD_DIM) else "prefill_wgmma"


def multi_mode(call: _Call, head_dim: int, tma: bool) -> str | None:
    """The multi-token decode mode of a plan whose decode takes TMA (`tma`, tma_ok's answer): multi_tma
    for a 16-bit cache there, multi (cp.async) otherwise; None above MAX_HEAD_DIM_MULTI (prefill serves
    those rows)."""
    if head_dim > MAX_HEAD_DIM_MULTI:
        return None
    return "multi_tma" if tma and call.kv_name == "auto" else "multi"


def mode_for(rows: int, decode_mode: str, prefill_mode: str, wgmma_rows: int, multi: str | None = None,
             multi_rows: int = MULTI_ROWS) -> str:
    """The variant for a batch whose longest request has `rows` packed query rows: decode up to one
    16-row tile; prefill_ws above WS_ROWS when the plan has it (above `multi_rows` when `multi` is the
    cp.async one, as for fp8 caches: WS_ROWS was measured against multi_tma); multi-token decode
    (`multi`, when the plan has one) up to `multi_rows`; prefill_wgmma (when the plan allows it) once
    the rows overflow one SM80 prefill tile (`wgmma_rows`), plain prefill in between."""
    if rows <= 16:
        return decode_mode
    if prefill_mode == "prefill_ws" and rows > WS_ROWS and multi != "multi":
        return prefill_mode
    if multi is not None and rows <= multi_rows:
        return multi
    return prefill_mode if rows > wgmma_rows else "prefill"


def wave_capacity(sms: int, tma: bool, smem: int, smem_limit: int) -> int:
    """Resident CTAs of one wave of a variant using `smem` bytes of the `smem_limit` of an SM."""
    if tma:
        # TMA decode streams at near the SM's bandwidth share with one CTA per SM; a second resident
        # CTA adds little, so a wave is one CTA per SM (H200, perf/results/attn_quick_*: B=16 ctx 4096
        # 96 us with 1 split vs 110 with 2; B=1 ctx 32768 78 us with 16 splits vs 83 with 32).
        return sms
    return sms * max(1, smem_limit // max(smem, 1))


def split_cost(ctas: int, splits: int, capacity: int, keys: int, fixed_keys: int = 128) -> float:
    """Relative run time of `ctas` x `splits` CTAs over `capacity` resident slots: whole waves (a
    partial last wave costs a full one) times the per-CTA work, 1/splits of a request's keys plus a
    fixed prologue/epilogue worth `fixed_keys` keys."""
    waves = -(-ctas * splits // capacity)
    return waves * (1.0 / splits + fixed_keys / max(keys, 1))


def splits_for(num_splits: int, ctas: int, max_seqlen_k: int, stage_keys: int, capacity: int,
               persistent: bool = False) -> int:
    """The split count: num_splits > 0 is taken as given (at most MAX_SPLITS and one per stage of
    keys); 0 asks for the count with the least whole-wave cost (split_cost), so that a batch neither
    underfills the GPU nor leaves a mostly empty last wave (measured on H200: 512 decode CTAs over
    396 slots ran 1.29 waves, i.e. two). A persistent grid (prefill_ws) has no waves: it splits only
    a batch of fewer work items than resident CTAs (measured on H200, B=1 S=16384 causal d128: the wave
    model's 2 splits ran 6346 us at f4cd955, one split in the persistent kernel 4718 us at 328a07c;
    perf/results/ws_tiles_*.json)."""
    max_steps = max(1, -(-max_seqlen_k // stage_keys))
    if num_splits > 0:
        return max(1, min(num_splits, max_steps, MAX_SPLITS))
    if persistent and ctas >= capacity:
        return 1
    return _best_splits(ctas, max_seqlen_k, max_steps, capacity)


@functools.lru_cache(maxsize=4096)
def _best_splits(ctas: int, max_seqlen_k: int, max_steps: int, capacity: int) -> int:
    """Memoised: the search runs once per batch shape, not on every call."""
    most = max(1, min(MAX_SPLITS // 2, max_steps // 2))  # each split keeps at least two stages of keys
    return min(range(1, most + 1), key=lambda s: (split_cost(ctas, s, capacity, max_seqlen_k), s))
