// The paged KV cache as seen by kernels: the ONLY code that turns a slot, or a (sequence, logical
// position) through block_table, into an address. The logical view is always
// [num_blocks, block_size, num_kv_heads, head_size]; NHD and HND differ only in the strides.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"

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

// (block, offset in block) of a slot in [0, num_slots) -> element offset of its head `head`. The
// division by block_size is a shift for power-of-two block sizes (block_shift >= 0) and 32-bit whenever
// the slot fits (caches below 2^31 slots); block * block_stride etc. are 64-bit.
__device__ __forceinline__ int64_t slot_head_offset(CacheGeometry const& g, int block_shift, int64_t slot,
                                                    int head) {
  int64_t block, offset;
  if (block_shift >= 0) {
    block = slot >> block_shift;
    offset = slot & (g.block_size - 1);
  } else if (slot <= int64_t(0x7fffffff)) {
    uint32_t const b = uint32_t(slot) / uint32_t(g.block_size);
    block = b;
    offset = int64_t(uint32_t(slot) - b * uint32_t(g.block_size));
  } else {
    block = slot / g.block_size;
    offset = slot - block * g.block_size;
  }
  return block * g.block_stride + offset * g.page_stride + int64_t(head) * g.head_stride;
}

// One cache tensor (K or V) of one element type: its geometry and base pointer.
template <class CacheElement>
struct PagedCache {
  CacheGeometry g;
  CacheElement* base;

  __device__ __forceinline__ bool valid_slot(int64_t slot) const {
    return slot >= 0 && slot < g.num_slots;
  }

  // First element of `head` in flat slot `slot` (slot = physical block * block_size + offset).
  __device__ __forceinline__ CacheElement* slot_head(int64_t slot, int head, int block_shift = -1) const {
    return base + slot_head_offset(g, block_shift, slot, head);
  }
};

}  // namespace pagedattn

namespace pagedattn {

// Reads one request's K and V history through block_table (paged) or cu_seqlens_k (contiguous
// varlen). The mainloop asks "where are the K and V rows of logical key j"; nothing else touches the
// table. A key whose physical block lies outside [0, num_blocks) is reported invalid and the caller
// zero-fills it, so a corrupt table can never cause an out-of-bounds access.
struct PagedKV {
  char const* k_base;          // cache (or K) pointer + kv_head * head_stride, in bytes
  char const* v_base;
  int32_t const* table;        // this request's block_table row, or null when not paged
  int64_t k_block_stride, k_row_stride;   // bytes
  int64_t v_block_stride, v_row_stride;
  int32_t block_size, block_shift, num_blocks;
  int64_t first_row;           // non-paged: cu_seqlens_k[b]

  // Keys a request's block_table row can map (max_blocks_per_seq entries): no key at or past it is read.
  static __device__ __forceinline__ int table_capacity(int max_blocks_per_seq, int block_size) {
    return max_blocks_per_seq * block_size;
  }

  // Slot of key j inside its page.
  __device__ __forceinline__ int offset(int j) const {
    return block_shift >= 0 ? j & (block_size - 1) : j % block_size;
  }

  // Pull `lines` 128-byte lines of a block_table row into L2 from entry `first` on, one per calling
  // thread t < lines (entries first + 32 t), ahead of the loads that will need them.
  static __device__ __forceinline__ void prefetch_table(int32_t const* row, int entries, int first, int lines) {
    int const t = int(threadIdx.x);
    int const entry = first + 32 * t;
    if (t < lines && entry < entries) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(row + entry));
  }

  // Physical block holding key j (one block_table read); 0 when not paged. Reading it apart from
  // rows() lets a caller fetch it well before it needs the addresses.
  __device__ __forceinline__ int page(int j) const {
    if (table == nullptr) return 0;
    return table[block_shift >= 0 ? j >> block_shift : j / block_size];
  }

  // Sets the byte addresses of key j's K and V rows, given phys = page(j); false if the row must
  // not be read.
  __device__ __forceinline__ bool rows(int j, int phys, char const*& k_row, char const*& v_row) const {
    if (table == nullptr) {
      k_row = k_base + (first_row + j) * k_row_stride;
      v_row = v_base + (first_row + j) * v_row_stride;
      return true;
    }
    int const off = offset(j);
    bool const valid = phys >= 0 && phys < num_blocks;
    int64_t const row = valid ? phys : 0;
    k_row = k_base + row * k_block_stride + int64_t(off) * k_row_stride;
    v_row = v_base + row * v_block_stride + int64_t(off) * v_row_stride;
    return valid;
  }

  // Sets the byte addresses of key j's K and V rows; false if the row must not be read.
  __device__ __forceinline__ bool locate(int j, char const*& k_row, char const*& v_row) const {
    return rows(j, page(j), k_row, v_row);
  }
};

}  // namespace pagedattn
