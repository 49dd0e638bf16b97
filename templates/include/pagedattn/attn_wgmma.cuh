// Warpgroup MMA (sm_90a wgmma) pieces of the prefill mainloop (attn_fwd.cuh, Traits::kWgmma).
//
// Each warpgroup (four warps, 128 threads) owns 64 of the tile's kBlockM rows:
//   S (64 x kBlockN)  = Q K^T   both operands from shared memory (K-major, 128-byte swizzle)
//   O (64 x kHeadDim) += P V    P from registers (the S accumulator converted), V from shared memory
//                               read MN-major (the same swizzled K/V tile, seen transposed)
// The tiles are the ones the cp.async loader already builds: rows of 64 columns in 8-row atoms with
// the 128-byte swizzle are exactly GMMA's K-major SW128 layout, so only the views below are new.
//
// Accumulator registers: a thread holds rows g and g + 8 of its warp's 16 (g = lane / 4) and, for
// each 8-column block n, columns 8n + 2 (lane % 4) + {0, 1}, in the order (row g: c, c + 1; row
// g + 8: c, c + 1) per block -- the order of an SM80 16x8 MMA accumulator, so OnlineSoftmax works on
// a flat (4, 1, N / 8) view of them, and the converted P is already the A-operand order of the
// next MMA (8 values per 16-key step: two 8-column blocks).
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include <cute/tensor.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/atom/mma_atom.hpp>

namespace pagedattn {

template <class Traits>
struct WgmmaTiles {
  using Element = typename Traits::Element;
  static constexpr int kM = Traits::kBlockM, kN = Traits::kBlockN, kD = Traits::kHeadDim;
  using WarpGroups = cute::Layout<cute::Shape<cute::Int<Traits::kWarpsM / 4>, cute::_1, cute::_1>>;

  using Atom = cute::GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(cute::tile_to_shape(Atom{}, cute::Shape<cute::Int<kM>, cute::Int<kD>>{}));
  using SmemLayoutK = decltype(cute::tile_to_shape(Atom{}, cute::Shape<cute::Int<kN>, cute::Int<kD>>{}));
  // V as (d, key): the B operand of P V, D-contiguous (MN-major)
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutK{}, cute::make_layout(cute::Shape<cute::Int<kD>, cute::Int<kN>>{}, cute::GenRowMajor{})));

  using TiledMmaQK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::Int<kN>, cute::Int<kD>>>(),
      WarpGroups{}));
  using TiledMmaPV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::Int<kD>, cute::Int<kN>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
      WarpGroups{}));

  // A warpgroup accumulator of (kM, kCols): ((2, 2, kCols / 8), 1, 1), compact, as
  // partition_fragment_C(TiledMma, (kM, kCols)) builds it (one MMA tile per warpgroup), without that
  // function's layout algebra. PAGEDATTN_CHECK_TYPES: assert it is the same type (check_wgmma_types).
  template <int kCols>
  using AccLayout = cute::Layout<cute::Shape<cute::Shape<cute::_2, cute::_2, cute::Int<kCols / 8>>, cute::_1, cute::_1>,
                                 cute::Stride<cute::Stride<cute::_1, cute::_2, cute::_4>, cute::_0, cute::_0>>;
  template <class TiledMma, int kCols>
  __device__ __forceinline__ static auto acc() {
    auto a = cute::make_tensor<float>(AccLayout<kCols>{});
#if PAGEDATTN_CHECK_TYPES
    static_assert(cute::is_same_v<decltype(a), decltype(cute::partition_fragment_C(
                                                 TiledMma{}, cute::Shape<cute::Int<kM>, cute::Int<kCols>>{}))>,
                  "wgmma accumulator");
#endif
    return a;
  }

  // P in registers, in the A-operand order of TiledMmaPV: (8 values, 1 row block, kBlockN / 16 steps)
  using FragP = decltype(cute::make_tensor<Element>(
      cute::Shape<cute::Shape<cute::_2, cute::_2, cute::_2>, cute::_1, cute::Int<kN / 16>>{}));
};

// C (+)= A B over all k-steps of the operands, issued as one wgmma batch; kZeroInit overwrites C (no
// clear needed). A is shared-memory descriptors or registers (then fenced too). kWait: wait for the
// batch here; otherwise the caller waits (wgmma_wait) before it touches C or a register A again.
template <bool kZeroInit, bool kWait = true, class TiledMma, class TA, class TB, class TC>
__device__ __forceinline__ void wgmma_gemm(TiledMma& mma, TA& a, TB const& b, TC& c) {
  using namespace cute;
  constexpr bool kRegA = !is_same_v<typename TA::engine_type::iterator, GMMA::DescriptorIterator>;
  if constexpr (kRegA) warpgroup_fence_operand(a);
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait) {
    warpgroup_wait<0>();
    warpgroup_fence_operand(c);
    if constexpr (kRegA) warpgroup_fence_operand(a);
  }
}

// Waits until at most kPending of this warpgroup's wgmma batches are in flight (they complete in
// order), then fences the accumulator `c` of the batch waited for.
template <int kPending, class TC>
__device__ __forceinline__ void wgmma_wait(TC& c) {
  cute::warpgroup_wait<kPending>();
  cute::warpgroup_fence_operand(c);
}

}  // namespace pagedattn
