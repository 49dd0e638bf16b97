// Compile-time shape of one attention variant: tile sizes, warp arrangement, MMA and shared memory.
//
// A CTA owns kBlockM packed rows of one (request, kv head): row R is query token R / group of the
// request and query head kv_head * group + R % group, so the query heads sharing a KV head read each
// K/V byte once. Warps form kWarpsN groups of kWarpsM warps:
//   - the kWarpsM warps of a group split the M rows (TiledMma over M), as in prefill;
//   - the kWarpsN groups take different kBlockN-key sub-tiles of each stage (a split of the KV range
//     inside the CTA) and merge their softmax states in the epilogue, as in decode, where M is small.
//
// Two ways to fill shared memory with K/V (kTma):
//   - false: every thread cp.asyncs 16-byte chunks of a whole stage into swizzled tiles; the CTA
//     syncs once per stage (sm_80 ... sm_90);
//   - true (sm_90, paged decode): each warp owns a ring of kStages sub-tiles; one lane fills a slot
//     with TMA tile copies (a sub-tile lies inside one cache page), completing on one mbarrier per
//     slot. The TMA writes the same 128-byte-swizzled tiles the cp.async path builds (fp8: 128-byte
//     swizzled rows of 128 columns when kFp8Regs, else plain rows). Warps never wait for each other
//     inside the mainloop.
//
// kWarpsD > 1 (head dims above 256, where one warp's O accumulator would outgrow its registers): the
// kWarpsD column groups share every key sub-tile; the warp of column group d and key group g computes
// the whole S = Q K^T of g's sub-tile (the same numbers in every column group) and its own
// kHeadDimO-column slice of O += P V. The softmax state is identical across the column groups, so the
// epilogue merges only the key groups. cp.async loading: one key group (kWarpsN == 1); TMA decode
// (16-bit caches): the column groups of a key group share its ring, which column group 0 fills.
//
// kWs = kTma && kWgmma (sm_90a prefill of paged 16-bit caches, mainloop_ws.cuh; persistent CTAs):
// kWarpsM / 4 consumer warpgroups multiply as kWgmma does, fed by a producer warpgroup after them
// (kCtaThreads) whose warps fill separate K and V rings by TMA; kPingPong makes the consumers take
// turns on the tensor cores.
//
// kWgmma (sm_90a prefill): the same cp.async stages and swizzled tiles (they are the 128-byte-swizzled
// K-major layout warpgroup MMAs read), but each warpgroup of four warps multiplies its 64 rows with
// wgmma: S = Q K^T from shared memory, O += P V with P in registers (attn_wgmma.cuh). fp8 caches land
// raw and the CTA widens each stage into the one Element stage the MMAs read, as the SM80 path does.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/numeric.cuh"
#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cutlass/numeric_types.h>
#include "pagedattn/cute_trim.cuh"  // the CuTe traits headers left out (after CuTe: cache keys only)

// prefill_ws: the producer feeds the consumers their work items and Q rows (AttnTraits::kQFeed; 2: two
// Q tiles and chained items, AttnTraits::kChain)
#ifndef PAGEDATTN_WS_Q_FEED
#define PAGEDATTN_WS_Q_FEED 0
#endif
// prefill_ws: O through shared memory and bulk copies (AttnTraits::kOBulk)
#ifndef PAGEDATTN_WS_O_BULK
#define PAGEDATTN_WS_O_BULK 0
#endif
// prefill_ws: K/V multicast to the two CTAs of a cluster (AttnTraits::kPair)
#ifndef PAGEDATTN_WS_PAIR
#define PAGEDATTN_WS_PAIR 0
#endif

namespace pagedattn {

template <class Element_, Fp8Format kFp8_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarpsM_,
          int kWarpsN_, int kStages_, bool kTma_, bool kWgmma_, int kWarpsD_,
          bool kPingPong_, bool kKAhead_, int kExp2FmaSoftcap_, class Smem_>
struct AttnTraits {
  using Element = Element_;  // cutlass::half_t or cutlass::bfloat16_t: Q, O and both MMA operands
  static constexpr Fp8Format kFp8 = kFp8_;
  static constexpr bool kIsFp8 = kFp8 != Fp8Format::kNone;
  static constexpr bool kIsBf16 = cute::is_same_v<Element, cutlass::bfloat16_t>;
  static constexpr int kCacheBytes = kIsFp8 ? 1 : int(sizeof(Element));

  static constexpr int kHeadDim = kHeadDim_;  // tile width; the runtime head size may be smaller
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;    // keys of one warp group's sub-tile
  static constexpr int kWarpsM = kWarpsM_;
  static constexpr int kWarpsN = kWarpsN_;
  static constexpr int kStages = kStages_;   // stages of the CTA (cp.async) or slots of each warp's ring (TMA)
  static constexpr bool kTma = kTma_;
  static constexpr bool kWgmma = kWgmma_;
  static constexpr int kWarpsD = kWarpsD_;    // warp groups that split O's columns (one sub-tile of keys)
  static constexpr int kHeadDimO = kHeadDim / kWarpsD;  // columns of O each group accumulates
  static constexpr int kGroupThreads = 32 * kWarpsM;
  static constexpr int kThreads = kGroupThreads * kWarpsN * kWarpsD;  // the threads that compute a tile
  // kWs: the warp-specialised sm_90a prefill (TMA feeding warpgroup MMAs, mainloop_ws.cuh), whose
  // producer warpgroup follows the kThreads consumer threads
  static constexpr bool kWs = kTma && kWgmma;
  // The MMAs' operand type: Element, except in prefill_ws with an fp8 cache, whose producer widens
  // the chunks to fp16 (one conversion per pair of e4m3 values, a byte move for e5m2: both formats
  // are fp16 values exactly); a bf16 Q is then converted to fp16 in shared memory once per item, each
  // warp's rows scaled by a power of two that keeps them below fp16's largest (kQToHalf)
  using MmaElement = cute::conditional_t<kWs && kIsFp8, cutlass::half_t, Element>;
  static constexpr int kProducerThreads = kWs ? 128 : 0;
  static constexpr int kCtaThreads = kThreads + kProducerThreads;
  static constexpr bool kPingPong = kPingPong_;  // kWs: the consumer warpgroups take turns issuing MMAs
  static constexpr bool kKAhead = kKAhead_;  // kWs, fp8: the producer widens K a step ahead of V
  // kWs, fp8 (PAGEDATTN_WS_FP8_QK, tile field kWsFp8Qk: its slots, 0 off, the default): K is not
  // widened. Its raw chunks land by TMA in a ring of kKSlots slots and S = Q K^T runs as fp8 MMAs on
  // them: Q is split per item into two e4m3 tiles, hi + lo, which hold a bf16 or fp16 Q's values
  // exactly but for parts below 2^-16 of the warp's rows' largest |q|, so S costs the MMAs of one
  // 16-bit S and the producer widens V alone. The fp8 MMAs accumulate with less precision than fp32
  // (tiles.py: the LSE off by up to 0.33 on outlier inputs), hence opt-in
  static constexpr int kKSlots = kWs && kIsFp8 ? PAGEDATTN_WS_FP8_QK : 0;
  static constexpr bool kFp8Qk = kKSlots > 0;
  static constexpr bool kQToHalf = kWs && kIsFp8 && kIsBf16 && !kFp8Qk;  // see MmaElement
  // kWs (PAGEDATTN_WS_Q_FEED, tile field kWsQFeed; opt-in): the producer finds each work item, hands it
  // to the consumers in shared memory and copies its Q rows (cp.async, landing on an mbarrier per
  // consumer warpgroup) once the warpgroup's last S of the item before no longer reads them; without
  // it each consumer warpgroup finds its next item and copies its own Q rows
  static constexpr bool kQFeed = kWs && PAGEDATTN_WS_Q_FEED > 0;
  // kWsQFeed 2 (16-bit caches up to head dim 128, where a second Q tile fits): two Q tiles, item n's in
  // tile n % 2, so that item n + 1's first S can run in the same turn on the tensor cores as item n's
  // last P V (ws_consume's chain); four work slots per consumer warpgroup (an item's is read until its
  // epilogue, after the producer may have filled the next item's Q tile)
  static constexpr bool kChain = kQFeed && PAGEDATTN_WS_Q_FEED == 2 && !kIsFp8 && kHeadDim <= 128;
  static constexpr int kQTiles = kChain ? 2 : 1;
  static constexpr int kWorkSlots = kChain ? 4 : 2;
  // kWs with 16-bit caches up to head dim 128 (PAGEDATTN_WS_O_BULK, tile field kWsOBulk; opt-in): each
  // consumer warp puts its 16 rows of O in a shared-memory buffer of its own (stmatrix, rows kOPitch
  // bytes apart: no bank conflicts), and its lanes store them a row each by 1-D bulk copies, instead of
  // 4-byte stores from the accumulators (ws_store_tile). Not where the buffers do not fit beside the
  // rings (fp8's raw stages, head dims above 128)
  static constexpr bool kOBulk = kWs && PAGEDATTN_WS_O_BULK && !kIsFp8 && kHeadDim <= 128;
  static constexpr int kOPitch = kHeadDim * 2 + 16;
  // kWs with 16-bit caches (PAGEDATTN_WS_PAIR, tile field kWsPair; opt-in, the host renders it only
  // there: tiles.ws_pair): the kernel runs in clusters of two CTAs, which take work items 2 P and 2 P + 1
  // (two row tiles of one column) together and walk the same K/V steps, each producer loading half of
  // every step's boxes into both CTAs' rings (TMA multicast): half the L2 reads and the boxes per CTA
  // (ws_produce, ws_pair_item)
  static constexpr bool kPair = kWs && PAGEDATTN_WS_PAIR;
  static_assert(!kPair || !kIsFp8, "kWsPair: 16-bit caches");
  static constexpr int kRingSlots = kKSlots > kStages ? kKSlots : kStages;  // mbarriers per ring kind
  // kWs with softcap (a tanh per score on the SFU too): column groups of 8 keys, of kBlockN / 8, whose
  // 2^x the consumers compute on the FMA pipe instead (OnlineSoftmax::exponentiate)
  static constexpr int kExp2FmaSoftcap = kExp2FmaSoftcap_;
  static constexpr int kStageKeys = kBlockN * kWarpsN;
  static constexpr int kMmaM = kBlockM / (16 * kWarpsM);  // 16-row MMA tiles per warp
  static constexpr int kRows = 2 * kMmaM;                  // softmax rows held by each thread

  static_assert(kHeadDim % 16 == 0 && kHeadDimO <= 256, "kHeadDim: a multiple of 16, at most 256 per column group");
  static_assert(kWarpsD == 1 || (!kWgmma && kHeadDim % (64 * kWarpsD) == 0 &&
                                  (kTma ? !kIsFp8 && kWarpsM == 1 : kWarpsN == 1)),
                "column groups: whole 64-column swizzle atoms each; cp.async loading with one key sub-tile per "
                "stage, or TMA decode of a 16-bit cache");
  static_assert(kBlockM % (16 * kWarpsM) == 0, "kBlockM must be a multiple of 16 * kWarpsM");
  static_assert(kBlockN % 16 == 0, "kBlockN must be a multiple of 16 (one MMA K step of P.V)");
  static_assert(kStages >= 2, "the K/V pipeline needs at least two stages");
  static_assert(!kTma || kWgmma || (kWarpsM == 1 && (kIsFp8 || kHeadDim % 16 == 0)),
                "TMA loading: one warp per group; 16-bit tiles in swizzle atoms of 64, 32 or 16 columns");
  static_assert(!kWs || ((!kIsFp8 || kHeadDim == 128) && kBlockN % 16 == 0 && kBlockN <= 512),
                "warp-specialised prefill: 16-bit caches or fp8 at head dim 128, 16-key TMA chunks, one per "
                "producer lane");
  // fp8 TMA decode with 128-byte rows per column block: the tiles land 128-byte swizzled and each
  // thread converts its own MMA operands from fp8 in registers (attn_fp8_regs.cuh); no widened copy.
  static constexpr bool kFp8Regs = kTma && !kWgmma && kIsFp8 && kHeadDim % 128 == 0;
  static_assert(!kFp8Regs || kBlockM == 16, "fp8 register operands: one 16-row MMA tile per warp");
  static_assert(!kWgmma || (kWarpsN == 1 && kWarpsM % 4 == 0 && kBlockM == 16 * kWarpsM &&
                            (kHeadDim % 64 == 0 || (kWs && !kIsFp8)) && kBlockN % 64 == 0),
                "wgmma: whole warpgroups of 64 rows, Element tiles in 64-column swizzle atoms (prefill_ws with "
                "a 16-bit cache: 32- and 16-column ones too, attn_wgmma.cuh)");

  // Swizzled shared-memory tiles: 8-row atoms as wide as the head dim allows (64, 32 or 16 columns).
  static constexpr int kBlockKSmem = kHeadDim % 64 == 0 ? 64 : (kHeadDim % 32 == 0 ? 32 : 16);
  static constexpr int kSwizzle = kBlockKSmem == 64 ? 3 : (kBlockKSmem == 32 ? 2 : 1);
  using SmemLayoutAtom = decltype(cute::composition(
      cute::Swizzle<kSwizzle, 3, 3>{},
      cute::Layout<cute::Shape<cute::_8, cute::Int<kBlockKSmem>>,
                   cute::Stride<cute::Int<kBlockKSmem>, cute::_1>>{}));
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  // (kBlockN, kHeadDim) tiles are column blocks of kBlockKSmem columns, each kBlockN rows of swizzled
  // 8-row atoms: exactly what TMA boxes {kBlockKSmem columns, 16 rows} with the 128-byte swizzle (64-
  // and 32-byte at 32 and 16 columns) write (tma.py).
  using SmemLayoutKV = decltype(cute::tile_to_shape(
      SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  // V seen as (d, key): the B operand of P.V, read with transposing ldmatrix.
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutKV{},
      cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));
  // One column group's slice of V as (d, key): its kHeadDimO columns are whole column blocks of the
  // tile, starting kBlockN * kHeadDimO elements in (a multiple of the swizzle's 512-element period, so
  // the slice is swizzled exactly like a tile of its own width).
  using SmemLayoutVtO = decltype(cute::composition(
      cute::tile_to_shape(SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDimO>>{}),
      cute::make_layout(cute::Shape<cute::Int<kHeadDimO>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));

  using MmaOp = cute::conditional_t<kIsBf16, cute::SM80_16x8x16_F32BF16BF16F32_TN,
                                    cute::SM80_16x8x16_F32F16F16F32_TN>;
  using TiledMma = cute::TiledMMA<cute::MMA_Atom<MmaOp>,
                                  cute::Layout<cute::Shape<cute::Int<kWarpsM>, cute::_1, cute::_1>>,
                                  cute::Tile<cute::Int<16 * kWarpsM>, cute::_16, cute::_16>>;
  using SmemCopyAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomT = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;

  // Shared memory: the host's plan of every region (tiles.smem_plan, rendered; SharedStorage in
  // attn_smem.cuh lays it out and checks it against these tiles). fp8 caches land raw in stages of
  // bytes; without kFp8Regs they are widened into Element stages the MMAs read.
  using Smem = Smem_;
  static constexpr int kTileElems = kBlockN * kHeadDim;
  // A stage (cp.async) or one ring slot of every warp (TMA) holds kStageKeys keys: kWarpsN tiles.
  static constexpr int kSmemStageElems = kWarpsN * kTileElems;
  static constexpr int kSmemStageRaw = kStageKeys * kHeadDim;  // fp8 bytes, unpadded
};

}  // namespace pagedattn
