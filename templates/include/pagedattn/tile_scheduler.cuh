// Which rows, keys and split a CTA of attn_fwd works on.
//
// Grid: (num_seqs * num_kv_heads, row tiles, num_splits); the host sizes the middle dimension from
// max_seqlen_q, a hint (rows past it: attn_fwd.cuh, attn_rows_past_grid). The persistent kWs kernel
// walks the same logical grid (ws_slot).
//
// Every index that comes from metadata is clamped to the tensors it addresses, whatever the metadata
// says: query rows to [0, total_q) (a non-monotone cu_seqlens_q gives an empty request), keys to the
// block table's capacity (paged) or to [0, total_k) (contiguous). Pages outside [0, num_blocks) are
// PagedKV's concern.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/attn_params.cuh"
#include "pagedattn/paged_kv.cuh"
#include <cute/tensor.hpp>

namespace pagedattn {

// Compile-time attention variants (AttnFwdSpec's feature fields). Semantics are FlashAttention's:
//   kWindow   query at bottom-right-aligned position p sees keys [p - window_left, p + window_right]
//             (-1: unbounded; causal sets right to 0); stages wholly outside a tile's window are never
//             loaded, and splits divide the window, not the history;
//   kSoftcap  s = softcap * tanh(s / softcap) on the scaled scores;
//   kAlibi    s -= slope[head] * |p - j|, after the softcap;
//   kSinks    one extra logit per head (natural-log units) in the softmax denominator only, added
//             once per row where the final (m, l) is formed (never per split); the LSE includes it.
template <bool kWindow_ = false, bool kSoftcap_ = false, bool kAlibi_ = false, bool kSinks_ = false>
struct AttnFeatures {
  static constexpr bool kWindow = kWindow_, kSoftcap = kSoftcap_, kAlibi = kAlibi_, kSinks = kSinks_;
  static constexpr bool kScoreMod = kSoftcap || kAlibi;  // scores change before masking
};

// The keys query token i (of q_len, over k_len keys) may see: [begin, end), clamped to [0, k_len].
// 64-bit arithmetic: window bounds may be anything up to INT32_MAX.
struct KeyRange {
  int begin, end;
};

template <class Features>
__device__ __forceinline__ KeyRange visible_keys(AttnParams const& p, int q_len, int k_len, int i) {
  int64_t const pos = int64_t(k_len) - q_len + i;  // bottom-right aligned position of query i
  int64_t end = k_len, begin = 0;
  if (p.causal) {
    end = pos + 1;
  } else if (Features::kWindow && p.window_right >= 0) {
    end = pos + 1 + p.window_right;
  }
  if (Features::kWindow && p.window_left >= 0) begin = pos - p.window_left;
  end = end < k_len ? end : k_len;
  begin = begin > 0 ? begin : 0;
  return {int(begin), int(end > begin ? end : begin)};
}

struct AttnWork {
  int b, kv_head, split;
  int column_cta;              // the work item among those of its (request, KV head) column and split: 0 .. tiles - 1
  int tile_slot;               // its (column, row tile) pair: the split-KV arrival counter it shares with its splits
  int q_start, q_len;          // request's first query row and query count, inside [0, total_q)
  int k_start, k_len;          // contiguous varlen: first K row (inside [0, total_k)); visible keys
  int row0;                    // first packed row of the tile
  int mask_from;               // keys >= mask_from may be masked for some row of the tile
  int mask_below;              // ... and so may keys < mask_below (a window's left edge)
  int step_begin, step_end;    // stages [step_begin, step_end) of kStageKeys keys
};

__device__ __forceinline__ int clamp_to(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }

// Which (request, KV head) column, row tile and split a CTA takes. The grid is (columns, row tiles,
// splits) and starts CTAs in blockIdx order, x fastest. Row tiles go in reverse: with causal masking
// the last tiles of a request see the most keys, so the longest CTAs start first instead of forming
// the tail. kWs (the warp-specialised prefill) is persistent instead: one CTA per SM walks work items
// blockIdx.x, blockIdx.x + gridDim.x, ... of the same logical grid (p.grid_tiles row tiles), in an
// order where consecutive items are the row tiles of one column, so the CTAs running together read
// the same K/V and it stays in L2.
struct GridSlot {
  int column, row_tile, split;
  int column_cta;  // this work item among those of its (request, KV head) column and split: 0 .. tiles - 1
  int tile_slot;   // its (column, row tile) pair, shared by its splits: column * tiles + column_cta
};

__device__ __forceinline__ GridSlot grid_slot() {
  int const tiles = int(gridDim.y), t = int(blockIdx.y);
  return {int(blockIdx.x), tiles - 1 - t, int(blockIdx.z), t, int(blockIdx.x) * tiles + t};
}

// Work item `item` of the persistent kWs grid: columns x p.grid_tiles row tiles x p.num_splits items
// (fewer than 2^31: the host checks).
__device__ __forceinline__ GridSlot ws_slot(AttnParams const& p, int item) {
  int const per_split = p.num_seqs * p.num_kv_heads * p.grid_tiles;
  int const split = item / per_split, rem = item - split * per_split;
  int const column = rem / p.grid_tiles, t = rem - column * p.grid_tiles;
  return {column, p.grid_tiles - 1 - t, split, t, rem};
}

// Split w.split's share of the stages [step_lo, step_hi) into w.step_begin, w.step_end.
__device__ __forceinline__ void split_steps(AttnParams const& p, AttnWork& w, int step_lo, int step_hi) {
  int const steps = step_hi - step_lo;
  int const per_split = (steps + p.num_splits - 1) / p.num_splits;
  w.step_begin = step_lo + cute::min(steps, w.split * per_split);
  w.step_end = step_lo + cute::min(steps, w.split * per_split + per_split);
}

// Row tile `tile` of w's request (w.q_len, w.k_len): its first row (w.row0, set either way), the keys
// its rows may see (mask_from, mask_below) and every split's stages, [step_lo, step_hi); false where
// the request has no such tile. (The stages stay out of w until split_steps: a store to w here, read
// back there, left an extra stack store in every kernel whose w lives in local memory.)
template <class Traits, class Features>
__device__ __forceinline__ bool tile_keys(AttnParams const& p, int tile, AttnWork& w, int& step_lo, int& step_hi) {
  int const rows = w.q_len * p.group;
  w.row0 = tile * Traits::kBlockM;
  if (w.row0 >= rows) return false;
  int const i_min = w.row0 / p.group;
  int const i_max = (cute::min(rows, w.row0 + Traits::kBlockM) - 1) / p.group;
  // Windows and causal limits move right with the query: the tile's first row sees the least on the
  // right, its last row the least on the left.
  KeyRange const first = visible_keys<Features>(p, w.q_len, w.k_len, i_min);
  KeyRange const last = visible_keys<Features>(p, w.q_len, w.k_len, i_max);
  w.mask_from = first.end;
  w.mask_below = last.begin;
  int const keys_begin = first.begin, keys_end = last.end;
  step_lo = keys_begin / Traits::kStageKeys;
  step_hi = keys_end > keys_begin ? (keys_end + Traits::kStageKeys - 1) / Traits::kStageKeys : step_lo;
  return true;
}

// The work item of a grid slot, all but its stages: those of the tile's whole key range (every split's)
// go to [step_lo, step_hi). False where the slot has no tile (its request's fields are set anyway).
template <class Traits, class Features>
__device__ __forceinline__ bool schedule_tile(AttnParams const& p, GridSlot const& slot, AttnWork& w, int& step_lo,
                                              int& step_hi) {
  int const tile = slot.row_tile;
  w.b = slot.column / p.num_kv_heads;
  w.kv_head = slot.column - w.b * p.num_kv_heads;
  w.column_cta = slot.column_cta;
  w.tile_slot = slot.tile_slot;
  w.split = slot.split;
  w.q_start = clamp_to(p.cu_seqlens_q[w.b], 0, p.total_q);
  w.q_len = clamp_to(p.cu_seqlens_q[w.b + 1], w.q_start, p.total_q) - w.q_start;
  int k_len;
  w.k_start = 0;
  if (p.block_table != nullptr) {
    k_len = cute::min(p.seqused_k[w.b], PagedKV::table_capacity(p.max_blocks_per_seq, p.block_size));
  } else {
    w.k_start = clamp_to(p.cu_seqlens_k[w.b], 0, p.total_k);
    k_len = clamp_to(p.cu_seqlens_k[w.b + 1], w.k_start, p.total_k) - w.k_start;
    if (p.seqused_k != nullptr) k_len = cute::min(k_len, p.seqused_k[w.b]);
  }
  w.k_len = k_len > 0 ? k_len : 0;
  // the request's fields above are set even for a CTA with no tile (attn_fwd's rows past the grid)
  return tile_keys<Traits, Features>(p, tile, w, step_lo, step_hi);
}

// The work item of a grid slot, its split's stages in [step_begin, step_end); false where the slot
// has no tile (its request's fields are set anyway).
template <class Traits, class Features>
__device__ __forceinline__ bool schedule(AttnParams const& p, GridSlot const& slot, AttnWork& w) {
  int step_lo, step_hi;
  if (!schedule_tile<Traits, Features>(p, slot, w, step_lo, step_hi)) return false;
  split_steps(p, w, step_lo, step_hi);
  return true;
}

}  // namespace pagedattn
