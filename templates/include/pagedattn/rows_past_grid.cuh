// attn_fwd's out-of-line path for the rows its grid does not cover (see attn_rows_past_grid below).
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/attn_params.cuh"
#include "pagedattn/attn_tile.cuh"
#include "pagedattn/mask.cuh"
#include "pagedattn/numeric.cuh"
#include "pagedattn/softmax_merge.cuh"
#include "pagedattn/tile_scheduler.cuh"

namespace pagedattn {

// Rows of a request past the grid's row tiles (max_seqlen_q understated its length, or more tiles than
// a grid dimension holds). They are computed here, exactly but slowly: a warp per row, every work item
// of the (request, KV head) column (row tiles x splits) taking its share, each row over its whole
// visible range (never split), with the same mask, score modifiers, sinks and zero-filled corrupt pages
// as the tiles. Warp `warp` of the `warps` that share work item `w` takes rows first + (item * warps +
// warp) + k * items * warps, where item = split * tiles + w.column_cta and items = tiles * splits.
// Kept out of line: a loop over row tiles around the inlined tile body made ptxas spill 4.7 KB per
// thread (prefill 340 -> 106 TFLOP/s on H200); this path costs the tile kernels nothing.
template <class Traits, class Features>
__device__ __noinline__ void attn_rows_past_grid(AttnParams const& p, AttnWork const& w, int tiles, int warp,
                                                 int warps) {
  using Element = typename Traits::Element;
  constexpr int kPerLane = (Traits::kHeadDim + 31) / 32;  // lane holds columns lane, lane + 32, ...
  int const lane = threadIdx.x % 32;
  int const first = tiles * Traits::kBlockM, rows = w.q_len * p.group, D = p.head_size;
  int const item = w.split * tiles + w.column_cta, items = tiles * p.num_splits;
  PagedKV const kv = TileCtx<Traits>::request_kv(p, w);
  float scale_log2 = p.scale_log2, v_scale = 1.f;
  if constexpr (Traits::kIsFp8) {
    int const di = w.b * p.descale_batch_stride + w.kv_head * p.descale_head_stride;
    scale_log2 *= p.k_descale[di];
    v_scale = p.v_descale[di];
  }
  auto cache_value = [&](char const* row, int d) -> float {
    if constexpr (Traits::kIsFp8) {
      constexpr __nv_fp8_interpretation_t kind = Traits::kFp8 == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2;
      return __half2float(__half(__nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(row[d]), kind)));
    } else {
      return float(reinterpret_cast<Element const*>(row)[d]);
    }
  };
  float const cap_in = Features::kSoftcap ? kLn2 / p.softcap : 0.f;
  float const cap_out = Features::kSoftcap ? p.softcap * kLog2e : 0.f;
  for (int R = first + item * warps + warp; R < rows; R += items * warps) {
    int const i = R / p.group, head = w.kv_head * p.group + (R - i * p.group);
    int64_t const token = w.q_start + i;
    Element const* q = static_cast<Element const*>(p.q) + token * p.q_row_stride + int64_t(head) * p.q_head_stride;
    float qv[kPerLane], acc[kPerLane];
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      int const d = lane + 32 * e;
      qv[e] = d < D ? float(q[d]) : 0.f;
      acc[e] = 0.f;
    }
    float slope = 0.f;
    if constexpr (Features::kAlibi) slope = p.alibi_slopes[int64_t(w.b) * p.alibi_batch_stride + head] * kLog2e;
    int const pos = w.k_len - w.q_len + i;
    KeyRange const keys = visible_keys<Features>(p, w.q_len, w.k_len, i);
    SoftmaxPartial st = SoftmaxPartial::empty();
    for (int j = keys.begin; j < keys.end; ++j) {
      char const *k_row = kv.k_base, *v_row = kv.v_base;
      bool const ok = kv.locate(j, k_row, v_row);  // a corrupt page reads as zeros, as in the tiles
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        int const d = lane + 32 * e;
        if (ok && d < D) dot += qv[e] * cache_value(k_row, d);
      }
#pragma unroll
      for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      float s = dot * scale_log2;
      if constexpr (Features::kSoftcap) s = cap_out * tanh_approx(s * cap_in);
      if constexpr (Features::kAlibi) s -= slope * float(abs(pos - j));
      float const m = fmaxf(st.m, s);
      float const r = softmax_rescale(st.m, m), e_s = exp2f(s - m);
      st = {m, st.l * r + e_s};
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        int const d = lane + 32 * e;
        acc[e] = acc[e] * r + (ok && d < D ? e_s * cache_value(v_row, d) : 0.f);
      }
    }
    if constexpr (Features::kSinks) {
      // the sink joins the denominator; where it is the new maximum the sums re-express against it,
      // acc as well as l (acc holds sums against st.m)
      SoftmaxPartial const with_sink = softmax_combine(st, {p.sinks[head] * kLog2e, 1.f});
      float const r = softmax_rescale(st.m, with_sink.m);
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) acc[e] *= r;
      st = with_sink;
    }
    float const norm = st.l > 0.f ? v_scale / st.l : 0.f;
    Element* o = static_cast<Element*>(p.out) + token * p.o_row_stride + int64_t(head) * p.o_head_stride;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      int const d = lane + 32 * e;
      if (d < D) o[d] = Element(acc[e] * norm);
    }
    if (lane == 0 && p.lse != nullptr) p.lse[int64_t(head) * p.total_q + token] = st.lse();
  }
}

}  // namespace pagedattn
