"""reshape_and_cache_flash: reference semantics (CPU), every variant compiles (CPU), the kernel
against the reference bit for bit on NaN-poisoned caches (GPU), and bad input (both)."""
import itertools

import pytest
import torch

import pagedattn
from pagedattn import CacheSpec, ContractError, reference
from pagedattn.codegen.compile import compile_source, nvrtc_options
from pagedattn.codegen.toolchain import toolchain
from pagedattn.ops.plans import PlanCache
from pagedattn.ops import kv_write
from pagedattn.ops.kv_write import KvWriteSpec
from pagedattn.registry import Kernel, get_kernel, variant_name

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16 if t.element_size() == 2 else torch.int32)


# ---------------------------------------------------------------- reference semantics (CPU)
def test_reference_hand_made_nhd():
    spec = CacheSpec(3, 2, 1, 2, torch.float32)
    kc, vc = spec.allocate("cpu", fill=float("nan"))
    key = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]], [[5.0, 6.0]], [[7.0, 8.0]]])  # T_pad = 4
    slots = torch.tensor([5, -1, 0])                                              # 3 tokens, one skipped
    reference.reshape_and_cache_flash(key, -key, kc, vc, slots)
    assert kc[2, 1, 0].tolist() == [1.0, 2.0] and kc[0, 0, 0].tolist() == [5.0, 6.0]
    assert vc[2, 1, 0].tolist() == [-1.0, -2.0]
    written = torch.zeros(3, 2, dtype=torch.bool)
    written[2, 1] = written[0, 0] = True
    assert kc[~written].isnan().all() and vc[~written].isnan().all()  # token 1 and padded token 3 unwritten


def test_reference_hnd_matches_nhd():
    key, value = torch.randn(5, 3, 8), torch.randn(5, 3, 8)
    slots = torch.tensor([7, 0, 3, -1, 12])
    out = {}
    for layout in ("NHD", "HND"):
        kc, vc = CacheSpec(4, 4, 3, 8, torch.float32, layout=layout).allocate("cpu", fill=0.0)
        reference.reshape_and_cache_flash(key, value, kc, vc, slots)
        out[layout] = (kc.clone(), vc.clone())
    assert torch.equal(out["NHD"][0], out["HND"][0]) and torch.equal(out["NHD"][1], out["HND"][1])


def test_reference_fp8_per_head_saturates():
    key = torch.tensor([[[1000.0, -1000.0]], [[0.5, 1.0]]]).expand(2, 2, 2).contiguous()  # H=2
    scale = torch.tensor([1.0, 4.0])
    kc, vc = CacheSpec(1, 4, 2, 2, torch.uint8, "fp8_e4m3", scale="head").allocate("cpu", fill=0)
    reference.reshape_and_cache_flash(key, key, kc, vc, torch.tensor([0, 1]), "fp8_e4m3", scale, scale)
    f = kc.view(torch.float8_e4m3fn).float()
    assert f[0, 0, 0].tolist() == [448.0, -448.0]          # saturated, not NaN
    assert f[0, 0, 1].tolist() == [256.0, -256.0]          # 1000/4 = 250 rounds to 256
    assert f[0, 1, 0].tolist() == [0.5, 1.0] and f[0, 1, 1].tolist() == [0.125, 0.25]


def test_reference_fp8_e5m2_per_tensor_float8_storage():
    key = torch.randn(6, 2, 16) * 1e5
    kc, vc = CacheSpec(2, 4, 2, 16, torch.float8_e5m2, "fp8_e5m2").allocate("cpu")
    s = torch.tensor([0.5])
    reference.reshape_and_cache_flash(key, key, kc, vc, torch.arange(6), "fp8_e5m2", s, s)
    got = kc.float().reshape(-1, 2, 16)[:6]
    assert got.abs().max() <= 57344.0 and not got.isnan().any()


# ---------------------------------------------------------------- every variant compiles (CPU)
def test_every_path_is_a_variant():
    paths = {s.path for s in KvWriteSpec.all_variants()}
    assert paths == {"span", "head", "flat"}
    flat = Kernel(KvWriteSpec("bf16", "fp8_e4m3", "flat")).source
    assert (f"kv_write_flat<__nv_bfloat16, uint8_t, pagedattn::Fp8Format::kE4M3, {kv_write.flat_max_items('fp8_e4m3')}, "
            f"{kv_write.stream_items('fp8_e4m3')}>") in flat  # the streaming body when it is on for fp8
    copy = Kernel(KvWriteSpec("bf16", "auto", "flat")).source
    assert f"kv_write_flat<__nv_bfloat16, __nv_bfloat16, pagedattn::Fp8Format::kNone, {kv_write.FLAT_MAX_ITEMS}, 0>" in copy
    assert f"__launch_bounds__({kv_write.FLAT_MAX_THREADS})" in copy
    assert f"__launch_bounds__({kv_write.flat_bounds('fp8_e4m3')})" in flat
    assert "kv_write<__half, __half, pagedattn::Fp8Format::kNone, true>" in Kernel(
        KvWriteSpec("fp16", "auto", "span")).source


@pytest.mark.compiles
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("spec", list(KvWriteSpec.all_variants()), ids=variant_name)
def test_every_write_variant_compiles(spec, arch):
    k = Kernel(spec)
    res = compile_source(k.source, variant=k.name, arch=arch, options=nvrtc_options(arch, toolchain()))
    assert res.cubin[:4] == b"\x7fELF"


# ---------------------------------------------------------------- path choice (CPU)
ALL_FLAT = frozenset(itertools.product(("NHD", "HND"), ("copy", "fp8", "fp8_head")))  # FLAT_FOR: always


def _spec(layout="NHD", kv="auto", scale="tensor", D=128, dtype=torch.bfloat16, H=8):
    return CacheSpec(64, 16, H, D, dtype if kv == "auto" else torch.uint8, kv, layout, scale)


@pytest.mark.parametrize("layout,kv,scale,want", [
    ("NHD", "auto", "tensor", "flat"),
    ("HND", "auto", "tensor", "flat"),
    ("NHD", "fp8_e4m3", "tensor", "flat"),   # since the streaming schedule, NHD fp8 with one scale too
    ("HND", "fp8_e5m2", "tensor", "flat"),
    ("NHD", "fp8_e5m2", "head", "flat"),
    ("HND", "fp8_e4m3", "head", "flat"),
])
def test_write_path_default(layout, kv, scale, want):
    assert kv_write.write_path(_spec(layout, kv, scale), 2, 65536, aligned=True) == want
    assert kv_write.write_path(_spec(layout, kv, scale), 2, 256, aligned=True) == want


def test_write_path_falls_back(monkeypatch):
    hnd = _spec("HND")
    assert kv_write.write_path(hnd, 2, 100, aligned=False) == "head"                # unaligned rows
    assert kv_write.write_path(_spec("HND", D=36), 2, 100, aligned=True) == "head"  # 72-byte rows
    assert kv_write.write_path(_spec("HND", D=36), 4, 100, aligned=True) == "flat"  # fp32: 144 bytes
    assert kv_write.write_path(_spec("NHD", "fp8_e4m3", D=36), 2, 100, True) == "span"
    assert kv_write.write_path(_spec("NHD", "fp8_e4m3", "head", D=36), 2, 100, True) == "head"
    assert kv_write.write_path(hnd, 2, 1 << 30, aligned=True) == "head"             # beyond a 1-D grid
    monkeypatch.setattr(kv_write, "FLAT_MIN_TOKENS", 1024)
    assert kv_write.write_path(hnd, 2, 1023, aligned=True) == "head"
    assert kv_write.write_path(hnd, 2, 1024, aligned=True) == "flat"
    monkeypatch.setattr(kv_write, "FLAT_FOR", frozenset())
    assert kv_write.write_path(hnd, 2, 4096, aligned=True) == "head"
    assert kv_write.write_path(_spec("NHD"), 2, 4096, aligned=True) == "span"
    monkeypatch.setattr(kv_write, "FLAT_FOR", ALL_FLAT)
    assert kv_write.write_path(_spec("NHD", "fp8_e4m3"), 2, 4096, aligned=True) == "flat"
    assert kv_write.write_kind(_spec("NHD", "fp8_e4m3", "head")) == ("NHD", "fp8_head")


def test_rows_aligned():
    x = torch.zeros(4 * 8 * 64 + 8, dtype=torch.float16)
    base = x[(-x.data_ptr() % 16) // 2:]  # 16-byte aligned start
    key = base[:4 * 8 * 64].view(4, 8, 64)
    assert kv_write.rows_aligned(key, key)
    assert not kv_write.rows_aligned(key, base[1:1 + 4 * 8 * 64].view(4, 8, 64))   # base pointer
    qkv = torch.zeros(4, 3 * 8 + 1, 64, dtype=torch.float16)[:, :8]                # token stride
    assert (qkv.stride(0) * 2) % 16 == 0 and kv_write.rows_aligned(qkv, qkv)
    odd = torch.zeros(4 * (8 * 64 + 4), dtype=torch.float16)
    odd = odd[(-odd.data_ptr() % 16) // 2:][:4 * (8 * 64 + 4)].view(4, 8 * 64 + 4)[:, :8 * 64].view(4, 8, 64)
    assert odd.stride(0) == 8 * 64 + 4 and not kv_write.rows_aligned(odd, odd)


@pytest.mark.parametrize("T,token_packs", [(1, 256), (3, 18), (37, 72), (1023, 256), (1024, 256),
                                           (65536, 256), (5000, 1000), (777, 9)])
@pytest.mark.parametrize("many,few", [((4, 256), (2, 128)), ((3, 96), (1, 32)), ((4, 512), (4, 64))])
def test_flat_shape_covers_every_pack(T, token_packs, many, few):
    """Every pack is some thread's, and the kernel's items = ceil(packs / grid threads) never exceeds
    what the host asked for."""
    items, want_threads = many if T >= kv_write.MANY_TOKENS else few
    grid, block = kv_write._flat_shape(T, token_packs, many, few)
    threads, packs = block[0], T * token_packs
    assert threads % 32 == 0 and 32 <= threads <= want_threads and grid[1:] == (1, 1) and block[1:] == (1, 1)
    assert threads == min(want_threads, -(-packs // (32 * items)) * 32) or threads == 32
    assert (grid[0] - 1) * threads * items < packs <= grid[0] * threads * items
    kernel_items = -(-packs // (grid[0] * threads))
    assert 1 <= kernel_items <= items and grid[0] * threads * kernel_items >= packs
    capped, _ = kv_write._flat_shape(T, token_packs, many, few, stream_ctas=7)
    assert capped[0] == (min(grid[0], 7) if T >= kv_write.MANY_TOKENS else grid[0])


# ---------------------------------------------------------------- the kernel (GPU)
def make_inputs(T, H, D, dtype, source, pad, gen):
    T_pad = T + (5 if pad else 0)
    if source == "contiguous":
        key = torch.randn(T_pad, H, D, dtype=dtype, device="cuda", generator=gen)
        value = torch.randn(T_pad, H, D, dtype=dtype, device="cuda", generator=gen)
    elif source == "strided":  # K and V as slices of a fused QKV tensor
        qkv = torch.randn(T_pad, 3 * H, D, dtype=dtype, device="cuda", generator=gen)
        key, value = qkv[:, H:2 * H], qkv[:, 2 * H:]
    else:  # base pointers not 16-byte aligned
        flat = torch.randn(2 * T_pad * H * D + 2, dtype=dtype, device="cuda", generator=gen)
        key = flat[1:1 + T_pad * H * D].view(T_pad, H, D)
        value = flat[T_pad * H * D + 1:2 * T_pad * H * D + 1].view(T_pad, H, D)
    # some magnitudes beyond the fp8 range, to exercise saturation
    mag = torch.where(torch.rand(T_pad, H, 1, device="cuda", generator=gen) < 0.1, 300.0, 2.0).to(dtype)
    key.mul_(mag)
    value.mul_(mag)
    return key, value


GRID = [
    (layout, dtype, kv, scale, D, bs, source, pad)
    for layout, dtype, kv, scale, D, bs, source, pad in itertools.product(
        ("NHD", "HND"), (torch.float16, torch.bfloat16, torch.float32), ("auto", "fp8_e4m3", "fp8_e5m2"),
        ("tensor", "head"), (64, 80, 96, 128, 256, 72), (1, 16, 32, 128),
        ("contiguous", "strided", "unaligned"), (False, True))
    if not (kv == "auto" and scale == "head")
]


def _id(case):
    layout, dtype, kv, scale, D, bs, source, pad = case
    return f"{layout}-{str(dtype)[6:]}-{kv}-{scale}-d{D}-b{bs}-{source}-{'pad' if pad else 'nopad'}"


@pytest.fixture(params=["base", "flat"])
def force_path(request, monkeypatch):
    """base: every write takes span/head; flat: every write whose rows are aligned takes flat (the
    others, e.g. source=unaligned, must fall back to span/head)."""
    monkeypatch.setattr(kv_write, "FLAT_FOR", ALL_FLAT if request.param == "flat" else frozenset())
    monkeypatch.setattr(kv_write, "FLAT_MIN_TOKENS", 1)
    monkeypatch.setattr(kv_write, "_PLANS", PlanCache())
    return request.param


@pytest.mark.gpu
@pytest.mark.parametrize("case", GRID, ids=_id)
def test_write_matches_reference_bitwise(case, force_path):
    layout, dtype, kv, scale, D, bs, source, pad = case
    gen = torch.Generator("cuda").manual_seed(hash(_id(case)) % 2**31)
    H, T = 4, 37
    num_blocks = -(-3 * T // bs) + 1
    cache_dtype = dtype if kv == "auto" else torch.uint8
    spec = CacheSpec(num_blocks, bs, H, D, cache_dtype, kv, layout, scale)
    key, value = make_inputs(T, H, D, dtype, source, pad, gen)
    slots = torch.randperm(spec.num_slots, device="cuda", generator=gen)[:T]
    if pad:
        slots[torch.rand(T, device="cuda", generator=gen) < 0.3] = -1
    ks, vs = _random_scales(kv, scale, H, gen)
    kc, vc = _check_against_reference(spec, key, value, slots, kv, ks, vs)
    # rerun: bit-identical
    kc2, vc2 = spec.allocate("cuda", fill=float("nan"))
    pagedattn.reshape_and_cache_flash(key, value, kc2, vc2, slots, kv, ks, vs)
    assert torch.equal(bits(kc2), bits(kc)) and torch.equal(bits(vc2), bits(vc))
    # the forced path is the one that ran (unaligned rows fall back to span/head)
    (plan,) = kv_write._PLANS.values()
    if force_path == "flat" and source != "unaligned":
        assert plan.flat is not None and plan.base is None
    else:
        assert plan.base is not None


@pytest.mark.gpu
@pytest.mark.parametrize("storage", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_write_float8_storage_and_int32_slots(storage):
    kv = "fp8_e4m3" if storage == torch.float8_e4m3fn else "fp8_e5m2"
    spec = CacheSpec(8, 16, 8, 128, storage, kv, "HND", "head")
    key, value = torch.randn(2, 50, 8, 128, device="cuda", dtype=torch.bfloat16) * 50
    slots = torch.randperm(128, device="cuda")[:50].int()
    s = torch.rand(8, device="cuda") + 0.1
    kc, vc = spec.allocate("cuda", fill=float("nan"))
    rk, rv = kc.clone(), vc.clone()
    spec.write(key, value, kc, vc, slots, s, s)  # through the contract object
    reference.reshape_and_cache_flash(key, value, rk, rv, slots, kv, s, s)
    assert torch.equal(bits(kc), bits(rk)) and torch.equal(bits(vc), bits(rv))


def _random_scales(kv, scale, H, gen):
    """(k_scale, v_scale) for an fp8 cache: [1] or [H] in [0.05, 1.05); (None, None) for "auto"."""
    if kv == "auto":
        return None, None
    n = 1 if scale == "tensor" else H
    return (torch.rand(n, device="cuda", generator=gen) + 0.05, torch.rand(n, device="cuda", generator=gen) + 0.05)


def _check_against_reference(spec, key, value, slots, kv, ks, vs):
    """Write into NaN-poisoned caches; written slots must equal the reference bit for bit and every
    other slot must still be poisoned. Returns the written caches."""
    kc, vc = spec.allocate("cuda", fill=float("nan"))
    rk, rv = kc.clone(), vc.clone()
    pagedattn.reshape_and_cache_flash(key, value, kc, vc, slots, kv, ks, vs)
    reference.reshape_and_cache_flash(key, value, rk, rv, slots, kv, ks, vs)
    torch.cuda.synchronize()
    assert torch.equal(bits(kc), bits(rk)) and torch.equal(bits(vc), bits(rv))
    written = torch.zeros(spec.num_slots, dtype=torch.bool, device="cuda")
    s = slots.long()
    written[s[s >= 0]] = True
    unwritten = kc[(~written).view(spec.num_blocks, spec.block_size)]  # [n, H, D] whatever the layout
    assert (unwritten.view(torch.uint8) == 0x7F).all() if kv != "auto" else unwritten.isnan().all()
    return kc, vc


@pytest.fixture
def max_items(request, monkeypatch):
    """Re-render the flat variants with kItems = FLAT_MAX_ITEMS = request.param (and back afterwards)."""
    monkeypatch.setattr(kv_write, "FLAT_MAX_ITEMS", request.param)
    monkeypatch.setattr(kv_write, "_PLANS", PlanCache())
    get_kernel.cache_clear()
    yield request.param
    get_kernel.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("max_items", [4, 3], indirect=True)
@pytest.mark.parametrize("items", [1, 2, 4])
@pytest.mark.parametrize("threads", [32, 96, 512])
@pytest.mark.parametrize("layout,kv,scale", [("NHD", "auto", "tensor"), ("HND", "auto", "tensor"),
                                             ("HND", "fp8_e4m3", "head"), ("NHD", "fp8_e5m2", "head")])
@pytest.mark.parametrize("T,H,D,dtype", [(1, 1, 64, torch.bfloat16), (5, 3, 72, torch.float16),
                                         (1500, 3, 80, torch.bfloat16), (4099, 8, 128, torch.bfloat16),
                                         (2000, 2, 36, torch.float32)])
def test_flat_many_tokens(max_items, items, threads, layout, kv, scale, T, H, D, dtype, monkeypatch):
    """Flat with kItems 4 and 3, packs per thread 1, 2 and 4 (capped at kItems), CTAs of 1, 3 and 16
    warps (fp8 variants cap CTAs at FLAT_STREAM_MAX_THREADS and stream their many-token writes): token
    counts below and above MANY_TOKENS, odd H, rows of 9 and 10 packs."""
    monkeypatch.setattr(kv_write, "FLAT_FOR", ALL_FLAT)
    monkeypatch.setattr(kv_write, "FLAT_MIN_TOKENS", 1)
    for name in ("FLAT_ITEMS", "FLAT_ITEMS_FEW"):
        monkeypatch.setattr(kv_write, name, items)
    for name in ("FLAT_THREADS", "FLAT_THREADS_FEW"):
        monkeypatch.setattr(kv_write, name, threads)
    gen = torch.Generator("cuda").manual_seed(T * 7 + threads)
    bs = 16
    spec = CacheSpec(-(-2 * T // bs) + 1, bs, H, D, dtype if kv == "auto" else torch.uint8, kv, layout, scale)
    assert kv_write.write_path(spec, torch.empty(0, dtype=dtype).element_size(), T, True) == "flat"
    key, value = make_inputs(T, H, D, dtype, "strided", True, gen)
    slots = torch.randperm(spec.num_slots, device="cuda", generator=gen)[:T]
    slots[torch.rand(T, device="cuda", generator=gen) < 0.2] = -1
    ks, vs = _random_scales(kv, scale, H, gen)
    _check_against_reference(spec, key, value, slots, kv, ks, vs)
    _check_against_reference(spec, key, value, slots.int(), kv, ks, vs)  # int32 slot ids
    assert len(kv_write._PLANS) == 2 and all(p.base is None for p in kv_write._PLANS.values())


@pytest.mark.gpu
@pytest.mark.parametrize("waves", [1, 0.02])
@pytest.mark.parametrize("stream_items", [4, 2, 1])
@pytest.mark.parametrize("layout,kv,scale", [("NHD", "fp8_e4m3", "tensor"), ("HND", "fp8_e4m3", "head"),
                                             ("HND", "fp8_e5m2", "tensor")])
@pytest.mark.parametrize("T,H,D,dtype", [(1500, 3, 80, torch.bfloat16), (4099, 8, 128, torch.bfloat16),
                                         (2000, 2, 32, torch.float32), (1024, 1, 64, torch.float16),
                                         (1100, 2, 72, torch.bfloat16)])
def test_flat_streaming(waves, stream_items, layout, kv, scale, T, H, D, dtype, monkeypatch, request):
    """The streaming schedule (a grid capped at `waves` resident waves: 1, or a few CTAs so that every
    thread loops over many batches), batches of 4, 2 and 1 items, items of two packs (rows of 10, 16 and
    8 packs) and of one (D=72 bf16: 9 packs), against the reference bit for bit."""
    monkeypatch.setattr(kv_write, "FLAT_FOR", ALL_FLAT)
    monkeypatch.setattr(kv_write, "FLAT_MIN_TOKENS", 1)
    monkeypatch.setattr(kv_write, "FLAT_STREAM_WAVES", waves)
    monkeypatch.setattr(kv_write, "FLAT_STREAM_ITEMS", stream_items)
    monkeypatch.setattr(kv_write, "_PLANS", PlanCache())
    get_kernel.cache_clear()  # the variant's source depends on FLAT_STREAM_ITEMS
    request.addfinalizer(get_kernel.cache_clear)
    gen = torch.Generator("cuda").manual_seed(T * 3 + stream_items)
    bs = 16
    spec = CacheSpec(-(-2 * T // bs) + 1, bs, H, D, torch.uint8, kv, layout, scale)
    key, value = make_inputs(T, H, D, dtype, "strided", True, gen)
    slots = torch.randperm(spec.num_slots, device="cuda", generator=gen)[:T]
    slots[torch.rand(T, device="cuda", generator=gen) < 0.2] = -1
    ks, vs = _random_scales(kv, scale, H, gen)
    _check_against_reference(spec, key, value, slots, kv, ks, vs)
    (plan,) = kv_write._PLANS.values()
    token_packs, (items, threads), _, cap = plan.flat_shape
    assert plan.base is None and cap > 0
    if waves < 1:  # a few CTAs: every thread loops over many batches
        assert cap < -(-T * token_packs // (items * threads)), "should stream"


@pytest.mark.gpu
@pytest.mark.parametrize("D,offset", [(36, 0), (64, 1), (64, 0)])
def test_flat_fallback_rows_not_aligned(D, offset, monkeypatch):
    """bf16 D=36 (72-byte rows) and an unaligned base take span/head, aligned ones flat; the same plan
    serves calls whose base pointers differ in alignment."""
    monkeypatch.setattr(kv_write, "FLAT_FOR", ALL_FLAT)
    monkeypatch.setattr(kv_write, "_PLANS", PlanCache())
    T, H = 300, 4
    spec = CacheSpec(32, 16, H, D, torch.bfloat16, "auto", "HND")
    flat = torch.randn(2 * T * H * D + 16, dtype=torch.bfloat16, device="cuda")
    for off in (offset, 0, offset):  # one cached plan, alignment decided per call
        key = flat[off:off + T * H * D].view(T, H, D)
        value = flat[T * H * D + off:2 * T * H * D + off].view(T, H, D)
        _check_against_reference(spec, key, value, torch.randperm(spec.num_slots, device="cuda")[:T],
                                 "auto", None, None)
    (plan,) = kv_write._PLANS.values()
    assert (plan.flat is None) == (D == 36) and (plan.base is not None) == (D == 36 or offset == 1)


@pytest.mark.gpu
@pytest.mark.usefixtures("force_path")
def test_corrupt_slot_is_never_written():
    spec = CacheSpec(4, 16, 2, 64, torch.float16)
    kc, vc = spec.allocate("cuda", fill=float("nan"))
    guard = torch.full((1 << 16,), 7.0, dtype=torch.float16, device="cuda")  # memory after the cache
    key = torch.randn(3, 2, 64, dtype=torch.float16, device="cuda")
    slots = torch.tensor([spec.num_slots, 2**40, 3], device="cuda")
    pagedattn.reshape_and_cache_flash(key, key, kc, vc, slots)
    torch.cuda.synchronize()
    assert (guard == 7.0).all()
    assert kc.reshape(-1, 2, 64)[3].eq(key[2]).all()
    assert kc.reshape(-1, 2, 64)[torch.arange(64, device="cuda") != 3].isnan().all()
    with pytest.raises(ContractError, match=r"slot_mapping\[0\]"):
        pagedattn.reshape_and_cache_flash(key, key, kc, vc, slots, validate=True)


@pytest.mark.gpu
def test_debug_env_validates(monkeypatch):
    monkeypatch.setenv("PAGEDATTN_DEBUG", "1")
    kc, vc = CacheSpec(1, 16, 1, 64, torch.float16).allocate("cuda")
    key = torch.randn(1, 1, 64, dtype=torch.float16, device="cuda")
    with pytest.raises(ContractError, match="outside the cache"):
        pagedattn.reshape_and_cache_flash(key, key, kc, vc, torch.tensor([16], device="cuda"))


@pytest.mark.gpu
def test_nonzero_stream_and_threads():
    import threading

    spec = CacheSpec(64, 16, 8, 128, torch.bfloat16)
    key = torch.randn(512, 8, 128, dtype=torch.bfloat16, device="cuda")
    slots = torch.randperm(1024, device="cuda")[:512]
    want_k, want_v = spec.allocate("cuda", fill=0.0)
    reference.reshape_and_cache_flash(key, key, want_k, want_v, slots)
    s = torch.cuda.Stream()
    kc, vc = spec.allocate("cuda", fill=0.0)
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        pagedattn.reshape_and_cache_flash(key, key, kc, vc, slots)
    s.synchronize()
    assert torch.equal(kc, want_k)
    results = []

    def worker():
        k2, v2 = spec.allocate("cuda", fill=0.0)
        for _ in range(20):
            pagedattn.reshape_and_cache_flash(key, key, k2, v2, slots)
        torch.cuda.synchronize()
        results.append(torch.equal(k2, want_k) and torch.equal(v2, want_v))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True, True]


# ---------------------------------------------------------------- bad input: clear error, cache untouched
def _bad_cases():
    H, D = 4, 64
    f16 = dict(dtype=torch.float16, device=DEV)
    key = torch.randn(8, H, D, **f16)
    slots = torch.arange(8, device=DEV)
    s1 = torch.ones(1, device=DEV)
    return {
        "key int dtype": dict(key=key.to(torch.int32)),
        "key/value dtype differ": dict(value=key.to(torch.float32)),
        "heads mismatch": dict(key=torch.randn(8, H + 1, D, **f16)),
        "head size mismatch": dict(key=torch.randn(8, H, D + 8, **f16), value=torch.randn(8, H, D + 8, **f16)),
        "slot float dtype": dict(slots=slots.float()),
        "slot 2-D": dict(slots=slots.view(2, 4)),
        "more slots than tokens": dict(slots=torch.arange(9, device=DEV)),
        "fp8 without scale": dict(kv="fp8_e4m3", cache_dtype=torch.uint8),
        "fp8 scale fp16": dict(kv="fp8_e4m3", cache_dtype=torch.uint8, ks=s1.half(), vs=s1.half()),
        "fp8 scale wrong shape": dict(kv="fp8_e4m3", cache_dtype=torch.uint8,
                                      ks=torch.ones(2, device=DEV), vs=torch.ones(2, device=DEV)),
        "(H, D) not dense": dict(key=torch.randn(8, H, 2 * D, **f16)[:, :, ::2]),
        "input dtype differs from auto cache": dict(cache_dtype=torch.bfloat16),
        "unknown kv_cache_dtype": dict(kv="int8"),
        "fp8 with bf16 cache": dict(kv="fp8_e4m3", cache_dtype=torch.bfloat16, ks=s1, vs=s1),
        "K/V caches differ in layout": dict(mixed_layout=True),
        "key/value token counts differ": dict(value=torch.randn(7, H, D, **f16)),
        "key not a tensor": dict(key=[[0.0]]),
        "slot beyond cache with validate": dict(slots=torch.tensor([0, 1, 10_000], device=DEV), validate=True),
        "uint8 cache with auto": dict(cache_dtype=torch.uint8),
    }


@pytest.mark.parametrize("name", sorted(_bad_cases()))
def test_bad_input_raises_and_leaves_cache(name):
    c = _bad_cases()[name]
    H, D = 4, 64
    key = c.get("key", torch.randn(8, H, D, dtype=torch.float16, device=DEV))
    value = c.get("value", key if isinstance(key, torch.Tensor) else torch.zeros(8, H, D))
    cache_dtype = c.get("cache_dtype", torch.float16)
    spec_kv = "fp8_e4m3" if cache_dtype == torch.uint8 else "auto"
    kc, vc = CacheSpec(4, 16, H, D, cache_dtype, spec_kv).allocate(DEV, fill=0.0)
    if c.get("mixed_layout"):
        vc = CacheSpec(4, 16, H, D, cache_dtype, spec_kv, "HND").allocate(DEV, fill=0.0)[1]
    kc.view(torch.uint8).random_()
    vc.view(torch.uint8).random_()
    before = (kc.clone(), vc.clone())
    with pytest.raises((ContractError, ValueError, TypeError)) as info:
        pagedattn.reshape_and_cache_flash(key, value, kc, vc, c.get("slots", torch.arange(8, device=DEV)),
                                          c.get("kv", "auto"), c.get("ks"), c.get("vs"),
                                          validate=c.get("validate"))
    assert len(str(info.value)) > 15
    if DEV == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(bits(kc), bits(before[0])) and torch.equal(bits(vc), bits(before[1]))


def test_cta_shape_follows_token_count():
    from pagedattn.ops.kv_write import _threads

    nhd = CacheSpec(8, 16, 8, 128, torch.bfloat16)
    hnd = CacheSpec(8, 16, 8, 128, torch.bfloat16, layout="HND")
    assert _threads(nhd, "span", 2, many_tokens=False) == 256  # one 16-byte pack per thread
    assert _threads(nhd, "span", 2, many_tokens=True) == 64    # four packs per thread
    assert _threads(hnd, "head", 2, many_tokens=False) == 256  # a warp per head
    assert _threads(hnd, "head", 2, many_tokens=True) == 128   # four warps, two heads each
    tiny = CacheSpec(8, 16, 1, 64, torch.float16)
    assert _threads(tiny, "span", 2, many_tokens=True) == 64    # at least a warp per tensor


# ---------------------------------------------------------------- issue #18: scales (CPU unless marked)
def _fp8_write_args(k_scale, v_scale=None, device="cpu"):
    kc, vc = CacheSpec(4, 16, 4, 64, torch.uint8, "fp8_e4m3").allocate(device, fill=0.0)
    key = torch.randn(8, 4, 64, dtype=torch.float16, device=device)
    return (key, key, kc, vc, torch.arange(8, device=device), "fp8_e4m3", k_scale,
            k_scale if v_scale is None else v_scale)


def test_0d_scale_accepted():
    """vLLM's layer scales are 0-d: one scale, like [1] (the kernel reads the same single float)."""
    from pagedattn.ops.kv_write import _check_scale

    spec = CacheSpec(4, 16, 4, 64, torch.uint8, "fp8_e4m3")
    assert _check_scale("k_scale", torch.tensor(0.5), spec, torch.device("cpu")) == 0
    with pytest.raises(ContractError, match="CUDA tensors; key_cache is on cpu"):  # every check passed
        pagedattn.reshape_and_cache_flash(*_fp8_write_args(torch.tensor(0.5)))


@pytest.mark.parametrize("scale,match", [
    (torch.ones(1, dtype=torch.float16),
     r"k_scale must be a float32 tensor, got torch.float16 tensor of shape \(1,\)"),
    (torch.ones(2), r"k_scale must be a contiguous \[4\] tensor for scale granularity 'head', got shape \(2,\)"),
    (torch.ones(8)[::2], r"k_scale must be a contiguous \[4\] .*strides \(2,\)"),
    ([0.5], "k_scale must be a float32 tensor, got list"),
    (torch.ones(1, device="meta"), "k_scale is on meta, the cache on cpu"),
])
def test_scale_refused_names_what_was_given(scale, match):
    with pytest.raises(ContractError, match=match):
        pagedattn.reshape_and_cache_flash(*_fp8_write_args(scale))


def test_scale_values_check():
    from pagedattn.contract import check_scale_values

    check_scale_values("k_scale", torch.tensor([0.5, 2.0]))
    for t, match in ((torch.tensor([0.5, float("nan")]), r"k_scale\[1\] = nan"),
                     (torch.tensor(0.0), r"k_scale = 0.0: fp8 scales must be finite and > 0"),
                     (torch.tensor([[1.0, -1.0]]), r"k_scale\[0, 1\] = -1.0"),
                     (torch.tensor([float("inf")]), r"k_scale\[0\] = inf")):
        with pytest.raises(ContractError, match=match):
            check_scale_values("k_scale", t)


@pytest.mark.gpu
def test_scale_values_checked_with_validate(monkeypatch):
    bad = torch.tensor([float("nan")], device="cuda")
    args = _fp8_write_args(torch.tensor([0.5], device="cuda"), bad, device="cuda")
    pagedattn.reshape_and_cache_flash(*args)  # no sync unless asked
    with pytest.raises(ContractError, match=r"v_scale\[0\] = nan"):
        pagedattn.reshape_and_cache_flash(*args, validate=True)
    monkeypatch.setenv("PAGEDATTN_DEBUG", "1")
    with pytest.raises(ContractError, match=r"v_scale\[0\] = nan"):
        pagedattn.reshape_and_cache_flash(*args)


@pytest.mark.gpu
def test_0d_scale_writes_like_1_element():
    zero_d = _fp8_write_args(torch.tensor(0.03, device="cuda"), device="cuda")
    one = _fp8_write_args(torch.tensor([0.03], device="cuda"), device="cuda")
    one = (zero_d[0], zero_d[1]) + one[2:]
    pagedattn.reshape_and_cache_flash(*zero_d)
    pagedattn.reshape_and_cache_flash(*one)
    assert torch.equal(zero_d[2], one[2]) and torch.equal(zero_d[3], one[3])
