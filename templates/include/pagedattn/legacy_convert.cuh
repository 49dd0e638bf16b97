// Reading cache elements as float, and writing float results back as the output element type.
// The legacy reader's counterpart of quantize.cuh's PackConvert (which quantises on the write side).
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/numeric.cuh"

namespace pagedattn {

// The two-element vector type of a 16-bit element (converted to float2 in one instruction).
template <class Element> struct PairOf;
template <> struct PairOf<__half> { using type = __half2; };
template <> struct PairOf<__nv_bfloat16> { using type = __nv_bfloat162; };

__device__ __forceinline__ float2 to_float2(__half2 x) { return __half22float2(x); }
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 x) { return __bfloat1622float2(x); }

// N consecutive cache elements at `src` as floats, read in ONE access of N * sizeof(CacheElement)
// bytes (src must be aligned to that). fp8 values come out unscaled: the per-tensor scale is folded
// into the caller's constants.
template <class CacheElement, Fp8Format kFp8, int N>
__device__ __forceinline__ void load_as_float(CacheElement const* src, float (&out)[N]) {
  static_assert(N % 2 == 0, "load_as_float converts pairs");
  using Raw = typename Bytes<N * int(sizeof(CacheElement))>::type;
  Raw const raw = *reinterpret_cast<Raw const*>(src);
  if constexpr (kFp8 == Fp8Format::kNone) {
    using Pair = typename PairOf<CacheElement>::type;
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      float2 const f = to_float2(reinterpret_cast<Pair const*>(&raw)[i / 2]);
      out[i] = f.x;
      out[i + 1] = f.y;
    }
  } else {
    constexpr __nv_fp8_interpretation_t kind = kFp8 == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2;
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      __nv_fp8x2_storage_t const pair = reinterpret_cast<__nv_fp8x2_storage_t const*>(&raw)[i / 2];
      float2 const f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, kind)));
      out[i] = f.x;
      out[i + 1] = f.y;
    }
  }
}

// float -> output element, round to nearest even. Outputs are fp16 or bf16.
template <class Element> __device__ Element from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

}  // namespace pagedattn
