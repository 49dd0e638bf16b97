"""ctypes mirrors of the C++ Params structs (templates/include/pagedattn/*.cuh). The rendered sources
static_assert every offset against these, so a drift fails at compile time."""
from __future__ import annotations

import ctypes as C


class CacheGeometry(C.Structure):
    _fields_ = [
        ("block_stride", C.c_int64),
        ("page_stride", C.c_int64),
        ("head_stride", C.c_int64),
        ("num_slots", C.c_int64),
        ("num_blocks", C.c_int32),
        ("block_size", C.c_int32),
        ("num_heads", C.c_int32),
        ("head_size", C.c_int32),
    ]


class KvWriteParams(C.Structure):
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
        ("cache", CacheGeometry),
        ("scale_stride", C.c_int32),
        ("slot_is_int64", C.c_int32),
    ]


def _fields(spec: str):
    """'name:type, ...' -> ctypes _fields_ (p = pointer, i64, i32, f32)."""
    kinds = {"p": C.c_void_p, "i64": C.c_int64, "i32": C.c_int32, "f32": C.c_float}
    out = []
    for item in spec.split(","):
        name, kind = item.split(":")
        out.append((name.strip(), kinds[kind.strip()]))
    return out


class AttnParams(C.Structure):
    _fields_ = _fields(
        "q:p, out:p, lse:p, k:p, v:p, block_table:p, cu_seqlens_q:p, seqused_k:p, cu_seqlens_k:p,"
        "k_descale:p, v_descale:p, o_accum:p, lse_accum:p,"
        "q_row_stride:i64, q_head_stride:i64, o_row_stride:i64, o_head_stride:i64,"
        "k_block_stride:i64, k_row_stride:i64, k_head_stride:i64,"
        "v_block_stride:i64, v_row_stride:i64, v_head_stride:i64,"
        "bt_stride:i32, max_blocks_per_seq:i32, num_blocks:i32, block_size:i32, block_shift:i32,"
        "num_seqs:i32, num_q_heads:i32, num_kv_heads:i32, group:i32, head_size:i32, total_q:i32,"
        "num_splits:i32, causal:i32, descale_batch_stride:i32, descale_head_stride:i32, scale_log2:f32")


class CombineParams(C.Structure):
    _fields_ = _fields(
        "o_accum:p, lse_accum:p, out:p, lse:p, o_row_stride:i64, o_head_stride:i64,"
        "o_accum_row:i32, total_q:i32, num_q_heads:i32, head_size:i32, num_splits:i32")
