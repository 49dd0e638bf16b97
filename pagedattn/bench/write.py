"""write suite: `reshape_and_cache_flash` against torch `index_copy_` into the same cache (perf/README.md
has the shapes, the bytes counted and the goals). The cache holds max(4T, 256 MiB worth of) slots; each
call writes random distinct slots, or (params "slots": "pages") whole pages drawn at random as a prefill
writes them. The check (`_check`) is bit-exact against pagedattn.reference.
"""
from __future__ import annotations

import torch

import pagedattn
from pagedattn import reference

from .common import Case, Ctx, Recorder, ceil_div, nan_fill_

NAME = "write"
H, D, BLOCK = 8, 128, 16
TOKENS = (1, 16, 256, 4096, 65536)
PAGED_TOKENS = (65536,)  # also measured with page-contiguous slots (params "slots": "pages")
TINY_TOKENS = (1, 16, 40)
KV_DTYPES = ("auto", "fp8_e4m3")
LAYOUTS = ("NHD", "HND")
GOALS = {"T65536_NHD_bf16": 0.90, "T65536_other": 0.80, "T256_us": 6.0}


def available(ctx: Ctx):
    ok = hasattr(pagedattn, "reshape_and_cache_flash")
    return (True, None) if ok else (False, "pagedattn.reshape_and_cache_flash is not available")


def cases(ctx: Ctx) -> list[Case]:
    out = []
    for layout in LAYOUTS:
        for kv in KV_DTYPES:
            for t in (TINY_TOKENS if ctx.tiny else TOKENS):
                cache = "bf16" if kv == "auto" else kv
                params = {"layout": layout, "kv_cache_dtype": kv, "cache": cache, "T": t, "H": H,
                          "D": D, "block_size": BLOCK, "input": "bf16", "scale": "tensor"}
                ids = {f"write/{layout}/{cache}/T{t}": params}
                if t in PAGED_TOKENS:  # also the write as a prefill does it: whole pages, shuffled
                    ids[f"write/{layout}/{cache}/T{t}/pages"] = {**params, "slots": "pages"}
                out += [Case(cid, NAME, p, lambda ctx, rec, p=p: run_case(ctx, rec, p)) for cid, p in ids.items()]
    return out


def page_slots(num_blocks: int, t: int, device) -> torch.Tensor:
    """Slots of t tokens written the way a prefill writes them: consecutive slots filling whole
    pages (BLOCK tokens each), the pages drawn at random from the cache."""
    pages = torch.randperm(num_blocks, device=device)[: ceil_div(t, BLOCK)]
    return (pages[:, None] * BLOCK + torch.arange(BLOCK, device=device)).flatten()[:t].contiguous()


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _written_view(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return cache[slots // cache.shape[1], slots % cache.shape[1]]  # [T, H, D]


def run_case(ctx: Ctx, rec: Recorder, p: dict) -> None:
    dev, t, layout, kv = ctx.device, p["T"], p["layout"], p["kv_cache_dtype"]
    fp8 = kv != "auto"
    elem_c = 1 if fp8 else 2
    nbytes = 2 * t * H * D * 2 + 2 * t * H * D * elem_c + 8 * t  # bf16 K/V read, the cache written, slots
    rec.work("GB/s", nbytes, "copy")
    num_blocks = ceil_div(max(4 * t, ((2 if ctx.tiny else 256) * 2**20) // (H * D * elem_c)), BLOCK)
    num_slots = num_blocks * BLOCK
    spec = pagedattn.CacheSpec(num_blocks, BLOCK, H, D, torch.uint8 if fp8 else torch.bfloat16, kv_cache_dtype=kv,
                               layout=layout, scale="tensor")
    kc, vc = spec.allocate(dev)
    sets = min(ctx.sets_for(nbytes), max(1, num_slots // t))
    keys = [torch.randn(t, H, D, dtype=torch.bfloat16, device=dev) for _ in range(sets)]
    values = [torch.randn(t, H, D, dtype=torch.bfloat16, device=dev) for _ in range(sets)]
    if p.get("slots") == "pages":
        slots = [page_slots(num_blocks, t, dev) for _ in range(sets)]
    else:
        slots = [torch.randperm(num_slots, device=dev)[:t].contiguous() for _ in range(sets)]
    k_scale = v_scale = None
    if fp8:
        k_scale = torch.tensor([max(float(x.abs().amax()) for x in keys + values) / 448.0], device=dev)
        v_scale = k_scale.clone()
    rec.extra(sets=sets, num_blocks=num_blocks, cache_bytes=2 * num_slots * H * D * elem_c)

    def ours(k):
        pagedattn.reshape_and_cache_flash(keys[k], values[k], kc, vc, slots[k], kv, k_scale, v_scale)

    # correctness once, then timing (a failure here is the case's error; the peer still runs)
    def check_and_time():
        _check(ctx, rec, p, spec, ours, keys[0], values[0], slots[0], kc, vc, k_scale, v_scale)
        rec.ours("pagedattn", ours, sets)
    rec.attempt("pagedattn", check_and_time)

    def quantised(x, scale):  # the peer's fp8: torch ops before the scatter
        return reference.quantize_fp8(x, scale, kv).view(torch.uint8) if fp8 else x

    def make():
        if layout == "NHD":
            kflat, vflat = kc.view(-1, H, D), vc.view(-1, H, D)

            def peer(k):
                kflat.index_copy_(0, slots[k], quantised(keys[k], k_scale))
                vflat.index_copy_(0, slots[k], quantised(values[k], v_scale))
            return peer
        # HND storage is [num_blocks, H, block_size, D]: row (blk * H + h) * bs + off of its [-1, D] view
        # holds token (blk, off), head h. (index_put_ through the permuted logical view would copy the
        # whole cache on every call: not a fair peer.)
        krows = kc.permute(0, 2, 1, 3).reshape(-1, D)
        vrows = vc.permute(0, 2, 1, 3).reshape(-1, D)
        assert krows.data_ptr() == kc.data_ptr() and krows._base is not None, "HND rows must be a view"
        heads = torch.arange(H, device=dev).view(1, H)

        def peer(k):
            s = slots[k].view(-1, 1)
            rows = (((s // BLOCK) * H + heads) * BLOCK + s % BLOCK).reshape(-1)  # [T * H]
            krows.index_copy_(0, rows, quantised(keys[k], k_scale).reshape(-1, D))
            vrows.index_copy_(0, rows, quantised(values[k], v_scale).reshape(-1, D))
        return peer
    rec.peer("torch index_copy_", make, sets)
    if fp8:
        rec.note("peer quantises with torch ops before the scatter")
    if layout == "HND":
        rec.note("peer computes the HND row ids from the slots")

    if t == 65536:  # the goals of issue 3
        rec.target(GOALS["T65536_NHD_bf16"] if (layout == "NHD" and not fp8) else GOALS["T65536_other"],
                   "fraction")
    elif t == 256:
        rec.target(GOALS["T256_us"], "us")


def _check(ctx, rec, p, spec, ours, key, value, slots, kc, vc, k_scale, v_scale) -> None:
    """Poison the caches, write with ours, compare bit for bit (see the module docstring)."""
    t, layout, kv = p["T"], p["layout"], p["kv_cache_dtype"]
    fp8 = kv != "auto"
    num_blocks, num_slots = spec.num_blocks, spec.num_slots
    nan_fill_(kc)
    nan_fill_(vc)
    ours(0)
    ctx.sync()
    problems = []
    for name, src, cache, scale in (("K", key, kc, k_scale), ("V", value, vc, v_scale)):
        expect = reference.quantize_fp8(src, scale, kv).view(torch.uint8) if fp8 else src
        if not _bit_equal(_written_view(cache, slots), expect):
            problems.append(f"{name}: written slots differ from the reference conversion")
        rows = cache.reshape(num_blocks, BLOCK, H * D) if layout == "NHD" else cache
        poisoned = (rows.view(torch.uint8) == 0x7F).all(-1) if fp8 else torch.isnan(rows).all(-1)
        untouched = int(poisoned.reshape(num_slots, -1).all(-1).sum())
        if untouched != num_slots - t:
            problems.append(f"{name}: {num_slots - untouched} slots written, expected {t}")
    n = min(t, 64)
    rk, rv = spec.allocate(ctx.device)
    nan_fill_(rk)
    nan_fill_(rv)
    reference.reshape_and_cache_flash(key[:n], value[:n], rk, rv, slots[:n], kv, k_scale, v_scale)
    for name, got, ref in (("K", kc, rk), ("V", vc, rv)):
        if not _bit_equal(_written_view(got, slots[:n]), _written_view(ref, slots[:n])):
            problems.append(f"{name}: differs from pagedattn.reference on the first {n} tokens")
    rec.check(not problems, "bit-exact",
              "; ".join(problems) or f"{t} tokens bit-exact, {num_slots - t} other slots untouched")
