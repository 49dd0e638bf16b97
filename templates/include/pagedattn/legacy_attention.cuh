// paged_attention_v1 / v2 over the legacy cache layout: decode, one query token per sequence, on CUDA
// cores. The readable contrast to the flash path.
//
// Work split (one compiled kernel serves both; the launch decides):
//   v1: grid (heads, seqs, 1), partition_size = 0. A CTA scans its sequence's whole history and
//       writes the normalised output.
//   v2: grid (heads, seqs, partitions), partition_size = 512. A CTA scans one partition and writes a
//       partial state: max logit, exp-sum and the partition's normalised output (tmp_out); the reduce
//       kernel (legacy_reduce.cuh) merges the partitions.
// Inside a CTA, warp w takes the partition's cache blocks w, w + kWarps, ... and keeps its own online
// softmax state (m, l, acc). For each block:
//   1. q.k   A group of kGroupSize = 32 / block_size lanes owns one token, so the warp covers the
//            block in one step. Each lane reads whole 16-byte K chunks (the layout's x) and dots them
//            with q (in shared memory, pre-scaled); the group sums its lanes with shuffles.
//   2. softmax  The block's max joins the warp's running max m; l and acc are rescaled by
//            2^(m_old - m_new) and p = 2^(s - m_new) goes to shared memory.
//   3. p.V   A lane owns rows d = row0, row0 + kRowsPerStep, ... and a run of kVVec tokens; V rows
//            are contiguous in tokens, so each access reads kVVec tokens of one row.
// Finally the warps' (m, l, acc) are merged with softmax_merge.cuh, the same math as the v2 reduce.
//
// Safety: lengths are clamped to what the block table (and, for v2, the grid) holds; table entries
// outside [0, num_blocks) skip their block; positions past the end of the sequence are masked before
// any arithmetic, so stale or NaN cache contents there never reach the output.
#pragma once

#include "pagedattn/nvrtc_compat.cuh"
#include "pagedattn/numeric.cuh"
#include "pagedattn/legacy_convert.cuh"
#include "pagedattn/legacy_paged_cache.cuh"
#include "pagedattn/softmax_merge.cuh"

namespace pagedattn {

struct LegacyAttentionParams {
  void* out;                    // [num_seqs, num_heads, D]                    (v1)
  void const* query;            // [num_seqs, num_heads, D], D dense
  void const* key_cache;        // [num_blocks, num_kv_heads, D / x, block_size, x]
  void const* value_cache;      // [num_blocks, num_kv_heads, D, block_size]
  int32_t const* block_tables;  // [num_seqs, max_blocks_per_seq]
  int32_t const* seq_lens;      // [num_seqs]
  float const* alibi_slopes;    // [num_heads] or null
  float const* k_scale;         // fp8: [1], dequantised = stored * scale
  float const* v_scale;
  float* exp_sums;              // v2: [num_seqs, num_heads, partition_stride]
  float* max_logits;            // v2: same shape; natural-log units
  void* tmp_out;                // v2: [num_seqs, num_heads, partition_stride, D]
  int64_t q_seq_stride;         // elements
  int64_t q_head_stride;
  int64_t out_seq_stride;
  int64_t out_head_stride;
  int64_t block_table_stride;
  LegacyCacheGeometry cache;
  float qk_scale_log2;          // softmax scale * log2(e)
  int32_t queries_per_kv;       // num_heads / num_kv_heads (GQA)
  int32_t max_tokens;           // a sequence is clamped to this many tokens (the table's capacity)
  int32_t partition_size;       // 0: v1, whole sequence; else tokens per partition (multiple of block_size)
  int32_t partition_stride;     // v2: last-but-one dim of tmp_out
};

template <class Element_, class CacheElement_, Fp8Format kFp8_, int kHeadDim_, int kBlockSize_,
          int kThreads_ = 128>
struct LegacyAttention {
  using Element = Element_;
  using CacheElement = CacheElement_;
  static constexpr Fp8Format kFp8 = kFp8_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockSize = kBlockSize_;
  static constexpr int kThreads = kThreads_;
  static constexpr int kWarps = kThreads / 32;

  // q.k: a K chunk is 16 bytes (x elements); kGroupSize lanes share a token's chunks.
  static constexpr int kX = 16 / int(sizeof(CacheElement));
  static constexpr int kChunks = kHeadDim / kX;
  static constexpr int kGroupSize = 32 / kBlockSize;
  static constexpr int kChunksPerLane = (kChunks + kGroupSize - 1) / kGroupSize;
  // p.V: a lane reads kVVec tokens of one V row per access (at most 16 bytes).
  static constexpr int kVVec = kX < kBlockSize ? kX : kBlockSize;
  static constexpr int kVecsPerRow = kBlockSize / kVVec;
  static constexpr int kRowsPerStep = 32 / kVecsPerRow;
  static constexpr int kRowsPerLane = (kHeadDim + kRowsPerStep - 1) / kRowsPerStep;

  static_assert(kBlockSize == 8 || kBlockSize == 16 || kBlockSize == 32,
                "one warp step covers a block: block_size must be 8, 16 or 32");
  static_assert(kHeadDim % kX == 0, "head_size must be a multiple of the layout's x");
  static_assert(kHeadDim % 4 == 0, "q is read from shared memory as float4");
  static_assert(kThreads % 32 == 0 && kWarps >= 1, "whole warps");

  using Cache = LegacyPagedCache<CacheElement const, kBlockSize>;

  struct SharedStorage {
    alignas(16) float q[kHeadDim];          // pre-scaled query
    float p[kWarps][kBlockSize];            // probabilities of the block a warp is on
    float acc[kWarps][kHeadDim];            // each warp's unnormalised output, for the final merge
    SoftmaxPartial state[kWarps];
  };

  // q . k for token `token` of the block, by the kGroupSize lanes of its group; every lane of the
  // group returns the sum. K chunks of the group's lanes interleave: lane `member` takes chunks
  // member, member + kGroupSize, ...
  static __device__ __forceinline__ float qk_dot(Cache const& cache, int64_t block, int kv_head,
                                                 int token, int member, float const* sQ) {
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < kChunksPerLane; ++j) {
      int const chunk = member + j * kGroupSize;
      if (kChunks % kGroupSize == 0 || chunk < kChunks) {
        float k[kX];
        load_as_float<CacheElement, kFp8>(cache.k_chunk(block, kv_head, chunk, token), k);
        float4 const* q4 = reinterpret_cast<float4 const*>(sQ + chunk * kX);
#pragma unroll
        for (int i = 0; i < kX; i += 4) {
          float4 const q = q4[i / 4];
          dot += q.x * k[i] + q.y * k[i + 1] + q.z * k[i + 2] + q.w * k[i + 3];
        }
      }
    }
#pragma unroll
    for (int mask = kGroupSize / 2; mask > 0; mask /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, mask);
    return dot;
  }

  static __device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int mask = 16; mask > 0; mask /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, mask));
    return x;
  }

  static __device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int mask = 16; mask > 0; mask /= 2) x += __shfl_xor_sync(0xffffffffu, x, mask);
    return x;
  }

  static __device__ __forceinline__ void run(LegacyAttentionParams const& p) {
    __shared__ SharedStorage smem;
    int const head = blockIdx.x;
    int const seq = blockIdx.y;
    int const partition = blockIdx.z;
    int const warp = threadIdx.x / 32;
    int const lane = threadIdx.x % 32;
    int const kv_head = head / p.queries_per_kv;

    // The token range [begin, end) of this CTA. seq_len is clamped to what the table holds; v2's last
    // partition also takes every token past the grid (max_seq_len is a hint that sizes the grid).
    int const seq_len = max(p.seq_lens[seq], 0);
    int const len = min(seq_len, p.max_tokens);
    int begin = 0;
    int end = len;
    if (p.partition_size > 0) {
      begin = partition * p.partition_size;
      if (begin >= len) return;  // nothing of this sequence here: the reduce never reads this slot
      end = partition == int(gridDim.z) - 1 ? len : min(begin + p.partition_size, len);
    }

    Cache const cache{p.cache, static_cast<CacheElement const*>(p.key_cache),
                      static_cast<CacheElement const*>(p.value_cache)};
    LegacyBlockTable const table{p.block_tables + seq * p.block_table_stride, p.cache.num_blocks};

    // q into shared memory, scaled so that q.k is the logit in log2 units (fp8: times k_scale).
    float qk_scale = p.qk_scale_log2;
    float v_scale = 1.f;
    if constexpr (kFp8 != Fp8Format::kNone) {
      qk_scale *= p.k_scale[0];
      v_scale = p.v_scale[0];
    }
    Element const* q = static_cast<Element const*>(p.query) + seq * p.q_seq_stride + head * p.q_head_stride;
    for (int d = threadIdx.x; d < kHeadDim; d += kThreads) smem.q[d] = to_float(q[d]) * qk_scale;
    // ALiBi: slope * (position - (seq_len - 1)), in log2 units.
    float const alibi = p.alibi_slopes != nullptr ? p.alibi_slopes[head] * kLog2e : 0.f;
    __syncthreads();

    // This lane's roles: token `group` of a block in q.k; rows row0 + i * kRowsPerStep and tokens
    // vec * kVVec .. + kVVec in p.V.
    int const group = lane / kGroupSize;
    int const member = lane % kGroupSize;
    int const row0 = lane / kVecsPerRow;
    int const vec = lane % kVecsPerRow;

    SoftmaxPartial state = SoftmaxPartial::empty();
    float acc[kRowsPerLane];
#pragma unroll
    for (int i = 0; i < kRowsPerLane; ++i) acc[i] = 0.f;

    int const first_block = begin / kBlockSize;
    int const end_block = (end + kBlockSize - 1) / kBlockSize;
    for (int n = first_block + warp; n < end_block; n += kWarps) {
      int const block = table.physical(n);
      if (block < 0) continue;  // corrupt table entry: the block's tokens are masked (uniform)

      // 1. q.k for token `group` of the block.
      int const token = n * kBlockSize + group;
      float s = qk_dot(cache, block, kv_head, group, member, smem.q);
      s += alibi * float(token - seq_len + 1);
      s = token >= begin && token < end ? s : kNegInf;  // select: a NaN past the end never propagates

      // 2. Online softmax: fold this block into the warp's state.
      float const m_new = fmaxf(state.m, warp_max(s));
      float const rescale = softmax_rescale(state.m, m_new);
      float const prob = softmax_rescale(s, m_new);  // 0 for masked tokens
      state = {m_new, state.l * rescale + warp_sum(member == 0 ? prob : 0.f)};
      if (member == 0) smem.p[warp][group] = prob;
      __syncwarp();

      // 3. acc = acc * rescale + p . V over this block.
      float probs[kVVec];
#pragma unroll
      for (int t = 0; t < kVVec; ++t) probs[t] = smem.p[warp][vec * kVVec + t];
      int const run_start = n * kBlockSize + vec * kVVec;
      bool const tail = (n + 1) * kBlockSize > end;  // last block: zero V past the end (uniform)
#pragma unroll
      for (int i = 0; i < kRowsPerLane; ++i) {
        int const d = row0 + i * kRowsPerStep;
        acc[i] *= rescale;
        if (kHeadDim % kRowsPerStep == 0 || d < kHeadDim) {
          float v[kVVec];
          load_as_float<CacheElement, kFp8>(cache.v_row(block, kv_head, d, vec * kVVec), v);
          float dot = 0.f;
#pragma unroll
          for (int t = 0; t < kVVec; ++t) {
            if (tail && run_start + t >= end) v[t] = 0.f;
            dot += probs[t] * v[t];
          }
          acc[i] += dot;
        }
      }
      __syncwarp();  // smem.p is rewritten by the next block
    }

    // Lanes sharing rows (different token runs) sum their accumulators; one of them publishes.
#pragma unroll
    for (int i = 0; i < kRowsPerLane; ++i) {
#pragma unroll
      for (int mask = kVecsPerRow / 2; mask > 0; mask /= 2)
        acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], mask);
    }
    if (vec == 0) {
#pragma unroll
      for (int i = 0; i < kRowsPerLane; ++i) {
        int const d = row0 + i * kRowsPerStep;
        if (kHeadDim % kRowsPerStep == 0 || d < kHeadDim) smem.acc[warp][d] = acc[i];
      }
    }
    if (lane == 0) smem.state[warp] = state;
    __syncthreads();

    // Merge the warps. v1 writes the output; v2 its partition's slot of tmp_out / exp_sums / max_logits.
    auto const state_at = [&](int w) { return smem.state[w]; };
    auto const value_at = [&](int w, int d) { return smem.acc[w][d]; };
    if (p.partition_size == 0) {
      Element* out = static_cast<Element*>(p.out) + seq * p.out_seq_stride + head * p.out_head_stride;
      softmax_merge_partials<kThreads, kHeadDim, kWarps, false>(
          kWarps, state_at, value_at, [&](int d, float x) { out[d] = from_float<Element>(x * v_scale); });
    } else {
      int64_t const slot = (int64_t(seq) * gridDim.x + head) * p.partition_stride + partition;
      Element* out = static_cast<Element*>(p.tmp_out) + slot * kHeadDim;
      SoftmaxPartial const total = softmax_merge_partials<kThreads, kHeadDim, kWarps, false>(
          kWarps, state_at, value_at, [&](int d, float x) { out[d] = from_float<Element>(x * v_scale); });
      if (threadIdx.x == 0) {
        p.max_logits[slot] = total.m == kNegInf ? kNegInf : total.m * kLn2;
        p.exp_sums[slot] = total.l;
      }
    }
  }
};

}  // namespace pagedattn
