// FlashAttention forward over a paged KV cache: the kernel, wiring scheduler -> loader/mainloop ->
// epilogue. One concern per header:
//   tile_scheduler.cuh  which (request, KV head, row tile, split) a CTA works on, and its key range
//   attn_tile.cuh       what the parts share (TileCtx); attn_smem.cuh: the shared-memory regions
//   mainloop_sm80.cuh   mma.sync mainloop (sm_80 ... sm_90) and the cp.async K/V loader
//   mainloop_tma.cuh    TMA decode's per-warp K/V ring, a loader of the SM80 mainloop
//   mainloop_wgmma.cuh  sm_90a prefill: warpgroup MMAs over the cp.async pipeline
//   mainloop_ws.cuh     sm_90a prefill of paged caches: a TMA producer warpgroup feeding wgmma consumers
//                       (its consumers; ws_producer.cuh the producer, ws_epilogue.cuh its epilogue,
//                       ws_pipeline.cuh what the two roles share)
//   mask.cuh            every mask and score modifier (causal, window, softcap, ALiBi), for all mainloops
//   epilogue.cuh        warp groups merged, O and LSE (or a split's partials) written
//   split_combine.cuh   the last split of a tile to arrive merges the partials
//   rows_past_grid.cuh  rows an understated max_seqlen_q leaves outside the grid
//   paged_kv.cuh        the only code that turns (request, key) into cache addresses
// Grid: (num_seqs * num_kv_heads, m_blocks, num_splits). A CTA owns kBlockM packed rows of one
// (request, kv head) (see attn_traits.cuh), and one split of the request's visible KV range; which
// ones is grid_slot()'s choice (tile_scheduler.cuh). The warp-specialised prefill's grid is one CTA
// per SM (at most one per work item), each walking that same logical grid (ws_slot).
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/attn_params.cuh"
#include "pagedattn/attn_traits.cuh"
#include "pagedattn/attn_tile.cuh"
#include "pagedattn/mainloop_sm80.cuh"
#include "pagedattn/mainloop_tma.cuh"
#include "pagedattn/rows_past_grid.cuh"
#include "pagedattn/tile_scheduler.cuh"
#if PAGEDATTN_WGMMA
#include "pagedattn/mainloop_wgmma.cuh"
#include "pagedattn/mainloop_ws.cuh"
#endif

namespace pagedattn {

// One row tile `w` of one (request, KV head, split): the Q tile (cp.async, with the first K/V
// stage), then the mainloop of the variant, which ends in the epilogue.
template <class Traits, class Features>
__device__ __forceinline__ void attn_fwd_tile(AttnParams const& p, char* smem, AttnWork const& w) {
  TileCtx<Traits> const c(p, w, smem);
  load_q_tile(c);
  int const n_steps = w.step_end - w.step_begin;
  if constexpr (Traits::kWgmma) {
#if PAGEDATTN_WGMMA
    mainloop_wgmma<Traits, Features>(c);
#else
    static_assert(!Traits::kWgmma, "wgmma variants are rendered with PAGEDATTN_WGMMA defined");
#endif
  } else if constexpr (Traits::kTma) {
    TmaKVLoader<Traits> loader(c, n_steps);
    mainloop_sm80<Traits, Features>(c, loader);
  } else {
    CpAsyncKVLoader<Traits> loader(c, n_steps);
    mainloop_sm80<Traits, Features>(c, loader);
  }
}

// The kernel: one row tile of one (request, KV head, split) per CTA (tile_scheduler.cuh), or, for the
// warp-specialised prefill, one persistent CTA per SM taking its share of them.
template <class Traits, class Features>
__device__ __forceinline__ void attn_fwd(AttnParams const& p, char* smem) {
  constexpr int kStageKeys = Traits::kStageKeys;
  // TMA decode: the first block-table windows are read only after seqused_k arrives (they start where
  // this split starts). Guess that start from the table's capacity (exact for the longest requests,
  // e.g. equal-length decode batches) and pull those table lines into L2 now, in flight with
  // schedule()'s loads; a wrong guess costs a few L2 lines.
  if constexpr (Traits::kTma && !Traits::kWs) {
    if (p.block_table != nullptr) {
      int const b = blockIdx.x / p.num_kv_heads;
      int const steps = (PagedKV::table_capacity(p.max_blocks_per_seq, p.block_size) + kStageKeys - 1) / kStageKeys;
      int const first = int(blockIdx.z) * ((steps + p.num_splits - 1) / p.num_splits) * kStageKeys / p.block_size;
      // 8 lines of 32 entries: the first two page windows
      PagedKV::prefetch_table(p.block_table + int64_t(b) * p.bt_stride, p.max_blocks_per_seq, first, 8);
    }
  }
  if constexpr (Traits::kWs) {  // persistent: the CTA walks its work items (mainloop_ws.cuh)
#if PAGEDATTN_WGMMA
    attn_fwd_ws<Traits, Features>(p, smem);
#endif
  } else {
    AttnWork w;
    bool const has_tile = schedule<Traits, Features>(p, grid_slot(), w);
    if (w.q_len * p.group > int(gridDim.y) * Traits::kBlockM) {  // rare
      attn_rows_past_grid<Traits, Features>(p, w, int(gridDim.y), int(threadIdx.x / 32), int(blockDim.x / 32));
    }
    if (has_tile) attn_fwd_tile<Traits, Features>(p, smem, w);
  }
}

}  // namespace pagedattn
