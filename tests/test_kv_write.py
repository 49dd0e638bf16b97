"""reshape_and_cache_flash: reference semantics (CPU), every variant compiles (CPU), the kernel
against the reference bit for bit on NaN-poisoned caches (GPU), and bad input (both)."""
import dataclasses
import itertools

import pytest
import torch

import pagedattn
from pagedattn import CacheSpec, ContractError, reference
from pagedattn.codegen.compile import compile_source, nvrtc_options
from pagedattn.codegen.toolchain import toolchain
from pagedattn.ops import kv_write
from pagedattn.ops.kv_write import KvWriteSpec, write_config
from pagedattn.registry import Kernel, UnsupportedError, variant_name

from _compile_grid import grid

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
    fp8, copy = kv_write.FLAT_BUILD["fp8"], kv_write.FLAT_BUILD["copy"]
    assert fp8["stream_items"] > 0 and copy["stream_items"] == 0  # the streaming body: fp8 only
    flat = Kernel(KvWriteSpec("bf16", "fp8_e4m3", "flat")).source
    assert (f"kv_write_flat<__nv_bfloat16, uint8_t, pagedattn::Fp8Format::kE4M3, {fp8['max_items']}, "
            f"{fp8['stream_items']}>") in flat
    assert f"__launch_bounds__({fp8['max_threads']}, {fp8['min_blocks']})" in flat
    src = Kernel(KvWriteSpec("bf16", "auto", "flat")).source
    assert f"kv_write_flat<__nv_bfloat16, __nv_bfloat16, pagedattn::Fp8Format::kNone, {copy['max_items']}, 0>" in src
    assert f"__launch_bounds__({copy['max_threads']})" in src
    assert "kv_write<__half, __half, pagedattn::Fp8Format::kNone, true>" in Kernel(
        KvWriteSpec("fp16", "auto", "span")).source
    append = Kernel(KvWriteSpec("bf16", "fp8_e4m3", "flat", True))
    assert append.name == "kv_write_bf16_fp8e4m3_flat_append" and "write_seqused(params)" in append.source
    assert (f"kv_write_flat<__nv_bfloat16, uint8_t, pagedattn::Fp8Format::kE4M3, {fp8['max_items']}, "
            f"{fp8['stream_items']}, true>") in append.source and "write_seqused" not in flat


def test_build_fields_name_and_render_the_variant():
    """Compile-time knobs are spec fields: off their default they name the variant and reach the source;
    at their default the spec, name and source are the default's."""
    default = KvWriteSpec("bf16", "fp8_e4m3", "flat")
    assert KvWriteSpec("bf16", "fp8_e4m3", "flat", **kv_write.FLAT_BUILD["fp8"]) == default
    assert variant_name(default) == "kv_write_bf16_fp8e4m3_flat"
    spec = KvWriteSpec("bf16", "fp8_e4m3", "flat", max_items=3, stream_items=4, max_threads=128, min_blocks=0)
    assert variant_name(spec) == "kv_write_bf16_fp8e4m3_flat_items3_stream4_threads128_minblocks0"
    src = Kernel(spec).source
    assert "kv_write_flat<__nv_bfloat16, uint8_t, pagedattn::Fp8Format::kE4M3, 3, 4>" in src
    assert "__launch_bounds__(128)" in src and spec.build == dict(max_items=3, stream_items=4, max_threads=128,
                                                                   min_blocks=0)
    assert list(KvWriteSpec.all_variants()).count(spec) == 0 and default in KvWriteSpec.all_variants()
    with pytest.raises(UnsupportedError, match="shape the flat path only"):
        KvWriteSpec("bf16", "auto", "span", max_items=2)
    for bad in (dict(max_items=1), dict(stream_items=-1), dict(max_threads=1024), dict(max_threads=100)):
        with pytest.raises(UnsupportedError, match=next(iter(bad))):
            KvWriteSpec("bf16", "auto", "flat", **bad)


# make test: every variant for sm_90a, one per path for sm_80 (the same source; the sm_80 rest in test-all);
# of the append variants (flash_attn_with_kvcache's write: the same bodies, slots computed) one per path
SM80_WRITE = (KvWriteSpec("bf16", "auto", "span"), KvWriteSpec("fp16", "fp8_e5m2", "head"),
              KvWriteSpec("bf16", "fp8_e4m3", "flat"), KvWriteSpec("bf16", "auto", "span", True))
SM90_APPEND = (KvWriteSpec("bf16", "fp8_e4m3", "flat", True), KvWriteSpec("fp16", "auto", "head", True))


@pytest.mark.compiles
@pytest.mark.parametrize("spec,arch", grid([*KvWriteSpec.all_variants(), *(KvWriteSpec(s.dtype, s.kv_cache_dtype, s.path, True)
                                                                           for s in KvWriteSpec.all_variants())],
                                           lambda spec, arch: spec in SM80_WRITE or (
                                               arch == "sm_90a" and (not spec.append or spec in SM90_APPEND))))
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


def test_write_path_falls_back():
    hnd = _spec("HND")
    assert kv_write.write_path(hnd, 2, 100, aligned=False) == "head"                # unaligned rows
    assert kv_write.write_path(_spec("HND", D=36), 2, 100, aligned=True) == "head"  # 72-byte rows
    assert kv_write.write_path(_spec("HND", D=36), 4, 100, aligned=True) == "flat"  # fp32: 144 bytes
    assert kv_write.write_path(_spec("NHD", "fp8_e4m3", D=36), 2, 100, True) == "span"
    assert kv_write.write_path(_spec("NHD", "fp8_e4m3", "head", D=36), 2, 100, True) == "head"
    assert kv_write.write_path(hnd, 2, 1 << 30, aligned=True) == "head"             # beyond a 1-D grid
    no_flat = dataclasses.replace(write_config(hnd, 4096, 132), flat=False)
    assert kv_write.write_path(hnd, 2, 4096, aligned=True, config=no_flat) == "head"
    assert kv_write.write_path(_spec("NHD"), 2, 4096, aligned=True, config=no_flat) == "span"
    assert kv_write.write_kind(_spec("NHD", "fp8_e4m3", "head")) == ("NHD", "fp8_head")
    assert kv_write.FLAT_FOR == ALL_FLAT and kv_write.FLAT_MIN_TOKENS == 1  # the measured table: flat everywhere


@pytest.mark.parametrize("layout,kv,scale", [("NHD", "auto", "tensor"), ("HND", "auto", "tensor"),
                                             ("NHD", "fp8_e4m3", "tensor"), ("HND", "fp8_e5m2", "head")])
def test_write_config_choices(layout, kv, scale):
    """write_config: few tokens one pack per thread in CTAs of 128 (span: one pack, head: up to 8 warps);
    from MANY_TOKENS on 4 packs in CTAs of 256 (span 4 packs, head 4 warps), fp8 streaming over one wave."""
    spec = _spec(layout, kv, scale)
    few, many = (write_config(spec, T, 132) for T in (kv_write.MANY_TOKENS - 1, kv_write.MANY_TOKENS))
    assert few == kv_write.WriteConfig(flat=True, items=1, threads=128, stream_waves=0, sm_count=132,
                                       span_packs=1, head_warps=8)
    assert many == kv_write.WriteConfig(flat=True, items=4, threads=256, stream_waves=1 if kv != "auto" else 0,
                                        sm_count=132, span_packs=4, head_warps=4)
    assert write_config(spec, 1, 78).sm_count == 78 and write_config(spec, 65536, 132) == many


def test_flat_launch_follows_config_and_variant():
    """flat_launch: threads capped at the variant's max_threads, items at its max_items unless it
    streams, and the grid capped at stream_waves x SMs x resident CTAs only where the variant streams."""
    cfg = write_config(_spec("HND", "fp8_e4m3"), 65536, 132)
    packs = 65536 * 256
    stream = KvWriteSpec("bf16", "fp8_e4m3", "flat")
    grid, block = kv_write.flat_launch(cfg, stream, packs, resident=lambda threads: 2048 // threads)
    assert block == (256, 1, 1) and grid == (132 * 8, 1, 1)
    grid, block = kv_write.flat_launch(dataclasses.replace(cfg, stream_waves=0.5, threads=512), stream, packs,
                                       resident=lambda threads: 2048 // threads)
    assert block == (256, 1, 1) and grid == (132 * 4, 1, 1)        # the variant's max_threads
    one_shot = KvWriteSpec("bf16", "fp8_e4m3", "flat", stream_items=0, max_items=3)
    grid, block = kv_write.flat_launch(cfg, one_shot, packs, resident=None)  # never asks for occupancy
    assert block == (256, 1, 1) and grid == (-(-packs // (256 * 3)), 1, 1)  # items 4 capped at max_items 3


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
@pytest.mark.parametrize("items,want_threads", [(4, 256), (2, 128), (3, 96), (1, 32), (4, 512), (4, 64)])
def test_flat_grid_covers_every_pack(T, token_packs, items, want_threads):
    """Every pack is some thread's, and the kernel's items = ceil(packs / grid threads) never exceeds
    what the host asked for."""
    grid, block = kv_write.flat_grid(T * token_packs, items, want_threads)
    threads, packs = block[0], T * token_packs
    assert threads % 32 == 0 and 32 <= threads <= want_threads and grid[1:] == (1, 1) and block[1:] == (1, 1)
    assert threads == min(want_threads, -(-packs // (32 * items)) * 32) or threads == 32
    assert (grid[0] - 1) * threads * items < packs <= grid[0] * threads * items
    kernel_items = -(-packs // (grid[0] * threads))
    assert 1 <= kernel_items <= items and grid[0] * threads * kernel_items >= packs
    capped, _ = kv_write.flat_grid(T * token_packs, items, want_threads, max_ctas=7)
    assert capped[0] == min(grid[0], 7)


class _FakeKernel:
    """get_kernel's stand-in for the CPU: records which variant each launch used, with grid and block."""
    launches = []

    def __init__(self, spec):
        self.spec = spec

    def launcher(self, device):
        return self

    def max_active_blocks(self, threads):
        return 2048 // threads

    def __call__(self, grid, block, params):
        self.launches.append((self.spec, grid, block, params[-5]))  # num_tokens: the 4 append fields follow it


@pytest.fixture
def fake_launch(monkeypatch):
    """reshape_and_cache_flash on CPU tensors up to the launch: the kernels are _FakeKernel."""
    monkeypatch.setattr(kv_write, "get_kernel", _FakeKernel)
    monkeypatch.setattr(kv_write, "sm_count", lambda device: 132)
    monkeypatch.setattr(kv_write, "_require_cuda", lambda key_cache: None)
    kv_write._PLANS.clear()
    _FakeKernel.launches = []
    yield _FakeKernel.launches
    kv_write._PLANS.clear()


def _cpu_write(T, kv="auto", layout="HND", overrides=None, H=8, D=128):
    spec = _spec(layout, kv, H=H, D=D)
    kc, vc = spec.allocate("cpu")
    key = torch.zeros(T, H, D, dtype=torch.bfloat16)
    s = torch.ones(1) if kv != "auto" else None
    kv_write.reshape_and_cache_flash(key, key, kc, vc, torch.arange(T), kv, s, s, overrides=overrides)
    return spec


def test_default_launch_is_write_configs(fake_launch):
    _cpu_write(5000, "fp8_e4m3")
    _cpu_write(100)
    (fp8, g1, b1, t1), (copy, g2, b2, t2) = fake_launch
    assert fp8 == KvWriteSpec("bf16", "fp8_e4m3", "flat") and (t1, b1) == (5000, (256, 1, 1))
    assert g1 == (min(-(-5000 * 256 // (4 * 256)), 132 * 2048 // 256), 1, 1)  # capped at one resident wave
    assert copy == KvWriteSpec("bf16", "auto", "flat") and b2 == (128, 1, 1) and g2 == (-(-100 * 256 // 128), 1, 1)


def test_overrides_reach_the_launch(fake_launch):
    """Compile-time overrides pick the variant (and its source), launch-time ones the grid and block;
    each set of overrides gets its own plan, and no override leaks into the next call."""
    _cpu_write(5000, "fp8_e4m3", overrides={"stream_items": 2, "min_blocks": 0, "stream_waves": 0.5,
                                            "threads": 128})
    _cpu_write(300, overrides={"flat": False, "head_warps": 2})
    _cpu_write(300, "fp8_e4m3", "NHD", overrides={"flat": False, "span_packs": 2})
    _cpu_write(300, overrides={"items": 2, "threads": 64})
    _cpu_write(300)
    (v1, g1, b1, _), (v2, g2, b2, _), (v3, g3, b3, _), (v4, g4, b4, _), (v5, g5, b5, _) = fake_launch
    assert variant_name(v1) == "kv_write_bf16_fp8e4m3_flat_stream2_minblocks0"
    assert "kv_write_flat<__nv_bfloat16, uint8_t, pagedattn::Fp8Format::kE4M3, 2, 2>" in Kernel(v1).source
    assert "__launch_bounds__(256)" in Kernel(v1).source
    assert b1 == (128, 1, 1) and g1 == (int(132 * 16 * 0.5), 1, 1)
    assert v2 == KvWriteSpec("bf16", "auto", "head") and (g2, b2) == ((300, 1, 1), (64, 1, 1))
    assert v3 == KvWriteSpec("bf16", "fp8_e4m3", "span") and b3 == (2 * 64, 1, 1)  # 128 packs / 2 per thread
    assert v4 == KvWriteSpec("bf16", "auto", "flat") and b4 == (64, 1, 1) and g4 == (-(-300 * 256 // 128), 1, 1)
    assert v5 == v4 and b5 == (128, 1, 1)
    assert len(kv_write._PLANS) == 5


@pytest.mark.parametrize("overrides,match", [
    ({"itemz": 2}, "overrides: unknown itemz; compile-time: max_items"),
    ([("items", 2)], "overrides must be a mapping"),
    ({"max_items": 1}, "overrides: kv_write: max_items=1"),
])
def test_bad_overrides_are_refused(overrides, match, fake_launch):
    with pytest.raises(ContractError, match=match):
        _cpu_write(8, overrides=overrides)
    assert not fake_launch


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


@pytest.fixture
def plans():
    """An empty plan cache for the test (it inspects the plan its writes made)."""
    kv_write._PLANS.clear()
    yield kv_write._PLANS
    kv_write._PLANS.clear()


@pytest.fixture(params=["base", "flat"])
def force_path(request, plans):
    """The overrides of a path: base: every write takes span/head; flat: every write whose rows are
    aligned takes flat (the others, e.g. source=unaligned, must fall back to span/head)."""
    return request.param, {"flat": request.param == "flat"}


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
    path, overrides = force_path
    kc, vc = _check_against_reference(spec, key, value, slots, kv, ks, vs, overrides)
    # rerun: bit-identical
    kc2, vc2 = spec.allocate("cuda", fill=float("nan"))
    kv_write.reshape_and_cache_flash(key, value, kc2, vc2, slots, kv, ks, vs, overrides=overrides)
    assert torch.equal(bits(kc2), bits(kc)) and torch.equal(bits(vc2), bits(vc))
    # the forced path is the one that ran (unaligned rows fall back to span/head)
    (plan,) = kv_write._PLANS.values()
    if path == "flat" and source != "unaligned":
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


def _check_against_reference(spec, key, value, slots, kv, ks, vs, overrides=None):
    """Write (with these overrides) into NaN-poisoned caches; written slots must equal the reference
    bit for bit and every other slot must still be poisoned. Returns the written caches."""
    kc, vc = spec.allocate("cuda", fill=float("nan"))
    rk, rv = kc.clone(), vc.clone()
    kv_write.reshape_and_cache_flash(key, value, kc, vc, slots, kv, ks, vs, overrides=overrides)
    reference.reshape_and_cache_flash(key, value, rk, rv, slots, kv, ks, vs)
    torch.cuda.synchronize()
    assert torch.equal(bits(kc), bits(rk)) and torch.equal(bits(vc), bits(rv))
    written = torch.zeros(spec.num_slots, dtype=torch.bool, device="cuda")
    s = slots.long()
    written[s[s >= 0]] = True
    unwritten = kc[(~written).view(spec.num_blocks, spec.block_size)]  # [n, H, D] whatever the layout
    assert (unwritten.view(torch.uint8) == 0x7F).all() if kv != "auto" else unwritten.isnan().all()
    return kc, vc


@pytest.mark.gpu
@pytest.mark.parametrize("max_items", [4, 3])
@pytest.mark.parametrize("items", [1, 2, 4])
@pytest.mark.parametrize("threads", [32, 96, 512])
@pytest.mark.parametrize("layout,kv,scale", [("NHD", "auto", "tensor"), ("HND", "auto", "tensor"),
                                             ("HND", "fp8_e4m3", "head"), ("NHD", "fp8_e5m2", "head")])
@pytest.mark.parametrize("T,H,D,dtype", [(1, 1, 64, torch.bfloat16), (5, 3, 72, torch.float16),
                                         (1500, 3, 80, torch.bfloat16), (4099, 8, 128, torch.bfloat16),
                                         (2000, 2, 36, torch.float32)])
def test_flat_many_tokens(max_items, items, threads, layout, kv, scale, T, H, D, dtype, plans):
    """Flat with kItems 4 and 3 (copies; fp8 variants keep theirs, cap CTAs at their max_threads, 256,
    and stream their many-token writes), packs per thread 1, 2 and 4 (capped at kItems), CTAs of 1, 3
    and 16 warps: token counts below and above MANY_TOKENS, odd H, rows of 9 and 10 packs."""
    overrides = {"flat": True, "items": items, "threads": threads, **({"max_items": max_items} if kv == "auto" else {})}
    gen = torch.Generator("cuda").manual_seed(T * 7 + threads)
    bs = 16
    spec = CacheSpec(-(-2 * T // bs) + 1, bs, H, D, dtype if kv == "auto" else torch.uint8, kv, layout, scale)
    assert kv_write.write_path(spec, torch.empty(0, dtype=dtype).element_size(), T, True) == "flat"
    key, value = make_inputs(T, H, D, dtype, "strided", True, gen)
    slots = torch.randperm(spec.num_slots, device="cuda", generator=gen)[:T]
    slots[torch.rand(T, device="cuda", generator=gen) < 0.2] = -1
    ks, vs = _random_scales(kv, scale, H, gen)
    _check_against_reference(spec, key, value, slots, kv, ks, vs, overrides)
    _check_against_reference(spec, key, value, slots.int(), kv, ks, vs, overrides)  # int32 slot ids
    assert len(plans) == 2 and all(p.base is None for p in plans.values())
    want = max_items if kv == "auto" else kv_write.FLAT_BUILD["fp8"]["max_items"]
    assert all(p.flat_spec.build["max_items"] == want for p in plans.values())


@pytest.mark.gpu
@pytest.mark.parametrize("waves", [1, 0.02])
@pytest.mark.parametrize("stream_items", [4, 2, 1])
@pytest.mark.parametrize("layout,kv,scale", [("NHD", "fp8_e4m3", "tensor"), ("HND", "fp8_e4m3", "head"),
                                             ("HND", "fp8_e5m2", "tensor")])
@pytest.mark.parametrize("T,H,D,dtype", [(1500, 3, 80, torch.bfloat16), (4099, 8, 128, torch.bfloat16),
                                         (2000, 2, 32, torch.float32), (1024, 1, 64, torch.float16),
                                         (1100, 2, 72, torch.bfloat16)])
def test_flat_streaming(waves, stream_items, layout, kv, scale, T, H, D, dtype, plans):
    """The streaming schedule (a grid capped at `waves` resident waves: 1, or a few CTAs so that every
    thread loops over many batches), batches of 4, 2 and 1 items, items of two packs (rows of 10, 16 and
    8 packs) and of one (D=72 bf16: 9 packs), against the reference bit for bit."""
    overrides = {"flat": True, "stream_waves": waves, "stream_items": stream_items}
    gen = torch.Generator("cuda").manual_seed(T * 3 + stream_items)
    bs = 16
    spec = CacheSpec(-(-2 * T // bs) + 1, bs, H, D, torch.uint8, kv, layout, scale)
    key, value = make_inputs(T, H, D, dtype, "strided", True, gen)
    slots = torch.randperm(spec.num_slots, device="cuda", generator=gen)[:T]
    slots[torch.rand(T, device="cuda", generator=gen) < 0.2] = -1
    ks, vs = _random_scales(kv, scale, H, gen)
    _check_against_reference(spec, key, value, slots, kv, ks, vs, overrides)
    (plan,) = plans.values()
    shape = plan.shapes[T]
    (grid, _, _), (threads, _, _) = shape.flat
    assert plan.base is None and plan.flat_spec.build["stream_items"] == stream_items
    resident = plan.flat.max_active_blocks(threads)
    assert shape.config.stream_waves == waves and grid <= max(1, int(shape.config.sm_count * resident * waves))
    if waves < 1:  # a few CTAs: every thread loops over many batches
        assert grid < -(-T * plan.token_packs // (shape.config.items * threads)), "should stream"


@pytest.mark.gpu
@pytest.mark.parametrize("D,offset", [(36, 0), (64, 1), (64, 0)])
def test_flat_fallback_rows_not_aligned(D, offset, plans):
    """bf16 D=36 (72-byte rows) and an unaligned base take span/head, aligned ones flat; the same plan
    serves calls whose base pointers differ in alignment."""
    T, H = 300, 4
    spec = CacheSpec(32, 16, H, D, torch.bfloat16, "auto", "HND")
    flat = torch.randn(2 * T * H * D + 16, dtype=torch.bfloat16, device="cuda")
    for off in (offset, 0, offset):  # one cached plan, alignment decided per call
        key = flat[off:off + T * H * D].view(T, H, D)
        value = flat[T * H * D + off:2 * T * H * D + off].view(T, H, D)
        _check_against_reference(spec, key, value, torch.randperm(spec.num_slots, device="cuda")[:T],
                                 "auto", None, None)
    (plan,) = plans.values()
    assert (plan.flat is None) == (D == 36) and (plan.base is not None) == (D == 36 or offset == 1)


@pytest.mark.gpu
def test_corrupt_slot_is_never_written(force_path):
    _, overrides = force_path
    spec = CacheSpec(4, 16, 2, 64, torch.float16)
    kc, vc = spec.allocate("cuda", fill=float("nan"))
    guard = torch.full((1 << 16,), 7.0, dtype=torch.float16, device="cuda")  # memory after the cache
    key = torch.randn(3, 2, 64, dtype=torch.float16, device="cuda")
    slots = torch.tensor([spec.num_slots, 2**40, 3], device="cuda")
    kv_write.reshape_and_cache_flash(key, key, kc, vc, slots, overrides=overrides)
    torch.cuda.synchronize()
    assert (guard == 7.0).all()
    assert kc.reshape(-1, 2, 64)[3].eq(key[2]).all()
    assert kc.reshape(-1, 2, 64)[torch.arange(64, device="cuda") != 3].isnan().all()
    with pytest.raises(ContractError, match=r"slot_mapping\[0\]"):
        kv_write.reshape_and_cache_flash(key, key, kc, vc, slots, validate=True, overrides=overrides)


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
    from pagedattn.ops.kv_write import base_threads

    nhd = CacheSpec(8, 16, 8, 128, torch.bfloat16)
    hnd = CacheSpec(8, 16, 8, 128, torch.bfloat16, layout="HND")
    few, many = write_config(nhd, 256, 132), write_config(nhd, 65536, 132)
    assert base_threads(nhd, "span", 2, few) == 256   # one 16-byte pack per thread
    assert base_threads(nhd, "span", 2, many) == 64   # four packs per thread
    assert base_threads(hnd, "head", 2, few) == 256   # a warp per head
    assert base_threads(hnd, "head", 2, many) == 128  # four warps, two heads each
    tiny = CacheSpec(8, 16, 1, 64, torch.float16)
    assert base_threads(tiny, "span", 2, many) == 64  # at least a warp per tensor


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
