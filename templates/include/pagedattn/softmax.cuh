// Online softmax state of the rows a thread holds in an SM80 MMA accumulator.
//
// Accumulator fragments of the 16x8 MMA are indexed (v, mi, ni): value v = c + 2h is row
// 8h + lane/4 and column 2(lane%4) + c of MMA tile (mi, ni). A thread's softmax row r = 2mi + h; the
// four lanes of a quad share each row, so row reductions are two xor-shuffles.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/softmax_merge.cuh"
#include <cute/tensor.hpp>

namespace pagedattn {

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// 2^x on the SFU alone (ex2.approx.ftz): exp2f also handles results below 2^-126, which costs three
// more instructions per score; a probability that small is 0 next to the row's maximum of 1.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 2^x for x <= 64 on the FMA pipe, to share the exponentials with the SFU where the SFU is the
// bottleneck (softcap: a tanh per score as well). x = j + f with j = round(x) (adding 1.5 * 2^23 puts
// it in the low mantissa bits) and f in [-1/2, 1/2]; 2^f is a cubic with p(0) = 1 fitted for relative
// error (1.0e-4, under bf16's rounding of P), and j goes into the exponent bits. x <= -127 (masked
// scores are -inf) gives exactly +0, x = 0 exactly 1; a NaN score (NaN in K or Q) gives 0 here where the
// SFU's gives NaN (keeping it would cost an instruction per score on the pipe this relieves).
__device__ __forceinline__ float exp2_fma(float x) {
  constexpr float kRound = 12582912.f;
  x = fmaxf(x, -127.f);
  float const t = x + kRound;
  float const f = x - (t - kRound);
  float const p = fmaf(fmaf(fmaf(0.05500871f, f, 0.24221068f), f, 0.69328292f), f, 1.f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}

// Tile field kLazyMax (prefill_ws at head dims >= 128): 0 quad-reduces every tile's row maxima; 1 only
// when some row of the warp grew past its maximum; 2 only when one grew by more than 2^8 (see exponentiate);
// 3 (opt-in) as 2 in an item's first step, and in its later ones no pass for the tile's maxima at all
// (exponentiate_lagging).
#ifndef PAGEDATTN_LAZY_MAX
#define PAGEDATTN_LAZY_MAX 0
#endif

template <int kRows>
struct OnlineSoftmax {
  float m[kRows];  // running max of scaled logits, log2 units (-inf: no key seen yet)
  float l[kRows];  // this thread's part of sum 2^(s - m); summed over the quad at the end

  __device__ __forceinline__ OnlineSoftmax() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      m[r] = kNegInf;
      l[r] = 0.f;
    }
  }

  // acc_s: raw scores of one tile (masked entries -inf). Turns them into probabilities 2^(s*k - m)
  // and rescales acc_o's rows to the new maxima. scale_log2 = softmax_scale * log2(e) * k_descale.
  // kFma of every kMmaN column groups (of 8 keys) take their 2^x from exp2_fma, spread evenly.
  template <int kFma = 0, class TensorS, class TensorO>
  __device__ __forceinline__ void update(TensorS& acc_s, TensorO& acc_o, float scale_log2) {
    float alpha[kRows];
    exponentiate<kFma>(acc_s, scale_log2, alpha);
    rescale(acc_o, alpha);
  }

  // The first half of update(): the new maxima and probabilities; alpha[r] is the factor row r of O
  // must take (rescale) before the tile's P V adds to it. Leaves O alone, so that a P V of the tile
  // before may still be accumulating into it.
  template <int kFma = 0, class TensorS>
  __device__ __forceinline__ void exponentiate(TensorS& acc_s, float scale_log2, float (&alpha)[kRows]) {
    using namespace cute;
    constexpr int kMmaN = decltype(size<2>(acc_s))::value;
    static_assert(kFma >= 0 && kFma <= kMmaN, "kFma: column groups of the tile");
    // PAGEDATTN_LAZY_MAX: the quad shuffles, the new maxima and O's rescaling only when a row of the warp
    // grew past its maximum (1; the same maxima as always) or past it by more than kSlack (2, 3): a row's
    // maximum then lags its scores' by up to kSlack, so p <= 2^kSlack, which l undoes exactly (a bf16
    // or fp16 P keeps its relative precision; fp32 l and O have the headroom). The vote is warp-uniform.
    float tile_max[kRows];  // this thread's part of each row's maximum (raw scores)
    bool grow = true;
    if constexpr (PAGEDATTN_LAZY_MAX > 0) {
      constexpr float kSlack = PAGEDATTN_LAZY_MAX == 1 ? 0.f : kLagSlack;
      bool mine = false;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        tile_max[r] = row_max(acc_s, r / 2, r % 2);
        mine |= !(tile_max[r] * scale_log2 <= m[r] + kSlack);  // NaN: grow
      }
      grow = __any_sync(0xffffffffu, mine);
    }
#pragma unroll
    for (int mi = 0; mi < kRows / 2; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int const r = 2 * mi + h;
        float const t = PAGEDATTN_LAZY_MAX > 0 ? tile_max[r] : row_max(acc_s, mi, h);
        float const m_new = grow ? fmaxf(m[r], quad_max(t) * scale_log2) : m[r];
        float const m_use = m_new == kNegInf ? 0.f : m_new;  // an all-masked row stays at p = 0
        alpha[r] = exp2_ftz(m[r] - m_use);
        m[r] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int ni = 0; ni < kMmaN; ++ni) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            float const x = fmaf(acc_s(2 * h + c, mi, ni), scale_log2, -m_use);
            float const p = (ni * kFma) % kMmaN < kFma ? exp2_fma(x) : exp2_ftz(x);
            acc_s(2 * h + c, mi, ni) = p;
            sum += p;
          }
        }
        l[r] = l[r] * alpha[r] + sum;
      }
    }
  }

  // PAGEDATTN_LAZY_MAX 3 (prefill_ws, an item's steps after its first): exponentiate() with no pass over
  // the scores for their maxima. The exponentials come first, against the maxima as they stand, and a
  // row's sum of them tells whether its maximum may stay: a sum <= 2^kLagSlack bounds every p of the
  // row's part by it (p >= 0), which is exponentiate()'s lag (alpha = 1). Otherwise the warp takes the
  // tile's largest p per row (quad-reduced), moves each maximum up by its log2 and multiplies the row's
  // p, l and alpha by 2^(old - new): exact as long as no p overflowed. A p past 2^kLagRange (an
  // overflow, +inf, among them) makes it return true with the state untouched and the scores lost: the
  // caller then makes S afresh and calls exponentiate() on it. A row with no maximum yet takes
  // exponentiate() too (the caller checks no_max first): its scores' scale is not known.
  static constexpr float kLagSlack = 8.f, kLagRange = 60.f;

  __device__ __forceinline__ bool no_max() const {
    bool none = false;
#pragma unroll
    for (int r = 0; r < kRows; ++r) none |= m[r] == kNegInf;
    return __any_sync(0xffffffffu, none);
  }

  template <class TensorS>
  __device__ __forceinline__ bool exponentiate_lagging(TensorS& acc_s, float scale_log2, float (&alpha)[kRows]) {
    using namespace cute;
    constexpr int kMmaN = decltype(size<2>(acc_s))::value;
    float sum[kRows];
    exponentiate_at_max(acc_s, scale_log2, sum);
    constexpr float kSumMax = float(1 << int(kLagSlack)), kPMax = float(1ull << int(kLagRange));
    bool big = false;
#pragma unroll
    for (int r = 0; r < kRows; ++r) big |= !(sum[r] <= kSumMax);  // NaN too
    if (__any_sync(0xffffffffu, big)) {  // rare: the tile's largest p per row
      float top[kRows];
      bool far = false;
#pragma unroll
      for (int mi = 0; mi < kRows / 2; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          top[2 * mi + h] = quad_max(row_max(acc_s, mi, h));
          far |= !(top[2 * mi + h] <= kPMax);
        }
      }
      if (__any_sync(0xffffffffu, far)) return true;
#pragma unroll
      for (int mi = 0; mi < kRows / 2; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          int const r = 2 * mi + h;
          float const up = top[r] > 1.f ? __log2f(top[r]) : 0.f;  // the maximum only rises
          float const a = exp2_ftz(-up);
#pragma unroll
          for (int ni = 0; ni < kMmaN; ++ni) {
            acc_s(2 * h, mi, ni) *= a;
            acc_s(2 * h + 1, mi, ni) *= a;
          }
          alpha[r] = a;
          l[r] = (l[r] + sum[r]) * a;
          m[r] += up;
        }
      }
    } else {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        alpha[r] = 1.f;
        l[r] += sum[r];
      }
    }
    return false;
  }

  // This thread's part of the maximum of row (mi, h) of a tile's raw scores.
  template <class TensorS>
  __device__ __forceinline__ static float row_max(TensorS const& acc_s, int mi, int h) {
    using namespace cute;
    float t = kNegInf;
#pragma unroll
    for (int ni = 0; ni < decltype(size<2>(acc_s))::value; ++ni) {
      t = fmaxf(t, fmaxf(acc_s(2 * h, mi, ni), acc_s(2 * h + 1, mi, ni)));
    }
    return t;
  }

  // Softcapped scores are bounded: s = cap * t with |t| <= 1 (cap = softcap * log2(e), log2 units).
  // Against a fixed maximum m0 = max(0, cap - kHi) every 2^(s - m0) lies in [2^(-cap - m0), 2^kHi], so
  // when cap + m0 <= kLo each probability is a normal number of P's type, a row's sum and P V keep
  // kHi bits of headroom in fp32, and no row maximum, no per-tile alpha and no rescaling of O are
  // needed. kHi / kLo: 64 / 126 for bf16 P (cap <= 95: softcap <= 65.8), 15 / 14 for fp16 P (cap <=
  // 14). Sets m to m0 and returns true when the bound holds; leaves the state alone otherwise.
  template <class Element>
  __device__ __forceinline__ bool fix_max(float cap) {
    constexpr bool kHalf = cute::is_same_v<Element, cute::half_t>;
    constexpr float kHi = kHalf ? 15.f : 64.f, kLo = kHalf ? 14.f : 126.f;
    float const m0 = fmaxf(0.f, cap - kHi);
    if (!(cap + m0 <= kLo)) return false;
#pragma unroll
    for (int r = 0; r < kRows; ++r) m[r] = m0;
    return true;
  }

  // p = 2^(s * scale_log2 - m) in place, m as it stands, and each row's part of their sum, into sum[r]
  // (kAdd: added to it, row by row as each is done). kFma: as in exponentiate().
  template <int kFma = 0, bool kAdd = false, class TensorS>
  __device__ __forceinline__ void exponentiate_at_max(TensorS& acc_s, float scale_log2, float (&sum)[kRows]) const {
    using namespace cute;
    constexpr int kMmaN = decltype(size<2>(acc_s))::value;
    static_assert(kFma >= 0 && kFma <= kMmaN, "kFma: column groups of the tile");
#pragma unroll
    for (int mi = 0; mi < kRows / 2; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int const r = 2 * mi + h;
        float s = 0.f;
#pragma unroll
        for (int ni = 0; ni < kMmaN; ++ni) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            float const x = fmaf(acc_s(2 * h + c, mi, ni), scale_log2, -m[r]);
            float const p = (ni * kFma) % kMmaN < kFma ? exp2_fma(x) : exp2_ftz(x);
            acc_s(2 * h + c, mi, ni) = p;
            s += p;
          }
        }
        if constexpr (kAdd) {
          sum[r] += s;
        } else {
          sum[r] = s;
        }
      }
    }
  }

  // exponentiate() once fix_max() has set the maximum: p = 2^(s * scale_log2 - m0), alpha = 1.
  template <int kFma = 0, class TensorS>
  __device__ __forceinline__ void exponentiate_fixed(TensorS& acc_s, float scale_log2) {
    exponentiate_at_max<kFma, true>(acc_s, scale_log2, l);
  }

  // The second half: O's rows times alpha (a row whose max did not move is skipped, exactly).
  template <class TensorO>
  __device__ __forceinline__ void rescale(TensorO& acc_o, float const (&alpha)[kRows]) {
    using namespace cute;
    constexpr int kMmaD = decltype(size<2>(acc_o))::value;
#pragma unroll
    for (int mi = 0; mi < kRows / 2; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float const a = alpha[2 * mi + h];
        if (a != 1.f) {
#pragma unroll
          for (int nd = 0; nd < kMmaD; ++nd) {
            acc_o(2 * h, mi, nd) *= a;
            acc_o(2 * h + 1, mi, nd) *= a;
          }
        }
      }
    }
  }

  // Quad-reduced state of row r.
  __device__ __forceinline__ SoftmaxPartial row_state(int r) const { return {m[r], quad_sum(l[r])}; }
};

}  // namespace pagedattn
