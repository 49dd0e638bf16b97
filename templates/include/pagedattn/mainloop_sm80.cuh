// The SM80-class mainloop of attn_fwd (mma.sync tensor cores; sm_80 ... sm_90) and its K/V loaders.
//
// Per step of kStageKeys keys, each warp group takes its kBlockN-key sub-tile:
//   1. the loader has the step's stage in shared memory: this file's CpAsyncKVLoader (the whole CTA,
//      kStages - 1 stages ahead) or TMA decode's ring per warp (TmaKVLoader, mainloop_tma.cuh);
//   2. fp8 caches: the group widens its sub-tile to Element in shared memory, or (kFp8Regs) each
//      thread converts its MMA operands in registers (attn_fp8_regs.cuh); scales are folded in later;
//   3. S = Q K^T, the mask policy (mask.cuh), online softmax, O += P V.
// Rows are located through PagedKV; keys past the end, columns past the head size and rows of corrupt
// pages are zero-filled.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/async_copy.cuh"
#include "pagedattn/attn_fp8_regs.cuh"
#include "pagedattn/attn_tile.cuh"
#include "pagedattn/epilogue.cuh"
#include "pagedattn/mask.cuh"
#include "pagedattn/numeric.cuh"
#include "pagedattn/softmax.cuh"
#include "pagedattn/tma_copy.cuh"

namespace pagedattn {


// Packed rows [row_begin, row_begin + rows) of item w's tile -> (token, head) rows of q, into the
// swizzled Q tile at `q_smem`, by cp.async: thread `tid` of `threads` (not committed).
template <class Traits>
__device__ __forceinline__ void load_q_rows(AttnParams const& p, AttnWork const& w, typename Traits::Element* q_smem,
                                            int row_begin, int rows, int tid, int threads) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kChunks = Traits::kHeadDim / 8;
  Tensor sQ = make_tensor(make_smem_ptr(q_smem), typename Traits::SmemLayoutQ{});
  Element const* q = static_cast<Element const*>(p.q);
  for (int i = tid; i < rows * kChunks; i += threads) {
    int const r = row_begin + i / kChunks, col = (i % kChunks) * 8;
    int const R = w.row0 + r, t = R / p.group, g = R - t * p.group;
    bool const ok = t < w.q_len && col < p.head_size;
    Element const* src = q + (int64_t(w.q_start + t) * p.q_row_stride +
                              int64_t(w.kv_head * p.group + g) * p.q_head_stride + col);
    cp_async_16(&sQ(r, col), ok ? src : q, ok);
  }
}

// The whole Q tile, by every thread of the tile (one cp.async group with the first K/V stage).
template <class Traits>
__device__ __forceinline__ void load_q_tile(TileCtx<Traits> const& c) {
  load_q_rows<Traits>(c.p, c.w, c.smem.q(), 0, Traits::kBlockM, c.tidx, Traits::kThreads);
}

// cp.async K/V loader: the whole CTA copies stage `step` (every warp group's sub-tile) into stage
// buffer `stage`. 16-bit caches land in the swizzled Element tiles the MMAs read; fp8 caches land raw.
// kAsyncProxy: the stages are read by wgmma (the async proxy): fence each thread's cp.async bytes
// before the barrier that publishes them.
template <class Traits, bool kAsyncProxy = false>
struct CpAsyncKVLoader {
  TileCtx<Traits> const& c;
  int n_steps;
  bool fp8_rows_16b;  // fp8 rows 16-byte aligned (else two 8-byte halves)

  __device__ __forceinline__ CpAsyncKVLoader(TileCtx<Traits> const& ctx, int steps)
      : c(ctx), n_steps(steps),
        fp8_rows_16b(ctx.p.head_size % 16 == 0 &&
                     ((ctx.p.k_block_stride | ctx.p.k_row_stride | ctx.p.k_head_stride | ctx.p.v_block_stride |
                       ctx.p.v_row_stride | ctx.p.v_head_stride) & 15) == 0) {}

  __device__ __forceinline__ void load(int step, int stage) const {
    constexpr int kHeadDim = Traits::kHeadDim, kBlockN = Traits::kBlockN;
    int const key0 = step * Traits::kStageKeys, D = c.p.head_size;
    PagedKV const& kv = c.kv;
    constexpr int kCols = 16 / Traits::kCacheBytes;  // columns of one 16-byte chunk of a cache row
    constexpr int kChunks = kHeadDim / kCols;
    for (int i = c.tidx; i < Traits::kStageKeys * kChunks; i += Traits::kThreads) {
      int const row = i / kChunks, col = (i % kChunks) * kCols;
      int const j = key0 + row;
      char const *k_row = kv.k_base, *v_row = kv.v_base;
      bool const ok = j < c.w.k_len && kv.locate(j, k_row, v_row) && col < D;
      if constexpr (!Traits::kIsFp8) {
        int const off = int(typename Traits::SmemLayoutKV{}(row % kBlockN, col));
        cp_async_16(c.smem.k_tile(stage, row / kBlockN) + off, ok ? k_row + col * 2 : kv.k_base, ok);
        cp_async_16(c.smem.v_tile(stage, row / kBlockN) + off, ok ? v_row + col * 2 : kv.v_base, ok);
      } else {
        uint8_t* k_dst = c.smem.raw_k(stage, row) + col;
        uint8_t* v_dst = c.smem.raw_v(stage, row) + col;
        if (fp8_rows_16b) {
          cp_async_16(k_dst, ok ? k_row + col : kv.k_base, ok);
          cp_async_16(v_dst, ok ? v_row + col : kv.v_base, ok);
        } else {  // rows only 8-byte aligned (D % 16 == 8): two halves, the second may lie past D
          bool const ok_hi = ok && col + 8 < D;
          cp_async_8(k_dst, ok ? k_row + col : kv.k_base, ok);
          cp_async_8(v_dst, ok ? v_row + col : kv.v_base, ok);
          cp_async_8(k_dst + 8, ok_hi ? k_row + col + 8 : kv.k_base, ok_hi);
          cp_async_8(v_dst + 8, ok_hi ? v_row + col + 8 : kv.v_base, ok_hi);
        }
      }
    }
  }

  // The first kStages - 1 stages (the Q tile, loaded before, rides in the first group).
  __device__ __forceinline__ void prologue() const {
#pragma unroll
    for (int s = 0; s < Traits::kStages - 1; ++s) {
      if (s < n_steps) load(c.w.step_begin + s, s);
      cp_async_commit();
    }
  }

  // Before step `it`: its stage landed for every thread (and stage it-1 is free), then the stage
  // kStages - 1 ahead is issued.
  __device__ __forceinline__ void wait(int it) const {
    constexpr int kStages = Traits::kStages;
    cp_async_wait<kStages - 2>();
    if constexpr (kAsyncProxy) fence_proxy_async_smem();
    __syncthreads();
    if (it + kStages - 1 < n_steps) load(c.w.step_begin + it + kStages - 1, (it + kStages - 1) % kStages);
    cp_async_commit();
  }

  // Where step `it`'s tiles of this warp group are (16-bit caches; fp8 stages are raw bytes).
  __device__ __forceinline__ int stage_of(int it) const { return it % Traits::kStages; }
};


// fp8 caches: `kKeys` raw rows of K and V (kHeadDim bytes each, as the loader lands them) widened to
// Element into the swizzled tiles the MMAs read, by `threads` threads from `first`; the caller
// synchronises those threads before the MMAs (scales are folded in later).
template <class Traits, int kKeys>
__device__ __forceinline__ void widen_fp8_keys(uint8_t const* raw_k, uint8_t const* raw_v, typename Traits::Element* k_tile,
                                               typename Traits::Element* v_tile, int first, int threads) {
  constexpr int kHeadDim = Traits::kHeadDim, kChunks = kHeadDim / 16;
  typename Traits::SmemLayoutKV layout;
  for (int i = first; i < kKeys * kChunks; i += threads) {
    int const r = i / kChunks, col = (i % kChunks) * 16;
    int const raw_off = r * kHeadDim + col;
    uint4 lo, hi;
    dequant_fp8x16<Traits::kIsBf16, Traits::kFp8>(*reinterpret_cast<uint4 const*>(raw_k + raw_off), lo, hi);
    *reinterpret_cast<uint4*>(k_tile + layout(r, col)) = lo;
    *reinterpret_cast<uint4*>(k_tile + layout(r, col + 8)) = hi;
    dequant_fp8x16<Traits::kIsBf16, Traits::kFp8>(*reinterpret_cast<uint4 const*>(raw_v + raw_off), lo, hi);
    *reinterpret_cast<uint4*>(v_tile + layout(r, col)) = lo;
    *reinterpret_cast<uint4*>(v_tile + layout(r, col + 8)) = hi;
  }
}

// Barrier over one warp group (named barrier 1 + group; the whole CTA when there is one group).
template <class Traits>
__device__ __forceinline__ void group_sync(int group_idx) {
  if constexpr (Traits::kWarpsN == 1) {
    __syncthreads();
  } else if constexpr (Traits::kGroupThreads == 32) {
    __syncwarp();
  } else {
    asm volatile("bar.sync %0, %1;\n" ::"r"(1 + group_idx), "n"(Traits::kGroupThreads));
  }
}

// The MMA operand fragments of one warp group, as thr_mma.partition_fragment_A(sQ) / _B(sK) / _B(sVt)
// build them from the swizzled tiles, without that layout algebra (after the copies', the front end's
// largest cost). The layouts CuTe derives follow the tiles' swizzle atoms (Traits::kBlockKSmem = kW
// columns: 64, 32 or 16, so kW / 16 k-steps per atom): a k-step mode splits into the k-steps of one
// atom ((2, 2) for 64 columns, 2 for 32, none for 16), then the atoms, which are innermost in the
// registers; V's d mode into an atom's 8-column groups (8; (2, 2); 2), then the atoms. Written for
// every atom width with more than one atom per tile, and for one 64-column atom (d64); other tiles
// keep CuTe's derivation. Only the register order depends on these types (copies and MMAs index the
// fragments through them), never a value. PAGEDATTN_CHECK_TYPES: assert they are CuTe's types.
template <class Traits>
struct Sm80Frags {
  using Element = typename Traits::Element;
  static constexpr int kMmaM = Traits::kMmaM, kN8 = Traits::kBlockN / 8, kK16 = Traits::kBlockN / 16;
  static constexpr int kW = Traits::kBlockKSmem;
  static constexpr int kAtoms = Traits::kHeadDim / kW, kAtomsO = Traits::kHeadDimO / kW;
  static constexpr bool kWritten = Traits::kHeadDim % kW == 0 && Traits::kHeadDimO % kW == 0 &&
                                   (kW == 64 || (kAtoms > 1 && kAtomsO > 1));
  template <int kN, int kS>  // the stride of a mode of kN entries: kS, or 0 for a single entry
  using S = cute::Int<kN == 1 ? 0 : kS>;
  template <int kN>
  using I = cute::Int<kN>;
  using _1 = cute::_1;
  using _2 = cute::_2;
  using _4 = cute::_4;
  using _8 = cute::_8;
  using _0 = cute::_0;
  // The k-step mode of Q's and K's fragments, kU registers per k-step: the k-steps of an atom (stride
  // kU * kAtoms), then the atoms (stride kU)
  template <int kU>
  using StepShape = cute::conditional_t<
      kW == 64,
      cute::conditional_t<kAtoms == 1, cute::Shape<_2, _2>, cute::Shape<cute::Shape<_2, _2>, I<kAtoms>>>,
      cute::conditional_t<kW == 32, cute::Shape<_2, I<kAtoms>>, I<kAtoms>>>;
  template <int kU>
  using StepStride = cute::conditional_t<
      kW == 64,
      cute::conditional_t<kAtoms == 1, cute::Stride<I<kU>, I<2 * kU>>,
                          cute::Stride<cute::Stride<I<kU * kAtoms>, I<2 * kU * kAtoms>>, I<kU>>>,
      cute::conditional_t<kW == 32, cute::Stride<I<kU * kAtoms>, I<kU>>, I<kU>>>;
  // The same mode in the register views of the copies: an atom's k-steps as one mode (4 or 2)
  template <int kU>
  using ViewStepShape = cute::conditional_t<kW == 16, I<kAtoms>,
                                            cute::conditional_t<kAtoms == 1, I<kW / 16>, cute::Shape<I<kW / 16>, I<kAtoms>>>>;
  template <int kU>
  using ViewStepStride = cute::conditional_t<kW == 16 || kAtoms == 1, I<kU>, cute::Stride<I<kU * kAtoms>, I<kU>>>;

  using LayoutQ = cute::Layout<cute::Shape<cute::Shape<_2, _2, _2>, I<kMmaM>, StepShape<8 * kMmaM>>,
                               cute::Stride<cute::Stride<_1, _2, _4>, S<kMmaM, 8>, StepStride<8 * kMmaM>>>;
  using LayoutK = cute::Layout<cute::Shape<cute::Shape<_2, _2>, I<kN8>, StepShape<4 * kN8>>,
                               cute::Stride<cute::Stride<_1, _2>, S<kN8, 4>, StepStride<4 * kN8>>>;
  // V^T's d mode: 64-column atoms put an atom's 8 groups of d first (stride 4), then the kK16 key
  // steps (32), then the atoms; narrower ones the atoms first (4 * kK16), then their groups
  // (4 * kK16 * kAtomsO), then the key steps (4)
  static constexpr int kUV = 4 * kK16;
  using LayoutVt = cute::conditional_t<
      kW == 64,
      cute::Layout<cute::Shape<cute::Shape<_2, _2>, cute::conditional_t<kAtomsO == 1, _8, cute::Shape<_8, I<kAtomsO>>>, I<kK16>>,
                   cute::Stride<cute::Stride<_1, _2>, cute::conditional_t<kAtomsO == 1, _4, cute::Stride<_4, I<32 * kK16>>>,
                                S<kK16, 32>>>,
      cute::Layout<cute::Shape<cute::Shape<_2, _2>,
                               cute::Shape<cute::conditional_t<kW == 32, cute::Shape<_2, _2>, _2>, I<kAtomsO>>, I<kK16>>,
                   cute::Stride<cute::Stride<_1, _2>,
                                cute::Stride<cute::conditional_t<kW == 32, cute::Stride<I<kUV * kAtomsO>, I<2 * kUV * kAtomsO>>,
                                                                 I<kUV * kAtomsO>>,
                                             I<kUV>>,
                                S<kK16, 4>>>>;

  // The register views the ldmatrix copies write (s2r_*_thr.retile_D(fragment)), with the fragments (a
  // wrong view would put values in the wrong registers): a copy's 8 values, contiguous except for V^T
  // in atoms narrower than 64 columns (its second 8 d are the next group, 4 * kK16 * kAtomsO on).
  // PAGEDATTN_CHECK_TYPES asserts them for the tested tiles: (kMmaM, kBlockN / 8, kHeadDim / 64,
  // kHeadDimO / 64) = (1, 2, 2, 2) sm_80 decode, (2, 8, 2, 2) sm_80 prefill, (1, 4, 4, 4) sm_80 prefill
  // d256, (1, 2, 8, 4) sm_90a decode_tma d512; decode, prefill and multi (2, 2, ...) at d64, d80, d96
  // (one 64-column atom; five of 16 columns; three of 32), prefill d192 (three 64-column atoms) and
  // (2, 2, 2, 2) multi_tma; also checked once: (1, 4, 2, 2) fp8 decode_tma. Written with the fragments.
  using ViewQ = cute::Layout<cute::Shape<cute::Shape<_8, _1>, I<kMmaM>, ViewStepShape<8 * kMmaM>>,
                             cute::Stride<cute::Stride<_1, _0>, S<kMmaM, 8>, ViewStepStride<8 * kMmaM>>>;
  using ViewK = cute::Layout<cute::Shape<cute::Shape<_8, _1>, I<kN8 / 2>, ViewStepShape<4 * kN8>>,
                             cute::Stride<cute::Stride<_1, _0>, S<kN8 / 2, 8>, ViewStepStride<4 * kN8>>>;
  using ViewVt = cute::conditional_t<
      kW == 64,
      cute::conditional_t<
          kK16 == 1 || kAtomsO == 1,
          cute::Layout<cute::Shape<cute::Shape<_8, _1>, I<4 * kAtomsO>, I<kK16>>,
                       cute::Stride<cute::Stride<_1, _0>, _8, S<kK16, 32>>>,
          cute::Layout<cute::Shape<cute::Shape<_8, _1>, cute::Shape<_4, I<kAtomsO>>, I<kK16>>,
                       cute::Stride<cute::Stride<_1, _0>, cute::Stride<_8, I<32 * kK16>>, I<32>>>>,
      cute::Layout<cute::Shape<cute::Shape<cute::Shape<_4, _2>, _1>,
                               cute::conditional_t<kW == 32, cute::Shape<_2, I<kAtomsO>>, I<kAtomsO>>, I<kK16>>,
                   cute::Stride<cute::Stride<cute::Stride<_1, I<kUV * kAtomsO>>, _0>,
                                cute::conditional_t<kW == 32, cute::Stride<I<2 * kUV * kAtomsO>, I<kUV>>, I<kUV>>,
                                S<kK16, 4>>>>;

  template <class View, class ThrCopy, class Frag>
  __device__ __forceinline__ static auto view(ThrCopy const& thr, Frag& frag) {
    if constexpr (kWritten) {
      auto v = cute::make_tensor(frag.data(), View{});
#if PAGEDATTN_CHECK_TYPES
      static_assert(cute::is_same_v<decltype(v), decltype(thr.retile_D(frag))>, "register view");
#endif
      return v;
    } else {
      return thr.retile_D(frag);
    }
  }

  template <class ThrMma, class TensorQ>
  __device__ __forceinline__ static auto q(ThrMma const& thr, TensorQ const& sQ) {
    if constexpr (kWritten) {
      auto f = cute::make_tensor<Element>(LayoutQ{});
#if PAGEDATTN_CHECK_TYPES
      static_assert(cute::is_same_v<decltype(f), decltype(thr.partition_fragment_A(sQ))>, "Q fragment");
#endif
      return f;
    } else {
      return thr.partition_fragment_A(sQ);
    }
  }
  template <class ThrMma, class TensorK>
  __device__ __forceinline__ static auto k(ThrMma const& thr, TensorK const& sK) {
    if constexpr (kWritten) {
      auto f = cute::make_tensor<Element>(LayoutK{});
#if PAGEDATTN_CHECK_TYPES
      static_assert(cute::is_same_v<decltype(f), decltype(thr.partition_fragment_B(sK))>, "K fragment");
#endif
      return f;
    } else {
      return thr.partition_fragment_B(sK);
    }
  }
  template <class ThrMma, class TensorVt>
  __device__ __forceinline__ static auto vt(ThrMma const& thr, TensorVt const& sVt) {
    if constexpr (kWritten) {
      auto f = cute::make_tensor<Element>(LayoutVt{});
#if PAGEDATTN_CHECK_TYPES
      static_assert(cute::is_same_v<decltype(f), decltype(thr.partition_fragment_B(sVt))>, "V fragment");
#endif
      return f;
    } else {
      return thr.partition_fragment_B(sVt);
    }
  }
};

// The shared -> register copies of the MMA operands: ldmatrix x4 of Q and K, ldmatrix x4.trans of V
// (Traits::SmemCopyAtom / SmemCopyAtomT). Where Sm80Frags writes the register views out (kWritten), each
// thread's shared-memory addresses are written out too, instead of CuTe's make_tiled_copy_A/B(...)
// .get_thread_slice(..).partition_S of the swizzled tiles (with retile_D, most of the front end's
// cost); other tiles keep CuTe's tiled copies. PAGEDATTN_CHECK_TYPES: check_sm80_types asserts, in the
// front end, the written offsets equal CuTe's for every thread, copy and k-step.
//
// An x4 ldmatrix loads four 8x8 matrices of 16-bit values; lane l gives the address of row l % 8 of
// matrix l / 8 (16 contiguous bytes), and every lane receives register i from matrix i. The MMA
// fragments fix which matrix goes to which register, hence each lane's (row, column):
//   Q (A operand, 16 rows x 16 columns per copy): registers a0..a3 are (rows 0-7 | 8-15) x (columns 0-7),
//     then x (columns 8-15): lane l reads row l % 16, columns l / 16 * 8 + [0, 8);
//   K (B operand, 16 keys x 16 columns: two 8-key MMA tiles): b0, b1 of keys 0-7, then b0, b1 of keys
//     8-15: lane l reads key l / 16 * 8 + l % 8, columns l / 8 % 2 * 8 + [0, 8);
//   V^T (B operand of P V, transposed from V's (key, d) rows: 16 keys x 16 d per copy): b0, b1 of
//     d 0-7, then of d 8-15: lane l reads key l % 16, d l / 16 * 8 + [0, 8).
// Each copy (the A operand's rows 16 * kWarpsM * mi + 16 * warp, K's keys 16 * j, V's d 16 * j) at
// k-step kk (16 columns of Q and K, 16 keys of V) moves the lane's (row, column) by multiples of 16, so
// the thread's part of the address is computed once and each copy adds an offset to it (below).
// Written wherever the register views are. Two kinds of tile compile to other SASS than with CuTe's
// copies: multi_tma, whose Q tiles (kMmaM > 1) are loaded once into registers, where the compiler sums
// Q's addresses in another order and ptxas assigns Q's fragments other registers; and tiles of atoms
// narrower than 64 columns split over several warps along M (prefill d80, d96), where it places a few
// set-up instructions elsewhere (a loop counter's first value, the row digit the swizzle reads) and
// ptxas allocates the main loop's registers differently. Timed on the H200 against CuTe's copies in
// one call, A B A B (perf/results/ldsm_ab_h200_20261204_405b778_*.json): the same times (prefill d80
// 2903 / 2902 us both ways; d96 3130-3139 written, 3139-3149 CuTe's; multi-token decode q5-q64 within
// 1 %). PAGEDATTN_LDSM (rendered only under a forced tile field kLdsm, for such A/B studies): 0 takes
// CuTe's copies everywhere.
template <class Traits>
inline constexpr bool kSm80WrittenLdsm =
#ifdef PAGEDATTN_LDSM
    PAGEDATTN_LDSM &&
#endif
    Sm80Frags<Traits>::kWritten;

template <class Traits, bool kWritten = kSm80WrittenLdsm<Traits>>
struct Sm80Ldsm {  // written
  using Element = typename Traits::Element;
  using Frags = Sm80Frags<Traits>;

  // Element offsets in a tile of kRows rows built from SmemLayoutAtom: 8 x kW atoms (kW =
  // kBlockKSmem: 64, 32 or 16 columns) down the rows first, then column blocks of kRows * kW elements.
  // Inside an atom, SmemLayoutAtom's Swizzle<kSwizzle, 3, 3> XORs the 16-byte chunk of a row (offset
  // bits 3..5, 3..4 or 3) with the offset bits 6..8, 6..7 or 6 (the row's bits 0..2, 1..2 or 2 within
  // the atom); the other bits pass through.
  //
  // Written as CuTe's partition computes them (swizzle_layout.hpp, slice_and_offset), so that the
  // compiler emits the same instructions (even the order of operands matters): a thread's unswizzled
  // offset splits into the bits the swizzle reads or writes (`zy`) and the rest; the swizzled base
  // swizzle(zy) + rest is computed once. A copy's unswizzled offset from there is a multiple of 16
  // columns: inside an atom, its bits 4 and 5 (16 and 32 columns, in atoms that wide), which the
  // swizzle XORs with the thread's bits 7 and 8, move the swizzled offset by +16 or -16, +32 or -32 as
  // those bits are clear or set; its other bits (column blocks, 16-row steps) pass through; it has no
  // bits the swizzle reads.
  static constexpr int kW = Traits::kBlockKSmem;
  static constexpr int kY = 1 << Traits::kSwizzle;                // values of the bits the swizzle reads
  static constexpr uint32_t kYMask = uint32_t(kY - 1) << 6;       // those bits
  __host__ __device__ static constexpr uint32_t swizzle(uint32_t o) { return o ^ ((o & kYMask) >> 3); }
  struct Thread {
    uint32_t base;  // swizzle(zy) + rest
    int s16, s32;   // how 16 and 32 more columns move the swizzled offset (in atoms that wide)
  };
  __host__ __device__ static constexpr Thread thread(uint32_t zy, int rest) {
    return {swizzle(zy) + rest, (zy & 128) == 0 ? 16 : -16, (zy & 256) == 0 ? 32 : -32};
  }
  // The thread's offsets, from its row digit r, its 8-column chunk (c8 < 2, bit 3) and the rest, with
  // the thread index t split into digits as CuTe's partition splits it (the last digit unbounded).
  // Lane l = t % 32 of warp t / 32 (the kWarpsM warps take different 16-row tiles of the A operand and
  // the same B operands). The row digit has kDigit = 8 rows (K's) or 16 (Q's, V's):
  //  - 64-column atoms: r % 8 is the row in the atom (offset bits 6..8, all read by the swizzle) and,
  //    of 16 rows, r / 8 the atom below (+512);
  //  - narrower atoms: a row is kW elements, so the swizzle reads the row's bits from kR = 64 / kW
  //    rows up: r % kR rows pass through (* kW), hi = r / kR is read by the swizzle (the y bits, from
  //    bit 6) and, of 16 rows, CuTe takes hi % kY there and hi / kY = r / 8 as the atom below (8 kW).
  //    The base (rows + rest) + (zy ^ (y >> 3)), after the steps s16 and s32, is swizzle(zy) + rest in
  //    CuTe's order of operations.
  static constexpr int kR = 64 / kW;
  template <int kDigit>
  __host__ __device__ static constexpr Thread thread(int r, int c8, int rest) {
    if constexpr (kW == 64) {
      if constexpr (kDigit == 16) return thread<8>(r % 8, c8, r / 8 * 512 + rest);
      else return thread((uint32_t(r * 64) & 448) ^ (uint32_t(c8 * 8) & 8), rest);
    } else {
      int const hi = r / kR;
      uint32_t const y = uint32_t((kDigit == 16 ? hi % kY : hi) * 64) & kYMask;
      uint32_t const zy = y ^ (uint32_t(c8 * 8) & 8);
      int const lo = r % kR * kW;
      int const other = (kDigit == 16 ? lo + hi / kY * (8 * kW) : lo) + rest;
      int const s16 = (y & 128) == 0 ? 16 : -16, s32 = (y & 256) == 0 ? 32 : -32;
      return {other + (zy ^ (y >> 3)), s16, s32};
    }
  }
  __host__ __device__ static constexpr Thread thread_q(int t) {  // row l % 16 + 16 warp, column l / 16 * 8
    if constexpr (Traits::kWarpsM == 1) return thread<16>(t % 16, t / 16, 0);
    // (64-column atoms: the atom below joins the rest before the warp's rows, in CuTe's order)
    else if constexpr (kW == 64) return thread<8>(t % 16 % 8, t / 16 % 2, t % 16 / 8 * 512 + t / 16 / 2 * 1024);
    else return thread<16>(t % 16, t / 16 % 2, t / 16 / 2 * (16 * kW));
  }
  __host__ __device__ static constexpr Thread thread_k(int t) {  // key l / 16 * 8 + l % 8, column l / 8 % 2 * 8
    if constexpr (Traits::kWarpsM == 1) return thread<8>(t % 8, t / 8 % 2, t / 8 / 2 * (8 * kW));
    else return thread<8>(t % 8, t / 8 % 2, t / 8 / 2 % 2 * (8 * kW));
  }
  __host__ __device__ static constexpr Thread thread_vt(int t) {  // V's key l % 16, d l / 16 * 8
    if constexpr (Traits::kWarpsM == 1) return thread<16>(t % 16, t / 16, 0);
    else return thread<16>(t % 16, t / 16 % 2, 0);
  }
  // The constant of 16-column block i (k-step i of Q and K, d pair i of V) in a tile of kRows rows:
  // the kW / 16 blocks of an atom (the swizzle's +-16, +-32), then the next column block
  template <int kRows>
  __host__ __device__ static constexpr int columns(Thread const& th, int i) {
    constexpr int kPer = kW / 16;
    return (kPer > 1 ? i % 2 * th.s16 : 0) + (kPer > 2 ? i / 2 % 2 * th.s32 : 0) + i / kPer * (kRows * kW);
  }
  // The offsets from the thread's base of k-step kk (Q, K: 16 columns; V: 16 keys), and from there
  // of copy m (Q: MMA tile mi, 16 kWarpsM rows; K: key pair j, 16 rows; V: d pair j, 16 columns)
  __host__ __device__ static constexpr int q_step(Thread const& th, int kk) { return columns<Traits::kBlockM>(th, kk); }
  __host__ __device__ static constexpr int q_copy(Thread const&, int mi) { return mi * 16 * Traits::kWarpsM * kW; }
  __host__ __device__ static constexpr int k_step(Thread const& th, int kk) { return columns<Traits::kBlockN>(th, kk); }
  __host__ __device__ static constexpr int k_copy(Thread const&, int j) { return j * 16 * kW; }
  __host__ __device__ static constexpr int vt_step(Thread const&, int kk) { return kk * 16 * kW; }
  __host__ __device__ static constexpr int vt_copy(Thread const& th, int j) { return columns<Traits::kBlockN>(th, j); }

  // The whole offset of thread t's copy m at k-step kk of operand kOperand (0: Q, 1: K, 2: V^T), as
  // the copies below compute it (PAGEDATTN_CHECK_TYPES: check_ldsm_offsets compares it with CuTe's)
  template <int kOperand>
  __host__ __device__ static constexpr int offset_of(int t, int m, int kk) {
    if constexpr (kOperand == 0) return int(thread_q(t).base) + q_step(thread_q(t), kk) + q_copy(thread_q(t), m);
    else if constexpr (kOperand == 1) return int(thread_k(t).base) + k_step(thread_k(t), kk) + k_copy(thread_k(t), m);
    else return int(thread_vt(t).base) + vt_step(thread_vt(t), kk) + vt_copy(thread_vt(t), m);
  }

  int gtid;
  __device__ __forceinline__ explicit Sm80Ldsm(int thread) : gtid(thread) {}

  template <class Frag>
  __device__ __forceinline__ static auto view_q(Frag& f) { return cute::make_tensor(f.data(), typename Frags::ViewQ{}); }
  template <class Frag>
  __device__ __forceinline__ static auto view_k(Frag& f) { return cute::make_tensor(f.data(), typename Frags::ViewK{}); }
  template <class Frag>
  __device__ __forceinline__ static auto view_vt(Frag& f) { return cute::make_tensor(f.data(), typename Frags::ViewVt{}); }
  // A tile's thread partition: the thread's swizzled base in the tile and its column steps
  struct Part {
    Element const* base;
    Thread th;
  };
  template <class Tile>
  __device__ __forceinline__ Part partition_q(Tile const& s) const { return part(s, thread_q(gtid)); }
  template <class Tile>
  __device__ __forceinline__ Part partition_k(Tile const& s) const { return part(s, thread_k(gtid)); }
  template <class Tile>
  __device__ __forceinline__ Part partition_vt(Tile const& s) const { return part(s, thread_vt(gtid)); }
  template <class Tile>
  __device__ __forceinline__ static Part part(Tile const& s, Thread const& th) {
    return {cute::raw_pointer_cast(s.data()) + th.base, th};
  }

  // One x4 ldmatrix (kTrans: .trans) of the 16 bytes at `src` into copy (m, kk) of view v: register i
  // holds the view's values 2i and 2i + 1 (all 8 contiguous but for V^T in atoms narrower than 64
  // columns, whose values 4..7 are the next group of d: Sm80Frags::ViewVt)
  template <bool kTrans, class View>
  __device__ __forceinline__ static void ldsm(Element const* src, View& v, int m, int kk) {
    auto r = [&](int i) -> uint32_t& { return *reinterpret_cast<uint32_t*>(&v(2 * i, m, kk)); };
    auto const& s = *reinterpret_cast<cute::uint128_t const*>(src);
    if constexpr (kTrans) cute::SM75_U16x8_LDSM_T::copy(s, r(0), r(1), r(2), r(3));
    else cute::SM75_U32x4_LDSM_N::copy(s, r(0), r(1), r(2), r(3));
  }
  // k-step kk of Q into the view of its fragment (every MMA tile mi); all of them
  template <class View>
  __device__ __forceinline__ void q(Part const& sQ, View& v, int kk) const {
    Element const* s = sQ.base + q_step(sQ.th, kk);
    CUTE_UNROLL
    for (int mi = 0; mi < Traits::kMmaM; ++mi) ldsm<false>(s + q_copy(sQ.th, mi), v, mi, kk);
  }
  template <class View>
  __device__ __forceinline__ void q_all(Part const& sQ, View& v) const {
    CUTE_UNROLL
    for (int kk = 0; kk < Traits::kHeadDim / 16; ++kk) q(sQ, v, kk);
  }
  template <class View>
  __device__ __forceinline__ void k(Part const& sK, View& v, int kk) const {
    Element const* s = sK.base + k_step(sK.th, kk);
    CUTE_UNROLL
    for (int j = 0; j < Traits::kBlockN / 16; ++j) ldsm<false>(s + k_copy(sK.th, j), v, j, kk);
  }
  template <class View>
  __device__ __forceinline__ void vt(Part const& sVt, View& v, int kk) const {
    Element const* s = sVt.base + vt_step(sVt.th, kk);
    CUTE_UNROLL
    for (int j = 0; j < Traits::kHeadDimO / 16; ++j) ldsm<true>(s + vt_copy(sVt.th, j), v, j, kk);
  }
};

template <class Traits>
struct Sm80Ldsm<Traits, false> {  // CuTe's tiled copies
  using Frags = Sm80Frags<Traits>;
  using TiledMma = typename Traits::TiledMma;
  using CopyQ = decltype(cute::make_tiled_copy_A(typename Traits::SmemCopyAtom{}, TiledMma{}));
  using CopyK = decltype(cute::make_tiled_copy_B(typename Traits::SmemCopyAtom{}, TiledMma{}));
  using CopyV = decltype(cute::make_tiled_copy_B(typename Traits::SmemCopyAtomT{}, TiledMma{}));
  CopyQ s2r_q;
  CopyK s2r_k;
  CopyV s2r_v;
  decltype(CopyQ{}.get_thread_slice(0)) thr_q;
  decltype(CopyK{}.get_thread_slice(0)) thr_k;
  decltype(CopyV{}.get_thread_slice(0)) thr_v;
  __device__ __forceinline__ explicit Sm80Ldsm(int gtid)
      : thr_q(s2r_q.get_thread_slice(gtid)), thr_k(s2r_k.get_thread_slice(gtid)), thr_v(s2r_v.get_thread_slice(gtid)) {}

  template <class Frag>
  __device__ __forceinline__ auto view_q(Frag& f) const { return Frags::template view<typename Frags::ViewQ>(thr_q, f); }
  template <class Frag>
  __device__ __forceinline__ auto view_k(Frag& f) const { return Frags::template view<typename Frags::ViewK>(thr_k, f); }
  template <class Frag>
  __device__ __forceinline__ auto view_vt(Frag& f) const { return Frags::template view<typename Frags::ViewVt>(thr_v, f); }
  template <class Tile>
  __device__ __forceinline__ auto partition_q(Tile const& s) const { return thr_q.partition_S(s); }
  template <class Tile>
  __device__ __forceinline__ auto partition_k(Tile const& s) const { return thr_k.partition_S(s); }
  template <class Tile>
  __device__ __forceinline__ auto partition_vt(Tile const& s) const { return thr_v.partition_S(s); }

  template <class Src, class View>
  __device__ __forceinline__ void q(Src const& tSsQ, View& v, int kk) const {
    cute::copy(s2r_q, tSsQ(cute::_, cute::_, kk), v(cute::_, cute::_, kk));
  }
  template <class Src, class View>
  __device__ __forceinline__ void q_all(Src const& tSsQ, View& v) const { cute::copy(s2r_q, tSsQ, v); }
  template <class Src, class View>
  __device__ __forceinline__ void k(Src const& tSsK, View& v, int kk) const {
    cute::copy(s2r_k, tSsK(cute::_, cute::_, kk), v(cute::_, cute::_, kk));
  }
  template <class Src, class View>
  __device__ __forceinline__ void vt(Src const& tOsVt, View& v, int kk) const {
    cute::copy(s2r_v, tOsVt(cute::_, cute::_, kk), v(cute::_, cute::_, kk));
  }
};

// The layout of an SM80 MMA accumulator of (kBlockM, kCols) per thread, ((2,2), kMmaM, kCols/8), as
// partition_fragment_C(TiledMma, (kBlockM, kCols)) builds it (compact, size-1 modes of stride 0), without
// that function's layout algebra. PAGEDATTN_CHECK_TYPES: assert it is the same type.
template <class Traits, int kCols>
using Sm80AccLayout = decltype(cute::make_layout(
    cute::Shape<cute::Shape<cute::_2, cute::_2>, cute::Int<Traits::kMmaM>, cute::Int<kCols / 8>>{}));

template <class Traits, int kCols>
__device__ __forceinline__ auto sm80_acc() {
  auto acc = cute::make_tensor<float>(Sm80AccLayout<Traits, kCols>{});
#if PAGEDATTN_CHECK_TYPES
  static_assert(cute::is_same_v<decltype(acc), decltype(cute::partition_fragment_C(
                                                   typename Traits::TiledMma{},
                                                   cute::Shape<cute::Int<Traits::kBlockM>, cute::Int<kCols>>{}))>);
#endif
  return acc;
}

// (row, column) in the tile of each entry of this thread's SM80 MMA accumulator ((2,2), kMmaM, kCols/8)
// (flat index i, or (v, mi, ni)): the numbers thr_mma.partition_C(make_identity_tensor(...)) gives, by
// plain integer arithmetic (that partition costs the compiler's front end more than the rest of the
// kernel). Warp w of the kWarpsM holds rows 16w ... 16w + 15 of every 16 * kWarpsM.
template <class Traits>
struct Sm80AccCoord {
  int row0, col0;  // this thread's first entry
  __device__ __forceinline__ explicit Sm80AccCoord(int gtid)
      : row0(gtid / 32 % Traits::kWarpsM * 16 + gtid % 32 / 4), col0(gtid % 32 % 4 * 2) {}
  __device__ __forceinline__ cute::tuple<int, int> operator()(int v, int mi, int ni) const {
    return {row0 + mi * (16 * Traits::kWarpsM) + v / 2 * 8, col0 + ni * 8 + v % 2};
  }
  __device__ __forceinline__ cute::tuple<int, int> operator()(int i) const {
    return (*this)(i % 4, i / 4 % Traits::kMmaM, i / (4 * Traits::kMmaM));
  }
};

#if PAGEDATTN_CHECK_TYPES
// Sm80Ldsm's written offsets against CuTe's partition of the tile: `TiledCopy::tidfrg_S(layout)` maps
// (thread, value, (copy, k-step)) to the tile offset partition_S reads; value 0 is the ldmatrix row's
// address. Every thread and copy of k-step kStep, as one constant expression (the compiler bounds the
// work of each; one k-step of a 4-warp prefill tile is about a thousand evaluations).
template <class Traits, int kOperand, class TiledCopy, class TileLayout, int kCopies, int kSteps, int kStep>
struct LdsmOffsetsCheck {
  static constexpr bool same() {
    constexpr auto cute_layout = TiledCopy::tidfrg_S(TileLayout{});  // (thread, value, (copy, k-step))
    static_assert(cute::size<0>(cute_layout) == Traits::kGroupThreads && cute::size<2, 0>(cute_layout) == kCopies &&
                      cute::size<2, 1>(cute_layout) == kSteps,
                  "the copies CuTe partitions");
    for (int t = 0; t < Traits::kGroupThreads; ++t)
      for (int m = 0; m < kCopies; ++m)
        if (int(cute_layout(t, 0, cute::make_coord(m, kStep))) !=
            Sm80Ldsm<Traits, true>::template offset_of<kOperand>(t, m, kStep))
          return false;
    return true;
  }
  static_assert(same(), "Sm80Ldsm's ldmatrix offsets (operand kOperand: 0 Q, 1 K, 2 V^T) are CuTe's");
  static constexpr bool ok = true;
};

template <class Traits, int kOperand, class TiledCopy, class TileLayout, int kCopies, int kSteps, int... kStep>
constexpr bool check_ldsm_offsets(cute::int_sequence<kStep...>) {
  return (LdsmOffsetsCheck<Traits, kOperand, TiledCopy, TileLayout, kCopies, kSteps, kStep>::ok && ...);
}

template <class Traits>
constexpr bool check_ldsm_offsets() {
  using namespace cute;
  using TiledMma = typename Traits::TiledMma;
  using CopyQ = decltype(make_tiled_copy_A(typename Traits::SmemCopyAtom{}, TiledMma{}));
  using CopyK = decltype(make_tiled_copy_B(typename Traits::SmemCopyAtom{}, TiledMma{}));
  using CopyV = decltype(make_tiled_copy_B(typename Traits::SmemCopyAtomT{}, TiledMma{}));
  constexpr int kSteps = Traits::kHeadDim / 16, kStepsV = Traits::kBlockN / 16;
  return check_ldsm_offsets<Traits, 0, CopyQ, typename Traits::SmemLayoutQ, Traits::kMmaM, kSteps>(
             make_int_sequence<kSteps>{}) &&
         check_ldsm_offsets<Traits, 1, CopyK, typename Traits::SmemLayoutKV, Traits::kBlockN / 16, kSteps>(
             make_int_sequence<kSteps>{}) &&
         check_ldsm_offsets<Traits, 2, CopyV, typename Traits::SmemLayoutVtO, Traits::kHeadDimO / 16, kStepsV>(
             make_int_sequence<kStepsV>{});
}
#endif

#if PAGEDATTN_CHECK_TYPES
// The written-out fragment, view and accumulator types of Traits against CuTe's, without the rest of
// the kernel: the instantiations mainloop_sm80's setup below makes, from the same types (the kernel
// body under PAGEDATTN_CHECK_TYPES_ONLY, attn_fwd.cu.j2; tests: front end only).
template <class Traits>
__device__ void check_sm80_types(typename Traits::Element* smem, int gtid) {
  using namespace cute;
  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(gtid);
  Tensor sQ = make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutVtO{});
  Tensor q = Sm80Frags<Traits>::q(thr_mma, sQ);
  Tensor k = Sm80Frags<Traits>::k(thr_mma, sK);
  Tensor vt = Sm80Frags<Traits>::vt(thr_mma, sVt);
  auto s2r_q_thr = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma).get_thread_slice(gtid);
  auto s2r_k_thr = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma).get_thread_slice(gtid);
  auto s2r_v_thr = make_tiled_copy_B(typename Traits::SmemCopyAtomT{}, tiled_mma).get_thread_slice(gtid);
  Sm80Frags<Traits>::template view<typename Sm80Frags<Traits>::ViewQ>(s2r_q_thr, q);
  Sm80Frags<Traits>::template view<typename Sm80Frags<Traits>::ViewK>(s2r_k_thr, k);
  Sm80Frags<Traits>::template view<typename Sm80Frags<Traits>::ViewVt>(s2r_v_thr, vt);
  if constexpr (Sm80Frags<Traits>::kWritten) static_assert(check_ldsm_offsets<Traits>());
  sm80_acc<Traits, Traits::kHeadDimO>();
  sm80_acc<Traits, Traits::kBlockN>();
}
#endif

template <class Traits, class Features, class Loader>
__device__ __forceinline__ void mainloop_sm80(TileCtx<Traits> const& c, Loader& loader) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr int kHeadDimO = Traits::kHeadDimO;  // this group's columns of O (kHeadDim unless kWarpsD > 1)
  constexpr int kStages = Traits::kStages, kStageKeys = Traits::kStageKeys;
  // TMA decode keeps Q's MMA fragments in registers (kHeadDim / 4 of them); the others reload them
  // from shared memory for every K tile.
  constexpr bool kQInRegs = Traits::kTma && kHeadDim <= 128;
  int const gtid = c.gtid, group_idx = c.group_idx;
  AttnWork const& w = c.w;

  // ---- MMA setup (per warp group)
  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(gtid);
  Tensor sQ = make_tensor(make_smem_ptr(c.smem.q()), typename Traits::SmemLayoutQ{});  // (kBlockM, kHeadDim)
  Tensor sK0 = make_tensor(make_smem_ptr(c.smem.k_tile(0, 0)), typename Traits::SmemLayoutKV{});
  Tensor sVt0 = make_tensor(make_smem_ptr(c.smem.v_tile(0, 0)), typename Traits::SmemLayoutVtO{});
  Tensor tSrQ = Sm80Frags<Traits>::q(thr_mma, sQ);      // (MMA, kMmaM, kHeadDim/16)
  Tensor tSrK = Sm80Frags<Traits>::k(thr_mma, sK0);     // (MMA, kBlockN/8, kHeadDim/16)
  Tensor tOrVt = Sm80Frags<Traits>::vt(thr_mma, sVt0);  // (MMA, kHeadDimO/8, kBlockN/16)
  Tensor acc_o = sm80_acc<Traits, kHeadDimO>();  // (MMA, kMmaM, kHeadDimO/8)
  clear(acc_o);

  Sm80Ldsm<Traits> const ldsm(gtid);  // the ldmatrix copies
  auto const tSsQ = ldsm.partition_q(sQ);
  Tensor tSrQ_view = ldsm.view_q(tSrQ);
  Tensor tSrK_view = ldsm.view_k(tSrK);
  Tensor tOrVt_view = ldsm.view_vt(tOrVt);

  // (row, key) of each accumulator entry, and the keys each of this thread's rows may see
  Sm80AccCoord<Traits> const tScS(gtid);  // = thr_mma.partition_C(make_identity_tensor((kBlockM, kBlockN)))
  AttnMask<Traits::kRows, Features> const mask(c.p, w, tScS);

  // kFp8Regs: fp16 MMAs; bf16 queries enter as q * 2^-8 (see attn_fp8_regs.cuh)
  constexpr float kQScale = Traits::kIsBf16 ? 1.f / 256.f : 1.f;
  float const scale_log2 = Traits::kFp8Regs ? c.scale_log2 * (1.f / kQScale) : c.scale_log2;
  constexpr bool kFp8QRegs = Traits::kFp8Regs && kHeadDim <= 128;
  uint32_t q_frag[kFp8QRegs ? kHeadDim / 16 : 1][4];
  OnlineSoftmax<Traits::kRows> softmax;

  // ---- mainloop: a kStages-deep pipeline over stages [step_begin, step_end)
  int const n_steps = w.step_end - w.step_begin;
  loader.prologue();
  if constexpr (Traits::kTma) {  // the prologue waited for Q
    if constexpr (Traits::kFp8Regs) {
      if constexpr (kFp8QRegs) {
        CUTE_UNROLL
        for (int kk = 0; kk < kHeadDim / 16; ++kk) fp8_regs_q<Element>(sQ, kk, gtid, kQScale, q_frag[kk]);
      }
    } else if constexpr (kQInRegs) {
      ldsm.q_all(tSsQ, tSrQ_view);  // Q stays in registers for the whole mainloop
    }
  }
  for (int it = 0; it < n_steps; ++it) {
    int const stage = it % kStages;
    loader.wait(it);

    if constexpr (Traits::kFp8Regs) {
      int const key0 = (w.step_begin + it) * kStageKeys + group_idx * kBlockN;
      if (key0 >= w.k_len) continue;
      uint8_t const* k_sub = c.smem.raw_k(stage, group_idx * kBlockN);
      uint8_t const* v_sub = c.smem.raw_v(stage, group_idx * kBlockN);
      Tensor acc_s = sm80_acc<Traits, kBlockN>();
      fp8_regs_qk<kHeadDim, kBlockN, Traits::kFp8>(k_sub, gtid, acc_s, [&](int kk, uint32_t (&a)[4]) {
        if constexpr (kFp8QRegs) {
          CUTE_UNROLL
          for (int x = 0; x < 4; ++x) a[x] = q_frag[kk][x];
        } else {
          fp8_regs_q<Element>(sQ, kk, gtid, kQScale, a);
        }
      });
      float const s_scale = mask.template apply<kBlockN>(acc_s, tScS, key0, scale_log2);
      softmax.update(acc_s, acc_o, s_scale);
      fp8_regs_pv<kHeadDim, kBlockN, Traits::kFp8>(v_sub, gtid, acc_s, acc_o);
      continue;
    }

    Element* k_tile;
    Element* v_tile;
    if constexpr (Traits::kIsFp8) {
      // each warp group widens its own sub-tile into the one Element stage (with the column groups
      // that share it); only those threads wait for it
      k_tile = c.smem.k_tile(0, group_idx);
      v_tile = c.smem.v_tile(0, group_idx);
      widen_fp8_keys<Traits, kBlockN>(c.smem.raw_k(stage, group_idx * kBlockN), c.smem.raw_v(stage, group_idx * kBlockN),
                                      k_tile, v_tile, gtid + c.d_idx * Traits::kGroupThreads,
                                      Traits::kGroupThreads * Traits::kWarpsD);
      group_sync<Traits>(group_idx);
    } else {
      k_tile = c.smem.k_tile(stage, group_idx);
      v_tile = c.smem.v_tile(stage, group_idx);
    }
    int const key0 = (w.step_begin + it) * kStageKeys + group_idx * kBlockN;
    if (key0 >= w.k_len) continue;  // this group's sub-tile lies past the end: nothing to add

    Tensor sK = make_tensor(make_smem_ptr(k_tile), typename Traits::SmemLayoutKV{});
    Tensor sVt = make_tensor(make_smem_ptr(v_tile + c.d_idx * kBlockN * kHeadDimO), typename Traits::SmemLayoutVtO{});
    auto const tSsK = ldsm.partition_k(sK);
    auto const tOsVt = ldsm.partition_vt(sVt);

    // S = Q K^T. With few independent MMA chains (narrow sub-tiles), even and odd k-steps go to two
    // accumulators so consecutive MMAs do not wait on each other.
    Tensor acc_s = sm80_acc<Traits, kBlockN>();  // (MMA, kMmaM, kBlockN/8)
    clear(acc_s);
    constexpr bool kTwoChains = kBlockN / 8 * Traits::kMmaM < 4;
    Tensor acc_s_odd = sm80_acc<Traits, kBlockN>();
    if constexpr (kTwoChains) clear(acc_s_odd);
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tSrQ); ++k) {
      if constexpr (!kQInRegs) ldsm.q(tSsQ, tSrQ_view, k);
      ldsm.k(tSsK, tSrK_view, k);
      if (kTwoChains && k % 2 == 1) {
        cute::gemm(tiled_mma, tSrQ(_, _, k), tSrK(_, _, k), acc_s_odd);
      } else {
        cute::gemm(tiled_mma, tSrQ(_, _, k), tSrK(_, _, k), acc_s);
      }
    }
    if constexpr (kTwoChains) {
      CUTE_UNROLL
      for (int i = 0; i < size(acc_s); ++i) acc_s(i) += acc_s_odd(i);
    }

    float const s_scale = mask.template apply<kBlockN>(acc_s, tScS, key0, scale_log2);
    softmax.update(acc_s, acc_o, s_scale);

    // O += P V (P converted to Element in the A-operand layout)
    Tensor tOrP = make_tensor<Element>(Shape<_8, Int<Traits::kMmaM>, Int<kBlockN / 16>>{});
    CUTE_UNROLL
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      CUTE_UNROLL
      for (int mi = 0; mi < Traits::kMmaM; ++mi) {
        CUTE_UNROLL
        for (int v = 0; v < 8; ++v) tOrP(v, mi, kk) = Element(acc_s(v % 4, mi, 2 * kk + v / 4));
      }
    }
    CUTE_UNROLL
    for (int k = 0; k < kBlockN / 16; ++k) {
      ldsm.vt(tOsVt, tOrVt_view, k);
      cute::gemm(tiled_mma, tOrP(_, _, k), tOrVt(_, _, k), acc_o);
    }
  }
  write_tile<Traits, Features>(c, acc_o, softmax,
                               thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimO>>{})));
}

}  // namespace pagedattn
