// The legacy paged KV cache (vLLM's reshape_and_cache / paged_attention_v1/v2 layout) as seen by
// kernels: the ONLY legacy code that turns a slot, a block-table entry or (block, head, d, token)
// into an address.
//
//   K: [num_blocks, H, D / x, block_size, x]   x = 16 bytes / element size. Chunk c (elements
//      c*x .. c*x+x-1) of a token sits right after the same chunk of the block's previous token, so
//      lanes reading chunk c of consecutive tokens read consecutive 16-byte words.
//   V: [num_blocks, H, D, block_size]          row d of a block holds element d of every token, so a
//      lane reads a run of tokens of one row in one access.
// Block and head strides come from the tensors (multiples of 16 bytes); the inner dims are dense.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"

namespace pagedattn {

struct LegacyCacheGeometry {
  int64_t k_block_stride;  // elements between physical blocks of the K cache
  int64_t k_head_stride;   // elements between heads of one K block
  int64_t v_block_stride;
  int64_t v_head_stride;
  int32_t num_blocks;      // block ids outside [0, num_blocks) are never dereferenced
  int32_t num_heads;       // KV heads
  int32_t head_size;
  int32_t block_size;
};

// K and V of one cache, element type CacheElement (const for readers). kBlockSize > 0 fixes the
// block size at compile time; 0 takes it from the geometry.
template <class CacheElement, int kBlockSize = 0>
struct LegacyPagedCache {
  static constexpr int kX = 16 / int(sizeof(CacheElement));  // the layout's x
  LegacyCacheGeometry g;
  CacheElement* k;
  CacheElement* v;

  __device__ __forceinline__ int block_size() const { return kBlockSize > 0 ? kBlockSize : g.block_size; }

  __device__ __forceinline__ bool valid_block(int64_t block) const {
    return block >= 0 && block < g.num_blocks;
  }
  __device__ __forceinline__ bool valid_slot(int64_t slot) const {
    return slot >= 0 && slot < int64_t(g.num_blocks) * block_size();
  }

  // First element of K chunk `chunk` of token `offset` in (block, head): x contiguous elements.
  __device__ __forceinline__ CacheElement* k_chunk(int64_t block, int head, int chunk, int offset) const {
    return k + block * g.k_block_stride + head * g.k_head_stride +
           (int64_t(chunk) * block_size() + offset) * kX;
  }

  // Element d of token `offset` in (block, head); the block's next tokens follow contiguously.
  __device__ __forceinline__ CacheElement* v_row(int64_t block, int head, int d, int offset) const {
    return v + block * g.v_block_stride + head * g.v_head_stride + int64_t(d) * block_size() + offset;
  }
};

// One sequence's row of the block table: logical block n -> physical block.
struct LegacyBlockTable {
  int32_t const* row;
  int32_t num_blocks;

  // The physical block, or -1 when the table holds an id outside [0, num_blocks): a corrupt entry is
  // skipped by the caller (its tokens are masked), never dereferenced.
  __device__ __forceinline__ int physical(int n) const {
    int const block = row[n];
    return block >= 0 && block < num_blocks ? block : -1;
  }
};

}  // namespace pagedattn
