// paged_attention_v2's second pass: one CTA per (head, sequence) merges the sequence's partitions.
// Partition i left (max_logits[i], exp_sums[i], tmp_out[i]), its normalised output; the merge is
// softmax_merge.cuh's: weight_i = 2^(m_i - M) l_i / sum_j 2^(m_j - M) l_j. A sequence with one
// partition gets weight exactly 1, so v2 then matches v1 bit for bit.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/numeric.cuh"
#include "pagedattn/legacy_convert.cuh"
#include "pagedattn/softmax_merge.cuh"

namespace pagedattn {

struct LegacyReduceParams {
  void* out;                  // [num_seqs, num_heads, D]
  float const* exp_sums;      // [num_seqs, num_heads, partition_stride]
  float const* max_logits;    // same shape; natural-log units, -inf for an empty partition
  void const* tmp_out;        // [num_seqs, num_heads, partition_stride, D]
  int32_t const* seq_lens;    // [num_seqs]
  int64_t out_seq_stride;     // elements
  int64_t out_head_stride;
  int32_t max_tokens;         // the attention kernel's clamp: the same partitions exist here
  int32_t partition_size;
  int32_t partition_stride;
  int32_t num_partitions;     // partitions of the attention grid (its last one covers the rest)
};

template <class Element_, int kHeadDim_, int kThreads_ = 128>
struct LegacyReduce {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kThreads = kThreads_;
  static constexpr int kChunk = 256;  // partitions weighed per pass (128k tokens)

  static __device__ __forceinline__ void run(LegacyReduceParams const& p) {
    int const head = blockIdx.x;
    int const seq = blockIdx.y;
    int const len = min(max(p.seq_lens[seq], 0), p.max_tokens);
    int const num_partitions = min((len + p.partition_size - 1) / p.partition_size, p.num_partitions);

    int64_t const first = (int64_t(seq) * gridDim.x + head) * p.partition_stride;
    float const* exp_sums = p.exp_sums + first;
    float const* max_logits = p.max_logits + first;
    Element const* tmp_out = static_cast<Element const*>(p.tmp_out) + first * kHeadDim;
    Element* out = static_cast<Element*>(p.out) + seq * p.out_seq_stride + head * p.out_head_stride;

    softmax_merge_partials<kThreads, kHeadDim, kChunk, true>(
        num_partitions,
        [&](int i) { return SoftmaxPartial{max_logits[i] * kLog2e, exp_sums[i]}; },
        [&](int i, int d) { return to_float(tmp_out[int64_t(i) * kHeadDim + d]); },
        [&](int d, float x) { out[d] = from_float<Element>(x); });
  }
};

}  // namespace pagedattn
