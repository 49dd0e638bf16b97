// Warpgroup MMA (sm_90a wgmma) pieces of the prefill mainloop (attn_fwd.cuh, Traits::kWgmma).
//
// Each warpgroup (four warps, 128 threads) owns 64 of the tile's kBlockM rows:
//   S (64 x kBlockN)  = Q K^T   both operands from shared memory (K-major, swizzled)
//   O (64 x kHeadDim) += P V    P from registers (the S accumulator converted), V from shared memory
//                               read MN-major (the same swizzled K/V tile, seen transposed)
// The tiles are the ones the cp.async loader already builds (Traits::SmemLayoutKV): panels of
// kPanel = Traits::kBlockKSmem columns in 8-row swizzled atoms. 64 columns with the 128-byte swizzle
// are GMMA's K-major SW128 layout; prefill_ws also takes head dims 96 (32-column panels, 64-byte
// swizzle: SW64) and 80 (16-column panels, 32-byte swizzle: SW32), as its TMA boxes land them. Only the
// views below are new.
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
#include "pagedattn/numeric.cuh"

namespace pagedattn {

template <class Traits>
struct WgmmaTiles {
  using Element = typename Traits::MmaElement;
  static constexpr int kM = Traits::kBlockM, kN = Traits::kBlockN, kD = Traits::kHeadDim;
  using WarpGroups = cute::Layout<cute::Shape<cute::Int<Traits::kWarpsM / 4>, cute::_1, cute::_1>>;

  // columns of a panel: 128-, 64- or 32-byte rows, the swizzle's span (Traits::SmemLayoutAtom)
  static constexpr int kPanel = Traits::kBlockKSmem;
  static_assert(kPanel == 64 || ((kPanel == 32 || kPanel == 16) && Traits::kWs && !Traits::kIsFp8),
                "128-byte swizzled panels, or (prefill_ws with a 16-bit cache) 64- or 32-byte ones");
  using Atom = cute::conditional_t<kPanel == 64, cute::GMMA::Layout_K_SW128_Atom<Element>,
                                   cute::conditional_t<kPanel == 32, cute::GMMA::Layout_K_SW64_Atom<Element>,
                                                       cute::GMMA::Layout_K_SW32_Atom<Element>>>;
  static constexpr cute::GMMA::LayoutType kLayoutType =
      kPanel == 64 ? cute::GMMA::LayoutType::B128
                   : kPanel == 32 ? cute::GMMA::LayoutType::B64 : cute::GMMA::LayoutType::B32;
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

  // The (row, column) coordinates in the (kM, kCols) tile of a thread's accumulator entries, as
  // thr_mma.partition_C(make_identity_tensor(kM, kCols)) gives them: thread v = tidx % 128 of
  // warpgroup wg holds rows 64 wg + 16 (v / 32) + (v / 4) % 8 (+ 8) and columns 2 (v % 4) (+ 1) + 8 n
  // (the accumulator order above), computed in the order the TiledMma's layouts do.
  template <int kCols>
  using CoordLayout = cute::Layout<
      cute::Shape<cute::Shape<cute::_2, cute::_2, cute::Int<kCols / 8>>, cute::_1, cute::_1>,
      cute::Stride<cute::Stride<cute::ScaledBasis<cute::_1, 1>, cute::ScaledBasis<cute::_8, 0>,
                                cute::ScaledBasis<cute::_8, 1>>, cute::_0, cute::_0>>;
  template <int kCols>
  __device__ __forceinline__ static auto coords(int tidx) {
    int const v = tidx % 128, wg = tidx / 128 % (Traits::kWarpsM / 4);
    int const col = v % 4 * 2, row = v / 4 % 8 + v / 32 * 16 + wg * 64;
    return cute::make_tensor(cute::make_inttuple_iter(cute::make_tuple(row, col)), CoordLayout<kCols>{});
  }

  // The shared-memory operands as wgmma descriptor fragments, as thr_mma.partition_fragment_A/B build
  // them from the tiles above, without that function's layout algebra (most of the front end's time in
  // these mainloops). A fragment is one descriptor (the operand's first k-step) and a layout of k-steps
  // whose offsets, in 16-byte units, the MMA adds to the descriptor's start address: (1, 1, k-steps).
  // The tiles are panels of kPanel columns (kRows x kPanel, kPanel / 8 units a row, 8-row atoms stacked
  // down the rows); a k-step of Q or K is the next 16 columns (32 bytes, 2 units) of a panel, then the
  // next panel (kRows x kPanel / 8 units on); a k-step of V^T is the next 16 keys (16 rows: 2 kPanel
  // units).
  // K-major operands (Q, K): the stride byte offset steps 8 rows (kPanel units: 1024 bytes at SW128);
  // the leading byte offset is 1 (unused by swizzled K-major layouts, whose atom spans the MMA's 16
  // columns). V read MN-major (d-contiguous): the leading byte offset steps a panel along d (kN rows,
  // kN x kPanel / 8 units; 0 where there is one), the stride byte offset 8 keys (kPanel units).
  // PAGEDATTN_CHECK_TYPES: the fragments' engines and k-step offsets are CuTe's (check_wgmma_types); the
  // descriptors' values are CuTe's make_gmma_desc's (check_wgmma_descs, PAGEDATTN_CHECK_DESCS) and, at
  // SW128, checked by the SASS, byte-identical to that of partition_fragment_A/B
  // (perf/results/nvrtc_wgmma_frags_cpu2_20261204_issue19.json).
  static constexpr int kUnitsPerRow = kPanel / 8;  // 16-byte units of a panel's row
  template <int kRows>
  using KMajorSteps = cute::Layout<
      cute::Shape<cute::_1, cute::_1, cute::Shape<cute::Int<kPanel / 16>, cute::Int<kD / kPanel>>>,
      cute::Stride<cute::_0, cute::_0, cute::Stride<cute::_2, cute::Int<kRows * kUnitsPerRow>>>>;
  using VtSteps = cute::Layout<cute::Shape<cute::_1, cute::_1, cute::Int<kN / 16>>,
                               cute::Stride<cute::_0, cute::_0, cute::Int<16 * kUnitsPerRow>>>;

  // fp8 operands (kFp8Qk): a k-step is 32 columns (32 bytes, 2 units) of the one 128-byte panel
  using Fp8Steps = cute::Layout<cute::Shape<cute::_1, cute::_1, cute::Int<kD / 32>>,
                                cute::Stride<cute::_0, cute::_0, cute::_2>>;

  template <cute::GMMA::LayoutType kType = kLayoutType>
  __device__ __forceinline__ static cute::GmmaDescriptor desc(void const* tile, uint32_t leading, uint32_t stride) {
    cute::GmmaDescriptor d;
    d.bitfield.layout_type_ = uint8_t(kType);
    d.bitfield.start_address_ = uint16_t(cute::cast_smem_ptr_to_uint(tile) >> 4);
    d.bitfield.base_offset_ = 0;
    d.bitfield.stride_byte_offset_ = stride;
    d.bitfield.leading_byte_offset_ = leading;
    return d;
  }
  // Q's rows of thread tidx's warpgroup (64 rows: 64 x kPanel elements into each panel; the warpgroup
  // taken modulo the tile's, as the TiledMma's thread layout does)
  __device__ __forceinline__ static auto frag_q(Element const* q_tile, int tidx) {
    int const wg = tidx / 128 % (Traits::kWarpsM / 4);
    return cute::make_tensor(cute::GMMA::DescriptorIterator{desc(q_tile + wg * 64 * kPanel, 1, kPanel)},
                             KMajorSteps<kM>{});
  }
  __device__ __forceinline__ static auto frag_k(Element const* k_tile) {
    return cute::make_tensor(cute::GMMA::DescriptorIterator{desc(k_tile, 1, kPanel)}, KMajorSteps<kN>{});
  }
  __device__ __forceinline__ static auto frag_vt(Element const* v_tile) {
    return cute::make_tensor(
        cute::GMMA::DescriptorIterator{desc(v_tile, kD > kPanel ? kN * kUnitsPerRow : 0, kPanel)}, VtSteps{});
  }

  // kFp8Qk: the e4m3 Q tile `half` (0: hi, 1: lo; kM rows of kD bytes each, hi first) of thread
  // tidx's warpgroup, and a raw K slot
  __device__ __forceinline__ static auto frag_q8(void const* q_tiles, int half, int tidx) {
    static_assert(kD == 128, "one 128-byte panel");
    int const wg = tidx / 128 % (Traits::kWarpsM / 4);
    char const* const at = static_cast<char const*>(q_tiles) + (half * kM + wg * 64) * kD;
    return cute::make_tensor(cute::GMMA::DescriptorIterator{desc<cute::GMMA::LayoutType::B128>(at, 1, 64)},
                             Fp8Steps{});
  }
  __device__ __forceinline__ static auto frag_k8(void const* k_raw) {
    return cute::make_tensor(cute::GMMA::DescriptorIterator{desc<cute::GMMA::LayoutType::B128>(k_raw, 1, 64)},
                             Fp8Steps{});
  }

  // P in registers, in the A-operand order of TiledMmaPV: (8 values, 1 row block, kBlockN / 16 steps)
  using FragP = decltype(cute::make_tensor<Element>(
      cute::Shape<cute::Shape<cute::_2, cute::_2, cute::_2>, cute::_1, cute::Int<kN / 16>>{}));
};

// kFp8Qk (prefill_ws, fp8 cache): S = Q K^T as e4m3 Q (hi, then lo) times the raw fp8 K, both K-major
// in 128-byte swizzled rows (one 128-column panel: the decode path's TMA boxes). Apart from WgmmaTiles
// so that only the kernels that use it instantiate it.
template <class Traits>
struct WgmmaQk8 {
  using Tiles = WgmmaTiles<Traits>;
  using KElement = cute::conditional_t<Traits::kFp8 == Fp8Format::kE5M2, cutlass::float_e5m2_t, cutlass::float_e4m3_t>;
  using TiledMma = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<cutlass::float_e4m3_t, KElement, float,
                                 cute::Shape<cute::_64, cute::Int<Tiles::kN>, cute::Int<Tiles::kD>>>(),
      typename Tiles::WarpGroups{}));
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

// C = A1 B + A2 B as one wgmma batch, not waited for (kFp8Qk's S: Q's e4m3 hi and lo against one K).
template <class TiledMma, class TA, class TB, class TC>
__device__ __forceinline__ void wgmma_gemm_split(TiledMma& mma, TA const& a1, TA const& a2, TB const& b, TC& c) {
  using namespace cute;
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a1); ++k) {
    cute::gemm(mma, a1(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a2); ++k) cute::gemm(mma, a2(_, _, k), b(_, _, k), c);
  warpgroup_commit_batch();
}

// Waits until at most kPending of this warpgroup's wgmma batches are in flight (they complete in
// order), then fences the accumulator `c` of the batch waited for.
template <int kPending, class TC>
__device__ __forceinline__ void wgmma_wait(TC& c) {
  cute::warpgroup_wait<kPending>();
  cute::warpgroup_fence_operand(c);
}

}  // namespace pagedattn
