"""ctypes mirrors of the legacy kernels' Params structs (templates/include/pagedattn/legacy_*.cuh).
The rendered sources static_assert their size and alignment against these."""
from __future__ import annotations

import ctypes as C


class LegacyCacheGeometry(C.Structure):
    _fields_ = [
        ("k_block_stride", C.c_int64),
        ("k_head_stride", C.c_int64),
        ("v_block_stride", C.c_int64),
        ("v_head_stride", C.c_int64),
        ("num_blocks", C.c_int32),
        ("num_heads", C.c_int32),
        ("head_size", C.c_int32),
        ("block_size", C.c_int32),
    ]


class LegacyCacheWriteParams(C.Structure):
    _fields_ = [
        ("key", C.c_void_p),
        ("value", C.c_void_p),
        ("key_cache", C.c_void_p),
        ("value_cache", C.c_void_p),
        ("slot_mapping", C.c_void_p),
        ("k_scale", C.c_void_p),
        ("v_scale", C.c_void_p),
        ("key_stride", C.c_int64),
        ("value_stride", C.c_int64),
        ("cache", LegacyCacheGeometry),
        ("slot_is_int64", C.c_int32),
        ("reserved", C.c_int32),
    ]


class LegacyAttentionParams(C.Structure):
    _fields_ = [
        ("out", C.c_void_p),
        ("query", C.c_void_p),
        ("key_cache", C.c_void_p),
        ("value_cache", C.c_void_p),
        ("block_tables", C.c_void_p),
        ("seq_lens", C.c_void_p),
        ("alibi_slopes", C.c_void_p),
        ("k_scale", C.c_void_p),
        ("v_scale", C.c_void_p),
        ("exp_sums", C.c_void_p),
        ("max_logits", C.c_void_p),
        ("tmp_out", C.c_void_p),
        ("q_seq_stride", C.c_int64),
        ("q_head_stride", C.c_int64),
        ("out_seq_stride", C.c_int64),
        ("out_head_stride", C.c_int64),
        ("block_table_stride", C.c_int64),
        ("cache", LegacyCacheGeometry),
        ("qk_scale_log2", C.c_float),
        ("queries_per_kv", C.c_int32),
        ("max_tokens", C.c_int32),
        ("partition_size", C.c_int32),
        ("partition_stride", C.c_int32),
    ]


class LegacyReduceParams(C.Structure):
    _fields_ = [
        ("out", C.c_void_p),
        ("exp_sums", C.c_void_p),
        ("max_logits", C.c_void_p),
        ("tmp_out", C.c_void_p),
        ("seq_lens", C.c_void_p),
        ("out_seq_stride", C.c_int64),
        ("out_head_stride", C.c_int64),
        ("max_tokens", C.c_int32),
        ("partition_size", C.c_int32),
        ("partition_stride", C.c_int32),
        ("reserved", C.c_int32),
    ]
