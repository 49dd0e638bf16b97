// Split-KV combine: merge num_splits partial (O, LSE) rows into the final O and LSE row.
//
// attn_fwd runs it in the last CTA to finish a tile (an arrival counter per tile, see attn_fwd.cuh),
// so split-KV costs no second launch. One warp per (token, q head); lanes stride over the head dim in
// float4s. Partials are added in split order, so the result is deterministic whichever CTA is last.
// Rows whose splits are all empty give O = 0 and LSE = -inf.
// Latency, not bandwidth, sets the cost (decode has few rows): each lane loads the LSEs of splits
// lane, lane + 32, ... once, the weights reach the other lanes by shuffles, and the partial rows are
// loaded sixteen splits at a time (kBatch) with no load waiting on another. Partials written by other CTAs are
// read through L2 (ld.global.cg), never from a stale L1 line.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/softmax_merge.cuh"
#include "pagedattn/attn_tile.cuh"

namespace pagedattn {

// part: split 0's partial row (fp32, split s at part + s * part_stride); lse_part: split 0's LSE
// (split s at lse_part[s * lse_stride]); out: the output row; lse_out: where the merged LSE goes (or
// null); sink: a logit with no value row that joins the denominator (learnable sinks; -inf for none).
// Called by all 32 lanes of a warp.
template <class Element>
__device__ __forceinline__ void combine_split_row(float const* part, int64_t part_stride, float const* lse_part,
                                                  int64_t lse_stride, Element* out, float* lse_out,
                                                  int head_size, int num_splits, int lane, float sink = kNegInf) {
  // PAGEDATTN_MAX_SPLITS: the host's one cap on splits (heuristics.MAX_SPLITS), rendered in; a lane
  // holds the LSEs of splits lane, lane + 32, ...
  static_assert(PAGEDATTN_MAX_SPLITS % 32 == 0, "the split cap is a whole number of warps");
  constexpr int kMaxChunks = PAGEDATTN_MAX_SPLITS / 32;
  constexpr int kBatch = 16;     // partial rows in flight per lane
  // the first batch of partial rows (columns lane * 4 ..) is loaded with the LSEs: one round trip less
  float4 first[kBatch];
  {
    bool const active = lane * 4 < head_size;
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      first[u] = active && u < num_splits ? __ldcg(reinterpret_cast<float4 const*>(part + u * part_stride + lane * 4))
                                          : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  // the merged LSE, in natural-log units: max, then the sum of exp(lse_s - max) over splits
  float lse_mine[kMaxChunks];
  int const chunks = (num_splits + 31) / 32;
  float mx = kNegInf;
#pragma unroll
  for (int c = 0; c < kMaxChunks; ++c) {
    int const s = 32 * c + lane;
    lse_mine[c] = c < chunks && s < num_splits ? __ldcg(lse_part + s * lse_stride) : kNegInf;
    mx = fmaxf(mx, lse_mine[c]);
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  mx = fmaxf(mx, sink);
  float sum = 0.f;
  if (mx != kNegInf) {
#pragma unroll
    for (int c = 0; c < kMaxChunks; ++c) sum += lse_mine[c] == kNegInf ? 0.f : expf(lse_mine[c] - mx);
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (sink != kNegInf) sum += expf(sink - mx);  // after the butterfly: once, not once per lane
  float const total = sum > 0.f ? mx + logf(sum) : kNegInf;
  // this lane's weights: split 32c + lane gets w_mine[c] (0 for empty splits and empty rows)
  float w_mine[kMaxChunks];
#pragma unroll
  for (int c = 0; c < kMaxChunks; ++c) {
    w_mine[c] = total == kNegInf || lse_mine[c] == kNegInf ? 0.f : expf(lse_mine[c] - total);
  }

  // acc += the weighted partial rows o of splits 32 c + j0 + u (u < kBatch), in split order; w_c is
  // this lane's weight in chunk c (split 32 c + lane), n the chunk's number of splits.
  auto add_batch = [&](float4& acc, float4 const (&o)[kBatch], float w_c, int j0, int n) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      float const w = __shfl_sync(0xffffffffu, w_c, min(j0 + u, n - 1));
      if (j0 + u < n && w != 0.f) {  // an empty split adds nothing (and never a NaN)
        acc.x += w * o[u].x;
        acc.y += w * o[u].y;
        acc.z += w * o[u].z;
        acc.w += w * o[u].w;
      }
    }
  };
  float4 const zero = make_float4(0.f, 0.f, 0.f, 0.f);
  float4 acc_first = zero;  // the preloaded batch, added before the loops so that its registers go free
  add_batch(acc_first, first, w_mine[0], 0, min(32, num_splits));
  // The loops stay rolled: one copy of a batch's loads in the kernel, not one per chunk and column
  // block (unrolled, the combine was most of every attention kernel's code and of its compile time).
  // The chunk's weight is picked from the registers by selects, never by an indexed (local) read.
#pragma unroll 1
  for (int d0 = 0; d0 < head_size; d0 += 32 * 4) {  // uniform over the warp: shuffles inside
    int const d = d0 + lane * 4;
    bool const active = d < head_size;
    float4 acc = d0 == 0 ? acc_first : zero;
#pragma unroll 1
    for (int c = 0; c < chunks; ++c) {
      float w_c = w_mine[0];
#pragma unroll
      for (int k = 1; k < kMaxChunks; ++k) w_c = c == k ? w_mine[k] : w_c;
      int const n = min(32, num_splits - 32 * c);
#pragma unroll 1
      for (int j0 = d0 == 0 && c == 0 ? kBatch : 0; j0 < n; j0 += kBatch) {  // kBatch loads in flight
        float4 o[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          int const j = min(j0 + u, n - 1);
          o[u] = active ? __ldcg(reinterpret_cast<float4 const*>(part + (32 * c + j) * part_stride + d)) : zero;
        }
        add_batch(acc, o, w_c, j0, n);
      }
    }
    if (active) {
      out[d] = Element(acc.x);
      out[d + 1] = Element(acc.y);
      out[d + 2] = Element(acc.z);
      out[d + 3] = Element(acc.w);
    }
  }
  if (lane == 0 && lse_out != nullptr) *lse_out = total;
}

}  // namespace pagedattn

namespace pagedattn {

// Split-KV: after a tile's split has written its partials (epilogue.cuh), the last CTA of the tile
// to arrive merges every split's partials into O and LSE. The flag lives in dynamic shared memory
// (AttnSmem::last_split_flag): static shared memory would push a variant whose dynamic size is
// exactly the 48 KiB default over the launch limit. Release/acquire through thread 0 (bar.sync
// orders every thread's partials before its fence, and its fence after the counter before every
// thread's reads): one gpu-scope fence on each side, not a sequentially consistent fence per thread.
template <class Traits, class Features>
__device__ __forceinline__ void merge_splits_if_last(TileCtx<Traits> const& c) {
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  AttnParams const& p = c.p;
  AttnWork const& w = c.w;
  int* is_last = c.smem.last_split_flag();
  tile_sync<Traits>();  // every thread's partials are written and the epilogue's shared memory is read
  if (c.tidx == 0) {
    int* counter = p.split_counters + w.tile_slot;
    asm volatile("fence.acq_rel.gpu;" ::: "memory");  // this CTA's partials before its arrival
    bool const last = atomicAdd(counter, 1) == p.num_splits - 1;
    if (last) {
      asm volatile("fence.acq_rel.gpu;" ::: "memory");  // the other splits' partials before our reads
      *counter = 0;  // all splits arrived: zero again for the next call on this stream
    }
    *is_last = last;
  }
  tile_sync<Traits>();
  if (!*is_last) return;
  int64_t const part_stride = int64_t(p.total_q) * p.num_q_heads * kHeadDim;
  for (int m = c.tidx / 32; m < Traits::kBlockM; m += Traits::kThreads / 32) {  // a warp per row
    int const R = w.row0 + m, t = R / p.group, g = R - t * p.group;
    if (t >= w.q_len) break;
    int const token = w.q_start + t, head = w.kv_head * p.group + g;
    combine_split_row<Element>(
        p.o_accum + (int64_t(token) * p.num_q_heads + head) * kHeadDim, part_stride,
        p.lse_accum + int64_t(head) * p.total_q + token, int64_t(p.num_q_heads) * p.total_q,
        static_cast<Element*>(p.out) + int64_t(token) * p.o_row_stride + int64_t(head) * p.o_head_stride,
        p.lse != nullptr ? p.lse + int64_t(head) * p.total_q + token : nullptr, p.head_size, p.num_splits,
        c.tidx % 32, Features::kSinks ? p.sinks[head] : kNegInf);
  }
}

}  // namespace pagedattn
