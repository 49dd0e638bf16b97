// reshape_and_cache_flash: one CTA per token writes that token's K and V into its slot.
//
// Two paths, chosen per variant:
//   kSpan  (NHD cache, one scale for all heads): the token's H*D elements are contiguous on both
//          sides, so half the CTA copies K's whole span and the other half V's, in 16-byte packs,
//          adjacent threads on adjacent packs.
//   !kSpan (HND cache or per-head scales): a warp per head (heads strided over warps); lanes 0-15
//          copy that head's K packs and lanes 16-31 its V packs, with the head's own scale.
// A pack is 16 bytes of input; the conversion (identity or fp8 quantise) is applied per pack.
// Unaligned bases take scalar steps up to the first aligned pack; the tail is scalar too.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/numeric.cuh"
#include "pagedattn/paged_kv.cuh"

namespace pagedattn {

struct KvWriteParams {
  void const* key;            // [T_pad, H, D], (H, D) dense, token stride key_stride
  void const* value;
  void* key_cache;            // logical [num_blocks, block_size, H, D]
  void* value_cache;
  void const* slot_mapping;   // [num_tokens] int64 or int32; < 0 skips the token
  float const* k_scale;       // fp8 only: [1] or [H]
  float const* v_scale;
  int64_t key_stride;         // elements between tokens of key
  int64_t value_stride;
  CacheGeometry cache;
  int32_t scale_stride;       // 0: one scale, 1: per head
  int32_t slot_is_int64;
};

// Copy n elements src -> dst with the conversion, by `nthreads` cooperating threads.
template <class Cvt, class Element, class CacheElement>
__device__ __forceinline__ void copy_span(Element const* __restrict__ src,
                                          CacheElement* __restrict__ dst, int n, float scale,
                                          int tid, int nthreads) {
  constexpr int kPack = Cvt::kPack;
  // Scalar steps until src is 16-byte aligned; vectorise only if dst is then aligned too.
  int prefix = int(((16 - (reinterpret_cast<uintptr_t>(src) & 15)) & 15) / sizeof(Element));
  prefix = prefix < n ? prefix : n;
  if (reinterpret_cast<uintptr_t>(dst + prefix) % Cvt::kOutBytes != 0) prefix = n;

  for (int i = tid; i < prefix; i += nthreads) dst[i] = Cvt::one(src[i], scale);

  int const packs = (n - prefix) / kPack;
  auto const* __restrict__ src_packs = reinterpret_cast<typename Cvt::InPack const*>(src + prefix);
  auto* __restrict__ dst_packs = reinterpret_cast<typename Cvt::OutPack*>(dst + prefix);
#pragma unroll 4
  for (int i = tid; i < packs; i += nthreads) dst_packs[i] = Cvt::pack(src_packs[i], scale);

  for (int i = prefix + packs * kPack + tid; i < n; i += nthreads) dst[i] = Cvt::one(src[i], scale);
}

template <class Element, class CacheElement, Fp8Format kFp8, bool kSpan>
__device__ __forceinline__ void kv_write(KvWriteParams const& p) {
  using Cvt = PackConvert<Element, CacheElement, kFp8>;
  constexpr bool kQuant = kFp8 != Fp8Format::kNone;

  int64_t const token = blockIdx.x;
  int64_t const slot = p.slot_is_int64 ? static_cast<int64_t const*>(p.slot_mapping)[token]
                                       : int64_t(static_cast<int32_t const*>(p.slot_mapping)[token]);
  PagedCache<CacheElement> const k_cache{p.cache, static_cast<CacheElement*>(p.key_cache)};
  PagedCache<CacheElement> const v_cache{p.cache, static_cast<CacheElement*>(p.value_cache)};
  // slot < 0: padding, no destination. slot >= num_slots: corrupt, never written.
  if (!k_cache.valid_slot(slot)) return;

  auto const* key = static_cast<Element const*>(p.key) + token * p.key_stride;
  auto const* value = static_cast<Element const*>(p.value) + token * p.value_stride;
  int const D = p.cache.head_size;

  if constexpr (kSpan) {
    int const half = blockDim.x / 2;
    bool const is_v = threadIdx.x >= half;
    float scale = 1.f;
    if constexpr (kQuant) scale = is_v ? p.v_scale[0] : p.k_scale[0];
    copy_span<Cvt>(is_v ? value : key, (is_v ? v_cache : k_cache).slot_head(slot, 0),
                   p.cache.num_heads * D, scale, int(threadIdx.x) - (is_v ? half : 0), half);
  } else {
    int const warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
    bool const is_v = lane >= 16;
    for (int h = warp; h < p.cache.num_heads; h += num_warps) {
      float scale = 1.f;
      if constexpr (kQuant) scale = (is_v ? p.v_scale : p.k_scale)[h * p.scale_stride];
      copy_span<Cvt>((is_v ? value : key) + h * D, (is_v ? v_cache : k_cache).slot_head(slot, h), D,
                     scale, lane & 15, 16);
    }
  }
}

}  // namespace pagedattn
