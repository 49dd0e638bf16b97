// Merging partial softmax states: the identity behind split-KV.
//
// A partial state summarises one query row's attention over a subset of the keys:
//   m = max_j s_j                          logits in log2 units (s = q.k * scale * log2(e) [+ bias])
//   l = sum_j 2^(s_j - m)
//   o = sum_j 2^(s_j - m) v_j              unnormalised, or o / l normalised
// Partials over disjoint key sets merge exactly. With M = max_i m_i:
//   l = sum_i 2^(m_i - M) l_i,   out = sum_i 2^(m_i - M) o_i / l     (o_i unnormalised)
//                                out = sum_i 2^(m_i - M) l_i o_i / l  (o_i normalised)
// Only differences m_i - M <= 0 are exponentiated, so nothing overflows. An empty partial (no keys,
// or every key masked) is m = -inf, l = 0: it weighs exactly 0 and its output is never read. If every
// partial is empty the merged state is empty and the merged output is 0.
//
// Users: the legacy kernels merge their warps' states (legacy_attention.cuh) and their 512-token
// partitions (legacy_reduce.cuh); the flash path's split-KV combine merges its splits.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include <cuda/std/limits>

namespace pagedattn {

constexpr float kNegInf = -cuda::std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct SoftmaxPartial {
  float m;  // max logit in log2 units; -inf when empty
  float l;  // sum of 2^(s - m); 0 when empty

  static __device__ __forceinline__ SoftmaxPartial empty() { return {kNegInf, 0.f}; }

  // Natural-log log-sum-exp of the logits (the flash path's LSE): (m + log2(l)) * ln(2).
  __device__ __forceinline__ float lse() const { return l > 0.f ? (m + log2f(l)) * kLn2 : kNegInf; }
};

// 2^(m_i - m): the factor that re-expresses sums taken against max m_i against a max m >= m_i.
// 0 for m_i = -inf, also when m is -inf too (which would otherwise give NaN).
__device__ __forceinline__ float softmax_rescale(float m_i, float m) {
  return m_i == kNegInf ? 0.f : exp2f(m_i - m);
}

// Fold two partials. Commutative bit for bit, so a butterfly leaves every lane with the same state.
__device__ __forceinline__ SoftmaxPartial softmax_combine(SoftmaxPartial a, SoftmaxPartial b) {
  float const m = fmaxf(a.m, b.m);
  return {m, softmax_rescale(a.m, m) * a.l + softmax_rescale(b.m, m) * b.l};
}

// The factor by which partial `part`'s output enters the merged normalised output (see the top of
// the file); 0 when the merged state `total` is empty.
template <bool kNormalised>
__device__ __forceinline__ float softmax_merge_weight(SoftmaxPartial part, SoftmaxPartial total) {
  if (!(total.l > 0.f)) return 0.f;
  float const r = softmax_rescale(part.m, total.m);
  return kNormalised ? r * part.l / total.l : r / total.l;
}

// Fold the partials held by kWidth adjacent lanes (kWidth a power of two <= 32); every lane of the
// group ends with the merged state.
template <int kWidth>
__device__ __forceinline__ SoftmaxPartial softmax_warp_combine(SoftmaxPartial p) {
  static_assert(kWidth >= 1 && kWidth <= 32 && (kWidth & (kWidth - 1)) == 0, "kWidth: power of two <= 32");
#pragma unroll
  for (int mask = kWidth / 2; mask > 0; mask /= 2) {
    SoftmaxPartial const other{__shfl_xor_sync(0xffffffffu, p.m, mask),
                               __shfl_xor_sync(0xffffffffu, p.l, mask)};
    p = softmax_combine(p, other);
  }
  return p;
}

// Merge n partials, each with an output row of kDim elements, into one normalised row, using all
// kThreads threads of the CTA (every thread must call it). Accessors:
//   state(i)    -> SoftmaxPartial of partial i
//   value(i, d) -> float, element d of partial i's output (normalised or not: kNormalised)
//   store(d, x) -> receives element d of the merged, normalised output
// Weights are computed kChunk partials at a time into shared memory; a partial of weight 0 is skipped
// (never read). Thread t owns elements t, t + kThreads, ... and sums partials in index order, so the
// result does not depend on scheduling. Returns the merged state (every thread).
template <int kThreads, int kDim, int kChunk, bool kNormalised, class StateAt, class ValueAt, class Store>
__device__ __forceinline__ SoftmaxPartial softmax_merge_partials(int n, StateAt const& state,
                                                                 ValueAt const& value, Store const& store) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "kThreads: whole warps");
  constexpr int kWarps = kThreads / 32;
  constexpr int kPerThread = (kDim + kThreads - 1) / kThreads;
  __shared__ SoftmaxPartial sWarpState[kWarps];
  __shared__ float sWeight[kChunk];
  int const tid = threadIdx.x;

  // 1. The merged (m, l): a strided fold per thread, a butterfly per warp, then the warps in order.
  SoftmaxPartial total = SoftmaxPartial::empty();
  for (int i = tid; i < n; i += kThreads) total = softmax_combine(total, state(i));
  total = softmax_warp_combine<32>(total);
  if (tid % 32 == 0) sWarpState[tid / 32] = total;
  __syncthreads();
  total = sWarpState[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) total = softmax_combine(total, sWarpState[w]);

  // 2. The weighted sum of the outputs.
  float acc[kPerThread];
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) acc[k] = 0.f;
  for (int start = 0; start < n; start += kChunk) {
    int const count = n - start < kChunk ? n - start : kChunk;
    __syncthreads();  // the previous chunk's weights are consumed
    for (int i = tid; i < count; i += kThreads)
      sWeight[i] = softmax_merge_weight<kNormalised>(state(start + i), total);
    __syncthreads();
    for (int i = 0; i < count; ++i) {
      float const w = sWeight[i];
      if (w == 0.f) continue;  // uniform over the CTA
#pragma unroll
      for (int k = 0; k < kPerThread; ++k) {
        int const d = tid + k * kThreads;
        if (kDim % kThreads == 0 || d < kDim) acc[k] += w * value(start + i, d);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    int const d = tid + k * kThreads;
    if (kDim % kThreads == 0 || d < kDim) store(d, acc[k]);
  }
  return total;
}

}  // namespace pagedattn
