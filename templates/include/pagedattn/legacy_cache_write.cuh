// reshape_and_cache (the legacy writer): one CTA per token writes that token's K and V into its slot
// of the legacy layout (legacy_paged_cache.cuh).
//
// The unit of work is one 16-byte K chunk: x elements of one head. A thread converts the chunk's
// input (one or two 16-byte packs, via quantize.cuh's PackConvert) and stores it as one 16-byte K
// chunk; it converts the same x elements of V and stores them one by one, block_size apart (V rows
// are contiguous in tokens, not in d). Inputs whose rows are not 16-byte aligned take a scalar path.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/quantize.cuh"
#include "pagedattn/legacy_paged_cache.cuh"

namespace pagedattn {

struct LegacyCacheWriteParams {
  void const* key;            // [T_pad, H, D], (H, D) dense, token stride key_stride
  void const* value;
  void* key_cache;            // [num_blocks, H, D / x, block_size, x]
  void* value_cache;          // [num_blocks, H, D, block_size]
  void const* slot_mapping;   // [num_tokens] int64 or int32; < 0 skips the token
  float const* k_scale;       // fp8 only: [1]; stored = saturate_to_finite(x / scale)
  float const* v_scale;
  int64_t key_stride;         // elements between tokens of key
  int64_t value_stride;
  LegacyCacheGeometry cache;
  int32_t slot_is_int64;
  int32_t reserved;
};

template <class Element, class CacheElement, Fp8Format kFp8>
__device__ __forceinline__ void legacy_cache_write(LegacyCacheWriteParams const& p) {
  using Cvt = PackConvert<Element, CacheElement, kFp8>;
  using Cache = LegacyPagedCache<CacheElement>;
  constexpr int kX = Cache::kX;                 // elements per K chunk
  constexpr int kPacks = kX / Cvt::kPack;       // 16-byte input packs per chunk: 1, or 2 for fp8
  static_assert(kPacks >= 1 && kX % Cvt::kPack == 0, "a K chunk is a whole number of input packs");

  int64_t const token = blockIdx.x;
  int64_t const slot = p.slot_is_int64 ? static_cast<int64_t const*>(p.slot_mapping)[token]
                                       : int64_t(static_cast<int32_t const*>(p.slot_mapping)[token]);
  Cache const cache{p.cache, static_cast<CacheElement*>(p.key_cache),
                    static_cast<CacheElement*>(p.value_cache)};
  // slot < 0: padding. slot past the cache: corrupt, never written.
  if (!cache.valid_slot(slot)) return;
  int64_t const block = slot / cache.block_size();
  int const offset = int(slot - block * cache.block_size());

  auto const* key = static_cast<Element const*>(p.key) + token * p.key_stride;
  auto const* value = static_cast<Element const*>(p.value) + token * p.value_stride;
  bool const vectorised = (reinterpret_cast<uintptr_t>(key) % 16 == 0) &&
                          (reinterpret_cast<uintptr_t>(value) % 16 == 0);  // uniform over the CTA
  float k_scale = 1.f, v_scale = 1.f;
  if constexpr (kFp8 != Fp8Format::kNone) {
    k_scale = p.k_scale[0];
    v_scale = p.v_scale[0];
  }

  int const D = p.cache.head_size;
  int const chunks_per_head = D / kX;
  int const chunks = p.cache.num_heads * chunks_per_head;
  for (int i = threadIdx.x; i < chunks; i += blockDim.x) {
    int const head = i / chunks_per_head;
    int const chunk = i - head * chunks_per_head;
    Element const* k_src = key + head * D + chunk * kX;
    Element const* v_src = value + head * D + chunk * kX;
    CacheElement* k_dst = cache.k_chunk(block, head, chunk, offset);
    CacheElement* v_dst = cache.v_row(block, head, chunk * kX, offset);
    int const v_step = cache.block_size();  // between rows d and d + 1 of V
    if (vectorised) {
#pragma unroll
      for (int j = 0; j < kPacks; ++j) {
        reinterpret_cast<typename Cvt::OutPack*>(k_dst)[j] =
            Cvt::pack(reinterpret_cast<uint4 const*>(k_src)[j], k_scale);
        uint4 const in = reinterpret_cast<uint4 const*>(v_src)[j];
        Element const* v_in = reinterpret_cast<Element const*>(&in);
#pragma unroll
        for (int e = 0; e < Cvt::kPack; ++e)
          v_dst[(j * Cvt::kPack + e) * v_step] = Cvt::one(v_in[e], v_scale);
      }
    } else {
#pragma unroll
      for (int e = 0; e < kX; ++e) {
        k_dst[e] = Cvt::one(k_src[e], k_scale);
        v_dst[e * v_step] = Cvt::one(v_src[e], v_scale);
      }
    }
  }
}

}  // namespace pagedattn
