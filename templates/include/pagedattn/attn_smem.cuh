// The dynamic shared memory of attn_fwd, region by region: the one place that knows where each
// lives. Sizes come from AttnTraits (kSmemBytes is the total the host mirrors in smem_bytes(); the
// rendered source asserts the two agree).
//
//   mainloop:  [Q tile][K Element stages][V Element stages][raw K stages][raw V stages] (kRawStages)
//   epilogue:  [O of each warp group][m][l], then the split-KV "last CTA" flag: the mainloop's bytes,
//              reused once every K/V read is done
//   TMA:       one mbarrier per (warp, ring slot), after both (never reused); kWs: the K and V rings'
//              full and empty mbarriers, then the split-KV flag (its epilogue needs no shared memory,
//              and the next tile's Q and K/V may already be landing in the mainloop's bytes) and the
//              consumer warpgroups' work items, then (fp8) the producer warps' raw-stage mbarriers
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/tile_scheduler.cuh"

namespace pagedattn {

template <class Traits>
struct AttnSmem {
  using Element = typename Traits::Element;
  static constexpr int kElemStageBytes = Traits::kElemStages * Traits::kSmemStageElems * int(sizeof(Element));
  static constexpr int kOffK = Traits::kSmemQ;
  static constexpr int kOffV = kOffK + kElemStageBytes;
  static constexpr int kOffRawK = kOffV + kElemStageBytes;
  static constexpr int kOffRawV = kOffRawK + Traits::kRawStages * Traits::kSmemStageRaw;
  static constexpr int kOffBars = (Traits::kSmemMain + 7) / 8 * 8;
  static constexpr int kEpilogueRows = Traits::kWarpsN * Traits::kBlockM;
  static_assert(kOffBars + Traits::kSmemBarriers == Traits::kSmemBytes, "regions and kSmemBytes disagree");

  char* base;

  // mainloop
  __device__ __forceinline__ Element* q() const { return reinterpret_cast<Element*>(base); }
  // Element tile the MMAs read: (stage, warp group); fp8 widens into stage 0 only
  __device__ __forceinline__ Element* k_tile(int stage, int group) const {
    return reinterpret_cast<Element*>(base + kOffK) + (stage * Traits::kWarpsN + group) * Traits::kTileElems;
  }
  __device__ __forceinline__ Element* v_tile(int stage, int group) const {
    return reinterpret_cast<Element*>(base + kOffV) + (stage * Traits::kWarpsN + group) * Traits::kTileElems;
  }
  // fp8 bytes of `keys` rows from row `row` of stage `stage` (kHeadDim bytes a row, unpadded)
  __device__ __forceinline__ uint8_t* raw_k(int stage, int row = 0) const {
    return reinterpret_cast<uint8_t*>(base + kOffRawK) + (stage * Traits::kStageKeys + row) * Traits::kHeadDim;
  }
  __device__ __forceinline__ uint8_t* raw_v(int stage, int row = 0) const {
    return reinterpret_cast<uint8_t*>(base + kOffRawV) + (stage * Traits::kStageKeys + row) * Traits::kHeadDim;
  }
  // TMA ring barriers of warp group `group`: kStages of them
  __device__ __forceinline__ uint64_t* ring_bars(int group) const {
    return reinterpret_cast<uint64_t*>(base + kOffBars) + group * Traits::kStages;
  }

  // epilogue
  __device__ __forceinline__ float* o(int group, int row) const {
    return reinterpret_cast<float*>(base) + (group * Traits::kBlockM + row) * Traits::kHeadDim;
  }
  __device__ __forceinline__ float* m() const { return reinterpret_cast<float*>(base) + kEpilogueRows * Traits::kHeadDim; }
  __device__ __forceinline__ float* l() const { return m() + kEpilogueRows; }
  __device__ __forceinline__ int* last_split_flag() const {
    return Traits::kWs ? reinterpret_cast<int*>(ring_bars(4)) : reinterpret_cast<int*>(base);
  }
  // kWs: consumer warpgroup wg's work item of parity `parity` (items alternate between its two)
  __device__ __forceinline__ AttnWork* ws_work(int wg, int parity) const {
    static_assert(sizeof(AttnWork) == 56, "kSmemWsTail holds four 56-byte work items");
    return reinterpret_cast<AttnWork*>(reinterpret_cast<char*>(ring_bars(4)) + 8) + 2 * wg + parity;
  }
  // kWs, fp8: the raw-stage mbarrier of (K: kv 0, V: kv 1, producer warp `warp`, raw stage `stage`)
  __device__ __forceinline__ uint64_t* ws_raw_bar(int kv, int warp, int stage) const {
    return reinterpret_cast<uint64_t*>(reinterpret_cast<char*>(ring_bars(4)) + 8 + 4 * 56) +
           (kv * 4 + warp) * Traits::kRawStages + stage;
  }
};

}  // namespace pagedattn
