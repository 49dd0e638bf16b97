"""The CUtensorMaps of decode_tma: K and V of a paged cache described for the TMA engine."""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from .tiles import fp8_regs

if TYPE_CHECKING:
    from .validate import _Call

_TMA_DTYPE = {torch.float16: "FLOAT16", torch.bfloat16: "BFLOAT16"}
# L2 promotion of the K/V tensor maps (CU_TENSOR_MAP_L2_PROMOTION_<this>): NONE, L2_64B, L2_128B, L2_256B.
# Boxes are 128 bytes wide. Measured on H200 (perf/results/history/decode_sweep_h200_promotion_64b556a):
# 256-byte promotion cost 6 % of decode bandwidth (B=64 ctx 4096: 269.7 us against 254.0 with 128 bytes,
# 254.2 with none; ncu: 26 % L2 "hits" on lines promoted while in flight, DRAM at 83 % against 90 %).
TMA_L2_PROMOTION = "L2_128B"


def tma_maps(k: torch.Tensor, v: torch.Tensor, call: _Call, head_dim: int) -> tuple[torch.Tensor, int]:
    """Device buffer holding the K and V CUtensorMaps (2 x 128 bytes) of a paged cache, and the
    tensor-map dimension of the slot within a page. `_Plan.tma_maps` keeps them per cache.

    Dimensions, innermost first, in increasing stride (the layouts differ only in the middle two):
    NHD (d, head, slot, block), HND (d, slot, head, block). A box is one page's kBlockN=16 slots of
    one head: 64 columns with 128-byte swizzle (16-bit caches; prefill_ws at head dims 96 and 80: 32 or
    16 columns with 64- or 32-byte swizzle, box_cols), 128 columns with 128-byte swizzle (fp8 with a head
    dim that is a multiple of 128: fp8_regs), or the whole row (other fp8, unswizzled)."""
    from cuda.bindings import driver as drv

    from ...codegen.load import check

    fp8 = call.kv_name != "auto"
    width = 1 if fp8 else 2
    dtype = getattr(drv.CUtensorMapDataType, "CU_TENSOR_MAP_DATA_TYPE_" + ("UINT8" if fp8 else _TMA_DTYPE[k.dtype]))
    plain = fp8 and not fp8_regs(head_dim, True)
    cols = head_dim if plain else box_cols(head_dim, fp8)
    swizzle = getattr(drv.CUtensorMapSwizzle, "CU_TENSOR_MAP_SWIZZLE_" + ("NONE" if plain else f"{cols * width}B"))
    blocks, bs, heads = call.num_blocks, call.block_size, call.Hkv
    maps = bytearray()
    for t, (s_block, s_row, s_head) in ((k, call.k_strides), (v, call.v_strides)):
        if s_head < s_row:    # NHD
            dims, strides, box, row_dim = (call.D, heads, bs, blocks), (s_head, s_row, s_block), (cols, 1, 16, 1), 2
        else:                 # HND
            dims, strides, box, row_dim = (call.D, bs, heads, blocks), (s_row, s_head, s_block), (cols, 16, 1, 1), 1
        tmap = check(drv.cuTensorMapEncodeTiled(
            dtype, 4, t.data_ptr(), [drv.cuuint64_t(x) for x in dims],
            [drv.cuuint64_t(x * width) for x in strides], [drv.cuuint32_t(x) for x in box],
            [drv.cuuint32_t(1)] * 4,
            drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
            getattr(drv.CUtensorMapL2promotion, "CU_TENSOR_MAP_L2_PROMOTION_" + TMA_L2_PROMOTION),
            drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
        maps += ctypes.string_at(int(tmap.getPtr()), 128)
    return torch.frombuffer(maps, dtype=torch.uint8).to(k.device), row_dim


def box_cols(head_dim: int, fp8: bool) -> int:
    """Columns of a swizzled box: one 128-byte row (128 fp8 or 64 16-bit columns), or for a 16-bit head
    dim that is not a multiple of 64 the widest panel that divides it, 32 (64-byte rows: prefill_ws at
    96) or 16 (32-byte rows: at 80): AttnTraits::kBlockKSmem, the panels the kernels' shared-memory
    tiles are made of."""
    if fp8:
        return 128
    if head_dim % 16:
        raise ValueError(f"tma_maps: no swizzled TMA box for a 16-bit head dim of {head_dim}")
    return next(w for w in (64, 32, 16) if head_dim % w == 0)
