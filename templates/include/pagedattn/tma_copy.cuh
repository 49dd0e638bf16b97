// Hopper (sm_90) TMA tile copies global -> shared that complete on an mbarrier, and the few mbarrier
// operations a per-warp ring needs. Every function compiles to nothing below sm_90, where the
// callers never reach them (attn_fwd dispatches on Traits::kTma, which the host enables on sm_90 only).
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

// One plain arrival (a consumer handing a ring slot back to its producer).
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(cute::cast_smem_ptr_to_uint(bar)) : "memory");
#endif
}

// Blocks until the phase with parity `phase` has completed, in the ordering `sem` (a string literal:
// "" or ".acquire.cluster"). A macro, so that each wait's asm text is a literal of its own: an operand
// for the qualifier ("C") changed the code NVVM made around every wait (TMA decode's ring loop).
#define PAGEDATTN_MBARRIER_WAIT(bar, phase, sem)                                                     \
  asm volatile(                                                                                      \
      "{\n"                                                                                          \
      ".reg .pred done;\n"                                                                           \
      "wait_%=:\n"                                                                                   \
      "mbarrier.try_wait.parity" sem ".shared::cta.b64 done, [%0], %1;\n"                            \
      "@!done bra wait_%=;\n"                                                                        \
      "}\n" ::"r"(cute::cast_smem_ptr_to_uint(bar)), "r"(phase) : "memory")

// kCluster: a phase the cluster's other CTA takes part in (prefill_ws with kWsPair), acquired at
// cluster scope.
template <bool kCluster = false>
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t phase) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kCluster) {
    PAGEDATTN_MBARRIER_WAIT(bar, phase, ".acquire.cluster");
  } else {
    PAGEDATTN_MBARRIER_WAIT(bar, phase, "");
  }
#endif
}

// Clusters of two CTAs (prefill_ws with kWsPair): this CTA's rank in its cluster.
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t rank = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
#endif
  return rank;
}

// Every thread of every CTA of the cluster: what each did before (mbarrier inits, remote arrivals)
// is visible to all after.
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

// One arrival on the mbarrier at bar's offset in the shared memory of the cluster's CTA `rank` (this
// one included): a consumer handing a slot back to both CTAs' producers. Its reads of the slot are done
// (wgmma waited for them) and nothing it wrote there is read again, so the arrival keeps the default
// release at CTA scope: at cluster scope ptxas puts a MEMBAR.ALL.GPU before each one.
__device__ __forceinline__ void mbarrier_arrive_cluster(uint64_t* bar, uint32_t rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(cute::cast_smem_ptr_to_uint(bar)), "r"(rank) : "memory");
#endif
}

// Orders this thread's earlier generic-proxy writes to shared memory before later async-proxy
// (TMA) accesses of the same bytes.
__device__ __forceinline__ void fence_proxy_async_smem() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Start fetching a tensor map (in global memory) into the descriptor cache, so that the first copy
// does not wait for it behind the other loads of the prologue.
__device__ __forceinline__ void tma_prefetch_map(void const* tensor_map) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(tensor_map)) : "memory");
#endif
}

// One TMA box of a 4-D tensor map (a CUtensorMap the host encoded, in global memory) at coordinates
// (c0 innermost ... c3) into shared memory; completion is counted on `bar`.
__device__ __forceinline__ void tma_load_4d(void* smem, void const* tensor_map, int c0, int c1, int c2, int c3,
                                            uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
      ::"r"(cute::cast_smem_ptr_to_uint(smem)), "l"(reinterpret_cast<uint64_t>(tensor_map)),
        "r"(cute::cast_smem_ptr_to_uint(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
#endif
}

// tma_load_4d into the same offset of the shared memory of every CTA of the cluster in cta_mask (bit r:
// rank r), each copy's bytes counted on the mbarrier at bar's offset in that CTA.
__device__ __forceinline__ void tma_load_4d_multicast(void* smem, void const* tensor_map, int c0, int c1, int c2,
                                                      int c3, uint64_t* bar, uint16_t cta_mask) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4, %5, %6}], [%2], %7;\n"
      ::"r"(cute::cast_smem_ptr_to_uint(smem)), "l"(reinterpret_cast<uint64_t>(tensor_map)),
        "r"(cute::cast_smem_ptr_to_uint(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "h"(cta_mask) : "memory");
#endif
}

// Four 8x8 matrices of 16-bit values from registers to shared memory (stmatrix): lane l holds values
// (l / 4, 2 (l % 4)) and the next of matrix k in r[k] (the MMA accumulator layout), and lanes 8 k ..
// 8 k + 7 give the addresses of matrix k's rows 0 .. 7 (16 bytes each).
__device__ __forceinline__ void stmatrix_x4(void* row, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
               ::"r"(cute::cast_smem_ptr_to_uint(row)), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
#endif
}

// `bytes` (a multiple of 16; both addresses 16-byte aligned) from shared to global memory by the bulk-copy
// engine, in this thread's current bulk group (bulk_commit closes it).
__device__ __forceinline__ void bulk_store(void* gmem, void const* smem, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
               ::"l"(reinterpret_cast<uint64_t>(gmem)), "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void bulk_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}

// Blocks until every bulk group this thread committed has read its shared memory (the writes to global
// memory may still be in flight).
__device__ __forceinline__ void bulk_wait_read() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
#endif
}

// An L2 eviction policy for data read once (decode's K/V stream): its lines go first when their set needs
// room. After an L2 flush (or any writer) the cache holds dirty lines; loads of normal priority evict them
// one by one, and every eviction is a write to DRAM that competes with the stream. With evict_first the
// stream mostly replaces its own clean lines.
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
#endif
  return policy;
}

// tma_load_4d with an L2 cache policy (l2_evict_first_policy).
__device__ __forceinline__ void tma_load_4d_hint(void* smem, void const* tensor_map, int c0, int c1, int c2, int c3,
                                                 uint64_t* bar, uint64_t policy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3, %4, %5, %6}], [%2], %7;\n"
      ::"r"(cute::cast_smem_ptr_to_uint(smem)), "l"(reinterpret_cast<uint64_t>(tensor_map)),
        "r"(cute::cast_smem_ptr_to_uint(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "l"(policy) : "memory");
#endif
}

}  // namespace pagedattn
