// Parameters of the paged FlashAttention forward kernel and its split-KV combine.
// Mirrored field for field by pagedattn/ops/params.py (AttnParams).
#pragma once

#include "pagedattn/nvrtc_compat.cuh"

namespace pagedattn {

struct AttnParams {
  void const* q;                // [total_q, Hq, D] (row and head strides below; d contiguous)
  void* out;                    // [total_q, Hq, D]
  float* lse;                   // [Hq, total_q] natural log, or null
  void const* k;                // paged: [num_blocks, block_size, Hkv, D]; varlen: [total_k, Hkv, D]
  void const* v;
  int32_t const* block_table;   // [B, bt_stride] int32, or null (non-paged varlen)
  int32_t const* cu_seqlens_q;  // [B + 1]
  int32_t const* seqused_k;     // [B] or null
  int32_t const* cu_seqlens_k;  // [B + 1] (non-paged) or null
  float const* k_descale;       // fp8 caches: index = b * descale_batch_stride + kv_head * descale_head_stride
  float const* v_descale;
  float* o_accum;               // split-KV partial outputs [num_splits, total_q, Hq, D] fp32
  float* lse_accum;             // split-KV partial LSE [num_splits, Hq, total_q] fp32
  void const* tma_desc;         // decode_tma: two CUtensorMaps (K, V) in global memory, or null
  int32_t* split_counters;      // split-KV: one arrival counter per (column, row tile) (AttnWork::tile_slot), zero between calls
  float const* alibi_slopes;    // ALiBi (Features::kAlibi): [Hq] or [B, Hq] fp32, index b * alibi_batch_stride + head
  float const* sinks;           // learnable sinks (Features::kSinks): [Hq] fp32 logits, natural-log units
  int64_t q_row_stride, q_head_stride;
  int64_t o_row_stride, o_head_stride;
  int64_t k_block_stride, k_row_stride, k_head_stride;  // paged: block/page strides; varlen: token stride
  int64_t v_block_stride, v_row_stride, v_head_stride;
  int32_t bt_stride;            // row stride of block_table
  int32_t max_blocks_per_seq;   // columns of block_table
  int32_t num_blocks;           // physical blocks in the cache (block ids outside [0, num_blocks) are never read)
  int32_t block_size;
  int32_t block_shift;          // log2(block_size) when a power of two, else -1
  int32_t num_seqs;
  int32_t num_q_heads, num_kv_heads, group;   // group = Hq / Hkv, packed into the tile's M dimension
  int32_t head_size;            // runtime D <= kHeadDim; columns >= D are zero-filled and not stored
  int32_t total_q;              // rows of q and out: no request's rows are read or written past it
  int32_t total_k;              // contiguous varlen: rows of k and v (0 when paged)
  int32_t num_splits;
  int32_t causal;
  int32_t descale_batch_stride, descale_head_stride;
  int32_t tma_row_dim;          // decode_tma: tensor-map dimension of the slot in a page (1 HND, 2 NHD)
  int32_t window_left, window_right;  // Features::kWindow: keys [p - left, p + right] of the query at p (-1: unbounded)
  int32_t alibi_batch_stride;   // 0 for [Hq] slopes, Hq for [B, Hq]
  float scale_log2;             // softmax_scale * log2(e) (k_descale is applied per CTA)
  float softcap;                // Features::kSoftcap: s = softcap * tanh(s / softcap) on the scaled scores
  int32_t grid_tiles;           // row tiles per (request, KV head) column: gridDim.y, or the persistent kWs grid's
};

}  // namespace pagedattn
