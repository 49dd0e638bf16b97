// reshape_and_cache_flash: new K/V tokens [T, H, D] into their slots of a paged cache.
//
// Three paths, chosen per variant (host side: pagedattn/ops/kv_write.py, write_path):
//   kSpan  (NHD cache, one scale for all heads): one CTA per token. The token's H*D elements are
//          contiguous on both sides, so half the CTA copies K's whole span and the other half V's,
//          in 16-byte packs, adjacent threads on adjacent packs. Kept for NHD fp8 with one scale
//          (fastest there: one slot id and one scale serve each thread's 4 packs) and as a fallback.
//   head   (HND cache or per-head scales): one CTA per token, a warp per head (heads strided over
//          warps); lanes 0-15 copy that head's K packs and lanes 16-31 its V packs, with the head's
//          own scale. Kept as the fallback where flat cannot run (unaligned rows).
//   flat   (the writes the host's table FLAT_FOR names: by default all but NHD fp8 with one scale):
//          no CTA per token.
//          The work is the flat index space of 16-byte input packs, token-major: (token, K/V, head,
//          pack within the head row). A CTA takes items * blockDim consecutive packs, thread t its
//          packs t, t + blockDim, ... (items: 1, 2 or kItems, picked by the host through the grid
//          size), so a warp reads 512 contiguous input bytes per item and writes whole head rows
//          (256-byte runs for D=128 bf16) in either cache layout. Each thread first issues ALL its
//          loads (slot ids, scales, K/V packs: `items` independent requests in flight), then converts
//          and stores. span/head instead wait for the slot id, then load one pack per lane, then
//          store, head after head: with many tokens that latency chain, not the scattered
//          destinations, is what limits them (random and page-contiguous slots measure the same).
//          Needs every head row 16-byte aligned (D * sizeof(Element) % 16 == 0, aligned base pointers
//          and token strides); the host falls back to span/head otherwise. Indices that can exceed
//          2^31 (pack index, token * stride, slot * strides) are 64-bit.
// A pack is 16 bytes of input; the conversion (identity or fp8 quantise, PackConvert) is applied per
// pack, so all paths store bit-identical values. span/head take scalar steps up to the first aligned
// pack when a base is unaligned, and the tail is scalar too.
// slot < 0 (padding) skips a token; slot >= num_slots (corrupt) is never written.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/quantize.cuh"
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
  int32_t slot_is_int64;      // slot_mapping is int64 (else int32)
  int32_t num_tokens;         // tokens to write (the flat path's extent; span/head launch one CTA per token)
};

__device__ __forceinline__ int64_t load_slot(KvWriteParams const& p, int64_t token) {
  return p.slot_is_int64 ? __ldg(static_cast<int64_t const*>(p.slot_mapping) + token)
                               : int64_t(__ldg(static_cast<int32_t const*>(p.slot_mapping) + token));
}

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
  float const inv = Cvt::inverse(scale);
#pragma unroll 4
  for (int i = tid; i < packs; i += nthreads) dst_packs[i] = Cvt::pack(src_packs[i], scale, inv);

  for (int i = prefix + packs * kPack + tid; i < n; i += nthreads) dst[i] = Cvt::one(src[i], scale);
}

template <class Element, class CacheElement, Fp8Format kFp8, bool kSpan>
__device__ __forceinline__ void kv_write(KvWriteParams const& p) {
  using Cvt = PackConvert<Element, CacheElement, kFp8>;
  constexpr bool kQuant = kFp8 != Fp8Format::kNone;

  int64_t const token = blockIdx.x;
  int64_t const slot = load_slot(p, token);
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

// (block, offset in block) of a slot in [0, num_slots) -> element offset of its head `head`. The
// division by block_size is a shift for power-of-two block sizes (block_shift >= 0) and 32-bit whenever
// the slot fits (caches below 2^31 slots); block * block_stride etc. are 64-bit.
__device__ __forceinline__ int64_t slot_head_offset(CacheGeometry const& g, int block_shift, int64_t slot,
                                                    int head) {
  int64_t block, offset;
  if (block_shift >= 0) {
    block = slot >> block_shift;
    offset = slot & (g.block_size - 1);
  } else if (slot <= int64_t(0x7fffffff)) {
    uint32_t const b = uint32_t(slot) / uint32_t(g.block_size);
    block = b;
    offset = int64_t(uint32_t(slot) - b * uint32_t(g.block_size));
  } else {
    block = slot / g.block_size;
    offset = slot - block * g.block_size;
  }
  return block * g.block_stride + offset * g.page_stride + int64_t(head) * g.head_stride;
}

// One thread's kItems packs of the flat path, kItems exact (a compile-time count: the loops unroll
// into straight-line code and the compiler issues every load up front). The CTA covers packs
// [blockIdx.x, blockIdx.x + 1) * blockDim.x * kItems.
// A pack index is kept as mixed-radix digits (token, row = K/V * H + head, pack in row): the thread's
// first pack and the step blockDim.x are split once (the only divisions), each further item adds the
// step's digits with carries -- the integer work per pack stays small next to the fp8 conversion.
template <class Element, class CacheElement, Fp8Format kFp8, int kItems>
__device__ __forceinline__ void kv_write_flat_items(KvWriteParams const& p, int64_t num_tokens) {
  using Cvt = PackConvert<Element, CacheElement, kFp8>;
  using InPack = typename Cvt::InPack;
  using OutPack = typename Cvt::OutPack;
  constexpr bool kQuant = kFp8 != Fp8Format::kNone;

  // one scale for all heads: loaded first, in flight with everything else
  float k_scale = 1.f, v_scale = 1.f;
  if constexpr (kQuant) {
    if (p.scale_stride == 0) {
      k_scale = __ldg(p.k_scale);
      v_scale = __ldg(p.v_scale);
    }
  }

  int const H = p.cache.num_heads, D = p.cache.head_size;
  int const row_packs = D / Cvt::kPack;  // packs per head row (D * sizeof(Element) % 16 == 0)
  int const rows = 2 * H;                 // K's H head rows, then V's
  int const token_packs = rows * row_packs;

  // digits of the thread's first pack, and of the step between its items
  int64_t const first = int64_t(blockIdx.x) * blockDim.x * kItems;
  int64_t token = first / token_packs;
  int rest = int(first - token * token_packs) + int(threadIdx.x);  // < token_packs + blockDim.x
  token += rest / token_packs;
  rest %= token_packs;
  int row = rest / row_packs, pack = rest - row * row_packs;
  int const step_tokens = int(blockDim.x) / token_packs;
  int const step_rest = int(blockDim.x) - step_tokens * token_packs;
  int const step_rows = step_rest / row_packs, step_packs = step_rest - step_rows * row_packs;

  int64_t slot[kItems];
  int head[kItems], pk[kItems];
  bool is_v[kItems];
  InPack in[kItems];
  float scale[kItems];

  // 1. every load: slot ids, per-head scales and K/V packs, all independent of each other.
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    if (i > 0) {  // + blockDim.x packs
      pack += step_packs;
      int carry = pack >= row_packs;
      pack -= carry ? row_packs : 0;
      row += step_rows + carry;
      carry = row >= rows;
      row -= carry ? rows : 0;
      token += step_tokens + carry;
    }
    is_v[i] = row >= H;
    head[i] = is_v[i] ? row - H : row;
    pk[i] = pack;
    slot[i] = -1;
    scale[i] = 1.f;
    in[i] = InPack{};
    if (token < num_tokens) {  // past the last token: nothing to read or write
      slot[i] = load_slot(p, token);
      if constexpr (kQuant) {
        if (p.scale_stride != 0) scale[i] = __ldg((is_v[i] ? p.v_scale : p.k_scale) + head[i]);
      }
      Element const* src = static_cast<Element const*>(is_v[i] ? p.value : p.key) +
                           token * (is_v[i] ? p.value_stride : p.key_stride) + head[i] * D;
      in[i] = __ldg(reinterpret_cast<InPack const*>(src) + pack);
    }
  }
  int const bs = p.cache.block_size;
  int const block_shift = (bs & (bs - 1)) == 0 ? __ffs(bs) - 1 : -1;

  // 2. convert and store. slot < 0 (padding, or past the last token) and slot >= num_slots: skipped.
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    if (slot[i] < 0 || slot[i] >= p.cache.num_slots) continue;
    if constexpr (kQuant) {
      if (p.scale_stride == 0) scale[i] = is_v[i] ? v_scale : k_scale;
    }
    CacheElement* dst = static_cast<CacheElement*>(is_v[i] ? p.value_cache : p.key_cache) +
                        slot_head_offset(p.cache, block_shift, slot[i], head[i]);
    reinterpret_cast<OutPack*>(dst)[pk[i]] = Cvt::pack_serial(in[i], scale[i]);  // fewest registers
  }
}

// The flat path (see the top of the file). Launch: any blockDim.x <= 512 that is a multiple of 32, and a
// 1-D grid of ceil(packs / (items * blockDim.x)) CTAs for some items in [1, kMaxItems], packs =
// num_tokens * 2 * H * D / kPack. The kernel reads items back as ceil(packs / (gridDim.x * blockDim.x))
// and runs the body compiled for 1, 2 or kMaxItems packs per thread (the smallest that is enough; any
// count >= items covers every pack, CTAs past the end find no token). So the host picks the packs per
// thread at launch: fewer with few tokens, to spread them over more threads.
template <class Element, class CacheElement, Fp8Format kFp8, int kMaxItems>
__device__ __forceinline__ void kv_write_flat(KvWriteParams const& p) {
  static_assert(kMaxItems >= 2, "kMaxItems: 2 or more");
  int64_t const num_tokens = p.num_tokens;
  int64_t const packs = num_tokens * (2 * p.cache.num_heads * p.cache.head_size /
                                      PackConvert<Element, CacheElement, kFp8>::kPack);
  int64_t const grid_threads = int64_t(gridDim.x) * blockDim.x;
  int64_t const items = (packs + grid_threads - 1) / grid_threads;  // the same in every thread
  if (items <= 1) {
    kv_write_flat_items<Element, CacheElement, kFp8, 1>(p, num_tokens);
  } else if (kMaxItems > 2 && items > 2) {
    kv_write_flat_items<Element, CacheElement, kFp8, kMaxItems>(p, num_tokens);
  } else {
    kv_write_flat_items<Element, CacheElement, kFp8, 2>(p, num_tokens);
  }
}

}  // namespace pagedattn
