"""ctypes mirrors of every kernel's C++ Params struct (templates/include/pagedattn/*.cuh). The rendered
sources static_assert each struct's size and alignment against these; field order is covered by the
GPU tests. Fields are written 'name:kind' with kind p (pointer), i64, i32, f32, or a struct below."""
from __future__ import annotations

import ctypes as C

_KINDS = {"p": C.c_void_p, "i64": C.c_int64, "i32": C.c_int32, "f32": C.c_float}


def _struct(name: str, spec: str, **structs) -> type[C.Structure]:
    fields = []
    for item in spec.split(","):
        field, kind = (x.strip() for x in item.split(":"))
        fields.append((field, structs[kind] if kind in structs else _KINDS[kind]))
    return type(name, (C.Structure,), {"_fields_": fields})


# -- flash path (kv_write.cuh, paged_kv.cuh, attn_params.cuh) --------------------------------------
CacheGeometry = _struct(
    "CacheGeometry",
    "block_stride:i64, page_stride:i64, head_stride:i64, num_slots:i64,"
    "num_blocks:i32, block_size:i32, num_heads:i32, head_size:i32")

KvWriteParams = _struct(
    "KvWriteParams",
    "key:p, value:p, key_cache:p, value_cache:p, slot_mapping:p, k_scale:p, v_scale:p,"
    "cache_seqlens:p, block_table:p, seqused_out:p,"
    "key_stride:i64, value_stride:i64, cache:CacheGeometry, scale_stride:i32, slot_is_int64:i32,"
    "num_tokens:i32, append_tokens:i32, table_width:i32, table_stride:i32, batch:i32",
    CacheGeometry=CacheGeometry)

AttnParams = _struct(
    "AttnParams",
    "q:p, out:p, lse:p, k:p, v:p, block_table:p, cu_seqlens_q:p, seqused_k:p, cu_seqlens_k:p,"
    "k_descale:p, v_descale:p, o_accum:p, lse_accum:p, tma_desc:p, split_counters:p, alibi_slopes:p, sinks:p,"
    "q_row_stride:i64, q_head_stride:i64, o_row_stride:i64, o_head_stride:i64,"
    "k_block_stride:i64, k_row_stride:i64, k_head_stride:i64,"
    "v_block_stride:i64, v_row_stride:i64, v_head_stride:i64,"
    "bt_stride:i32, max_blocks_per_seq:i32, num_blocks:i32, block_size:i32, block_shift:i32,"
    "num_seqs:i32, num_q_heads:i32, num_kv_heads:i32, group:i32, head_size:i32, total_q:i32, total_k:i32,"
    "num_splits:i32, causal:i32, descale_batch_stride:i32, descale_head_stride:i32, tma_row_dim:i32,"
    "window_left:i32, window_right:i32, alibi_batch_stride:i32, scale_log2:f32, softcap:f32, grid_tiles:i32")

# -- legacy path (legacy_*.cuh) ---------------------------------------------------------------------
LegacyCacheGeometry = _struct(
    "LegacyCacheGeometry",
    "k_block_stride:i64, k_head_stride:i64, v_block_stride:i64, v_head_stride:i64,"
    "num_blocks:i32, num_heads:i32, head_size:i32, block_size:i32")

LegacyCacheWriteParams = _struct(
    "LegacyCacheWriteParams",
    "key:p, value:p, key_cache:p, value_cache:p, slot_mapping:p, k_scale:p, v_scale:p,"
    "key_stride:i64, value_stride:i64, cache:LegacyCacheGeometry, slot_is_int64:i32, reserved:i32",
    LegacyCacheGeometry=LegacyCacheGeometry)

LegacyAttentionParams = _struct(
    "LegacyAttentionParams",
    "out:p, query:p, key_cache:p, value_cache:p, block_tables:p, seq_lens:p, alibi_slopes:p,"
    "k_scale:p, v_scale:p, exp_sums:p, max_logits:p, tmp_out:p,"
    "q_seq_stride:i64, q_head_stride:i64, out_seq_stride:i64, out_head_stride:i64,"
    "block_table_stride:i64, cache:LegacyCacheGeometry, qk_scale_log2:f32, queries_per_kv:i32,"
    "max_tokens:i32, partition_size:i32, partition_stride:i32",
    LegacyCacheGeometry=LegacyCacheGeometry)

LegacyReduceParams = _struct(
    "LegacyReduceParams",
    "out:p, exp_sums:p, max_logits:p, tmp_out:p, seq_lens:p, out_seq_stride:i64, out_head_stride:i64,"
    "max_tokens:i32, partition_size:i32, partition_stride:i32, num_partitions:i32")
