// The warp-specialised prefill's plumbing that its producer and consumer warpgroups share
// (mainloop_ws.cuh): the register hand-over, the K/V rings' mbarriers and slots, the consumers' barriers
// and ping-pong turns, and the walk over a persistent CTA's work items.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/attn_smem.cuh"
#include "pagedattn/tile_scheduler.cuh"

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

// The next work item from `item` on (stepping gridDim.x) that has a tile: into w, item past it.
template <class Traits, class Features>
__device__ __forceinline__ bool ws_next_item(AttnParams const& p, int total, int& item, AttnWork& w) {
  while (item < total) {
    bool const has_tile = schedule<Traits, Features>(p, ws_slot(p, item), w);
    item += gridDim.x;
    if (has_tile) return true;
  }
  return false;
}

}  // namespace pagedattn
