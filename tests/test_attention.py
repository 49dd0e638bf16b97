"""flash_attn_varlen_func: the reference (CPU), compilation (CPU), the kernel against the reference on
NaN-poisoned caches with shuffled tables (GPU), and bad input (CPU and GPU)."""
import contextlib
import itertools
import math
import random

import pytest
import torch
import torch.nn.functional as F

import pagedattn
from pagedattn import CacheSpec, ContractError, reference
from pagedattn.codegen.compile import compile_source, nvrtc_options
from pagedattn.codegen.toolchain import toolchain
from pagedattn.ops.attention import WGMMA_MODES, AttnFwdSpec, flash_attn_varlen_func, kernel_head_dim
from pagedattn.ops.attention.tiles import SMEM_PER_CTA
from pagedattn.ops.attention import heuristics as attention_heuristics
from pagedattn.registry import Kernel, UnsupportedError, variant_name

from _compile_grid import grid

DEV = "cuda" if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------- helpers
def build_case(lens_q, lens_k, Hq, Hkv, D, block_size, layout, dtype, kv, scale_gran, gen, device="cuda"):
    """Random K/V written into a NaN-poisoned paged cache through a shuffled block table."""
    B = len(lens_q)
    blocks_per_seq = [max(1, -(-k // block_size)) for k in lens_k]
    width = max(blocks_per_seq) + 1
    num_blocks = sum(blocks_per_seq) + 3
    cache_dtype = dtype if kv == "auto" else torch.uint8
    spec = CacheSpec(num_blocks, block_size, Hkv, D, cache_dtype, kv, layout, scale_gran)
    kc, vc = spec.allocate(device, fill=float("nan"))
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((B, width), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(blocks_per_seq):
        table[b, :n] = perm[start:start + n].int()
        start += n
    table[:, -1] = perm[-1]  # unused column points at a poisoned page
    ks = vs = None
    if kv != "auto":
        n = Hkv if scale_gran == "head" else 1
        ks = (torch.rand(n, generator=gen) * 0.05 + 0.01).to(device)
        vs = (torch.rand(n, generator=gen) * 0.05 + 0.01).to(device)
    for b, (lk) in enumerate(lens_k):
        if lk == 0:
            continue
        key = torch.randn(lk, Hkv, D, generator=gen).to(device, dtype)
        val = torch.randn(lk, Hkv, D, generator=gen).to(device, dtype)
        pos = torch.arange(lk)
        slots = (table[b, pos // block_size].long() * block_size + pos % block_size).to(device)
        reference.reshape_and_cache_flash(key, val, kc, vc, slots, kv, ks, vs)
    q = torch.randn(sum(lens_q), Hq, D, generator=gen).to(device, dtype)
    cu_q = torch.tensor([0] + list(itertools.accumulate(lens_q)), dtype=torch.int32, device=device)
    seqused = torch.tensor(lens_k, dtype=torch.int32, device=device)
    return dict(q=q, kc=kc, vc=vc, table=table.to(device), cu_q=cu_q, seqused=seqused, ks=ks, vs=vs,
                spec=spec)


def rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


# ---------------------------------------------------------------- reference (CPU)
@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_sdpa_on_gathered_kv(causal):
    gen = torch.Generator().manual_seed(1)
    c = build_case([3, 1, 17], [40, 9, 17], 8, 2, 32, 4, "HND", torch.float32, "auto", "tensor", gen, "cpu")
    out, lse = reference.paged_attention(c["q"], c["kc"], c["vc"], c["cu_q"], c["seqused"], c["table"],
                                         causal=causal, return_lse=True, compute_dtype=torch.float64)
    cu = c["cu_q"].tolist()
    for b, lk in enumerate(c["seqused"].tolist()):
        # gather by hand, independently of reference.gather_kv
        rows = [c["kc"][int(c["table"][b, j // 4]), j % 4] for j in range(lk)]
        k = torch.stack(rows).double()
        v = torch.stack([c["vc"][int(c["table"][b, j // 4]), j % 4] for j in range(lk)]).double()
        q = c["q"][cu[b]:cu[b + 1]].double()
        L = q.shape[0]
        mask = torch.arange(lk)[None] <= (lk - L + torch.arange(L))[:, None] if causal else None
        ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(4, 1).transpose(0, 1),
                                             v.repeat_interleave(4, 1).transpose(0, 1), attn_mask=mask)
        assert torch.allclose(out[cu[b]:cu[b + 1]].double(), ref.transpose(0, 1), atol=1e-6)
    assert torch.isfinite(lse).all()


def test_reference_empty_request_and_fp8():
    gen = torch.Generator().manual_seed(2)
    c = build_case([2, 1], [0, 33], 4, 4, 16, 16, "NHD", torch.bfloat16, "fp8_e4m3", "head", gen, "cpu")
    out, lse = reference.paged_attention(c["q"], c["kc"], c["vc"], c["cu_q"], c["seqused"], c["table"],
                                         kv_cache_dtype="fp8_e4m3", k_descale=c["ks"], v_descale=c["vs"],
                                         return_lse=True)
    assert (out[:2] == 0).all() and torch.isinf(lse[:, :2]).all() and (lse[:, :2] < 0).all()
    assert torch.isfinite(out[2:]).all()


# ---------------------------------------------------------------- compilation (CPU)
# (the wgmma prefill with an fp8 cache: its widening and MMAs; the 16-bit loader is in the others;
# prefill_ws with fp8: bf16 e4m3 converts Q to fp16, fp16 e5m2 widens by byte moves)
CI_SPECS = [AttnFwdSpec("bf16", "auto", 128, "decode"), AttnFwdSpec("bf16", "auto", 128, "prefill"),
            AttnFwdSpec("fp16", "fp8_e4m3", 80, "decode"), AttnFwdSpec("bf16", "auto", 128, "decode_tma"),
            AttnFwdSpec("fp16", "fp8_e5m2", 80, "decode_tma"), AttnFwdSpec("bf16", "fp8_e4m3", 128, "decode_tma"),
            AttnFwdSpec("bf16", "fp8_e4m3", 128, "prefill_wgmma"), AttnFwdSpec("bf16", "auto", 512, "decode_tma"),
            AttnFwdSpec("bf16", "auto", 128, "multi_tma"), AttnFwdSpec("bf16", "auto", 128, "prefill_ws"),
            AttnFwdSpec("bf16", "fp8_e4m3", 128, "prefill_ws"), AttnFwdSpec("fp16", "fp8_e5m2", 128, "prefill_ws"),
            AttnFwdSpec("bf16", "auto", 96, "prefill_ws"),  # opt-in (narrow): not among all_variants
            AttnFwdSpec("fp16", "auto", 80, "prefill_ws"), AttnFwdSpec("bf16", "auto", 96, "decode_tma"),
            AttnFwdSpec("fp16", "auto", 80, "multi_tma")]


# make test compiles the cp.async/mma.sync variants for one arch (sm_80 and sm_90a compile one source):
# sm_80 (the head dim 512 one is decode_tma, sm_90a only); both: test-all
SM90_ONLY_IN_CI = ()


def ci_arch(spec, arch):
    if not spec.supports_arch("sm_80"):
        return arch == "sm_90a"
    return arch == ("sm_90a" if spec in SM90_ONLY_IN_CI else "sm_80")


def _ptxas_notes(spec, arch) -> list:
    """Extra NVRTC options of an attention compile test: ptxas -v for the warpgroup-MMA kernels, whose
    log must then hold no "Potential Performance Loss" note (wgmma_serialization.py)."""
    return ["-Xptxas=-v"] if arch == "sm_90a" and spec.mode in WGMMA_MODES else []


@pytest.mark.parametrize("spec,arch", grid(CI_SPECS, ci_arch, _ptxas_notes))
def test_attention_variants_compile(spec, arch):
    """Every variant compiles (make test: one arch each; the rest under test-all), with its code under
    256 KiB; a warpgroup-MMA kernel without a ptxas note of a performance loss (C7515: its MMAs
    serialised, which nothing but a benchmark would otherwise notice)."""
    if not spec.supports_arch(arch):
        pytest.skip(f"{variant_name(spec)} is built for sm_90a only")
    k = Kernel(spec)
    res = compile_source(k.source, variant=k.name, arch=arch,
                         options=nvrtc_options(arch, toolchain()) + _ptxas_notes(spec, arch))
    assert res.cubin[:4] == b"\x7fELF"
    assert "Performance Loss" not in res.log, (k.name, res.log)
    # Code size, which NVVM's and ptxas' time follow: the split combine unrolled over its chunks and
    # columns once made ~75 % of every attention kernel (decode_tma d128 325 KB of code, 85 KB since).
    assert _code_bytes(res.cubin) <= 256 * 1024, (k.name, _code_bytes(res.cubin))


@pytest.mark.parametrize("dtype,kv,tiles,define", [
    ("bf16", "auto", {}, "#define PAGEDATTN_WS_Q_LATE 0"),
    ("bf16", "fp8_e4m3", {"kWsFp8Qk": 4}, "#define PAGEDATTN_WS_FP8_QK 4"),
    ("fp16", "fp8_e5m2", {"kWsFp8Qk": 4}, "#define PAGEDATTN_WS_FP8_QK 4"),
    ("bf16", "auto", {"kLazyMax": 1}, "#define PAGEDATTN_LAZY_MAX 1"),
    ("fp16", "auto", {"kLazyMax": 3}, "#define PAGEDATTN_LAZY_MAX 3"),
    ("bf16", "fp8_e5m2", {"kLazyMax": 3}, "#define PAGEDATTN_LAZY_MAX 3"),
    ("bf16", "auto", {"kWsQFeed": True, "kLazyMax": 3}, "#define PAGEDATTN_WS_Q_FEED 1"),
    ("fp16", "fp8_e4m3", {"kWsQFeed": True}, "#define PAGEDATTN_WS_Q_FEED 1"),
    ("fp16", "auto", {"kWsOBulk": True}, "#define PAGEDATTN_WS_O_BULK 1"),
    ("bf16", "auto", {"kWsOBulk": True, "kWsQFeed": True, "kLazyMax": 3}, "#define PAGEDATTN_WS_O_BULK 1"),
    ("bf16", "auto", {"kWsOBulk": True, "kWsQFeed": 2, "kLazyMax": 3}, "#define PAGEDATTN_WS_Q_FEED 2"),
    ("fp16", "auto", {"kWsPair": True}, "__cluster_dims__(2, 1, 1)"),
    ("bf16", "auto", {"kWsPair": True, "kWsQFeed": True, "kWsOBulk": True, "kLazyMax": 3}, "#define PAGEDATTN_WS_PAIR 1"),
], ids=["defaults", "fp8_s_e4m3", "fp8_s_e5m2", "lazy_max_exact", "lazy_max_lagging", "lazy_max_lagging_fp8", "q_feed_lagging",
        "q_feed_fp8", "o_bulk", "o_bulk_q_feed_lagging", "chained_o_bulk_lagging", "pair", "pair_q_feed_o_bulk_lagging"])
def test_ws_opt_in_tiles_compile(dtype, kv, tiles, define):
    """prefill_ws's opt-in tile fields render and compile for sm_90a (in the test's process: the NVRTC
    farm compiles specs' default tiles): fp8 S (kWsFp8Qk: K read raw by e4m3 x fp8 MMAs) with e4m3 and
    e5m2 keys, and the lazy row maxima the defaults do not take (kLazyMax 1: the quad reductions skipped
    only when no row of the warp grew; 3: exponentials against the maxima as they stand, checked by the
    rows' sums, with a way back that makes S again from the cache; the default is 2 from d128 on, 0 at d64),
    the producer feeding the consumers their work items and Q rows (kWsQFeed; 2: two Q tiles and each
    item's first S issued with the last P V of the item before), O stored through shared memory by
    bulk copies (kWsOBulk), and clusters of two CTAs sharing each K/V step by TMA multicast (kWsPair).
    None may leave ptxas noting a performance loss, such as serialised warpgroup MMAs (C7515: an
    accumulator defined by other instructions inside a batch's stage; the chain once did, which would
    cost the overlap of every S with the P V before it)."""
    from pagedattn.ops import attention as attention_ops

    with attention_ops.forced(tiles={"prefill_ws": tiles}):  # the tiles are read as it renders
        k = Kernel(AttnFwdSpec(dtype, kv, 128, "prefill_ws"))
        source = k.source
    assert define in source
    res = compile_source(source, variant=k.name, arch="sm_90a",
                         options=nvrtc_options("sm_90a", toolchain()) + ["-Xptxas=-v"])
    assert res.cubin[:4] == b"\x7fELF"
    assert "Performance Loss" not in res.log, res.log


@pytest.mark.parametrize("dtype,features,tiles", [
    ("fp16", {}, {}),
    ("bf16", {"window": True, "softcap": True}, {}),
    ("bf16", {"alibi": True, "sinks": True}, {}),
    ("bf16", {}, {"kWsOBulk": True, "kWsQFeed": 2, "kLazyMax": 3, "kWsPair": True}),
    ("fp16", {}, {"kWsQFeed": True}),
], ids=["fp16", "window_softcap", "alibi_sinks", "all_opt_ins", "q_feed"])
@pytest.mark.parametrize("d", [96, 80])
def test_ws_narrow_compiles(dtype, features, tiles, d):
    """prefill_ws at head dims 96 and 80 (opt-in: 32- and 16-column panels, the 64- and 32-byte swizzles)
    compiles for sm_90a with the features and the opt-in tile fields, without a ptxas performance note
    (C7515: serialised MMAs)."""
    from pagedattn.ops import attention as attention_ops

    with attention_ops.forced(tiles={"prefill_ws": tiles}):
        k = Kernel(AttnFwdSpec(dtype, "auto", d, "prefill_ws", **features))
        source = k.source
    assert "pagedattn::AttnTraits<" in source and f",{d}," in "".join(source.split())
    res = compile_source(source, variant=k.name, arch="sm_90a",
                         options=nvrtc_options("sm_90a", toolchain()) + ["-Xptxas=-v"])
    assert res.cubin[:4] == b"\x7fELF"
    assert "Performance Loss" not in res.log, res.log


def _code_bytes(cubin: bytes) -> int:
    """Bytes of the cubin's .text sections (64-bit little-endian ELF)."""
    import struct

    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    entsize, count, names_at = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * entsize) for i in range(count)]
    names = headers[names_at][4]
    total = 0
    for name, _, _, _, offset, size in headers:
        if cubin[names + name:].startswith(b".text."):
            total += size
    return total


@pytest.mark.slow
@pytest.mark.parametrize("spec,arch", grid([s for s in AttnFwdSpec.all_variants() if s not in CI_SPECS],
                                          lambda spec, arch: False, _ptxas_notes))
def test_every_attention_variant_compiles(spec, arch):
    test_attention_variants_compile(spec, arch)


def test_head_dim_mapping():
    assert [kernel_head_dim(d) for d in (64, 72, 80, 88, 96, 104, 128, 136, 192, 200, 256, 264, 320, 512)] == \
        [64, 80, 80, 96, 96, 128, 128, 192, 192, 256, 256, 512, 512, 512]
    with pytest.raises(UnsupportedError, match="at most 512"):
        kernel_head_dim(520)
    with pytest.raises(UnsupportedError, match="head_dim"):
        AttnFwdSpec("bf16", "auto", 72, "decode")


def test_head_dim_512_tiles():
    """Head dim 512: two column groups of 256 (attn_traits.cuh kWarpsD), decode and prefill on the
    cp.async loader, and TMA decode of 16-bit caches with two key groups of two column warps sharing
    a ring each; no fp8 TMA decode (its operands are converted in registers, whole rows per warp) and
    no warpgroup MMAs there."""
    for kv in ("auto", "fp8_e4m3"):
        for mode in ("decode", "prefill"):
            spec = AttnFwdSpec("bf16", kv, 512, mode)
            assert spec.tiles["kWarpsD"] == 2 and spec.tiles["kWarpsN"] == 1 and not spec.tiles["kTma"]
            assert spec.threads == 64 * spec.tiles["kWarpsM"]
            assert spec.supports_arch("sm_80") and spec.supports_arch("sm_90a")
            assert f"{'true' if spec.tiles['kWgmma'] else 'false'}, {spec.tiles['kWarpsD']},\n" in Kernel(spec).source
    tma = AttnFwdSpec("bf16", "auto", 512, "decode_tma")
    assert (tma.tiles["kWarpsD"], tma.tiles["kWarpsN"], tma.tiles["kTma"], tma.threads) == (2, 2, True, 128)
    assert tma.supports_arch("sm_90a") and not tma.supports_arch("sm_80")
    assert tma.dynamic_smem() <= SMEM_PER_CTA["sm_90a"]
    for kv, mode in (("fp8_e4m3", "decode_tma"), ("auto", "prefill_wgmma"), ("auto", "prefill_ws"),
                     ("auto", "multi_tma")):
        with pytest.raises(UnsupportedError, match="head dims up to"):
            AttnFwdSpec("bf16", kv, 512, mode)
    # the 99 KiB archs: decode drops a stage, prefill does not fit
    assert AttnFwdSpec.for_arch("sm_86", "bf16", "auto", 512, "decode").tiles["kStages"] == 2
    assert not AttnFwdSpec("bf16", "auto", 512, "prefill").supports_arch("sm_86")
    assert all(AttnFwdSpec("bf16", "auto", d, "decode").tiles["kWarpsD"] == 1 for d in (64, 128, 256))


# ---------------------------------------------------------------- the kernel (GPU)
HEADS = [(8, 8), (32, 8), (32, 4), (28, 4), (16, 1)]
KV = [("auto", "tensor"), ("fp8_e4m3", "tensor"), ("fp8_e5m2", "head")]


def _sample_grid(n, seed=0):
    rng = random.Random(seed)
    axes = dict(dtype=[torch.float16, torch.bfloat16], D=[64, 80, 96, 128, 192, 256, 72],
                layout=["NHD", "HND"], bs=[1, 8, 16, 32, 128, 256], heads=HEADS, causal=[False, True],
                batch=["decode", "mixed", "prefill"], splits=[0, 1, 7], kv=KV, lse=[False, True],
                out=[False, True], loader=["auto", "cp_async"])
    return cover_axes(axes, n, rng, 3)


def cover_axes(axes, n, rng, times):
    """n cases over the axes: every value of every axis at least `times` times, the rest random."""
    cases = []
    for name, values in axes.items():
        for v in values:
            for _ in range(times):
                c = {k: rng.choice(vals) for k, vals in axes.items()}
                c[name] = v
                cases.append(c)
    while len(cases) < n:
        cases.append({k: rng.choice(vals) for k, vals in axes.items()})
    return cases


def _case_id(c):
    return (f"{str(c['dtype'])[6:]}-d{c['D']}-{c['layout']}-b{c['bs']}-h{c['heads'][0]}x{c['heads'][1]}-"
            f"{'causal' if c['causal'] else 'full'}-{c['batch']}-s{c['splits']}-{c['kv'][0]}-{c['kv'][1]}-"
            f"{'lse' if c['lse'] else 'nolse'}-{'out' if c['out'] else 'noout'}-{c['loader']}")


def _multi_rows(kv, bs):
    """The most rows multi-token decode takes for this cache: WS_ROWS where the warp-specialised prefill
    takes the rows above (16-bit paged caches of 16-key pages), else MULTI_ROWS."""
    ws = kv == "auto" and bs % 16 == 0
    return attention_heuristics.WS_ROWS if ws else attention_heuristics.MULTI_ROWS


def _lengths(kind, rng, group=1, multi_rows=None):
    if kind == "multi":      # multi-token decode: 2..multi_rows / group query tokens over longer histories
        most = max(2, (multi_rows or attention_heuristics.MULTI_ROWS) // group)
        lq = [most, rng.randint(2, most), 1, rng.randint(2, most)]
        lk = [lq[0] + rng.randint(0, 900), lq[1] + rng.randint(1, 300), rng.randint(1, 500), lq[3]]
        return lq, lk
    if kind == "decode":     # q_len 1; one request with no KV at all
        lk = [rng.randint(1, 700), 0, rng.randint(1, 300), rng.randint(300, 1100)]
        return [1] * len(lk), lk
    if kind == "prefill":    # full prefill, q_len == k_len, not multiples of tiles
        lq = [rng.randint(1, 300), rng.randint(100, 400)]
        return lq, list(lq)
    if kind == "long":       # more row tiles than SMs: the persistent prefill's CTAs take several each
        lq = [rng.randint(500, 900), rng.randint(200, 700), rng.randint(1, 300)]
        return lq, [lq[0], lq[1] + rng.randint(0, 400), lq[2]]
    # mixed: decode + chunked prefill over a cached prefix + full prefill + seqused_k = 0
    lq = [1, rng.randint(2, 90), rng.randint(1, 200), 1]
    lk = [rng.randint(1, 800), lq[1] + rng.randint(1, 500), lq[2], 0]
    lq[3] = 1
    return lq, lk


@pytest.fixture
def decode_loader():
    """decode_loader("cp_async") makes decode batches take the cp.async variant even on sm_90 (where
    TMA is the default for paged decode), so both loaders stay tested on one GPU."""
    from pagedattn.ops import attention as attention_ops

    with contextlib.ExitStack() as stack:
        def force(loader):
            if loader == "cp_async":
                stack.enter_context(attention_ops.forced(tma=False))
            attention_ops._PLANS.clear()

        yield force
    attention_ops._PLANS.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("c", _sample_grid(400), ids=_case_id)
def test_attention_matches_reference(c, decode_loader):
    decode_loader(c["loader"])
    rng = random.Random(_case_id(c))
    gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
    Hq, Hkv = c["heads"]
    lens_q, lens_k = _lengths(c["batch"], rng, Hq // Hkv, _multi_rows(c["kv"][0], c["bs"]))
    kv, gran = c["kv"]
    case = build_case(lens_q, lens_k, Hq, Hkv, c["D"], c["bs"], c["layout"], c["dtype"], kv, gran, gen)
    table = case["table"]
    if table.numel() > 8:
        assert not torch.equal(table.flatten().sort().values, table.flatten()), "table should be shuffled"
    out = torch.full_like(case["q"], float("nan")) if c["out"] else None
    kw = dict(max_seqlen_q=max(lens_q), cu_seqlens_q=case["cu_q"], max_seqlen_k=max(lens_k),
              seqused_k=case["seqused"], causal=c["causal"], block_table=table,
              return_softmax_lse=c["lse"], out=out, num_splits=c["splits"],
              k_descale=case["ks"], v_descale=case["vs"], kv_cache_dtype=kv)
    res = flash_attn_varlen_func(case["q"], case["kc"], case["vc"], **kw)
    o, lse = res if c["lse"] else (res, None)
    if c["out"]:
        assert o is out
    ref, ref_lse = reference.paged_attention(case["q"], case["kc"], case["vc"], case["cu_q"], case["seqused"],
                                             table, causal=c["causal"], kv_cache_dtype=kv,
                                             k_descale=case["ks"], v_descale=case["vs"], return_lse=True,
                                             compute_dtype=torch.float64)
    low = reference.paged_attention(case["q"], case["kc"], case["vc"], case["cu_q"], case["seqused"], table,
                                    causal=c["causal"], kv_cache_dtype=kv, k_descale=case["ks"],
                                    v_descale=case["vs"], compute_dtype=c["dtype"])
    assert not o.isnan().any(), "NaN in the output"
    err, err_low = rel_l2(o, ref), rel_l2(low.to(c["dtype"]), ref)
    assert err <= max(2 * err_low, 2e-3) and err < 2e-2, (err, err_low)
    if c["lse"]:
        finite = torch.isfinite(ref_lse)
        assert torch.equal(finite, torch.isfinite(lse)), "LSE -inf pattern differs"
        assert torch.allclose(lse[finite], ref_lse[finite].float(), atol=2e-2, rtol=1e-3)
    again = flash_attn_varlen_func(case["q"], case["kc"], case["vc"], **{**kw, "out": None})
    again = again[0] if c["lse"] else again
    assert torch.equal(again.view(torch.int16), o.view(torch.int16)), "rerun is not bit-identical"


def _multi_grid(n, seed=11):
    """Multi-token decode (modes multi / multi_tma): up to MULTI_ROWS packed rows per KV head (WS_ROWS
    where prefill_ws takes the rows above)."""
    rng = random.Random(seed)
    axes = dict(dtype=[torch.float16, torch.bfloat16], D=[64, 80, 96, 128, 72], layout=["NHD", "HND"],
                bs=[1, 8, 16, 32, 128], heads=[(8, 8), (32, 8), (32, 4), (28, 4), (16, 2)], causal=[False, True],
                batch=["multi"], splits=[0, 1, 3], kv=KV, lse=[False, True], out=[False, True],
                loader=["auto", "cp_async"])
    return cover_axes(axes, n, rng, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("c", _multi_grid(64), ids=_case_id)
def test_multi_token_decode_matches_reference(c, decode_loader):
    from pagedattn.ops import attention as attention_ops

    test_attention_matches_reference(c, decode_loader)
    modes = {mode for plan in attention_ops._PLANS.values() for mode, _ in plan._kernels}
    assert modes & {"multi", "multi_tma"}, modes


def _narrow_decode_grid(n, seed=29):
    """decode_tma and multi_tma at head dims 96 and 80 (forced narrow: TMA boxes of 32 / 16 columns with the
    64- / 32-byte swizzle into the warps' rings): head sizes 96, 88, 80 and 72, pages of 16-256 keys,
    decode, multi-token and mixed batches, splits, 16-bit caches."""
    rng = random.Random(seed)
    axes = dict(dtype=[torch.float16, torch.bfloat16], D=[96, 88, 80, 72], layout=["NHD", "HND"],
                bs=[16, 32, 128, 256], heads=[(8, 8), (32, 8), (32, 4), (28, 4), (16, 2)], causal=[False, True],
                batch=["decode", "multi", "mixed"], splits=[0, 1, 3, 7], kv=KV[:1], lse=[False, True],
                out=[False, True], loader=["auto"])
    return cover_axes(axes, n, rng, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("c", _narrow_decode_grid(32), ids=_case_id)
def test_narrow_tma_decode_matches_reference(c, decode_loader):
    """The opt-in narrow TMA decode (decode_tma, multi_tma at 96 and 80) against the reference; its plans
    launch TMA kernels at those head dims only."""
    from pagedattn.ops import attention as attention_ops

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("TMA decode is sm_90-only")
    with attention_ops.forced(narrow=True):
        test_attention_matches_reference(c, decode_loader)
        kernels = {(m, v.head_dim) for plan in attention_ops._PLANS.values() for (m, _), v in plan._kernels.items()}
    assert {m for m, _ in kernels} & {"decode_tma", "multi_tma", "prefill_ws"}, kernels
    assert all(d == kernel_head_dim(c["D"]) for m, d in kernels if m in ("decode_tma", "multi_tma", "prefill_ws"))


def _fp8_wgmma_grid(n, seed=13):
    """fp8 caches through the sm_90a warpgroup-MMA prefill (stages widened in shared memory): every
    head dim it compiles, both fp8 formats, block sizes down to 1 (the cp.async loader's per-row path);
    two or more query heads per KV head, so the longest request packs over 128 rows (wgmma's side)."""
    rng = random.Random(seed)
    axes = dict(dtype=[torch.float16, torch.bfloat16], D=[64, 128, 192, 256, 120], layout=["NHD", "HND"],
                bs=[1, 16, 32, 256], heads=[(16, 8), (32, 8), (28, 4), (16, 1)], causal=[False, True],
                batch=["prefill"], splits=[0, 1], kv=KV[1:], lse=[False, True], out=[False, True],
                loader=["auto"])
    return cover_axes(axes, n, rng, 2)


def _check_sm90a_mode(c, decode_loader, mode, required=True):
    """An sm_90a-only prefill's case: matches the reference, and (`required`) the dispatch took `mode`."""
    from pagedattn.ops import attention as attention_ops

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"{mode} is sm_90a-only")
    test_attention_matches_reference(c, decode_loader)
    modes = {m for plan in attention_ops._PLANS.values() for m, _ in plan._kernels}
    assert mode in modes or not required, modes


@pytest.mark.gpu
@pytest.mark.parametrize("c", _fp8_wgmma_grid(40), ids=_case_id)
def test_fp8_wgmma_prefill_matches_reference(c, decode_loader):
    from pagedattn.ops import attention as attention_ops

    # forced: the dispatch takes prefill_ws at head dim 128 where TMA reads the cache
    with attention_ops.forced(prefill="prefill_wgmma"):
        _check_sm90a_mode(c, decode_loader, "prefill_wgmma")


@pytest.fixture
def fp8_ws():
    """prefill_ws forced (the dispatch takes it for fp8 caches at head dim 128 where TMA reads them;
    forced, the grid's other cases reach it too), on fresh plans."""
    from pagedattn.ops import attention as attention_ops

    with attention_ops.forced(prefill="prefill_ws"):
        yield


def _fp8_ws_grid(n, seed=19):
    """fp8 caches through the warp-specialised prefill (head dim 128: raw TMA chunks widened by the
    producer warps into the fp16 ring its MMAs read): both formats and layouts, head sizes that run on the 128
    tile (112: the tensor map zero-fills the last columns), splits, mixed and long batches."""
    rng = random.Random(seed)
    axes = dict(dtype=[torch.float16, torch.bfloat16], D=[128, 112], layout=["NHD", "HND"],
                bs=[16, 32, 64, 256], heads=[(16, 8), (32, 8), (28, 4), (16, 1)], causal=[False, True],
                batch=["prefill", "mixed", "long"], splits=[0, 1, 3], kv=KV[1:], lse=[False, True],
                out=[False, True], loader=["auto", "cp_async"])
    return cover_axes(axes, n, rng, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("c", _fp8_ws_grid(32), ids=_case_id)
def test_fp8_ws_prefill_matches_reference(c, decode_loader, fp8_ws):
    _check_sm90a_mode(c, decode_loader, "prefill_ws", required=c["batch"] != "mixed")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_ws_widens_every_value_exactly(kv, dtype, fp8_ws):
    """prefill_ws's producer widens fp8 to fp16 (e4m3 by the hardware conversion, e5m2 by byte moves)
    and converts a bf16 Q to fp16. With one key per request each output row is the widened V row itself, so
    every finite fp8 value (both signs, the subnormals) must come out exactly as torch converts it.
    The rest of each key's 16-key chunk is NaN bytes; shuffled pages. Q is zero, so every score is 0
    and the key's weight exactly 1: with random Q, e5m2 keys (up to 57344) make scores of ~1e5 whose
    exponent 2^(s * scale - m * scale) is off 0 by the rounding of m * scale (~1e-3), so P (rounded
    to 16 bits for P V) and l differ and an output came out one fp16 ulp off (the softmax's rounding,
    as in any FlashAttention, not the widening's: H200, every commit since 91b3bea)."""
    from pagedattn.ops import attention as attention_ops

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("prefill_ws is sm_90a-only")
    fp8 = torch.float8_e4m3fn if kv == "fp8_e4m3" else torch.float8_e5m2
    D, bs, q_len, hq = 128, 16, 160, 3
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[torch.isfinite(codes.view(fp8).float())]
    n = -(-codes.numel() // D)  # requests, a V row of D codes each
    v_rows = torch.zeros(n * D, dtype=torch.uint8)
    v_rows[:codes.numel()] = codes[torch.randperm(codes.numel())]
    v_rows = v_rows.view(n, D)
    pages = torch.randperm(n + 5)[:n]
    kc = torch.full((n + 5, bs, 1, D), 0x7F, dtype=torch.uint8)  # 0x7f: NaN in both formats
    vc = kc.clone()
    kc[pages, 0, 0] = codes[torch.randint(codes.numel(), (n, D))]
    vc[pages, 0, 0] = v_rows
    q = torch.zeros(n * q_len, hq, D, dtype=dtype, device="cuda")
    cu_q = torch.arange(0, (n + 1) * q_len, q_len, dtype=torch.int32, device="cuda")
    one = torch.ones(1, device="cuda")
    out = flash_attn_varlen_func(q, kc.cuda(), vc.cuda(), q_len, cu_q, 1,
                                 seqused_k=torch.ones(n, dtype=torch.int32, device="cuda"),
                                 block_table=pages.int().view(n, 1).cuda(), num_splits=1,
                                 kv_cache_dtype=kv, k_descale=one, v_descale=one)
    want = v_rows.view(fp8).to(dtype).view(n, 1, 1, D).expand(n, q_len, hq, D).reshape(-1, hq, D)
    assert torch.equal(out.cpu(), want)
    modes = {m for plan in attention_ops._PLANS.values() for m, _ in plan._kernels}
    assert "prefill_ws" in modes, modes


def _two_requests_pages(gen, k_lens, bs):
    """A cache of three pages more than two requests of k_lens keys take, and their block table: the
    requests' pages shuffled over it."""
    pages = [-(-n // bs) for n in k_lens]
    table = torch.randperm(sum(pages) + 3, generator=gen)[:sum(pages)].int()
    block_table = torch.zeros(len(pages), max(pages), dtype=torch.int32)
    for b, (at, n) in enumerate(zip([0, pages[0]], pages)):
        block_table[b, :n] = table[at:at + n]
    return sum(pages) + 3, block_table


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("k_slots", [0, 4], ids=["widened", "fp8_s"])
def test_fp8_ws_scores_keep_q_exact(k_slots, kv, dtype, fp8_ws):
    """The LSE is the sharpest view of S = Q K^T: scores of std ~10, |q| spread over e^±3, float64
    reference on the same fp8 cache, ragged requests over shuffled pages, fresh random inputs.
    The default path widens K to fp16, so S is the dequantised cache's: the LSE within 5e-3 (H200: 6e-5,
    equal to a bf16 cache's). The opt-in fp8 S (tile field kWsFp8Qk) splits Q into e4m3 hi + lo tiles,
    exact to ~3e-4 of the LSE in a float64 emulation (one e4m3 tile: ~2), but the fp8 MMAs accumulate
    with less than fp32's precision: H200 measured 0.08-0.15 here (perf/results/ws_fp8_qk/precision/);
    this holds it to 0.3 and the output to the grid's rel L2 2e-2."""
    from pagedattn.ops import attention as attention_ops

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("prefill_ws is sm_90a-only")
    gen = torch.Generator().manual_seed(29)
    Hq, Hkv, D, bs = 8, 2, 128, 16
    q_lens, k_lens = [200, 77], [300, 77]
    blocks, block_table = _two_requests_pages(gen, k_lens, bs)
    fp8 = torch.float8_e4m3fn if kv == "fp8_e4m3" else torch.float8_e5m2
    kc = torch.randn(blocks, bs, Hkv, D, generator=gen).to(fp8).view(torch.uint8).to(DEV)
    vc = torch.randn(blocks, bs, Hkv, D, generator=gen).to(fp8).view(torch.uint8).to(DEV)
    q = (4 * torch.randn(sum(q_lens), Hq, D, generator=gen) * torch.randn(sum(q_lens), Hq, D, generator=gen).exp())
    q = q.to(dtype).to(DEV)
    cu_q = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32, device=DEV)
    seqused = torch.tensor(k_lens, dtype=torch.int32, device=DEV)
    one = torch.ones(1, device=DEV)
    with attention_ops.forced(tiles={"prefill_ws": {"kWsFp8Qk": k_slots}}):
        out, lse = flash_attn_varlen_func(q, kc, vc, max(q_lens), cu_q, max(k_lens), seqused_k=seqused,
                                          block_table=block_table.to(DEV), causal=True, return_softmax_lse=True,
                                          kv_cache_dtype=kv, k_descale=one, v_descale=one)
    want, want_lse = reference.paged_attention(q, kc, vc, cu_q, seqused, block_table.to(DEV), causal=True,
                                               kv_cache_dtype=kv, k_descale=one, v_descale=one,
                                               return_lse=True, compute_dtype=torch.float64)
    assert (lse.float() - want_lse).abs().max().item() < (0.3 if k_slots else 5e-3)
    assert rel_l2(out.float(), want) < (2e-2 if k_slots else 5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("lazy", [0, 1, 2, 3])
def test_ws_lazy_max_rows_that_grow(lazy, dtype):
    """prefill_ws's row maxima (tile field kLazyMax): 0 quad-reduces every tile's, 1 only when a row of
    the warp grew, 2 when one grew by more than 2^8 (the maximum then lags by up to 8 in log2 units, which
    l undoes), 3 with no pass for the tile's maxima (the rows' sums of p tell when one must move). Keys whose scale
    rises along the sequence make the maxima grow by small and by large steps at every point of it;
    ragged requests over shuffled pages, float64 reference."""
    from pagedattn.ops import attention as attention_ops

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("prefill_ws is sm_90a-only")
    gen = torch.Generator().manual_seed(31 + lazy)
    Hq, Hkv, D, bs = 8, 2, 128, 16
    q_lens, k_lens = [260, 77], [700, 77]
    blocks, block_table = _two_requests_pages(gen, k_lens, bs)
    rise = (1 + torch.arange(bs * blocks) / 48).view(-1, bs, 1, 1)  # a page's keys by its slot
    kc = (torch.randn(blocks, bs, Hkv, D, generator=gen) * rise).to(dtype).to(DEV)
    vc = torch.randn(blocks, bs, Hkv, D, generator=gen).to(dtype).to(DEV)
    q = torch.randn(sum(q_lens), Hq, D, generator=gen).to(dtype).to(DEV)
    cu_q = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32, device=DEV)
    seqused = torch.tensor(k_lens, dtype=torch.int32, device=DEV)
    with attention_ops.forced(prefill="prefill_ws", tiles={"prefill_ws": {"kLazyMax": lazy}}):
        out, lse = flash_attn_varlen_func(q, kc, vc, max(q_lens), cu_q, max(k_lens), seqused_k=seqused,
                                          block_table=block_table.to(DEV), causal=True, return_softmax_lse=True)
        again = flash_attn_varlen_func(q, kc, vc, max(q_lens), cu_q, max(k_lens), seqused_k=seqused,
                                       block_table=block_table.to(DEV), causal=True)
    want, want_lse = reference.paged_attention(q, kc, vc, cu_q, seqused, block_table.to(DEV), causal=True,
                                               return_lse=True, compute_dtype=torch.float64)
    assert torch.equal(out, again)
    assert (lse.float() - want_lse).abs().max().item() < 2e-3
    assert rel_l2(out.float(), want) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("window", [-1, 150], ids=["full", "window150"])
@pytest.mark.parametrize("D,kv", [(128, "auto"), (256, "auto"), (120, "auto"), (128, "fp8_e4m3"), (128, "fp8_e5m2")])
def test_ws_lagging_max_scores_that_jump(D, kv, window, dtype):
    """kLazyMax 3 exponentiates a step's scores against the row maxima as they stand and checks the rows'
    sums after: a p past 2^60 sends the warp back to make S again, from Q's tile and the cache's K
    (mainloop_ws.cuh: ws_scores_again). Keys scaled by 1 up to 400 at scattered positions make scores
    jump by every amount, far past what P's type holds among them; a sliding window leaves rows with no
    key in an item's first steps; head size 120 (columns past it zero); fp8 caches (K widened as the
    producer does). Against float64 and against kLazyMax 2 on the same inputs; reruns bit-identical."""
    from pagedattn.ops import attention as attention_ops

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("prefill_ws is sm_90a-only")
    gen = torch.Generator().manual_seed(7 + D + window + len(kv))
    Hq, Hkv, bs = 8, 2, 16
    q_lens, k_lens = [300, 90], [800, 90]
    blocks, block_table = _two_requests_pages(gen, k_lens, bs)
    jump = torch.ones(blocks * bs)
    at = torch.randperm(blocks * bs, generator=gen)[:40]
    jump[at] = torch.tensor([1.0, -3.0, 5.0, 20.0, -60.0, 100.0, 400.0, -400.0] * 5)
    kc = torch.randn(blocks, bs, Hkv, D, generator=gen) * jump.view(blocks, bs, 1, 1)
    vc = torch.randn(blocks, bs, Hkv, D, generator=gen)
    fp8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}.get(kv)
    if kv == "fp8_e4m3":
        kc = kc.clamp(-440, 440)  # e4m3 has no infinity: past 448 it is NaN
    kc, vc = ((x.to(fp8).view(torch.uint8) if fp8 else x.to(dtype)).to(DEV) for x in (kc, vc))
    q = torch.randn(sum(q_lens), Hq, D, generator=gen).to(dtype).to(DEV)
    cu_q = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32, device=DEV)
    seqused = torch.tensor(k_lens, dtype=torch.int32, device=DEV)
    scales = dict(kv_cache_dtype=kv, k_descale=torch.ones(1, device=DEV), v_descale=torch.ones(1, device=DEV))
    args = dict(seqused_k=seqused, block_table=block_table.to(DEV), causal=True, window_size=(window, 0),
                **(scales if fp8 else {}))
    runs = {}
    for lazy in (2, 3):
        with attention_ops.forced(prefill="prefill_ws", tiles={"prefill_ws": {"kLazyMax": lazy}}):
            runs[lazy] = flash_attn_varlen_func(q, kc, vc, max(q_lens), cu_q, max(k_lens), return_softmax_lse=True,
                                                **args)
            if lazy == 3:
                again = flash_attn_varlen_func(q, kc, vc, max(q_lens), cu_q, max(k_lens), **args)
    want, want_lse = reference.paged_attention(q, kc, vc, cu_q, seqused, block_table.to(DEV), causal=True,
                                               window_size=(window, 0), return_lse=True,
                                               compute_dtype=torch.float64, **(scales if fp8 else {}))
    out, lse = runs[3]
    assert torch.equal(out, again)
    assert (lse.float() - want_lse).abs().max().item() < 2e-3
    assert rel_l2(out.float(), want) < 1e-2
    assert (lse.float() - runs[2][1].float()).abs().max().item() < 1e-3
    assert rel_l2(out.float(), runs[2][0].float()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("c", _fp8_ws_grid(32)[:12], ids=_case_id)
def test_fp8_ws_fp8_scores_match_reference(c, decode_loader, fp8_ws):
    """The opt-in fp8 S of prefill_ws (tile field kWsFp8Qk: K read raw by e4m3 x fp8 MMAs, the producer
    widening V alone) over a share of the fp8 ws grid."""
    from pagedattn.ops import attention as attention_ops

    with attention_ops.forced(tiles={"prefill_ws": {"kWsFp8Qk": 4}}):
        _check_sm90a_mode(c, decode_loader, "prefill_ws", required=c["batch"] != "mixed")


def _ws_grid(n, seed=17, head_sizes=(64, 128, 192, 256, 120, 96, 80)):
    """The warp-specialised sm_90a prefill (prefill_ws: TMA producer, wgmma consumers): paged 16-bit
    caches with pages of whole 16-key chunks, every head dim it compiles (120, 96 and 80 run on 128, their
    last columns zero-filled by the tensor map: heuristics.wgmma_head_dim), both layouts, splits, mixed
    batches (decode rows and requests with no keys in the same launch), and batches of more row tiles
    than SMs (each persistent CTA then takes several, its rings and the next item's Q running on across
    them)."""
    rng = random.Random(seed)
    axes = dict(dtype=[torch.float16, torch.bfloat16], D=list(head_sizes), layout=["NHD", "HND"],
                bs=[16, 32, 64, 256], heads=[(16, 8), (32, 8), (28, 4), (16, 1)], causal=[False, True],
                batch=["prefill", "mixed", "long"], splits=[0, 1, 3], kv=KV[:1], lse=[False, True], out=[False, True],
                loader=["auto"])
    return cover_axes(axes, n, rng, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("c", _ws_grid(48), ids=_case_id)
def test_ws_prefill_matches_reference(c, decode_loader):
    _check_sm90a_mode(c, decode_loader, "prefill_ws", required=c["batch"] != "mixed")  # mixed: may pack few rows


@pytest.mark.gpu
@pytest.mark.parametrize("c", _ws_grid(48)[::2] + _fp8_ws_grid(32)[:8], ids=_case_id)
def test_ws_lagging_max_matches_reference(c, decode_loader, fp8_ws):
    """The opt-in lagging exponentials (kLazyMax 3: no pass for the tiles' maxima; softmax.cuh) over a
    share of the ws grid and of the fp8 ws grid."""
    from pagedattn.ops import attention as attention_ops

    with attention_ops.forced(tiles={"prefill_ws": {"kLazyMax": 3}}):
        _check_sm90a_mode(c, decode_loader, "prefill_ws", required=c["batch"] != "mixed")


@pytest.mark.gpu
@pytest.mark.parametrize("c", _ws_grid(48)[1::2] + _fp8_ws_grid(32)[8:16], ids=_case_id)
def test_ws_q_feed_matches_reference(c, decode_loader, fp8_ws):
    """The opt-in producer feed (kWsQFeed: the producer finds each work item and copies its Q rows onto
    an mbarrier per consumer warpgroup) over the half of the ws grid the lagging maxima's test leaves
    out, and over fp8 ws cases (its bf16 Q converted to fp16 by the consumers after the feed)."""
    from pagedattn.ops import attention as attention_ops

    with attention_ops.forced(tiles={"prefill_ws": {"kWsQFeed": True}}):
        _check_sm90a_mode(c, decode_loader, "prefill_ws", required=c["batch"] != "mixed")


def _ws_narrow_grid(n, seed=23):
    """prefill_ws compiled at head dims 96 and 80 (forced narrow: 32- or 16-column panels with the 64-
    or 32-byte swizzle, three or five TMA boxes per 16-key chunk; the dispatch runs them on the 128 tile):
    the ws grid's axes at head sizes 96, 88 and 80, 72 (the last 8 columns zero-filled by the tensor map)."""
    return _ws_grid(n, seed, head_sizes=(96, 88, 80, 72))


@pytest.mark.gpu
@pytest.mark.parametrize("c", _ws_narrow_grid(32), ids=_case_id)
def test_ws_narrow_matches_reference(c, decode_loader):
    """The opt-in head-dim-96 and -80 prefill_ws (WgmmaTiles' SW64 / SW32 descriptors, box_cols' 32- / 16-column
    boxes) against the reference, alone and with every opt-in tile field (the producer feed with chained
    items, O's bulk stores, the lagging exponentials, clusters of two)."""
    from pagedattn.ops import attention as attention_ops

    for tiles in ({}, {**WS_OPT_INS, "kWsPair": True}):
        with attention_ops.forced(prefill="prefill_ws", narrow=True, tiles={"prefill_ws": tiles}):
            _check_sm90a_mode(c, decode_loader, "prefill_ws", required=c["batch"] != "mixed")  # mixed: may pack few rows
            dims = {v.head_dim for plan in attention_ops._PLANS.values() for (m, _), v in plan._kernels.items()
                    if m == "prefill_ws"}
            assert dims <= {kernel_head_dim(c["D"])}, dims


# every opt-in tile field of prefill_ws at once: the candidate defaults (kWsQFeed 2: two Q tiles and
# chained items where they fit, 16-bit caches to head dim 128; one tile elsewhere)
WS_OPT_INS = {"kWsOBulk": True, "kWsQFeed": 2, "kLazyMax": 3}


@pytest.mark.gpu
@pytest.mark.parametrize("c", _ws_grid(48)[::3], ids=_case_id)
def test_ws_o_bulk_matches_reference(c, decode_loader):
    """The opt-in bulk stores of O (kWsOBulk: each consumer warp's rows through shared memory, a 1-D bulk
    copy per row of the request; split-KV partials keep the 4-byte stores), with the other opt-ins (the
    producer feed with chained items, the lagging maxima) and alone."""
    from pagedattn.ops import attention as attention_ops

    for tiles in (WS_OPT_INS, {"kWsOBulk": True}):
        with attention_ops.forced(tiles={"prefill_ws": tiles}):
            _check_sm90a_mode(c, decode_loader, "prefill_ws", required=c["batch"] != "mixed")


# prefill_ws in clusters of two CTAs with K/V multicast (kWsPair): alone, with the producer feed and the
# lagging maxima, and with every other opt-in (chained items, O's bulk stores)
WS_PAIRS = ({"kWsPair": True}, {"kWsPair": True, "kWsQFeed": True, "kLazyMax": 3}, {"kWsPair": True, **WS_OPT_INS})


@pytest.mark.gpu
@pytest.mark.parametrize("c", _ws_grid(48)[1::3], ids=_case_id)
def test_ws_pair_matches_reference(c, decode_loader):
    """The opt-in clusters of two CTAs (kWsPair: row tiles 2m + 1 and 2m of a column together, each
    producer copying half of every K/V step into both CTAs' rings by TMA multicast) over a third of the
    ws grid: every head dim, GQA 2 / 4 / 7 / 16, splits, mixed batches (CTAs with no tile of their own
    passing their partner's steps); alone, with the feed and with every opt-in (WS_PAIRS)."""
    from pagedattn.ops import attention as attention_ops

    for tiles in WS_PAIRS:
        with attention_ops.forced(tiles={"prefill_ws": tiles}):
            _check_sm90a_mode(c, decode_loader, "prefill_ws", required=c["batch"] != "mixed")


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", WS_PAIRS, ids=["pair", "pair_q_feed_lagging", "pair_opt_ins"])
@pytest.mark.parametrize("shape", ["mha", "chunked", "window", "split"])
def test_ws_pair_steps_outside_a_tile_add_nothing(shape, tiles):
    """A pair's CTAs walk the steps either tile sees, so a tile takes steps wholly outside its own keys
    (masked: they must add nothing) and a CTA whose tile does not exist passes its partner's steps:
    group 1 (tiles 2m and 2m + 1 end in different steps; 300 queries make an odd tile count), chunked
    prefill (queries fewer than keys), a sliding window (the tiles start in different steps) and three
    splits. Equal to the same launch without pairs: bit for bit where only steps past a tile's end are
    added; within rounding where a window's rows start later, and with splits (a pair splits the steps
    either tile sees, so a tile's split boundaries move); NaN-poisoned pages never reach the output."""
    from pagedattn.ops import attention as attention_ops

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("prefill_ws is sm_90a-only")
    gen = torch.Generator().manual_seed(41)
    Hq, Hkv = (8, 8) if shape in ("mha", "split") else (16, 4)
    lens_q = {"mha": [1000, 300, 129], "chunked": [200, 77, 512], "window": [900, 333], "split": [700, 300]}[shape]
    lens_k = [1500, 1201, 2000] if shape == "chunked" else lens_q
    case = build_case(lens_q, lens_k, Hq, Hkv, 128, 16, "NHD", torch.bfloat16, "auto", "tensor", gen)
    kw = dict(max_seqlen_q=max(lens_q), cu_seqlens_q=case["cu_q"], max_seqlen_k=max(lens_k),
              seqused_k=case["seqused"], causal=True, block_table=case["table"], return_softmax_lse=True,
              num_splits=3 if shape == "split" else 1)
    if shape == "window":
        kw["window_size"] = (300, 0)
    without = {k: v for k, v in tiles.items() if k != "kWsPair"}
    with attention_ops.forced(prefill="prefill_ws", tiles={"prefill_ws": without}):
        want, want_lse = flash_attn_varlen_func(case["q"], case["kc"], case["vc"], **kw)
    with attention_ops.forced(prefill="prefill_ws", tiles={"prefill_ws": tiles}):
        got, lse = flash_attn_varlen_func(case["q"], case["kc"], case["vc"], **kw)
        kernels = {(m, plan._kernels[(m, f)].spec.pair) for plan in attention_ops._PLANS.values()
                   for m, f in plan._kernels}
    assert ("prefill_ws", True) in kernels, kernels
    assert not got.isnan().any() and not lse.isnan().any()
    if shape in ("window", "split"):
        assert rel_l2(got.float(), want.float()) < 2e-3
        assert (lse - want_lse).abs().max().item() < 1e-3
    else:
        assert torch.equal(got, want) and torch.equal(lse, want_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("shift", [0, 8], ids=["first", "shifted"])
def test_ws_o_bulk_with_out_rows_in_a_wider_buffer(shift):
    """kWsOBulk with a given `out` whose rows lie `shift` elements into the rows of a wider buffer (row
    stride Hq * D + 16), over requests whose last tiles are partial: equal bit for bit to the 4-byte
    stores of the same tiles without it, and nothing around out's rows is written."""
    from pagedattn.ops import attention as attention_ops

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("prefill_ws is sm_90a-only")
    gen = torch.Generator().manual_seed(31)
    Hq, Hkv, D, bs = 16, 4, 128, 16
    lens = [300, 77, 1030]  # 300 x 4 and 77 x 4 rows: the last tiles are partial
    case = build_case(lens, lens, Hq, Hkv, D, bs, "NHD", torch.bfloat16, "auto", "tensor", gen)
    T = sum(lens)
    kw = dict(max_seqlen_q=max(lens), cu_seqlens_q=case["cu_q"], max_seqlen_k=max(lens), seqused_k=case["seqused"],
              causal=True, block_table=case["table"])
    without = {k: v for k, v in WS_OPT_INS.items() if k != "kWsOBulk"}
    with attention_ops.forced(prefill="prefill_ws", tiles={"prefill_ws": without}):
        want = flash_attn_varlen_func(case["q"], case["kc"], case["vc"], **kw)
    buf = torch.full((T, Hq * D + 16), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = buf[:, shift:shift + Hq * D].view(T, Hq, D)
    with attention_ops.forced(prefill="prefill_ws", tiles={"prefill_ws": WS_OPT_INS}):
        got = flash_attn_varlen_func(case["q"], case["kc"], case["vc"], out=out, **kw)
    assert got is out
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert buf[:, :shift].isnan().all() and buf[:, shift + Hq * D:].isnan().all(), "written outside out's rows"


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [{}, {"kWsQFeed": True, "kLazyMax": 3}, {"kWsQFeed": 2}, WS_OPT_INS, *WS_PAIRS],
                         ids=["defaults", "q_feed_lagging", "chained", "opt_ins", "pair", "pair_q_feed_lagging",
                              "pair_opt_ins"])
@pytest.mark.parametrize("splits", [1, 3])
def test_ws_prefill_is_deterministic_and_leaves_counters_zero(splits, tiles):
    """The persistent prefill_ws over many more work items than SMs, of very different lengths (causal,
    ragged requests, one with no keys), run back to back and on a second stream: bit-identical, equal
    to the reference, and every split counter is zero again after each launch; with the default tiles,
    with the opt-in producer feed (its work items and Q rows handed over item after item; 2: two Q
    tiles, items chained, an item with no keys breaking the chain) and in clusters of two CTAs (kWsPair:
    pairs of row tiles walked together, CTAs with no tile passing their partner's steps)."""
    from pagedattn.ops import attention as attention_ops
    from pagedattn.ops import workspace

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("prefill_ws is sm_90a-only")
    gen = torch.Generator().manual_seed(23)
    Hq, Hkv, D, bs = 32, 8, 128, 16
    lens = [1500, 37, 2049, 700, 0, 1023]
    nb = [-(-L // bs) + 1 for L in lens]
    spec = CacheSpec(sum(nb) + 9, bs, Hkv, D, torch.bfloat16)
    kc, vc = spec.allocate("cuda")
    kc.normal_()
    vc.normal_()
    perm = torch.randperm(spec.num_blocks, generator=gen)
    table = torch.zeros(len(lens), max(nb), dtype=torch.int32)
    at = 0
    for i, n in enumerate(nb):
        table[i, :n] = perm[at:at + n]
        at += n
    table = table.cuda()
    cu_q = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(int(cu_q[-1]), Hq, D, generator=gen).bfloat16().cuda()

    def run():
        out, lse = flash_attn_varlen_func(q, kc, vc, max(lens), cu_q, max(lens), seqused_k=seq, block_table=table,
                                          causal=True, num_splits=splits, return_softmax_lse=True)
        torch.cuda.synchronize()
        assert all(int(b.abs().sum()) == 0 for b in workspace.counter_buffers().values())
        return out, lse

    with attention_ops.forced(tiles={"prefill_ws": tiles}):  # (its plans go when the block closes)
        first, lse = run()
        modes = {m for plan in attention_ops._PLANS.values() for m, _ in plan._kernels}
        assert "prefill_ws" in modes, modes
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            others = [run() for _ in range(2)]
        torch.cuda.current_stream().wait_stream(side)
        for o, l in others + [run() for _ in range(3)]:
            assert torch.equal(o, first) and torch.equal(l, lse)
    ref = reference.paged_attention(q, kc, vc, cu_q, seq, table, causal=True, compute_dtype=torch.float64)
    assert rel_l2(first.float(), ref) < 1e-2


def _d512_grid(n, seed=5):
    """Head dim 512 (and head sizes it serves: 320, 504 with its 8-byte fp8 rows), every path it has."""
    rng = random.Random(seed)
    axes = dict(dtype=[torch.float16, torch.bfloat16], D=[512, 512, 320, 504], layout=["NHD", "HND"],
                bs=[1, 16, 256, 32], heads=[(8, 8), (32, 8), (16, 1)], causal=[False, True],
                batch=["decode", "mixed", "prefill"], splits=[0, 1, 7], kv=KV, lse=[False, True],
                out=[False, True], loader=["auto", "cp_async"])
    return cover_axes(axes, n, rng, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("c", _d512_grid(48), ids=_case_id)
def test_head_dim_512_matches_reference(c, decode_loader):
    from pagedattn.ops import attention as attention_ops

    test_attention_matches_reference(c, decode_loader)
    if torch.cuda.get_device_capability() == (9, 0) and c["batch"] == "decode" and c["bs"] % 16 == 0:
        tma = c["kv"][0] == "auto" and c["loader"] == "auto"  # column warps sharing TMA rings (16-bit only)
        modes = {m for plan in attention_ops._PLANS.values() for m, _ in plan._kernels}
        assert modes == {"decode_tma" if tma else "decode"}, modes


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_contiguous_varlen_mode(causal):
    gen = torch.Generator().manual_seed(5)
    lq, lk = [5, 130, 1], [70, 130, 333]
    Hq, Hkv, D = 16, 4, 128
    q = torch.randn(sum(lq), Hq, D, generator=gen).cuda().bfloat16()
    k = torch.randn(sum(lk), Hkv, D, generator=gen).cuda().bfloat16()
    v = torch.randn(sum(lk), Hkv, D, generator=gen).cuda().bfloat16()
    cu_q = torch.tensor([0, 5, 135, 136], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 70, 200, 533], dtype=torch.int32, device="cuda")
    o, lse = flash_attn_varlen_func(q, k, v, 130, cu_q, 333, cu_seqlens_k=cu_k, causal=causal,
                                    return_softmax_lse=True)
    ref, ref_lse = reference.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, return_lse=True,
                                              compute_dtype=torch.float64)
    assert rel_l2(o, ref) < 1e-2
    assert torch.allclose(lse, ref_lse.float(), atol=2e-2)


@pytest.mark.gpu
def test_split_counters_reset_and_are_per_stream():
    """The fused split combine counts arrivals per tile: after every call the counters are zero
    again, calls on another stream use their own buffer, and results stay bit-identical."""
    from pagedattn.ops import workspace

    gen = torch.Generator().manual_seed(11)
    B, ctx, Hq, Hkv, D, bs = 3, 1000, 32, 8, 128, 16
    spec = CacheSpec(B * 63 + 5, bs, Hkv, D, torch.bfloat16)
    kc, vc = spec.allocate("cuda")
    kc.normal_()
    vc.normal_()
    table = torch.randperm(spec.num_blocks, generator=gen)[: B * 63].view(B, 63).int().cuda()
    q = torch.randn(B, Hq, D, generator=gen).cuda().bfloat16()
    cu_q = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    seq = torch.tensor([1000, 17, 999], dtype=torch.int32, device="cuda")

    def run():
        return flash_attn_varlen_func(q, kc, vc, 1, cu_q, ctx, seqused_k=seq, block_table=table, num_splits=7,
                                      return_softmax_lse=True)
    first, lse = run()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        others = [run() for _ in range(3)]
    torch.cuda.current_stream().wait_stream(side)
    again = [run() for _ in range(3)]
    torch.cuda.synchronize()
    for o, l in others + again:
        assert torch.equal(o, first) and torch.equal(l, lse)
    buffers = list(workspace.counter_buffers().values())
    assert len(buffers) >= 2 and all(int(b.abs().sum()) == 0 for b in buffers)
    ref = reference.paged_attention(q, kc, vc, cu_q, seq, table, compute_dtype=torch.float64)
    assert rel_l2(first, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("D,splits,sinks", [(128, 33, False), (128, 256, True), (256, 100, False),
                                            (512, 70, True), (64, 64, False)])
def test_many_splits_combine_matches_reference(D, splits, sinks):
    """The in-kernel combine over more than one warp's worth of splits (its chunk loop), head dims over
    128 columns (its column loop), sinks, and rows whose splits are mostly empty (a short request in a
    batch split for a long one): against the float64 reference, NaN-poisoned cache and output."""
    gen = torch.Generator().manual_seed(D + splits)
    lens_k = [splits * 128 + 77, 300, 1]
    Hq, Hkv = 16, 4
    case = build_case([1, 1, 1], lens_k, Hq, Hkv, D, 16, "NHD", torch.bfloat16, "auto", "tensor", gen)
    sink = (torch.randn(Hq, generator=gen) * 2).cuda() if sinks else None
    out = torch.full_like(case["q"], float("nan"))
    o, lse = flash_attn_varlen_func(case["q"], case["kc"], case["vc"], 1, case["cu_q"], max(lens_k),
                                    seqused_k=case["seqused"], block_table=case["table"], num_splits=splits,
                                    return_softmax_lse=True, out=out, sinks=sink)
    ref, ref_lse = reference.paged_attention(case["q"], case["kc"], case["vc"], case["cu_q"], case["seqused"],
                                             case["table"], return_lse=True, sinks=sink,
                                             compute_dtype=torch.float64)
    assert not o.isnan().any(), "NaN in the output"
    assert rel_l2(o, ref) < 1e-2
    assert torch.allclose(lse, ref_lse.float(), atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_writer_reader_round_trip(layout, kv):
    """Tokens go in through reshape_and_cache_flash and come out through attention."""
    gen = torch.Generator().manual_seed(9)
    B, ctx, Hq, Hkv, D, bs = 3, 200, 32, 8, 128, 16
    spec = CacheSpec(64, bs, Hkv, D, torch.bfloat16 if kv == "auto" else torch.uint8, kv, layout)
    kc, vc = spec.allocate("cuda", fill=float("nan"))
    table = torch.randperm(64, generator=gen)[: B * 13].view(B, 13).int().cuda()
    key = torch.randn(B * ctx, Hkv, D, generator=gen).cuda().bfloat16()
    val = torch.randn(B * ctx, Hkv, D, generator=gen).cuda().bfloat16()
    pos = torch.arange(ctx, device="cuda")
    slots = (table[:, pos // bs].long() * bs + pos % bs).reshape(-1)
    scale = torch.tensor([0.02], device="cuda") if kv != "auto" else None
    pagedattn.reshape_and_cache_flash(key, val, kc, vc, slots, kv, scale, scale)
    q = torch.randn(B, Hq, D, generator=gen).cuda().bfloat16()
    cu_q = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    seqused = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    o = pagedattn.flash_attn_varlen_func(q, kc, vc, 1, cu_q, ctx, seqused_k=seqused, block_table=table,
                                         kv_cache_dtype=kv, k_descale=scale, v_descale=scale)
    cu_k = torch.arange(0, (B + 1) * ctx, ctx, dtype=torch.int32, device="cuda")
    ref = reference.varlen_attention(q, key, val, cu_q, cu_k, compute_dtype=torch.float64)
    assert rel_l2(o, ref) < (1e-2 if kv == "auto" else 8e-2)


@pytest.mark.gpu
def test_corrupt_block_table_is_safe():
    gen = torch.Generator().manual_seed(3)
    c = build_case([1, 1], [100, 50], 8, 8, 128, 16, "NHD", torch.bfloat16, "auto", "tensor", gen)
    table = c["table"].clone()
    table[0, 1] = 10**6
    table[1, 0] = -5
    o = flash_attn_varlen_func(c["q"], c["kc"], c["vc"], 1, c["cu_q"], 100, seqused_k=c["seqused"] * 50,
                               block_table=table)
    torch.cuda.synchronize()
    assert o.shape == c["q"].shape
    import os
    os.environ["PAGEDATTN_DEBUG"] = "1"
    try:
        with pytest.raises(ContractError, match="request 0"):
            flash_attn_varlen_func(c["q"], c["kc"], c["vc"], 1, c["cu_q"], 100, seqused_k=c["seqused"],
                                   block_table=table)
    finally:
        del os.environ["PAGEDATTN_DEBUG"]


# ---------------------------------------------------------------- bad input (runs before any launch)
def _good():
    gen = torch.Generator().manual_seed(4)
    return build_case([1, 2], [20, 33], 8, 4, 64, 16, "NHD", torch.bfloat16, "auto", "tensor", gen, DEV)


def _call(c, **over):
    kw = dict(q=c["q"], k=c["kc"], v=c["vc"], max_seqlen_q=2, cu_seqlens_q=c["cu_q"], max_seqlen_k=33,
              seqused_k=c["seqused"], block_table=c["table"])
    kw.update(over)
    return flash_attn_varlen_func(**kw)


BAD = {
    "K/V caches differ": lambda c: dict(v=c["vc"][:, :, :2].contiguous()),
    "head size differs from q": lambda c: dict(q=torch.zeros(3, 8, 32, dtype=torch.bfloat16, device=DEV)),
    "Hq not a multiple of Hkv": lambda c: dict(q=torch.zeros(3, 6, 64, dtype=torch.bfloat16, device=DEV)),
    "fp8 cache without descales": lambda c: dict(
        k=c["kc"].view(torch.uint8)[..., :64], v=c["vc"].view(torch.uint8)[..., :64], kv_cache_dtype="fp8_e4m3"),
    "int64 block table": lambda c: dict(block_table=c["table"].long()),
    "int64 seqused_k": lambda c: dict(seqused_k=c["seqused"].long()),
    "cu_seqlens_q wrong dtype": lambda c: dict(cu_seqlens_q=c["cu_q"].long()),
    "block table rows != B": lambda c: dict(block_table=c["table"][:1]),
    "q fp32": lambda c: dict(q=c["q"].float()),
    "q dtype differs from cache": lambda c: dict(q=c["q"].half()),
    "unknown keyword": lambda c: dict(foo=1),
    "out wrong shape": lambda c: dict(out=torch.zeros(3, 8, 32, dtype=torch.bfloat16, device=DEV)),
    "no seqused_k with table": lambda c: dict(seqused_k=None),
    "neither table nor cu_seqlens_k": lambda c: dict(block_table=None, seqused_k=None),
    "head size 520": lambda c: dict(q=torch.zeros(3, 8, 520, dtype=torch.bfloat16, device=DEV)),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_is_a_clear_error(name):
    c = _good()
    with pytest.raises((ContractError, NotImplementedError, TypeError, ValueError)) as info:
        _call(c, **BAD[name](c))
    assert len(str(info.value)) > 10


# ---------------------------------------------------------------- issue #18: what the errors say (CPU)
# A valid call on CPU tensors passes every check and stops at the CUDA one, so each case below changes
# one argument of a valid call and matches the message.
CUDA_ONLY = "need CUDA tensors; q is on cpu"


def _cpu(kv="auto", gran="tensor", lens_q=(1, 2), lens_k=(20, 33)):
    gen = torch.Generator().manual_seed(4)
    return build_case(list(lens_q), list(lens_k), 8, 4, 64, 16, "NHD", torch.bfloat16, kv, gran, gen, "cpu")


def _cpu_call(c, **over):
    kw = dict(q=c["q"], k=c["kc"], v=c["vc"], max_seqlen_q=2, cu_seqlens_q=c["cu_q"], max_seqlen_k=33,
              seqused_k=c["seqused"], block_table=c["table"], kv_cache_dtype=c["spec"].kv_cache_dtype,
              k_descale=c["ks"], v_descale=c["vs"])
    kw.update(over)
    return flash_attn_varlen_func(**kw)


@pytest.mark.parametrize("kv,gran", [("auto", "tensor"), ("fp8_e4m3", "tensor"), ("fp8_e5m2", "head")])
@pytest.mark.parametrize("validate", [False, True])
def test_valid_cpu_call_reaches_the_cuda_check(kv, gran, validate):
    with pytest.raises(ContractError, match=CUDA_ONLY):
        _cpu_call(_cpu(kv, gran), validate=validate)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), 0.0, -0.125, 0, True, "0.1",
                                   [0.1], torch.tensor(float("nan")), torch.tensor([0.1]), torch.tensor(1)])
def test_softmax_scale_refused(scale):
    with pytest.raises(ContractError, match="softmax_scale"):
        _cpu_call(_cpu(), softmax_scale=scale)


@pytest.mark.parametrize("scale", [0.125, 1, torch.tensor(0.125)])
def test_softmax_scale_accepted(scale):
    with pytest.raises(ContractError, match=CUDA_ONLY):
        _cpu_call(_cpu(), softmax_scale=scale)


@pytest.mark.parametrize("name", ["max_seqlen_q", "max_seqlen_k", "num_splits"])
@pytest.mark.parametrize("value", [-1, 2.0, None, True, "2", torch.tensor(2)])
def test_scalar_arguments_refused(name, value):
    with pytest.raises(ContractError, match=f"{name} must be a non-negative int"):
        _cpu_call(_cpu(), **{name: value})


def _fp8_scale(c, name, index, value):
    t = c[{"k_descale": "ks", "v_descale": "vs"}[name]].clone()
    t[index] = value
    return {name: t}


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, 0.0])
@pytest.mark.parametrize("name", ["k_descale", "v_descale"])
def test_descale_values_checked_with_validate(name, value, monkeypatch):
    c = _cpu("fp8_e5m2", "head")
    bad = _fp8_scale(c, name, 2, value)
    with pytest.raises(ContractError, match=CUDA_ONLY):     # no sync unless asked
        _cpu_call(c, **bad)
    with pytest.raises(ContractError, match=rf"{name}\[2\] = {value}: fp8 scales must be finite and > 0"):
        _cpu_call(c, **bad, validate=True)
    monkeypatch.setenv("PAGEDATTN_DEBUG", "1")
    with pytest.raises(ContractError, match=rf"{name}\[2\]"):
        _cpu_call(c, **bad)


def test_descales_0d_and_per_request_accepted():
    from pagedattn.ops.attention import _descale_strides

    c = _cpu("fp8_e4m3")
    for ks in (torch.tensor(0.02), torch.full((1, 1), 0.02), torch.full((2, 4), 0.02)):
        with pytest.raises(ContractError, match=CUDA_ONLY):
            _cpu_call(c, k_descale=ks, v_descale=ks.clone(), validate=True)
    assert _descale_strides("k_descale", torch.tensor(0.5), 2, 4) == (0, 0)
    assert _descale_strides("k_descale", torch.ones(4, 2).t(), 2, 4) == (1, 2)


def test_descale_shape_named_before_device():
    c = _cpu("fp8_e4m3")
    with pytest.raises(ContractError, match=r"k_descale must have shape \[1\], \[4\] or \[2, 4\].*got \(3,\)"):
        _cpu_call(c, k_descale=torch.ones(3, device="meta"))
    with pytest.raises(ContractError, match=r"k_descale must be a float32 .*got torch.float16 tensor of shape \(1,\)"):
        _cpu_call(c, k_descale=torch.ones(1, dtype=torch.float16, device="meta"))
    with pytest.raises(ContractError, match=r"k_descale \(1,\) and v_descale \(4,\) differ in shape"):
        _cpu_call(c, v_descale=torch.ones(4, device="meta"))
    with pytest.raises(ContractError, match="v_descale is on meta, q on cpu"):
        _cpu_call(c, v_descale=torch.ones(1, device="meta"))


def _empty_batch(paged=True, device="cpu"):
    q = torch.zeros(0, 8, 64, dtype=torch.bfloat16, device=device)
    kc, vc = CacheSpec(4, 16, 4, 64, torch.bfloat16).allocate(device)
    cu = torch.zeros(1, dtype=torch.int32, device=device)
    if paged:
        return dict(q=q, k=kc, v=vc, max_seqlen_q=0, cu_seqlens_q=cu, max_seqlen_k=0,
                    seqused_k=torch.zeros(0, dtype=torch.int32, device=device),
                    block_table=torch.zeros(0, 5, dtype=torch.int32, device=device))
    kv = torch.zeros(0, 4, 64, dtype=torch.bfloat16, device=device)
    return dict(q=q, k=kv, v=kv, max_seqlen_q=0, cu_seqlens_q=cu, max_seqlen_k=0, cu_seqlens_k=cu)


@pytest.mark.parametrize("paged", [True, False])
def test_empty_batch_passes_validation(paged):
    from pagedattn.ops.attention import validate

    kw = _empty_batch(paged)
    call = validate(kw["q"], kw["k"], kw["v"], kw["cu_seqlens_q"], kw.get("cu_seqlens_k"), kw.get("seqused_k"),
                    kw.get("block_table"), None, None, None, None)
    assert call.B == 0
    with pytest.raises(ContractError, match=CUDA_ONLY):
        flash_attn_varlen_func(**kw, validate=True)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [True, False])
def test_empty_batch_returns_empty_outputs(paged):
    kw = _empty_batch(paged, "cuda")
    out, lse = flash_attn_varlen_func(**kw, return_softmax_lse=True, validate=True)
    assert out.shape == (0, 8, 64) and lse.shape == (8, 0)


MESSAGES = {
    # an extra cu_seqlens_q entry is cu_seqlens_q's fault, not block_table's
    "cu_seqlens_q one too long": (
        lambda c: dict(cu_seqlens_q=torch.tensor([0, 1, 2, 3], dtype=torch.int32)),
        r"cu_seqlens_q has 4 entries \(B = 3\) while block_table has 2 rows and seqused_k has 2 entries"),
    "block_table one row short": (
        lambda c: dict(block_table=c["table"][:1]),
        r"cu_seqlens_q has 3 entries \(B = 2\) while block_table has 1 rows"),
    "contiguous cu_seqlens_k one too long": (
        lambda c: dict(block_table=None, seqused_k=None, k=c["kc"][0], v=c["vc"][0],
                       cu_seqlens_k=torch.tensor([0, 5, 10, 16], dtype=torch.int32)),
        r"cu_seqlens_q has 3 entries \(B = 2\) while cu_seqlens_k has 4 entries"),
    "head size 132": (lambda c: dict(q=torch.zeros(3, 8, 132, dtype=torch.bfloat16)),
                      "head size 132 .*a multiple of 8, at most 512"),
    "head size 520": (lambda c: dict(q=torch.zeros(3, 8, 520, dtype=torch.bfloat16)), "head size 520"),
    "out shape": (lambda c: dict(out=torch.zeros(3, 8, 32, dtype=torch.bfloat16)),
                  r"out must have q's shape \(3, 8, 64\) and dtype torch.bfloat16, got shape \(3, 8, 32\)"),
    "out dtype": (lambda c: dict(out=torch.zeros(3, 8, 64, dtype=torch.float16)), r"got shape .* and torch.float16"),
    "out strides": (lambda c: dict(out=torch.zeros(3, 64, 8, dtype=torch.bfloat16).transpose(1, 2)),
                    r"out needs a contiguous head dim .*\(like q\), got strides \(512, 1, 8\)"),
    "out device": (lambda c: dict(out=torch.zeros(3, 8, 64, dtype=torch.bfloat16, device="meta")),
                   "out is on meta, q on cpu; the kernels need CUDA tensors"),
    "out not a tensor": (lambda c: dict(out=[0.0]), "out must be None or a tensor like q, got list"),
    "int64 seqused_k": (lambda c: dict(seqused_k=c["seqused"].long()),
                        r"seqused_k must be a contiguous int32 \[B\] tensor, got torch.int64 tensor of shape \(2,\)"),
    "int64 cu_seqlens_q": (lambda c: dict(cu_seqlens_q=c["cu_q"].long()),
                           r"cu_seqlens_q .*got torch.int64 tensor of shape \(3,\) on cpu \(convert with .int\(\)\)"),
    "int64 cu_seqlens_k": (lambda c: dict(block_table=None, seqused_k=None, k=c["kc"][0], v=c["vc"][0],
                                          cu_seqlens_k=torch.tensor([0, 5, 16])),
                           r"cu_seqlens_k .*got torch.int64 tensor of shape \(3,\)"),
    "int64 block_table": (lambda c: dict(block_table=c["table"].long()),
                          r"block_table must be an int32 .*got torch.int64 tensor of shape \(2, 4\)"),
    "2-D cu_seqlens_q": (lambda c: dict(cu_seqlens_q=c["cu_q"][None]), r"got torch.int32 tensor of shape \(1, 3\)"),
    "strided seqused_k": (lambda c: dict(seqused_k=torch.zeros(4, dtype=torch.int32)[::2]),
                          "seqused_k must be contiguous, got stride 2"),
    "block_table on meta": (lambda c: dict(block_table=c["table"].to("meta")),
                            "block_table is on meta, q on cpu; the kernels need CUDA tensors"),
    "seqused_k on meta": (lambda c: dict(seqused_k=c["seqused"].to("meta")), "seqused_k is on meta, q on cpu"),
    "caches on meta": (lambda c: dict(k=c["kc"].to("meta"), v=c["vc"].to("meta")), "k is on meta, q on cpu"),
    "q on meta": (lambda c: dict(q=c["q"].to("meta")), "need CUDA tensors; q is on meta"),
    "q not a tensor": (lambda c: dict(q=None), "q must be a 3-D tensor .*got None"),
    "cu_seqlens_q empty": (lambda c: dict(cu_seqlens_q=torch.zeros(0, dtype=torch.int32)), "cu_seqlens_q is empty"),
    "cache not a tensor": (lambda c: dict(k=[1.0]), "k, v .*key_cache must be a torch.Tensor, got list"),
    "uint8 contiguous k without kv_cache_dtype": (
        lambda c: dict(block_table=None, seqused_k=None, k=c["kc"][0].view(torch.uint8)[..., :64],
                       v=c["vc"][0].view(torch.uint8)[..., :64],
                       cu_seqlens_k=torch.tensor([0, 5, 16], dtype=torch.int32)),
        "k/v dtype torch.uint8 is not supported"),
    "kv_cache_dtype not a string": (lambda c: dict(kv_cache_dtype=8), "^kv_cache_dtype=8 is not supported"),
}


@pytest.mark.parametrize("value", [torch.ones(2), torch.tensor(0.0), 30.0])
def test_unsupported_keyword_values_refused(value):
    """A tensor value is never an unsupported keyword's harmless default (it was a RuntimeError: the
    truth value of an elementwise comparison with (-1, -1))."""
    with pytest.raises(NotImplementedError, match="dropout_p"):
        _cpu_call(_cpu(), dropout_p=value)


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_error_messages_name_what_was_given(name):
    c = _cpu()
    changes, match = MESSAGES[name]
    with pytest.raises(ContractError, match=match):
        _cpu_call(c, **changes(c))


def _contiguous(c):
    k = torch.randn(53, 4, 64).bfloat16()
    return dict(block_table=None, seqused_k=None, k=k, v=k, cu_seqlens_k=torch.tensor([0, 20, 53], dtype=torch.int32))


VALUES = {  # validate=True: the values the kernels trust
    "cu_seqlens_q not from 0": (dict(cu_seqlens_q=[1, 2, 3]), r"cu_seqlens_q\[0\] = 1; offsets start at 0"),
    "empty request": (dict(cu_seqlens_q=[0, 3, 3], q_rows=3, max_seqlen_q=3),
                                None),  # empty request: valid
    "cu_seqlens_q goes back": (dict(cu_seqlens_q=[0, 2, 1], q_rows=1),
                               r"cu_seqlens_q\[2\] = 1 < cu_seqlens_q\[1\] = 2"),
    "cu_seqlens_q short of total_q": (dict(cu_seqlens_q=[0, 1, 2]), r"cu_seqlens_q\[2\] = 2, but q has 3 rows"),
    "q_len over max_seqlen_q": (dict(max_seqlen_q=1), r"request 1: q_len 2 .*exceeds max_seqlen_q=1"),
    "seqused_k negative": (dict(seqused_k=[20, -1]), r"request 1: seqused_k\[1\] = -1 is negative"),
    "seqused_k over max_seqlen_k": (dict(max_seqlen_k=32), r"request 1: 33 keys \(seqused_k\) exceed max_seqlen_k=32"),
    "seqused_k over the table": (dict(seqused_k=[20, 65], max_seqlen_k=65),
                                 r"request 1: seqused_k\[1\] = 65 exceeds its block_table capacity \(4 blocks x 16\)"),
    "block id out of range": (dict(block=(1, 2, 99)), r"request 1: block_table\[1, 2\] = 99 is outside \[0, "),
    "negative block id": (dict(block=(0, 0, -1)), r"request 0: block_table\[0, 0\] = -1"),
    "unused block id out of range": (dict(block=(0, 3, 99)), None),  # beyond seqused_k: never read
    "cu_seqlens_k short of total_k": (dict(contiguous=True, cu_seqlens_k=[0, 20, 50]),
                                      r"cu_seqlens_k\[2\] = 50, but k has 53 rows"),
    "cu_seqlens_k goes back": (dict(contiguous=True, cu_seqlens_k=[0, 60, 53]),
                               r"cu_seqlens_k\[2\] = 53 < cu_seqlens_k\[1\] = 60"),
    "key length over max_seqlen_k": (dict(contiguous=True, max_seqlen_k=30),
                                     r"request 1: 33 keys \(cu_seqlens_k\) exceed max_seqlen_k=30"),
    "contiguous seqused_k over its keys": (dict(contiguous=True, seqused_k=[21, 3]),
                                           r"request 0: seqused_k\[0\] = 21 exceeds its 20 keys in cu_seqlens_k"),
}


@pytest.mark.parametrize("name", sorted(VALUES))
def test_validate_checks_values(name, monkeypatch):
    c = _cpu()
    change, match = VALUES[name]
    change = dict(change)
    over = _contiguous(c) if change.pop("contiguous", False) else {}
    rows = change.pop("q_rows", None)
    if rows is not None:
        over["q"] = c["q"][:rows]
    if "block" in change:
        b, i, x = change.pop("block")
        table = c["table"].clone()
        table[b, i] = x
        over["block_table"] = table
    for key, value in change.items():
        over[key] = torch.tensor(value, dtype=torch.int32) if isinstance(value, list) else value
    with pytest.raises(ContractError, match=CUDA_ONLY):  # metadata alone is fine
        _cpu_call(c, **over)
    with pytest.raises(ContractError, match=match or CUDA_ONLY):
        _cpu_call(c, **over, validate=True)
    monkeypatch.setenv("PAGEDATTN_DEBUG", "1")
    with pytest.raises(ContractError, match=match or CUDA_ONLY):
        _cpu_call(c, **over)


@pytest.mark.gpu
def test_wrong_device_named_on_gpu():
    c = _good()
    with pytest.raises(ContractError, match="block_table is on cpu, q on cuda:0"):
        _call(c, block_table=c["table"].cpu())
    with pytest.raises(ContractError, match="out is on cpu, q on cuda:0"):
        _call(c, out=torch.empty_like(c["q"], device="cpu"))
    with pytest.raises(ContractError, match="q on cpu; the kernels need CUDA tensors"):
        _call(c, q=c["q"].cpu())
    fp8 = build_case([1, 2], [20, 33], 8, 4, 64, 16, "NHD", torch.bfloat16, "fp8_e4m3", "tensor",
                     torch.Generator().manual_seed(4))
    with pytest.raises(ContractError, match=r"k_descale\[0\] = nan"):
        flash_attn_varlen_func(fp8["q"], fp8["kc"], fp8["vc"], 2, fp8["cu_q"], 33, seqused_k=fp8["seqused"],
                               block_table=fp8["table"], kv_cache_dtype="fp8_e4m3",
                               k_descale=torch.full((1,), float("nan"), device="cuda"), v_descale=fp8["vs"],
                               validate=True)


def test_split_heuristic_fills_whole_waves(monkeypatch):
    from pagedattn.ops import attention

    monkeypatch.setattr(attention, "sm_count", lambda device: 132)
    decode = AttnFwdSpec("bf16", "auto", 128, "decode")
    pick = lambda B, ctx: attention.choose_splits(0, B * 8, ctx, decode, 0)  # noqa: E731
    assert pick(64, 4096) == 3          # 512 CTAs on 396 slots would leave a 29 % second wave
    assert pick(16, 4096) == 3          # 128 CTAs underfill: 384 fill one wave
    assert 32 <= pick(1, 32768) <= 64   # one request: split the long context across the GPU
    assert pick(1, 40) == 1             # too short to split
    assert attention.choose_splits(7, 8, 40, decode, 0) == 1      # forced, capped by the KV length
    assert attention.choose_splits(7, 8, 40000, decode, 0) == 7
    prefill = AttnFwdSpec("bf16", "auto", 128, "prefill")
    assert attention.choose_splits(0, 4 * 8 * 128, 4096, prefill, 0) == 1
    # TMA decode: a wave is one CTA per SM (measured on H200, see choose_splits)
    tma = AttnFwdSpec("bf16", "auto", 128, "decode_tma")
    pick = lambda B, ctx: attention.choose_splits(0, B * 8, ctx, tma, 0)  # noqa: E731
    assert pick(64, 4096) == 1 and pick(16, 4096) == 1 and pick(1, 32768) == 16
    # the persistent warp-specialised prefill has no waves: it splits only a grid that underfills the GPU
    ws = AttnFwdSpec("bf16", "auto", 128, "prefill_ws")
    assert attention.choose_splits(0, 8 * 512, 16384, ws, 0) == 1   # B=1 S=16384: the wave model said 2
    assert attention.choose_splits(0, 8 * 4, 16384, ws, 0) > 1      # B=1, 128 new tokens over 16k cached


def _call_info(layout="NHD", kv="auto", D=128, bs=16, Hkv=8):
    from pagedattn.ops.attention import _Call

    spec = CacheSpec(8, bs, Hkv, D, torch.bfloat16 if kv == "auto" else torch.uint8, kv, layout)
    k, _ = spec.allocate("cpu")
    return _Call(2, 4 * Hkv, Hkv, D, True, kv, k.stride()[:3], k.stride()[:3], 8, bs)


def test_tma_decode_dispatch_rules():
    from pagedattn.ops.attention import tma_ok

    assert tma_ok(_call_info("NHD"), "sm_90a", 128) and tma_ok(_call_info("HND"), "sm_90a", 128)
    assert not tma_ok(_call_info("NHD"), "sm_80", 128)           # TMA is Hopper-only
    assert not tma_ok(_call_info("NHD", bs=8), "sm_90a", 128)    # 16-key chunks must fit in a page
    assert not tma_ok(_call_info("NHD", D=80), "sm_90a", 80)     # 16-bit tiles: 64-column swizzle atoms,
    assert tma_ok(_call_info("NHD", D=80), "sm_90a", 80, narrow=True)  # or (opt-in) 16- / 32-column ones
    assert tma_ok(_call_info("HND", D=96), "sm_90a", 96, narrow=True)
    assert tma_ok(_call_info("NHD", kv="fp8_e4m3", D=80), "sm_90a", 80)  # fp8 rows are unswizzled
    assert not tma_ok(_call_info("NHD", kv="fp8_e4m3", D=72), "sm_90a", 80)  # 72-byte rows
    for mode in ("decode_tma", "multi_tma"):  # the narrow ones: opt-in, no variant of the bundles
        spec = AttnFwdSpec("bf16", "auto", 80, mode)
        assert spec.narrow and not spec.dispatched and spec.supports_arch("sm_90a")
    assert AttnFwdSpec("bf16", "fp8_e4m3", 80, "decode_tma").supports_arch("sm_90a")
    assert not AttnFwdSpec("bf16", "fp8_e4m3", 80, "decode_tma").narrow


def test_tma_maps_are_encoded_once_per_cache(monkeypatch):
    from pagedattn.ops import attention

    encoded = []
    monkeypatch.setattr(attention, "tma_maps", lambda k, v, call, head_dim: encoded.append((k, head_dim)) or ("maps", 2))
    plan = attention._Plan.__new__(attention._Plan)
    plan.call, plan.head_dim, plan._tma = _call_info(), 128, {}
    a, b = torch.zeros(4), torch.zeros(4)
    assert plan.tma_maps(a, a, 128) == ("maps", 2) and plan.tma_maps(a, a, 128) == ("maps", 2)
    plan.tma_maps(b, b, 128)
    assert len(encoded) == 2  # one per cache (an engine alternates one cache per layer)
    plan.tma_maps(a, a, 96)   # and per kernel head dim (fp8 at 96: decode_tma at 96, prefill_ws at 128)
    assert [d for _, d in encoded] == [128, 128, 96]


def test_tma_variants_are_hopper_only():
    from pagedattn.aot import plan

    spec = AttnFwdSpec("bf16", "auto", 128, "decode_tma")
    assert not spec.supports_arch("sm_80") and spec.supports_arch("sm_90a")
    assert [j.arch for j in plan([spec], ["sm_80", "sm_90a"])] == ["sm_90a"]
    with pytest.raises(UnsupportedError, match="sm_90a"):
        Kernel(spec).artifact("sm_80")
    for mode in ("decode", "prefill"):  # the cp.async variants build for every arch
        assert AttnFwdSpec("bf16", "auto", 128, mode).supports_arch("sm_80")


def test_wgmma_prefill_dispatch_rules():
    from pagedattn.aot import plan
    from pagedattn.ops.attention import smem_bytes, tile_config, wgmma_ok

    assert wgmma_ok(_call_info("NHD"), "sm_90a", 128) and wgmma_ok(_call_info("HND", bs=1), "sm_90a", 128)
    assert not wgmma_ok(_call_info("NHD"), "sm_80", 128)                     # wgmma is sm_90a-only
    assert not wgmma_ok(_call_info("NHD", D=80), "sm_90a", 80)               # 64-column swizzle atoms
    assert wgmma_ok(_call_info("NHD", kv="fp8_e4m3"), "sm_90a", 128)         # fp8 stages widened in smem
    with pytest.raises(UnsupportedError, match="prefill_wgmma"):
        AttnFwdSpec("bf16", "auto", 96, "prefill_wgmma")
    AttnFwdSpec("bf16", "fp8_e5m2", 128, "prefill_wgmma").check()
    spec = AttnFwdSpec("fp16", "auto", 64, "prefill_wgmma")
    assert [j.arch for j in plan([spec], ["sm_80", "sm_90a"])] == ["sm_90a"]
    for d in (64, 128, 192, 256):  # every compiled tile fits in shared memory, whole warpgroups of 64 rows
        t = tile_config(d, "prefill_wgmma")
        assert t["kWgmma"] and t["kBlockM"] == 16 * t["kWarpsM"] and t["kWarpsM"] % 4 == 0
        assert smem_bytes(t, d, False) <= 227 * 1024
        assert smem_bytes(tile_config(d, "prefill_wgmma", fp8=True), d, True) <= 227 * 1024
    assert not tile_config(128, "prefill")["kWgmma"] and not tile_config(128, "decode_tma")["kWgmma"]


def test_ws_prefill_dispatch_rules():
    from pagedattn.ops.attention import heuristics, smem_bytes, tile_config

    # the warp-specialised prefill: 16-bit caches TMA can read, on sm_90a
    assert heuristics.prefill_mode(True, True, False, 64) == "prefill_ws"
    assert heuristics.prefill_mode(True, True, True, 128) == "prefill_ws"       # fp8 at WS_FP8_HEAD_DIM
    assert heuristics.prefill_mode(True, True, True, 256) == "prefill_wgmma"    # fp8 elsewhere
    assert heuristics.prefill_mode(True, False, False, 128) == "prefill_wgmma"  # block size 1/8, contiguous KV
    assert heuristics.prefill_mode(False, True, False, 128) == "prefill"        # sm_80, head dims not multiples of 64
    with pytest.raises(UnsupportedError, match="fp8 caches at head_dim 128"):
        AttnFwdSpec("bf16", "fp8_e4m3", 256, "prefill_ws")
    fp8 = AttnFwdSpec("bf16", "fp8_e5m2", 128, "prefill_ws")  # its raw stages and barriers fit beside the ring
    assert fp8.tiles == {**tile_config(128, "prefill_ws"), "kKAhead": True, "kWsProducerRegs": 72, "kWsQLate": True}
    assert fp8.dynamic_smem() <= 227 * 1024
    assert fp8.dynamic_smem() == smem_bytes(fp8.tiles, 128, False) + 2 * 2 * 128 * 128 + 8 * 2 * 4 * 2
    # head dims 80 and 96 run on the 128 tile (wgmma_head_dim); they compile as such too (opt-in: narrow),
    # not among the variants bundles and `list` hold; 80's P V takes one of CuTe's extended wgmma shapes
    for d in (80, 96):
        narrow = AttnFwdSpec("bf16", "auto", d, "prefill_ws")
        assert narrow.narrow and not narrow.dispatched and narrow not in set(AttnFwdSpec.all_variants())
        assert ("CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED" in Kernel(narrow).source) is (d == 80)
    assert "CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED" not in Kernel(AttnFwdSpec("bf16", "auto", 80, "prefill")).source
    from pagedattn.ops.attention.tma import box_cols  # their TMA boxes: 32 / 16 columns, 64- / 32-byte swizzle
    assert [box_cols(d, False) for d in (96, 80, 128, 64)] + [box_cols(128, True)] == [32, 16, 64, 64, 128]
    with pytest.raises(ValueError, match="no swizzled TMA box"):
        box_cols(72, False)
    with pytest.raises(UnsupportedError, match="multiple of 64"):
        AttnFwdSpec("bf16", "auto", 96, "prefill_wgmma")
    assert [heuristics.wgmma_head_dim(d, False) for d in (64, 80, 96, 128, 192, 256, 512)] == \
        [64, 128, 128, 128, 192, 256, 512]
    assert [heuristics.wgmma_head_dim(d, False, narrow=True) for d in (80, 96)] == [80, 96]
    assert [heuristics.wgmma_head_dim(d, True, narrow=True) for d in (80, 96)] == [128, 128]  # 16-bit only
    assert [heuristics.wgmma_head_dim(d, True) for d in (80, 96, 128)] == [128, 128, 128]  # fp8 too
    for d in (64, 128, 192, 256):  # two consumer warpgroups of 64 rows and a producer warpgroup
        spec = AttnFwdSpec("bf16", "auto", d, "prefill_ws")
        t = tile_config(d, "prefill_ws")
        assert t["kWgmma"] and t["kTma"] and t["kBlockM"] == 128 and t["kWarpsM"] == 8 and t["kPingPong"]
        assert spec.threads == 384 and smem_bytes(t, d, False) <= 227 * 1024
        assert spec.supports_arch("sm_90a") and not spec.supports_arch("sm_80")
        assert "true,true,1,true," in "".join(Kernel(spec).source.split())  # kTma, kWgmma, kWarpsD, kPingPong
    assert tile_config(256, "prefill_ws")["kStages"] == 2 and tile_config(128, "prefill_ws")["kStages"] == 2
    assert tile_config(64, "prefill_ws")["kStages"] == 2 and tile_config(192, "prefill_ws")["kStages"] == 3
    # d256: Q's wgmma descriptors made per S (held across the loop they spilled with O)
    assert [tile_config(d, "prefill_ws")["kWsQLate"] for d in (64, 128, 192, 256)] == [False, False, False, True]
    assert tile_config(128, "prefill_ws", fp8=True)["kWsQLate"]  # its consumers have 216 registers
    assert "#define PAGEDATTN_WS_Q_LATE 1" in Kernel(AttnFwdSpec("bf16", "auto", 256, "prefill_ws")).source
    # lazy row maxima from d128 on (measured slower at d64), fp8 too; other modes never define the macro
    assert [tile_config(d, "prefill_ws")["kLazyMax"] for d in (64, 128, 192, 256)] == [0, 2, 2, 2]
    assert tile_config(128, "prefill_ws", fp8=True)["kLazyMax"] == 2
    assert "#define PAGEDATTN_LAZY_MAX 2" in Kernel(AttnFwdSpec("bf16", "auto", 128, "prefill_ws")).source
    for spec in (AttnFwdSpec("bf16", "auto", 64, "prefill_ws"), AttnFwdSpec("bf16", "auto", 128, "decode")):
        assert "PAGEDATTN_LAZY_MAX" not in Kernel(spec).source
    # softcap at d128: 2 of the 16 column groups take 2^x on the FMA pipe (the SFU has the tanh too)
    assert tile_config(128, "prefill_ws")["kExp2FmaSoftcap"] == 2 and tile_config(64, "prefill_ws")["kExp2FmaSoftcap"] == 0
    assert "false,2,Smem>" in "".join(Kernel(AttnFwdSpec("bf16", "auto", 128, "prefill_ws", softcap=True)).source.split())


def test_ws_opt_in_plans():
    """The opt-in prefill_ws fields' shared memory: kWsQFeed adds four mbarriers (2: a second Q tile, four
    work slots per consumer warpgroup and eight mbarriers), kWsOBulk a buffer of 16 rows of O per consumer
    warp, the last two where they fit (16-bit caches to head dim 128; elsewhere ignored, on the host as
    in the kernel), and every head dim's plan still fits sm_90a with all of them."""
    from pagedattn.ops import attention as attention_ops
    from pagedattn.ops.attention import smem_plan, tile_config

    for d in (64, 128, 192, 256):
        for fp8 in (False, True) if d == 128 else (False,):
            base = tile_config(d, "prefill_ws", fp8=fp8)
            plain = smem_plan(base, d, fp8)
            one = smem_plan({**base, "kWsQFeed": True}, d, fp8)
            assert one["WsQBars"] == 4 and one["Bytes"] == plain["Bytes"] + 32 and plain["WsQBars"] == 0
            plan = smem_plan({**base, "kWsQFeed": 2, "kWsOBulk": True}, d, fp8)
            small = d <= 128 and not fp8  # O's buffers and a second Q tile fit
            assert plan["WsO"] == (8 * (2 * d + 16) if small else 0) and plain["WsO"] == 0, (d, fp8)
            assert plan["Q"] == (2 if small else 1) * plain["Q"] and plan["WsWork"] == (8 if small else 4)
            assert plan["WsQBars"] == (8 if small else 4)
            assert plan["Bytes"] <= SMEM_PER_CTA["sm_90a"], (d, fp8, plan["Bytes"])
    with attention_ops.forced(tiles={"prefill_ws": {"kWsQFeed": True, "kWsOBulk": True}}):
        source = Kernel(AttnFwdSpec("bf16", "auto", 256, "prefill_ws")).source
    assert "#define PAGEDATTN_WS_Q_FEED 1" in source and "static constexpr int kWsO = 0;" in source


@pytest.mark.parametrize("dtype,kv,tiles,pair", [
    ("bf16", "auto", {"kWsPair": True}, True),
    ("bf16", "auto", {"kWsPair": True, "kWsQFeed": True}, True),
    ("bf16", "auto", {"kWsPair": True, "kWsQFeed": 2}, True),    # chained items too
    ("bf16", "fp8_e4m3", {"kWsPair": True}, False),              # fp8's producer widens its own copies
    ("bf16", "auto", {}, False),
])
def test_ws_pair_renders_where_it_runs(dtype, kv, tiles, pair):
    """kWsPair (clusters of two CTAs, K/V multicast) is rendered, cluster shape and all, only where the
    kernel runs it (tiles.ws_pair: 16-bit caches), and the launch pads for it exactly then
    (AttnFwdSpec.pair)."""
    from pagedattn.ops import attention as attention_ops

    with attention_ops.forced(tiles={"prefill_ws": tiles}):
        spec = AttnFwdSpec(dtype, kv, 128, "prefill_ws")
        source = Kernel(spec).source
        assert spec.pair is pair
    assert ("#define PAGEDATTN_WS_PAIR 1" in source) is pair
    assert ("__cluster_dims__(2, 1, 1)" in source) is pair


def _ptx(source: str, name: str) -> str:
    """The PTX NVRTC makes of a kernel source for compute_90a (tests/tools/sass_since.py's kernel_ptx)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent / "tools" / "sass_since.py"
    spec = importlib.util.spec_from_file_location("sass_since", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool.kernel_ptx(source, name, "sm_90a", nvrtc_options("sm_90a", toolchain()))


def test_ws_pair_waits_acquire_at_cluster_scope():
    """kWsPair: the producer's waits for slots both CTAs' consumers hand back acquire at cluster scope,
    and no wait of a kernel without pairs does (mbarrier_wait<kCluster>, the qualifier spliced into the
    asm text by PAGEDATTN_MBARRIER_WAIT)."""
    from pagedattn.ops import attention as attention_ops

    with attention_ops.forced(tiles={"prefill_ws": {"kWsPair": True}}):
        paired = Kernel(AttnFwdSpec("bf16", "auto", 128, "prefill_ws"))
        paired_ptx = _ptx(paired.source, paired.name)
    plain = Kernel(AttnFwdSpec("bf16", "auto", 128, "prefill_ws"))
    plain_ptx = _ptx(plain.source, plain.name)
    assert "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64" in paired_ptx
    assert "mbarrier.try_wait.parity.shared::cta.b64" in paired_ptx  # the full barriers: the CTA's own
    assert "mbarrier.try_wait.parity.shared::cta.b64" in plain_ptx and ".acquire.cluster" not in plain_ptx


def test_ws_pair_protocol_model():
    """The K/V ring of prefill_ws in clusters of two CTAs (tests/tools/ws_pair_model.py: each producer's
    half of a step multicast into both CTAs' slots, full barriers counting both halves' bytes, slots handed
    back to both producers, CTAs with no tile of their own passing the steps, the cluster barrier at the
    end) under random interleavings: no deadlock, no copy into a slot being read, no bytes counted in the
    wrong phase, nothing reaching a CTA that left; and each of three broken rules is caught."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent / "tools" / "ws_pair_model.py"
    spec = importlib.util.spec_from_file_location("ws_pair_model", path)
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)
    model.main(cases=400, seed=1)
    for fault in ("own_empty", "pass_early", "no_exit_sync"):
        assert model.caught(fault), fault


def test_ws_pair_schedule_emulation():
    """kWsPair's schedule transcribed into Python (perf/results/ws_pair/pair_schedule_emulation.py: ws_slot,
    tile_keys, split_steps, ws_pair_item, the mask's interior test) over random batches (groups 1-16,
    ragged and empty requests, fewer queries than keys, windows, splits, 64- and 128-key steps): a pair's
    CTAs walk the same steps, every tile's own steps are covered once across its splits, and each step
    added for the partner is invisible to every row of the tile and masked."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "perf" / "results" / "ws_pair" / "pair_schedule_emulation.py"
    spec = importlib.util.spec_from_file_location("pair_schedule_emulation", path)
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)
    model.main(cases=500, seed=2)


def test_ws_feed_protocol_model():
    """The hand-over protocol of prefill_ws's producer feed and chained items (tests/tools/ws_protocol_model.py:
    the K/V ring, the Q tiles' full / empty mbarriers with PTX's parity waits, the work slots, the ping-pong
    turns and tile_sync) under random interleavings of the producer and the two consumer warpgroups: no
    deadlock, no buffer overwritten while read, the turns balanced."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent / "tools" / "ws_protocol_model.py"
    spec = importlib.util.spec_from_file_location("ws_protocol_model", path)
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)
    model.main(cases=400, seed=1)


def test_tiles_beyond_shared_memory_are_refused():
    from pagedattn.ops import attention

    with attention.forced(tiles={"prefill_wgmma": {"kBlockN": 128, "kStages": 4}}):
        with pytest.raises(UnsupportedError, match="shared memory"):
            AttnFwdSpec("bf16", "auto", 128, "prefill_wgmma")


def test_prefill_variant_by_rows():
    from pagedattn.ops import attention

    plan = attention._Plan.__new__(attention._Plan)
    plan.decode_mode, plan.prefill_mode, plan.wgmma_rows, plan.multi_mode = "decode_tma", "prefill_wgmma", 128, None
    plan.multi_rows = attention.heuristics.MULTI_ROWS
    assert [plan.mode_for(r) for r in (1, 16, 17, 128, 129, 4096)] == \
        ["decode_tma", "decode_tma", "prefill", "prefill", "prefill_wgmma", "prefill_wgmma"]
    plan.multi_mode = "multi_tma"  # multi-token decode between one decode tile and MULTI_ROWS
    assert [plan.mode_for(r) for r in (16, 17, attention.heuristics.MULTI_ROWS, 128)] == \
        ["decode_tma", "multi_tma", "multi_tma", "prefill"]
    plan.prefill_mode = "prefill_ws"  # the warp-specialised prefill takes every batch above WS_ROWS
    ws = attention.heuristics.WS_ROWS
    assert [plan.mode_for(r) for r in (16, 17, ws, ws + 1, 128, 4096)] == \
        ["decode_tma", "multi_tma", "multi_tma", "prefill_ws", "prefill_ws", "prefill_ws"]
    plan.multi_mode = None
    plan.prefill_mode = "prefill"  # no wgmma (sm_80, fp8 caches, head dims not multiples of 64)
    assert plan.mode_for(4096) == "prefill"
