"""The historical comparison path: vLLM's native `reshape_and_cache` + `paged_attention_v1/v2`.

Cache layout ("legacy" in CacheSpec; the flash kernels refuse it, these refuse NHD/HND):
  key_cache   [num_blocks, num_kv_heads, head_size // x, block_size, x]   x = 16 // element size
  value_cache [num_blocks, num_kv_heads, head_size, block_size]
Decode only: one query token per sequence. The CUDA-core kernels are the readable contrast to the
flash path (perf/LEGACY.md compares the two families):
  v1  one CTA per (query head, sequence) scans the whole history.
  v2  one CTA per (query head, sequence, 512-token partition), then a reduce kernel merges the
      partitions' (max logit, exp-sum, partial output) with softmax_merge.cuh's stable rescaling.
`paged_attention` picks one with vLLM's rule (`use_v1`).

Semantics shared with pagedattn.legacy_reference (the oracle):
  out[s, h] = softmax(scale * q[s, h] . K[s, kv(h)]^T + alibi) @ V[s, kv(h)] over the first
  seq_lens[s] tokens, kv(h) = h // (num_heads // num_kv_heads), alibi = slope[h] * (pos - seq_len + 1).
  fp8 caches: dequantised value = stored fp8 value * k_scale (v_scale), per tensor.
  Block-table entries outside [0, num_blocks) are skipped (their tokens masked, never read); a
  sequence with no visible token gets a zero output. seq_lens beyond what block_tables can map are
  clamped; max_seq_len only sizes v2's partitions (its last partition takes any longer tail). PAGEDATTN_DEBUG=1 / validate=True turns both
  into errors instead (syncs).
"""
from __future__ import annotations

from .ops.legacy_attention import (PARTITION_SIZE, V1_MAX_SEQ_LEN, allocate_partials, num_partitions, run,
                                   use_v1)
from .ops.legacy_cache import reshape_and_cache

__all__ = ["PARTITION_SIZE", "V1_MAX_SEQ_LEN", "reshape_and_cache", "paged_attention_v1",
           "paged_attention_v2", "paged_attention", "use_v1", "num_partitions", "allocate_partials"]


def paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                       block_size, max_seq_len, alibi_slopes=None, kv_cache_dtype="auto", k_scale=None,
                       v_scale=None, *, validate: bool | None = None) -> None:
    """Decode attention over a legacy cache, one CTA per (head, sequence). Writes `out`.

    out, query: [num_seqs, num_heads, head_size] fp16/bf16 (head dim contiguous).
    block_tables: int32 [num_seqs, max_blocks_per_seq]; seq_lens: int32 [num_seqs].
    max_seq_len: an upper bound of seq_lens (v1 does not need it to size anything; it is checked
    against the table). alibi_slopes: float32 [num_heads] or None. kv_cache_dtype: "auto" | "fp8" |
    "fp8_e4m3" | "fp8_e5m2"; fp8 needs float32 one-element k_scale / v_scale.
    """
    run("v1", out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
        max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, validate=validate)


def paged_attention_v2(out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads,
                       scale, block_tables, seq_lens, block_size, max_seq_len, alibi_slopes=None,
                       kv_cache_dtype="auto", k_scale=None, v_scale=None, *,
                       validate: bool | None = None) -> None:
    """paged_attention_v1's contract, split into 512-token partitions plus a reduce pass.

    exp_sums, max_logits: float32 [num_seqs, num_heads, P]; tmp_out: [num_seqs, num_heads, P,
    head_size] in out's dtype; P >= ceil(max_seq_len / 512) (`allocate_partials` makes them).
    Partitions a sequence does not reach are neither written nor read. After the call, for a
    written partition: max_logits = its largest scaled logit (natural-log units, -inf if every token
    was masked), exp_sums = sum exp(logit - max), tmp_out = its normalised output.
    """
    run("v2", out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
        max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, (exp_sums, max_logits, tmp_out),
        validate=validate)


def paged_attention(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                    block_size, max_seq_len, alibi_slopes=None, kv_cache_dtype="auto", k_scale=None,
                    v_scale=None, *, validate: bool | None = None) -> str:
    """v1 or v2 by `use_v1`; v2's scratch is allocated here. Returns "v1" or "v2"."""
    return run("auto", out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
               block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, validate=validate)
