// Which keys each query row may see, and what its scores become before the softmax: the ONE place
// where the sequence end, causal and sliding-window masking, the softcap and ALiBi live (semantics:
// AttnFeatures in tile_scheduler.cuh). Every mainloop (SM80 MMAs, fp8 register operands, wgmma)
// builds an AttnMask for the rows its thread holds and calls apply() on each sub-tile of scores.
//
// Accumulator order (SM80 MMAs, and the flat view of a wgmma accumulator, which uses the same order):
// flat index i holds row 2 * ((i / 4) % (kRows / 2)) + (i % 4) / 2 of the thread's kRows rows; the
// identity tensor partitioned the same way (tScS) gives each entry's (row, key) in the tile.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/attn_params.cuh"
#include "pagedattn/softmax_merge.cuh"
#include "pagedattn/tile_scheduler.cuh"
#include <cute/tensor.hpp>

namespace pagedattn {

__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <int kRows, class Features>
struct AttnMask {
  int key_begin[kRows];  // row r sees keys [key_begin[r], key_end[r])
  int key_end[kRows];
  int pos[kRows];        // ALiBi: the row's bottom-right-aligned query position
  float slope[kRows];    // ALiBi slope of the row's head, log2 units
  int mask_from, mask_below;  // every row of the tile sees every key in [mask_below, mask_from)
  float cap_in, cap_out;      // softcap: s2 = cap_out * tanh(s2 * cap_in), s2 a log2-unit score

  __device__ __forceinline__ static constexpr int row_of(int i) { return 2 * ((i / 4) % (kRows / 2)) + (i % 4) / 2; }
  __device__ __forceinline__ static constexpr int first_entry(int r) { return 2 * (r % 2) + 4 * (r / 2); }

  // tScS: the identity tensor of the (rows, keys) score tile, partitioned like the accumulator.
  template <class TensorC>
  __device__ __forceinline__ AttnMask(AttnParams const& p, AttnWork const& w, TensorC const& tScS) {
    using namespace cute;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      int const R = w.row0 + int(get<0>(tScS(first_entry(r))));  // packed row: token R / group, head R % group
      int const qi = R / p.group;
      KeyRange const keys = visible_keys<Features>(p, w.q_len, w.k_len, qi);
      key_begin[r] = keys.begin;
      key_end[r] = keys.end;
      pos[r] = w.k_len - w.q_len + qi;
      slope[r] = 0.f;
      if constexpr (Features::kAlibi) {
        int const head = w.kv_head * p.group + (R - qi * p.group);
        // rows past the request (qi >= q_len) are never stored; keep their reads inside the tensor
        if (qi < w.q_len) slope[r] = p.alibi_slopes[int64_t(w.b) * p.alibi_batch_stride + head] * kLog2e;
      }
    }
    mask_from = w.mask_from;
    mask_below = w.mask_below;
    cap_in = Features::kSoftcap ? kLn2 / p.softcap : 0.f;
    cap_out = Features::kSoftcap ? p.softcap * kLog2e : 0.f;
  }

  // The sub-tile of kKeys keys starting at key0: scores a row may not see -> -inf (a sub-tile every
  // row sees whole is left alone), after the softcap and ALiBi. Returns the factor the softmax
  // applies to the scores: scale_log2 as given, or 1 once the score modifiers have applied it.
  template <int kKeys, class TensorS, class TensorC>
  __device__ __forceinline__ float apply(TensorS& acc_s, TensorC const& tScS, int key0, float scale_log2) const {
    using namespace cute;
    if constexpr (Features::kSoftcap && !Features::kAlibi) {
      // s2 = cap_out * tanh(acc * scale_log2 * cap_in): the tanh here, cap_out (> 0, so it keeps the
      // order of the scores) returned for the softmax to apply; interior sub-tiles skip the mask
      float const in = scale_log2 * cap_in;
      CUTE_UNROLL
      for (int i = 0; i < size(acc_s); ++i) acc_s(i) = tanh_approx(acc_s(i) * in);
      mask_keys<kKeys>(acc_s, tScS, key0);
      return cap_out;
    } else if constexpr (Features::kScoreMod) {
      CUTE_UNROLL
      for (int i = 0; i < size(acc_s); ++i) {
        int const r = row_of(i), j = key0 + int(get<1>(tScS(i)));
        float s = acc_s(i) * scale_log2;
        if constexpr (Features::kSoftcap) s = cap_out * tanh_approx(s * cap_in);
        if constexpr (Features::kAlibi) s -= slope[r] * float(abs(pos[r] - j));
        acc_s(i) = j < key_begin[r] || j >= key_end[r] ? kNegInf : s;
      }
      return 1.f;
    } else {
      mask_keys<kKeys>(acc_s, tScS, key0);
      return scale_log2;
    }
  }

  // Scores of keys a row may not see -> -inf, on sub-tiles that cross an edge of the visible range.
  template <int kKeys, class TensorS, class TensorC>
  __device__ __forceinline__ void mask_keys(TensorS& acc_s, TensorC const& tScS, int key0) const {
    using namespace cute;
    if ((!Features::kWindow || key0 >= mask_below) && key0 + kKeys <= mask_from) return;
    CUTE_UNROLL
    for (int i = 0; i < size(acc_s); ++i) {
      int const r = row_of(i), j = key0 + int(get<1>(tScS(i)));
      if ((Features::kWindow && j < key_begin[r]) || j >= key_end[r]) acc_s(i) = kNegInf;
    }
  }
};

}  // namespace pagedattn
