// The warp-specialised sm_90a prefill (Traits::kWs: warpgroup MMAs fed by TMA, paged 16-bit caches
// whose pages hold whole 16-key chunks). A persistent CTA per SM takes the work items blockIdx.x,
// blockIdx.x + gridDim.x, ... of the logical grid (ws_slot); it is kWarpsM / 4 consumer warpgroups
// and one producer warpgroup after them:
//   producer   its four warps issue the TMA copies of every item's K and V tiles (kBlockN keys as
//              16-key chunks, a share per warp and one per lane, each inside one cache page) into
//              rings of kStages slots, running ahead into the next item while the consumers finish
//              one; it gives its registers to the consumers (setmaxnreg);
//   consumers  each warpgroup owns 64 rows: its Q rows (cp.async), S = Q K^T, the mask policy, online
//              softmax, O += P V (attn_wgmma.cuh), the S of a step overlapping the P V of the step
//              before, and (with kPingPong) the two warpgroups taking turns on the tensor cores. Once
//              the last S of an item is done, a warpgroup finds its next item and loads its Q rows
//              (with kQFeed, opt-in, the producer does both: ws_feed_q; kQFeed 2 also chains the items,
//              WsChain); the epilogue writes O straight from the accumulators, so no shared memory the
//              producer or the next Q may be filling is touched (kOBulk, opt-in: through a buffer of its
//              own per warp and bulk copies).
// With kPair (tile field kWsPair, opt-in) the kernel runs in clusters of two CTAs that take two row
// tiles of one column together (ws_pair_item) and walk the same steps: each producer copies half of
// every step's boxes into both CTAs' slots (TMA multicast), and each consumer warp hands a slot back to
// both producers (ws_hand_back).
// K and V have rings of their own (a K slot goes back once its S is computed, a V slot once its P V
// is), each slot with two mbarriers: `full` (every producer warp's expected bytes landed) and `empty`
// (every consumer warp is done reading it). The rings run on across items: step n of the CTA (its
// items' steps in order) uses slot n % kStages. Keys past the request's end inside the last chunk are
// real cache slots: the mask hides their scores and the consumers zero their V rows (0 * NaN is not
// 0) before P V. A chunk in a page outside [0, num_blocks) is zero-filled by the producer instead.
// fp8 caches (head dim 128): the producer lands raw chunks in stages of its own and widens them into
// the ring as fp16, the MMAs' type then (Traits::MmaElement; ws_produce_fp8), writing the V rows past
// the request's end as zeros itself; a bf16 Q is converted to fp16 per item (ws_q_ready); the
// descales are folded into the softmax scale and the output. With kFp8Qk (tile field kWsFp8Qk,
// opt-in: faster, less precise; tiles.py says how much) only V is widened: K's raw chunks land in a
// ring of kKSlots slots of their own, S = Q K^T runs as e4m3 x fp8 MMAs on them, and each warp splits
// its Q rows into e4m3 hi and lo tiles per item (ws_q_split).
// This file holds the consumer warpgroups and the kernel; ws_producer.cuh the producer, ws_epilogue.cuh
// the epilogue, ws_pipeline.cuh what the roles share (register hand-over, ring barriers, turns).
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/async_copy.cuh"
#include "pagedattn/attn_tile.cuh"
#include "pagedattn/attn_wgmma.cuh"
#include "pagedattn/mainloop_sm80.cuh"
#include "pagedattn/mask.cuh"
#include "pagedattn/rows_past_grid.cuh"
#include "pagedattn/softmax.cuh"
#include "pagedattn/softmax_merge.cuh"
#include "pagedattn/split_combine.cuh"
#include "pagedattn/tile_scheduler.cuh"
#include "pagedattn/tma_copy.cuh"
#include "pagedattn/ws_epilogue.cuh"
#include "pagedattn/ws_pipeline.cuh"
#include "pagedattn/ws_producer.cuh"

namespace pagedattn {

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

// The raw scores S = Q K^T of a thread's accumulator entries for the step whose first key is key0, made
// again by the warp alone with fp32 FMAs: exponentiate_lagging's rare way back. Q from its shared-memory
// tile; K from the cache itself (its ring slot went back before the exponentials), as the producer
// reads it: keys past the request's end and columns past head_size as zeros, a page outside
// [0, num_blocks) as zeros, fp8 widened exactly. Nothing unrolled (code size): the scores gather in
// local memory. The coordinates come from a thread index the compiler cannot see through: it would
// otherwise make the swizzled offsets ahead of the step loop and hold them there.
template <class Traits, class TensorS>
__device__ __forceinline__ void ws_scores_again(TileCtx<Traits> const& c, int key0, TensorS& acc_s) {
  using namespace cute;
  using Element = typename Traits::MmaElement;
  int tidx = c.tidx;
  asm volatile("" : "+r"(tidx));
  auto const tScS = WgmmaTiles<Traits>::template coords<Traits::kBlockN>(tidx);
  Element const* const q = reinterpret_cast<Element const*>(c.smem.q());
  auto to_floats = [](uint4 const& x, float (&f)[8]) {  // the 8 Element values of a 16-byte piece
    Element const* const e = reinterpret_cast<Element const*>(&x);
    CUTE_UNROLL
    for (int j = 0; j < 8; ++j) f[j] = float(e[j]);
  };
  // the thread's two rows, and its first column: entry c + 2 h + 4 n is column col0 + c + 8 n of row h
  int const row0 = int(get<0>(tScS(0))), row1 = int(get<0>(tScS(2))), col0 = int(get<1>(tScS(0)));
  constexpr int kEntries = decltype(size(acc_s))::value;
  float again[kEntries];  // local memory: the loops below are not unrolled (code size)
#pragma unroll 1
  for (int e = 0; e < kEntries / 2; ++e) {  // column col0 + e % 2 + 8 (e / 2) of both rows
    int const cc = e % 2, n = e / 2;
    int const key = key0 + col0 + cc + 8 * n;
    char const* k_row = nullptr;
    char const* v_row;
    bool const live = key < c.w.k_len && c.kv.locate(key, k_row, v_row);
    float s0 = 0.f, s1 = 0.f;
#pragma unroll 1
    for (int d = 0; d < Traits::kHeadDim; d += 8) {
      float q0[8], q1[8], kf[8];
      to_floats(*reinterpret_cast<uint4 const*>(q + typename Traits::SmemLayoutQ{}(row0, d)), q0);
      to_floats(*reinterpret_cast<uint4 const*>(q + typename Traits::SmemLayoutQ{}(row1, d)), q1);
      uint4 kx = make_uint4(0, 0, 0, 0);
      if (live && d < c.p.head_size) {
        if constexpr (Traits::kIsFp8) {  // 8 fp8 bytes -> 8 fp16 values (the producer's widening)
          uint2 const raw = *reinterpret_cast<uint2 const*>(k_row + d);
          uint4 hi;
          widen_fp8x16_half<Traits::kFp8>(make_uint4(raw.x, raw.y, 0, 0), kx, hi);
        } else {
          kx = *reinterpret_cast<uint4 const*>(k_row + d * int(sizeof(Element)));
        }
      }
      to_floats(kx, kf);
      CUTE_UNROLL
      for (int j = 0; j < 8; ++j) {
        s0 = fmaf(q0[j], kf[j], s0);
        s1 = fmaf(q1[j], kf[j], s1);
      }
    }
    again[4 * n + cc] = s0;
    again[4 * n + cc + 2] = s1;
  }
  CUTE_UNROLL
  for (int i = 0; i < kEntries; ++i) acc_s(i) = again[i];
}

// Warpgroup wg's 64 rows of item w's Q tile, by cp.async (committed; ws_q_ready waits for them).
template <class Traits>
__device__ __forceinline__ void ws_load_q(AttnParams const& p, AttnWork const& w, char* smem, int wg) {
  load_q_rows<Traits>(p, w, AttnSmem<Traits>{smem}.q(), 64 * wg, 64, int(threadIdx.x) % 128, 128);
  cp_async_commit();
}

// Traits::kFp8Qk: each warp turns the 16 Q rows whose scores it holds from 16-bit panels (two of 64
// columns, 128 bytes a row) into two e4m3 tiles of 128-byte rows in the same bytes, hi (q times 2^s,
// rounded) where panel 0 was and lo (the rest, rounded) where panel 1 was, each row where it was. s
// puts the rows' largest |q| in [128, 256), so hi + lo is q 2^s exactly but for parts below 2^-9
// (e4m3's least subnormal), under 2^-16 of that largest |q|. The two lanes of a row each convert one
// panel's 64 columns (16-byte pieces at piece ^ (row % 8) in both layouts). Returns 2^-s, the scores' factor.
template <class Traits>
__device__ __forceinline__ float ws_q_split(AttnSmem<Traits> const& sm, int wg) {
  static_assert(Traits::kHeadDim == 128 && Traits::kBlockM == 128, "two 64-column panels, one 128-byte row");
  constexpr int kPanelBytes = Traits::kBlockM * 128;
  int const lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32 % 4;
  int const row = 64 * wg + 16 * warp + lane / 2, half = lane % 2, sw = row % 8;
  char* const q = reinterpret_cast<char*>(sm.q());
  char* const src = q + half * kPanelBytes + row * 128;
  float v[64];  // the lane's 64 values, in column order
  CUTE_UNROLL
  for (int j = 0; j < 8; ++j) {
    uint4 const x = *reinterpret_cast<uint4 const*>(src + ((j ^ sw) << 4));
    auto const* e = reinterpret_cast<typename Traits::Element const*>(&x);
    CUTE_UNROLL
    for (int i = 0; i < 8; ++i) v[8 * j + i] = to_float(e[i]);
  }
  float top = 0.f;  // NaN is left out here and stays NaN in hi
  CUTE_UNROLL
  for (int i = 0; i < 64; ++i) top = fmaxf(top, fabsf(v[i]));
  uint32_t const top_bits = __reduce_max_sync(0xffffffffu, __float_as_uint(top));  // non-negative: as integers
  int const s = min(120, max(-120, 7 - (int(top_bits >> 23) - 127)));
  float const up = __uint_as_float(uint32_t(127 + s) << 23);
  __syncwarp();  // every read of the row's two panels before either lane writes over them
  CUTE_UNROLL
  for (int t = 0; t < 4; ++t) {  // fp8 piece 4 half + t: columns 16 t .. 16 t + 15 of the lane's panel
    uint32_t hi[4], lo[4];
    CUTE_UNROLL
    for (int w = 0; w < 4; ++w) {
      uint32_t hw[2], lw[2];
      CUTE_UNROLL
      for (int p = 0; p < 2; ++p) {
        int const i = 16 * t + 4 * w + 2 * p;
        float2 const x = make_float2(v[i] * up, v[i + 1] * up);
        __nv_fp8x2_storage_t const h = __nv_cvt_float2_to_fp8x2(x, __NV_SATFINITE, __NV_E4M3);
        __half2_raw const hr = __nv_cvt_fp8x2_to_halfraw2(h, __NV_E4M3);
        float2 const back = __half22float2(*reinterpret_cast<__half2 const*>(&hr));
        float2 const r = make_float2(x.x - back.x, x.y - back.y);
        hw[p] = h;
        lw[p] = __nv_cvt_float2_to_fp8x2(r, __NV_SATFINITE, __NV_E4M3);
      }
      hi[w] = hw[0] | hw[1] << 16;
      lo[w] = lw[0] | lw[1] << 16;
    }
    int const at = row * 128 + (((4 * half + t) ^ sw) << 4);
    *reinterpret_cast<uint4*>(q + at) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    *reinterpret_cast<uint4*>(q + kPanelBytes + at) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
  }
  return __uint_as_float(uint32_t(127 - s) << 23);
}

// This warpgroup's Q rows landed and are visible to wgmma. Traits::kQToHalf: each warp then converts
// the 16 rows whose scores it holds (wgmma gives warp w of a warpgroup rows 16 w .. 16 w + 15) from
// bf16 to fp16 in place, times 2^-e, e the least power keeping the rows' largest magnitude below 2^15
// (0 unless some |q| >= 32768): the returned 2^e, applied to the scores, undoes it exactly.
template <class Traits>
__device__ __forceinline__ float ws_q_ready(AttnSmem<Traits> const& sm, int wg) {
  // every row of this warpgroup landed: kQFeed, the full mbarrier the caller waited on says so; else
  // each thread waits for its own copies, and then the warpgroup for all of them
  auto all_landed = [&] {
    if constexpr (!Traits::kQFeed) ws_group_sync(wg);
  };
  if constexpr (!Traits::kQFeed) cp_async_wait<0>();
  float unscale = 1.f;
  if constexpr (Traits::kQToHalf) {
    all_landed();
    constexpr int kPanels = Traits::kHeadDim / 64;   // 64-column panels of 128-byte rows (SW128 atoms)
    constexpr int kPerPanel = 16 * 8 / 32;           // a lane's 16-byte pieces of its warp's rows in a panel
    int const lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32 % 4;
    // piece i of the lane: 16 bytes of panel i / kPerPanel's 16 rows of the warp (the swizzle moves
    // pieces within a 128-byte row, and the conversion does not care where a value sits)
    auto piece = [&](int i) {
      int const panel = i / kPerPanel, at = (i % kPerPanel) * 32 + lane;
      return reinterpret_cast<uint4*>(sm.q()) + (panel * Traits::kBlockM + 64 * wg + 16 * warp) * 8 + at;
    };
    uint32_t top = 0;  // the rows' largest |q| as float bits (non-negative floats order as integers)
    CUTE_UNROLL
    for (int i = 0; i < kPanels * kPerPanel; ++i) {
      uint4 const x = *piece(i);
      for (uint32_t const w : {x.x, x.y, x.z, x.w}) top = max(top, max((w & 0x7fffu) << 16, w & 0x7fff0000u));
    }
    top = __reduce_max_sync(0xffffffffu, top);
    int const e = max(0, int(top >> 23) - 127 - 14);  // |q| < 2^(E + 1) <= 2^15 once scaled by 2^-e
    float const down = __uint_as_float(uint32_t(127 - e) << 23);
    CUTE_UNROLL
    for (int i = 0; i < kPanels * kPerPanel; ++i) {
      uint4 x = *piece(i);
      for (uint32_t* const w : {&x.x, &x.y, &x.z, &x.w}) {
        __half2 const h = __floats2half2_rn(__uint_as_float(*w << 16) * down, __uint_as_float(*w & 0xffff0000u) * down);
        *w = *reinterpret_cast<uint32_t const*>(&h);
      }
      *piece(i) = x;
    }
    unscale = __uint_as_float(uint32_t(127 + e) << 23);
  }
  if constexpr (Traits::kFp8Qk) {
    all_landed();
    unscale = ws_q_split<Traits>(sm, wg);
  }
  // the rows (written by cp.async, or converted) to wgmma, the async proxy. kQFeed with no conversion
  // needs no barrier: each warp fences after its own wait, and a warpgroup MMA starts once all four
  // warps issued it
  fence_proxy_async_smem();
  if constexpr (!Traits::kQFeed || Traits::kQToHalf || Traits::kFp8Qk) ws_group_sync(wg);
  return unscale;
}

// ws_consume's items one by one: each item's first S in a turn of its own on the tensor cores.
struct WsNoChain {
  static constexpr bool kOn = false;
};

// Traits::kChain: a consumer warpgroup's items chained. Item n's last turn on the tensor cores issues
// item n + 1's first S (into acc_s, which lives across items) before its own last P V, so that the two
// run back to back and item n + 1 starts with its scores made; the ring runs on across items, so that
// S reads K from the slot of item n's step n_steps. n counts the warpgroup's items (ws_consume_fed).
template <class Traits>
struct WsChain {
  static constexpr bool kOn = true;
  using Tiles = WgmmaTiles<Traits>;
  using Element = typename Traits::MmaElement;
  decltype(Tiles::template acc<typename Tiles::TiledMmaQK, Traits::kBlockN>()) acc_s;
  bool s0_ready = false;  // acc_s holds the current item's first S
  AttnSmem<Traits> sm;
  int wg;
  uint32_t n = 0;  // the current item

  // Item n + 1 once the producer handed it over (its Q tile landed): its Q tile, for its first S, or
  // null where it cannot start now (no item: the end; no steps; or, kPair, no tile of this CTA's).
  __device__ __forceinline__ Element const* next() const {
    uint32_t const m = n + 1;
    int const t = int(m % 2u);
    mbarrier_wait(sm.ws_q_full(wg, t), (m / 2u) & 1u);
    AttnWork const& w = *sm.ws_work(wg, int(m % uint32_t(Traits::kWorkSlots)));
    if (w.b < 0 || w.step_end == w.step_begin || (Traits::kPair && ws_idle(w))) return nullptr;
    fence_proxy_async_smem();  // its rows (cp.async) to wgmma, as ws_q_ready does
    return reinterpret_cast<Element const*>(AttnSmem<Traits>{sm.base, t}.q());
  }
};

// The S accumulator ws_consume uses: the chain's (kept across items), or its own.
template <class Chain, class AccS>
__device__ __forceinline__ auto& ws_acc_s(Chain& chain, AccS& own) {
  if constexpr (Chain::kOn) {
    return chain.acc_s;
  } else {
    return own;
  }
}

// One item, by a consumer thread (c.tidx < kThreads), once this warpgroup's Q rows landed
// (ws_q_ready, whose scale of this warp's Q rows q_unscale undoes in the scores); `next_q()` is called
// once, when the item's last S no longer reads them (before the last P V and the epilogue, which its
// copies overlap). `chain`: WsNoChain, or (Traits::kChain) WsChain, whose next item's first S this
// item's last turn issues.
template <class Traits, class Features, class NextQ, class Chain>
__device__ __forceinline__ void ws_consume(TileCtx<Traits> const& c, WsRing const ring,
                                           WsPingPong<Traits::kPingPong> const& pp, float const q_unscale,
                                           NextQ const& next_q, Chain& chain) {
  using namespace cute;
  using Element = typename Traits::MmaElement;  // fp16 with an fp8 cache (its Q converted by ws_q_ready)
  constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  static_assert(!Traits::kPingPong || Traits::kThreads == 256, "ping-pong: two consumer warpgroups");
  using Tiles = WgmmaTiles<Traits>;
  typename Tiles::TiledMmaQK mma_qk;
  typename Tiles::TiledMmaPV mma_pv;
  Tensor acc_o = Tiles::template acc<typename Tiles::TiledMmaPV, kHeadDim>();  // = partition_fragment_C(mma_pv, ..)
  clear(acc_o);
  Tensor o_rows = make_tensor(acc_o.data(), Layout<Shape<_4, _1, Int<kHeadDim / 8>>>{});
  Tensor tScS = Tiles::template coords<kBlockN>(c.tidx);
  AttnMask<2, Features> const mask(c.p, c.w, tScS);
  OnlineSoftmax<2> softmax;
  constexpr int kFma = Features::kSoftcap ? Traits::kExp2FmaSoftcap : 0;
  typename Tiles::FragP tOrP;
  WsBarriers const bars(c.smem);  // from the shared window's base: constants, not registers held per item

  // Steps overlap inside the warpgroup: S of step it is computed while P V of step it - 1 still
  // accumulates into O. O takes the rescaling step it - 1's scores asked for between issuing step it's
  // S and its P V (FA3's order), while the tensor cores run that S: 4-5 % faster on H200 than rescaling
  // once the P V before is done (perf/results/ws_rescale_ab_*_b658785.json: B=4 S=4096 causal 1208 ->
  // 1135-1157 us, B=1 S=16384 4183-4303 -> 3978 us, B=8 512 over 8192 1023-1031 -> 969-978 us).
  int const n_steps = c.w.step_end - c.w.step_begin;
  auto key0_of = [&](int it) { return (c.w.step_begin + it) * kBlockN; };
  constexpr int kKSlots = Traits::kFp8Qk ? Traits::kKSlots : kStages;  // K's ring
  Tensor acc_s_own = Tiles::template acc<typename Tiles::TiledMmaQK, kBlockN>();  // (unused when chained)
  auto& acc_s = ws_acc_s(chain, acc_s_own);
  auto wait_k = [&](int it) { mbarrier_wait(bars.full_k + ring.slot<kKSlots>(it), ring.phase<kKSlots>(it)); };
  auto wait_v = [&](int it) {  // step it's V landed; rows past the request's end zeroed
    mbarrier_wait(bars.full_v + ring.slot<kStages>(it), ring.phase<kStages>(it));
    if constexpr (!Traits::kIsFp8) {  // fp8: the producer wrote those rows as zeros
      int const first = c.w.k_len - key0_of(it);
      if (first < kBlockN) ws_clear_tail(c, ring.slot<kStages>(it), first);  // uniform: the last step only
    }
  };
  auto tSrK = [&](int it) {
    return Tiles::frag_k(reinterpret_cast<Element const*>(c.smem.k_tile(ring.slot<kStages>(it), 0)));
  };
  auto tOrVt = [&](int it) {
    return Tiles::frag_vt(reinterpret_cast<Element const*>(c.smem.v_tile(ring.slot<kStages>(it), 0)));
  };
  auto release_slot = [&](uint64_t* empty) {  // this warp is done with a slot
    __syncwarp();
    if (c.tidx % 32 == 0) ws_hand_back<Traits>(empty);
  };
  auto release_k = [&](int it) { release_slot(bars.empty_k + ring.slot<kKSlots>(it)); };
  auto release_v = [&](int it) { release_slot(bars.empty_v + ring.slot<kStages>(it)); };
  // S of step it against the Q tile at q (the item's, or the next item's in the chain), issued (not
  // waited for). Q's descriptors (one per 16-column k-step: = thr_qk.partition_fragment_A(Q tile)) are
  // loop-invariant, so the compiler would hold them all across the step loop (16 x 64 bits at d256,
  // spilled with the O accumulator); with PAGEDATTN_WS_Q_LATE (tile field kWsQLate: d256) each S makes
  // them afresh from an address the compiler cannot see through (an add and a move to a uniform register
  // per k-step).
  auto issue_s_with = [&](Element const* q, int it) {
#if PAGEDATTN_WS_Q_LATE
    asm volatile("" : "+l"(q));
#endif
    Tensor tSrQ = Tiles::frag_q(q, c.tidx);
    wgmma_gemm<true, false>(mma_qk, tSrQ, tSrK(it), acc_s);
  };
  // S of step it, issued (not waited for)
  auto issue_s = [&](int it) {
    if constexpr (Traits::kFp8Qk) {
      void const* q = c.smem.q();
#if PAGEDATTN_WS_Q_LATE
      asm volatile("" : "+l"(q));
#endif
      typename WgmmaQk8<Traits>::TiledMma mma_qk8;
      Tensor k8 = Tiles::frag_k8(c.smem.raw_k(ring.slot<kKSlots>(it)));
      wgmma_gemm_split(mma_qk8, Tiles::frag_q8(q, 0, c.tidx), Tiles::frag_q8(q, 1, c.tidx), k8, acc_s);
    } else {
      issue_s_with(reinterpret_cast<Element const*>(c.smem.q()), it);
    }
  };
  auto to_p = [&](auto const& s) {
    CUTE_UNROLL
    for (int i = 0; i < size(s); ++i) tOrP(i) = Element(s(i));
  };
  Tensor s_rows = make_tensor(acc_s.data(), Layout<Shape<_4, _1, Int<kBlockN / 8>>>{});
  // softcapped scores are bounded: a fixed maximum where P's type holds them (OnlineSoftmax::fix_max)
  bool const fixed_max = Features::kSoftcap && !Features::kAlibi && softmax.template fix_max<Element>(mask.cap_out);
  // kLag (kLazyMax 3): an item's steps after its first take exponentiate_lagging, whose rare way back
  // makes the step's S afresh (ws_scores_again: Q's tile and the cache's K). Not with 2^x on the FMA
  // pipe (exp2_fma holds for x <= 64 only), nor with kFp8Qk (Q split into e4m3 tiles): kLazyMax 2 then.
  constexpr bool kLag = PAGEDATTN_LAZY_MAX == 3 && kFma == 0 && !Traits::kFp8Qk;
  // Step it's masked scores into probabilities (lag: the step may take exponentiate_lagging). Its rare
  // way back (warp-uniform) makes S again and takes the loop's second turn, so that the mask and
  // exponentiate() are inlined once.
  auto exponentiate = [&](int it, float (&alpha)[2], bool lag) {
    bool exact = !kLag || !lag || fixed_max || softmax.no_max();
    for (bool again = false;; again = true) {
      if (again) ws_scores_again<Traits>(c, key0_of(it), acc_s);
      float const k = mask.template apply<kBlockN>(acc_s, tScS, key0_of(it), c.scale_log2 * q_unscale);
      if (fixed_max) {
        softmax.template exponentiate_fixed<kFma>(s_rows, k);
        alpha[0] = alpha[1] = 1.f;
        return;
      }
      if (exact) {
        softmax.template exponentiate<kFma>(s_rows, k, alpha);
        return;
      }
      if (!softmax.exponentiate_lagging(s_rows, k, alpha)) return;
      exact = true;
    }
  };
  bool s0_ready = false;  // the item before issued this item's first S (chained)
  if constexpr (Chain::kOn) s0_ready = chain.s0_ready;
  if (n_steps == 0) {
    next_q();
  } else {
    if (!s0_ready) {
      wait_k(0);
      pp.my_turn();
      issue_s(0);
      pp.your_turn();
      wgmma_wait<0>(acc_s);
      release_k(0);
    }
    float alpha[2];  // the rescaling of O that step it's scores ask for
    exponentiate(0, alpha, false);
    to_p(acc_s);
    for (int it = 1; it < n_steps; ++it) {
      wait_k(it);
      wait_v(it - 1);
      pp.my_turn();
      issue_s(it);
      if (!fixed_max) softmax.rescale(o_rows, alpha);  // while S's MMAs run (O is zero at step 1)
      wgmma_gemm<false, false>(mma_pv, tOrP, tOrVt(it - 1), acc_o);
      pp.your_turn();
      wgmma_wait<1>(acc_s);
      release_k(it);
      exponentiate(it, alpha, true);
      wgmma_wait<0>(acc_o);
      warpgroup_fence_operand(tOrP);  // P of step it - 1 stays in its registers until its MMAs are done
      release_v(it - 1);
      to_p(acc_s);
    }
    next_q();  // the last S is done (and S's registers are free): Q's shared memory is no longer read
    // Chained: the next item's first S (its K in the ring's next slot) and this item's last P V in one
    // turn. Two paths, not one with the S under a condition: ptxas serialises every wgmma of a kernel
    // (C7515) where an accumulator may be defined by other instructions inside a batch's stage, as
    // acc_s would be on the path without the S.
    Element const* q_next = nullptr;
    if constexpr (Chain::kOn) {
      q_next = chain.next();
      chain.s0_ready = q_next != nullptr;
    }
    if (Chain::kOn && q_next != nullptr) {
      wait_k(n_steps);
      wait_v(n_steps - 1);
      pp.my_turn();
      issue_s_with(q_next, n_steps);
      if (!fixed_max) softmax.rescale(o_rows, alpha);
      wgmma_gemm<false, false>(mma_pv, tOrP, tOrVt(n_steps - 1), acc_o);
      pp.your_turn();
      wgmma_wait<0>(acc_o);
      warpgroup_fence_operand(acc_s);
      warpgroup_fence_operand(tOrP);
      release_v(n_steps - 1);
      release_k(n_steps);
    } else {  // the last P V in a turn of its own
      wait_v(n_steps - 1);
      if (!fixed_max) softmax.rescale(o_rows, alpha);
      pp.my_turn();
      wgmma_gemm<false, false>(mma_pv, tOrP, tOrVt(n_steps - 1), acc_o);
      pp.your_turn();
      wgmma_wait<0>(acc_o);
      warpgroup_fence_operand(tOrP);
      release_v(n_steps - 1);
    }
  }
  if constexpr (Chain::kOn) {
    if (n_steps == 0) chain.s0_ready = false;
  }
  ws_store_tile<Traits, Features>(c, o_rows, softmax,
                                  Tiles::template coords<kHeadDim>(c.tidx));
}

// Rows past the grid's row tiles (rare; rows_past_grid.cuh) of this CTA's items: every thread checks
// a share of them, and only if one has such rows do all warps walk them. Called by every thread.
template <class Traits, class Features>
__device__ __forceinline__ void ws_rows_past_grid(AttnParams const& p, int total) {
  int const tile_rows = p.grid_tiles * Traits::kBlockM;
  bool past = false;
  for (int64_t item = blockIdx.x + int64_t(threadIdx.x) * gridDim.x; item < total;
       item += int64_t(blockDim.x) * gridDim.x) {  // 64-bit: blockDim.x * gridDim.x items past the last
    int const b = ws_slot(p, int(item)).column / p.num_kv_heads;
    int const q_start = clamp_to(p.cu_seqlens_q[b], 0, p.total_q);
    past |= (clamp_to(p.cu_seqlens_q[b + 1], q_start, p.total_q) - q_start) * p.group > tile_rows;
  }
  if (!__syncthreads_or(past)) return;
  for (int item = blockIdx.x; item < total; item += gridDim.x) {
    AttnWork w;
    schedule<Traits, Features>(p, ws_slot(p, item), w);  // the request's fields, tile or not
    if (w.q_len * p.group > tile_rows) {
      attn_rows_past_grid<Traits, Features>(p, w, p.grid_tiles, int(threadIdx.x / 32), int(blockDim.x / 32));
    }
  }
}

// Traits::kPair, an item of the other CTA's alone (ws_idle): its n_steps steps' slots, from ring step
// ring.ring on, each handed back to both CTAs' producers once it landed (before then the producers
// may not refill it: the next copies' bytes would count in this phase). By every consumer thread.
template <class Traits>
__device__ __forceinline__ void ws_pass_steps(AttnSmem<Traits> const& sm, WsRing const ring, int n_steps) {
  WsBarriers const bars(sm);
  for (int it = 0; it < n_steps; ++it) {
    int const slot = ring.slot<Traits::kStages>(it);
    uint32_t const phase = ring.phase<Traits::kStages>(it);
    mbarrier_wait(bars.full_k + slot, phase);
    mbarrier_wait(bars.full_v + slot, phase);
    __syncwarp();
    if (threadIdx.x % 32 == 0) {
      ws_hand_back<Traits>(bars.empty_k + slot);
      ws_hand_back<Traits>(bars.empty_v + slot);
    }
  }
}

// A consumer warpgroup's items, found by itself: the items blockIdx.x, blockIdx.x + gridDim.x, ... that
// have a tile, each found (and its Q rows copied) by the warpgroup once the last S of the one before is
// done. Its items alternate between its two work slots in shared memory (written by its first thread,
// read after ws_q_ready's barrier): the mainloop reloads the few fields it needs there instead of
// holding (or spilling) a work item in registers through it.
template <class Traits, class Features>
__device__ __forceinline__ void ws_consume_found(AttnParams const& p, AttnSmem<Traits> const& sm,
                                                 WsPingPong<Traits::kPingPong> const& pp, int wg, int total) {
  bool const leader = threadIdx.x % 128 == 0;
  WsRing ring{0};
  int item = ws_first<Traits>();  // the next item (kPair: pair) to look at
  int parity = 0;
  int pass = -1;  // kPair: the next item's steps where it is the other CTA's alone (ws_idle), else -1
  bool more;
  // the next item (found by every thread), into work slot `slot`: its Q rows on their way
  auto take = [&](AttnWork const& next, int slot) {
    if constexpr (Traits::kPair) {
      pass = ws_idle(next) ? next.step_end - next.step_begin : -1;
      if (pass >= 0) return;
    }
    ws_load_q<Traits>(p, next, sm.base, wg);
    if (leader) *sm.ws_work(wg, slot) = next;
  };
  auto take_next = [&] {  // the item after this one (in work slot parity ^ 1), if any
    AttnWork next;
    more = ws_next_item<Traits, Features>(p, total, item, next);
    if (more) take(next, parity ^ 1);
  };
  {
    AttnWork first;
    more = ws_next_item<Traits, Features>(p, total, item, first);
    if (more) take(first, 0);
  }
  while (more) {
    if constexpr (Traits::kPair) {
      if (pass >= 0) {
        // every warp done with the item before (its epilogue reads its work slot, which the next
        // item's may take): the barrier ws_q_ready would otherwise make
        ws_group_sync(wg);
        ws_pass_steps<Traits>(sm, ring, pass);
        ring.ring += uint32_t(pass);
        take_next();
        parity ^= 1;
        continue;
      }
    }
    float const q_unscale = ws_q_ready(sm, wg);
    AttnWork const& w = *sm.ws_work(wg, parity);
    more = false;
    {
      TileCtx<Traits> const c(p, w, sm.base);
      WsNoChain one_by_one;
      ws_consume<Traits, Features>(c, ring, pp, q_unscale, take_next, one_by_one);
    }
    ring.ring += uint32_t(w.step_end - w.step_begin);
    parity ^= 1;
  }
}

// Traits::kQFeed: a consumer warpgroup's items as the producer hands them over (ws_feed_q), item n in
// Q tile n % kQTiles and work slot n % kWorkSlots once the tile's full mbarrier says so, until the end
// item (b = -1). Each warp hands the Q rows back (the tile's empty mbarrier) once the item's last S is
// done. kChain: the items chained (WsChain).
template <class Traits, class Features>
__device__ __forceinline__ void ws_consume_fed(AttnParams const& p, AttnSmem<Traits> const& sm,
                                               WsPingPong<Traits::kPingPong> const& pp, int wg) {
  using Chain = cute::conditional_t<Traits::kChain, WsChain<Traits>, WsNoChain>;
  Chain chain;
  if constexpr (Traits::kChain) {
    chain.sm = sm;
    chain.wg = wg;
  }
  WsRing ring{0};
  for (uint32_t n = 0;; ++n) {
    int const t = int(n % uint32_t(Traits::kQTiles));
    mbarrier_wait(sm.ws_q_full(wg, t), (n / uint32_t(Traits::kQTiles)) & 1u);
    AttnWork const& w = *sm.ws_work(wg, int(n % uint32_t(Traits::kWorkSlots)));
    if (w.b < 0) return;
    auto const hand_q_back = [&] {  // the tile's rows (and the work slot) to the producer again
      __syncwarp();
      if (threadIdx.x % 32 == 0) mbarrier_arrive(sm.ws_q_empty(wg, t));
    };
    if constexpr (Traits::kPair) {
      if (ws_idle(w)) {  // the other CTA's item alone: its steps pass through
        int const n_steps = w.step_end - w.step_begin;
        hand_q_back();
        ws_pass_steps<Traits>(sm, ring, n_steps);
        ring.ring += uint32_t(n_steps);
        continue;
      }
    }
    AttnSmem<Traits> const item_sm{sm.base, t};
    float const q_unscale = ws_q_ready(item_sm, wg);
    if constexpr (Traits::kChain) chain.n = n;
    {
      TileCtx<Traits> const c(p, w, sm.base, t);
      ws_consume<Traits, Features>(c, ring, pp, q_unscale, hand_q_back, chain);
    }
    ring.ring += uint32_t(w.step_end - w.step_begin);
  }
}

// The persistent warp-specialised prefill: every thread of the CTA calls it.
template <class Traits, class Features>
__device__ __forceinline__ void attn_fwd_ws(AttnParams const& p, char* smem) {
  using Regs = WsRegisters<Traits>;
  AttnSmem<Traits> const sm{smem};
  WsBarriers const bars(sm);
  if (threadIdx.x == 0) {
    for (int s = 0; s < Traits::kRingSlots; ++s) {
      mbarrier_init(bars.full_k + s, kWsProducerWarps);
      mbarrier_init(bars.full_v + s, kWsProducerWarps);
      // every consumer warp's hand-back; kPair: both CTAs' (ws_hand_back)
      mbarrier_init(bars.empty_k + s, (Traits::kPair ? 2 : 1) * Traits::kThreads / 32);
      mbarrier_init(bars.empty_v + s, (Traits::kPair ? 2 : 1) * Traits::kThreads / 32);
    }
    if constexpr (Traits::kIsFp8) {
      for (int i = 0; i < 2 * kWsProducerWarps * Traits::Smem::kRawStages; ++i) {
        mbarrier_init(sm.ws_raw_bar(0, 0, 0) + i, 1);
      }
    }
    if constexpr (Traits::kQFeed) {
      for (int wg = 0; wg < Traits::kThreads / 128; ++wg) {
        for (int t = 0; t < Traits::kQTiles; ++t) {
          mbarrier_init(sm.ws_q_full(wg, t), Traits::kProducerThreads + 1);  // ws_feed_q
          mbarrier_init(sm.ws_q_empty(wg, t), 4);                            // the warpgroup's warps
        }
      }
    }
    mbarrier_init_fence();
  }
  int const total = ws_items(p);
  ws_rows_past_grid<Traits, Features>(p, total);  // its __syncthreads_or also publishes the barriers' init
  // kPair: ... and this to the other CTA, before its first multicast or hand-back reaches them
  if constexpr (Traits::kPair) cluster_sync();
  if (int(threadIdx.x) >= Traits::kThreads) {  // the producer warpgroup
    regs_decrease<Regs::kProducerRegs>();
    static_assert(Traits::kProducerThreads == 32 * kWsProducerWarps, "the producer warpgroup's warps");
    WsRing ring{0};
    int item = ws_first<Traits>();
    AttnWork w;
    uint32_t n = 0;  // the CTA's items so far
    while (ws_next_item<Traits, Features>(p, total, item, w)) {
      TileCtx<Traits> const c(p, w, smem);
      int const found = item - ws_stride<Traits>();  // ws_next_item steps past it
      auto const feed = [&] {  // kQFeed: the item and its Q rows to the consumers
        if constexpr (Traits::kQFeed) ws_feed_q<Traits, Features>(p, found, sm, n, false);
      };
      if constexpr (Traits::kIsFp8) {
        ws_produce_fp8(c, ring, feed);
      } else {
        ws_produce(c, ring, feed);
      }
      ring.ring += uint32_t(w.step_end - w.step_begin);
      ++n;
    }
    if constexpr (Traits::kQFeed) ws_feed_q<Traits, Features>(p, 0, sm, n, true);
    // stay until the consumers are done (named barrier 4): the CTA's warps leave together, so that
    // compute-sanitizer sees the consumers' named barriers (tile_sync, ping-pong) with every warp resident
    asm volatile("bar.sync 4, %0;\n" ::"n"(Traits::kCtaThreads) : "memory");
    if constexpr (Traits::kPair) cluster_sync();  // see the consumers' end
    return;
  }
  regs_increase<Regs::kConsumerRegs>();
  int const wg = int(threadIdx.x) / 128;
  WsPingPong<Traits::kPingPong> const pp{wg};
  pp.start();
  if constexpr (Traits::kQFeed) {
    ws_consume_fed<Traits, Features>(p, sm, pp, wg);
  } else {
    ws_consume_found<Traits, Features>(p, sm, pp, wg, total);
  }
  if constexpr (Traits::kOBulk) bulk_wait_read();  // O's last copies out of shared memory before it goes
  pp.finish();
  asm volatile("bar.arrive 4, %0;\n" ::"n"(Traits::kCtaThreads) : "memory");
  // kPair: neither CTA leaves while the other may still hand slots back to it or copy into it (every
  // step's copies landed in both before either's consumers passed it)
  if constexpr (Traits::kPair) cluster_sync();
}

}  // namespace pagedattn
