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

// The same widening in integer and 16-bit multiply ops only, for the warp-specialised prefill's
// producer warps (whose conversions would otherwise pace the consumers): each fp8 byte is moved to
// the top of a 16-bit lane (PRMT), its exponent and mantissa shifted into the 16-bit type's fields
// (SHF + LOP3), and the exponent bias corrected by one exact power-of-two multiply, which also turns
// the fp8 subnormals into normal 16-bit values. Exact for every finite value; the fp8 NaN (and e5m2
// infinity) encodings come out as finite values (the cache writer saturates and never stores them).
template <bool kToBf16, Fp8Format kFp8>
__device__ __forceinline__ uint32_t widen_fp8x2_bits(uint32_t top) {  // top: the 2 bytes in bits 8-15, 24-31
  constexpr bool kE4M3 = kFp8 == Fp8Format::kE4M3;
  // exponent + mantissa (7 bits) placed so that the fp8 mantissa heads the 16-bit one
  constexpr int kShift = kToBf16 ? (kE4M3 ? 4 : 3) : (kE4M3 ? 1 : 0);
  constexpr uint32_t kField = (0x7f00u >> kShift) * 0x10001u;
  uint32_t const w = (top & 0x80008000u) | ((top >> kShift) & kField);
  if constexpr (!kToBf16 && !kE4M3) {
    return w;  // e5m2 is the top byte of an fp16
  } else if constexpr (kToBf16) {
    // 2^(127 - 7) for e4m3, 2^(127 - 15) for e5m2, as bf16
    constexpr uint32_t kBias = (kE4M3 ? 0x7B80u : 0x7780u) * 0x10001u;
    __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162 const*>(&w),
                               *reinterpret_cast<__nv_bfloat162 const*>(&kBias));
    return *reinterpret_cast<uint32_t*>(&r);
  } else {
    constexpr uint32_t kBias = 0x5C00u * 0x10001u;  // 2^(15 - 7) as fp16
    __half2 r = __hmul2(*reinterpret_cast<__half2 const*>(&w), *reinterpret_cast<__half2 const*>(&kBias));
    return *reinterpret_cast<uint32_t*>(&r);
  }
}

template <bool kToBf16, Fp8Format kFp8>
__device__ __forceinline__ void widen_fp8x16_bits(uint4 raw, uint4& lo, uint4& hi) {
  static_assert(kFp8 != Fp8Format::kNone, "widen_fp8x16_bits needs an fp8 format");
  uint32_t const in[4] = {raw.x, raw.y, raw.z, raw.w};
  uint32_t words[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    words[2 * i] = widen_fp8x2_bits<kToBf16, kFp8>(__byte_perm(in[i], 0u, 0x1404));      // bytes 0, 1
    words[2 * i + 1] = widen_fp8x2_bits<kToBf16, kFp8>(__byte_perm(in[i], 0u, 0x3424));  // bytes 2, 3
  }
  lo = make_uint4(words[0], words[1], words[2], words[3]);
  hi = make_uint4(words[4], words[5], words[6], words[7]);
}

}  // namespace pagedattn
