// The paged KV cache as seen by kernels: the ONLY code that turns a slot, or a (sequence, logical
// position) through block_table, into an address. The logical view is always
// [num_blocks, block_size, num_kv_heads, head_size]; NHD and HND differ only in the strides.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include <cute/tensor.hpp>

namespace pagedattn {

struct CacheGeometry {
  int64_t block_stride;  // elements between physical blocks
  int64_t page_stride;   // elements between slots of one block
  int64_t head_stride;   // elements between heads of one slot
  int64_t num_slots;     // num_blocks * block_size: anything at or past it is never touched
  int32_t num_blocks;
  int32_t block_size;
  int32_t num_heads;
  int32_t head_size;
};

// A cache tensor (K or V) of one element type, indexed (block, slot in block, head, d).
template <class CacheElement>
struct PagedCache {
  CacheGeometry g;
  CacheElement* base;

  __device__ __forceinline__ auto tensor() const {
    using namespace cute;
    return make_tensor(make_gmem_ptr(base),
                       make_layout(make_shape(g.num_blocks, g.block_size, g.num_heads, g.head_size),
                                   make_stride(g.block_stride, g.page_stride, g.head_stride, _1{})));
  }

  __device__ __forceinline__ bool valid_slot(int64_t slot) const {
    return slot >= 0 && slot < g.num_slots;
  }

  // First element of `head` in flat slot `slot` (slot = physical block * block_size + offset).
  __device__ __forceinline__ CacheElement* slot_head(int64_t slot, int head) const {
    auto mCache = tensor();  // (num_blocks, block_size, H, D)
    int64_t const block = slot / g.block_size;
    int const offset = int(slot - block * g.block_size);
    return &mCache(block, offset, head, 0);
  }
};

}  // namespace pagedattn
