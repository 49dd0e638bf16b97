// Which keys each query row may see: the ONE place where the sequence end and causal masking live.
// Every mainloop (SM80 MMAs, fp8 register operands, wgmma) builds an AttnMask for the rows its thread
// holds and calls apply() on each sub-tile of scores.
//
// Accumulator order (SM80 MMAs, and the flat view of a wgmma accumulator, which uses the same order):
// flat index i holds row 2 * ((i / 4) % (kRows / 2)) + (i % 4) / 2 of the thread's kRows rows; the
// identity tensor partitioned the same way (tScS) gives each entry's (row, key) in the tile.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/attn_params.cuh"
#include "pagedattn/softmax_merge.cuh"
#include "pagedattn/tile_scheduler.cuh"
#include <cute/tensor.hpp>

namespace pagedattn {

template <int kRows>
struct AttnMask {
  int key_end[kRows];  // row r sees keys [0, key_end[r]): the sequence end, and bottom-right causal
  int mask_from;       // every row of the tile sees every key below this: sub-tiles under it skip apply

  __device__ __forceinline__ static constexpr int row_of(int i) { return 2 * ((i / 4) % (kRows / 2)) + (i % 4) / 2; }
  __device__ __forceinline__ static constexpr int first_entry(int r) { return 2 * (r % 2) + 4 * (r / 2); }

  // tScS: the identity tensor of the (rows, keys) score tile, partitioned like the accumulator.
  template <class TensorC>
  __device__ __forceinline__ AttnMask(AttnParams const& p, AttnWork const& w, TensorC const& tScS) {
    using namespace cute;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      int const qi = (w.row0 + int(get<0>(tScS(first_entry(r))))) / p.group;  // query token of row r
      key_end[r] = p.causal ? cute::min(w.k_len, w.k_len - w.q_len + qi + 1) : w.k_len;
    }
    mask_from = w.mask_from;
  }

  // Scores of keys a row may not see -> -inf, on the sub-tile of kKeys keys starting at key0; a
  // sub-tile that every row sees whole is left as it is.
  template <int kKeys, class TensorS, class TensorC>
  __device__ __forceinline__ void apply(TensorS& acc_s, TensorC const& tScS, int key0) const {
    using namespace cute;
    if (key0 + kKeys <= mask_from) return;
    CUTE_UNROLL
    for (int i = 0; i < size(acc_s); ++i) {
      if (key0 + int(get<1>(tScS(i))) >= key_end[row_of(i)]) acc_s(i) = kNegInf;
    }
  }
};

}  // namespace pagedattn
