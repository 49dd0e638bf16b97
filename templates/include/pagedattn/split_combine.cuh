// Split-KV combine: merge num_splits partial (O, LSE) rows into the final O and LSE.
// One warp per (token, q head); lanes stride over the head dim in float4s. Partials are added in
// split order, so the result is deterministic. All-empty rows give O = 0 and LSE = -inf.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/attn_params.cuh"
#include "pagedattn/softmax_merge.cuh"

namespace pagedattn {

template <class Element, int kWarps>
__device__ __forceinline__ void split_combine(CombineParams const& p) {
  int const warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int64_t const row = int64_t(blockIdx.x) * kWarps + warp;  // token * Hq + head
  if (row >= int64_t(p.total_q) * p.num_q_heads) return;
  int const token = int(row / p.num_q_heads), head = int(row - int64_t(token) * p.num_q_heads);
  auto lse_of = [&](int s) { return p.lse_accum[(int64_t(s) * p.num_q_heads + head) * p.total_q + token]; };

  // the merged LSE, in natural-log units: max, then the sum of exp(lse_s - max) over splits
  float mx = kNegInf;
  for (int s = lane; s < p.num_splits; s += 32) mx = fmaxf(mx, lse_of(s));
#pragma unroll
  for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = 0.f;
  if (mx != kNegInf) {
    for (int s = lane; s < p.num_splits; s += 32) sum += expf(lse_of(s) - mx);
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  float const total = sum > 0.f ? mx + logf(sum) : kNegInf;

  Element* out = static_cast<Element*>(p.out) + int64_t(token) * p.o_row_stride + int64_t(head) * p.o_head_stride;
  for (int d = lane * 4; d < p.head_size; d += 32 * 4) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (total != kNegInf) {
      for (int s = 0; s < p.num_splits; ++s) {
        float const lse_s = lse_of(s);
        if (lse_s == kNegInf) continue;
        float const wgt = expf(lse_s - total);
        float4 const o = *reinterpret_cast<float4 const*>(
            p.o_accum + ((int64_t(s) * p.total_q + token) * p.num_q_heads + head) * p.o_accum_row + d);
        acc.x += wgt * o.x;
        acc.y += wgt * o.y;
        acc.z += wgt * o.z;
        acc.w += wgt * o.w;
      }
    }
    out[d] = Element(acc.x);
    out[d + 1] = Element(acc.y);
    out[d + 2] = Element(acc.z);
    out[d + 3] = Element(acc.w);
  }
  if (lane == 0 && p.lse != nullptr) p.lse[int64_t(head) * p.total_q + token] = total;
}

}  // namespace pagedattn
