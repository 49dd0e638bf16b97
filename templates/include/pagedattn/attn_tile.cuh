// What every stage of one tile's work (loader, mainloop, epilogue) shares: the parameters, the work
// item, shared memory, the request's K/V view, this thread's place, and the tile's softmax and
// output scales.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/attn_params.cuh"
#include "pagedattn/attn_smem.cuh"
#include "pagedattn/paged_kv.cuh"
#include "pagedattn/tile_scheduler.cuh"

namespace pagedattn {

template <class Traits>
struct TileCtx {
  AttnParams const& p;
  AttnWork const& w;
  AttnSmem<Traits> smem;
  PagedKV kv;
  int tidx;       // thread in the CTA
  int group_idx;  // warp group: which KV sub-tile of each stage it takes
  int d_idx;      // column group (kWarpsD > 1): which kHeadDimO columns of O it accumulates
  int gtid;       // thread in the warp group (the MMA)
  float scale_log2;  // softmax scale * log2(e), times k_descale for fp8 caches
  float v_scale;     // v_descale for fp8 caches, else 1

  // q_tile: prefill_ws with two Q tiles (AttnTraits::kChain), the item's
  __device__ __forceinline__ TileCtx(AttnParams const& p_, AttnWork const& w_, char* smem_base, int q_tile = 0)
      : p(p_), w(w_), smem{smem_base, q_tile}, kv(request_kv(p_, w_)), tidx(int(threadIdx.x)),
        group_idx(int(threadIdx.x) / Traits::kGroupThreads % Traits::kWarpsN),
        d_idx(int(threadIdx.x) / (Traits::kGroupThreads * Traits::kWarpsN)),
        gtid(int(threadIdx.x) % Traits::kGroupThreads),
        scale_log2(p_.scale_log2), v_scale(1.f) {
    if constexpr (Traits::kIsFp8) {
      int const di = w.b * p.descale_batch_stride + w.kv_head * p.descale_head_stride;
      scale_log2 *= p.k_descale[di];
      v_scale = p.v_descale[di];
    }
  }

  // The request's K/V history for this KV head (byte strides; see PagedKV).
  static __device__ __forceinline__ PagedKV request_kv(AttnParams const& p, AttnWork const& w) {
    int64_t const kb = Traits::kCacheBytes;
    return PagedKV{static_cast<char const*>(p.k) + w.kv_head * p.k_head_stride * kb,
                   static_cast<char const*>(p.v) + w.kv_head * p.v_head_stride * kb,
                   p.block_table != nullptr ? p.block_table + int64_t(w.b) * p.bt_stride : nullptr,
                   p.k_block_stride * kb, p.k_row_stride * kb, p.v_block_stride * kb, p.v_row_stride * kb,
                   p.block_size, p.block_shift, p.num_blocks, int64_t(w.k_start)};
  }
};

// Barrier over the threads that compute the tile (Traits::kThreads): the whole CTA, or the consumer
// warpgroups of the warp-specialised prefill (named barrier 1: its producer warpgroup runs ahead).
template <class Traits>
__device__ __forceinline__ void tile_sync() {
  if constexpr (Traits::kWs) {
    asm volatile("bar.sync 1, %0;\n" ::"n"(Traits::kThreads) : "memory");
  } else {
    __syncthreads();
  }
}

}  // namespace pagedattn
