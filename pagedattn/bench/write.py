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
    if not hasattr(pagedattn, "reshape_and_cache_flash"):
        return False, "pagedattn.reshape_and_cache_flash is not available"
    return True, None


def cases(ctx: Ctx) -> list[Case]:
    out = []
    for layout in LAYOUTS:
        for kv in KV_DTYPES:
            for t in (TINY_TOKENS if ctx.tiny else TOKENS):
                cache = "bf16" if kv == "auto" else kv
                params = {"layout": layout, "kv_cache_dtype": kv, "cache": cache, "T": t, "H": H,
                          "D": D, "block_size": BLOCK, "input": "bf16", "scale": "tensor"}
                out.append(Case(f"write/{layout}/{cache}/T{t}", NAME, params,
                                lambda ctx, rec, p=params: run_case(ctx, rec, p)))
                if t in PAGED_TOKENS:  # the same write as a prefill does it: whole pages, shuffled
                    paged = {**params, "slots": "pages"}
                    out.append(Case(f"write/{layout}/{cache}/T{t}/pages", NAME, paged,
                                    lambda ctx, rec, p=paged: run_case(ctx, rec, p)))
    return out


def page_slots(num_blocks: int, t: int, device) -> torch.Tensor:
    """Slots of t tokens written the way a prefill writes them: consecutive slots filling whole
    pages (BLOCK tokens each), the pages drawn at random from the cache."""
    pages = torch.randperm(num_blocks, device=device)[: ceil_div(t, BLOCK)]
    return (pages[:, None] * BLOCK + torch.arange(BLOCK, device=device)).flatten()[:t].contiguous()


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    ia = a.contiguous().view(torch.uint8)
    ib = b.contiguous().view(torch.uint8)
    return bool(torch.equal(ia, ib))


def _written_view(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    bs = cache.shape[1]
    return cache[slots // bs, slots % bs]  # [T, H, D]


def run_case(ctx: Ctx, rec: Recorder, p: dict) -> None:
    dev, t, layout, kv = ctx.device, p["T"], p["layout"], p["kv_cache_dtype"]
    fp8 = kv != "auto"
    in_dtype = torch.bfloat16
    cache_dtype = torch.uint8 if fp8 else torch.bfloat16
    elem_in, elem_c = 2, (1 if fp8 else 2)
    nbytes = 2 * t * H * D * elem_in + 2 * t * H * D * elem_c + 8 * t
    rec.work("GB/s", nbytes, "copy")

    min_cache_bytes = (2 * 2**20) if ctx.tiny else 256 * 2**20
    num_slots = max(4 * t, min_cache_bytes // (H * D * elem_c))
    num_blocks = ceil_div(num_slots, BLOCK)
    num_slots = num_blocks * BLOCK
    spec = pagedattn.CacheSpec(num_blocks, BLOCK, H, D, cache_dtype, kv_cache_dtype=kv, layout=layout,
                               scale="tensor")
    kc, vc = spec.allocate(dev)
    sets = ctx.sets_for(nbytes)
    if sets * t > num_slots:
        sets = max(1, num_slots // t)
    keys = [torch.randn(t, H, D, dtype=in_dtype, device=dev) for _ in range(sets)]
    values = [torch.randn(t, H, D, dtype=in_dtype, device=dev) for _ in range(sets)]
    if p.get("slots") == "pages":
        slots = [page_slots(num_blocks, t, dev) for _ in range(sets)]
    else:
        slots = [torch.randperm(num_slots, device=dev)[:t].contiguous() for _ in range(sets)]
    if fp8:
        amax = max(float(x.abs().amax()) for x in keys + values)
        k_scale = torch.tensor([amax / 448.0], dtype=torch.float32, device=dev)
        v_scale = k_scale.clone()
    else:
        k_scale = v_scale = None
    rec.extra(sets=sets, num_blocks=num_blocks, cache_bytes=2 * num_slots * H * D * elem_c)

    def ours(k):
        pagedattn.reshape_and_cache_flash(keys[k], values[k], kc, vc, slots[k], kv, k_scale, v_scale)

    # -- correctness once, then timing (a failure here is the case's error; the peer still runs) --
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

    # -- goals (issue 3) --------------------------------------------------------------------------
    if t == 65536:
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
