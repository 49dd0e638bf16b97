// The writer's fp8 quantisation: stored = saturate_to_finite(x / scale), round to nearest even,
// bit-identical to torch's float8 conversion, applied per 16-byte pack of input (PackConvert).
// Only writers include this header, so tuning it never changes a reader's cache key.
#pragma once

#include "pagedattn/numeric.cuh"

namespace pagedattn {

// stored = saturate_to_finite(x / scale) in the fp8 format, round to nearest even.
template <Fp8Format kFp8>
__device__ __forceinline__ uint8_t quantize_fp8(float x, float scale) {
  static_assert(kFp8 != Fp8Format::kNone, "quantize_fp8 needs an fp8 format");
  constexpr __nv_fp8_interpretation_t kind = kFp8 == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2;
  return __nv_cvt_float_to_fp8(__fdiv_rn(x, scale), __NV_SATFINITE, kind);
}

// x / scale, correctly rounded exactly as __fdiv_rn, from a reciprocal computed once per scale: a
// multiply and two FMAs (Markstein's correction: with inv = RN(1/scale) and q0 = RN(x * inv), the
// residual x - q0 * scale is exact in an FMA and RN(q0 + residual * inv) is the rounded quotient).
// Non-finite results (x = +-inf, overflow, a zero scale) fall back to __fdiv_rn; quotients in the
// float subnormal range may differ by an ulp, which no fp8 format can see (they all quantise to 0).
// The sign of a zero quotient is kept from q0.
// div_by_fast is the finite case alone (no branch): a non-finite result means "ask __fdiv_rn".
__device__ __forceinline__ float div_by_fast(float x, float scale, float inv_scale) {
  float const q0 = __fmul_rn(x, inv_scale);
  float const e = __fmaf_rn(-q0, scale, x);
  float const q1 = __fmaf_rn(e, inv_scale, q0);
  return __int_as_float(__float_as_int(q1) | (__float_as_int(q0) & int(0x80000000u)));
}

__device__ __forceinline__ float div_by(float x, float scale, float inv_scale) {
  float const q = div_by_fast(x, scale, inv_scale);
  return isfinite(q) ? q : __fdiv_rn(x, scale);
}

// Convert 16 bytes of input elements into the cache's element type.
//   kFp8 == kNone: the cache holds the input type; packs are copied bit for bit.
//   otherwise:     each element is quantised with one scale.
template <class Element, class CacheElement, Fp8Format kFp8>
struct PackConvert {
  static constexpr int kPack = 16 / int(sizeof(Element));             // elements per input pack
  static constexpr int kOutBytes = kPack * int(sizeof(CacheElement));  // bytes per output pack
  using InPack = uint4;
  using OutPack = typename Bytes<kOutBytes>::type;
  static_assert(kFp8 != Fp8Format::kNone || sizeof(Element) == sizeof(CacheElement),
                "without fp8 the cache must hold the input element type");

  __device__ __forceinline__ static CacheElement one(Element x, float scale) {
    if constexpr (kFp8 == Fp8Format::kNone) {
      return x;
    } else {
      return quantize_fp8<kFp8>(to_float(x), scale);
    }
  }

  // 1 / scale for pack(): compute it once per scale, not once per pack.
  __device__ __forceinline__ static float inverse(float scale) {
    if constexpr (kFp8 == Fp8Format::kNone) {
      return 1.f;
    } else {
      return __frcp_rn(scale);
    }
  }

  __device__ __forceinline__ static OutPack pack(InPack in, float scale) { return pack(in, scale, inverse(scale)); }

  // inv = inverse(scale). The quotients of a pack are computed without a branch; only a pack with a
  // non-finite one (x = +-inf, overflow, a zero scale: rare) takes __fdiv_rn for all its elements,
  // which gives the same fp8 values (div_by). One branch per pack, not per element, keeps the
  // pack's eight independent quotients in one straight-line block.
  __device__ __forceinline__ static OutPack pack(InPack in, float scale, float inv) {
    if constexpr (kFp8 == Fp8Format::kNone) {
      return in;
    } else {
      // pairs through the fp8x2 conversion (cvt.rn.satfinite.*x2 on sm_89+): the same rounding and
      // saturation as quantize_fp8, half the conversions
      constexpr __nv_fp8_interpretation_t kind = kFp8 == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2;
      Element const* x = reinterpret_cast<Element const*>(&in);
      float q[kPack];
      bool finite = true;
#pragma unroll
      for (int i = 0; i < kPack; ++i) {
        q[i] = div_by_fast(to_float(x[i]), scale, inv);
        finite &= isfinite(q[i]);
      }
      if (!finite) {
#pragma unroll
        for (int i = 0; i < kPack; ++i) q[i] = __fdiv_rn(to_float(x[i]), scale);
      }
      OutPack out;
      __nv_fp8x2_storage_t* o = reinterpret_cast<__nv_fp8x2_storage_t*>(&out);
#pragma unroll
      for (int i = 0; i < kPack / 2; ++i) {
        o[i] = __nv_cvt_float2_to_fp8x2(make_float2(q[2 * i], q[2 * i + 1]), __NV_SATFINITE, kind);
      }
      return out;
    }
  }
  // The same values one element at a time, each with its own rare __fdiv_rn branch: fewer live
  // registers than pack(). The flat write path keeps four packs in flight per thread and is bound by
  // occupancy: on H200 (HND fp8, T=65536) it ran at 60 % of copy with this and 53 % with pack()
  // (64 vs 73 registers), while the span path gained (73 -> 75 %) from pack().
  __device__ __forceinline__ static OutPack pack_serial(InPack in, float scale) {
    if constexpr (kFp8 == Fp8Format::kNone) {
      return in;
    } else {
      constexpr __nv_fp8_interpretation_t kind = kFp8 == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2;
      float const inv = __frcp_rn(scale);
      Element const* x = reinterpret_cast<Element const*>(&in);
      OutPack out;
      __nv_fp8x2_storage_t* o = reinterpret_cast<__nv_fp8x2_storage_t*>(&out);
#pragma unroll
      for (int i = 0; i < kPack / 2; ++i) {
        float2 const q = make_float2(div_by(to_float(x[2 * i]), scale, inv), div_by(to_float(x[2 * i + 1]), scale, inv));
        o[i] = __nv_cvt_float2_to_fp8x2(q, __NV_SATFINITE, kind);
      }
      return out;
    }
  }
};

}  // namespace pagedattn
