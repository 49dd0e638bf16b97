// The warp-specialised prefill's plumbing that its producer and consumer warpgroups share
// (mainloop_ws.cuh): the register hand-over, the K/V rings' mbarriers and slots, the consumers' barriers
// and ping-pong turns, and the walk over a persistent CTA's work items.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/attn_smem.cuh"
#include "pagedattn/tile_scheduler.cuh"
#include "pagedattn/tma_copy.cuh"

namespace pagedattn {

// Registers per thread after the hand-over: the producer keeps kProducerRegs, the consumers take
// what is left of the registers the CTA was launched with (kPool: __launch_bounds__' share of the
// SM's 64 Ki, a multiple of 8 per thread), at most 240 (multiples of 8, as setmaxnreg wants).
// setmaxnreg.inc draws on that pool only: asking for more than the decrements freed can block a
// consumer warp for good (at producer 32 / consumers 240 an fp8 prefill hung on the H200).
template <class Traits>
struct WsRegisters {
  static constexpr int kAllThreads = Traits::kThreads + Traits::kProducerThreads;
  static constexpr int kPool = 65536 / kAllThreads / 8 * 8 * kAllThreads;
  // 24 (40 with kQFeed, whose producer copies Q too: the consumers' 232 then hold the kernel without
  // spills), or the tile field kWsProducerRegs (PAGEDATTN_WS_PRODUCER_REGS) when set: tile_config sets it
  // for fp8 caches, whose producer widens the chunks
  static constexpr int kProducerRegs = PAGEDATTN_WS_PRODUCER_REGS ? PAGEDATTN_WS_PRODUCER_REGS
                                      : Traits::kQFeed                ? 40
                                                                      : 24;
  static constexpr int kLeft = (kPool - kProducerRegs * Traits::kProducerThreads) / Traits::kThreads / 8 * 8;
  static constexpr int kConsumerRegs = kLeft > 240 ? 240 : kLeft;
  static_assert(kProducerRegs * Traits::kProducerThreads + kConsumerRegs * Traits::kThreads <= kPool,
                "the hand-over asks for more registers than the CTA holds");
};

template <int kRegs>
__device__ __forceinline__ void regs_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void regs_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// The ring's mbarriers, kStages of each: K and V travel apart, so a step's K slot goes back as soon
// as its S is computed while its V slot waits for the P V of the step.
struct WsBarriers {
  uint64_t *full_k, *full_v, *empty_k, *empty_v;

  template <class Traits>
  __device__ __forceinline__ explicit WsBarriers(AttnSmem<Traits> const& sm)
      : full_k(sm.ring_bars(0)), full_v(sm.ring_bars(1)), empty_k(sm.ring_bars(2)), empty_v(sm.ring_bars(3)) {}
};

// Where step `it` of an item whose steps start at ring step `ring` lives, and the phase its full
// barrier completes (its empty barrier's wait takes the phase before).
struct WsRing {
  uint32_t ring;
  template <int kStages>
  __device__ __forceinline__ int slot(int it) const { return int((ring + uint32_t(it)) % kStages); }
  template <int kStages>
  __device__ __forceinline__ uint32_t phase(int it) const { return ((ring + uint32_t(it)) / kStages) & 1u; }
};

// Barrier over one consumer warpgroup (named barriers 5 and 6; ids as immediates: ptxas then
// reserves 7 barriers, not all 16).
__device__ __forceinline__ void ws_group_sync(int wg) {
  if (wg == 0) {
    asm volatile("bar.sync 5, 128;\n" ::: "memory");
  } else {
    asm volatile("bar.sync 6, 128;\n" ::: "memory");
  }
}

// kPingPong: the two warpgroups take turns on the tensor cores, one issuing a step's MMAs while the
// other runs its softmax. Warpgroup w waits on named barrier 2 + w before it issues and then lets the
// other one go (bar.arrive). The turns run on across items (both warpgroups issue the same batches):
// warpgroup 1 lets warpgroup 0 start once (start), and warpgroup 0 takes that last arrival after its
// last item (finish), so every barrier is balanced.
template <bool kPingPong>
struct WsPingPong {
  int wg;
  __device__ __forceinline__ void my_turn() const {
    if constexpr (kPingPong) {
      if (wg == 0) {
        asm volatile("bar.sync 2, 256;\n" ::: "memory");
      } else {
        asm volatile("bar.sync 3, 256;\n" ::: "memory");
      }
    }
  }
  __device__ __forceinline__ void your_turn() const {
    if constexpr (kPingPong) {
      if (wg == 0) {
        asm volatile("bar.arrive 3, 256;\n" ::: "memory");
      } else {
        asm volatile("bar.arrive 2, 256;\n" ::: "memory");
      }
    }
  }
  __device__ __forceinline__ void start() const {
    if (wg == 1) your_turn();
  }
  __device__ __forceinline__ void finish() const {
    if (wg == 0) my_turn();
  }
};

// Traits::kPair: the CTA's turn to hand a ring slot back, on its own and (kPair) the cluster's other
// CTA's empty barrier: a slot is refilled in both CTAs at once, so both producers wait for both CTAs'
// consumers. By one lane of the warp.
template <class Traits>
__device__ __forceinline__ void ws_hand_back(uint64_t* empty) {
  if constexpr (Traits::kPair) {
    mbarrier_arrive_cluster(empty, 0);
    mbarrier_arrive_cluster(empty, 1);
  } else {
    mbarrier_arrive(empty);
  }
}

// Work items of the persistent grid: kWs walks items blockIdx.x, blockIdx.x + gridDim.x, ...; with
// Traits::kPair it walks pairs instead (ws_pair_item), its cluster's: blockIdx.x / 2, + gridDim.x / 2, ...
__device__ __forceinline__ int ws_items(AttnParams const& p) {
  return p.num_seqs * p.num_kv_heads * p.grid_tiles * p.num_splits;
}
template <class Traits>
__device__ __forceinline__ int ws_first() {
  return int(Traits::kPair ? blockIdx.x / 2 : blockIdx.x);
}
template <class Traits>
__device__ __forceinline__ int ws_stride() {
  return int(Traits::kPair ? gridDim.x / 2 : gridDim.x);
}

// Traits::kPair: a CTA with no tile of its own in a pair walks its steps all the same (ws_pair_item);
// its work item is the other CTA's with row0 = -1.
__device__ __forceinline__ bool ws_idle(AttnWork const& w) { return w.row0 < 0; }

// Traits::kPair: this CTA's work in pair `pair`, items 2 pair and 2 pair + 1 of the logical grid: row
// tiles 2 m + 1 and 2 m of one column and split (the host makes p.grid_tiles even), the CTA of
// cluster rank r taking item 2 pair + r. Both CTAs walk the same steps, their split's share of every
// key either tile sees; a step outside its own tile's keys is wholly masked for a CTA (AttnMask: past
// mask_from, or before mask_below), so it adds nothing to its rows. A CTA whose item has no tile while
// the other's has walks the other's steps idle (ws_idle), loading its half of every step. False where
// neither has a tile.
template <class Traits, class Features>
__device__ __forceinline__ bool ws_pair_item(AttnParams const& p, int total, int pair, AttnWork& w) {
  int const mine = 2 * pair + int(cluster_rank());
  bool const exists = mine < total;  // else the pair is the grid's last item alone, the other CTA's
  GridSlot const slot = ws_slot(p, exists ? mine : mine ^ 1);
  int lo = 0, hi = 0;
  bool const has_tile = schedule_tile<Traits, Features>(p, slot, w, lo, hi);  // the request's fields either way
  bool const has_mine = exists && has_tile;
  if (exists && (mine ^ 1) < total) {  // the other tile of the column: its keys, with w's request
    AttnWork other = w;
    int other_lo, other_hi;
    if (tile_keys<Traits, Features>(p, slot.row_tile ^ 1, other, other_lo, other_hi)) {
      lo = has_mine ? cute::min(lo, other_lo) : other_lo;
      hi = has_mine ? cute::max(hi, other_hi) : other_hi;
    } else if (!has_mine) {
      return false;
    }
  } else if (!has_tile) {
    return false;
  }
  if (!has_mine) w.row0 = -1;
  split_steps(p, w, lo, hi);
  return true;
}

// The work of item (kPair: pair) `at` for this CTA; false where it has none.
template <class Traits, class Features>
__device__ __forceinline__ bool ws_work_at(AttnParams const& p, int total, int at, AttnWork& w) {
  if constexpr (Traits::kPair) {
    return ws_pair_item<Traits, Features>(p, total, at, w);
  } else {
    return schedule<Traits, Features>(p, ws_slot(p, at), w);
  }
}

// The next work of this CTA from item (kPair: pair) `at` on, stepping ws_stride(): into w, `at` past it.
template <class Traits, class Features>
__device__ __forceinline__ bool ws_next_item(AttnParams const& p, int total, int& at, AttnWork& w) {
  int const per = Traits::kPair ? 2 : 1;  // items per step of the walk
  while (at < (total + per - 1) / per) {
    bool const has_work = ws_work_at<Traits, Features>(p, total, at, w);
    at += ws_stride<Traits>();
    if (has_work) return true;
  }
  return false;
}

}  // namespace pagedattn
