// Compile-time shape of one attention variant: tile sizes, warp arrangement, MMA and shared memory.
//
// A CTA owns kBlockM packed rows of one (request, kv head): row R is query token R / group of the
// request and query head kv_head * group + R % group, so the query heads sharing a KV head read each
// K/V byte once. Warps form kWarpsN groups of kWarpsM warps:
//   - the kWarpsM warps of a group split the M rows (TiledMma over M), as in prefill;
//   - the kWarpsN groups take different kBlockN-key sub-tiles of each stage (a split of the KV range
//     inside the CTA) and merge their softmax states in the epilogue, as in decode, where M is small.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/numeric.cuh"
#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cutlass/numeric_types.h>

namespace pagedattn {

template <class Element_, Fp8Format kFp8_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarpsM_,
          int kWarpsN_, int kStages_>
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
  static constexpr int kStages = kStages_;
  static constexpr int kGroupThreads = 32 * kWarpsM;
  static constexpr int kThreads = kGroupThreads * kWarpsN;
  static constexpr int kStageKeys = kBlockN * kWarpsN;
  static constexpr int kMmaM = kBlockM / (16 * kWarpsM);  // 16-row MMA tiles per warp
  static constexpr int kRows = 2 * kMmaM;                  // softmax rows held by each thread

  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256, "kHeadDim: a multiple of 16, at most 256");
  static_assert(kBlockM % (16 * kWarpsM) == 0, "kBlockM must be a multiple of 16 * kWarpsM");
  static_assert(kBlockN % 16 == 0, "kBlockN must be a multiple of 16 (one MMA K step of P.V)");
  static_assert(kStages >= 2, "the K/V pipeline needs at least two stages");

  // Swizzled shared-memory tiles: 8-row atoms as wide as the head dim allows (64, 32 or 16 columns).
  static constexpr int kBlockKSmem = kHeadDim % 64 == 0 ? 64 : (kHeadDim % 32 == 0 ? 32 : 16);
  static constexpr int kSwizzle = kBlockKSmem == 64 ? 3 : (kBlockKSmem == 32 ? 2 : 1);
  using SmemLayoutAtom = decltype(cute::composition(
      cute::Swizzle<kSwizzle, 3, 3>{},
      cute::Layout<cute::Shape<cute::_8, cute::Int<kBlockKSmem>>,
                   cute::Stride<cute::Int<kBlockKSmem>, cute::_1>>{}));
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(cute::tile_to_shape(
      SmemLayoutAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  // V seen as (d, key): the B operand of P.V, read with transposing ldmatrix.
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutKV{},
      cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));

  using MmaOp = cute::conditional_t<kIsBf16, cute::SM80_16x8x16_F32BF16BF16F32_TN,
                                    cute::SM80_16x8x16_F32F16F16F32_TN>;
  using TiledMma = cute::TiledMMA<cute::MMA_Atom<MmaOp>,
                                  cute::Layout<cute::Shape<cute::Int<kWarpsM>, cute::_1, cute::_1>>,
                                  cute::Tile<cute::Int<16 * kWarpsM>, cute::_16, cute::_16>>;
  using SmemCopyAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomT = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;

  // Shared memory, bytes. fp8 caches land raw in per-stage byte buffers and are widened once per
  // stage into a single Element stage that the MMAs read.
  static constexpr int kTileElems = kBlockN * kHeadDim;
  static constexpr int kSmemQ = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemStageElems = kStageKeys * kHeadDim;
  static constexpr int kSmemKV = kIsFp8
      ? 2 * kStages * kSmemStageElems + 2 * kSmemStageElems * int(sizeof(Element))
      : 2 * kStages * kSmemStageElems * int(sizeof(Element));
  static constexpr int kSmemEpilogue = kWarpsN * kBlockM * (kHeadDim + 2) * int(sizeof(float));
  static constexpr int kSmemBytes =
      kSmemQ + kSmemKV > kSmemEpilogue ? kSmemQ + kSmemKV : kSmemEpilogue;
};

}  // namespace pagedattn
