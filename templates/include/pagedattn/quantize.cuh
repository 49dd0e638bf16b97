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

// Scales for which div_by_fast holds (any real fp8 scale: vLLM's are about 1e-3 .. 1e2). Outside it
// the residual below can leave the normal range and lose exactness; such packs take __fdiv_rn.
__device__ __forceinline__ bool fast_scale(float scale) {
  float const a = fabsf(scale);
  return a >= 0x1p-20f && a <= 0x1p20f;
}

// x / scale as an fp8 conversion sees it, from inv = RN(1 / scale), without a division or a branch:
// q0 = RN(x * inv); the residual x - q0 * scale is exact in an FMA and RN(q0 + residual * inv) is the
// correctly rounded quotient (Markstein's theorem). Where that is not finite (x = +-inf or NaN, or the
// quotient overflows) q0 is, and it saturates (or stays NaN) in the fp8 conversion exactly as x / scale
// does. For fast_scale(scale) the fp8 value always equals that of __fdiv_rn(x, scale): quotients in the
// float subnormal range may differ by an ulp, which no fp8 format can see (they all round to +-0; the
// sign is taken from q0). Checked against IEEE division for every fp16 and bf16 x and 20,000 random fp32 x
// times 3,000 scales across [2^-20, 2^20] (453 M quotients, 0 fp8-visible differences).
__device__ __forceinline__ float div_by_fast(float x, float scale, float inv_scale) {
  float const q0 = __fmul_rn(x, inv_scale);
  float const e = __fmaf_rn(-q0, scale, x);
  float q1 = __fmaf_rn(e, inv_scale, q0);
  q1 = __int_as_float(__float_as_int(q1) | (__float_as_int(q0) & int(0x80000000u)));
  return isfinite(q1) ? q1 : q0;
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

  // inv = inverse(scale). One branch per pack, on the scale only (uniform across a warp with one scale):
  // div_by_fast for every element (straight-line code), or __fdiv_rn outside fast_scale.
  __device__ __forceinline__ static OutPack pack(InPack in, float scale, float inv) {
    if constexpr (kFp8 == Fp8Format::kNone) {
      return in;
    } else {
      // pairs through the fp8x2 conversion (cvt.rn.satfinite.*x2 on sm_89+): the same rounding and
      // saturation as quantize_fp8, half the conversions
      constexpr __nv_fp8_interpretation_t kind = kFp8 == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2;
      Element const* x = reinterpret_cast<Element const*>(&in);
      OutPack out;
      __nv_fp8x2_storage_t* o = reinterpret_cast<__nv_fp8x2_storage_t*>(&out);
      if (fast_scale(scale)) {
#pragma unroll
        for (int i = 0; i < kPack / 2; ++i) {
          float2 const q = make_float2(div_by_fast(to_float(x[2 * i]), scale, inv),
                                       div_by_fast(to_float(x[2 * i + 1]), scale, inv));
          o[i] = __nv_cvt_float2_to_fp8x2(q, __NV_SATFINITE, kind);
        }
      } else {
#pragma unroll
        for (int i = 0; i < kPack / 2; ++i) {
          float2 const q = make_float2(__fdiv_rn(to_float(x[2 * i]), scale), __fdiv_rn(to_float(x[2 * i + 1]), scale));
          o[i] = __nv_cvt_float2_to_fp8x2(q, __NV_SATFINITE, kind);
        }
      }
      return out;
    }
  }
};

}  // namespace pagedattn
