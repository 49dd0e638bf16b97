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
