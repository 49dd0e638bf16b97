// Split-KV combine: merge num_splits partial (O, LSE) rows into the final O and LSE.
// One warp per (token, q head); lanes stride over the head dim in float4s. Partials are added in
// split order, so the result is deterministic. All-empty rows give O = 0 and LSE = -inf.
// Latency, not bandwidth, sets this kernel's time (decode has few rows): each lane loads the LSEs of
// splits lane, lane + 32, ... once, the weights reach the other lanes by shuffles, and the partial
// rows are loaded eight splits at a time with no load waiting on another.
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
  constexpr int kMaxChunks = 8;  // splits <= 256 (choose_splits caps them there)
  float lse_mine[kMaxChunks];
  int const chunks = (p.num_splits + 31) / 32;
  float mx = kNegInf;
#pragma unroll
  for (int c = 0; c < kMaxChunks; ++c) {
    int const s = 32 * c + lane;
    lse_mine[c] = c < chunks && s < p.num_splits ? lse_of(s) : kNegInf;
    mx = fmaxf(mx, lse_mine[c]);
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = 0.f;
  if (mx != kNegInf) {
#pragma unroll
    for (int c = 0; c < kMaxChunks; ++c) sum += lse_mine[c] == kNegInf ? 0.f : expf(lse_mine[c] - mx);
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  float const total = sum > 0.f ? mx + logf(sum) : kNegInf;
  // this lane's weights: split 32c + lane gets w_mine[c] (0 for empty splits and empty rows)
  float w_mine[kMaxChunks];
#pragma unroll
  for (int c = 0; c < kMaxChunks; ++c) {
    w_mine[c] = total == kNegInf || lse_mine[c] == kNegInf ? 0.f : expf(lse_mine[c] - total);
  }

  Element* out = static_cast<Element*>(p.out) + int64_t(token) * p.o_row_stride + int64_t(head) * p.o_head_stride;
  float const* part = p.o_accum + (int64_t(token) * p.num_q_heads + head) * p.o_accum_row;
  int64_t const split_stride = int64_t(p.total_q) * p.num_q_heads * p.o_accum_row;
  for (int d0 = 0; d0 < p.head_size; d0 += 32 * 4) {  // uniform over the warp: shuffles below
    int const d = d0 + lane * 4;
    bool const active = d < p.head_size;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int c = 0; c < kMaxChunks; ++c) {
      if (c >= chunks) break;
      int const n = min(32, p.num_splits - 32 * c);
      for (int j0 = 0; j0 < n; j0 += 8) {  // eight loads in flight, then their sums in split order
        float4 o[8];
        float wgt[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          int const j = min(j0 + u, n - 1);
          float const w_j = __shfl_sync(0xffffffffu, w_mine[c], j);
          wgt[u] = j0 + u < n ? w_j : 0.f;
          o[u] = active ? *reinterpret_cast<float4 const*>(part + (32 * c + j) * split_stride + d)
                        : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          if (wgt[u] != 0.f) {  // an empty split adds nothing (and never a NaN)
            acc.x += wgt[u] * o[u].x;
            acc.y += wgt[u] * o[u].y;
            acc.z += wgt[u] * o[u].z;
            acc.w += wgt[u] * o[u].w;
          }
        }
      }
    }
    if (active) {
      out[d] = Element(acc.x);
      out[d + 1] = Element(acc.y);
      out[d + 2] = Element(acc.z);
      out[d + 3] = Element(acc.w);
    }
  }
  if (lane == 0 && p.lse != nullptr) p.lse[int64_t(head) * p.total_q + token] = total;
}

}  // namespace pagedattn
