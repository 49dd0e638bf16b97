// FlashAttention forward over a paged KV cache (SM80-class tensor cores; runs on sm_80 ... sm_90).
//
// Grid: (num_seqs * num_kv_heads, m_blocks, num_splits). A CTA owns kBlockM packed rows of one
// (request, kv head) (see attn_traits.cuh), and one split of the request's visible KV range
// (tile_scheduler.cuh).
// Per stage of kStageKeys keys:
//   1. load the stage kStages-1 ahead (cp.async by the whole CTA, or TMA by each warp into its own
//      ring, see attn_traits.cuh); rows are located through PagedKV (block_table lives there);
//   2. fp8 caches: widen the stage to Element in shared memory, or (kFp8Regs) convert each thread's
//      MMA operands in registers (attn_fp8_regs.cuh); scales are folded in later;
//   3. each warp group: S = Q K^T on its sub-tile, mask only if the sub-tile crosses the causal
//      diagonal or the end of the sequence, online softmax, O += P V.
//      On sm_90a prefill (Traits::kWgmma) each warpgroup does both products with wgmma instead of
//      SM80 MMAs (attn_wgmma.cuh); loading, masking, softmax and the epilogue are shared.
// Epilogue: warp groups merge their (m, l, O) through shared memory; write O and LSE, or a split's
// partial (O, LSE) in fp32. The last split of a tile to finish (arrival counter per tile) merges
// the partials into O and LSE (split_combine.cuh).
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/attn_params.cuh"
#include "pagedattn/attn_traits.cuh"
#include "pagedattn/attn_fp8_regs.cuh"
#include "pagedattn/async_copy.cuh"
#include "pagedattn/tma_copy.cuh"
#include "pagedattn/paged_kv.cuh"
#include "pagedattn/tile_scheduler.cuh"
#include "pagedattn/mask.cuh"
#include "pagedattn/softmax.cuh"
#include "pagedattn/softmax_merge.cuh"
#include "pagedattn/split_combine.cuh"
#if PAGEDATTN_WGMMA
#include "pagedattn/attn_wgmma.cuh"
#endif

namespace pagedattn {

// Barrier over one warp group (named barrier 1 + group; the whole CTA when there is one group).
template <class Traits>
__device__ __forceinline__ void group_sync(int group_idx) {
  if constexpr (Traits::kWarpsN == 1) {
    __syncthreads();
  } else if constexpr (Traits::kGroupThreads == 32) {
    __syncwarp();
  } else {
    asm volatile("bar.sync %0, %1;\n" ::"r"(1 + group_idx), "n"(Traits::kGroupThreads));
  }
}

// One row tile `w` of one (request, KV head, split).
template <class Traits, class Features>
__device__ __forceinline__ void attn_fwd_tile(AttnParams const& p, char* smem, AttnWork const& w) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr int kThreads = Traits::kThreads, kStages = Traits::kStages, kStageKeys = Traits::kStageKeys;
  constexpr int kCacheBytes = Traits::kCacheBytes;
  // TMA decode keeps Q's MMA fragments in registers (kHeadDim / 4 of them); the others reload them
  // from shared memory for every K tile.
  constexpr bool kQInRegs = Traits::kTma && kHeadDim <= 128;


  int const tidx = threadIdx.x;
  int const group_idx = tidx / Traits::kGroupThreads;  // which KV sub-tile of each stage
  int const gtid = tidx % Traits::kGroupThreads;       // thread within the warp group (the MMA)
  int const D = p.head_size;

  // ---- shared memory
  Element* smem_q = reinterpret_cast<Element*>(smem);
  char* smem_kv = smem + Traits::kSmemQ;
  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutQ{});  // (kBlockM, kHeadDim)
  // Element tiles the MMAs read: non-fp8, one per (stage, group); fp8, one per group (widened stage)
  // or none (kFp8Regs).
  Element* smem_k = reinterpret_cast<Element*>(smem_kv);
  Element* smem_v = smem_k + Traits::kElemStages * Traits::kSmemStageElems;
  uint8_t* raw_k = reinterpret_cast<uint8_t*>(smem_v + Traits::kElemStages * Traits::kSmemStageElems);
  uint8_t* raw_v = raw_k + kStages * Traits::kSmemStageRaw;
  uint64_t* ring_bars = reinterpret_cast<uint64_t*>(smem + (Traits::kSmemMain + 7) / 8 * 8) + group_idx * kStages;

  // ---- this CTA's view of K/V history
  int64_t const kb = kCacheBytes;
  PagedKV kv{static_cast<char const*>(p.k) + w.kv_head * p.k_head_stride * kb,
             static_cast<char const*>(p.v) + w.kv_head * p.v_head_stride * kb,
             p.block_table != nullptr ? p.block_table + int64_t(w.b) * p.bt_stride : nullptr,
             p.k_block_stride * kb, p.k_row_stride * kb, p.v_block_stride * kb, p.v_row_stride * kb,
             p.block_size, p.block_shift, p.num_blocks,
             int64_t(w.k_start)};

  // ---- Q tile: packed rows -> (token, head)
  {
    constexpr int kChunks = kHeadDim / 8;
    Element const* q = static_cast<Element const*>(p.q);
    for (int c = tidx; c < kBlockM * kChunks; c += kThreads) {
      int const r = c / kChunks, col = (c % kChunks) * 8;
      int const R = w.row0 + r, i = R / p.group, g = R - i * p.group;
      bool const ok = i < w.q_len && col < D;
      Element const* src = q + (int64_t(w.q_start + i) * p.q_row_stride +
                                int64_t(w.kv_head * p.group + g) * p.q_head_stride + col);
      cp_async_16(&sQ(r, col), ok ? src : q, ok);
    }
  }

  // ---- K/V stage loader
  bool const fp8_rows_16b = D % 16 == 0 && ((p.k_block_stride | p.k_row_stride | p.k_head_stride |
                                             p.v_block_stride | p.v_row_stride | p.v_head_stride) & 15) == 0;
  auto load_stage = [&](int step, int stage) {
    int const key0 = step * kStageKeys;
    if constexpr (!Traits::kIsFp8) {
      constexpr int kChunks = kHeadDim / 8;
      for (int c = tidx; c < kStageKeys * kChunks; c += kThreads) {
        int const row = c / kChunks, col = (c % kChunks) * 8;
        int const j = key0 + row;
        char const *k_row = kv.k_base, *v_row = kv.v_base;
        bool const ok = j < w.k_len && kv.locate(j, k_row, v_row) && col < D;
        int const tile = stage * Traits::kWarpsN + row / kBlockN;
        int const off = tile * Traits::kTileElems + typename Traits::SmemLayoutKV{}(row % kBlockN, col);
        cp_async_16(smem_k + off, ok ? k_row + col * 2 : kv.k_base, ok);
        cp_async_16(smem_v + off, ok ? v_row + col * 2 : kv.v_base, ok);
      }
    } else {
      constexpr int kChunks = kHeadDim / 16;
      for (int c = tidx; c < kStageKeys * kChunks; c += kThreads) {
        int const row = c / kChunks, col = (c % kChunks) * 16;
        int const j = key0 + row;
        char const *k_row = kv.k_base, *v_row = kv.v_base;
        bool const ok = j < w.k_len && kv.locate(j, k_row, v_row) && col < D;
        int const off = (stage * kStageKeys + row) * kHeadDim + col;
        if (fp8_rows_16b) {
          cp_async_16(raw_k + off, ok ? k_row + col : kv.k_base, ok);
          cp_async_16(raw_v + off, ok ? v_row + col : kv.v_base, ok);
        } else {  // rows only 8-byte aligned (D % 16 == 8): two halves, the second may lie past D
          bool const ok_hi = ok && col + 8 < D;
          cp_async_8(raw_k + off, ok ? k_row + col : kv.k_base, ok);
          cp_async_8(raw_v + off, ok ? v_row + col : kv.v_base, ok);
          cp_async_8(raw_k + off + 8, ok_hi ? k_row + col + 8 : kv.k_base, ok_hi);
          cp_async_8(raw_v + off + 8, ok_hi ? v_row + col + 8 : kv.v_base, ok_hi);
        }
      }
    }
  };

  // ---- TMA loader (Traits::kTma, paged caches whose block size is a multiple of 16): this warp's
  // sub-tile of a step is kBlockN / 16 chunks of 16 keys, each inside one cache page; lane q < kChunks
  // copies chunk q into one slot of the warp's ring. Pages come from a window of block-table entries:
  // one warp-wide load covers the next kWindow issues (lane L: chunk L % kChunks of issue L / kChunks)
  // and is made a whole window before it is needed, so the table never stalls a copy, even with one
  // warp per SM sub-partition (B=1 decode). Columns >= D arrive as zeros (the tensor map's first
  // dimension is D). A chunk in a page outside [0, num_blocks) is zero-filled instead; chunks past
  // the end are not loaded (clear_tail zeroes their V rows once the slot has landed).
  constexpr int kChunks = kBlockN / 16;
  static_assert(!Traits::kTma || (kBlockN % 16 == 0 && kChunks <= 32), "TMA sub-tiles are 16-key chunks");
  // TMA box: kBoxCols x 16 keys; 128-byte swizzled except fp8 rows not a multiple of 128 bytes
  constexpr int kBoxCols = Traits::kFp8Regs ? 128 : (Traits::kIsFp8 ? kHeadDim : 64);
  constexpr int kChunkBytes = 16 * kHeadDim * kCacheBytes;       // K (or V) bytes of one chunk
  void const* k_map = p.tma_desc;
  void const* v_map = static_cast<char const*>(p.tma_desc) + 128;
  auto tile_key0 = [&](int step) { return step * kStageKeys + group_idx * kBlockN; };
  constexpr int kWindow = 32 / kChunks;  // issues per page window
  static_assert(!Traits::kTma || 32 % kChunks == 0, "a page window is one entry per lane");
  auto slot_tiles = [&](int slot, char*& k_dst, char*& v_dst) {
    if constexpr (Traits::kIsFp8) {
      k_dst = reinterpret_cast<char*>(raw_k + (slot * kStageKeys + group_idx * kBlockN) * kHeadDim);
      v_dst = reinterpret_cast<char*>(raw_v + (slot * kStageKeys + group_idx * kBlockN) * kHeadDim);
    } else {
      k_dst = reinterpret_cast<char*>(smem_k + (slot * Traits::kWarpsN + group_idx) * Traits::kTileElems);
      v_dst = reinterpret_cast<char*>(smem_v + (slot * Traits::kWarpsN + group_idx) * Traits::kTileElems);
    }
  };
  auto issue_tma = [&](int step, int slot, int phys) {
    int const j = tile_key0(step) + 16 * gtid;  // this lane's chunk
    bool const mine = gtid < kChunks && j < w.k_len;
    bool const valid = mine && phys >= 0 && phys < p.num_blocks;
    uint32_t const loads = __ballot_sync(0xffffffffu, valid);
    uint32_t const bad = __ballot_sync(0xffffffffu, mine && !valid);
    char *k_dst, *v_dst;
    slot_tiles(slot, k_dst, v_dst);
    if (gtid == 0) mbarrier_arrive_expect_tx(ring_bars + slot, __popc(loads) * 2 * kChunkBytes);
    __syncwarp();
    if (valid) {
      int const off = p.block_shift >= 0 ? j & (p.block_size - 1) : j % p.block_size;
      int const c1 = p.tma_row_dim == 1 ? off : w.kv_head;
      int const c2 = p.tma_row_dim == 1 ? w.kv_head : off;
      CUTE_UNROLL
      for (int c = 0; c < kHeadDim / kBoxCols; ++c) {
        int const dst = (c * kBlockN + 16 * gtid) * kBoxCols * kCacheBytes;
        tma_load_4d(k_dst + dst, k_map, c * kBoxCols, c1, c2, phys, ring_bars + slot);
        tma_load_4d(v_dst + dst, v_map, c * kBoxCols, c1, c2, phys, ring_bars + slot);
      }
    }
    if (bad) {  // rare: zero-fill the chunks of corrupt pages, all lanes together
      for (int q = 0; q < kChunks; ++q) {
        if (!(bad >> q & 1u)) continue;
        for (int c = 0; c < kHeadDim / kBoxCols; ++c) {
          int const base = (c * kBlockN + 16 * q) * kBoxCols * kCacheBytes;
          for (int b = 16 * gtid; b < 16 * kBoxCols * kCacheBytes; b += 16 * 32) {
            *reinterpret_cast<uint4*>(k_dst + base + b) = make_uint4(0, 0, 0, 0);
            *reinterpret_cast<uint4*>(v_dst + base + b) = make_uint4(0, 0, 0, 0);
          }
        }
      }
      fence_proxy_async_smem();  // before a later TMA refills the slot
    }
  };
  // V rows of a landed sub-tile at or past k_len (the page's unused slots) are zeroed: P is 0 there,
  // but 0 * NaN is not.
  auto clear_tail = [&](int slot, int key0) {
    int const first = w.k_len - key0;
    if (first <= 0 || first >= kBlockN) return;  // not loaded at all, or no row past the end
    char *k_dst, *v_dst;
    slot_tiles(slot, k_dst, v_dst);
    constexpr int kRowChunks = kHeadDim * kCacheBytes / 16;
    for (int c = gtid; c < (kBlockN - first) * kRowChunks; c += 32) {
      int const r = first + c / kRowChunks, chunk = c % kRowChunks;
      int b;
      if constexpr (Traits::kIsFp8) {  // row r of each kBoxCols-column block (swizzling stays inside a row)
        b = ((chunk * 16) / kBoxCols * kBlockN + r) * kBoxCols + (chunk * 16) % kBoxCols;
      } else {
        b = int(typename Traits::SmemLayoutKV{}(r, chunk * 8)) * 2;
      }
      *reinterpret_cast<uint4*>(v_dst + b) = make_uint4(0, 0, 0, 0);
    }
    fence_proxy_async_smem();  // before a later TMA refills the slot
  };

  float scale_log2 = p.scale_log2;
  float v_scale = 1.f;
  if constexpr (Traits::kIsFp8) {
    int const di = w.b * p.descale_batch_stride + w.kv_head * p.descale_head_stride;
    scale_log2 *= p.k_descale[di];
    v_scale = p.v_descale[di];
  }

  // ---- epilogue: merge warp groups through shared memory, then write O and LSE. acc_o and tOcO
  // (its coordinates) are either mainloop's accumulator; softmax holds its rows' (m, l).
  auto write_out = [&](auto const& acc_o, auto const& softmax, auto const& tOcO) {
    cp_async_wait<0>();
    __syncthreads();  // all K/V reads done: shared memory is reused
    float* o_smem = reinterpret_cast<float*>(smem);                 // [kWarpsN][kBlockM][kHeadDim]
    float* m_smem = o_smem + Traits::kWarpsN * kBlockM * kHeadDim;  // [kWarpsN][kBlockM]
    float* l_smem = m_smem + Traits::kWarpsN * kBlockM;
#pragma unroll
    for (int r = 0; r < Traits::kRows; ++r) {
      SoftmaxPartial const st = softmax.row_state(r);
      int const m = get<0>(tOcO(2 * (r % 2), r / 2, 0));
      if (gtid % 4 == 0) {
        m_smem[group_idx * kBlockM + m] = st.m;
        l_smem[group_idx * kBlockM + m] = st.l;
      }
    }
    CUTE_UNROLL
    for (int i = 0; i < size(acc_o); ++i) {
      int const col = Traits::kFp8Regs ? fp8_regs_column(get<1>(tOcO(i))) : int(get<1>(tOcO(i)));
      o_smem[(group_idx * kBlockM + get<0>(tOcO(i))) * kHeadDim + col] = acc_o(i);
    }
    __syncthreads();

    bool const split_out = p.num_splits > 1;
    constexpr int kVec = 8;  // columns per thread step: 16 bytes of Element, 32 of fp32
    for (int c = tidx; c < kBlockM * (kHeadDim / kVec); c += kThreads) {
      int const m = c / (kHeadDim / kVec), col = (c % (kHeadDim / kVec)) * kVec;
      int const R = w.row0 + m, i = R / p.group, g = R - i * p.group;
      if (i >= w.q_len || col >= D) continue;
      SoftmaxPartial total = SoftmaxPartial::empty();
      for (int gi = 0; gi < Traits::kWarpsN; ++gi) {
        total = softmax_combine(total, {m_smem[gi * kBlockM + m], l_smem[gi * kBlockM + m]});
      }
      // a sink is one more logit with no value row: it joins the final (m, l) only (the combine adds it
      // when the KV range is split)
      if constexpr (Features::kSinks) {
        if (!split_out) total = softmax_combine(total, {p.sinks[w.kv_head * p.group + g] * kLog2e, 1.f});
      }
      float acc[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[e] = 0.f;
      for (int gi = 0; gi < Traits::kWarpsN; ++gi) {
        float const wgt = softmax_merge_weight<false>({m_smem[gi * kBlockM + m], l_smem[gi * kBlockM + m]}, total);
        if (wgt == 0.f) continue;
        float const* src = o_smem + (gi * kBlockM + m) * kHeadDim + col;
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[e] += wgt * src[e];
      }
      int const token = w.q_start + i, head = w.kv_head * p.group + g;
      if (!split_out) {
        Element outv[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) outv[e] = Element(acc[e] * v_scale);
        Element* dst = static_cast<Element*>(p.out) + int64_t(token) * p.o_row_stride +
                       int64_t(head) * p.o_head_stride + col;
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<uint4 const*>(outv);
        if (col == 0 && p.lse != nullptr) p.lse[int64_t(head) * p.total_q + token] = total.lse();
      } else {
        float* dst = p.o_accum + ((int64_t(w.split) * p.total_q + token) * p.num_q_heads + head) * kHeadDim + col;
#pragma unroll
        for (int e = 0; e < kVec; e += 4) {
          *reinterpret_cast<float4*>(dst + e) =
              make_float4(acc[e] * v_scale, acc[e + 1] * v_scale, acc[e + 2] * v_scale, acc[e + 3] * v_scale);
        }
        if (col == 0) p.lse_accum[(int64_t(w.split) * p.num_q_heads + head) * p.total_q + token] = total.lse();
      }
    }
    if (!split_out) return;

    // ---- split-KV: the last CTA of this tile to arrive merges every split's partials. The flag lives
    // in the (now free) dynamic shared memory: static shared memory would push a variant whose dynamic
    // size is exactly the 48 KiB default over the launch limit.
    // Release/acquire through thread 0 (bar.sync orders every thread's partials before its fence, and
    // its fence after the counter before every thread's reads): one gpu-scope fence on each side, not a
    // sequentially consistent fence per thread.
    int* is_last = reinterpret_cast<int*>(smem);
    __syncthreads();  // every thread's partials are written and the epilogue's shared memory is read
    if (tidx == 0) {
      int* counter = p.split_counters + (int64_t(blockIdx.x) * gridDim.y + blockIdx.y);
      asm volatile("fence.acq_rel.gpu;" ::: "memory");  // this CTA's partials before its arrival
      bool const last = atomicAdd(counter, 1) == p.num_splits - 1;
      if (last) {
        asm volatile("fence.acq_rel.gpu;" ::: "memory");  // the other splits' partials before our reads
        *counter = 0;  // all splits arrived: zero again for the next call on this stream
      }
      *is_last = last;
    }
    __syncthreads();
    if (!*is_last) return;
    int64_t const part_stride = int64_t(p.total_q) * p.num_q_heads * kHeadDim;
    for (int m = tidx / 32; m < kBlockM; m += kThreads / 32) {  // a warp per row
      int const R = w.row0 + m, i = R / p.group, g = R - i * p.group;
      if (i >= w.q_len) break;
      int const token = w.q_start + i, head = w.kv_head * p.group + g;
      combine_split_row<Element>(
          p.o_accum + (int64_t(token) * p.num_q_heads + head) * kHeadDim, part_stride,
          p.lse_accum + int64_t(head) * p.total_q + token, int64_t(p.num_q_heads) * p.total_q,
          static_cast<Element*>(p.out) + int64_t(token) * p.o_row_stride + int64_t(head) * p.o_head_stride,
          p.lse != nullptr ? p.lse + int64_t(head) * p.total_q + token : nullptr, D, p.num_splits, tidx % 32,
          Features::kSinks ? p.sinks[head] : kNegInf);
    }
  };

  if constexpr (Traits::kWgmma) {
#if PAGEDATTN_WGMMA
    // ---- sm_90a prefill: warpgroup MMAs over the same cp.async pipeline (attn_wgmma.cuh)
    using Tiles = WgmmaTiles<Traits>;
    typename Tiles::TiledMmaQK mma_qk;
    typename Tiles::TiledMmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(tidx);
    auto thr_pv = mma_pv.get_thread_slice(tidx);
    Tensor tSrQ = thr_qk.partition_fragment_A(make_tensor(make_smem_ptr(smem_q), typename Tiles::SmemLayoutQ{}));
    Tensor acc_o = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    clear(acc_o);
    // flat (4, 1, columns / 8) views of the accumulators for OnlineSoftmax (see attn_wgmma.cuh)
    Tensor o_rows = make_tensor(acc_o.data(), Layout<Shape<_4, _1, Int<kHeadDim / 8>>>{});
    Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    AttnMask<2, Features> const mask(p, w, tScS);  // rows g and g + 8 of this thread's warp
    OnlineSoftmax<2> softmax;

    auto stage_k = [&](int stage) {
      return make_tensor(make_smem_ptr(smem_k + stage * Traits::kTileElems), typename Tiles::SmemLayoutK{});
    };
    auto stage_vt = [&](int stage) {
      return make_tensor(make_smem_ptr(smem_v + stage * Traits::kTileElems), typename Tiles::SmemLayoutVt{});
    };
    auto new_scores = [&] { return partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{}); };
    auto score_rows = [&](auto& acc_s) {
      return make_tensor(acc_s.data(), Layout<Shape<_4, _1, Int<kBlockN / 8>>>{});
    };
    typename Tiles::FragP tOrP;  // P of the step, in the A-operand order of P V
    auto to_p = [&](auto const& acc_s) {
      CUTE_UNROLL
      for (int i = 0; i < size(acc_s); ++i) tOrP(i) = Element(acc_s(i));
    };

    int const n_steps = w.step_end - w.step_begin;
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < n_steps) load_stage(w.step_begin + s, s);
      cp_async_commit();  // the Q loads ride in the first group
    }
    // One step at a time: S, softmax, P V, each waited for; the four warpgroups of a CTA keep the
    // tensor cores busy between them. (Overlapping step i+1's S with step i's P V inside a
    // warpgroup measured slower: perf/results/history/prefill_sweep_h200_overlap_8e4b57c.json.)
    for (int it = 0; it < n_steps; ++it) {
      int const stage = it % kStages;
      cp_async_wait<kStages - 2>();
      fence_proxy_async_smem();  // this thread's cp.async bytes, visible to the wgmma (async proxy) reads
      __syncthreads();           // stage `it` landed for every thread; stage it-1 is free
      if (it + kStages - 1 < n_steps) load_stage(w.step_begin + it + kStages - 1, (it + kStages - 1) % kStages);
      cp_async_commit();
      Tensor acc_s = new_scores();
      wgmma_gemm<true>(mma_qk, tSrQ, thr_qk.partition_fragment_B(stage_k(stage)), acc_s);
      float const s_scale = mask.template apply<kBlockN>(acc_s, tScS, (w.step_begin + it) * kBlockN, scale_log2);
      Tensor s_rows = score_rows(acc_s);
      softmax.update(s_rows, o_rows, s_scale);
      to_p(acc_s);
      wgmma_gemm<false>(mma_pv, tOrP, thr_pv.partition_fragment_B(stage_vt(stage)), acc_o);
    }
    write_out(o_rows, softmax, thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{})));
#else
    static_assert(!Traits::kWgmma, "wgmma variants are rendered with PAGEDATTN_WGMMA defined");
#endif
  } else {
    // ---- MMA setup (per warp group)
    typename Traits::TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(gtid);
    Tensor sK0 = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKV{});
    Tensor sVt0 = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutVt{});
    Tensor tSrQ = thr_mma.partition_fragment_A(sQ);     // (MMA, kMmaM, kHeadDim/16)
    Tensor tSrK = thr_mma.partition_fragment_B(sK0);    // (MMA, kBlockN/8, kHeadDim/16)
    Tensor tOrVt = thr_mma.partition_fragment_B(sVt0);  // (MMA, kHeadDim/8, kBlockN/16)
    Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (MMA, kMmaM, kHeadDim/8)
    clear(acc_o);

    auto s2r_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
    auto s2r_q_thr = s2r_q.get_thread_slice(gtid);
    Tensor tSsQ = s2r_q_thr.partition_S(sQ);
    Tensor tSrQ_view = s2r_q_thr.retile_D(tSrQ);
    auto s2r_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
    auto s2r_k_thr = s2r_k.get_thread_slice(gtid);
    Tensor tSrK_view = s2r_k_thr.retile_D(tSrK);
    auto s2r_v = make_tiled_copy_B(typename Traits::SmemCopyAtomT{}, tiled_mma);
    auto s2r_v_thr = s2r_v.get_thread_slice(gtid);
    Tensor tOrVt_view = s2r_v_thr.retile_D(tOrVt);

    // (row, key) of each accumulator entry, and the keys each of this thread's rows may see
    Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    AttnMask<Traits::kRows, Features> const mask(p, w, tScS);

    // kFp8Regs: fp16 MMAs; bf16 queries enter as q * 2^-8 (see attn_fp8_regs.cuh)
    constexpr float kQScale = Traits::kIsBf16 ? 1.f / 256.f : 1.f;
    if constexpr (Traits::kFp8Regs) scale_log2 *= 1.f / kQScale;
    constexpr bool kFp8QRegs = Traits::kFp8Regs && kHeadDim <= 128;
    uint32_t q_frag[kFp8QRegs ? kHeadDim / 16 : 1][4];
    OnlineSoftmax<Traits::kRows> softmax;

    // ---- mainloop: a kStages-deep pipeline over stages [step_begin, step_end)
    int const n_steps = w.step_end - w.step_begin;
    // TMA page windows: lane L holds the page of chunk L % kChunks of issue (window start + L / kChunks)
    auto fetch_window = [&](int i0) {
      int const i = i0 + gtid / kChunks;
      int const j = tile_key0(w.step_begin + i) + 16 * (gtid % kChunks);
      return i < n_steps && j < w.k_len ? kv.page(j) : 0;
    };
    int win_cur = 0, win_next = 0;
    auto issue = [&](int i) {  // the i-th sub-tile of this warp's range, into slot i % kStages
      if (i % kWindow == 0 && i > 0) {
        win_cur = win_next;
        win_next = fetch_window(i + kWindow);
      }
      int const phys = __shfl_sync(0xffffffffu, win_cur, (i % kWindow) * kChunks + gtid % kChunks);
      issue_tma(w.step_begin + i, i % kStages, phys);
    };
    if constexpr (Traits::kTma) {
      if (gtid == 0) {
        tma_prefetch_map(k_map);  // in flight with the page-window loads below
        tma_prefetch_map(v_map);
        for (int s = 0; s < kStages; ++s) mbarrier_init(ring_bars + s, 1);
        mbarrier_init_fence();
      }
      __syncwarp();
      win_cur = fetch_window(0);
      win_next = fetch_window(kWindow);
      for (int s = 0; s < kStages - 1 && s < n_steps; ++s) issue(s);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();  // Q landed for every thread; the only CTA-wide barrier before the epilogue
      if constexpr (Traits::kFp8Regs) {
        if constexpr (kFp8QRegs) {
          CUTE_UNROLL
          for (int kk = 0; kk < kHeadDim / 16; ++kk) fp8_regs_q<Element>(sQ, kk, gtid, kQScale, q_frag[kk]);
        }
      } else if constexpr (kQInRegs) {
        copy(s2r_q, tSsQ, tSrQ_view);  // Q stays in registers for the whole mainloop
      }
    } else {
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s) {
        if (s < n_steps) load_stage(w.step_begin + s, s);
        cp_async_commit();  // the Q loads ride in the first group
      }
    }
    for (int it = 0; it < n_steps; ++it) {
      int const stage = it % kStages;
      if constexpr (Traits::kTma) {
        mbarrier_wait(ring_bars + stage, uint32_t(it / kStages) & 1u);
        clear_tail(stage, tile_key0(w.step_begin + it));
        __syncwarp();  // zero-filled rows of every lane are visible; slot it-1 is free
        int const ahead = it + kStages - 1;
        if (ahead < n_steps) issue(ahead);
      } else {
        cp_async_wait<kStages - 2>();
        __syncthreads();  // stage `it` landed for every thread; stage it-1 is free
        if (it + kStages - 1 < n_steps) load_stage(w.step_begin + it + kStages - 1, (it + kStages - 1) % kStages);
        cp_async_commit();
      }

      if constexpr (Traits::kFp8Regs) {
        int const key0 = tile_key0(w.step_begin + it);
        if (key0 >= w.k_len) continue;
        uint8_t const* k_sub = raw_k + (stage * kStageKeys + group_idx * kBlockN) * kHeadDim;
        uint8_t const* v_sub = raw_v + (stage * kStageKeys + group_idx * kBlockN) * kHeadDim;
        Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
        fp8_regs_qk<kHeadDim, kBlockN, Traits::kFp8>(k_sub, gtid, acc_s, [&](int kk, uint32_t (&a)[4]) {
          if constexpr (kFp8QRegs) {
            CUTE_UNROLL
            for (int x = 0; x < 4; ++x) a[x] = q_frag[kk][x];
          } else {
            fp8_regs_q<Element>(sQ, kk, gtid, kQScale, a);
          }
        });
        float const s_scale = mask.template apply<kBlockN>(acc_s, tScS, key0, scale_log2);
        softmax.update(acc_s, acc_o, s_scale);
        fp8_regs_pv<kHeadDim, kBlockN, Traits::kFp8>(v_sub, gtid, acc_s, acc_o);
        continue;
      }

      Element* k_tile;
      Element* v_tile;
      if constexpr (Traits::kIsFp8) {
        // each warp group widens its own sub-tile; only the group waits for it
        constexpr int kChunks = kHeadDim / 16;
        typename Traits::SmemLayoutKV layout;
        Element* k_dst = smem_k + group_idx * Traits::kTileElems;
        Element* v_dst = smem_v + group_idx * Traits::kTileElems;
        for (int c = gtid; c < kBlockN * kChunks; c += Traits::kGroupThreads) {
          int const r = c / kChunks, col = (c % kChunks) * 16;
          int const raw_off = (stage * kStageKeys + group_idx * kBlockN + r) * kHeadDim + col;
          uint4 lo, hi;
          dequant_fp8x16<Traits::kIsBf16, Traits::kFp8>(*reinterpret_cast<uint4 const*>(raw_k + raw_off), lo, hi);
          *reinterpret_cast<uint4*>(k_dst + layout(r, col)) = lo;
          *reinterpret_cast<uint4*>(k_dst + layout(r, col + 8)) = hi;
          dequant_fp8x16<Traits::kIsBf16, Traits::kFp8>(*reinterpret_cast<uint4 const*>(raw_v + raw_off), lo, hi);
          *reinterpret_cast<uint4*>(v_dst + layout(r, col)) = lo;
          *reinterpret_cast<uint4*>(v_dst + layout(r, col + 8)) = hi;
        }
        group_sync<Traits>(group_idx);
        k_tile = smem_k + group_idx * Traits::kTileElems;
        v_tile = smem_v + group_idx * Traits::kTileElems;
      } else {
        k_tile = smem_k + (stage * Traits::kWarpsN + group_idx) * Traits::kTileElems;
        v_tile = smem_v + (stage * Traits::kWarpsN + group_idx) * Traits::kTileElems;
      }
      int const key0 = (w.step_begin + it) * kStageKeys + group_idx * kBlockN;
      if (key0 >= w.k_len) continue;  // this group's sub-tile lies past the end: nothing to add

      Tensor sK = make_tensor(make_smem_ptr(k_tile), typename Traits::SmemLayoutKV{});
      Tensor sVt = make_tensor(make_smem_ptr(v_tile), typename Traits::SmemLayoutVt{});
      Tensor tSsK = s2r_k_thr.partition_S(sK);
      Tensor tOsVt = s2r_v_thr.partition_S(sVt);

      // S = Q K^T. With few independent MMA chains (narrow sub-tiles), even and odd k-steps go to two
      // accumulators so consecutive MMAs do not wait on each other.
      Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA, kMmaM, kBlockN/8)
      clear(acc_s);
      constexpr bool kTwoChains = kBlockN / 8 * Traits::kMmaM < 4;
      Tensor acc_s_odd = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
      if constexpr (kTwoChains) clear(acc_s_odd);
      CUTE_UNROLL
      for (int k = 0; k < size<2>(tSrQ); ++k) {
        if constexpr (!kQInRegs) copy(s2r_q, tSsQ(_, _, k), tSrQ_view(_, _, k));
        copy(s2r_k, tSsK(_, _, k), tSrK_view(_, _, k));
        if (kTwoChains && k % 2 == 1) {
          cute::gemm(tiled_mma, tSrQ(_, _, k), tSrK(_, _, k), acc_s_odd);
        } else {
          cute::gemm(tiled_mma, tSrQ(_, _, k), tSrK(_, _, k), acc_s);
        }
      }
      if constexpr (kTwoChains) {
        CUTE_UNROLL
        for (int i = 0; i < size(acc_s); ++i) acc_s(i) += acc_s_odd(i);
      }

      float const s_scale = mask.template apply<kBlockN>(acc_s, tScS, key0, scale_log2);
      softmax.update(acc_s, acc_o, s_scale);

      // O += P V (P converted to Element in the A-operand layout)
      Tensor tOrP = make_tensor<Element>(Shape<_8, Int<Traits::kMmaM>, Int<kBlockN / 16>>{});
      CUTE_UNROLL
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        CUTE_UNROLL
        for (int mi = 0; mi < Traits::kMmaM; ++mi) {
          CUTE_UNROLL
          for (int v = 0; v < 8; ++v) tOrP(v, mi, kk) = Element(acc_s(v % 4, mi, 2 * kk + v / 4));
        }
      }
      CUTE_UNROLL
      for (int k = 0; k < kBlockN / 16; ++k) {
        copy(s2r_v, tOsVt(_, _, k), tOrVt_view(_, _, k));
        cute::gemm(tiled_mma, tOrP(_, _, k), tOrVt(_, _, k), acc_o);
      }
    }
    write_out(acc_o, softmax, thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{})));

  }
}

// Rows of a request past the grid's row tiles (max_seqlen_q understated its length, or more tiles than
// a grid dimension holds). They are computed here, exactly but slowly: a warp per row, every CTA of
// the (request, KV head) column taking its share, each row over its whole visible range (never
// split), with the same mask, score modifiers, sinks and zero-filled corrupt pages as the tiles.
// Kept out of line: a loop over row tiles around the inlined tile body made ptxas spill 4.7 KB per
// thread (prefill 340 -> 106 TFLOP/s on H200); this path costs the tile kernels nothing.
template <class Traits, class Features>
__device__ __noinline__ void attn_rows_past_grid(AttnParams const& p, AttnWork const& w) {
  using Element = typename Traits::Element;
  constexpr int kPerLane = (Traits::kHeadDim + 31) / 32;  // lane holds columns lane, lane + 32, ...
  constexpr int kCacheBytes = Traits::kCacheBytes;
  int const lane = threadIdx.x % 32;
  int const warps = blockDim.x / 32;
  int const first = int(gridDim.y) * Traits::kBlockM, rows = w.q_len * p.group, D = p.head_size;
  int const cta = blockIdx.z * gridDim.y + blockIdx.y;
  int64_t const kb = kCacheBytes;
  PagedKV const kv{static_cast<char const*>(p.k) + w.kv_head * p.k_head_stride * kb,
                   static_cast<char const*>(p.v) + w.kv_head * p.v_head_stride * kb,
                   p.block_table != nullptr ? p.block_table + int64_t(w.b) * p.bt_stride : nullptr,
                   p.k_block_stride * kb, p.k_row_stride * kb, p.v_block_stride * kb, p.v_row_stride * kb,
                   p.block_size, p.block_shift, p.num_blocks, int64_t(w.k_start)};
  float scale_log2 = p.scale_log2, v_scale = 1.f;
  if constexpr (Traits::kIsFp8) {
    int const di = w.b * p.descale_batch_stride + w.kv_head * p.descale_head_stride;
    scale_log2 *= p.k_descale[di];
    v_scale = p.v_descale[di];
  }
  auto cache_value = [&](char const* row, int d) -> float {
    if constexpr (Traits::kIsFp8) {
      constexpr __nv_fp8_interpretation_t kind = Traits::kFp8 == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2;
      return __half2float(__half(__nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(row[d]), kind)));
    } else {
      return float(reinterpret_cast<Element const*>(row)[d]);
    }
  };
  float const cap_in = Features::kSoftcap ? kLn2 / p.softcap : 0.f;
  float const cap_out = Features::kSoftcap ? p.softcap * kLog2e : 0.f;
  for (int R = first + cta * warps + int(threadIdx.x / 32); R < rows; R += int(gridDim.y * gridDim.z) * warps) {
    int const i = R / p.group, head = w.kv_head * p.group + (R - i * p.group);
    int64_t const token = w.q_start + i;
    Element const* q = static_cast<Element const*>(p.q) + token * p.q_row_stride + int64_t(head) * p.q_head_stride;
    float qv[kPerLane], acc[kPerLane];
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      int const d = lane + 32 * e;
      qv[e] = d < D ? float(q[d]) : 0.f;
      acc[e] = 0.f;
    }
    float slope = 0.f;
    if constexpr (Features::kAlibi) slope = p.alibi_slopes[int64_t(w.b) * p.alibi_batch_stride + head] * kLog2e;
    int const pos = w.k_len - w.q_len + i;
    KeyRange const keys = visible_keys<Features>(p, w.q_len, w.k_len, i);
    SoftmaxPartial st = SoftmaxPartial::empty();
    for (int j = keys.begin; j < keys.end; ++j) {
      char const *k_row = kv.k_base, *v_row = kv.v_base;
      bool const ok = kv.locate(j, k_row, v_row);  // a corrupt page reads as zeros, as in the tiles
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        int const d = lane + 32 * e;
        if (ok && d < D) dot += qv[e] * cache_value(k_row, d);
      }
#pragma unroll
      for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      float s = dot * scale_log2;
      if constexpr (Features::kSoftcap) s = cap_out * tanh_approx(s * cap_in);
      if constexpr (Features::kAlibi) s -= slope * float(abs(pos - j));
      float const m = fmaxf(st.m, s);
      float const r = softmax_rescale(st.m, m), e_s = exp2f(s - m);
      st = {m, st.l * r + e_s};
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        int const d = lane + 32 * e;
        acc[e] = acc[e] * r + (ok && d < D ? e_s * cache_value(v_row, d) : 0.f);
      }
    }
    if constexpr (Features::kSinks) st = softmax_combine(st, {p.sinks[head] * kLog2e, 1.f});
    float const norm = st.l > 0.f ? v_scale / st.l : 0.f;
    Element* o = static_cast<Element*>(p.out) + token * p.o_row_stride + int64_t(head) * p.o_head_stride;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      int const d = lane + 32 * e;
      if (d < D) o[d] = Element(acc[e] * norm);
    }
    if (lane == 0 && p.lse != nullptr) p.lse[int64_t(head) * p.total_q + token] = st.lse();
  }
}

// The kernel: one row tile of one (request, KV head, split) per CTA (tile_scheduler.cuh).
template <class Traits, class Features>
__device__ __forceinline__ void attn_fwd(AttnParams const& p, char* smem) {
  constexpr int kStageKeys = Traits::kStageKeys;
  // TMA decode: the first block-table windows are read only after seqused_k arrives (they start where
  // this split starts). Guess that start from the table's capacity (exact for the longest requests,
  // e.g. equal-length decode batches) and pull those table lines into L2 now, in flight with
  // schedule()'s loads; a wrong guess costs a few L2 lines.
  if constexpr (Traits::kTma) {
    if (p.block_table != nullptr && threadIdx.x < 8) {
      int const b = blockIdx.x / p.num_kv_heads;
      int const capacity = p.max_blocks_per_seq * p.block_size;
      int const steps = (capacity + kStageKeys - 1) / kStageKeys;
      int const first = int(blockIdx.z) * ((steps + p.num_splits - 1) / p.num_splits) * kStageKeys / p.block_size;
      int const entry = first + 32 * int(threadIdx.x);  // 8 lines of 32 entries: the first two windows
      if (entry < p.max_blocks_per_seq) {
        int32_t const* line = p.block_table + int64_t(b) * p.bt_stride + entry;
        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(line));
      }
    }
  }
  AttnWork w;
  bool const has_tile = schedule<Traits, Features>(p, row_tile(), w);
  if (w.q_len * p.group > int(gridDim.y) * Traits::kBlockM) attn_rows_past_grid<Traits, Features>(p, w);  // rare
  if (has_tile) attn_fwd_tile<Traits, Features>(p, smem, w);
}

}  // namespace pagedattn
