// Hopper (sm_90) bulk copies global -> shared that complete on an mbarrier, and the few mbarrier
// operations a per-warp ring needs. Every function compiles to nothing below sm_90, where the
// callers never reach them (attn_fwd dispatches on Traits::kBulk, which the host enables on sm_90 only).
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include <cute/arch/util.hpp>

namespace pagedattn {

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int arrivals) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(cute::cast_smem_ptr_to_uint(bar)), "r"(arrivals));
#endif
}

// Makes initialised mbarriers visible to the async proxy (the bulk-copy engine).
__device__ __forceinline__ void mbarrier_init_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// One arrival that also announces `bytes` of copies still to land in this phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
               ::"r"(cute::cast_smem_ptr_to_uint(bar)), "r"(bytes) : "memory");
#endif
}

// Blocks until the phase with parity `phase` has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t phase) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n"
      "}\n" ::"r"(cute::cast_smem_ptr_to_uint(bar)), "r"(phase) : "memory");
#endif
}

// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared memory; the
// completion is counted on `bar`. The source is streamed once: L2 may evict it first.
__device__ __forceinline__ void bulk_copy_g2s(void* smem, void const* gmem, uint32_t bytes, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(cute::cast_smem_ptr_to_uint(smem)), "l"(gmem), "r"(bytes),
                 "r"(cute::cast_smem_ptr_to_uint(bar)) : "memory");
#endif
}

}  // namespace pagedattn
