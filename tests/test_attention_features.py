"""flash_attn_varlen_func's score and mask features (sliding window, softcap, ALiBi, learnable sinks):
the reference against a plain loop (CPU), argument checks and variant names (CPU), compilation (CPU),
and the kernels against the reference in every path (GPU)."""
import math
import random

import pytest
import torch

from pagedattn import ContractError, reference
from pagedattn.ops.attention import FEATURE_SETS, AttnFwdSpec, _Call, features_of, flash_attn_varlen_func
from pagedattn.ops.attention.heuristics import MULTI_ROWS, WS_ROWS
from pagedattn.registry import variant_name
from test_attention import build_case, cover_axes, decode_loader, rel_l2  # noqa: F401 (a fixture)
from test_attention import ci_arch
from test_attention import test_attention_variants_compile as compile_variant

from _compile_grid import grid


# ---------------------------------------------------------------- reference (CPU)
def _loop_attention(q, k, v, scale, causal, window, softcap, slopes, sinks):
    """The definition, one (head, query) at a time in float64: the oracle of the reference."""
    L, Hq, D = q.shape
    K, Hkv = k.shape[:2]
    out = torch.zeros(L, Hq, D, dtype=torch.float64)
    lse = torch.full((Hq, L), -math.inf, dtype=torch.float64)
    left, right = window
    for h in range(Hq):
        kh = h // (Hq // Hkv)
        for i in range(L):
            p = K - L + i
            logits, rows = [], []
            for j in range(K):
                if (causal and j > p) or (not causal and right >= 0 and j > p + right) or (left >= 0 and j < p - left):
                    continue
                s = float(q[i, h].double() @ k[j, kh].double()) * scale
                if softcap:
                    s = softcap * math.tanh(s / softcap)
                if slopes is not None:
                    s -= float(slopes[h]) * abs(p - j)
                logits.append(s)
                rows.append(v[j, kh].double())
            terms = logits + ([float(sinks[h])] if sinks is not None else [])
            if not terms:
                continue
            m = max(terms)
            z = sum(math.exp(t - m) for t in terms)
            lse[h, i] = m + math.log(z)
            for s, row in zip(logits, rows):
                out[i, h] += math.exp(s - lse[h, i]) * row
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (3, -1), (0, 0), (5, 2), (-1, 4)])
@pytest.mark.parametrize("mods", ["none", "softcap", "alibi", "sinks", "all"])
def test_reference_features_match_the_definition(causal, window, mods):
    gen = torch.Generator().manual_seed(hash((causal, window, mods)) % 2**31)
    L, K, Hq, Hkv, D = 5, 11, 4, 2, 8
    q, k, v = (torch.randn(n, h, D, generator=gen) for n, h in ((L, Hq), (K, Hkv), (K, Hkv)))
    softcap = 2.5 if mods in ("softcap", "all") else 0.0
    slopes = torch.rand(Hq, generator=gen) if mods in ("alibi", "all") else None
    sinks = torch.randn(Hq, generator=gen) if mods in ("sinks", "all") else None
    out, lse = reference.attention_rows(q, k, v, 0.4, causal, torch.float64, window_size=window, softcap=softcap,
                                        alibi_slopes=slopes, sinks=sinks)
    want, want_lse = _loop_attention(q, k, v, 0.4, causal, window, softcap, slopes, sinks)
    assert torch.allclose(out.double(), want, atol=1e-6)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    fin = torch.isfinite(want_lse)
    assert torch.allclose(lse.double()[fin], want_lse[fin], atol=1e-5)


def test_reference_sink_row_without_keys():
    q = torch.randn(1, 2, 8)
    k = v = torch.zeros(0, 1, 8)
    out, lse = reference.attention_rows(q, k, v, 1.0, False, torch.float64, sinks=torch.tensor([0.5, -1.0]))
    assert (out == 0).all() and torch.allclose(lse[:, 0], torch.tensor([0.5, -1.0]))


# ---------------------------------------------------------------- arguments and variants (CPU)
CALL = _Call(B=3, Hq=8, Hkv=2, D=128, paged=True, kv_name="auto", k_strides=(0, 0, 0), v_strides=(0, 0, 0))
CPU = torch.device("cpu")


def test_no_features_is_the_plain_variant():
    flags, *_ = features_of(CALL, CPU, True, (-1, -1), 0.0, None, None)
    assert flags == (False,) * 4
    flags, *_ = features_of(CALL, CPU, True, [-1, -1], 0, None, None)
    assert flags == (False,) * 4


def test_feature_flags_and_values():
    slopes = torch.rand(3, 8)
    flags, left, right, cap, a, stride, s = features_of(CALL, CPU, False, (128, 0), 30.0, slopes, torch.zeros(8))
    assert flags == (True, True, True, True) and (left, right, cap, stride) == (128, 0, 30.0, 8) and a is slopes
    # causal: a window needs a left edge (the right one is the causal limit)
    assert features_of(CALL, CPU, True, (-1, 3), 0.0, None, None)[0] == (False,) * 4
    assert features_of(CALL, CPU, False, (-1, 3), 0.0, None, None)[0][0]


BAD_FEATURES = {
    "window not a pair": (dict(window_size=(4,)), "window_size"),
    "window below -1": (dict(window_size=(-2, 0)), "window_size"),
    "window floats": (dict(window_size=(1.0, 0)), "window_size"),
    "window bools": (dict(window_size=(True, 0)), "window_size"),
    "window too large": (dict(window_size=(2**31, 0)), "window_size"),
    "softcap negative": (dict(softcap=-1.0), "softcap"),
    "softcap nan": (dict(softcap=float("nan")), "softcap"),
    "softcap inf": (dict(softcap=float("inf")), "softcap"),
    "softcap string": (dict(softcap="1"), "softcap"),
    "slopes float64": (dict(alibi_slopes=torch.zeros(8, dtype=torch.float64)), "alibi_slopes"),
    "slopes shape": (dict(alibi_slopes=torch.zeros(4)), "alibi_slopes"),
    "slopes batch": (dict(alibi_slopes=torch.zeros(2, 8)), "alibi_slopes"),
    "slopes strided": (dict(alibi_slopes=torch.zeros(16)[::2]), "alibi_slopes"),
    "slopes list": (dict(alibi_slopes=[0.1] * 8), "alibi_slopes"),
    "sinks batched": (dict(sinks=torch.zeros(3, 8)), "sinks"),
    "sinks int": (dict(sinks=torch.zeros(8, dtype=torch.int32)), "sinks"),
}


@pytest.mark.parametrize("name", sorted(BAD_FEATURES))
def test_bad_feature_arguments_are_refused(name):
    kw, word = BAD_FEATURES[name]
    args = dict(window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None)
    args.update(kw)
    with pytest.raises(ContractError, match=word):
        features_of(CALL, CPU, False, args["window_size"], args["softcap"], args["alibi_slopes"], args["sinks"])


def test_feature_variants_are_named_and_listed():
    spec = AttnFwdSpec("bf16", "auto", 128, "decode_tma", window=True, sinks=True)
    assert variant_name(spec) == "attn_fwd_bf16_kvauto_d128_decodetma_window_sinks"
    assert spec.features == "window+sinks"
    specs = list(AttnFwdSpec.all_variants())
    plain = [s for s in specs if s.features == "none"]
    assert {s.features for s in specs} == set(FEATURE_SETS)
    assert len(specs) == len(plain) * len(FEATURE_SETS)


FEATURE_CI_SPECS = [AttnFwdSpec("bf16", "auto", 128, "decode", window=True, softcap=True, alibi=True, sinks=True),
                    AttnFwdSpec("bf16", "auto", 128, "decode_tma", window=True, softcap=True, sinks=True),
                    AttnFwdSpec("bf16", "auto", 128, "prefill_wgmma", window=True, softcap=True, alibi=True,
                                sinks=True)]


@pytest.mark.compiles
@pytest.mark.parametrize("spec,arch", grid(FEATURE_CI_SPECS, ci_arch))
def test_feature_variants_compile(spec, arch):
    compile_variant(spec, arch)


# ---------------------------------------------------------------- the kernels (GPU)
def _feature_grid(n, seed=1):
    rng = random.Random(seed)
    axes = dict(dtype=[torch.float16, torch.bfloat16], D=[64, 128, 72, 256], layout=["NHD", "HND"],
                bs=[1, 16, 256, 32], heads=[(8, 8), (32, 8), (16, 1)], causal=[False, True],
                batch=["decode", "mixed", "prefill", "long"], splits=[0, 1, 7], kv=["auto", "fp8_e4m3"],
                features=[fs for fs in FEATURE_SETS if fs != "none"],
                window=[(5, -1), (40, 0), (100, 17), (700, -1), (-1, 9), (3000, -1)],
                alibi=["head", "batch"], loader=["auto", "cp_async"], contiguous=[False, False, False, True])
    cases = cover_axes(axes, n, rng, 2)
    for c in cases:  # the model-shaped feature sets of FEATURE_SETS: the variants bundles hold
        fs = c.pop("features").split("+")
        c["window"] = c["window"] if "window" in fs else (-1, -1)
        c["softcap"] = 20.0 if "softcap" in fs else 0.0
        c["alibi"] = c["alibi"] if "alibi" in fs else None
        c["sinks"] = "sinks" in fs
    return cases


def _fid(c):
    a = c["alibi"] or "noalibi"
    return (f"{str(c['dtype'])[6:]}-d{c['D']}-{c['layout']}-b{c['bs']}-h{c['heads'][0]}x{c['heads'][1]}-"
            f"{'causal' if c['causal'] else 'full'}-{c['batch']}-s{c['splits']}-{c['kv']}-w{c['window'][0]}"
            f"_{c['window'][1]}-cap{c['softcap']:g}-{a}-{'sinks' if c['sinks'] else 'nosinks'}-{c['loader']}"
            f"{'-contig' if c['contiguous'] else ''}")


def _feature_lengths(kind, rng, group=1, multi_rows=MULTI_ROWS):
    if kind == "multi":  # multi-token decode: 2..multi_rows / group queries over histories beyond the windows
        most = max(2, multi_rows // group)
        return [most, rng.randint(2, most), 1], [rng.randint(most, 1500), rng.randint(200, 900), rng.randint(1, 60)]
    if kind == "decode":
        lk = [rng.randint(1, 700), 0, rng.randint(1, 40), rng.randint(300, 1100)]
        return [1] * 4, lk
    if kind == "prefill":
        lq = [rng.randint(1, 300), rng.randint(100, 400)]
        return lq, list(lq)
    if kind == "long":  # windows much shorter than the history: stages outside are skipped
        return [1, 3, 1], [rng.randint(2000, 4000), rng.randint(1000, 3000), 5]
    lq = [1, rng.randint(2, 90), rng.randint(1, 200), 1]
    return lq, [rng.randint(1, 800), lq[1] + rng.randint(1, 500), lq[2], 0]


@pytest.mark.gpu
@pytest.mark.parametrize("c", _feature_grid(160), ids=_fid)
def test_features_match_reference(c, decode_loader):
    _check_feature_case(c, decode_loader)


@pytest.mark.gpu
@pytest.mark.parametrize("c", [c for c in _feature_grid(160) if c["batch"] in ("mixed", "prefill")][:16], ids=_fid)
def test_features_with_understated_max_seqlen_q(c, decode_loader):
    """max_seqlen_q = 1 for requests of up to 400 queries: the rows past the grid's row tiles take the
    out-of-line path (attn_fwd.cuh: attn_rows_past_grid), with every feature, fp8 and split."""
    _check_feature_case(c, decode_loader, max_q=1)


@pytest.mark.gpu
@pytest.mark.parametrize("c", [c for c in _feature_grid(160, seed=5) if c["batch"] in ("mixed", "prefill")][:16],
                         ids=_fid)
def test_features_with_lagging_max(c, decode_loader):
    """Every feature under prefill_ws's opt-in lagging exponentials (tile field kLazyMax 3; softcap's
    exponentials on the FMA pipe keep kLazyMax 2 inside the kernel)."""
    from pagedattn.ops import attention as attention_ops

    with attention_ops.forced(tiles={"prefill_ws": {"kLazyMax": 3}}):
        _check_feature_case(c, decode_loader)


@pytest.mark.gpu
@pytest.mark.parametrize("c", [c for c in _feature_grid(160, seed=5) if c["batch"] in ("mixed", "prefill")][16:28],
                         ids=_fid)
def test_features_with_ws_opt_ins(c, decode_loader):
    """Every feature under prefill_ws's opt-in tile fields together: the producer feed with chained items
    (kWsQFeed 2: the producer finds the work items and copies their Q rows into two tiles, and an item's
    first S runs in the last turn of the item before), O's bulk stores (kWsOBulk) and the lagging
    exponentials (kLazyMax 3)."""
    from pagedattn.ops import attention as attention_ops

    with attention_ops.forced(tiles={"prefill_ws": {"kWsQFeed": 2, "kWsOBulk": True, "kLazyMax": 3}}):
        _check_feature_case(c, decode_loader)


@pytest.mark.gpu
@pytest.mark.parametrize("c", [c for c in _feature_grid(160, seed=5) if c["batch"] in ("mixed", "prefill")][28:40],
                         ids=_fid)
def test_features_with_ws_pairs(c, decode_loader):
    """Every feature in prefill_ws's opt-in clusters of two CTAs (kWsPair: the pair walks the steps
    either tile sees, so windows start a tile's walk early and the mask must hide those steps), with the
    producer feed and chained items, O's bulk stores and the lagging exponentials."""
    from pagedattn.ops import attention as attention_ops

    with attention_ops.forced(tiles={"prefill_ws": {"kWsPair": True, "kWsQFeed": 2, "kWsOBulk": True,
                                                    "kLazyMax": 3}}):
        _check_feature_case(c, decode_loader)


@pytest.mark.gpu
@pytest.mark.parametrize("c", [dict(c, D=(96, 80)[i % 2], kv="auto", contiguous=False, bs=max(16, c["bs"]))
                               for i, c in enumerate([c for c in _feature_grid(160, seed=9)
                                                      if c["batch"] in ("mixed", "prefill", "long")][:16])],
                         ids=_fid)
def test_features_at_narrow_head_dim(c, decode_loader):
    """Every feature in the opt-in head-dim-96 and -80 prefill_ws (forced narrow: 32- and 16-column
    panels) and at those head dims as the dispatch runs them (the 128 tile, its last columns zero)."""
    from pagedattn.ops import attention as attention_ops

    _check_feature_case(c, decode_loader)
    with attention_ops.forced(prefill="prefill_ws", narrow=True):
        _check_feature_case(c, decode_loader)


@pytest.mark.gpu
@pytest.mark.parametrize("c", [dict(c, D=512, loader=("auto", "cp_async")[i % 2])
                               for i, c in enumerate(_feature_grid(160, seed=3)[::8])], ids=_fid)
def test_features_at_head_dim_512(c, decode_loader):
    """The score modifiers and masks at head dim 512 (the column-group mainloops: cp.async, and TMA
    decode for 16-bit caches)."""
    _check_feature_case(c, decode_loader)


@pytest.mark.gpu
@pytest.mark.parametrize("c", [dict(c, D=c["D"] if c["D"] <= 128 else 128, batch="multi", contiguous=False)
                               for c in _feature_grid(160, seed=7)[::6]], ids=_fid)
def test_features_in_multi_token_decode(c, decode_loader):
    """Every feature in the multi-token decode modes (multi / multi_tma): up to MULTI_ROWS packed rows."""
    from pagedattn.ops import attention as attention_ops

    _check_feature_case(c, decode_loader)
    modes = {mode for plan in attention_ops._PLANS.values() for mode, _ in plan._kernels}
    assert modes & {"multi", "multi_tma"}, modes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("softcap", [5.0, 50.0, 65.0, 70.0])
@pytest.mark.parametrize("D", [64, 128])
def test_softcap_prefill_with_saturated_scores(D, softcap, dtype, decode_loader):
    """The warp-specialised prefill takes softcapped probabilities against a fixed maximum where
    P's type holds the whole range (softmax.cuh: fix_max; bf16 up to softcap 65.8, fp16 up to 9.7) and
    keeps the online maximum above it (70): q scaled so that scores reach the cap, causal rows that
    see no key (q_len > k_len) and an empty request, split and unsplit."""
    from pagedattn.ops import attention as attention_ops

    for splits in (1, 3):
        c = dict(dtype=dtype, D=D, layout="NHD", bs=16, heads=(32, 8), causal=True, batch="saturated", splits=splits,
                 kv="auto", window=(-1, -1), softcap=softcap, alibi=None, sinks=splits == 3, loader="auto",
                 contiguous=False, q_scale=softcap / 2)
        _check_feature_case(c, decode_loader)
    modes = {mode for plan in attention_ops._PLANS.values() for mode, _ in plan._kernels}
    assert "prefill_ws" in modes, modes


def _check_feature_case(c, decode_loader, max_q=None):
    decode_loader(c["loader"])
    rng = random.Random(_fid(c))
    gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
    Hq, Hkv = c["heads"]
    kv = "auto" if c["contiguous"] else c["kv"]
    # multi-token decode keeps WS_ROWS rows where the warp-specialised prefill takes those above
    multi_rows = WS_ROWS if kv == "auto" and c["bs"] % 16 == 0 and not c["contiguous"] else MULTI_ROWS
    if c["batch"] == "saturated":  # rows of the second request see no key at all, the third is empty
        lens_q, lens_k = [rng.randint(300, 700), 150, 40], [rng.randint(700, 900), 90, 0]
    else:
        lens_q, lens_k = _feature_lengths(c["batch"], rng, Hq // Hkv, multi_rows)
    case = build_case(lens_q, lens_k, Hq, Hkv, c["D"], c["bs"], c["layout"], c["dtype"], kv, "tensor", gen)
    if "q_scale" in c:
        case["q"] *= c["q_scale"]
    B = len(lens_q)
    slopes = None
    if c["alibi"] == "head":
        slopes = (torch.rand(Hq, generator=gen) * 0.2).cuda()
    elif c["alibi"] == "batch":
        slopes = (torch.rand(B, Hq, generator=gen) * 0.2).cuda()
    sinks = (torch.randn(Hq, generator=gen) * 2).cuda() if c["sinks"] else None
    feats = dict(window_size=c["window"], softcap=c["softcap"], alibi_slopes=slopes)
    if c["contiguous"]:  # the same keys, gathered into [total_k, Hkv, D]
        ks = [reference.gather_kv(case["kc"], case["table"][b], n) for b, n in enumerate(lens_k)]
        vs = [reference.gather_kv(case["vc"], case["table"][b], n) for b, n in enumerate(lens_k)]
        k, v = torch.cat(ks).to(c["dtype"]), torch.cat(vs).to(c["dtype"])
        cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
        kw = dict(cu_seqlens_k=cu_k)
        ref_fn = lambda dt: reference.varlen_attention(case["q"], k, v, case["cu_q"], cu_k, causal=c["causal"],  # noqa: E731
                                                       return_lse=True, compute_dtype=dt, sinks=sinks, **feats)
    else:
        k, v = case["kc"], case["vc"]
        kw = dict(seqused_k=case["seqused"], block_table=case["table"], k_descale=case["ks"], v_descale=case["vs"],
                  kv_cache_dtype=kv)
        ref_fn = lambda dt: reference.paged_attention(case["q"], k, v, case["cu_q"], case["seqused"], case["table"],  # noqa: E731
                                                      causal=c["causal"], kv_cache_dtype=kv, k_descale=case["ks"],
                                                      v_descale=case["vs"], return_lse=True, compute_dtype=dt,
                                                      sinks=sinks, **feats)
    out = torch.full_like(case["q"], float("nan"))
    args = dict(max_seqlen_q=max(lens_q) if max_q is None else max_q, cu_seqlens_q=case["cu_q"], max_seqlen_k=max(lens_k), causal=c["causal"],
                return_softmax_lse=True, num_splits=c["splits"], s_aux=sinks, **feats, **kw)
    o, lse = flash_attn_varlen_func(case["q"], k, v, out=out, **args)
    ref, ref_lse = ref_fn(torch.float64)
    low, _ = ref_fn(c["dtype"])
    assert not o.isnan().any(), "NaN in the output"
    err, err_low = rel_l2(o, ref), rel_l2(low.to(c["dtype"]), ref)
    assert err <= max(2 * err_low, 3e-3) and err < 2e-2, (err, err_low)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)), "LSE -inf pattern differs"
    assert torch.allclose(lse[finite], ref_lse[finite].float(), atol=3e-2, rtol=1e-3)
    again, _ = flash_attn_varlen_func(case["q"], k, v, **args)
    assert torch.equal(again.view(torch.int16), o.view(torch.int16)), "rerun is not bit-identical"


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_flash_alibi_agrees_with_legacy(D):
    """The legacy v1 kernel's ALiBi (vLLM's) and the flash path's on the same decode batch."""
    from pagedattn import legacy
    from pagedattn.contract import CacheSpec

    gen = torch.Generator().manual_seed(D)
    B, Hq, Hkv, bs = 3, 8, 2, 16
    lens = [37, 300, 1]
    nb = 64
    lspec = CacheSpec(nb, bs, Hkv, D, torch.float16, "auto", "legacy")
    lk, lv = lspec.allocate("cuda", fill=float("nan"))
    fspec = CacheSpec(nb, bs, Hkv, D, torch.float16, "auto", "NHD")
    fk, fv = fspec.allocate("cuda", fill=float("nan"))
    table = torch.randperm(nb, generator=gen)[:B * 20].view(B, 20).int().cuda()
    for b, n in enumerate(lens):
        key = torch.randn(n, Hkv, D, generator=gen).half().cuda()
        val = torch.randn(n, Hkv, D, generator=gen).half().cuda()
        pos = torch.arange(n, device="cuda")
        slots = table[b, pos // bs].long() * bs + pos % bs
        legacy.reshape_and_cache(key, val, lk, lv, slots)
        reference.reshape_and_cache_flash(key, val, fk, fv, slots)
    q = torch.randn(B, Hq, D, generator=gen).half().cuda()
    slopes = (torch.rand(Hq, generator=gen) * 0.3).cuda()
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    want = torch.empty_like(q)
    legacy.paged_attention_v1(want, q, lk, lv, Hkv, D ** -0.5, table, seq, bs, max(lens), slopes)
    cu_q = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    got = flash_attn_varlen_func(q, fk, fv, 1, cu_q, max(lens), seqused_k=seq, block_table=table,
                                 alibi_slopes=slopes, causal=True)
    assert rel_l2(got, want) < 3e-3
