// Element types and conversions shared by the writer and the readers: fp8 formats, 16-byte packs,
// fp8 dequantise. The writer's quantisation is in quantize.cuh.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace pagedattn {

enum class Fp8Format : int { kNone = 0, kE4M3 = 1, kE5M2 = 2 };

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

// Unsigned integer type of exactly N bytes, used to move packs as one access.
template <int N> struct Bytes;
template <> struct Bytes<16> { using type = uint4; };
template <> struct Bytes<8>  { using type = uint2; };
template <> struct Bytes<4>  { using type = uint32_t; };
template <> struct Bytes<2>  { using type = uint16_t; };

// 16 fp8 values (one 16-byte load) -> 16 fp16 or bf16 values (two 16-byte stores). Exact: every e4m3 and e5m2
// value is representable in fp16 and bf16. Scales are applied elsewhere (folded into softmax / output).
template <bool kToBf16, Fp8Format kFp8>
__device__ __forceinline__ void dequant_fp8x16(uint4 raw, uint4& lo, uint4& hi) {
  static_assert(kFp8 != Fp8Format::kNone, "dequant_fp8x16 needs an fp8 format");
  constexpr __nv_fp8_interpretation_t kind = kFp8 == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2;
  __nv_fp8x2_storage_t const* in = reinterpret_cast<__nv_fp8x2_storage_t const*>(&raw);
  uint32_t words[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(in[i], kind);
    if constexpr (kToBf16) {
      __half2 hh = *reinterpret_cast<__half2*>(&h);
      __nv_bfloat162 b = __float22bfloat162_rn(__half22float2(hh));
      words[i] = *reinterpret_cast<uint32_t*>(&b);
    } else {
      words[i] = uint32_t(h.x) | (uint32_t(h.y) << 16);
    }
  }
  lo = make_uint4(words[0], words[1], words[2], words[3]);
  hi = make_uint4(words[4], words[5], words[6], words[7]);
}

// 16 e5m2 values -> 16 fp16 values by byte moves alone (PRMT): an e5m2 value's byte is the top byte of
// the same value's fp16, exactly, NaN and infinity included (the warp-specialised prefill's producer).
__device__ __forceinline__ void widen_e5m2x16_half(uint4 raw, uint4& lo, uint4& hi) {
  uint32_t const in[4] = {raw.x, raw.y, raw.z, raw.w};
  uint32_t words[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    words[2 * i] = __byte_perm(in[i], 0u, 0x1404);      // bytes 0, 1 into bits 8-15, 24-31
    words[2 * i + 1] = __byte_perm(in[i], 0u, 0x3424);  // bytes 2, 3
  }
  lo = make_uint4(words[0], words[1], words[2], words[3]);
  hi = make_uint4(words[4], words[5], words[6], words[7]);
}

// 16 fp8 values -> 16 fp16 values as the warp-specialised prefill widens them: e4m3 pairs by the
// hardware conversion, e5m2 by byte moves.
template <Fp8Format kFp8>
__device__ __forceinline__ void widen_fp8x16_half(uint4 raw, uint4& lo, uint4& hi) {
  if constexpr (kFp8 == Fp8Format::kE4M3) {
    dequant_fp8x16<false, kFp8>(raw, lo, hi);
  } else {
    widen_e5m2x16_half(raw, lo, hi);
  }
}

}  // namespace pagedattn
