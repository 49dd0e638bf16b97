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
//              (with kQFeed, opt-in, the producer does both: ws_feed_q); the epilogue writes O straight
//              from the accumulators, so no shared memory the producer or the next Q may be filling is
//              touched.
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

namespace pagedattn {

// Registers per thread after the hand-over: the producer keeps kProducerRegs, the consumers take
// what is left of the registers the CTA was launched with (kPool: __launch_bounds__' share of the
// SM's 64 Ki, a multiple of 8 per thread), at most 240 (multiples of 8, as setmaxnreg wants).
// setmaxnreg.inc draws on that pool only: asking for more than the decrements freed can block a
// consumer warp for good (at producer 32 / consumers 240 an fp8 prefill hung on the H200).
template <class Traits>
struct WsRegisters {
  static constexpr int kAllThreads = Traits::kThreads + Traits::kProducerThreads;
  static constexpr int kPool = 65536 / kAllThreads / 8 * 8 * kAllThreads;
  // 24 (40 with kQFeed, whose producer copies Q too: the consumers' 232 then hold the kernel without
  // spills), or the tile field kWsProducerRegs (PAGEDATTN_WS_PRODUCER_REGS) when set: tile_config sets it
  // for fp8 caches, whose producer widens the chunks
  static constexpr int kProducerRegs = PAGEDATTN_WS_PRODUCER_REGS ? PAGEDATTN_WS_PRODUCER_REGS
                                      : Traits::kQFeed                ? 40
                                                                      : 24;
  static constexpr int kLeft = (kPool - kProducerRegs * Traits::kProducerThreads) / Traits::kThreads / 8 * 8;
  static constexpr int kConsumerRegs = kLeft > 240 ? 240 : kLeft;
  static_assert(kProducerRegs * Traits::kProducerThreads + kConsumerRegs * Traits::kThreads <= kPool,
                "the hand-over asks for more registers than the CTA holds");
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

  template <class Traits>
  __device__ __forceinline__ explicit WsBarriers(AttnSmem<Traits> const& sm)
      : full_k(sm.ring_bars(0)), full_v(sm.ring_bars(1)), empty_k(sm.ring_bars(2)), empty_v(sm.ring_bars(3)) {}
};

// Where step `it` of an item whose steps start at ring step `ring` lives, and the phase its full
// barrier completes (its empty barrier's wait takes the phase before).
struct WsRing {
  uint32_t ring;
  template <int kStages>
  __device__ __forceinline__ int slot(int it) const { return int((ring + uint32_t(it)) % kStages); }
  template <int kStages>
  __device__ __forceinline__ uint32_t phase(int it) const { return ((ring + uint32_t(it)) / kStages) & 1u; }
};

// The producer warps (kWsProducerWarps: every warp of the producer warpgroup): the K (then V) tiles of
// the item's steps [step_begin, step_end) into their ring slots (WsRing) once the consumers freed them.
// Each warp copies kPerWarp of a step's 16-key chunks, one per lane (a TMA box's coordinates are the
// lane's own, so a warp issues its boxes one lane at a time: four warps issue four times as fast as
// one, which measured busy 88 % of the kernel feeding the whole ring alone), and arrives on the slot's
// full barrier with its bytes.
constexpr int kWsProducerWarps = 4;

// A producer lane's share of an item, for ws_produce and ws_produce_fp8: its warp's kPerWarp chunks
// of each step (chunk q = first_chunk + lane is the lane's own) and the K and V tensor maps.
template <class Traits>
struct WsProducerLane {
  static constexpr int kChunks = Traits::kBlockN / 16;
  static constexpr int kPerWarp = (kChunks + kWsProducerWarps - 1) / kWsProducerWarps;
  static_assert(kPerWarp <= 32, "one 16-key chunk per lane");
  // step it's chunk of this lane: in the request (mine) and in the cache (valid), the warp's masks of
  // both (loads: valid, bad: mine and not valid; bit l for chunk first_chunk + l) and its tensor-map
  // coordinates
  struct Chunk {
    bool valid;
    uint32_t loads, bad;
    int c1, c2;
  };
  TileCtx<Traits> const& c;
  int const lane, warp, first_chunk, q, n_steps;
  void const* const k_map;
  void const* const v_map;

  __device__ __forceinline__ explicit WsProducerLane(TileCtx<Traits> const& ctx)
      : c(ctx), lane(int(threadIdx.x) % 32), warp((int(threadIdx.x) - Traits::kThreads) / 32),
        first_chunk(warp * kPerWarp), q(first_chunk + lane), n_steps(ctx.w.step_end - ctx.w.step_begin),
        k_map(ctx.p.tma_desc), v_map(static_cast<char const*>(ctx.p.tma_desc) + 128) {
    if (threadIdx.x == Traits::kThreads) {
      tma_prefetch_map(k_map);
      tma_prefetch_map(v_map);
    }
  }
  __device__ __forceinline__ int chunk_key(int it) const {
    return (c.w.step_begin + it) * Traits::kBlockN + 16 * q;
  }
  __device__ __forceinline__ bool mine(int it) const {
    return it < n_steps && lane < kPerWarp && q < kChunks && chunk_key(it) < c.w.k_len;
  }
  // the page of step it's chunk (read a step or more ahead of its copies)
  __device__ __forceinline__ int chunk_page(int it) const { return mine(it) ? c.kv.page(chunk_key(it)) : 0; }
  __device__ __forceinline__ Chunk chunk(int it, int phys) const {
    Chunk k;
    bool const own = mine(it);
    k.valid = own && phys >= 0 && phys < c.p.num_blocks;
    k.loads = __ballot_sync(0xffffffffu, k.valid);
    k.bad = __ballot_sync(0xffffffffu, own && !k.valid);
    int const off = c.kv.offset(chunk_key(it));
    k.c1 = c.p.tma_row_dim == 1 ? off : c.w.kv_head;
    k.c2 = c.p.tma_row_dim == 1 ? c.w.kv_head : off;
    return k;
  }
};

template <class Traits, class Feed>
__device__ __forceinline__ void ws_produce(TileCtx<Traits> const& c, WsRing const ring, Feed const& feed) {
  constexpr int kHeadDim = Traits::kHeadDim, kBlockN = Traits::kBlockN, kStages = Traits::kStages;
  constexpr int kBoxCols = 64, kPerWarp = WsProducerLane<Traits>::kPerWarp;
  constexpr int kChunkBytes = 16 * kHeadDim * 2;  // K (or V) bytes of one chunk
  WsBarriers const bars(c.smem);  // from the shared window's base: constants, not registers held per item
  WsProducerLane<Traits> const my(c);
  int const lane = my.lane, first_chunk = my.first_chunk, q = my.q;
  int phys_next = my.chunk_page(0);
  if (my.n_steps == 0) feed();
  for (int it = 0; it < my.n_steps; ++it) {
    int const slot = ring.slot<kStages>(it);
    uint32_t const free_phase = ring.phase<kStages>(it) ^ 1u;
    int const phys = phys_next;
    phys_next = my.chunk_page(it + 1);
    auto const k = my.chunk(it, phys);
    bool const valid = k.valid;
    uint32_t const loads = k.loads, bad = k.bad;
    int const c1 = k.c1, c2 = k.c2;
    // one tile (K or V) of the step into its slot
    auto load = [&](char* dst, void const* map, uint64_t* full, uint64_t* empty) {
      mbarrier_wait(empty + slot, free_phase);
      if (bad) {  // rare: zero the warp's chunks of corrupt pages, all lanes together, before it arrives
        for (int l = 0; l < kPerWarp; ++l) {
          if (!(bad >> l & 1u)) continue;
          for (int col = 0; col < kHeadDim / kBoxCols; ++col) {
            int const base = (col * kBlockN + 16 * (first_chunk + l)) * kBoxCols * 2;
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
          tma_load_4d(dst + (col * kBlockN + 16 * q) * kBoxCols * 2, map, col * kBoxCols, c1, c2, phys,
                      full + slot);
        }
      }
    };
    load(reinterpret_cast<char*>(c.smem.k_tile(slot, 0)), my.k_map, bars.full_k, bars.empty_k);
    if (it == 0) feed();  // the item to the consumers once its first K is on its way
    load(reinterpret_cast<char*>(c.smem.v_tile(slot, 0)), my.v_map, bars.full_v, bars.empty_v);
  }
}

// fp8 caches (head dim 128): each producer warp TMA-loads its chunks of a step raw (one 128-column,
// 128-byte swizzled box per 16-key chunk: the decode path's tensor maps; kFp8Qk: K's straight into K's
// raw ring, which S reads, and the raw K stages and their mbarriers go unused) into raw stage n % kRawStages
// of its own (n: the CTA's step), up to two steps ahead of widening them into the Element ring slot
// once the consumers freed it. Raw 16-byte piece jp of chunk row r lies at piece jp ^ (r % 8); its 16
// columns are piece 2 (jp % 4) and the one after of the Element tile's 64-column block jp / 4, each
// at that piece ^ (r % 8) too (SmemLayoutKV). Chunks of corrupt pages are written as zeros. The warp
// then publishes its writes to the async proxy (wgmma) and arrives on the slot's full barrier.
template <class Traits, class Feed>
__device__ __forceinline__ void ws_produce_fp8(TileCtx<Traits> const& c, WsRing const ring, Feed const& feed) {
  constexpr int kHeadDim = Traits::kHeadDim, kBlockN = Traits::kBlockN, kStages = Traits::kStages;
  constexpr int kRaw = Traits::Smem::kRawStages, kPerWarp = WsProducerLane<Traits>::kPerWarp;
  constexpr int kRawChunkBytes = 16 * kHeadDim;  // K (or V) bytes of one raw chunk
  static_assert(kHeadDim == 128, "one 128-byte swizzled box per chunk");
  WsBarriers const bars(c.smem);
  WsProducerLane<Traits> const my(c);
  int const lane = my.lane, warp = my.warp, first_chunk = my.first_chunk, n_steps = my.n_steps;
  // step it's raw K and V chunks of this warp into its raw stage; loads / bad: the warp's chunks that
  // land / that lie in a corrupt page (bit l: chunk first_chunk + l)
  auto issue = [&](int it, int phys, uint32_t& loads, uint32_t& bad) {
    auto const k = my.chunk(it, phys);
    loads = k.loads;
    bad = k.bad;
    if (it >= n_steps) return;
    int const rs = int((ring.ring + uint32_t(it)) % kRaw);
    uint64_t* const k_bar = c.smem.ws_raw_bar(0, warp, rs);
    uint64_t* const v_bar = c.smem.ws_raw_bar(1, warp, rs);
    if (lane == 0) {
      if constexpr (!Traits::kFp8Qk) mbarrier_arrive_expect_tx(k_bar, __popc(loads) * kRawChunkBytes);
      mbarrier_arrive_expect_tx(v_bar, __popc(loads) * kRawChunkBytes);
    }
    __syncwarp();
    if (k.valid) {
      if constexpr (!Traits::kFp8Qk) tma_load_4d(c.smem.raw_k(rs, 16 * my.q), my.k_map, 0, k.c1, k.c2, phys, k_bar);
      tma_load_4d(c.smem.raw_v(rs, 16 * my.q), my.v_map, 0, k.c1, k.c2, phys, v_bar);
    }
    if constexpr (Traits::kFp8Qk) {
      // K straight into its ring slot once the consumers' S freed it (chunks of corrupt pages as zeros)
      constexpr int kKSlots = Traits::kKSlots;
      int const slot = ring.slot<kKSlots>(it);
      uint8_t* const dst = c.smem.raw_k(slot);
      mbarrier_wait(bars.empty_k + slot, ring.phase<kKSlots>(it) ^ 1u);
      if (bad) {  // rare
        for (int l = 0; l < kPerWarp; ++l) {
          if (!(bad >> l & 1u)) continue;
          for (int b = 16 * lane; b < kRawChunkBytes; b += 16 * 32) {
            *reinterpret_cast<uint4*>(dst + (first_chunk + l) * kRawChunkBytes + b) = make_uint4(0, 0, 0, 0);
          }
        }
        fence_proxy_async_smem();
        __syncwarp();
      }
      if (lane == 0) mbarrier_arrive_expect_tx(bars.full_k + slot, __popc(loads) * kRawChunkBytes);
      __syncwarp();
      if (k.valid) tma_load_4d(dst + 16 * my.q * kHeadDim, my.k_map, 0, k.c1, k.c2, phys, bars.full_k + slot);
    }
  };
  // step it's K or V from its raw stage into its ring slot, once the consumers freed the slot; the
  // caller then publishes it (publish: one fence for the tiles widened since the last one)
  auto widen = [&](int it, bool is_v, uint32_t loads, uint32_t bad) {
    uint32_t const n = ring.ring + uint32_t(it);
    int const rs = int(n % kRaw), slot = ring.slot<kStages>(it);
    uint8_t const* const raw = is_v ? c.smem.raw_v(rs) : c.smem.raw_k(rs);
    char* const dst = reinterpret_cast<char*>(is_v ? c.smem.v_tile(slot, 0) : c.smem.k_tile(slot, 0));
    mbarrier_wait(c.smem.ws_raw_bar(is_v, warp, rs), (n / kRaw) & 1u);
    mbarrier_wait((is_v ? bars.empty_v : bars.empty_k) + slot, ring.phase<kStages>(it) ^ 1u);
    // V rows past the request's end are written as zeros here (0 * NaN is not 0 in P V), chunks wholly
    // past it too, so the consumers clear no tail: rows [live, kBlockN) of the step (K keeps them: the
    // mask hides their scores)
    int const live = is_v ? c.w.k_len - (c.w.step_begin + it) * kBlockN : kBlockN;
    // A lane's pieces of a chunk: raw piece jp = lane % 8 of rows r = r0 + 4 j (r0 = lane / 8, j < 4),
    // each 16 fp8 values that become two 16-byte pieces of the fp16 tile. A row's pieces sit at piece
    // ^ (r % 8), and r % 8 = r0 ^ 4 (j % 2), so piece j of a chunk lies 512 j bytes past piece 0's
    // offset (raw and fp16 rows are 128 bytes), XOR 64 for odd j: three offsets made once per tile.
    constexpr int kPieces = 16 * 8 / 32, kChunkBytes = 16 * 128;
    int const r0 = lane / 8, jp = lane % 8, panel = (jp / 4) * kBlockN * 128 + r0 * 128;
    int const raw_at = r0 * 128 + ((jp ^ r0) << 4);
    uint8_t const* const raw_even = raw + raw_at;  // pieces at constant offsets from these two
    uint8_t const* const raw_odd = raw + (raw_at ^ 64);
    int const lo_at = panel + (((2 * (jp % 4)) ^ r0) << 4), hi_at = panel + (((2 * (jp % 4) + 1) ^ r0) << 4);
    CUTE_UNROLL
    for (int l = 0; l < kPerWarp; ++l) {
      int const chunk = first_chunk + l;
      bool const landed = loads >> l & 1u;
      // uniform: a chunk past the request's end is skipped (K) or written as zeros (V)
      if (!landed && !(bad >> l & 1u) && !is_v) continue;
      auto put = [&](int j, uint4 lo, uint4 hi) {
        char* const at = dst + chunk * kChunkBytes + 512 * j;
        *reinterpret_cast<uint4*>(at + (lo_at ^ (64 * (j % 2)))) = lo;
        *reinterpret_cast<uint4*>(at + (hi_at ^ (64 * (j % 2)))) = hi;
      };
      auto raw_piece = [&](int j) {
        return *reinterpret_cast<uint4 const*>((j % 2 ? raw_odd : raw_even) + chunk * kChunkBytes + 512 * j);
      };
      // the chunk's rows to widen (the rest are written as zeros): all 16 but in V's last chunk
      int const rows = !landed ? 0 : is_v ? min(16, live - 16 * chunk) : 16;
      if (rows <= 0) {  // a corrupt page's chunk, or V past the request's end
        CUTE_UNROLL
        for (int j = 0; j < kPieces; ++j) put(j, make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0));
        continue;
      }
      // every raw load of the chunk before any store: the stores may alias the loads as far as the
      // compiler knows, so loads placed after a store would wait for it (one piece at a time)
      auto widen_chunk = [&](auto whole) {  // whole: every row (a copy of its own, no predicates)
        uint4 x[kPieces];
        CUTE_UNROLL
        for (int j = 0; j < kPieces; ++j) x[j] = whole || r0 + 4 * j < rows ? raw_piece(j) : make_uint4(0, 0, 0, 0);
        CUTE_UNROLL
        for (int j = 0; j < kPieces; ++j) {
          uint4 lo, hi;  // to fp16 (Traits::MmaElement)
          widen_fp8x16_half<Traits::kFp8>(x[j], lo, hi);
          put(j, lo, hi);
        }
      };
      if (rows == 16) {  // uniform: all but V's last chunk
        widen_chunk(cute::true_type{});
      } else {
        widen_chunk(cute::false_type{});
      }
    }
  };
  // the tiles widened since the last call to the consumers: K of step k_it, V of step v_it (-1: none).
  // The fence orders the fp16 writes before wgmma reads them, and the raw reads before TMA refills.
  auto publish = [&](int k_it, int v_it) {
    fence_proxy_async_smem();
    __syncwarp();
    if (lane == 0) {
      if (k_it >= 0) mbarrier_arrive(bars.full_k + ring.slot<kStages>(k_it));
      if (v_it >= 0) mbarrier_arrive(bars.full_v + ring.slot<kStages>(v_it));
    }
  };
  // Masks of step it (bit l: chunk first_chunk + l lands / lies in a corrupt page) and of the next
  // steps; raw stage it % 2 is refilled with a later step once step it is out of it.
  uint32_t loads0, bad0, loads1, bad1;
  issue(0, my.chunk_page(0), loads0, bad0);
  if constexpr (Traits::kFp8Qk) {
    // V(it) widened while K(it + 1) and raw V(it + 1) are in flight; then K and raw V of step it + 2
    // (its raw V stage is V(it)'s, just freed; its K slot S(it + 2 - kKSlots)'s)
    issue(1, my.chunk_page(1), loads1, bad1);
    feed();
    int phys_next = my.chunk_page(2);
    for (int it = 0; it < n_steps; ++it) {
      widen(it, true, loads0, bad0);
      publish(-1, it);
      uint32_t loads2, bad2;
      issue(it + 2, phys_next, loads2, bad2);
      phys_next = my.chunk_page(it + 3);
      loads0 = loads1, bad0 = bad1;
      loads1 = loads2, bad1 = bad2;
    }
  } else if constexpr (!Traits::kKAhead) {  // K(it), V(it); raw(it + 1) in flight meanwhile
    feed();
    int phys_next = my.chunk_page(1);
    for (int it = 0; it < n_steps; ++it) {
      issue(it + 1, phys_next, loads1, bad1);
      phys_next = my.chunk_page(it + 2);
      widen(it, false, loads0, bad0);
      publish(it, -1);
      widen(it, true, loads0, bad0);
      publish(-1, it);
      loads0 = loads1, bad0 = bad1;
    }
  } else {
    // K a step ahead of V: the consumers wait for K(it) and V(it - 1) together, and free K(it)'s slot
    // after S(it) but V(it)'s only after P V(it), so K(it + 1) is widened before V(it), and the two are
    // published together (one fence); raw(it + 2) is issued once V(it) is out of its stage.
    issue(1, my.chunk_page(1), loads1, bad1);
    int phys_next = my.chunk_page(2);
    if (n_steps > 0) {
      widen(0, false, loads0, bad0);
      publish(0, -1);
    }
    feed();
    for (int it = 0; it < n_steps; ++it) {
      bool const k_next = it + 1 < n_steps;
      if (k_next) widen(it + 1, false, loads1, bad1);
      widen(it, true, loads0, bad0);
      publish(k_next ? it + 1 : -1, it);
      uint32_t loads2, bad2;
      issue(it + 2, phys_next, loads2, bad2);
      phys_next = my.chunk_page(it + 3);
      loads0 = loads1, bad0 = bad1;
      loads1 = loads2, bad1 = bad2;
    }
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

// Barrier over one consumer warpgroup (named barriers 5 and 6; ids as immediates: ptxas then
// reserves 7 barriers, not all 16).
__device__ __forceinline__ void ws_group_sync(int wg) {
  if (wg == 0) {
    asm volatile("bar.sync 5, 128;\n" ::: "memory");
  } else {
    asm volatile("bar.sync 6, 128;\n" ::: "memory");
  }
}

// Warpgroup wg's 64 rows of item w's Q tile, by cp.async (committed; ws_q_ready waits for them).
template <class Traits>
__device__ __forceinline__ void ws_load_q(AttnParams const& p, AttnWork const& w, char* smem, int wg) {
  load_q_rows<Traits>(p, w, AttnSmem<Traits>{smem}.q(), 64 * wg, 64, int(threadIdx.x) % 128, 128);
  cp_async_commit();
}

// Traits::kQFeed: a producer thread's copies of a consumer warpgroup's 64 Q rows of item w (the copies
// load_q_rows makes, rows past the request zero-filled). Where the producer's threads tile the rows'
// 16-byte pieces evenly (head dims 64, 128, 256), each thread keeps one column piece and walks down
// kStep rows at a time with additions (its token t and head g carried in the row's packing t * group +
// g), so that only the constructor divides: it runs before the warpgroup's rows are free, and copy()
// after, on the way from the consumers' last S to their next. Elsewhere (d192) load_q_rows.
template <class Traits>
struct WsQFeedRows {
  using Element = typename Traits::Element;
  static constexpr int kChunks = Traits::kHeadDim / 8;  // 16-byte pieces of a row
  static constexpr bool kWalk =
      Traits::kProducerThreads % kChunks == 0 && 64 % (Traits::kProducerThreads / kChunks) == 0;
  static constexpr int kStep = kWalk ? Traits::kProducerThreads / kChunks : 1;  // rows between a thread's pieces
  static_assert(Traits::kBlockKSmem == 64, "Q in 64-column panels of 128-byte rows");
  AttnParams const& p;
  AttnWork const& w;
  int const tid, wg;
  int t, g;                 // the token and head of the thread's first row
  Element const* src;       // its first piece in q
  int64_t step, carry;      // src's move kStep rows on, and more when the head wraps to the next token
  int dt, dg;               // kStep rows as tokens and heads

  __device__ __forceinline__ WsQFeedRows(AttnParams const& p_, AttnWork const& w_, int tid_, int wg_)
      : p(p_), w(w_), tid(tid_), wg(wg_) {
    if constexpr (kWalk) {
      int const R = w.row0 + 64 * wg + tid / kChunks;
      t = R / p.group;
      g = R - t * p.group;
      dt = kStep / p.group;
      dg = kStep - dt * p.group;
      step = int64_t(dt) * p.q_row_stride + int64_t(dg) * p.q_head_stride;
      carry = p.q_row_stride - int64_t(p.group) * p.q_head_stride;
      src = static_cast<Element const*>(p.q) + (int64_t(w.q_start + t) * p.q_row_stride +
                                                int64_t(w.kv_head * p.group + g) * p.q_head_stride + tid % kChunks * 8);
    }
  }
  __device__ __forceinline__ void copy(Element* q_smem) {
    if constexpr (kWalk) {
      using namespace cute;
      Tensor sQ = make_tensor(make_smem_ptr(q_smem), typename Traits::SmemLayoutQ{});
      int const col = tid % kChunks * 8, row = 64 * wg + tid / kChunks;
      bool const col_ok = col < p.head_size;
      Element* const first = &sQ(row, col);
      CUTE_UNROLL
      for (int k = 0; k < 64 / kStep; ++k) {
        bool const ok = col_ok && t < w.q_len;
        // a step of whole 8-row swizzle atoms keeps the piece's place in its row: 128-byte rows
        Element* const dst = kStep % 8 == 0 ? first + kStep * k * 64 : &sQ(row + kStep * k, col);
        cp_async_16(dst, ok ? src : p.q, ok);
        t += dt;
        g += dg;
        src += step;
        if (g >= p.group) {
          g -= p.group;
          ++t;
          src += carry;
        }
      }
    } else {
      load_q_rows<Traits>(p, w, q_smem, 64 * wg, 64, tid, Traits::kProducerThreads);
    }
  }
};

// Traits::kQFeed: the producer hands item number n of this CTA, work item `item` of the grid (or, done,
// the end: a work item with b = -1), to the consumers, by every producer thread. For each consumer
// warpgroup, once its last S of the item before in Q tile n % kQTiles is done (the tile's empty
// mbarrier): the work item into the warpgroup's slot n % kWorkSlots (ws_work), published by the first
// thread's arrival on the tile's full mbarrier, and its 64 Q rows by cp.async (WsQFeedRows), each
// thread's copies arriving there as they land (so the full mbarrier expects kProducerThreads + 1
// arrivals). The work item is found again here, before the
// wait (its fields held through the producer's step loop would take registers the producer does not
// have).
template <class Traits, class Features>
__device__ __forceinline__ void ws_feed_q(AttnParams const& p, int item, AttnSmem<Traits> const& sm, uint32_t n,
                                          bool done) {
  int const tid = int(threadIdx.x) - Traits::kThreads;
  int const t = int(n % uint32_t(Traits::kQTiles));  // item n's Q tile, and its use of the tile
  uint32_t const use = n / uint32_t(Traits::kQTiles);
  AttnSmem<Traits> const tile_sm{sm.base, t};
  // warpgroup wg's rows of Q tile t once read by the item before in the tile: `put` writes the item's
  // work slot (the first thread), `copy` makes this thread's copies of its Q rows
  auto hand_over = [&](int wg, auto const& put, auto const& copy) {
    mbarrier_wait(sm.ws_q_empty(wg, t), (use & 1u) ^ 1u);
    if (tid == 0) {
      put(sm.ws_work(wg, int(n % uint32_t(Traits::kWorkSlots))));
      mbarrier_arrive(sm.ws_q_full(wg, t));
    }
    copy();
    cp_async_arrive_on(sm.ws_q_full(wg, t));
  };
  if (done) {
    for (int wg = 0; wg < Traits::kThreads / 128; ++wg) {
      hand_over(wg, [](AttnWork* slot) { slot->b = -1; }, [] {});
    }
    return;
  }
  AttnWork w;
  schedule<Traits, Features>(p, ws_slot(p, item), w);
  for (int wg = 0; wg < Traits::kThreads / 128; ++wg) {
    WsQFeedRows<Traits> rows(p, w, tid, wg);
    hand_over(wg, [&](AttnWork* slot) { *slot = w; }, [&] { rows.copy(tile_sm.q()); });
  }
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

// kPingPong: the two warpgroups take turns on the tensor cores, one issuing a step's MMAs while the
// other runs its softmax. Warpgroup w waits on named barrier 2 + w before it issues and then lets the
// other one go (bar.arrive). The turns run on across items (both warpgroups issue the same batches):
// warpgroup 1 lets warpgroup 0 start once (start), and warpgroup 0 takes that last arrival after its
// last item (finish), so every barrier is balanced.
template <bool kPingPong>
struct WsPingPong {
  int wg;
  __device__ __forceinline__ void my_turn() const {
    if constexpr (kPingPong) {
      if (wg == 0) {
        asm volatile("bar.sync 2, 256;\n" ::: "memory");
      } else {
        asm volatile("bar.sync 3, 256;\n" ::: "memory");
      }
    }
  }
  __device__ __forceinline__ void your_turn() const {
    if constexpr (kPingPong) {
      if (wg == 0) {
        asm volatile("bar.arrive 3, 256;\n" ::: "memory");
      } else {
        asm volatile("bar.arrive 2, 256;\n" ::: "memory");
      }
    }
  }
  __device__ __forceinline__ void start() const {
    if (wg == 1) your_turn();
  }
  __device__ __forceinline__ void finish() const {
    if (wg == 0) my_turn();
  }
};

// Traits::kOBulk: this warp's 16 rows of O (times wgt[h] for the thread's row h) into its shared-memory
// buffer as Element, with stmatrix (entry 4 n + 2 h + j of the accumulator is column 8 n + 2 (lane % 4)
// + j of the warp's row lane / 4 + 8 h: matrix (h, n) of 8 x 8, four per stmatrix), then each of lanes
// 0 .. 15 stores its row of the request (the tile's rows past it are skipped) with one bulk copy of
// head_size columns. The buffer is written again only once the warp's copies of the item before have
// read it; ws_consume_* waits for the last item's before the CTA leaves.
template <class Traits, class AccO>
__device__ __forceinline__ void ws_store_rows_bulk(TileCtx<Traits> const& c, AccO const& acc_o, float const (&wgt)[2]) {
  using Element = typename Traits::Element;
  constexpr int kPitch = Traits::kOPitch;
  AttnParams const& p = c.p;
  AttnWork const& w = c.w;
  int const lane = c.tidx % 32, warp = c.tidx / 32;
  char* const buf = c.smem.ws_o(warp);
  if (lane < 16) bulk_wait_read();
  __syncwarp();
  auto pair = [&](int i, int h) {  // entries i, i + 1 as two Elements in 32 bits
    Element const e[2] = {Element(acc_o(i) * wgt[h]), Element(acc_o(i + 1) * wgt[h])};
    return *reinterpret_cast<uint32_t const*>(e);
  };
  // the lane's row address for each stmatrix: matrix k = lane / 8 is (h = k % 2, n + k / 2), row lane % 8
  char* const row = buf + (lane % 8 + 8 * (lane / 8 % 2)) * kPitch + lane / 16 * 16;
  CUTE_UNROLL
  for (int n = 0; n < Traits::kHeadDim / 8; n += 2) {
    stmatrix_x4(row + n * 16, pair(4 * n, 0), pair(4 * n + 2, 1), pair(4 * n + 4, 0), pair(4 * n + 6, 1));
  }
  fence_proxy_async_smem();  // the rows to the bulk-copy engine (the async proxy)
  __syncwarp();
  if (lane < 16) {
    int const R = w.row0 + 64 * (warp / 4) + 16 * (warp % 4) + lane, t = R / p.group, g = R - t * p.group;
    if (t < w.q_len) {
      int64_t const at = int64_t(w.q_start + t) * p.o_row_stride + int64_t(w.kv_head * p.group + g) * p.o_head_stride;
      bulk_store(static_cast<Element*>(p.out) + at, buf + lane * kPitch, p.head_size * int(sizeof(Element)));
    }
    bulk_commit();
  }
}

// The epilogue, straight from the accumulators: each thread's two rows (r and r + 8 of its warp's
// 16) normalised by their own (m, l) — one warpgroup holds a row's every key, so there is nothing to
// merge — and written as pairs of columns: O (times v_scale) and the LSE, or a split's fp32 partials,
// after which the last split of the tile to arrive merges them (split_combine.cuh).
template <class Traits, class Features, class AccO, class Softmax, class TensorC>
__device__ __forceinline__ void ws_store_tile(TileCtx<Traits> const& c, AccO const& acc_o, Softmax const& softmax,
                                              TensorC const& tOcO) {
  using namespace cute;
  using Element = typename Traits::Element;
  static_assert(Traits::kRows == 2, "a thread holds two rows of the tile");
  AttnParams const& p = c.p;
  AttnWork const& w = c.w;
  bool const split_out = p.num_splits > 1;
  int64_t row_at[2];  // element offset of each row's column 0 in out (or o_accum); -1 past the request
  float wgt[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    int const R = w.row0 + int(get<0>(tOcO(2 * h))), t = R / p.group, g = R - t * p.group;
    int const token = w.q_start + t, head = w.kv_head * p.group + g;
    SoftmaxPartial const st = softmax.row_state(h);
    SoftmaxPartial total = st;
    // a sink is one more logit with no value row: it joins the final (m, l) only (the merge adds it
    // when the KV range is split)
    if constexpr (Features::kSinks) {
      if (!split_out && t < w.q_len) total = softmax_combine(total, {p.sinks[head] * kLog2e, 1.f});
    }
    wgt[h] = softmax_merge_weight<false>(st, total) * c.v_scale;
    row_at[h] = t >= w.q_len ? -1
                : !split_out ? int64_t(token) * p.o_row_stride + int64_t(head) * p.o_head_stride
                             : ((int64_t(w.split) * p.total_q + token) * p.num_q_heads + head) * Traits::kHeadDim;
    if (t < w.q_len && c.tidx % 4 == 0) {  // the quad's first lane
      if (!split_out) {
        if (p.lse != nullptr) p.lse[int64_t(head) * p.total_q + token] = total.lse();
      } else {
        p.lse_accum[(int64_t(w.split) * p.num_q_heads + head) * p.total_q + token] = total.lse();
      }
    }
  }
  if constexpr (Traits::kOBulk) {
    // 1-D bulk copies need 16-byte aligned rows and lengths (the host's checks of out and of the head
    // size make them so; a guard, uniform over the launch)
    uint64_t const misaligned = reinterpret_cast<uint64_t>(p.out) | uint64_t(p.o_row_stride) * 2 |
                                uint64_t(p.o_head_stride) * 2 | uint64_t(p.head_size) * 2;
    if (!split_out && misaligned % 16 == 0) {
      ws_store_rows_bulk<Traits>(c, acc_o, wgt);
      return;
    }
  }
  CUTE_UNROLL
  for (int i = 0; i < size(acc_o); i += 2) {  // entries i, i + 1: columns col, col + 1 of row h
    int const h = (i / 2) % 2, col = int(get<1>(tOcO(i)));
    if (row_at[h] < 0 || col >= p.head_size) continue;
    float const x = acc_o(i) * wgt[h], y = acc_o(i + 1) * wgt[h];
    if (!split_out) {
      Element pair[2] = {Element(x), Element(y)};
      *reinterpret_cast<uint32_t*>(static_cast<Element*>(p.out) + row_at[h] + col) =
          *reinterpret_cast<uint32_t const*>(pair);
    } else {
      *reinterpret_cast<float2*>(p.o_accum + row_at[h] + col) = make_float2(x, y);
    }
  }
  if (split_out) merge_splits_if_last<Traits, Features>(c);
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
  // null where it cannot start now (no item: the end; or no steps).
  __device__ __forceinline__ Element const* next() const {
    uint32_t const m = n + 1;
    int const t = int(m % 2u);
    mbarrier_wait(sm.ws_q_full(wg, t), (m / 2u) & 1u);
    AttnWork const& w = *sm.ws_work(wg, int(m % uint32_t(Traits::kWorkSlots)));
    if (w.b < 0 || w.step_end == w.step_begin) return nullptr;
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
  // Q's descriptors (one per 16-column k-step: = thr_qk.partition_fragment_A(Q tile)). Loop-invariant, so
  // the compiler would hold them all across the step loop (16 x 64 bits at d256, spilled with the O
  // accumulator); with PAGEDATTN_WS_Q_LATE (tile field kWsQLate: d256) each S makes them afresh from an
  // address the compiler cannot see through (an add and a move to a uniform register per k-step).
  auto tSrQ = [&] {
    Element const* q = reinterpret_cast<Element const*>(c.smem.q());
#if PAGEDATTN_WS_Q_LATE
    asm volatile("" : "+l"(q));
#endif
    return Tiles::frag_q(q, c.tidx);
  };
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
    if (c.tidx % 32 == 0) mbarrier_arrive(empty);
  };
  auto release_k = [&](int it) { release_slot(bars.empty_k + ring.slot<kKSlots>(it)); };
  auto release_v = [&](int it) { release_slot(bars.empty_v + ring.slot<kStages>(it)); };
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
      Tensor q = tSrQ();
      wgmma_gemm<true, false>(mma_qk, q, tSrK(it), acc_s);
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
    if constexpr (Chain::kOn) {
      // the next item's first S (its K in the ring's next slot) and this item's last P V in one turn
      Element const* const q_next = chain.next();
      if (q_next != nullptr) wait_k(n_steps);
      wait_v(n_steps - 1);
      pp.my_turn();
      if (q_next != nullptr) {
        Tensor q = Tiles::frag_q(q_next, c.tidx);
        wgmma_gemm<true, false>(mma_qk, q, tSrK(n_steps), acc_s);
      }
      if (!fixed_max) softmax.rescale(o_rows, alpha);
      wgmma_gemm<false, false>(mma_pv, tOrP, tOrVt(n_steps - 1), acc_o);
      pp.your_turn();
      wgmma_wait<0>(acc_o);
      warpgroup_fence_operand(acc_s);
      warpgroup_fence_operand(tOrP);
      release_v(n_steps - 1);
      if (q_next != nullptr) release_k(n_steps);
      chain.s0_ready = q_next != nullptr;
    } else {
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

// The next work item from `item` on (stepping gridDim.x) that has a tile: into w, item past it.
template <class Traits, class Features>
__device__ __forceinline__ bool ws_next_item(AttnParams const& p, int total, int& item, AttnWork& w) {
  while (item < total) {
    bool const has_tile = schedule<Traits, Features>(p, ws_slot(p, item), w);
    item += gridDim.x;
    if (has_tile) return true;
  }
  return false;
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
  int item = blockIdx.x;  // the next item to look at
  int parity = 0;
  bool more;
  {
    AttnWork first;
    more = ws_next_item<Traits, Features>(p, total, item, first);
    if (more) {
      ws_load_q<Traits>(p, first, sm.base, wg);
      if (leader) *sm.ws_work(wg, 0) = first;
    }
  }
  while (more) {
    float const q_unscale = ws_q_ready(sm, wg);
    AttnWork const& w = *sm.ws_work(wg, parity);
    more = false;
    {
      TileCtx<Traits> const c(p, w, sm.base);
      WsNoChain one_by_one;
      ws_consume<Traits, Features>(c, ring, pp, q_unscale, [&] {
        AttnWork next;
        more = ws_next_item<Traits, Features>(p, total, item, next);
        if (more) {
          ws_load_q<Traits>(p, next, sm.base, wg);
          if (leader) *sm.ws_work(wg, parity ^ 1) = next;
        }
      }, one_by_one);
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
    AttnSmem<Traits> const item_sm{sm.base, t};
    float const q_unscale = ws_q_ready(item_sm, wg);
    if constexpr (Traits::kChain) chain.n = n;
    {
      TileCtx<Traits> const c(p, w, sm.base, t);
      ws_consume<Traits, Features>(c, ring, pp, q_unscale, [&] {
        __syncwarp();
        if (threadIdx.x % 32 == 0) mbarrier_arrive(sm.ws_q_empty(wg, t));
      }, chain);
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
      mbarrier_init(bars.empty_k + s, Traits::kThreads / 32);
      mbarrier_init(bars.empty_v + s, Traits::kThreads / 32);
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
  int const total = p.num_seqs * p.num_kv_heads * p.grid_tiles * p.num_splits;
  ws_rows_past_grid<Traits, Features>(p, total);  // its __syncthreads_or also publishes the barriers' init
  if (int(threadIdx.x) >= Traits::kThreads) {  // the producer warpgroup
    regs_decrease<Regs::kProducerRegs>();
    static_assert(Traits::kProducerThreads == 32 * kWsProducerWarps, "the producer warpgroup's warps");
    WsRing ring{0};
    int item = blockIdx.x;
    AttnWork w;
    uint32_t n = 0;  // the CTA's items so far
    while (ws_next_item<Traits, Features>(p, total, item, w)) {
      TileCtx<Traits> const c(p, w, smem);
      int const found = item - int(gridDim.x);  // ws_next_item steps past it
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
}

}  // namespace pagedattn
