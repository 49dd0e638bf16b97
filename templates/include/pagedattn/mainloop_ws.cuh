// The warp-specialised sm_90a prefill (Traits::kWs: warpgroup MMAs fed by TMA, paged 16-bit caches
// whose pages hold whole 16-key chunks). A CTA is kWarpsM / 4 consumer warpgroups and one producer
// warpgroup after them:
//   producer   one warp issues the TMA copies of each step's K and V tiles (kBlockN keys as 16-key
//              chunks, one per lane, each inside one cache page) into rings of kStages slots; it
//              gives its registers to the consumers (setmaxnreg) and leaves when the range is issued;
//   consumers  each warpgroup owns 64 rows: S = Q K^T, the mask policy, online softmax, O += P V
//              (attn_wgmma.cuh), the S of a step overlapping the P V of the step before, and (with
//              kPingPong) the two warpgroups taking turns on the tensor cores. The epilogue is the
//              other prefills'.
// K and V have rings of their own (a K slot goes back once its S is computed, a V slot once its P V
// is), each slot with two mbarriers: `full` (the producer's expected bytes landed) and `empty`
// (every consumer warp is done reading it). Keys past the request's end inside the last chunk are
// real cache slots: the mask hides their scores and the consumers zero their V rows (0 * NaN is not
// 0) before P V. A chunk in a page outside [0, num_blocks) is zero-filled by the producer instead.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/async_copy.cuh"
#include "pagedattn/attn_tile.cuh"
#include "pagedattn/attn_wgmma.cuh"
#include "pagedattn/epilogue.cuh"
#include "pagedattn/mainloop_sm80.cuh"
#include "pagedattn/mask.cuh"
#include "pagedattn/softmax.cuh"
#include "pagedattn/tma_copy.cuh"

namespace pagedattn {

// Registers per thread after the hand-over: the producer keeps kProducerRegs, the consumers take
// what the SM's 64 Ki registers leave (both multiples of 8, as setmaxnreg wants).
template <class Traits>
struct WsRegisters {
  static constexpr int kConsumerThreads = Traits::kThreads;
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs =
      ((65536 - kProducerRegs * Traits::kProducerThreads) / kConsumerThreads) / 8 * 8 > 240
          ? 240
          : ((65536 - kProducerRegs * Traits::kProducerThreads) / kConsumerThreads) / 8 * 8;
};

template <int kRegs>
__device__ __forceinline__ void regs_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void regs_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// The ring's mbarriers, kStages of each: K and V travel apart, so a step's K slot goes back as soon
// as its S is computed while its V slot waits for the P V of the step.
struct WsBarriers {
  uint64_t *full_k, *full_v, *empty_k, *empty_v;
};

// The producer warp: the K (then V) tiles of steps [step_begin, step_end) into slot it % kStages of
// their ring once the consumers freed it.
template <class Traits>
__device__ __forceinline__ void ws_produce(TileCtx<Traits> const& c, WsBarriers const& bars) {
  constexpr int kHeadDim = Traits::kHeadDim, kBlockN = Traits::kBlockN, kStages = Traits::kStages;
  constexpr int kChunks = kBlockN / 16, kBoxCols = 64;
  constexpr int kChunkBytes = 16 * kHeadDim * 2;  // K (or V) bytes of one chunk
  static_assert(kChunks <= 32, "one 16-key chunk per lane");
  AttnParams const& p = c.p;
  AttnWork const& w = c.w;
  int const lane = int(threadIdx.x) % 32;
  void const* k_map = p.tma_desc;
  void const* v_map = static_cast<char const*>(p.tma_desc) + 128;
  if (lane == 0) {
    tma_prefetch_map(k_map);
    tma_prefetch_map(v_map);
  }
  int const n_steps = w.step_end - w.step_begin;
  // this lane's chunk of step `it`, and its page (read one step ahead of its copies)
  auto chunk_key = [&](int it) { return (w.step_begin + it) * kBlockN + 16 * lane; };
  auto chunk_page = [&](int it) {
    int const j = chunk_key(it);
    return it < n_steps && lane < kChunks && j < w.k_len ? c.kv.page(j) : 0;
  };
  int phys_next = chunk_page(0);
  for (int it = 0; it < n_steps; ++it) {
    int const slot = it % kStages;
    uint32_t const free_phase = (uint32_t(it / kStages) & 1u) ^ 1u;
    int const phys = phys_next;
    phys_next = chunk_page(it + 1);
    int const j = chunk_key(it);
    bool const mine = lane < kChunks && j < w.k_len;
    bool const valid = mine && phys >= 0 && phys < p.num_blocks;
    uint32_t const loads = __ballot_sync(0xffffffffu, valid);
    uint32_t const bad = __ballot_sync(0xffffffffu, mine && !valid);
    int const off = c.kv.offset(j);
    int const c1 = p.tma_row_dim == 1 ? off : w.kv_head;
    int const c2 = p.tma_row_dim == 1 ? w.kv_head : off;
    // one tile (K or V) of the step into its slot
    auto load = [&](char* dst, void const* map, uint64_t* full, uint64_t* empty) {
      mbarrier_wait(empty + slot, free_phase);
      if (bad) {  // rare: zero the chunks of corrupt pages, all lanes together, before the slot is published
        for (int q = 0; q < kChunks; ++q) {
          if (!(bad >> q & 1u)) continue;
          for (int col = 0; col < kHeadDim / kBoxCols; ++col) {
            int const base = (col * kBlockN + 16 * q) * kBoxCols * 2;
            for (int b = 16 * lane; b < 16 * kBoxCols * 2; b += 16 * 32) {
              *reinterpret_cast<uint4*>(dst + base + b) = make_uint4(0, 0, 0, 0);
            }
          }
        }
        fence_proxy_async_smem();
        __syncwarp();
      }
      if (lane == 0) mbarrier_arrive_expect_tx(full + slot, __popc(loads) * kChunkBytes);
      __syncwarp();
      if (valid) {
        CUTE_UNROLL
        for (int col = 0; col < kHeadDim / kBoxCols; ++col) {
          tma_load_4d(dst + (col * kBlockN + 16 * lane) * kBoxCols * 2, map, col * kBoxCols, c1, c2, phys,
                      full + slot);
        }
      }
    };
    load(reinterpret_cast<char*>(c.smem.k_tile(slot, 0)), k_map, bars.full_k, bars.empty_k);
    load(reinterpret_cast<char*>(c.smem.v_tile(slot, 0)), v_map, bars.full_v, bars.empty_v);
  }
}

// V rows [first, kBlockN) of a landed slot -> 0, by every consumer thread; published to wgmma.
template <class Traits>
__device__ __forceinline__ void ws_clear_tail(TileCtx<Traits> const& c, int slot, int first) {
  constexpr int kRowChunks = Traits::kHeadDim / 8;  // 16-byte chunks of a row
  char* v_dst = reinterpret_cast<char*>(c.smem.v_tile(slot, 0));
  first = first > 0 ? first : 0;
  for (int i = c.tidx; i < (Traits::kBlockN - first) * kRowChunks; i += Traits::kThreads) {
    int const r = first + i / kRowChunks, chunk = i % kRowChunks;
    int const b = int(typename Traits::SmemLayoutKV{}(r, chunk * 8)) * 2;
    *reinterpret_cast<uint4*>(v_dst + b) = make_uint4(0, 0, 0, 0);
  }
  fence_proxy_async_smem();
  tile_sync<Traits>();
}

// A consumer thread (c.tidx < kThreads); the Q tile's cp.async copies are in flight.
template <class Traits, class Features>
__device__ __forceinline__ void ws_consume(TileCtx<Traits> const& c, WsBarriers const& bars) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  using Tiles = WgmmaTiles<Traits>;
  typename Tiles::TiledMmaQK mma_qk;
  typename Tiles::TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(c.tidx);
  auto thr_pv = mma_pv.get_thread_slice(c.tidx);
  Tensor tSrQ = thr_qk.partition_fragment_A(make_tensor(make_smem_ptr(c.smem.q()), typename Tiles::SmemLayoutQ{}));
  Tensor acc_o = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_o);
  Tensor o_rows = make_tensor(acc_o.data(), Layout<Shape<_4, _1, Int<kHeadDim / 8>>>{});
  Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  AttnMask<2, Features> const mask(c.p, c.w, tScS);
  OnlineSoftmax<2> softmax;
  typename Tiles::FragP tOrP;

  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async_smem();  // the Q tile, read by wgmma
  tile_sync<Traits>();

  // Steps overlap inside the warpgroup: S of step it is computed while P V of step it - 1 still
  // accumulates into O; O takes step it's rescaling once that P V is done.
  int const n_steps = c.w.step_end - c.w.step_begin;
  auto key0_of = [&](int it) { return (c.w.step_begin + it) * kBlockN; };
  auto wait_k = [&](int it) { mbarrier_wait(bars.full_k + it % kStages, uint32_t(it / kStages) & 1u); };
  auto wait_v = [&](int it) {  // step it's V landed; rows past the request's end zeroed
    mbarrier_wait(bars.full_v + it % kStages, uint32_t(it / kStages) & 1u);
    int const first = c.w.k_len - key0_of(it);
    if (first < kBlockN) ws_clear_tail(c, it % kStages, first);  // uniform: the last step only
  };
  auto tSrK = [&](int slot) {
    return thr_qk.partition_fragment_B(make_tensor(make_smem_ptr(c.smem.k_tile(slot, 0)), typename Tiles::SmemLayoutK{}));
  };
  auto tOrVt = [&](int slot) {
    return thr_pv.partition_fragment_B(make_tensor(make_smem_ptr(c.smem.v_tile(slot, 0)), typename Tiles::SmemLayoutVt{}));
  };
  auto release = [&](uint64_t* empty, int slot) {  // this warp is done with the slot
    __syncwarp();
    if (c.tidx % 32 == 0) mbarrier_arrive(empty + slot);
  };
  auto to_p = [&](auto const& s) {
    CUTE_UNROLL
    for (int i = 0; i < size(s); ++i) tOrP(i) = Element(s(i));
  };
  Tensor acc_s = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor s_rows = make_tensor(acc_s.data(), Layout<Shape<_4, _1, Int<kBlockN / 8>>>{});
  // kPingPong: the two warpgroups take turns on the tensor cores, one issuing a step's MMAs while the
  // other runs its softmax. Warpgroup w waits on named barrier 2 + w before it issues and then lets
  // the other one go (bar.arrive); warpgroup 1 lets warpgroup 0 start, and warpgroup 0 takes that
  // last arrival at the end, so every barrier is balanced.
  constexpr bool kPingPong = Traits::kPingPong;
  static_assert(!kPingPong || Traits::kThreads == 256, "ping-pong: two consumer warpgroups");
  int const wg = c.tidx / 128;
  auto my_turn = [&] {  // barrier ids as immediates: ptxas then reserves 5 barriers, not all 16
    if constexpr (kPingPong) {
      if (wg == 0) {
        asm volatile("bar.sync 2, 256;\n" ::: "memory");
      } else {
        asm volatile("bar.sync 3, 256;\n" ::: "memory");
      }
    }
  };
  auto your_turn = [&] {
    if constexpr (kPingPong) {
      if (wg == 0) {
        asm volatile("bar.arrive 3, 256;\n" ::: "memory");
      } else {
        asm volatile("bar.arrive 2, 256;\n" ::: "memory");
      }
    }
  };
  if (n_steps > 0) {
    if (wg == 1) your_turn();
    wait_k(0);
    my_turn();
    wgmma_gemm<true, false>(mma_qk, tSrQ, tSrK(0), acc_s);
    your_turn();
    wgmma_wait<0>(acc_s);
    release(bars.empty_k, 0);
    softmax.update(s_rows, o_rows, mask.template apply<kBlockN>(acc_s, tScS, key0_of(0), c.scale_log2));
    to_p(acc_s);
    for (int it = 1; it < n_steps; ++it) {
      int const slot = it % kStages, prev = (it - 1) % kStages;
      wait_k(it);
      wait_v(it - 1);
      my_turn();
      wgmma_gemm<true, false>(mma_qk, tSrQ, tSrK(slot), acc_s);
      wgmma_gemm<false, false>(mma_pv, tOrP, tOrVt(prev), acc_o);
      your_turn();
      wgmma_wait<1>(acc_s);
      release(bars.empty_k, slot);
      float alpha[2];
      softmax.exponentiate(s_rows, mask.template apply<kBlockN>(acc_s, tScS, key0_of(it), c.scale_log2), alpha);
      wgmma_wait<0>(acc_o);
      warpgroup_fence_operand(tOrP);  // P of step it - 1 stays in its registers until its MMAs are done
      release(bars.empty_v, prev);
      softmax.rescale(o_rows, alpha);
      to_p(acc_s);
    }
    wait_v(n_steps - 1);
    my_turn();
    wgmma_gemm<false, false>(mma_pv, tOrP, tOrVt((n_steps - 1) % kStages), acc_o);
    your_turn();
    wgmma_wait<0>(acc_o);
    warpgroup_fence_operand(tOrP);
    release(bars.empty_v, (n_steps - 1) % kStages);
    if (wg == 0) my_turn();
  }
  write_tile<Traits, Features>(c, o_rows, softmax,
                               thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{})));
}

// One row tile of the warp-specialised prefill: every thread of the CTA calls it.
template <class Traits, class Features>
__device__ __forceinline__ void attn_fwd_ws_tile(AttnParams const& p, char* smem, AttnWork const& w) {
  using Regs = WsRegisters<Traits>;
  TileCtx<Traits> const c(p, w, smem);
  WsBarriers const bars{c.smem.ring_bars(0), c.smem.ring_bars(1), c.smem.ring_bars(2), c.smem.ring_bars(3)};
  if (threadIdx.x == 0) {
    for (int s = 0; s < Traits::kStages; ++s) {
      mbarrier_init(bars.full_k + s, 1);
      mbarrier_init(bars.full_v + s, 1);
      mbarrier_init(bars.empty_k + s, Traits::kThreads / 32);
      mbarrier_init(bars.empty_v + s, Traits::kThreads / 32);
    }
    mbarrier_init_fence();
  }
  __syncthreads();
  if (int(threadIdx.x) >= Traits::kThreads) {  // the producer warpgroup
    regs_decrease<Regs::kProducerRegs>();
    if (int(threadIdx.x) < Traits::kThreads + 32) ws_produce(c, bars);
    // stay until the consumers are done (named barrier 4): the CTA's warps leave together, so that
    // compute-sanitizer sees the consumers' named-barrier epilogue with every warp still resident
    asm volatile("bar.sync 4, %0;\n" ::"n"(Traits::kCtaThreads) : "memory");
    return;
  }
  regs_increase<Regs::kConsumerRegs>();
  load_q_tile(c);
  ws_consume<Traits, Features>(c, bars);
  asm volatile("bar.arrive 4, %0;\n" ::"n"(Traits::kCtaThreads) : "memory");
}

}  // namespace pagedattn
