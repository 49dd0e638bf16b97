"""The legacy comparison path (pagedattn.legacy): reshape_and_cache + paged_attention_v1/v2.

CPU: the float64 references (writer and reader) on hand-made cases and against torch SDPA on an
independently gathered KV; the layout contract (flash and legacy refuse each other's caches); the
v1/v2 rule; validation before launch; a representative subset of variants compiles for sm_80 and
sm_90a (the whole matrix under `-m slow`).
GPU: v1 and v2 against the reference and against each other over dtypes x head sizes x block sizes,
GQA, ALiBi, fp8 caches (uint8 and float8 storage), NaN-poisoned caches / outputs / scratch, shuffled
block tables, lengths around the 512-token partitions; bit-identical reruns; writer bit for bit
against the reference writer; writer -> reader round trip; corrupt tables inside NaN guard blocks;
bad input raises before any launch.
"""
from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch
import torch.nn.functional as F

import pagedattn
from pagedattn import CacheSpec, ContractError, UnsupportedError, legacy
from pagedattn import legacy_reference as ref
from pagedattn.ops.legacy_attention import (BLOCK_SIZES, HEAD_SIZES, PARTITION_SIZE, LegacyAttentionSpec,
                                            LegacyReduceSpec)
from pagedattn.ops.legacy_cache import LegacyCacheWriteSpec
from pagedattn.reference import quantize_fp8
from pagedattn.registry import get_kernel, variant_name

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
TOL = {torch.float16: 3e-3, torch.bfloat16: 1e-2}   # relative L2 error against the float64 reference
SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16"}


# ================================================================ helpers (shared by CPU and GPU tests)
def poison(t: torch.Tensor) -> torch.Tensor:
    """NaN everywhere (fp8: byte 0x7F, NaN in both e4m3 and e5m2)."""
    if t.element_size() == 1:
        t.view(torch.uint8).fill_(0x7F)
    else:
        t.fill_(float("nan"))
    return t


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def legacy_caches(num_blocks, num_kv_heads, head_size, block_size, cache_dtype, device, guard=0):
    """NaN-poisoned legacy caches; with guard > 0 they sit between `guard` NaN blocks on each side
    of one allocation, so a read of block -1 or num_blocks would pull NaN into the output."""
    x = 16 // cache_dtype.itemsize
    kbig = poison(torch.empty(num_blocks + 2 * guard, num_kv_heads, head_size // x, block_size, x,
                              dtype=cache_dtype, device=device))
    vbig = poison(torch.empty(num_blocks + 2 * guard, num_kv_heads, head_size, block_size,
                              dtype=cache_dtype, device=device))
    return kbig[guard:guard + num_blocks], vbig[guard:guard + num_blocks]


def to_cache(x: torch.Tensor, cache_dtype, kv, scale):
    if kv == "auto":
        return x.to(cache_dtype)
    q = quantize_fp8(x, scale.reshape(()), kv)
    return q.view(torch.uint8) if cache_dtype == torch.uint8 else q


def fill(key_cache, value_cache, k, v, block_tables, seq_lens, kv="auto", k_scale=None, v_scale=None):
    """Test-side cache fill (not the writer under test): token p of sequence s goes to block
    block_tables[s, p // bs], offset p % bs. k, v: [num_seqs, max_len, H, D]."""
    _, h, chunks, bs, x = key_cache.shape
    for s, n in enumerate(seq_lens.tolist()):
        if n <= 0:
            continue
        pos = torch.arange(n, device=k.device)
        blocks = block_tables[s, pos // bs].long()
        offs = pos % bs
        key_cache[blocks, :, :, offs, :] = to_cache(k[s, :n], key_cache.dtype, kv, k_scale).reshape(
            n, h, chunks, x)
        value_cache[blocks, :, :, offs] = to_cache(v[s, :n], value_cache.dtype, kv, v_scale)


def shuffled_tables(seq_lens, block_size, num_blocks, width, gen, device):
    """Each sequence gets distinct physical blocks in random order; entries past a sequence's last
    block hold garbage ids (in and out of range) that must never be read."""
    need = [-(-n // block_size) for n in seq_lens]
    assert sum(need) <= num_blocks
    table = torch.randint(-5, num_blocks + 5, (len(seq_lens), width), generator=gen, dtype=torch.int32)
    for _ in range(100):  # a fresh permutation until the blocks in use are out of order
        perm = torch.randperm(num_blocks, generator=gen).int()
        start = 0
        for s, n in enumerate(need):
            table[s, :n] = perm[start:start + n]
            start += n
        used = torch.cat([table[s, :n] for s, n in enumerate(need)])
        if used.numel() < 2 or not torch.equal(used, used.sort().values):
            break
    assert used.numel() < 2 or not torch.equal(used, used.sort().values), "block table in order"
    return table.to(device)


def nhd_gather(key_cache, value_cache, table_row, n):
    """An independent gather for the SDPA check: permute the legacy cache to [N, bs, H, D] once,
    then index flat slots."""
    num_blocks, h, chunks, bs, x = key_cache.shape
    k_nhd = key_cache.permute(0, 3, 1, 2, 4).reshape(num_blocks * bs, h, chunks * x)
    v_nhd = value_cache.permute(0, 3, 1, 2).reshape(num_blocks * bs, h, chunks * x)
    slots = torch.tensor([int(table_row[p // bs]) * bs + p % bs for p in range(n)], dtype=torch.long)
    return k_nhd[slots], v_nhd[slots]


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def alibi_slopes(num_heads, device):
    """The ALiBi paper's geometric slopes (2^(-8 i / n))."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / num_heads) for i in range(num_heads)],
                        dtype=torch.float32, device=device)


# ================================================================ writer reference (CPU)
def test_writer_reference_hand_made():
    h, d, bs = 2, 16, 4                         # fp16: x = 8, two K chunks per head
    kc, vc = legacy_caches(3, h, d, bs, torch.float16, "cpu")
    t_idx = torch.arange(4)[:, None, None]
    h_idx = torch.arange(h)[None, :, None]
    d_idx = torch.arange(d)[None, None, :]
    key = (100 * t_idx + 10 * h_idx + d_idx).half()            # exact in fp16
    value = -key
    slots = torch.tensor([5, -1, 0, 11])                        # token 1 padding
    ref.reshape_and_cache(key, value, kc, vc, slots)
    written = {5: 0, 0: 2, 11: 3}
    for slot, t in written.items():
        block, off = divmod(slot, bs)
        for hh in range(h):
            for dd in range(d):
                assert kc[block, hh, dd // 8, off, dd % 8] == key[t, hh, dd]
                assert vc[block, hh, dd, off] == value[t, hh, dd]
    k_mask = torch.ones_like(kc, dtype=torch.bool)
    v_mask = torch.ones_like(vc, dtype=torch.bool)
    for slot in written:
        k_mask[slot // bs, :, :, slot % bs, :] = False
        v_mask[slot // bs, :, :, slot % bs] = False
    assert kc[k_mask].isnan().all() and vc[v_mask].isnan().all()


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_writer_reference_fp8(kv):
    h, d, bs = 2, 32, 8
    key = torch.randn(6, h, d, dtype=torch.bfloat16) * 4
    key[0, 0, 0] = 1e6                                          # saturates, does not become inf/NaN
    scale = torch.tensor([0.25])
    slots = torch.arange(6) * 3
    caches = {}
    for storage in (torch.uint8, FP8[kv]):
        kc, vc = legacy_caches(3, h, d, bs, storage, "cpu")
        ref.reshape_and_cache(key, key, kc, vc, slots, kv, scale, scale)
        caches[storage] = (kc, vc)
        assert kc.shape == (3, h, d // 16, bs, 16)              # x = 16 for one-byte elements
    (ku, vu), (kf, vf) = caches[torch.uint8], caches[FP8[kv]]
    assert torch.equal(ku, kf.view(torch.uint8)) and torch.equal(vu, vf.view(torch.uint8))
    fmax = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}[kv]
    step = {"fp8_e4m3": 2.0 ** -3, "fp8_e5m2": 2.0 ** -2}[kv]    # relative spacing of the format
    for t, slot in enumerate(slots.tolist()):
        block, off = divmod(slot, bs)
        got = ref.dequantize(vu[block, :, :, off], kv, scale)      # [H, D]
        want = key[t].double()
        sat = want.abs() > fmax * 0.25
        assert torch.all(got[sat].abs() == fmax * 0.25)
        small = want.abs() < 2.0 ** -6 * 0.25 * 8                 # sub-normal region: absolute error
        err = (got - want).abs()
        assert torch.all(err[~sat & ~small] <= step / 2 * want.abs()[~sat & ~small] * 1.0001)
        k_back = ref.dequantize(ku[block, :, :, off, :].reshape(h, d), kv, scale)
        assert torch.equal(k_back, got)


# ================================================================ reader reference (CPU)
def test_reader_reference_uniform_hand_made():
    """q = 0 gives uniform weights: the output is the mean of V over the visible tokens; the NaN in
    the unused slots of the last block and in unused blocks stays out."""
    kc, vc = legacy_caches(4, 1, 16, 8, torch.float16, "cpu")
    v = torch.arange(11 * 16, dtype=torch.float16).reshape(1, 11, 1, 16) / 16
    k = torch.randn(1, 11, 1, 16, dtype=torch.float16)
    table = torch.tensor([[3, 1]], dtype=torch.int32)
    lens = torch.tensor([11], dtype=torch.int32)
    fill(kc, vc, k, v, table, lens)
    out = ref.paged_attention(torch.zeros(1, 1, 16, dtype=torch.float16), kc, vc, 1, 0.25, table, lens)
    assert torch.allclose(out[0, 0], v[0, :, 0].double().mean(0), atol=1e-12)


def test_reader_reference_alibi_hand_made():
    """q = 0 and one ALiBi slope a: weight of position p is proportional to exp(a (p - L + 1))."""
    n, a = 9, 0.5
    kc, vc = legacy_caches(2, 1, 16, 8, torch.bfloat16, "cpu")
    v = torch.randn(1, n, 1, 16).bfloat16()
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    lens = torch.tensor([n], dtype=torch.int32)
    fill(kc, vc, torch.zeros_like(v), v, table, lens)
    out = ref.paged_attention(torch.zeros(1, 1, 16, dtype=torch.bfloat16), kc, vc, 1, 1.0, table, lens,
                              alibi_slopes=torch.tensor([a]))
    w = torch.exp(a * (torch.arange(n, dtype=torch.float64) - n + 1))
    want = (w[:, None] * v[0, :, 0].double()).sum(0) / w.sum()
    assert torch.allclose(out[0, 0], want, atol=1e-12)


def test_reader_reference_masks_invalid_blocks():
    kc, vc = legacy_caches(6, 1, 16, 8, torch.float16, "cpu")
    k = torch.randn(2, 24, 1, 16).half()
    v = torch.randn(2, 24, 1, 16).half()
    good = torch.tensor([[0, 1, 2], [5, 3, 4]], dtype=torch.int32)
    lens = torch.tensor([24, 24], dtype=torch.int32)
    fill(kc, vc, k, v, good, lens)
    q = torch.randn(2, 1, 16).half()
    bad = good.clone()
    bad[0, 1] = 6          # == num_blocks
    bad[1, :] = -1         # nothing visible
    out = ref.paged_attention(q, kc, vc, 1, 0.25, bad, lens)
    keep = torch.cat([torch.arange(0, 8), torch.arange(16, 24)])
    logits = 0.25 * (k[0, keep, 0].double() @ q[0, 0].double())
    want = torch.softmax(logits, 0) @ v[0, keep, 0].double()
    assert torch.allclose(out[0, 0], want, atol=1e-12)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


CPU_CASES = list(itertools.product((torch.float16, torch.bfloat16, "fp8_e4m3", "fp8_e5m2"),
                                   (8, 16, 32), (1, 4), (False, True)))


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: "-".join(map(str, c)).replace("torch.", ""))
def test_reader_reference_matches_sdpa(case):
    """The reference reader against torch SDPA on K/V gathered another way, in float64."""
    kind, bs, group, use_alibi = case
    gen = torch.Generator().manual_seed(7)
    dtype = kind if isinstance(kind, torch.dtype) else torch.bfloat16
    kv = "auto" if isinstance(kind, torch.dtype) else kind
    cache_dtype = dtype if kv == "auto" else torch.uint8
    hkv, d = 2, 32
    lens = [1, bs - 1, bs, 3 * bs + 5]
    num_blocks = sum(-(-n // bs) for n in lens) + 3
    table = shuffled_tables(lens, bs, num_blocks, max(lens) // bs + 2, gen, "cpu")
    kc, vc = legacy_caches(num_blocks, hkv, d, bs, cache_dtype, "cpu")
    k = torch.randn(len(lens), max(lens), hkv, d, generator=gen).to(dtype)
    v = torch.randn(len(lens), max(lens), hkv, d, generator=gen).to(dtype)
    ks = vs = None
    if kv != "auto":
        ks, vs = torch.tensor([0.05]), torch.tensor([0.02])
    lens_t = torch.tensor(lens, dtype=torch.int32)
    fill(kc, vc, k, v, table, lens_t, kv, ks, vs)
    q = torch.randn(len(lens), hkv * group, d, generator=gen).to(dtype)
    slopes = alibi_slopes(hkv * group, "cpu") if use_alibi else None
    scale = d ** -0.5
    out = ref.paged_attention(q, kc, vc, hkv, scale, table, lens_t, slopes, kv, ks, vs)
    for s, n in enumerate(lens):
        kg, vg = nhd_gather(kc, vc, table[s], n)
        if kv != "auto":
            kg = kg.view(FP8[kv]).double() * float(ks)      # the float32 scale the kernels see
            vg = vg.view(FP8[kv]).double() * float(vs)
        kg = kg.double().transpose(0, 1).repeat_interleave(group, 0)      # [Hq, n, D]
        vg = vg.double().transpose(0, 1).repeat_interleave(group, 0)
        bias = None
        if use_alibi:
            bias = (slopes.double()[:, None] * (torch.arange(n) - n + 1).double()[None, :])[:, None, :]
        want = F.scaled_dot_product_attention(q[s].double()[:, None, :], kg, vg, attn_mask=bias,
                                              scale=scale)[:, 0]
        assert torch.allclose(out[s], want, atol=1e-10, rtol=1e-10)


def test_reference_round_trip_writer_reader():
    """Reference writer then reference reader equals SDPA on the original tokens."""
    gen = torch.Generator().manual_seed(3)
    hkv, group, d, bs, n = 2, 3, 64, 16, 45
    kc, vc = legacy_caches(8, hkv, d, bs, torch.float16, "cpu")
    table = shuffled_tables([n], bs, 8, 4, gen, "cpu")
    key = torch.randn(n, hkv, d, generator=gen).half()
    value = torch.randn(n, hkv, d, generator=gen).half()
    pos = torch.arange(n)
    slots = table[0, pos // bs].long() * bs + pos % bs
    ref.reshape_and_cache(key, value, kc, vc, slots)
    q = torch.randn(1, hkv * group, d, generator=gen).half()
    out = ref.paged_attention(q, kc, vc, hkv, 0.125, table, torch.tensor([n], dtype=torch.int32))
    kk = key.double().transpose(0, 1).repeat_interleave(group, 0)
    vv = value.double().transpose(0, 1).repeat_interleave(group, 0)
    want = F.scaled_dot_product_attention(q[0].double()[:, None], kk, vv, scale=0.125)[:, 0]
    assert torch.allclose(out[0], want, atol=1e-12)


# ================================================================ the v1/v2 rule and the contract (CPU)
def test_use_v1_rule():
    assert legacy.use_v1(1, 32, 512)               # one partition
    assert not legacy.use_v1(1, 32, 513)           # 2 partitions, 32 CTAs: v2 adds parallelism
    assert legacy.use_v1(17, 32, 4096)             # 544 CTAs > 512
    assert not legacy.use_v1(16, 32, 4096)         # exactly 512 is not more than 512
    assert legacy.use_v1(64, 32, 8192)
    assert not legacy.use_v1(64, 32, 8193)         # past 8192 always v2
    assert legacy.use_v1(3, 8, 0)
    assert legacy.num_partitions(0) == 1 and legacy.num_partitions(1025) == 3


def test_cache_spec_legacy_layout():
    spec = CacheSpec(5, 16, 4, 128, torch.bfloat16, layout="legacy")
    kc, vc = spec.allocate("cpu", fill=float("nan"))
    assert kc.shape == (5, 4, 16, 16, 8) and vc.shape == (5, 4, 128, 16)
    assert CacheSpec.from_legacy_tensors(kc, vc) == spec
    spec.check_tensors(kc, vc)
    fp8 = CacheSpec(5, 8, 2, 80, torch.uint8, "fp8_e4m3", layout="legacy")
    kc8, vc8 = fp8.allocate("cpu", fill=0)
    assert kc8.shape == (5, 2, 5, 8, 16) and (kc8 == 0x7F).all()
    assert CacheSpec.from_legacy_tensors(kc8, vc8, kv_cache_dtype="fp8") == fp8
    f8 = torch.empty(5, 2, 5, 8, 16, dtype=torch.float8_e5m2), torch.empty(5, 2, 80, 8, dtype=torch.float8_e5m2)
    assert CacheSpec.from_legacy_tensors(*f8).kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(ContractError, match="multiple"):
        CacheSpec(5, 16, 4, 84, torch.float16, layout="legacy")
    with pytest.raises(ContractError, match="per-tensor"):
        CacheSpec(5, 16, 4, 128, torch.uint8, "fp8_e4m3", layout="legacy", scale="head")
    with pytest.raises(ContractError, match="legacy"):
        spec.strides()


def test_flash_and_legacy_refuse_each_others_caches():
    legacy_k, legacy_v = CacheSpec(4, 16, 2, 64, torch.float16, layout="legacy").allocate("cpu")
    nhd_k, nhd_v = CacheSpec(4, 16, 2, 64, torch.float16, layout="NHD").allocate("cpu")
    key = torch.randn(3, 2, 64, dtype=torch.float16)
    slots = torch.arange(3)
    with pytest.raises(ContractError, match="legacy layout"):
        CacheSpec.from_tensors(legacy_k, legacy_v)
    with pytest.raises(ContractError, match="legacy layout"):
        pagedattn.reshape_and_cache_flash(key, key, legacy_k, legacy_v, slots)
    with pytest.raises(ContractError, match="NHD/HND"):
        CacheSpec.from_legacy_tensors(nhd_k, nhd_v)
    with pytest.raises(ContractError, match="NHD/HND"):
        legacy.reshape_and_cache(key, key, nhd_k, nhd_v, slots)
    q = torch.randn(1, 2, 64, dtype=torch.float16)
    with pytest.raises(ContractError, match="NHD/HND"):
        legacy.paged_attention_v1(torch.empty_like(q), q, nhd_k, nhd_v, 2, 0.1,
                                  torch.zeros(1, 1, dtype=torch.int32),
                                  torch.ones(1, dtype=torch.int32), 16, 1)
    nhd_spec = CacheSpec(4, 16, 2, 64, torch.float16)
    with pytest.raises(ContractError, match="not on a 'NHD' cache"):
        nhd_spec.require_layout(("legacy",), "reshape_and_cache")
    # a legacy CacheSpec routes .write to the legacy writer (which needs CUDA)
    spec = CacheSpec(4, 16, 2, 64, torch.float16, layout="legacy")
    with pytest.raises(ContractError, match="CUDA"):
        spec.write(key, key, legacy_k, legacy_v, slots)
    with pytest.raises(ContractError, match="legacy"):
        spec.check_tensors(nhd_k, nhd_v)


def test_registry_variant_space():
    attn = list(LegacyAttentionSpec.all_variants())
    assert len(attn) == 2 * 3 * len(HEAD_SIZES) * len(BLOCK_SIZES) == 126
    assert len(list(LegacyReduceSpec.all_variants())) == 14
    assert len(list(LegacyCacheWriteSpec.all_variants())) == 6
    assert variant_name(LegacyAttentionSpec("bf16", "fp8_e4m3", 128, 16)) == "legacy_attn_bf16_fp8e4m3_d128_bs16"
    assert variant_name(LegacyReduceSpec("fp16", 80)) == "legacy_reduce_fp16_d80"
    with pytest.raises(UnsupportedError, match="head_size"):
        LegacyAttentionSpec("fp16", "auto", 72, 16)
    with pytest.raises(UnsupportedError, match="block_size"):
        LegacyAttentionSpec("fp16", "auto", 128, 64)
    src = get_kernel(LegacyAttentionSpec("fp16", "auto", 128, 16)).source
    assert "legacy_attn_fp16_auto_d128_bs16(" in src and "static_assert(sizeof(Params)" in src
    assert len(src.splitlines()) < 25     # the template is thin: types, constants, one instantiation


# ================================================================ validation before launch (CPU tensors)
def _valid_call(device="cpu", kv="auto"):
    """A valid v2 call's arguments (dict). On CPU the call passes validation and stops at the
    'CUDA tensors' check; on a GPU it runs."""
    hkv, group, d, bs, n_seq = 2, 2, 64, 16, 3
    dtype = torch.float16
    cache_dtype = dtype if kv == "auto" else torch.uint8
    kc, vc = legacy_caches(12, hkv, d, bs, cache_dtype, device)
    for cache in (kc, vc):
        cache.copy_(to_cache(torch.randn(cache.shape, device=device), cache_dtype, kv,
                             torch.tensor([0.1], device=device)))
    q = torch.randn(n_seq, hkv * group, d, dtype=dtype, device=device)
    max_seq_len = 100
    es, ml, tmp = legacy.allocate_partials(q, max_seq_len)
    args = dict(out=poison(torch.empty_like(q)), exp_sums=es, max_logits=ml, tmp_out=tmp, query=q,
                key_cache=kc, value_cache=vc, num_kv_heads=hkv, scale=d ** -0.5,
                block_tables=torch.arange(n_seq * 7, device=device, dtype=torch.int32).remainder(12)
                .reshape(n_seq, 7),
                seq_lens=torch.tensor([100, 3, 50], dtype=torch.int32, device=device), block_size=bs,
                max_seq_len=max_seq_len, alibi_slopes=None, kv_cache_dtype=kv, k_scale=None, v_scale=None)
    if kv != "auto":
        args["k_scale"] = torch.tensor([0.1], device=device)
        args["v_scale"] = torch.tensor([0.1], device=device)
    return args


def _v1_args(args):
    return {k: v for k, v in args.items() if k not in ("exp_sums", "max_logits", "tmp_out")}


def _bad_calls(device):
    f32 = dict(dtype=torch.float32, device=device)
    return {
        "query int dtype": (dict(query=lambda a: a["query"].int()), "query"),
        "query 2-D": (dict(query=lambda a: a["query"][0]), "3-D"),
        "out dtype differs": (dict(out=lambda a: a["out"].bfloat16()), "must match query"),
        "query head dim strided": (dict(query=lambda a: torch.randn(3, 4, 128, dtype=torch.float16,
                                                                    device=device)[:, :, ::2]), "contiguous"),
        "head size mismatch": (dict(query=lambda a: torch.randn(3, 4, 128, dtype=torch.float16, device=device),
                                    out=lambda a: torch.randn(3, 4, 128, dtype=torch.float16, device=device)),
                               "head_size"),
        "num_kv_heads wrong": (dict(num_kv_heads=lambda a: 4), "KV heads"),
        "num_heads not multiple": (dict(query=lambda a: torch.randn(3, 3, 64, dtype=torch.float16, device=device),
                                        out=lambda a: torch.randn(3, 3, 64, dtype=torch.float16, device=device)),
                                   "multiple"),
        "cache dtype differs from query": (dict(query=lambda a: a["query"].bfloat16(),
                                                out=lambda a: a["out"].bfloat16()), "cache dtype"),
        "block_size mismatch": (dict(block_size=lambda a: 32), "block_size"),
        "block_size a tensor": (dict(block_size=lambda a: torch.tensor([16, 16])), "block_size"),  # was a RuntimeError
        "block_tables int64": (dict(block_tables=lambda a: a["block_tables"].long()), "block_tables"),
        "block_tables rows wrong": (dict(block_tables=lambda a: a["block_tables"][:2]), "block_tables"),
        "block_tables column-major": (dict(block_tables=lambda a: a["block_tables"].t().contiguous().t()),
                                      "contiguous rows"),
        "seq_lens int64": (dict(seq_lens=lambda a: a["seq_lens"].long()), "seq_lens"),
        "seq_lens wrong length": (dict(seq_lens=lambda a: a["seq_lens"][:2]), "seq_lens"),
        "seq_lens on another device": (dict(seq_lens=lambda a: a["seq_lens"].to("meta")), "seq_lens"),
        "max_seq_len negative": (dict(max_seq_len=lambda a: -1), "max_seq_len"),
        "max_seq_len float": (dict(max_seq_len=lambda a: 100.0), "max_seq_len"),
        "max_seq_len beyond table": (dict(max_seq_len=lambda a: 7 * 16 + 1), "block_tables can map"),
        "scale nan": (dict(scale=lambda a: float("nan")), "scale"),
        "alibi float16": (dict(alibi_slopes=lambda a: torch.ones(4, dtype=torch.float16, device=device)),
                          "alibi_slopes"),
        "alibi wrong length": (dict(alibi_slopes=lambda a: torch.ones(3, **f32)), "alibi_slopes"),
        "K/V caches differ": (dict(value_cache=lambda a: a["value_cache"][:, :1]), "value_cache"),
        "key cache x wrong": (dict(key_cache=lambda a: a["key_cache"].reshape(12, 2, 4, 16, 16)), "x ="),
        "key cache not dense": (dict(key_cache=lambda a: torch.empty(12, 2, 8, 32, 8, dtype=torch.float16,
                                                                     device=device)[:, :, :, :16]), "dense"),
        "fp8 name with fp16 cache": (dict(kv_cache_dtype=lambda a: "fp8_e4m3"), "kv_cache_dtype"),
        "unknown kv_cache_dtype": (dict(kv_cache_dtype=lambda a: "int4"), "kv_cache_dtype", ValueError),
        "exp_sums too few partitions": (dict(exp_sums=lambda a: a["exp_sums"][:, :, :0]), "exp_sums"),
        "max_logits float16": (dict(max_logits=lambda a: a["max_logits"].half()), "max_logits"),
        "tmp_out dtype": (dict(tmp_out=lambda a: a["tmp_out"].float()), "tmp_out"),
        "tmp_out shape": (dict(tmp_out=lambda a: a["tmp_out"][:, :, :, :32]), "tmp_out"),
        "exp_sums/max_logits shapes differ": (dict(max_logits=lambda a: torch.empty(3, 4, 2, **f32)),
                                              "differ in shape"),
    }


def _apply(args, changes):
    args = dict(args)
    for key, fn in changes.items():
        args[key] = fn(args)
    return args


@pytest.mark.parametrize("name", sorted(_bad_calls("cpu")))
def test_bad_calls_raise_contract_error(name):
    changes, match, *exc = _bad_calls("cpu")[name]
    exc = exc[0] if exc else ContractError
    args = _apply(_valid_call(), changes)
    with pytest.raises(exc, match=match):
        legacy.paged_attention_v2(**args)
    if not any(k in changes for k in ("exp_sums", "max_logits", "tmp_out")):
        with pytest.raises(exc, match=match):
            legacy.paged_attention_v1(**_v1_args(args))


def test_valid_call_passes_validation_on_cpu():
    """The baseline of the bad-call table: the valid call gets as far as the device check."""
    for kv in ("auto", "fp8_e5m2"):
        args = _valid_call(kv=kv)
        with pytest.raises(ContractError, match="CUDA tensors"):
            legacy.paged_attention_v2(**args)
        with pytest.raises(ContractError, match="CUDA tensors"):
            legacy.paged_attention_v1(**_v1_args(args))
        with pytest.raises(ContractError, match="CUDA tensors"):
            legacy.paged_attention(**_v1_args(args))


def test_fp8_scales_validated():
    args = _valid_call(kv="fp8_e4m3")
    for changes, match in ((dict(k_scale=None), "needs k_scale"),
                           (dict(v_scale=torch.ones(2)), "one element"),
                           (dict(k_scale=torch.ones(1, dtype=torch.float64)), "float32")):
        with pytest.raises(ContractError, match=match):
            legacy.paged_attention_v1(**{**_v1_args(args), **changes})


def test_fp8_scale_values_checked_with_validate():
    """validate=True (syncs): NaN / inf / non-positive scales are named; without it they pass."""
    args = _v1_args(_valid_call(kv="fp8_e4m3"))
    bad = {**args, "v_scale": torch.tensor(float("nan"))}  # 0-d: one scale
    with pytest.raises(ContractError, match="CUDA tensors"):
        legacy.paged_attention_v1(**bad)
    with pytest.raises(ContractError, match=r"v_scale = nan: fp8 scales must be finite and > 0"):
        legacy.paged_attention_v1(**bad, validate=True)
    kc8, vc8 = legacy_caches(4, 2, 64, 16, torch.uint8, "cpu")
    key = torch.randn(5, 2, 64, dtype=torch.float16)
    with pytest.raises(ContractError, match=r"k_scale\[0\] = 0.0"):
        legacy.reshape_and_cache(key, key, kc8, vc8, torch.arange(5), "fp8_e4m3", torch.zeros(1), torch.ones(1),
                                 validate=True)


def test_unsupported_head_size_raises():
    spec = CacheSpec(4, 16, 1, 48, torch.float16, layout="legacy")
    kc, vc = spec.allocate("cpu")
    q = torch.randn(1, 1, 48, dtype=torch.float16)
    with pytest.raises(UnsupportedError, match="head_size"):
        legacy.paged_attention_v1(torch.empty_like(q), q, kc, vc, 1, 0.1, torch.zeros(1, 1, dtype=torch.int32),
                                  torch.ones(1, dtype=torch.int32), 16, 1)


def test_writer_validation():
    kc, vc = legacy_caches(4, 2, 64, 16, torch.float16, "cpu")
    key = torch.randn(5, 2, 64, dtype=torch.float16)
    slots = torch.arange(5)
    cases = [
        (dict(key=key.float(), value=key.float()), "not supported"),
        (dict(key=torch.randn(5, 3, 64, dtype=torch.float16)), r"\[T, 2, 64\]"),
        (dict(slot_mapping=slots.float()), "slot_mapping"),
        (dict(slot_mapping=torch.arange(6)), "only 5"),
        (dict(kv_cache_dtype="fp8_e4m3"), "kv_cache_dtype"),
        (dict(key=key.bfloat16(), value=key.bfloat16()), "input dtype"),
    ]
    for changes, match in cases:
        args = dict(key=key, value=key, key_cache=kc, value_cache=vc, slot_mapping=slots)
        args.update(changes)
        with pytest.raises(ContractError, match=match):
            legacy.reshape_and_cache(**args)
    kc8, vc8 = legacy_caches(4, 2, 64, 16, torch.uint8, "cpu")
    with pytest.raises(ContractError, match="needs k_scale"):
        legacy.reshape_and_cache(key, key, kc8, vc8, slots, "fp8_e4m3")
    with pytest.raises(ContractError, match="CUDA"):
        legacy.reshape_and_cache(key, key, kc, vc, slots)
    with pytest.raises(ContractError, match="CUDA tensors; key_cache is on cpu"):  # even with no token
        legacy.reshape_and_cache(key, key, kc, vc, slots[:0])


# ================================================================ variants compile (CPU)
# Every head size, block size, cache dtype and input dtype appears at least once.
COMPILE_SUBSET = [
    LegacyAttentionSpec("fp16", "auto", 64, 8),
    LegacyAttentionSpec("bf16", "auto", 80, 16),
    LegacyAttentionSpec("fp16", "fp8_e4m3", 96, 32),
    LegacyAttentionSpec("bf16", "fp8_e5m2", 112, 8),
    LegacyAttentionSpec("bf16", "auto", 128, 16),
    LegacyAttentionSpec("fp16", "fp8_e4m3", 192, 16),
    LegacyAttentionSpec("bf16", "fp8_e5m2", 256, 32),
    LegacyReduceSpec("fp16", 80),
    LegacyReduceSpec("bf16", 256),
    *LegacyCacheWriteSpec.all_variants(),
]


def _compile(spec_arch):
    """Worker: compile one (spec, arch) into the shared disk cache; returns an error text or None."""
    spec, arch = spec_arch
    try:
        get_kernel(spec).artifact(arch)
        return None
    except Exception as exc:  # noqa: BLE001 - reported by the caller with the variant's name
        return f"{variant_name(spec)} ({arch}): {exc}"


def precompile(specs, archs, workers=None) -> list[str]:
    """Compile in parallel worker processes (NVRTC serialises compiles inside one process) into
    PAGEDATTN_CACHE_DIR; later get_kernel() calls in this process find them on disk."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(s, a) for s in specs for a in archs]
    cpus = len(os.sched_getaffinity(0))
    workers = max(1, min(workers or cpus, cpus, len(jobs)))
    if workers == 1:
        return [e for e in map(_compile, jobs) if e]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return [e for e in pool.map(_compile, jobs) if e]


@pytest.mark.compiles
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("spec", COMPILE_SUBSET, ids=variant_name)
def test_variant_subset_compiles(spec, arch):
    art = get_kernel(spec).artifact(arch)
    assert art.cubin[:4] == b"\x7fELF"


@pytest.mark.slow
def test_every_variant_compiles():
    """All 146 variants x {sm_80, sm_90a}, over every CPU (about 2 min on 2 cores)."""
    specs = [*LegacyAttentionSpec.all_variants(), *LegacyReduceSpec.all_variants(),
             *LegacyCacheWriteSpec.all_variants()]
    errors = precompile(specs, ["sm_80", "sm_90a"])
    assert not errors, "\n".join(errors)


# ================================================================ the kernels (GPU)
def _attn_case_id(c):
    dtype, kv, storage, d, bs, group, alibi = c
    return (f"{SHORT[dtype]}-{kv}{'' if kv == 'auto' else '-' + str(storage)[6:]}-d{d}-bs{bs}-g{group}"
            f"{'-alibi' if alibi else ''}")


def _grid():
    cases = []
    # every (dtype, head size, block size) with a plain cache; GQA and ALiBi rotate through
    for i, (dtype, d, bs) in enumerate(itertools.product((torch.float16, torch.bfloat16), HEAD_SIZES,
                                                         BLOCK_SIZES)):
        cases.append((dtype, "auto", dtype, d, bs, (1, 4, 8)[i % 3], i % 2 == 1))
    # fp8: every head size at block 16, every block size at head 128, uint8 and float8 storage
    for i, (dtype, kv) in enumerate(itertools.product((torch.float16, torch.bfloat16), FP8)):
        shapes = [(d, 16) for d in HEAD_SIZES] + [(128, 8), (128, 32)]
        for j, (d, bs) in enumerate(shapes):
            storage = torch.uint8 if (i + j) % 2 == 0 else FP8[kv]
            cases.append((dtype, kv, storage, d, bs, (1, 4, 8)[j % 3], (i + j) % 2 == 0))
    return cases


GRID = _grid()
LONG_CASES = [
    (torch.float16, "auto", torch.float16, 128, 16, 4, False),
    (torch.bfloat16, "auto", torch.bfloat16, 128, 32, 1, True),
    (torch.bfloat16, "fp8_e4m3", torch.uint8, 256, 8, 8, False),
    (torch.float16, "fp8_e5m2", torch.float8_e5m2, 80, 16, 2, True),
]
GRID_LENS = [1, 17, 511, 512, 513, 1030]
LONG_LENS = [511, 512, 513, 8192, 8193]


def _gpu_specs():
    specs = set()
    for dtype, kv, _, d, bs, _, _ in GRID + LONG_CASES:
        specs.add(LegacyAttentionSpec(SHORT[dtype], kv, d, bs))
        specs.add(LegacyReduceSpec(SHORT[dtype], d))
    specs.update(LegacyCacheWriteSpec.all_variants())
    specs.add(LegacyAttentionSpec("fp16", "auto", 64, 16))
    specs.add(LegacyReduceSpec("fp16", 64))
    return sorted(specs, key=variant_name)


@pytest.fixture(scope="module")
def gpu_kernels():
    """Compile every variant the GPU tests use, in parallel, before the first test needs one."""
    from pagedattn.registry import arch_for_device

    errors = precompile(_gpu_specs(), [arch_for_device(0)], workers=16)
    assert not errors, "\n".join(errors)


class Problem:
    """A decode batch over a NaN-poisoned legacy cache (with NaN guard blocks), a shuffled table,
    and its float64 reference output."""

    def __init__(self, dtype, kv, storage, d, bs, group, use_alibi, lens, seed=0, hkv=2, guard=2):
        gen = torch.Generator().manual_seed(seed)
        self.dtype, self.kv, self.bs, self.hkv = dtype, kv, bs, hkv
        self.lens = lens
        self.max_seq_len = max(lens)
        num_blocks = sum(-(-n // bs) for n in lens) + 5
        width = -(-self.max_seq_len // bs) + 3
        self.table = shuffled_tables(lens, bs, num_blocks, width, gen, "cuda")
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        cache_dtype = dtype if kv == "auto" else storage
        self.key_cache, self.value_cache = legacy_caches(num_blocks, hkv, d, bs, cache_dtype, "cuda", guard)
        k = torch.randn(len(lens), self.max_seq_len, hkv, d, generator=gen).to(dtype).cuda()
        v = torch.randn(len(lens), self.max_seq_len, hkv, d, generator=gen).to(dtype).cuda()
        self.k_scale = self.v_scale = None
        if kv != "auto":
            self.k_scale = torch.tensor([0.04], device="cuda")
            self.v_scale = torch.tensor([0.03], device="cuda")
        fill(self.key_cache, self.value_cache, k, v, self.table, self.seq_lens, kv, self.k_scale,
             self.v_scale)
        self.query = torch.randn(len(lens), hkv * group, d, generator=gen).to(dtype).cuda()
        self.alibi = alibi_slopes(hkv * group, "cuda") if use_alibi else None
        self.scale = d ** -0.5
        self.want = self.reference()

    def reference(self, **kw):
        return ref.paged_attention(self.query, self.key_cache, self.value_cache, self.hkv, self.scale,
                                   kw.get("table", self.table), kw.get("seq_lens", self.seq_lens),
                                   self.alibi, self.kv, self.k_scale, self.v_scale,
                                   max_tokens=kw.get("max_tokens"))

    def args(self, **kw):
        a = dict(query=self.query, key_cache=self.key_cache, value_cache=self.value_cache,
                 num_kv_heads=self.hkv, scale=self.scale, block_tables=self.table,
                 seq_lens=self.seq_lens, block_size=self.bs, max_seq_len=self.max_seq_len,
                 alibi_slopes=self.alibi, kv_cache_dtype=self.kv, k_scale=self.k_scale,
                 v_scale=self.v_scale)
        a.update(kw)
        return a

    def v1(self, **kw):
        out = poison(torch.empty_like(self.query))
        legacy.paged_attention_v1(out, **self.args(**kw))
        return out

    def v2(self, **kw):
        out = poison(torch.empty_like(self.query))
        scratch = [poison(t) for t in legacy.allocate_partials(self.query, kw.get("max_seq_len",
                                                                               self.max_seq_len))]
        legacy.paged_attention_v2(out, *scratch, **self.args(**kw))
        return out

    def check(self, out, what, want=None):
        want = self.want if want is None else want
        tol = TOL[self.dtype]
        assert not out.isnan().any(), f"{what}: NaN in the output"
        for s, n in enumerate(self.lens):
            err = rel_l2(out[s], want[s])
            assert err <= tol, f"{what}: sequence {s} (len {n}) relative L2 error {err:.2e} > {tol:.0e}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", GRID, ids=_attn_case_id)
def test_v1_v2_match_reference(case, gpu_kernels):
    p = Problem(*case, lens=GRID_LENS, seed=zlib.crc32(_attn_case_id(case).encode()))
    o1, o2 = p.v1(), p.v2()
    p.check(o1, "v1")
    p.check(o2, "v2")
    # one partition: v2's merge weight is exactly 1, so v2 equals v1 bit for bit
    short = [s for s, n in enumerate(GRID_LENS) if n <= PARTITION_SIZE]
    assert torch.equal(bits(o1[short]), bits(o2[short]))
    assert rel_l2(o2, o1) <= TOL[p.dtype]
    # bit-identical reruns
    assert torch.equal(bits(p.v1()), bits(o1)) and torch.equal(bits(p.v2()), bits(o2))
    # auto picks by the rule and gives that kernel's output
    out = poison(torch.empty_like(p.query))
    chose = legacy.paged_attention(out, **p.args())
    assert chose == ("v1" if legacy.use_v1(len(GRID_LENS), p.query.shape[1], p.max_seq_len) else "v2")
    assert torch.equal(bits(out), bits(o1 if chose == "v1" else o2))


@pytest.mark.gpu
@pytest.mark.parametrize("case", LONG_CASES, ids=_attn_case_id)
def test_partition_boundaries(case, gpu_kernels):
    p = Problem(*case, lens=LONG_LENS, seed=11)
    o1, o2 = p.v1(), p.v2()
    p.check(o1, "v1")
    p.check(o2, "v2")
    assert rel_l2(o2, o1) <= TOL[p.dtype]
    assert torch.equal(bits(o1[:2]), bits(o2[:2]))       # 511 and 512: one partition
    out = poison(torch.empty_like(p.query))
    assert legacy.paged_attention(out, **p.args()) == "v2"  # max_seq_len 8193 > 8192
    assert torch.equal(bits(out), bits(o2))


@pytest.mark.gpu
def test_scratch_larger_than_needed_and_strided_tensors(gpu_kernels):
    """tmp_out with more partitions than the launch; query as a slice of a fused QKV; out strided."""
    p = Problem(torch.bfloat16, "auto", torch.bfloat16, 64, 16, 2, False, lens=[700, 3, 1500], seed=5)
    s, h, d = p.query.shape
    qkv = torch.randn(s, 3 * h, d, dtype=p.dtype, device="cuda")
    qkv[:, :h] = p.query
    q = qkv[:, :h]
    big_out = poison(torch.empty(s, 2 * h, d, dtype=p.dtype, device="cuda"))
    out = big_out[:, h:]
    legacy.paged_attention_v1(out, **p.args(query=q))
    p.check(out, "v1 strided")
    assert big_out[:, :h].isnan().all()
    es, ml, tmp = (poison(t) for t in legacy.allocate_partials(p.query, 4 * p.max_seq_len))
    out2 = poison(torch.empty_like(p.query))
    legacy.paged_attention_v2(out2, es, ml, tmp, **p.args(query=q))
    p.check(out2, "v2 with oversized scratch")
    assert tmp[:, :, legacy.num_partitions(p.max_seq_len):].isnan().all()   # never written
    # partial states as documented: max_logits in natural-log units, exp_sums >= 1
    parts = legacy.num_partitions(1500)
    assert torch.all(es[2, :, :parts] >= 1.0) and torch.isfinite(ml[2, :, :parts]).all()
    assert es[1, :, 1:].isnan().all()                    # sequence of 3 tokens: one partition written


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_corrupt_tables_and_lengths_are_safe(dtype, gpu_kernels):
    """Out-of-range block ids are skipped (never read: the NaN guard blocks around the cache would
    show), seq_lens past the table are clamped, negative seq_lens give zeros; validate=True names
    the problem instead."""
    p = Problem(dtype, "auto", dtype, 128, 16, 4, True, lens=[600, 40, 1030, 16], seed=9)
    n = p.key_cache.shape[0]
    table = p.table.clone()
    table[0, 3] = n                 # one past the end: the guard block
    table[0, 5] = -1                # the guard block before the cache
    table[2, 10] = 2**31 - 1
    table[2, 11] = -2**31
    table[3, 0] = n + 1             # every token of sequence 3 invalid: output 0
    lens = p.seq_lens.clone()
    lens[1] = -7                    # negative: output 0
    want = p.reference(table=table, seq_lens=lens)
    o1 = p.v1(block_tables=table, seq_lens=lens)
    o2 = p.v2(block_tables=table, seq_lens=lens)
    for o, what in ((o1, "v1"), (o2, "v2")):
        p.check(o, what, want)
        assert torch.equal(o[1], torch.zeros_like(o[1])) and torch.equal(o[3], torch.zeros_like(o[3]))
    with pytest.raises(ContractError, match=r"block_tables\[0, 3\]"):
        legacy.paged_attention_v1(torch.empty_like(p.query), **p.args(block_tables=table), validate=True)
    with pytest.raises(ContractError, match=r"seq_lens\[1\]"):
        legacy.paged_attention_v2(torch.empty_like(p.query), *legacy.allocate_partials(p.query, 1030),
                                  **p.args(seq_lens=lens), validate=True)
    # seq_len beyond the table: clamped, never read (v2: past max_seq_len's partitions too, the last
    # partition takes the rest).
    # (No ALiBi here: slope * (pos - 10**6) in float32 is not comparable with float64.)
    p = Problem(dtype, "auto", dtype, 128, 16, 4, False, lens=[600, 40, 1024, 16], seed=10)
    table = p.table.clone()
    need = 1024 // p.bs                                  # sequence 2 fills its last block
    table[2, need:] = table[2, :table.shape[1] - need]   # the row's tail maps real tokens
    long = p.seq_lens.clone()
    long[2] = 10**6
    cap1 = table.shape[1] * p.bs
    o1 = p.v1(seq_lens=long, block_tables=table)
    p.check(o1, "v1 clamped", p.reference(seq_lens=long, table=table, max_tokens=cap1))
    o2 = p.v2(seq_lens=long, block_tables=table)
    p.check(o2, "v2 clamped", p.reference(seq_lens=long, table=table, max_tokens=cap1))
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_plan_reuse_refreshes_pointers(gpu_kernels):
    """A second call with the same metadata (new tensors, same shapes) reuses the first call's plan;
    its pointers must be the new ones."""
    first = Problem(torch.float16, "fp8_e5m2", torch.uint8, 96, 32, 4, True, lens=[900, 30], seed=21)
    second = Problem(torch.float16, "fp8_e5m2", torch.uint8, 96, 32, 4, True, lens=[900, 30], seed=22)
    for p in (first, second, first):
        p.check(p.v1(), "v1")
        p.check(p.v2(), "v2")
        out = poison(torch.empty_like(p.query))
        legacy.paged_attention(out, **p.args())
        p.check(out, "auto")


@pytest.mark.gpu
def test_empty_batch_and_zero_max_seq_len(gpu_kernels):
    p = Problem(torch.float16, "auto", torch.float16, 64, 16, 1, False, lens=[5, 9], seed=1)
    empty = p.query[:0]
    legacy.paged_attention_v1(empty.clone(), **p.args(query=empty, block_tables=p.table[:0],
                                                      seq_lens=p.seq_lens[:0]))
    zeros = torch.zeros_like(p.seq_lens)
    o1 = p.v1(seq_lens=zeros, max_seq_len=0)
    o2 = p.v2(seq_lens=zeros, max_seq_len=0)
    assert torch.equal(o1, torch.zeros_like(o1)) and torch.equal(o2, torch.zeros_like(o2))


WRITE_CASES = [
    (dtype, kv, storage, d, bs, slot_dtype, aligned)
    for (dtype, (kv, storage), d, bs), slot_dtype, aligned in zip(
        itertools.product((torch.float16, torch.bfloat16),
                          (("auto", None), ("fp8_e4m3", torch.uint8), ("fp8_e5m2", torch.float8_e5m2),
                           ("fp8_e4m3", torch.float8_e4m3fn)),
                          (64, 80, 128, 256), BLOCK_SIZES),
        itertools.cycle((torch.int64, torch.int32)), itertools.cycle((True, True, False)))
]


def _write_id(c):
    dtype, kv, storage, d, bs, slot_dtype, aligned = c
    return (f"{SHORT[dtype]}-{kv}{'-' + str(storage)[6:] if storage is not None else ''}-d{d}-bs{bs}-"
            f"{str(slot_dtype)[6:]}{'' if aligned else '-unaligned'}")


@pytest.mark.gpu
@pytest.mark.parametrize("case", WRITE_CASES, ids=_write_id)
def test_writer_matches_reference_bitwise(case, gpu_kernels):
    dtype, kv, storage, d, bs, slot_dtype, aligned = case
    gen = torch.Generator().manual_seed(zlib.crc32(_write_id(case).encode()))
    h, t = 4, 37
    num_blocks = -(-2 * t // bs) + 1
    cache_dtype = dtype if kv == "auto" else storage
    kc, vc = legacy_caches(num_blocks, h, d, bs, cache_dtype, "cuda")
    rk, rv = kc.clone(), vc.clone()
    if aligned:
        key = torch.randn(t + 3, h, d, generator=gen).to(dtype).cuda()
        value = torch.randn(t + 3, h, d, generator=gen).to(dtype).cuda()
    else:   # rows not 16-byte aligned: the scalar path
        flat = torch.randn(2 * (t + 3) * h * d + 2, generator=gen).to(dtype).cuda()
        key = flat[1:1 + (t + 3) * h * d].view(t + 3, h, d)
        value = flat[(t + 3) * h * d + 1:2 * (t + 3) * h * d + 1].view(t + 3, h, d)
    key[:, :, 0] *= 500     # beyond the fp8 range: saturation
    slots = torch.randperm(num_blocks * bs, generator=gen)[:t]
    slots[::5] = -1                          # padding
    slots[3] = num_blocks * bs               # corrupt: skipped, never written
    slots = slots.to(slot_dtype).cuda()
    ks = vs = None
    if kv != "auto":
        ks = torch.tensor([0.5], device="cuda")
        vs = torch.tensor([0.25], device="cuda")
    legacy.reshape_and_cache(key, value, kc, vc, slots, kv, ks, vs)
    ref.reshape_and_cache(key, value, rk, rv, slots.cpu(), kv, ks, vs)
    torch.cuda.synchronize()
    assert torch.equal(bits(kc), bits(rk)) and torch.equal(bits(vc), bits(rv))
    with pytest.raises(ContractError, match=r"slot_mapping\[3\]"):
        legacy.reshape_and_cache(key, value, kc, vc, slots, kv, ks, vs, validate=True)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_writer_then_reader_round_trip(kv, gpu_kernels):
    """Our writer fills the cache, our v1/v2 read it; the reference reads the same cache. For a
    plain cache the reference equals attention over the original tokens."""
    dtype, hkv, group, d, bs = torch.bfloat16, 2, 4, 128, 16
    lens = [300, 1025, 1]
    gen = torch.Generator().manual_seed(4)
    num_blocks = sum(-(-n // bs) for n in lens) + 4
    table = shuffled_tables(lens, bs, num_blocks, -(-max(lens) // bs), gen, "cuda")
    spec = CacheSpec(num_blocks, bs, hkv, d, dtype if kv == "auto" else torch.uint8, kv, layout="legacy")
    kc, vc = spec.allocate("cuda", fill=float("nan"))
    ks = vs = None
    if kv != "auto":
        ks, vs = torch.tensor([0.02], device="cuda"), torch.tensor([0.03], device="cuda")
    keys, values = [], []
    for s, n in enumerate(lens):
        key = torch.randn(n, hkv, d, generator=gen).to(dtype).cuda()
        value = torch.randn(n, hkv, d, generator=gen).to(dtype).cuda()
        pos = torch.arange(n, device="cuda")
        slots = table[s, pos // bs].long() * bs + pos % bs
        spec.write(key, value, kc, vc, slots, ks, vs)       # the contract routes to the legacy writer
        keys.append(key)
        values.append(value)
    q = torch.randn(len(lens), hkv * group, d, generator=gen).to(dtype).cuda()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    want = ref.paged_attention(q, kc, vc, hkv, d ** -0.5, table, seq_lens, None, kv, ks, vs)
    if kv == "auto":
        for s in range(len(lens)):
            kk = keys[s].double().transpose(0, 1).repeat_interleave(group, 0)
            vv = values[s].double().transpose(0, 1).repeat_interleave(group, 0)
            sdpa = F.scaled_dot_product_attention(q[s].double()[:, None], kk, vv, scale=d ** -0.5)[:, 0]
            assert torch.allclose(want[s], sdpa, atol=1e-10)
    for version in ("v1", "v2"):
        out = poison(torch.empty_like(q))
        args = (q, kc, vc, hkv, d ** -0.5, table, seq_lens, bs, max(lens), None, kv, ks, vs)
        if version == "v1":
            legacy.paged_attention_v1(out, *args)
        else:
            legacy.paged_attention_v2(out, *legacy.allocate_partials(q, max(lens)), *args)
        for s in range(len(lens)):
            assert rel_l2(out[s], want[s]) <= TOL[dtype], f"{version} sequence {s}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(_bad_calls("cuda")))
def test_bad_calls_raise_before_launch(name, gpu_kernels):
    changes, match, *exc = _bad_calls("cuda")[name]
    args = _apply(_valid_call("cuda"), changes)
    out = args["out"]
    if out.is_floating_point():
        poison(out)
    with pytest.raises(exc[0] if exc else ContractError, match=match):
        legacy.paged_attention_v2(**args)
    torch.cuda.synchronize()
    if out.is_floating_point():
        assert out.isnan().all(), "a kernel ran before the error"
    # the valid call itself runs, fills every output and agrees with the reference
    good = _valid_call("cuda")
    legacy.paged_attention_v2(**good)
    want = ref.paged_attention(good["query"], good["key_cache"], good["value_cache"], good["num_kv_heads"],
                               good["scale"], good["block_tables"], good["seq_lens"])
    assert rel_l2(good["out"], want) <= TOL[torch.float16]


@pytest.mark.gpu
def test_debug_env_checks_tables(monkeypatch, gpu_kernels):
    monkeypatch.setenv("PAGEDATTN_DEBUG", "1")
    p = Problem(torch.float16, "auto", torch.float16, 64, 16, 1, False, lens=[20, 40], seed=2)
    table = p.table.clone()
    table[1, 2] = p.key_cache.shape[0]
    out = poison(torch.empty_like(p.query))
    with pytest.raises(ContractError, match=r"block_tables\[1, 2\]"):
        legacy.paged_attention_v1(out, **p.args(block_tables=table))
    assert out.isnan().all()


def test_reference_softmax_merge_identity():
    """The identity legacy_reduce.cuh / softmax_merge.cuh implement, checked in float64: merging the
    partitions' (max, exp-sum, normalised output) gives the unpartitioned softmax output."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1537, generator=gen, dtype=torch.float64) * 5
    v = torch.randn(1537, 8, generator=gen, dtype=torch.float64)
    want = torch.softmax(logits, 0) @ v
    parts = list(torch.split(torch.arange(1537), PARTITION_SIZE))
    m = torch.stack([logits[i].max() for i in parts])
    l = torch.stack([torch.exp(logits[i] - logits[i].max()).sum() for i in parts])
    o = torch.stack([torch.softmax(logits[i], 0) @ v[i] for i in parts])
    w = torch.exp(m - m.max()) * l
    merged = (w[:, None] * o).sum(0) / w.sum()
    assert torch.allclose(merged, want, atol=1e-12)
    assert math.isclose(float(torch.logsumexp(logits, 0)), float(m.max() + torch.log(w.sum())), rel_tol=1e-12)
