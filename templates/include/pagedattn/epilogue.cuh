// The epilogue of attn_fwd: the warp groups of a tile merge their (m, l, O) through shared memory,
// then the tile's rows are written: O (times v_scale) and the LSE, or, when the KV range is split,
// the split's partial O and LSE in fp32, after which the last split of the tile to arrive merges
// them (split_combine.cuh). Learnable sinks join the final (m, l) once: here when not split, in the
// merge otherwise.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/async_copy.cuh"
#include "pagedattn/attn_fp8_regs.cuh"
#include "pagedattn/attn_tile.cuh"
#include "pagedattn/softmax_merge.cuh"
#include "pagedattn/split_combine.cuh"

namespace pagedattn {

// acc_o and tOcO (its coordinates) are either mainloop's accumulator; softmax holds its rows' (m, l).
// Every thread that computes the tile calls it.
template <class Traits, class Features, class AccO, class Softmax, class TensorC>
__device__ __forceinline__ void write_tile(TileCtx<Traits> const& c, AccO const& acc_o, Softmax const& softmax,
                                           TensorC const& tOcO) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
  AttnParams const& p = c.p;
  AttnWork const& w = c.w;
  cp_async_wait<0>();
  tile_sync<Traits>();  // all K/V reads done: shared memory is reused
#pragma unroll
  for (int r = 0; r < Traits::kRows; ++r) {
    SoftmaxPartial const st = softmax.row_state(r);
    int const m = get<0>(tOcO(2 * (r % 2), r / 2, 0));
    if (c.gtid % 4 == 0 && c.d_idx == 0) {  // column groups hold the same (m, l)
      c.smem.m()[c.group_idx * kBlockM + m] = st.m;
      c.smem.l()[c.group_idx * kBlockM + m] = st.l;
    }
  }
  CUTE_UNROLL
  for (int i = 0; i < size(acc_o); ++i) {
    int const col = Traits::kFp8Regs ? fp8_regs_column(get<1>(tOcO(i)))
                                     : c.d_idx * Traits::kHeadDimO + int(get<1>(tOcO(i)));
    c.smem.o(c.group_idx, get<0>(tOcO(i)))[col] = acc_o(i);
  }
  tile_sync<Traits>();

  bool const split_out = p.num_splits > 1;
  constexpr int kVec = 8;  // columns per thread step: 16 bytes of Element, 32 of fp32
  float const* m_smem = c.smem.m();
  float const* l_smem = c.smem.l();
  for (int i = c.tidx; i < kBlockM * (kHeadDim / kVec); i += Traits::kThreads) {
    int const m = i / (kHeadDim / kVec), col = (i % (kHeadDim / kVec)) * kVec;
    int const R = w.row0 + m, t = R / p.group, g = R - t * p.group;
    if (t >= w.q_len || col >= p.head_size) continue;
    SoftmaxPartial total = SoftmaxPartial::empty();
    for (int gi = 0; gi < Traits::kWarpsN; ++gi) {
      total = softmax_combine(total, {m_smem[gi * kBlockM + m], l_smem[gi * kBlockM + m]});
    }
    // a sink is one more logit with no value row: it joins the final (m, l) only (the merge adds it
    // when the KV range is split)
    if constexpr (Features::kSinks) {
      if (!split_out) total = softmax_combine(total, {p.sinks[w.kv_head * p.group + g] * kLog2e, 1.f});
    }
    float acc[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] = 0.f;
    for (int gi = 0; gi < Traits::kWarpsN; ++gi) {
      float const wgt = softmax_merge_weight<false>({m_smem[gi * kBlockM + m], l_smem[gi * kBlockM + m]}, total);
      if (wgt == 0.f) continue;
      float const* src = c.smem.o(gi, m) + col;
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[e] += wgt * src[e];
    }
    int const token = w.q_start + t, head = w.kv_head * p.group + g;
    float const v_scale = c.v_scale;
    if (!split_out) {
      Element outv[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) outv[e] = Element(acc[e] * v_scale);
      Element* dst = static_cast<Element*>(p.out) + int64_t(token) * p.o_row_stride +
                     int64_t(head) * p.o_head_stride + col;
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<uint4 const*>(outv);
      if (col == 0 && p.lse != nullptr) p.lse[int64_t(head) * p.total_q + token] = total.lse();
    } else {
      float* dst = p.o_accum + ((int64_t(w.split) * p.total_q + token) * p.num_q_heads + head) * kHeadDim + col;
#pragma unroll
      for (int e = 0; e < kVec; e += 4) {
        *reinterpret_cast<float4*>(dst + e) =
            make_float4(acc[e] * v_scale, acc[e + 1] * v_scale, acc[e + 2] * v_scale, acc[e + 3] * v_scale);
      }
      if (col == 0) p.lse_accum[(int64_t(w.split) * p.num_q_heads + head) * p.total_q + token] = total.lse();
    }
  }
  if (split_out) merge_splits_if_last<Traits, Features>(c);
}

}  // namespace pagedattn
