// The warp-specialised prefill's producer warpgroup (mainloop_ws.cuh): the TMA copies of each work
// item's K and V into the rings (16-bit caches: ws_produce, with Traits::kPair half of them multicast
// into both CTAs of a cluster; fp8 caches, widened to fp16: ws_produce_fp8), and with Traits::kQFeed
// the hand-over of each item and its Q rows to the consumers (ws_feed_q).
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/async_copy.cuh"
#include "pagedattn/attn_tile.cuh"
#include "pagedattn/mainloop_sm80.cuh"
#include "pagedattn/numeric.cuh"
#include "pagedattn/tile_scheduler.cuh"
#include "pagedattn/tma_copy.cuh"
#include "pagedattn/ws_pipeline.cuh"

namespace pagedattn {

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
  // a box: 16 rows of one swizzle panel (64 columns, 128-byte swizzle; at head dims 96 and 80, 32 or 16
  // columns and the 64- or 32-byte swizzle: the tensor maps of tma.py)
  constexpr int kBoxCols = Traits::kBlockKSmem, kPerWarp = WsProducerLane<Traits>::kPerWarp;
  constexpr int kChunkBytes = 16 * kHeadDim * 2;  // K (or V) bytes of one chunk
  constexpr int kCols = kHeadDim / kBoxCols;  // boxes per chunk
  WsBarriers const bars(c.smem);  // from the shared window's base: constants, not registers held per item
  WsProducerLane<Traits> const my(c);
  int const lane = my.lane, first_chunk = my.first_chunk, q = my.q;
  // kPair: this CTA's boxes of a step, the half with (chunk * kCols + column) % 2 == its cluster rank
  int const rank = Traits::kPair ? int(cluster_rank()) : 0;
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
      if constexpr (Traits::kPair) {
        mbarrier_wait<true>(empty + slot, free_phase);  // both CTAs' consumers handed it back
      } else {
        mbarrier_wait(empty + slot, free_phase);
      }
      if (bad) {  // rare: zero the warp's chunks of corrupt pages, all lanes together, before it arrives
        for (int l = 0; l < kPerWarp; ++l) {
          if (!(bad >> l & 1u)) continue;
          for (int col = 0; col < kCols; ++col) {
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
        for (int col = 0; col < kCols; ++col) {
          char* const at = dst + (col * kBlockN + 16 * q) * kBoxCols * 2;
          if constexpr (Traits::kPair) {  // into both CTAs' slots, counted on both full barriers
            if ((q * kCols + col) % 2 == rank) {
              tma_load_4d_multicast(at, map, col * kBoxCols, c1, c2, phys, full + slot, uint16_t(0b11));
            }
          } else {
            tma_load_4d(at, map, col * kBoxCols, c1, c2, phys, full + slot);
          }
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
        // a step of whole 8-row swizzle atoms keeps the piece's place in its row (rows of a panel:
        // kBlockKSmem elements)
        Element* const dst = kStep % 8 == 0 ? first + kStep * k * Traits::kBlockKSmem : &sQ(row + kStep * k, col);
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

// Traits::kQFeed: the producer hands item number n of this CTA, work item (kPair: pair) `item` of the
// grid (or, done, the end: a work item with b = -1), to the consumers, by every producer thread. For
// each consumer warpgroup, once its last S of the item before in Q tile n % kQTiles is done (the tile's
// empty mbarrier): the work item into the warpgroup's slot n % kWorkSlots (ws_work), published by the
// first thread's arrival on the tile's full mbarrier, and its 64 Q rows by cp.async (WsQFeedRows), each
// thread's copies arriving there as they land (so the full mbarrier expects kProducerThreads + 1
// arrivals; an item of the other CTA's alone, kPair, has no rows). The work item is found again here,
// before the wait (its fields held through the producer's step loop would take registers the producer
// does not have).
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
  ws_work_at<Traits, Features>(p, ws_items(p), item, w);
  if (Traits::kPair && ws_idle(w)) {  // no tile of this CTA's: the item alone, for its steps
    for (int wg = 0; wg < Traits::kThreads / 128; ++wg) hand_over(wg, [&](AttnWork* slot) { *slot = w; }, [] {});
    return;
  }
  for (int wg = 0; wg < Traits::kThreads / 128; ++wg) {
    WsQFeedRows<Traits> rows(p, w, tid, wg);
    hand_over(wg, [&](AttnWork* slot) { *slot = w; }, [&] { rows.copy(tile_sm.q()); });
  }
}

}  // namespace pagedattn
