// The TMA K/V loader of decode (Traits::kTma: paged caches whose block size is a multiple of 16),
// a loader policy of the SM80 mainloop (mainloop_sm80.cuh). Each warp is its own warp group and
// streams its sub-tile of every step through a ring of kStages slots, with no CTA-wide barrier.
//
// A sub-tile is kBlockN / 16 chunks of 16 keys, each inside one cache page; lane q < kChunks copies
// chunk q into the warp's ring slot. Pages come from a window of block-table entries: one warp-wide
// load covers the next kWindow issues (lane L: chunk L % kChunks of issue L / kChunks) and is made a
// whole window before it is needed, so the table never stalls a copy, even with one warp per SM
// sub-partition (B=1 decode). Columns >= D arrive as zeros (the tensor map's first dimension is D).
// A chunk in a page outside [0, num_blocks) is zero-filled instead; chunks past the end are not
// loaded (clear_tail zeroes their V rows once the slot has landed). fp8 caches land raw: widened by
// the mainloop, or read in registers (Traits::kFp8Regs, attn_fp8_regs.cuh).
//
// Column groups (Traits::kWarpsD > 1, head dims above 256): the kWarpsD warps of a key group share
// its ring. Column group 0 fills it; every warp waits on the slot's mbarrier and clears its own
// columns' tail rows, then the group's warps meet at a named barrier, after which the slot of the
// previous step is free for everyone and column group 0 issues the next one.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/async_copy.cuh"
#include "pagedattn/attn_tile.cuh"
#include "pagedattn/tma_copy.cuh"

namespace pagedattn {

template <class Traits>
struct TmaKVLoader {
  static constexpr int kHeadDim = Traits::kHeadDim, kBlockN = Traits::kBlockN, kStages = Traits::kStages;
  static constexpr int kCacheBytes = Traits::kCacheBytes;
  static constexpr int kChunks = kBlockN / 16;
  static_assert(kBlockN % 16 == 0 && kChunks <= 32, "TMA sub-tiles are 16-key chunks");
  // TMA box: kBoxCols x 16 keys; 128-byte swizzled except fp8 rows not a multiple of 128 bytes (16-bit
  // head dims 96 and 80: the 32- and 16-column panels of Traits::kBlockKSmem, 64- and 32-byte swizzled)
  static constexpr int kBoxCols = Traits::kFp8Regs ? 128 : (Traits::kIsFp8 ? kHeadDim : Traits::kBlockKSmem);
  static constexpr int kChunkBytes = 16 * kHeadDim * kCacheBytes;  // K (or V) bytes of one chunk
  static constexpr int kWindow = 32 / kChunks;                     // issues per page window
  static_assert(32 % kChunks == 0, "a page window is one entry per lane");
  static constexpr int kWarpsD = Traits::kWarpsD;

  TileCtx<Traits> const& c;
  int n_steps;
  void const* k_map;
  void const* v_map;
  uint64_t* bars;         // this warp's ring
  int win_cur, win_next;  // page windows: lane L holds the page of chunk L % kChunks of issue (start + L / kChunks)

  __device__ __forceinline__ TmaKVLoader(TileCtx<Traits> const& ctx, int steps)
      : c(ctx), n_steps(steps), k_map(ctx.p.tma_desc), v_map(static_cast<char const*>(ctx.p.tma_desc) + 128),
        bars(ctx.smem.ring_bars(ctx.group_idx)), win_cur(0), win_next(0) {}

  // Whether this warp fills its key group's ring (column group 0; every warp without column groups).
  __device__ __forceinline__ bool filler() const { return kWarpsD == 1 || c.d_idx == 0; }

  __device__ __forceinline__ int key0(int step) const { return step * Traits::kStageKeys + c.group_idx * kBlockN; }

  // This warp's K and V destination of ring slot `slot`.
  __device__ __forceinline__ void slot_tiles(int slot, char*& k_dst, char*& v_dst) const {
    if constexpr (Traits::kIsFp8) {
      k_dst = reinterpret_cast<char*>(c.smem.raw_k(slot, c.group_idx * kBlockN));
      v_dst = reinterpret_cast<char*>(c.smem.raw_v(slot, c.group_idx * kBlockN));
    } else {
      k_dst = reinterpret_cast<char*>(c.smem.k_tile(slot, c.group_idx));
      v_dst = reinterpret_cast<char*>(c.smem.v_tile(slot, c.group_idx));
    }
  }

  __device__ __forceinline__ void issue_step(int step, int slot, int phys) const {
    int const gtid = c.gtid;
    int const j = key0(step) + 16 * gtid;  // this lane's chunk
    bool const mine = gtid < kChunks && j < c.w.k_len;
    bool const valid = mine && phys >= 0 && phys < c.p.num_blocks;
    uint32_t const loads = __ballot_sync(0xffffffffu, valid);
    uint32_t const bad = __ballot_sync(0xffffffffu, mine && !valid);
    char *k_dst, *v_dst;
    slot_tiles(slot, k_dst, v_dst);
    if (gtid == 0) mbarrier_arrive_expect_tx(bars + slot, __popc(loads) * 2 * kChunkBytes);
    __syncwarp();
    if (valid) {
      AttnParams const& p = c.p;
      int const off = c.kv.offset(j);
      int const c1 = p.tma_row_dim == 1 ? off : c.w.kv_head;
      int const c2 = p.tma_row_dim == 1 ? c.w.kv_head : off;
      CUTE_UNROLL
      for (int col = 0; col < kHeadDim / kBoxCols; ++col) {
        int const dst = (col * kBlockN + 16 * gtid) * kBoxCols * kCacheBytes;
#if PAGEDATTN_KV_EVICT_FIRST
        uint64_t const policy = l2_evict_first_policy();
        tma_load_4d_hint(k_dst + dst, k_map, col * kBoxCols, c1, c2, phys, bars + slot, policy);
        tma_load_4d_hint(v_dst + dst, v_map, col * kBoxCols, c1, c2, phys, bars + slot, policy);
#else
        tma_load_4d(k_dst + dst, k_map, col * kBoxCols, c1, c2, phys, bars + slot);
        tma_load_4d(v_dst + dst, v_map, col * kBoxCols, c1, c2, phys, bars + slot);
#endif
      }
    }
    if (bad) {  // rare: zero-fill the chunks of corrupt pages, all lanes together
      for (int q = 0; q < kChunks; ++q) {
        if (!(bad >> q & 1u)) continue;
        for (int col = 0; col < kHeadDim / kBoxCols; ++col) {
          int const base = (col * kBlockN + 16 * q) * kBoxCols * kCacheBytes;
          for (int b = 16 * gtid; b < 16 * kBoxCols * kCacheBytes; b += 16 * 32) {
            *reinterpret_cast<uint4*>(k_dst + base + b) = make_uint4(0, 0, 0, 0);
            *reinterpret_cast<uint4*>(v_dst + base + b) = make_uint4(0, 0, 0, 0);
          }
        }
      }
      fence_proxy_async_smem();  // before a later TMA refills the slot
    }
  }

  // V rows of a landed sub-tile at or past k_len (the page's unused slots) are zeroed: P is 0 there,
  // but 0 * NaN is not. Each column group clears the columns it reads.
  __device__ __forceinline__ void clear_tail(int slot, int k0) const {
    int const first = c.w.k_len - k0;
    if (first <= 0 || first >= kBlockN) return;  // not loaded at all, or no row past the end
    char *k_dst, *v_dst;
    slot_tiles(slot, k_dst, v_dst);
    constexpr int kRowChunks = kHeadDim * kCacheBytes / 16 / kWarpsD;  // 16-byte chunks of a group's row
    for (int i = c.gtid; i < (kBlockN - first) * kRowChunks; i += 32) {
      int const r = first + i / kRowChunks, chunk = c.d_idx * kRowChunks + i % kRowChunks;
      int b;
      if constexpr (Traits::kIsFp8) {  // row r of each kBoxCols-column block (swizzling stays inside a row)
        b = ((chunk * 16) / kBoxCols * kBlockN + r) * kBoxCols + (chunk * 16) % kBoxCols;
      } else {
        b = int(typename Traits::SmemLayoutKV{}(r, chunk * 8)) * 2;
      }
      *reinterpret_cast<uint4*>(v_dst + b) = make_uint4(0, 0, 0, 0);
    }
    fence_proxy_async_smem();  // before a later TMA refills the slot
  }

  __device__ __forceinline__ int fetch_window(int i0) const {
    int const i = i0 + c.gtid / kChunks;
    int const j = key0(c.w.step_begin + i) + 16 * (c.gtid % kChunks);
    return i < n_steps && j < c.w.k_len ? c.kv.page(j) : 0;
  }

  // The i-th sub-tile of this warp's range, into slot i % kStages.
  __device__ __forceinline__ void issue(int i) {
    if (!filler()) return;
    if (i % kWindow == 0 && i > 0) {
      win_cur = win_next;
      win_next = fetch_window(i + kWindow);
    }
    int const phys = __shfl_sync(0xffffffffu, win_cur, (i % kWindow) * kChunks + c.gtid % kChunks);
    issue_step(c.w.step_begin + i, i % kStages, phys);
  }

  // Barriers, the first page windows and kStages - 1 sub-tiles; then waits for the Q tile (the only
  // CTA-wide barrier before the epilogue).
  __device__ __forceinline__ void prologue() {
    if (filler()) {
      if (c.gtid == 0) {
        tma_prefetch_map(k_map);  // in flight with the page-window loads below
        tma_prefetch_map(v_map);
        for (int s = 0; s < kStages; ++s) mbarrier_init(bars + s, 1);
        mbarrier_init_fence();
      }
      __syncwarp();
      win_cur = fetch_window(0);
      win_next = fetch_window(kWindow);
      for (int s = 0; s < kStages - 1 && s < n_steps; ++s) issue(s);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
  }

  // Before step `it`: its slot landed (tail rows cleared) and slot it-1 is free; issue kStages - 1 ahead.
  __device__ __forceinline__ void wait(int it) {
    int const slot = it % kStages;
    mbarrier_wait(bars + slot, uint32_t(it / kStages) & 1u);
    clear_tail(slot, key0(c.w.step_begin + it));
    if constexpr (kWarpsD == 1) {
      __syncwarp();  // zero-filled rows of every lane are visible; slot it-1 is free
    } else {  // the same across the key group's warps (named barrier 1 + group, as group_sync)
      asm volatile("bar.sync %0, %1;\n" ::"r"(1 + c.group_idx), "n"(32 * kWarpsD) : "memory");
    }
    int const ahead = it + kStages - 1;
    if (ahead < n_steps) issue(ahead);
  }
};

}  // namespace pagedattn
