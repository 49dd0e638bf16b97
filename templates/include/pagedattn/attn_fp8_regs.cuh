// fp8 K/V straight from shared memory into tensor-core operands (Traits::kFp8Regs: sm_90 TMA decode,
// head dims that are multiples of 128).
//
// The TMA lands each 16-key chunk as 128-byte rows per 128-column block, 128-byte swizzled: 16-byte
// chunk c of row r sits at chunk c ^ (r % 8). Every thread loads the fp8 bytes of its own MMA operands
// and converts them in registers (e4m3: one cvt per pair; e5m2 is the high byte of an fp16, one byte
// permute per pair). The MMAs are fp16 for both query types: every e4m3 and e5m2 value is exact in
// fp16, P in [0, 1] keeps more bits in fp16 than in bf16, and bf16 queries enter scaled by 2^-8 (exact;
// |q| up to 2^24 stays finite), which the caller folds back into the softmax scale.
//
// Two reorderings make every load a wide, conflict-free one (g = lane / 4, t = lane % 4):
//   - S = Q K^T sums over d, so d may be visited in any order that Q and K share. In k-step kk the
//     thread's four d values are 64(kk/4) + 16t + 4(kk%4) + {0..3}: per 64 columns one 16-byte load
//     of a K row feeds four k-steps, and Q's fragments are built once in the same order.
//   - O = P V: a thread holds keys {2t, 2t+1, 2t+8, 2t+9} of each 16-key step (P's natural layout),
//     so it loads a 4-byte word from each of those four V rows; word w = 8u + g of a row gives
//     columns 4w .. 4w+3, i.e. column 32u + 4g + j is MMA column g of n-tile 4u + j. O's columns come
//     out in that order and the epilogue puts them back (fp8_regs_column).
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/numeric.cuh"
#include <cute/arch/mma_sm80.hpp>

namespace pagedattn {

// Physical column of logical accumulator column c (n-tile c / 8, MMA column c % 8) of O.
__device__ __forceinline__ int fp8_regs_column(int c) { return 32 * (c / 32) + 4 * (c % 8) + (c / 8) % 4; }

// fp16x2 of the fp8 pair in bits [16 hi, 16 hi + 16) of w (low byte -> low half).
template <Fp8Format kFp8>
__device__ __forceinline__ uint32_t fp8x2_to_half2(uint32_t w, int hi) {
  if constexpr (kFp8 == Fp8Format::kE5M2) {
    return __byte_perm(w, 0u, hi ? 0x3424u : 0x1404u);  // each byte becomes the high byte of a half
  } else {
    uint32_t out;
    uint16_t const pair = uint16_t(w >> (16 * hi));
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(out) : "h"(pair));
    return out;
  }
}

__device__ __forceinline__ uint32_t half2_bits(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ void mma_f16(float (&d)[4], uint32_t const (&a)[4], uint32_t b0, uint32_t b1) {
  cute::SM80_16x8x16_F32F16F16F32_TN::fma(d[0], d[1], d[2], d[3], a[0], a[1], a[2], a[3], b0, b1,
                                          d[0], d[1], d[2], d[3]);
}

// Q's A fragment of k-step kk in the shared d order: rows g and g + 8, columns d0 .. d0 + 3 (inside
// one 16-byte swizzle chunk of sQ, so one 8-byte load per row), times q_scale, as fp16.
template <class Element, class TensorQ>
__device__ __forceinline__ void fp8_regs_q(TensorQ const& sQ, int kk, int lane, float q_scale, uint32_t (&a)[4]) {
  int const g = lane / 4, t = lane % 4;
  int const d0 = 64 * (kk / 4) + 16 * t + 4 * (kk % 4);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint2 const raw = *reinterpret_cast<uint2 const*>(&sQ(g + 8 * h, d0));
    Element const* e = reinterpret_cast<Element const*>(&raw);
    a[h] = half2_bits(float(e[0]) * q_scale, float(e[1]) * q_scale);
    a[2 + h] = half2_bits(float(e[2]) * q_scale, float(e[3]) * q_scale);
  }
}

// acc_s(., 0, nt) += Q K^T for the kBlockN keys of a sub-tile at `kt` (column blocks of kBlockN rows x
// 128 bytes). q_frag(kk, a) yields Q's fragment of k-step kk.
template <int kHeadDim, int kBlockN, Fp8Format kFp8, class AccS, class QFrag>
__device__ __forceinline__ void fp8_regs_qk(uint8_t const* kt, int lane, AccS& acc_s, QFrag&& q_frag) {
  int const g = lane / 4, t = lane % 4;
  // Narrow sub-tiles have few independent MMA chains: even and odd k-steps accumulate apart.
  constexpr bool kTwoChains = kBlockN / 8 < 4;
  float acc[kBlockN / 8][2][4];
#pragma unroll
  for (int nt = 0; nt < kBlockN / 8; ++nt)
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[nt][c][v] = 0.f;
#pragma unroll
  for (int s = 0; s < kHeadDim / 64; ++s) {
    uint4 rows[kBlockN / 8];
#pragma unroll
    for (int nt = 0; nt < kBlockN / 8; ++nt) {  // row 8nt + g of column block s / 2; (8nt + g) % 8 = g
      uint8_t const* row = kt + ((s / 2) * kBlockN + 8 * nt + g) * 128;
      rows[nt] = *reinterpret_cast<uint4 const*>(row + (((4 * (s % 2) + t) ^ g) * 16));
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t a[4];
      q_frag(4 * s + i, a);
#pragma unroll
      for (int nt = 0; nt < kBlockN / 8; ++nt) {
        uint32_t const w = i == 0 ? rows[nt].x : i == 1 ? rows[nt].y : i == 2 ? rows[nt].z : rows[nt].w;
        mma_f16(acc[nt][kTwoChains ? i % 2 : 0], a, fp8x2_to_half2<kFp8>(w, 0), fp8x2_to_half2<kFp8>(w, 1));
      }
    }
  }
#pragma unroll
  for (int nt = 0; nt < kBlockN / 8; ++nt)
#pragma unroll
    for (int v = 0; v < 4; ++v) acc_s(v, 0, nt) = kTwoChains ? acc[nt][0][v] + acc[nt][1][v] : acc[nt][0][v];
}

// acc_o(., 0, nt) += P V for the sub-tile at `vt`; P = acc_s (probabilities), n-tiles in the column
// order above.
template <int kHeadDim, int kBlockN, Fp8Format kFp8, class AccS, class AccO>
__device__ __forceinline__ void fp8_regs_pv(uint8_t const* vt, int lane, AccS const& acc_s, AccO& acc_o) {
  int const g = lane / 4, t = lane % 4;
#pragma unroll
  for (int kv = 0; kv < kBlockN / 16; ++kv) {
    uint32_t const p[4] = {half2_bits(acc_s(0, 0, 2 * kv), acc_s(1, 0, 2 * kv)),
                           half2_bits(acc_s(2, 0, 2 * kv), acc_s(3, 0, 2 * kv)),
                           half2_bits(acc_s(0, 0, 2 * kv + 1), acc_s(1, 0, 2 * kv + 1)),
                           half2_bits(acc_s(2, 0, 2 * kv + 1), acc_s(3, 0, 2 * kv + 1))};
    int const r0 = 16 * kv + 2 * t;  // rows r0, r0 + 1, r0 + 8, r0 + 9; r0 % 8 = 2t
#pragma unroll
    for (int u = 0; u < kHeadDim / 32; ++u) {
      uint8_t const* block = vt + (u / 4) * kBlockN * 128 + 4 * (g % 4);
      int const chunk = 2 * (u % 4) + g / 4;
      uint32_t const w0 = *reinterpret_cast<uint32_t const*>(block + r0 * 128 + ((chunk ^ (2 * t)) * 16));
      uint32_t const w1 = *reinterpret_cast<uint32_t const*>(block + (r0 + 1) * 128 + ((chunk ^ (2 * t + 1)) * 16));
      uint32_t const w2 = *reinterpret_cast<uint32_t const*>(block + (r0 + 8) * 128 + ((chunk ^ (2 * t)) * 16));
      uint32_t const w3 = *reinterpret_cast<uint32_t const*>(block + (r0 + 9) * 128 + ((chunk ^ (2 * t + 1)) * 16));
      // pairs of keys per column: [w0.j, w1.j] and [w2.j, w3.j] for columns j = 0 .. 3
      uint32_t const lo01 = __byte_perm(w0, w1, 0x5140u), hi01 = __byte_perm(w0, w1, 0x7362u);
      uint32_t const lo23 = __byte_perm(w2, w3, 0x5140u), hi23 = __byte_perm(w2, w3, 0x7362u);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t const b0 = fp8x2_to_half2<kFp8>(j < 2 ? lo01 : hi01, j % 2);
        uint32_t const b1 = fp8x2_to_half2<kFp8>(j < 2 ? lo23 : hi23, j % 2);
        float d[4] = {acc_o(0, 0, 4 * u + j), acc_o(1, 0, 4 * u + j), acc_o(2, 0, 4 * u + j), acc_o(3, 0, 4 * u + j)};
        mma_f16(d, p, b0, b1);
#pragma unroll
        for (int v = 0; v < 4; ++v) acc_o(v, 0, 4 * u + j) = d[v];
      }
    }
  }
}

}  // namespace pagedattn
