"""Tiny workloads for the jit suite: each builds its inputs once and returns the call to measure.

A workload is `setup(device) -> {"fn": our call, "peer": (name, torch call) or None}`; its kernels are
whatever variants our call selects. Shared by the jit suite (host overhead, in-process) and the worker
that measures cold compiles and warm first calls in fresh processes.
"""
from __future__ import annotations

import math

import torch

H, D, BLOCK = 8, 128, 16


def _write(layout: str, kv: str):
    def setup(device):
        import pagedattn

        fp8 = kv != "auto"
        spec = pagedattn.CacheSpec(64, BLOCK, H, D, torch.uint8 if fp8 else torch.bfloat16,
                                   kv_cache_dtype=kv, layout=layout)
        kc, vc = spec.allocate(device)
        k = torch.randn(1, H, D, dtype=torch.bfloat16, device=device)
        v = torch.randn(1, H, D, dtype=torch.bfloat16, device=device)
        slots = torch.tensor([37], dtype=torch.int64, device=device)
        scale = torch.tensor([0.02], dtype=torch.float32, device=device) if fp8 else None

        def fn():
            pagedattn.reshape_and_cache_flash(k, v, kc, vc, slots, kv, scale, scale)
        peer = None
        if layout == "NHD" and not fp8:
            kf, vf = kc.view(-1, H, D), vc.view(-1, H, D)

            def torch_write():
                kf.index_copy_(0, slots, k)
                vf.index_copy_(0, slots, v)
            peer = ("torch index_copy_ (K and V)", torch_write)
        return {"fn": fn, "peer": peer}
    return setup


def _paged(device, q_len: int, L: int, kv: str):
    """One request's paged inputs, the bench's (attention.build: Hq=32, Hkv=8, D=128, block 16)."""
    from .attention import build
    from .common import Ctx

    p = dict(B=1, q_len=q_len, ctx=L, hq=32, hkv=8, d=D, bs=BLOCK, kv_cache_dtype=kv)
    return build(Ctx(torch.device(device)), p, sets=1)


def _attention(kv: str, q_len: int, L: int):
    def setup(device):
        from .attention import _ours_fn, flash_fn

        data = _paged(device, q_len, L, kv)
        ours = _ours_fn(flash_fn(), data)
        peer = None
        if kv == "auto" and q_len == 1:
            import torch.nn.functional as F

            kk, vv = data.contiguous_kv(0)
            qf = data.q[0].view(1, 8, 4, 128)
            peer = ("torch sdpa (unpaged, default backend)",
                    lambda: F.scaled_dot_product_attention(qf, kk, vv))
        return {"fn": lambda: ours(0), "peer": peer}
    return setup


def _legacy(variant: str, bs: int = 16, L: int = 1024):
    def setup(device):
        import pagedattn.legacy as legacy

        from .legacy import to_legacy

        data = _paged(device, 1, L, "auto")
        if bs != BLOCK:
            raise ValueError("jit legacy workloads use block size 16")
        kl, vl = to_legacy(data.kc, data.vc)
        out = torch.empty(1, 32, 128, dtype=torch.bfloat16, device=device)
        parts = math.ceil(L / 512)
        ws = (torch.empty(1, 32, parts, dtype=torch.float32, device=device),
              torch.empty(1, 32, parts, dtype=torch.float32, device=device),
              torch.empty(1, 32, parts, 128, dtype=torch.bfloat16, device=device))
        args = (data.q[0], kl, vl, 8, 1 / math.sqrt(128), data.tables[0], data.seqused, bs, L)
        if variant == "v1":
            return {"fn": lambda: legacy.paged_attention_v1(out, *args), "peer": None}
        return {"fn": lambda: legacy.paged_attention_v2(out, *ws, *args), "peer": None}
    return setup


def _has_flash() -> bool:
    from .attention import flash_fn

    return flash_fn() is not None


def _has_legacy() -> bool:
    try:
        import pagedattn.legacy  # noqa: F401
    except ImportError:
        return False
    return True


# name -> (family it needs, setup)
WORKLOADS = {
    "write_nhd_bf16": ("write", _write("NHD", "auto")),
    "write_hnd_bf16": ("write", _write("HND", "auto")),
    "write_nhd_fp8": ("write", _write("NHD", "fp8_e4m3")),
    "write_hnd_fp8": ("write", _write("HND", "fp8_e4m3")),
    "decode_bf16": ("flash", _attention("auto", 1, 256)),
    "decode_fp8": ("flash", _attention("fp8_e4m3", 1, 256)),
    "prefill_bf16": ("flash", _attention("auto", 256, 256)),
    "legacy_v1": ("legacy", _legacy("v1")),
    "legacy_v2": ("legacy", _legacy("v2")),
}
QUICK = ("write_nhd_bf16", "write_nhd_fp8", "decode_bf16", "legacy_v1")
# steady-state host overhead is measured on these (tiny sizes)
HOST = ("write_nhd_bf16", "write_nhd_fp8", "decode_bf16", "legacy_v1")


def available_workloads(names) -> list[str]:
    have = {"write": True, "flash": _has_flash(), "legacy": _has_legacy()}
    return [n for n in names if have[WORKLOADS[n][0]]]
