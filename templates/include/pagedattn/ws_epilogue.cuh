// The warp-specialised prefill's epilogue (mainloop_ws.cuh): a consumer warpgroup's rows of O and their
// LSE written from its accumulators, or a split's partials merged (split_combine.cuh).
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/attn_tile.cuh"
#include "pagedattn/softmax_merge.cuh"
#include "pagedattn/split_combine.cuh"
#include "pagedattn/tma_copy.cuh"

namespace pagedattn {

// Traits::kOBulk: this warp's 16 rows of O (times wgt[h] for the thread's row h) into its shared-memory
// buffer as Element, with stmatrix (entry 4 n + 2 h + j of the accumulator is column 8 n + 2 (lane % 4)
// + j of the warp's row lane / 4 + 8 h: matrix (h, n) of 8 x 8, four per stmatrix), then each of lanes
// 0 .. 15 stores its row of the request (the tile's rows past it are skipped) with one bulk copy of
// head_size columns. The buffer is written again only once the warp's copies of the item before have
// read it; attn_fwd_ws waits for the last ones to have read it before the CTA leaves.
template <class Traits, class AccO>
__device__ __forceinline__ void ws_store_rows_bulk(TileCtx<Traits> const& c, AccO const& acc_o, float const (&wgt)[2]) {
  using Element = typename Traits::Element;
  constexpr int kPitch = Traits::kOPitch;
  AttnParams const& p = c.p;
  AttnWork const& w = c.w;
  int const lane = c.tidx % 32, warp = c.tidx / 32;
  char* const buf = c.smem.ws_o(warp);
  if (lane < 16) bulk_wait_read();
  __syncwarp();
  auto pair = [&](int i, int h) {  // entries i, i + 1 as two Elements in 32 bits
    Element const e[2] = {Element(acc_o(i) * wgt[h]), Element(acc_o(i + 1) * wgt[h])};
    return *reinterpret_cast<uint32_t const*>(e);
  };
  // the lane's row address for each stmatrix: matrix k = lane / 8 is (h = k % 2, n + k / 2), row lane % 8
  char* const row = buf + (lane % 8 + 8 * (lane / 8 % 2)) * kPitch + lane / 16 * 16;
  CUTE_UNROLL
  for (int n = 0; n < Traits::kHeadDim / 8; n += 2) {
    stmatrix_x4(row + n * 16, pair(4 * n, 0), pair(4 * n + 2, 1), pair(4 * n + 4, 0), pair(4 * n + 6, 1));
  }
  fence_proxy_async_smem();  // the rows to the bulk-copy engine (the async proxy)
  __syncwarp();
  if (lane < 16) {
    int const R = w.row0 + 64 * (warp / 4) + 16 * (warp % 4) + lane, t = R / p.group, g = R - t * p.group;
    if (t < w.q_len) {
      int64_t const at = int64_t(w.q_start + t) * p.o_row_stride + int64_t(w.kv_head * p.group + g) * p.o_head_stride;
      bulk_store(static_cast<Element*>(p.out) + at, buf + lane * kPitch, p.head_size * int(sizeof(Element)));
    }
    bulk_commit();
  }
}

// The epilogue, straight from the accumulators: each thread's two rows (r and r + 8 of its warp's
// 16) normalised by their own (m, l) — one warpgroup holds a row's every key, so there is nothing to
// merge — and written as pairs of columns: O (times v_scale) and the LSE, or a split's fp32 partials,
// after which the last split of the tile to arrive merges them (split_combine.cuh).
template <class Traits, class Features, class AccO, class Softmax, class TensorC>
__device__ __forceinline__ void ws_store_tile(TileCtx<Traits> const& c, AccO const& acc_o, Softmax const& softmax,
                                              TensorC const& tOcO) {
  using namespace cute;
  using Element = typename Traits::Element;
  static_assert(Traits::kRows == 2, "a thread holds two rows of the tile");
  AttnParams const& p = c.p;
  AttnWork const& w = c.w;
  bool const split_out = p.num_splits > 1;
  int64_t row_at[2];  // element offset of each row's column 0 in out (or o_accum); -1 past the request
  float wgt[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    int const R = w.row0 + int(get<0>(tOcO(2 * h))), t = R / p.group, g = R - t * p.group;
    int const token = w.q_start + t, head = w.kv_head * p.group + g;
    SoftmaxPartial const st = softmax.row_state(h);
    SoftmaxPartial total = st;
    // a sink is one more logit with no value row: it joins the final (m, l) only (the merge adds it
    // when the KV range is split)
    if constexpr (Features::kSinks) {
      if (!split_out && t < w.q_len) total = softmax_combine(total, {p.sinks[head] * kLog2e, 1.f});
    }
    wgt[h] = softmax_merge_weight<false>(st, total) * c.v_scale;
    row_at[h] = t >= w.q_len ? -1
                : !split_out ? int64_t(token) * p.o_row_stride + int64_t(head) * p.o_head_stride
                             : ((int64_t(w.split) * p.total_q + token) * p.num_q_heads + head) * Traits::kHeadDim;
    if (t < w.q_len && c.tidx % 4 == 0) {  // the quad's first lane
      if (!split_out) {
        if (p.lse != nullptr) p.lse[int64_t(head) * p.total_q + token] = total.lse();
      } else {
        p.lse_accum[(int64_t(w.split) * p.num_q_heads + head) * p.total_q + token] = total.lse();
      }
    }
  }
  if constexpr (Traits::kOBulk) {
    // 1-D bulk copies need 16-byte aligned rows and lengths (the host's checks of out and of the head
    // size make them so; a guard, uniform over the launch)
    uint64_t const misaligned = reinterpret_cast<uint64_t>(p.out) | uint64_t(p.o_row_stride) * 2 |
                                uint64_t(p.o_head_stride) * 2 | uint64_t(p.head_size) * 2;
    if (!split_out && misaligned % 16 == 0) {
      ws_store_rows_bulk<Traits>(c, acc_o, wgt);
      return;
    }
  }
  CUTE_UNROLL
  for (int i = 0; i < size(acc_o); i += 2) {  // entries i, i + 1: columns col, col + 1 of row h
    int const h = (i / 2) % 2, col = int(get<1>(tOcO(i)));
    if (row_at[h] < 0 || col >= p.head_size) continue;
    float const x = acc_o(i) * wgt[h], y = acc_o(i + 1) * wgt[h];
    if (!split_out) {
      Element pair[2] = {Element(x), Element(y)};
      *reinterpret_cast<uint32_t*>(static_cast<Element*>(p.out) + row_at[h] + col) =
          *reinterpret_cast<uint32_t const*>(pair);
    } else {
      *reinterpret_cast<float2*>(p.o_accum + row_at[h] + col) = make_float2(x, y);
    }
  }
  if (split_out) merge_splits_if_last<Traits, Features>(c);
}

}  // namespace pagedattn
