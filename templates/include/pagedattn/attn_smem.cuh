// The dynamic shared memory of attn_fwd as one struct, SharedStorage: the regions in the order they
// lie, each an array sized by the host's plan (tiles.smem_plan, rendered as Traits::Smem), so the
// bytes the launch asks for and this layout are the same numbers. The static_asserts below check
// that each region holds what the tiles need and that sizeof(SharedStorage) is the plan's Bytes.
//
//   union {
//     mainloop:  Q tile | K Element stages | V Element stages | raw K stages | raw V stages (fp8 bytes)
//     epilogue:  O of each warp group | m, l of each row   (reuses the mainloop's bytes once every
//                K/V read is done; the split-KV "last CTA" flag of the non-ws paths is its first int)
//   }
//   ws_o:        kWs with kWsOBulk: each consumer warp's buffer of its 16 rows of O (16-byte units)
//   ring_bars:   TMA: one mbarrier per (warp, ring slot); kWs: the K and V rings' full and empty ones
//   kWs:         the split-KV flag (its epilogue needs no shared memory, and the next tile's Q and K/V
//                may already be landing in the mainloop's bytes), the consumer warpgroups' work items,
//                then (fp8) the producer warps' raw-stage mbarriers (never reused), then (kWsQFeed) the
//                Q tile's mbarriers: full and empty of each consumer warpgroup's rows
//
// A region the plan leaves empty takes no bytes: regions are base classes (SmemRegion<tag, T, 0> is
// empty), and empty bases share their neighbour's address.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/tile_scheduler.cuh"
#include <cute/tensor.hpp>

namespace pagedattn {

template <int kTag, class T, int kCount>
struct SmemRegion {
  T data[kCount];
};
template <int kTag, class T>
struct SmemRegion<kTag, T, 0> {};

// The region of `tag` in a SharedStorage part (a pointer to its first element, null when empty).
template <int kTag, class T, int kCount>
__device__ __forceinline__ T* region(SmemRegion<kTag, T, kCount>& r) {
  if constexpr (kCount > 0) {
    return r.data;
  } else {
    return nullptr;
  }
}

enum SmemTag { kTagQ, kTagK, kTagV, kTagRawK, kTagRawV, kTagO, kTagRowStats, kTagRingBars, kTagWsFlag, kTagWsWork,
               kTagWsRawBars, kTagWsQBars, kTagWsO };

template <class Element, class Plan>
struct SmemMainloop : SmemRegion<kTagQ, Element, Plan::kQ>, SmemRegion<kTagK, Element, Plan::kK>,
                      SmemRegion<kTagV, Element, Plan::kV>, SmemRegion<kTagRawK, uint8_t, Plan::kRawK>,
                      SmemRegion<kTagRawV, uint8_t, Plan::kRawV> {};

template <class Plan>
struct SmemEpilogue : SmemRegion<kTagO, float, Plan::kO>, SmemRegion<kTagRowStats, float, Plan::kRowStats> {};

template <class Element, class Plan>
union SmemMain {
  SmemMainloop<Element, Plan> mainloop;
  SmemEpilogue<Plan> epilogue;
};

// (a union cannot be a base class: SharedStorage holds it through this one-member struct)
template <class Element, class Plan>
struct SmemMainHolder {
  SmemMain<Element, Plan> main;
};

template <class Traits>
struct SharedStorage : SmemMainHolder<typename Traits::Element, typename Traits::Smem>,
                       SmemRegion<kTagWsO, uint4, Traits::Smem::kWsO>,
                       SmemRegion<kTagRingBars, uint64_t, Traits::Smem::kRingBars>,
                       SmemRegion<kTagWsFlag, uint64_t, Traits::Smem::kWsFlag>,
                       SmemRegion<kTagWsWork, AttnWork, Traits::Smem::kWsWork>,
                       SmemRegion<kTagWsRawBars, uint64_t, Traits::Smem::kWsRawBars>,
                       SmemRegion<kTagWsQBars, uint64_t, Traits::Smem::kWsQBars> {};

// The regions of SharedStorage<Traits> by name, at `base` (the kernel's dynamic shared memory).
template <class Traits>
struct AttnSmem {
  using Element = typename Traits::Element;
  using Plan = typename Traits::Smem;
  using Storage = SharedStorage<Traits>;
  static constexpr int kEpilogueRows = Traits::kWarpsN * Traits::kBlockM;

  // what the tiles need of the plan (the plan is the host's; these are the kernel's side of it)
  static_assert(sizeof(Storage) == Plan::kBytes, "SharedStorage is not the plan's size (tiles.smem_plan)");
  static constexpr int kQTile = cute::cosize(typename Traits::SmemLayoutQ{});
  static_assert(Plan::kQ == Traits::kQTiles * kQTile, "Q region: one Q tile (kChain: two)");
  static_assert(Plan::kV == Plan::kElemStages * Traits::kSmemStageElems &&
                Plan::kK == (Traits::kFp8Qk ? 0 : Plan::kV),
                "K/V regions: kElemStages stages of kWarpsN tiles (no K with fp8 S: its ring is RawK)");
  static_assert(Plan::kElemStages == (Traits::kFp8Regs ? 0 : Traits::kIsFp8 && !Traits::kWs ? 1 : Traits::kStages),
                "Element stages: every stage (16-bit caches, prefill_ws), one widened stage (fp8), none (fp8 "
                "operands in registers)");
  static_assert(Plan::kRawV == Plan::kRawStages * Traits::kSmemStageRaw &&
                Plan::kRawK == (Traits::kFp8Qk ? Traits::kKSlots * Traits::kSmemStageRaw : Plan::kRawV) &&
                (Traits::kIsFp8 ? Plan::kRawStages >= 2 && (Traits::kWs || Plan::kRawStages == Traits::kStages)
                                : Plan::kRawStages == 0),
                "raw fp8 stages: the pipeline's (prefill_ws: its own count), none for 16-bit caches");
  static_assert(Plan::kO == kEpilogueRows * Traits::kHeadDim && Plan::kRowStats == 2 * kEpilogueRows,
                "epilogue: O, m and l of every warp group's rows");
  static_assert(Plan::kRingBars == (Traits::kTma ? (Traits::kWs ? 4 : Traits::kWarpsN) * Traits::kRingSlots : 0),
                "ring mbarriers: one per (warp, slot); prefill_ws: full and empty of K and V per slot");
  static_assert(Plan::kWsFlag == int(Traits::kWs) && Plan::kWsWork == (Traits::kWs ? 2 * Traits::kWorkSlots : 0) &&
                Plan::kWsRawBars == (Traits::kWs ? 2 * 4 * Plan::kRawStages : 0),
                "prefill_ws: the split flag, two work items per consumer warpgroup (kChain: four), raw-stage "
                "mbarriers");
  static_assert(Plan::kWsO == (Traits::kOBulk ? Traits::kThreads / 32 * 16 * Traits::kOPitch / 16 : 0),
                "prefill_ws with kWsOBulk: 16 rows of O per consumer warp, kOPitch bytes each");
  static_assert(Plan::kWsQBars == (Traits::kQFeed ? 4 * Traits::kQTiles : 0),
                "prefill_ws with kWsQFeed: a full and an empty mbarrier per consumer warpgroup's Q rows (per Q tile)");
  // Every Element tile (Q, K and V tiles) starts at a whole period of its swizzle (8 rows of a panel:
  // 1024, 512 or 256 bytes at 64, 32 or 16 columns) from the 1024-aligned base, so that the pattern the
  // TMA boxes write and the wgmma descriptors assume (base offset 0) is the layouts' own
  static constexpr int kSwizzlePeriod = 8 * Traits::kBlockKSmem * int(sizeof(Element));
  static_assert(kQTile * int(sizeof(Element)) % kSwizzlePeriod == 0 &&
                Traits::kTileElems * int(sizeof(Element)) % kSwizzlePeriod == 0,
                "Q and K/V tiles: whole swizzle periods");

  char* base;
  int q_tile = 0;  // kChain: the Q tile q() is (the item's)

  // Never null: the assumption lets the compiler drop the null checks of the conversions to the
  // region bases, which would hide that every address is in shared memory (generic LD/ST, not LDS/STS).
  __device__ __forceinline__ Storage& storage() const {
    Storage* const s = reinterpret_cast<Storage*>(base);
    __builtin_assume(s != nullptr);
    return *s;
  }
  __device__ __forceinline__ SmemMainloop<Element, Plan>& mainloop() const { return storage().main.mainloop; }
  __device__ __forceinline__ SmemEpilogue<Plan>& epilogue() const { return storage().main.epilogue; }

  // mainloop
  __device__ __forceinline__ Element* q() const { return region<kTagQ>(mainloop()) + q_tile * kQTile; }
  // Element tile the MMAs read: (stage, warp group); fp8 widens into stage 0 only
  __device__ __forceinline__ Element* k_tile(int stage, int group) const {
    return region<kTagK>(mainloop()) + (stage * Traits::kWarpsN + group) * Traits::kTileElems;
  }
  __device__ __forceinline__ Element* v_tile(int stage, int group) const {
    return region<kTagV>(mainloop()) + (stage * Traits::kWarpsN + group) * Traits::kTileElems;
  }
  // fp8 bytes of `keys` rows from row `row` of stage `stage` (kHeadDim bytes a row, unpadded); K with
  // fp8 S (kFp8Qk): the stages are its ring's slots
  __device__ __forceinline__ uint8_t* raw_k(int stage, int row = 0) const {
    return region<kTagRawK>(mainloop()) + (stage * Traits::kStageKeys + row) * Traits::kHeadDim;
  }
  __device__ __forceinline__ uint8_t* raw_v(int stage, int row = 0) const {
    return region<kTagRawV>(mainloop()) + (stage * Traits::kStageKeys + row) * Traits::kHeadDim;
  }
  // TMA ring barriers of warp group `group` (kWs: 0 full K, 1 full V, 2 empty K, 3 empty V): kRingSlots
  // of them (kStages but with a deeper fp8 K ring)
  __device__ __forceinline__ uint64_t* ring_bars(int group) const {
    return region<kTagRingBars>(storage()) + group * Traits::kRingSlots;
  }

  // epilogue
  __device__ __forceinline__ float* o(int group, int row) const {
    return region<kTagO>(epilogue()) + (group * Traits::kBlockM + row) * Traits::kHeadDim;
  }
  __device__ __forceinline__ float* m() const { return region<kTagRowStats>(epilogue()); }
  __device__ __forceinline__ float* l() const { return m() + kEpilogueRows; }
  __device__ __forceinline__ int* last_split_flag() const {
    if constexpr (Traits::kWs) {
      return reinterpret_cast<int*>(region<kTagWsFlag>(storage()));
    } else {
      return reinterpret_cast<int*>(base);
    }
  }
  // kWs: consumer warpgroup wg's work slot `slot` of its kWorkSlots (its items take them in turn)
  __device__ __forceinline__ AttnWork* ws_work(int wg, int slot) const {
    return region<kTagWsWork>(storage()) + Traits::kWorkSlots * wg + slot;
  }
  // kWs, fp8: the raw-stage mbarrier of (K: kv 0, V: kv 1, producer warp `warp`, raw stage `stage`)
  __device__ __forceinline__ uint64_t* ws_raw_bar(int kv, int warp, int stage) const {
    return region<kTagWsRawBars>(storage()) + (kv * 4 + warp) * Plan::kRawStages + stage;
  }
  // kOBulk: consumer warp `warp`'s buffer of 16 rows of O, kOPitch bytes apart
  __device__ __forceinline__ char* ws_o(int warp) const {
    return reinterpret_cast<char*>(region<kTagWsO>(storage())) + warp * 16 * Traits::kOPitch;
  }
  // kQFeed: the mbarrier of consumer warpgroup wg's Q rows in Q tile t, full (landed) or empty (read)
  __device__ __forceinline__ uint64_t* ws_q_full(int wg, int t) const {
    return region<kTagWsQBars>(storage()) + wg * Traits::kQTiles + t;
  }
  __device__ __forceinline__ uint64_t* ws_q_empty(int wg, int t) const {
    return region<kTagWsQBars>(storage()) + (2 + wg) * Traits::kQTiles + t;
  }
};

}  // namespace pagedattn
