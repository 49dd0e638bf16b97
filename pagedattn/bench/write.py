"""write suite: `reshape_and_cache_flash` against torch `index_copy_` into the same cache (perf/README.md has
the shapes, the bytes counted and the goals). The cache holds max(4T, 256 MiB worth of) slots; each call
writes random distinct slots, or (params "slots": "pages") whole pages drawn at random as a prefill writes
them. The check (`_check`) is bit-exact against pagedattn.reference. `--overrides '{"write": {...}}'` passes
the op's `overrides=` in every write.
"""
from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import torch

import pagedattn
from pagedattn import reference

from .common import Case, Ctx, Recorder, nan_fill_
from .timing import rotation_sets

H, D, BLOCK = 8, 128, 16
TOKENS, TINY_TOKENS = (1, 16, 256, 4096, 65536), (1, 16, 40)
PAGED_TOKENS = (65536,)  # also measured with page-contiguous slots (params "slots": "pages")


def cases(ctx: Ctx) -> list[Case]:
    out = []
    for layout, kv, t in itertools.product(("NHD", "HND"), ("auto", "fp8_e4m3"), TINY_TOKENS if ctx.tiny else TOKENS):
        cache = "bf16" if kv == "auto" else kv
        p = {"layout": layout, "kv_cache_dtype": kv, "cache": cache, "T": t, "H": H, "D": D, "block_size": BLOCK,
             "input": "bf16", "scale": "tensor"}
        ids = {f"write/{layout}/{cache}/T{t}": p}
        if t in PAGED_TOKENS:  # also the write as a prefill does it: whole pages, shuffled
            ids[f"write/{layout}/{cache}/T{t}/pages"] = {**p, "slots": "pages"}
        out += [Case(cid, "write", p, lambda ctx, rec, p=p: run_case(ctx, rec, p)) for cid, p in ids.items()]
    return out


def inputs(ctx: Ctx, p: dict) -> SimpleNamespace:
    """The caches, `sets` input sets (keys, values, slots) and scales of write params `p` (T, layout,
    kv_cache_dtype, scale "tensor" | "head", slots "random" | "pages"), and the bytes a write moves."""
    dev, t, kv = ctx.device, p["T"], p["kv_cache_dtype"]
    elem_c = 1 if kv != "auto" else 2
    nbytes = 2 * t * H * D * 2 + 2 * t * H * D * elem_c + 8 * t  # bf16 K/V read, the cache written, slots
    num_blocks = math.ceil(max(4 * t, ((2 if ctx.tiny else 256) * 2**20) // (H * D * elem_c)) / BLOCK)
    spec = pagedattn.CacheSpec(num_blocks, BLOCK, H, D, torch.uint8 if elem_c == 1 else torch.bfloat16,
                               kv_cache_dtype=kv, layout=p["layout"], scale=p.get("scale", "tensor"))
    kc, vc = spec.allocate(dev)
    sets = min(rotation_sets(nbytes, ctx.l2_bytes), max(1, spec.num_slots // t))
    keys, values = ([torch.randn(t, H, D, dtype=torch.bfloat16, device=dev) for _ in range(sets)] for _ in "kv")

    def slots():
        if p.get("slots") != "pages":
            return torch.randperm(spec.num_slots, device=dev)[:t].contiguous()
        pages = torch.randperm(num_blocks, device=dev)[: math.ceil(t / BLOCK)]
        return (pages[:, None] * BLOCK + torch.arange(BLOCK, device=dev)).flatten()[:t].contiguous()
    scale = None
    if elem_c == 1:
        amax = max(float(x.abs().amax()) for x in keys + values)
        scale = torch.full((H if spec.scale == "head" else 1,), amax / 448.0, device=dev)
    return SimpleNamespace(spec=spec, kc=kc, vc=vc, keys=keys, values=values, slots=[slots() for _ in range(sets)],
                           k_scale=scale, v_scale=None if scale is None else scale.clone(), sets=sets, nbytes=nbytes,
                           kv=kv)


def ours_fn(inp: SimpleNamespace, overrides: dict | None = None):
    """fn(k): the write of input set k (with `overrides` of the launch when given)."""
    kw = {"overrides": overrides} if overrides is not None else {}
    return lambda k: pagedattn.reshape_and_cache_flash(inp.keys[k], inp.values[k], inp.kc, inp.vc, inp.slots[k],
                                                       inp.kv, inp.k_scale, inp.v_scale, **kw)


def _quantised(inp, x, scale):  # what the cache holds for x (the peer's fp8: torch ops before the scatter)
    return reference.quantize_fp8(x, scale, inp.kv).view(torch.uint8) if inp.kv != "auto" else x


def torch_peer(inp: SimpleNamespace):
    """fn(k): input set k written by torch index_copy_ into the same caches. HND storage is [num_blocks, H,
    block_size, D]: row (blk * H + h) * bs + off of its [-1, D] view holds token (blk, off), head h
    (index_put_ through the permuted logical view would copy the whole cache on every call)."""
    if inp.spec.layout == "NHD":
        kflat, vflat = inp.kc.view(-1, H, D), inp.vc.view(-1, H, D)

        def peer(k):
            kflat.index_copy_(0, inp.slots[k], _quantised(inp, inp.keys[k], inp.k_scale))
            vflat.index_copy_(0, inp.slots[k], _quantised(inp, inp.values[k], inp.v_scale))
        return peer
    krows, vrows = (c.permute(0, 2, 1, 3).reshape(-1, D) for c in (inp.kc, inp.vc))
    assert krows.data_ptr() == inp.kc.data_ptr() and krows._base is not None, "HND rows must be a view"
    heads = torch.arange(H, device=inp.kc.device).view(1, H)

    def peer(k):
        s = inp.slots[k].view(-1, 1)
        rows = (((s // BLOCK) * H + heads) * BLOCK + s % BLOCK).reshape(-1)  # [T * H]
        krows.index_copy_(0, rows, _quantised(inp, inp.keys[k], inp.k_scale).reshape(-1, D))
        vrows.index_copy_(0, rows, _quantised(inp, inp.values[k], inp.v_scale).reshape(-1, D))
    return peer


def run_case(ctx: Ctx, rec: Recorder, p: dict) -> None:
    t, fp8 = p["T"], p["kv_cache_dtype"] != "auto"
    inp = inputs(ctx, p)
    rec.work("GB/s", inp.nbytes, "copy")
    rec.extra(sets=inp.sets, num_blocks=inp.spec.num_blocks,
              cache_bytes=2 * inp.spec.num_slots * H * D * (1 if fp8 else 2))
    ours = ours_fn(inp, ctx.overrides.get("write"))

    with rec.attempt("pagedattn"):  # correctness once, then timing (a failure is the case's error; the peer runs)
        _check(ctx, rec, inp, ours)
        rec.ours("pagedattn", ours, inp.sets)
    rec.peer("torch index_copy_", lambda: torch_peer(inp), inp.sets)
    if fp8:
        rec.note("peer quantises with torch ops before the scatter")
    if p["layout"] == "HND":
        rec.note("peer computes the HND row ids from the slots")
    if t == 65536:  # the goals of issue 3
        rec.target(0.90 if (p["layout"] == "NHD" and not fp8) else 0.80, "fraction")
    elif t == 256:
        rec.target(6.0, "us")


def _check(ctx: Ctx, rec: Recorder, inp: SimpleNamespace, ours) -> None:
    """Poison the caches, write set 0 with ours and with pagedattn.reference into poisoned caches of the same
    spec, compare bit for bit: every slot, so the written ones converted alike and the others untouched."""
    t = inp.slots[0].numel()
    ref = [nan_fill_(c) for c in inp.spec.allocate(ctx.device)]
    nan_fill_(inp.kc)
    nan_fill_(inp.vc)
    ours(0)
    reference.reshape_and_cache_flash(inp.keys[0], inp.values[0], *ref, inp.slots[0], inp.kv, inp.k_scale,
                                      inp.v_scale)
    ctx.sync()
    # [num_blocks, block, H, D] bytes -> slots whose bytes differ
    differ = {name: int((got.view(torch.uint8) != want.view(torch.uint8)).flatten(2).any(-1).sum())
              for name, got, want in (("K", inp.kc, ref[0]), ("V", inp.vc, ref[1]))}
    rec.check(not any(differ.values()), "bit-exact",
              "; ".join(f"{name}: {n} slots differ from pagedattn.reference" for name, n in differ.items() if n)
              or f"{t} tokens written as pagedattn.reference writes them, the other "
                 f"{inp.spec.num_slots - t} slots untouched")
