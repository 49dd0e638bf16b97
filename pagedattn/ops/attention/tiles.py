"""Tile sizes of the attn_fwd kernels: THE choice per (head dim, mode, cache dtype, arch), the
shared memory each needs, and what each arch gives a CTA.

The measured defaults (`_tiles`) serve sm_80 and sm_90a alike (one rendered source per variant).
sm_86 and sm_89 give a CTA only 99 KiB: where a default tile needs more (decode at head dims 192 and
256), `tile_config` halves the warps that split the keys until the stages fit; a tile that still
cannot fit is refused with an UnsupportedError."""
from __future__ import annotations

from ...registry import UnsupportedError
from . import overrides

HEAD_DIMS = (64, 80, 96, 128, 192, 256, 512)
# Above this head dim the warps split O's columns (kWarpsD groups; see attn_traits.cuh): decode,
# prefill and (16-bit caches) decode_tma only (no warpgroup MMAs, no fp8 operands in registers).
MAX_HEAD_DIM_PER_GROUP = 256
COLUMN_GROUP_MODES = ("decode", "decode_tma", "prefill")
# Multi-token decode (q_len x group packed rows of one KV head up to MULTI_ROWS, e.g. speculative
# decoding): the decode tiles with 32 rows per warp, at head dims up to MAX_HEAD_DIM_MULTI (a warp's
# 32 x 128 fp32 O takes 128 registers; wider ones would spill).
MAX_HEAD_DIM_MULTI = 128
MODES = ("decode", "decode_tma", "multi", "multi_tma", "prefill", "prefill_wgmma", "prefill_ws")
# sm_90, paged caches: K/V by TMA (into each warp's ring; prefill_ws: by a producer warpgroup)
TMA_MODES = ("decode_tma", "multi_tma", "prefill_ws")
WGMMA_MODES = ("prefill_wgmma", "prefill_ws")  # sm_90a warpgroup MMAs
SM90_MODES = (*TMA_MODES, "prefill_wgmma")
# Shared memory one CTA may use (the opt-in maximum of cudaFuncSetAttribute), per NVRTC target.
SMEM_PER_CTA = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_90a": 227 * 1024}
SMEM_LIMIT = SMEM_PER_CTA["sm_90a"]  # the budget of the default tiles (every one of them also fits sm_80's)
WS_RAW_STAGES = 2  # prefill_ws with an fp8 cache: raw stages per K and V (AttnTraits::kRawStages)
SMALL_SMEM_ARCH = "sm_86"  # the tiles of AttnFwdSpec.small_smem: those of the 99 KiB archs (sm_86, sm_89)


def tile_config(head_dim: int, mode: str, fp8: bool = False, arch: str = "sm_90a") -> dict:
    """THE choice of tile sizes per (head dim, mode, arch). Decode packs few rows, so its warps split
    the KV range (kWarpsN); prefill's warps split the rows (kWarpsM). decode_tma is decode with each
    warp filling its own ring by TMA (sm_90, paged caches; see attn_traits.cuh); multi and multi_tma
    are those two with 32 rows per warp (multi-token decode); prefill_wgmma is prefill with warpgroup
    MMAs (sm_90a, head dims that are multiples of 64; fp8 stages widened in shared memory);
    prefill_ws is the warp-specialised one (a TMA producer warpgroup; paged 16-bit caches).
    On an arch with less shared memory than the default tile needs, fewer warps split the keys
    (each stage holds kBlockN x kWarpsN keys); UnsupportedError if even one warp's stages overflow."""
    if head_dim > MAX_HEAD_DIM_PER_GROUP and (mode not in COLUMN_GROUP_MODES or (mode == "decode_tma" and fp8)):
        raise UnsupportedError(f"attn_fwd: mode={mode}{' with an fp8 cache' if fp8 else ''} supports head dims "
                               f"up to {MAX_HEAD_DIM_PER_GROUP}, got {head_dim} (decode and prefill run it)")
    if head_dim > MAX_HEAD_DIM_MULTI and mode in ("multi", "multi_tma"):
        raise UnsupportedError(f"attn_fwd: mode={mode} supports head dims up to {MAX_HEAD_DIM_MULTI}, "
                               f"got {head_dim} (prefill runs it)")
    cfg = {"kWgmma": mode in WGMMA_MODES, "kWarpsD": 1, **_tiles(head_dim, mode, fp8)}
    limit = smem_limit(arch)
    while smem_bytes(cfg, head_dim, fp8) > limit and cfg["kWarpsN"] > 1:
        cfg["kWarpsN"] //= 2
    while smem_bytes(cfg, head_dim, fp8) > limit and cfg["kStages"] > 2:
        cfg["kStages"] -= 1
    if smem_bytes(cfg, head_dim, fp8) > limit:
        raise UnsupportedError(f"attn_fwd: no {mode} tile fits in shared memory at head_dim {head_dim}"
                               f"{' (fp8 cache)' if fp8 else ''}: {smem_bytes(cfg, head_dim, fp8)} bytes, "
                               f"a CTA gets at most {limit} on {arch}")
    return {**cfg, **overrides.current().tiles_for(mode)}  # a benchmark's or test's (overrides.py)


def smem_limit(arch: str) -> int:
    """Shared memory one CTA may use on `arch`."""
    try:
        return SMEM_PER_CTA[arch]
    except KeyError:
        raise UnsupportedError(f"attn_fwd: no shared-memory size known for arch {arch!r} "
                               f"(known: {', '.join(SMEM_PER_CTA)})") from None

def _tiles(head_dim: int, mode: str, fp8: bool) -> dict:
    if head_dim > MAX_HEAD_DIM_PER_GROUP:
        # two column groups of 256 (a warp's 16 x 256 fp32 O is the most its registers hold); every
        # group reads each stage's keys, so stages stay at 16 keys (32 KiB of K+V at d512)
        if mode == "decode":
            return dict(kBlockM=16, kBlockN=16, kWarpsM=1, kWarpsN=1, kWarpsD=2, kStages=3, kMinBlocks=2,
                        kTma=False)
        if mode == "decode_tma":
            # 16-bit caches: each key group's two column warps share one ring (mainloop_tma.cuh); two
            # key groups of three 32 KiB slots (208 KiB with Q), one CTA per SM
            return dict(kBlockM=16, kBlockN=16, kWarpsM=1, kWarpsN=2, kWarpsD=2, kStages=3, kMinBlocks=1,
                        kTma=True)
        return dict(kBlockM=64, kBlockN=16, kWarpsM=4, kWarpsN=1, kWarpsD=2, kStages=2, kMinBlocks=1,
                    kTma=False)
    if mode == "decode":
        # Measured on H200 (perf/results/history/attn_tile_sweep_*): with cp.async, decode is bound by
        # warps per SM, so the smallest sub-tile and two stages (68 KiB at d128: three CTAs) win.
        return dict(kBlockM=16, kBlockN=16, kWarpsM=1, kWarpsN=4, kStages=2, kMinBlocks=3, kTma=False)
    if mode in ("multi", "multi_tma"):
        # Multi-token decode: the decode tiles of the same loader with two 16-row MMA tiles per warp
        # (32 packed rows: e.g. 8 query tokens x 4 query heads per KV head), so K/V stream once per KV
        # head as in decode instead of through a 128-row prefill tile that is mostly padding.
        tma = mode == "multi_tma"
        return dict(kBlockM=32, kBlockN=16, kWarpsM=1, kWarpsN=4, kStages=3 if tma else 2, kMinBlocks=2,
                    kTma=tma)
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
    if mode == "prefill_ws":
        # two consumer warpgroups of 64 rows each and a producer warpgroup; 128-key stages where the
        # O and S accumulators fit the consumers' registers (64 + 64 fp32 at d128), 64 keys above.
        # Two slots at d128: measured on H200 (perf/results/ws_tiles_f4cd955.json, ws_tiles_328a07c.json:
        # causal B=4 S=4096, B=1 S=16384, B=16 S=1024, B=8 512 over 8192) 1-5 % faster than three in
        # every case, before and after the kernel became persistent. Two at d64 too: B=4 S=4096 causal
        # 814 / 809 -> 801 / 796 us (rot / flush; two rounds alike, perf/results/ws_tiles_d64/; 192-key
        # stages gain the same, with spills). Three elsewhere where they fit (tile_config drops to two
        # where shared memory ends, at d256).
        # fp8 (head dim 128): the producer widens the chunks (to fp16), so it keeps 72 registers (the
        # consumers 216, as with 64) and widens K(n + 1) before V(n) (kKAhead). Measured on H200, B=4
        # S=4096 causal e4m3 (perf/results/ws_fp8_half/): 40 registers 1507 us, 48 1444, 56 1389; with
        # kKAhead 56 1331-1340, 64 1300, 72 1281-1287, 80 1347-1356 (bf16 ws 1140-1170 in those runs).
        # Softcap at d128 (a tanh per score: the SFU, not the tensor cores, bounds the step): 2 of the 16
        # column groups take 2^x on the FMA pipe; measured on H200 (perf/results/ws_tiles_softcap_exp2fma_*
        # 0485e2d: B=4 S=4096 causal 1428 -> 1395-1408 us, B=1 S=16384 4990 -> 4936 us; 1 and 3 no gain,
        # 4, 6 and 8 slower: the FMA pipe fills).
        # kWsFp8Qk (fp8; off, opt-in through tile overrides): S = Q K^T as e4m3 x fp8 MMAs on K's raw chunks
        # (a ring of kWsFp8Qk raw slots in the bytes of the two fp16 K slots; Q split per item into e4m3
        # hi + lo, exact to 2^-16 of a warp's largest |q|), so the producer widens V alone. Faster: B=4
        # S=4096 causal e4m3 on H200, 1287 -> 1204-1221 us, 0.89x -> 0.91-0.94x of bf16 in the same runs
        # (perf/results/ws_fp8_qk/). Not the default because the fp8 MMAs accumulate with less than fp32's
        # precision: against float64, the LSE moved by up to 1e-3 with normal Q and 0.15-0.33 with
        # heavy-tailed or outlier-channel Q, the output's rel L2 up to 1e-2, where the widened path
        # matches the bf16 cache's results bit for bit (ws_fp8_qk/precision/).
        # kWsQLate at d256: Q's 16 wgmma descriptors made per S rather than held across the step loop,
        # where they spilled with the 128-register O: B=4 S=4096 causal 2467 / 2407 and 2447 / 2429 ->
        # 2290 / 2256 and 2291 / 2281 us (rot / flush, two rounds in one call); d128 and d192 alike either
        # way (perf/results/ws_q_late/). On for fp8 too, whose consumers (216 registers) spilled the
        # descriptors in the step loop: 5.0 M -> 0.74 M local-memory requests (ncu), time unchanged
        # (1285-1292 us against 1274-1283 without; perf/results/ws_fp8_producer/).
        # kLazyMax 2 at head dims >= 128 (softmax.cuh): a tile's row maxima are quad-reduced, and O rescaled,
        # only when a row of the warp grew by more than 8 (log2 units) past its maximum, which otherwise
        # lags (p <= 2^8, undone by l). The row maxima cost ~10 % of the d128 step (a probe with none:
        # 1144 -> 1027 us); lazy ones, A/B interleaved in one call on H200 (perf/results/ws_softmax_lazy/,
        # B=4 S=4096 causal, rot / flush us): d128 1121 / 1110 and 1115 / 1086 -> 1094 / 1089 and
        # 1094 / 1087, B=1 S=16384 3894-3899 -> 3803-3806, d192 1727-1729 -> 1658-1659, d256 2233 ->
        # 2120-2123, fp8 e4m3 1296 -> 1261; d64 798-799 -> 824-825 (slower: off there); B=8 512 over 8192
        # alike (946-949 -> 939-948). 1 (exact maxima, fewer skips) measured no better than 0.
        # kLazyMax 3 (softmax.cuh: exponentiate_lagging; opt-in until its GPU tests pass, see
        # perf/results/ws_lag/README.md): an item's steps after its first exponentiate against the maxima as
        # they stand, with no FMNMX pass; a row part's sum of p over 2^8 takes the maxima from the p, one past
        # 2^60 makes S again from the cache (rare). A/B interleaved in one call on H200 (rot / flush us, the
        # defaults against 3): B=4 S=4096 causal d128 1112 / 1113 and 1135 / 1101 -> 1094 / 1084 and
        # 1088 / 1086, B=1 S=16384 3943 -> 3750-3757, d64 794 -> 767, d256 2185-2198 -> 2175-2185.
        # Exponentials first with the FMNMX pass kept (the maxima voted on after them) measured no gain:
        # the pass's instructions cost, not its latency.
        # kWsQFeed (opt-in, not yet run on a GPU; ws_producer.cuh ws_feed_q): the producer finds each work
        # item, hands it over in shared memory and copies its Q rows by cp.async onto an mbarrier per consumer
        # warpgroup, which hands the rows back after its last S of the item. The consumers then run no
        # schedule and no Q addressing (~830 instructions a warp per item by ncu at b658785) and no warpgroup
        # barrier before a 16-bit Q; the producer keeps 40 registers (24 without), the consumers 232. ptxas
        # (sm_90a, NVRTC 13): consumer spill instructions 40 -> 0 at d128 with kLazyMax 3, 32 -> 0 at d192,
        # 80 -> 0 at d256, 56 -> 0 for fp8 e4m3, 42 -> 8 with a window and ALiBi. kWsQFeed 2 (16-bit caches to
        # head dim 128, where a second Q tile fits): two Q tiles, and an item's first S issued in the same turn
        # on the tensor cores as the last P V of the item before (ws_consume's chain). kWsOBulk (opt-in, likewise
        # unmeasured; 16-bit caches to head dim 128): O by stmatrix into a buffer per consumer warp and a 1-D
        # bulk copy per row of the request, instead of 32 4-byte stores per thread.
        # kWsPair (opt-in, not yet run on a GPU; 16-bit caches: ws_pair): clusters of two
        # CTAs take row tiles 2m + 1 and 2m of one column together and walk the steps either sees, each
        # producer multicasting half of every step's boxes into both CTAs' rings: half the TMA boxes and L2
        # reads per CTA, the lever session 30's probe priced at 3.5-5 % (perf/results/ws_pair/README.md).
        # With the feed, no spills at d128 (ptxas); without it the consumers' two schedules spill (74).
        # Head dims 80 and 96 (opt-in narrow; the plans run them on the 128 tile: heuristics.wgmma_head_dim)
        # take the d128 tiles: 32- / 16-column panels, 120 / 100 KiB of shared memory with two slots.
        return dict(kBlockM=128, kBlockN=128 if head_dim <= 128 else 64, kWarpsM=8, kWarpsN=1,
                    kStages=2 if head_dim <= 128 else 3, kMinBlocks=1, kTma=True, kPingPong=True,
                    kExp2FmaSoftcap=2 if head_dim == 128 else 0, kWsQLate=head_dim == 256 or fp8,
                    kLazyMax=2 if head_dim >= 128 else 0,
                    **(dict(kKAhead=True, kWsProducerRegs=72) if fp8 else {}))
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
    rows split into 128-byte swizzled blocks (not in prefill_ws, whose producer widens fp8 chunks into
    a 16-bit ring)."""
    return tma and head_dim % 128 == 0


def ws_pair(cfg: dict, fp8: bool) -> bool:
    """Whether a tile runs prefill_ws in clusters of two CTAs with K/V multicast (tile field kWsPair,
    opt-in; AttnTraits::kPair): 16-bit caches (an fp8 producer widens raw stages of its own). The
    launch then pads the row tiles to an even count and the persistent grid to an even size, so that
    work items 2 P and 2 P + 1 are two row tiles of one column (ws_pair_item)."""
    return bool(cfg.get("kTma") and cfg.get("kWgmma") and cfg.get("kWsPair")) and not fp8


WS_WORK_BYTES = 56  # sizeof(AttnWork): prefill_ws keeps four of them (two per consumer warpgroup)


def smem_plan(cfg: dict, head_dim: int, fp8: bool) -> dict:
    """THE shared-memory plan of a tile: stage counts and the size of each region of SharedStorage
    (attn_smem.cuh), in elements of the region's type. The rendered source takes these numbers as
    they are (attn_fwd.cu.j2: `struct Smem`) and asserts the regions hold what the tiles need and
    that sizeof(SharedStorage) is Bytes, the dynamic shared memory the launch asks for.

      union { Q | K stages | V stages (Element) | raw K | raw V (fp8 bytes);  O | m, l (float) }
      WsO (prefill_ws with kWsOBulk: O's rows, 16-byte units); RingBars mbarriers; prefill_ws: the split-KV
      flag (8 bytes), WsWork work items, WsRawBars and WsQBars mbarriers"""
    stage = cfg["kBlockN"] * cfg["kWarpsN"] * head_dim  # one stage (cp.async) or one slot of every warp's ring
    ws = cfg["kTma"] and cfg["kWgmma"]
    # Element stages the MMAs read: one per stage (16-bit caches); fp8: the one stage raw stages are
    # widened into, none when TMA decode converts fp8 operands in registers, the whole ring in prefill_ws
    # (its producer widens WS_RAW_STAGES raw stages into it)
    if not fp8 or ws:
        elem_stages = cfg["kStages"]
    else:
        elem_stages = 0 if fp8_regs(head_dim, cfg["kTma"] and not cfg["kWgmma"]) else 1
    raw_stages = (WS_RAW_STAGES if ws else cfg["kStages"]) if fp8 else 0
    # prefill_ws, fp8 with kWsFp8Qk = n (opt-in): K is not widened; its raw chunks land in a ring of n
    # slots that S's fp8 MMAs read as they are (the RawK region), and only V has Element slots
    k_slots = cfg.get("kWsFp8Qk", 0) if ws and fp8 else 0
    rows = cfg["kWarpsN"] * cfg["kBlockM"]  # the epilogue's rows: every warp group's
    # prefill_ws with kWsQFeed 2 (16-bit caches to head dim 128): two Q tiles, four work slots per consumer
    # warpgroup (AttnTraits::kChain)
    chain = ws and cfg.get("kWsQFeed") == 2 and not fp8 and head_dim <= 128
    q_feed = ws and bool(cfg.get("kWsQFeed"))
    plan = dict(ElemStages=elem_stages, RawStages=raw_stages, Q=(2 if chain else 1) * cfg["kBlockM"] * head_dim,
                K=0 if k_slots else elem_stages * stage, V=elem_stages * stage,
                RawK=(k_slots or raw_stages) * stage, RawV=raw_stages * stage,
                O=rows * head_dim, RowStats=2 * rows,
                # TMA: an mbarrier per (warp, ring slot); prefill_ws: a full and an empty one per slot of
                # the K ring and of the V ring, and (fp8) one per (K or V, producer warp, raw stage)
                RingBars=(4 if ws else cfg["kWarpsN"]) * max(cfg["kStages"], k_slots) if cfg["kTma"] else 0,
                WsFlag=int(ws), WsWork=(8 if chain else 4) if ws else 0, WsRawBars=2 * 4 * raw_stages if ws else 0,
                # prefill_ws with kWsQFeed (opt-in): a full and an empty mbarrier per consumer warpgroup's Q rows
                # (per Q tile)
                WsQBars=(8 if chain else 4) if q_feed else 0,
                # prefill_ws with kWsOBulk (opt-in; 16-bit caches to head dim 128): 16 rows of O per consumer
                # warp, 2 head_dim + 16 bytes apart, in 16-byte units
                WsO=cfg["kWarpsM"] * (2 * head_dim + 16) if ws and cfg.get("kWsOBulk") and not fp8 and head_dim <= 128
                else 0)
    main = max(2 * (plan["Q"] + plan["K"] + plan["V"]) + plan["RawK"] + plan["RawV"],
               4 * (plan["O"] + plan["RowStats"]))
    tail = 8 * (plan["RingBars"] + plan["WsFlag"] + plan["WsRawBars"] + plan["WsQBars"]) + \
        WS_WORK_BYTES * plan["WsWork"]
    if plan["WsO"]:  # its 16-byte units right after the union (and the struct's size a multiple of 16)
        main = -(-main // 16) * 16 + 16 * plan["WsO"]
    plan["Bytes"] = (-(-main // 8) * 8 if tail else main) + tail
    if plan["WsO"]:
        plan["Bytes"] = -(-plan["Bytes"] // 16) * 16
    return plan


def smem_bytes(cfg: dict, head_dim: int, fp8: bool) -> int:
    """The dynamic shared memory of a tile: sizeof(SharedStorage), by smem_plan."""
    return smem_plan(cfg, head_dim, fp8)["Bytes"]
