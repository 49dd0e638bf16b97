// The sm_90a prefill mainloop (Traits::kWgmma): warpgroup MMAs (attn_wgmma.cuh) over the cp.async
// K/V pipeline (mainloop_sm80.cuh's loader, publishing each stage to the async proxy; fp8 stages are
// widened by the CTA into one Element stage first). One step at a
// time: S = Q K^T, mask, online softmax, O += P V, each waited for; the four warpgroups of a CTA keep
// the tensor cores busy between them. (Overlapping step i+1's S with step i's P V inside a warpgroup
// measured slower: perf/results/history/prefill_sweep_h200_overlap_8e4b57c.json.)
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/attn_tile.cuh"
#include "pagedattn/attn_wgmma.cuh"
#include "pagedattn/epilogue.cuh"
#include "pagedattn/mainloop_sm80.cuh"
#include "pagedattn/mask.cuh"
#include "pagedattn/softmax.cuh"

namespace pagedattn {

#if PAGEDATTN_CHECK_TYPES
// The written-out types of the wgmma mainloops (mainloop_wgmma, ws_consume) against CuTe's (the kernel
// body under PAGEDATTN_CHECK_TYPES_ONLY; tests: front end only): the accumulators, and the descriptor
// fragments (the same engine and, mode by mode, the same k-step offsets: CuTe's shapes nest the
// k-steps as its tiles do, coalesced per mode they are the written ones), and the coordinate tensors.
template <class Mine, class Cutes>
constexpr bool same_fragment() {
  using namespace cute;
  using Modes = Step<_1, _1, _1>;
  return is_same_v<typename Mine::engine_type, typename Cutes::engine_type> &&
         is_same_v<decltype(coalesce(typename Mine::layout_type{}, Modes{})),
                   decltype(coalesce(typename Cutes::layout_type{}, Modes{}))>;
}

template <class Traits>
__device__ void check_wgmma_types() {
  using namespace cute;
  using Tiles = WgmmaTiles<Traits>;
  using Element = typename Traits::MmaElement;  // the tiles' type (fp16 in prefill_ws with an fp8 cache)
  Tiles::template acc<typename Tiles::TiledMmaPV, Traits::kHeadDim>();
  Tiles::template acc<typename Tiles::TiledMmaQK, Traits::kBlockN>();
  Element* const tile = nullptr;
  auto thr_qk = typename Tiles::TiledMmaQK{}.get_thread_slice(0);
  auto thr_pv = typename Tiles::TiledMmaPV{}.get_thread_slice(0);
  static_assert(same_fragment<decltype(Tiles::frag_q(tile, 0)), decltype(thr_qk.partition_fragment_A(
                                  make_tensor(make_smem_ptr(tile), typename Tiles::SmemLayoutQ{})))>(), "Q fragment");
  static_assert(same_fragment<decltype(Tiles::frag_k(tile)), decltype(thr_qk.partition_fragment_B(
                                  make_tensor(make_smem_ptr(tile), typename Tiles::SmemLayoutK{})))>(), "K fragment");
  static_assert(same_fragment<decltype(Tiles::frag_vt(tile)), decltype(thr_pv.partition_fragment_B(make_tensor(
                                  make_smem_ptr(tile), typename Tiles::SmemLayoutVt{})))>(), "V^T fragment");
  static_assert(same_fragment<decltype(Tiles::template coords<Traits::kBlockN>(0)), decltype(thr_qk.partition_C(
                                  make_identity_tensor(Shape<Int<Traits::kBlockM>, Int<Traits::kBlockN>>{})))>(),
                "S coordinates");
  static_assert(same_fragment<decltype(Tiles::template coords<Traits::kHeadDim>(0)), decltype(thr_pv.partition_C(
                                  make_identity_tensor(Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{})))>(),
                "O coordinates");
}
#endif

#if PAGEDATTN_CHECK_DESCS
// Defined nowhere: a call to it that survives optimisation fails the build (an unresolved extern function).
extern "C" __device__ void pagedattn_wgmma_descriptor_differs_from_cutes();

// The values of the written descriptor fragments (WgmmaTiles: layout type, offsets, start address, every
// k-step) against those of CuTe's partition_fragment_A/B over the same tiles (make_gmma_desc), for
// thread 0; and the tiles the loaders write (Traits' layouts: the TMA boxes, the cp.async copies, the
// zero fills) against the GMMA layouts those descriptors describe, at every 16-byte piece of two 8-row
// atoms. Tests: a full compile; every comparison folds to a constant, and one that is not equal leaves
// the call above.
template <class Traits>
__device__ void check_wgmma_descs(char* smem) {
  using namespace cute;
  using Tiles = WgmmaTiles<Traits>;
  using Element = typename Traits::MmaElement;
  Element* const tile = reinterpret_cast<Element*>(smem);
  // the two layouts from address 0, over their first two 8-row atoms of every panel (rows repeat by atom;
  // a panel's place depends on the rows, as every panel is reached from row 0)
  auto same_tile = [](auto written, auto gmma) {
    Element* const none = nullptr;
    Tensor a = make_tensor(make_smem_ptr(none), written);
    Tensor b = make_tensor(make_smem_ptr(none), gmma);
    bool eq = true;
    CUTE_UNROLL
    for (int r = 0; r < 16; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < Traits::kHeadDim; c += 8) {
        eq = eq && raw_pointer_cast(&a(r, c)) == raw_pointer_cast(&b(r, c));
      }
    }
    return eq;
  };
  if (!same_tile(typename Traits::SmemLayoutKV{}, typename Tiles::SmemLayoutK{}) ||
      !same_tile(typename Traits::SmemLayoutQ{}, typename Tiles::SmemLayoutQ{})) {
    pagedattn_wgmma_descriptor_differs_from_cutes();
  }
  auto thr_qk = typename Tiles::TiledMmaQK{}.get_thread_slice(0);
  auto thr_pv = typename Tiles::TiledMmaPV{}.get_thread_slice(0);
  auto same = [](auto const& mine, auto const& cutes) {
    bool eq = size<2>(mine) == size<2>(cutes);
    CUTE_UNROLL
    for (int k = 0; k < size<2>(mine); ++k) {
      eq = eq && uint64_t(mine(0, 0, k)) == uint64_t(cutes(0, 0, k));
    }
    return eq;
  };
  auto tensor = [&](auto layout) { return make_tensor(make_smem_ptr(tile), layout); };
  bool const ok = same(Tiles::frag_q(tile, 0), thr_qk.partition_fragment_A(tensor(typename Tiles::SmemLayoutQ{}))) &&
                  same(Tiles::frag_k(tile), thr_qk.partition_fragment_B(tensor(typename Tiles::SmemLayoutK{}))) &&
                  same(Tiles::frag_vt(tile), thr_pv.partition_fragment_B(tensor(typename Tiles::SmemLayoutVt{})));
  if (!ok) pagedattn_wgmma_descriptor_differs_from_cutes();
}
#endif

template <class Traits, class Features>
__device__ __forceinline__ void mainloop_wgmma(TileCtx<Traits> const& c) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using Tiles = WgmmaTiles<Traits>;
  typename Tiles::TiledMmaQK mma_qk;
  typename Tiles::TiledMmaPV mma_pv;
  Tensor tSrQ = Tiles::frag_q(c.smem.q(), c.tidx);  // = thr_qk.partition_fragment_A(Q tile)
  Tensor acc_o = Tiles::template acc<typename Tiles::TiledMmaPV, kHeadDim>();  // = partition_fragment_C(mma_pv, ..)
  clear(acc_o);
  // flat (4, 1, columns / 8) views of the accumulators for OnlineSoftmax (see attn_wgmma.cuh)
  Tensor o_rows = make_tensor(acc_o.data(), Layout<Shape<_4, _1, Int<kHeadDim / 8>>>{});
  Tensor tScS = Tiles::template coords<kBlockN>(c.tidx);
  AttnMask<2, Features> const mask(c.p, c.w, tScS);  // rows g and g + 8 of this thread's warp
  OnlineSoftmax<2> softmax;

  typename Tiles::FragP tOrP;  // P of the step, in the A-operand order of P V

  int const n_steps = c.w.step_end - c.w.step_begin;
  CpAsyncKVLoader<Traits, /*kAsyncProxy=*/true> const loader(c, n_steps);
  loader.prologue();
  for (int it = 0; it < n_steps; ++it) {
    int const loaded = it % Traits::kStages;
    loader.wait(it);
    if constexpr (Traits::kIsFp8) {
      // the CTA widens the raw stage into the one Element stage (free: every warpgroup waited for its
      // MMAs of the step before), then publishes it to the async proxy that wgmma reads through
      widen_fp8_keys<Traits, kBlockN>(c.smem.raw_k(loaded), c.smem.raw_v(loaded), c.smem.k_tile(0, 0),
                                      c.smem.v_tile(0, 0), c.tidx, Traits::kThreads);
      fence_proxy_async_smem();
      __syncthreads();
    }
    int const stage = Traits::kIsFp8 ? 0 : loaded;  // the Element stage the MMAs read
    Tensor acc_s = Tiles::template acc<typename Tiles::TiledMmaQK, kBlockN>();
    wgmma_gemm<true>(mma_qk, tSrQ, Tiles::frag_k(c.smem.k_tile(stage, 0)), acc_s);
    float const s_scale = mask.template apply<kBlockN>(acc_s, tScS, (c.w.step_begin + it) * kBlockN, c.scale_log2);
    Tensor s_rows = make_tensor(acc_s.data(), Layout<Shape<_4, _1, Int<kBlockN / 8>>>{});
    softmax.update(s_rows, o_rows, s_scale);
    CUTE_UNROLL
    for (int i = 0; i < size(acc_s); ++i) tOrP(i) = Element(acc_s(i));
    wgmma_gemm<false>(mma_pv, tOrP, Tiles::frag_vt(c.smem.v_tile(stage, 0)), acc_o);
  }
  write_tile<Traits, Features>(c, o_rows, softmax,
                               Tiles::template coords<kHeadDim>(c.tidx));
}

}  // namespace pagedattn
