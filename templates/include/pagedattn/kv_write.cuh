// reshape_and_cache_flash: new K/V tokens [T, H, D] into their slots of a paged cache.
//
// Three paths, chosen per variant (host side: pagedattn/ops/kv_write.py, write_path):
//   kSpan  (NHD cache, one scale for all heads): one CTA per token. The token's H*D elements are
//          contiguous on both sides, so half the CTA copies K's whole span and the other half V's,
//          in 16-byte packs, adjacent threads on adjacent packs. Kept as the NHD fallback where flat
//          cannot run (unaligned rows).
//   head   (HND cache or per-head scales): one CTA per token, a warp per head (heads strided over
//          warps); lanes 0-15 copy that head's K packs and lanes 16-31 its V packs, with the head's
//          own scale. Kept as the fallback where flat cannot run (unaligned rows).
//   flat   (the writes the host's table FLAT_FOR names: by default all of them):
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
//          With many tokens the host may instead cap the grid near one resident wave: then each
//          thread streams over its packs in batches, loading batch i + 1 before converting batch i
//          (kv_write_flat_items, kStream; used for fp8, whose per-thread setup is then paid once).
//          Needs every head row 16-byte aligned (D * sizeof(Element) % 16 == 0, aligned base pointers
//          and token strides); the host falls back to span/head otherwise. Indices that can exceed
//          2^31 (pack index, token * stride, slot * strides) are 64-bit.
// A pack is 16 bytes of input; the conversion (identity or fp8 quantise, PackConvert) is applied per
// pack, so all paths store bit-identical values. span/head take scalar steps up to the first aligned
// pack when a base is unaligned, and the tail is scalar too.
// slot < 0 (padding) skips a token; slot >= num_slots (corrupt) is never written.
// Append mode (kAppend variants, flash_attn_with_kvcache's write): no slot_mapping. Token
// b * append_tokens + i is position cache_seqlens[b] + i of request b, whose slot comes from its
// block_table row (append_slot); CTA 0 also writes seqused_out[b] = cache_seqlens[b] + append_tokens,
// the key counts the attention launched next reads.
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
  int32_t const* cache_seqlens;  // append mode only: [batch] keys already cached
  int32_t const* block_table;    // append mode: [batch, table_width], row stride table_stride
  int32_t* seqused_out;          // append mode: [batch] cache_seqlens + append_tokens (written)
  int64_t key_stride;         // elements between tokens of key
  int64_t value_stride;
  CacheGeometry cache;
  int32_t scale_stride;       // 0: one scale, 1: per head
  int32_t slot_is_int64;      // slot_mapping is int64 (else int32)
  int32_t num_tokens;         // tokens to write (the flat path's extent; span/head launch one CTA per token)
  int32_t append_tokens;      // append mode: new tokens per request (num_tokens = batch * append_tokens)
  int32_t table_width;
  int32_t table_stride;
  int32_t batch;
};

// q = n / d for n < 2^63, d < 2^31: 32-bit when n fits (the common case; a 64-bit division is a long
// subroutine, on the critical path of a short write).
__device__ __forceinline__ int64_t div_small(int64_t n, int d) {
  return (n >> 32) == 0 ? int64_t(uint32_t(n) / uint32_t(d)) : n / d;
}

// Append mode's slot of `token`: -1 (skipped) for a position outside its request's block_table row.
// Whatever the table holds, the result is a slot the callers check against num_slots.
__device__ __forceinline__ int64_t append_slot(KvWriteParams const& p, int64_t token) {
  int64_t const b = div_small(token, p.append_tokens);
  int64_t const pos = int64_t(__ldg(p.cache_seqlens + b)) + (token - b * p.append_tokens);
  int const bs = p.cache.block_size;
  if (pos < 0 || pos >= int64_t(p.table_width) * bs) return -1;
  int64_t const blk = div_small(pos, bs);
  int64_t const entry = __ldg(p.block_table + b * p.table_stride + blk);
  return entry < 0 ? -1 : entry * bs + (pos - blk * bs);
}

// Append mode: the key counts of the attention that follows, by CTA 0.
__device__ __forceinline__ void write_seqused(KvWriteParams const& p) {
  if (blockIdx.x != 0) return;
  for (int b = threadIdx.x; b < p.batch; b += blockDim.x) p.seqused_out[b] = __ldg(p.cache_seqlens + b) + p.append_tokens;
}

template <bool kAppend>
__device__ __forceinline__ int64_t load_slot(KvWriteParams const& p, int64_t token) {
  if constexpr (kAppend) return append_slot(p, token);
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

template <class Element, class CacheElement, Fp8Format kFp8, bool kSpan, bool kAppend = false>
__device__ __forceinline__ void kv_write(KvWriteParams const& p) {
  using Cvt = PackConvert<Element, CacheElement, kFp8>;
  constexpr bool kQuant = kFp8 != Fp8Format::kNone;

  int64_t const token = blockIdx.x;
  int64_t const slot = load_slot<kAppend>(p, token);
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

// A position in the flat space as mixed-radix digits (token, row = K/V * H + head, unit in row; a unit
// is one pack, or kVec packs for the streaming items below: row_packs then counts units), and a fixed
// step between a thread's units in the same digits: the start and the step are split once (the only
// divisions), each advance adds the step's digits with carries -- the integer work per unit stays
// small next to the fp8 conversion.
struct FlatCursor {
  int64_t token;
  int row, pack;
  int step_tokens, step_rows, step_packs;
  int rows, row_packs;

  __device__ __forceinline__ FlatCursor(int64_t first, int step, int rows_, int row_packs_)
      : rows(rows_), row_packs(row_packs_) {
    int const token_packs = rows * row_packs;
    token = div_small(first, token_packs);
    int const rest = int(first - token * token_packs);
    row = rest / row_packs;
    pack = rest - row * row_packs;
    step_tokens = step / token_packs;
    int const step_rest = step - step_tokens * token_packs;
    step_rows = step_rest / row_packs;
    step_packs = step_rest - step_rows * row_packs;
  }

  __device__ __forceinline__ void advance() {
    pack += step_packs;
    int carry = pack >= row_packs;
    pack -= carry ? row_packs : 0;
    row += step_rows + carry;
    carry = row >= rows;
    row -= carry ? rows : 0;
    token += step_tokens + carry;
  }
};

// kVec consecutive 16-byte input packs of one head row (an "item" of the flat path) between their load
// and their store. kVec = 2 shares the slot id, the addresses and the cursor step between two packs and
// stores an fp8 item with one 16-byte store.
template <class Cvt, int kVec>
struct FlatItem {
  typename Cvt::InPack in[kVec];
  int64_t slot;  // < 0: nothing to store (padding, or past the last token)
  float scale;   // per-head scales only (one scale: loaded once per thread)
  int row, unit; // head row (K/V * H + head) and item index within it
};

// Issue the loads of the item at `cur` (slot id, per-head scale, input packs): nothing waits on them here.
template <class Cvt, bool kQuant, class Element, int kVec, bool kAppend>
__device__ __forceinline__ void flat_load(KvWriteParams const& p, FlatCursor const& cur, int64_t num_tokens,
                                          FlatItem<Cvt, kVec>& it) {
  int const H = p.cache.num_heads;
  it.row = cur.row;
  it.unit = cur.pack;
  it.slot = -1;
  it.scale = 1.f;
#pragma unroll
  for (int v = 0; v < kVec; ++v) it.in[v] = typename Cvt::InPack{};
  if (cur.token < num_tokens) {
    bool const is_v = cur.row >= H;
    int const head = is_v ? cur.row - H : cur.row;
    it.slot = load_slot<kAppend>(p, cur.token);
    if constexpr (kQuant) {
      if (p.scale_stride != 0) it.scale = __ldg((is_v ? p.v_scale : p.k_scale) + head);
    }
    Element const* src = static_cast<Element const*>(is_v ? p.value : p.key) +
                         cur.token * (is_v ? p.value_stride : p.key_stride) + head * p.cache.head_size;
    auto const* packs = reinterpret_cast<typename Cvt::InPack const*>(src) + cur.pack * kVec;
#pragma unroll
    for (int v = 0; v < kVec; ++v) it.in[v] = __ldg(packs + v);
  }
}

// Convert and store one loaded item. slot < 0 and slot >= num_slots (corrupt) are skipped.
// k_scale/v_scale and their inverses: the one scale of each (when p.scale_stride == 0).
template <class Cvt, bool kQuant, class CacheElement, int kVec>
__device__ __forceinline__ void flat_store(KvWriteParams const& p, int block_shift, float2 k_scale, float2 v_scale,
                                           FlatItem<Cvt, kVec> const& it) {
  using OutPack = typename Cvt::OutPack;
  if (it.slot < 0 || it.slot >= p.cache.num_slots) return;
  int const H = p.cache.num_heads;
  bool const is_v = it.row >= H;
  float scale = 1.f, inv = 1.f;
  if constexpr (kQuant) {
    if (p.scale_stride == 0) {
      float2 const one = is_v ? v_scale : k_scale;
      scale = one.x;
      inv = one.y;
    } else {
      scale = it.scale;
      inv = Cvt::inverse(scale);
    }
  }
  CacheElement* dst = static_cast<CacheElement*>(is_v ? p.value_cache : p.key_cache) +
                      slot_head_offset(p.cache, block_shift, it.slot, is_v ? it.row - H : it.row);
  constexpr int kItemOutBytes = kVec * int(sizeof(OutPack));
  if constexpr (kItemOutBytes <= 16) {  // one store for the item (fp8 pairs: 16 bytes)
    using ItemOut = typename Bytes<kItemOutBytes>::type;
    ItemOut out;
    OutPack* o = reinterpret_cast<OutPack*>(&out);
#pragma unroll
    for (int v = 0; v < kVec; ++v) o[v] = Cvt::pack(it.in[v], scale, inv);
    reinterpret_cast<ItemOut*>(dst)[it.unit] = out;
  } else {
#pragma unroll
    for (int v = 0; v < kVec; ++v) reinterpret_cast<OutPack*>(dst)[it.unit * kVec + v] = Cvt::pack(it.in[v], scale, inv);
  }
}

// The flat path (see the top of the file), one thread's packs. Two schedules, both over the same
// cursor:
//   kStream == false: kItems packs, kItems exact. The CTA covers packs
//       [blockIdx.x, blockIdx.x + 1) * blockDim.x * kItems, thread t its packs t, t + blockDim.x, ...;
//       every load is issued before the first store (straight-line code, all kItems in flight).
//   kStream == true: a grid that does not cover the packs (the host caps it near one resident wave):
//       thread g of the grid takes packs g, g + grid threads, ... in batches of kItems, and issues the
//       loads of batch i + 1 before it converts and stores batch i (two register buffers, ping-pong).
//       Loads stay in flight while the fp8 conversion runs, where the one-shot schedule alternates
//       "all waiting" and "all converting".
template <class Element, class CacheElement, Fp8Format kFp8, int kItems, bool kStream, bool kAppend, int kVec = 1>
__device__ __forceinline__ void kv_write_flat_items(KvWriteParams const& p, int64_t num_tokens) {
  using Cvt = PackConvert<Element, CacheElement, kFp8>;
  using Item = FlatItem<Cvt, kVec>;
  constexpr bool kQuant = kFp8 != Fp8Format::kNone;

  // one scale for all heads (and its inverse, once): loaded first, in flight with everything else
  float2 k_scale{1.f, 1.f}, v_scale{1.f, 1.f};
  if constexpr (kQuant) {
    if (p.scale_stride == 0) {
      k_scale.x = __ldg(p.k_scale);
      v_scale.x = __ldg(p.v_scale);
    }
  }
  auto invert = [&] {  // after the loads are issued
    if constexpr (kQuant) {
      if (p.scale_stride == 0) {
        k_scale.y = Cvt::inverse(k_scale.x);
        v_scale.y = Cvt::inverse(v_scale.x);
      }
    }
  };
  int const rows = 2 * p.cache.num_heads;                 // K's H head rows, then V's
  // items per head row (D * sizeof(Element) % 16 == 0; kVec = 2 only when the packs pair up)
  int const row_packs = p.cache.head_size / (Cvt::kPack * kVec);
  int const bs = p.cache.block_size;
  int const block_shift = (bs & (bs - 1)) == 0 ? __ffs(bs) - 1 : -1;

  if constexpr (!kStream) {
    FlatCursor cur(int64_t(blockIdx.x) * blockDim.x * kItems + threadIdx.x, int(blockDim.x), rows, row_packs);
    Item it[kItems];
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      if (i > 0) cur.advance();
      flat_load<Cvt, kQuant, Element, kVec, kAppend>(p, cur, num_tokens, it[i]);
    }
    invert();
#pragma unroll
    for (int i = 0; i < kItems; ++i) flat_store<Cvt, kQuant, CacheElement, kVec>(p, block_shift, k_scale, v_scale, it[i]);
  } else {
    FlatCursor cur(int64_t(blockIdx.x) * blockDim.x + threadIdx.x, int(gridDim.x * blockDim.x), rows, row_packs);
    Item a[kItems], b[kItems];
    auto load = [&](Item (&batch)[kItems]) {
#pragma unroll
      for (int i = 0; i < kItems; ++i) {
        flat_load<Cvt, kQuant, Element, kVec, kAppend>(p, cur, num_tokens, batch[i]);
        cur.advance();
      }
    };
    auto store = [&](Item const (&batch)[kItems]) {
#pragma unroll
      for (int i = 0; i < kItems; ++i) flat_store<Cvt, kQuant, CacheElement, kVec>(p, block_shift, k_scale, v_scale, batch[i]);
    };
    load(a);
    invert();
    while (true) {  // cur: the first pack not loaded yet
      bool more = cur.token < num_tokens;
      if (more) load(b);
      store(a);
      if (!more) break;
      more = cur.token < num_tokens;
      if (more) load(a);
      store(b);
      if (!more) break;
    }
  }
}

// The flat path's entry. Launch: any blockDim.x <= 512 that is a multiple of 32 and a 1-D grid. With
// packs = num_tokens * 2 * H * D / kPack and `items` = ceil(packs / (gridDim.x * blockDim.x)) (the
// kernel compares, it does not divide), the body compiled for 1, 2 or kMaxItems packs per thread runs
// (the smallest that is enough; CTAs past the end find no token), and a grid too small for kMaxItems
// takes the streaming schedule (compiled when kStreamItems > 0: its batch size; the host caps the grid
// only for such variants; without it the grid must cover the packs). So the host picks the schedule at launch through the grid size: fewer
// packs per thread with few tokens, a capped grid (stream) or one CTA per kMaxItems * blockDim packs.
template <class Element, class CacheElement, Fp8Format kFp8, int kMaxItems, int kStreamItems, bool kAppend = false>
__device__ __forceinline__ void kv_write_flat(KvWriteParams const& p) {
  static_assert(kMaxItems >= 2, "kMaxItems: 2 or more");
  static_assert(kStreamItems >= 0, "kStreamItems: 0 (no streaming body) or the packs per batch");
  int64_t const num_tokens = p.num_tokens;
  int64_t const packs = num_tokens * (2 * p.cache.num_heads * p.cache.head_size /
                                      PackConvert<Element, CacheElement, kFp8>::kPack);
  int64_t const grid_threads = int64_t(gridDim.x) * blockDim.x;  // the same in every thread
  if (packs <= grid_threads) {
    kv_write_flat_items<Element, CacheElement, kFp8, 1, false, kAppend>(p, num_tokens);
  } else if (packs <= 2 * grid_threads) {
    kv_write_flat_items<Element, CacheElement, kFp8, 2, false, kAppend>(p, num_tokens);
  } else if (kStreamItems == 0 || packs <= kMaxItems * grid_threads) {
    kv_write_flat_items<Element, CacheElement, kFp8, kMaxItems, false, kAppend>(p, num_tokens);
  } else if constexpr (kStreamItems > 0) {
    // items of two packs where head rows have an even number of packs and every cache row starts on a
    // multiple of the item's output (fp8: one 16-byte store each; the host checks the base pointers)
    using Cvt = PackConvert<Element, CacheElement, kFp8>;
    int64_t const strides = (p.cache.block_stride | p.cache.page_stride | p.cache.head_stride) *
                            int64_t(sizeof(CacheElement));
    if ((p.cache.head_size / Cvt::kPack) % 2 == 0 && strides % (2 * sizeof(typename Cvt::OutPack)) == 0) {
      kv_write_flat_items<Element, CacheElement, kFp8, kStreamItems, true, kAppend, 2>(p, num_tokens);
    } else {
      kv_write_flat_items<Element, CacheElement, kFp8, kStreamItems, true, kAppend, 1>(p, num_tokens);
    }
  }
}

}  // namespace pagedattn
