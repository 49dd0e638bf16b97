// cp.async global -> shared copies that zero-fill instead of reading when a predicate is false.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include <cute/arch/util.hpp>

namespace pagedattn {

// 16 bytes; gmem is not dereferenced when !pred (the destination is zero-filled).
__device__ __forceinline__ void cp_async_16(void* smem, void const* gmem, bool pred) {
  uint32_t const dst = cute::cast_smem_ptr_to_uint(smem);
  int const src_bytes = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}

// 8 bytes (for an fp8 row whose last 16-byte chunk straddles the head size).
__device__ __forceinline__ void cp_async_8(void* smem, void const* gmem, bool pred) {
  uint32_t const dst = cute::cast_smem_ptr_to_uint(smem);
  int const src_bytes = pred ? 8 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// One arrival on an mbarrier once every cp.async this thread issued before has landed (sm_90; the
// arrival is one of those the barrier was initialised to expect: .noinc).
__device__ __forceinline__ void cp_async_arrive_on(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(cute::cast_smem_ptr_to_uint(bar))
               : "memory");
#endif
}

}  // namespace pagedattn
