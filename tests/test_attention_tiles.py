"""Tiles per arch on the CPU: every tile fits the shared memory of the arch it is built for, and the
variant the plan and the registry build for an arch carries that arch's tiles (issue 20: sm_86/sm_89
give a CTA only 99 KiB)."""
import importlib.resources
import itertools
import re

import pytest

from pagedattn.codegen.compile import SUPPORTED_ARCHS
from pagedattn.ops import attention
from pagedattn.ops.attention import AttnFwdSpec, heuristics, tiles
from pagedattn.registry import Kernel, UnsupportedError

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a")
SM90_ONLY = (*tiles.TMA_MODES, "prefill_wgmma")
KV = ("auto", "fp8_e4m3")


def _valid(kv, d, mode):
    """(dtype, kv, head dim, mode) the family compiles at all (AttnFwdSpec.check's rules)."""
    try:
        AttnFwdSpec("bf16", kv, d, mode)
    except UnsupportedError:
        return False
    return True


def _runs(mode, arch):
    return mode not in SM90_ONLY or arch == "sm_90a"


def test_the_table_names_every_arch():
    assert set(SUPPORTED_ARCHS) == set(ARCHS) == set(tiles.SMEM_PER_CTA)
    assert tiles.SMEM_PER_CTA["sm_86"] == tiles.SMEM_PER_CTA["sm_89"] == 99 * 1024
    assert tiles.SMEM_LIMIT == tiles.SMEM_PER_CTA["sm_90a"] == 227 * 1024


@pytest.mark.parametrize("arch", ARCHS)
def test_every_tile_fits_its_arch(arch):
    limit = tiles.SMEM_PER_CTA[arch]
    checked = 0
    for d, mode, kv in itertools.product(tiles.HEAD_DIMS, tiles.MODES, KV):
        if not _valid(kv, d, mode) or not _runs(mode, arch):
            continue
        fp8 = kv != "auto"
        try:
            cfg = tiles.tile_config(d, mode, fp8, arch)
        except UnsupportedError:  # refused by name, never built there: only prefill at d512 on 99 KiB
            assert (d, mode, limit) == (512, "prefill", 99 * 1024), (arch, d, mode, kv)
            assert not AttnFwdSpec("bf16", kv, d, mode).supports_arch(arch)
            continue
        assert tiles.smem_bytes(cfg, d, fp8) <= limit, (arch, d, mode, kv, cfg)
        checked += 1
    assert checked >= 24


def test_the_defaults_stay_on_sm80_and_sm90a():
    """sm_80 and sm_90a compile one source per variant: the measured tiles, unchanged."""
    for d, mode, kv in itertools.product(tiles.HEAD_DIMS, tiles.MODES, KV):
        if not _valid(kv, d, mode):
            continue
        fp8 = kv != "auto"
        default = tiles.tile_config(d, mode, fp8)
        assert tiles.tile_config(d, mode, fp8, "sm_90a") == default
        if _runs(mode, "sm_80"):
            assert tiles.tile_config(d, mode, fp8, "sm_80") == default
            assert not AttnFwdSpec.for_arch("sm_80", "bf16", kv, d, mode).small_smem
        assert not AttnFwdSpec.for_arch("sm_90a", "bf16", kv, d, mode).small_smem


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("d", (192, 256))
def test_large_decode_tiles_shrink_on_99_kib_archs(d, kv):
    """The bug of issue 20: 102 KiB (d192) and 136 KiB (d256) of decode tiles on sm_86/sm_89."""
    fp8 = kv != "auto"
    default = tiles.tile_config(d, "decode", fp8)
    assert tiles.smem_bytes(default, d, fp8) > 99 * 1024
    for arch in ("sm_86", "sm_89"):
        small = tiles.tile_config(d, "decode", fp8, arch)
        assert small["kWarpsN"] < default["kWarpsN"]
        assert {k: v for k, v in small.items() if k != "kWarpsN"} == {k: v for k, v in default.items()
                                                                       if k != "kWarpsN"}
        spec = AttnFwdSpec.for_arch(arch, "bf16", kv, d, "decode")
        assert spec.small_smem and spec.tiles == small and spec.dynamic_smem() <= 99 * 1024
        assert spec.supports_arch(arch) and not spec.supports_arch("sm_80") and not spec.supports_arch("sm_90a")
        # the default variant is no longer built where it cannot load
        assert not AttnFwdSpec("bf16", kv, d, "decode").supports_arch(arch)
        assert "static constexpr int kBytes = %d;\n" % spec.dynamic_smem() in Kernel(spec).source


def test_every_registered_variant_holds_its_archs_tiles():
    """For each arch the registry (AOT plans, Kernel.artifact) builds a variant for, the variant's
    tiles are tile_config's for that arch and fit it; and for every call shape the plan can meet on an
    arch, the variant it builds (for_arch) is registered and built for that arch."""
    variants = set(AttnFwdSpec.all_variants())
    for spec in variants:
        fp8 = spec.kv_cache_dtype != "auto"
        built = [a for a in ARCHS if spec.supports_arch(a)]
        assert built, spec
        for arch in built:
            assert spec.tiles == tiles.tile_config(spec.head_dim, spec.mode, fp8, arch), (spec, arch)
            assert spec.dynamic_smem() <= tiles.SMEM_PER_CTA[arch], (spec, arch)
    for dtype, kv, d, mode, fs in itertools.product(("fp16", "bf16"), AttnFwdSpec.SUPPORTED["kv_cache_dtype"],
                                                    tiles.HEAD_DIMS, tiles.MODES, attention.FEATURE_SETS):
        if not _valid(kv, d, mode) or not AttnFwdSpec("bf16", kv, d, mode).dispatched:
            continue
        flags = tuple(f in fs.split("+") for f in attention.FEATURES)
        for arch in ARCHS:
            if not _runs(mode, arch):
                continue
            try:
                spec = AttnFwdSpec.for_arch(arch, dtype, kv, d, mode, flags)
            except UnsupportedError:  # a clear error for the call: prefill at d512 on the 99 KiB archs
                assert (d, mode, tiles.SMEM_PER_CTA[arch]) == (512, "prefill", 99 * 1024), (arch, d, mode)
                continue
            assert spec in variants and spec.supports_arch(arch), (spec, arch)


def test_the_plan_builds_the_arch_variant(monkeypatch):
    """_Plan.kernel on an sm_86 device: the small_smem decode variant at d256, the default at d128."""
    built = []

    class FakeKernel:
        def __init__(self, spec):
            built.append(spec)

        def launcher(self, device):
            return None

    monkeypatch.setattr(attention, "get_kernel", FakeKernel)
    monkeypatch.setattr(attention, "sm_count", lambda device: 84)
    for d, small in ((256, True), (192, True), (128, False)):
        plan = attention._Plan.__new__(attention._Plan)
        plan.arch, plan.device, plan.dtype, plan.head_dim, plan._kernels = "sm_86", 0, "bf16", d, {}
        plan.call = attention._Call(1, 8, 8, d, True, "auto", (0, 0, 0), (0, 0, 0), 4, 16)
        variant = plan.kernel("decode")
        assert built[-1].small_smem is small and variant.spec is built[-1]
        assert variant.stage_keys == built[-1].tiles["kBlockN"] * built[-1].tiles["kWarpsN"]


def test_a_tile_that_cannot_fit_is_refused(monkeypatch):
    monkeypatch.setitem(tiles.SMEM_PER_CTA, "sm_86", 16 * 1024)
    with pytest.raises(UnsupportedError, match=r"no decode tile fits in shared memory at head_dim 256.*sm_86"):
        tiles.tile_config(256, "decode", False, "sm_86")
    with pytest.raises(UnsupportedError, match="no shared-memory size known for arch 'sm_75'"):
        tiles.tile_config(128, "decode", False, "sm_75")
    assert not AttnFwdSpec("bf16", "auto", 256, "decode").supports_arch("sm_86")


def test_small_smem_only_where_the_tiles_differ():
    for args in (("bf16", "auto", 128, "decode"), ("bf16", "auto", 256, "prefill"),
                 ("bf16", "auto", 256, "decode_tma"), ("bf16", "auto", 128, "prefill_wgmma")):
        with pytest.raises(UnsupportedError, match="small_smem"):
            AttnFwdSpec(*args, small_smem=True)
    # names of the default variants are unchanged; the twins say what they are
    assert Kernel(AttnFwdSpec("bf16", "auto", 256, "decode")).name == "attn_fwd_bf16_kvauto_d256_decode"
    assert Kernel(AttnFwdSpec("bf16", "auto", 256, "decode", small_smem=True)).name == \
        "attn_fwd_bf16_kvauto_d256_decode_small_smem"


def test_one_split_cap():
    """heuristics.MAX_SPLITS: the forced cap, twice the heuristic's, and what the combine holds."""
    source = Kernel(AttnFwdSpec("bf16", "auto", 128, "decode")).source
    assert re.search(r"#define PAGEDATTN_MAX_SPLITS (\d+)", source).group(1) == str(heuristics.MAX_SPLITS)
    header = (importlib.resources.files("pagedattn.templates") / "include/pagedattn/split_combine.cuh").read_text()
    assert "kMaxChunks = PAGEDATTN_MAX_SPLITS / 32;" in header
    assert heuristics.MAX_SPLITS == attention.MAX_SPLITS
    assert heuristics.splits_for(10 ** 6, 1, 10 ** 9, 16, 132) == heuristics.MAX_SPLITS
    assert heuristics.splits_for(0, 1, 10 ** 9, 16, 10 ** 6) <= heuristics.MAX_SPLITS // 2


def test_mode_choice_is_pure():
    pick = lambda rows: heuristics.mode_for(rows, "decode_tma", "prefill_wgmma", 128)  # noqa: E731
    assert [pick(r) for r in (1, 16, 17, 128, 129)] == ["decode_tma", "decode_tma", "prefill", "prefill",
                                                        "prefill_wgmma"]
    assert heuristics.mode_for(4096, "decode", "prefill", 128) == "prefill"
    # multi-token decode between one decode tile and MULTI_ROWS, when the plan has a multi mode
    multi = lambda rows, m: heuristics.mode_for(rows, "decode_tma", "prefill_wgmma", 128, m)  # noqa: E731
    top = heuristics.MULTI_ROWS
    assert [multi(r, "multi_tma") for r in (16, 17, top, top + 1)] == ["decode_tma", "multi_tma", "multi_tma",
                                                                       "prefill"]
    assert multi(17, None) == "prefill"
    # prefill_ws, where the plan has it, above WS_ROWS (multi-token decode below)
    ws = lambda rows: heuristics.mode_for(rows, "decode_tma", "prefill_ws", 128, "multi_tma")  # noqa: E731
    assert [ws(r) for r in (16, heuristics.WS_ROWS, heuristics.WS_ROWS + 1, 129)] == \
        ["decode_tma", "multi_tma", "prefill_ws", "prefill_ws"]
    # an fp8 cache's multi is the cp.async one: it keeps the rows up to MULTI_ROWS
    ws8 = lambda rows: heuristics.mode_for(rows, "decode_tma", "prefill_ws", 128, "multi")  # noqa: E731
    assert [ws8(r) for r in (heuristics.WS_ROWS + 1, top, top + 1, 129)] == \
        ["multi", "multi", "prefill", "prefill_ws"]


def test_multi_token_decode_modes():
    """multi / multi_tma: the decode tiles with 32 rows per warp, up to MAX_HEAD_DIM_MULTI; multi_tma only
    for 16-bit caches on sm_90a; the plan picks multi_tma where TMA decode applies to a 16-bit cache."""
    for mode in ("multi", "multi_tma"):
        cfg = tiles.tile_config(128, mode)
        assert (cfg["kBlockM"], cfg["kWarpsM"], cfg["kWarpsN"], cfg["kTma"]) == (32, 1, 4, mode == "multi_tma")
        with pytest.raises(UnsupportedError, match=f"mode={mode} supports head dims up to 128"):
            tiles.tile_config(256, mode)
    with pytest.raises(UnsupportedError, match="multi_tma needs a 16-bit cache"):
        AttnFwdSpec("bf16", "fp8_e4m3", 128, "multi_tma")
    assert AttnFwdSpec("bf16", "fp8_e4m3", 128, "multi").supports_arch("sm_80")
    assert not AttnFwdSpec("bf16", "auto", 128, "multi_tma").supports_arch("sm_80")
    call = lambda kv, bs=16: attention._Call(1, 32, 8, 128, True, kv, (0, 0, 0), (0, 0, 0), 4, bs)  # noqa: E731
    pick = lambda c, arch, d: heuristics.multi_mode(c, d, heuristics.tma_ok(c, arch, d))  # noqa: E731
    assert pick(call("auto"), "sm_90a", 128) == "multi_tma"
    assert pick(call("fp8_e4m3"), "sm_90a", 128) == "multi"
    assert pick(call("auto", 8), "sm_90a", 128) == "multi"   # pages of 8: no TMA
    assert pick(call("auto"), "sm_80", 64) == "multi"
    assert pick(call("auto"), "sm_90a", 256) is None


def test_former_names_still_import():
    """The package keeps the former module's names (imports and monkeypatch targets)."""
    from pagedattn.ops.attention import (_PLANS, FEATURE_SETS, MODES, SMEM_LIMIT, _Call, _descale_strides,  # noqa: F401
                                         _int32_vector, check_unsupported, check_values, choose_splits,
                                         features_of, flash_attn_varlen_func, kernel_head_dim, smem_bytes,
                                         split_capacity, tile_config, tma_maps, tma_ok, validate, wgmma_ok)
    assert callable(validate) and attention.validate is validate  # the function, not the submodule
    assert not hasattr(attention, "_UNSUPPORTED_KW")


@pytest.mark.gpu
@pytest.mark.parametrize("D,kv,splits", [(256, "auto", 0), (192, "fp8_e4m3", 3)])
def test_small_smem_decode_matches_reference(D, kv, splits, monkeypatch):
    """The decode tiles of sm_86/sm_89 (fewer warps over the keys), compiled for this GPU: the plan
    is made to build the small_smem twin (registered for sm_86/sm_89 only) with the cp.async loader."""
    import torch

    from pagedattn import reference
    from test_attention import build_case, rel_l2

    for_arch = AttnFwdSpec.for_arch.__func__
    monkeypatch.setattr(AttnFwdSpec, "for_arch",
                        classmethod(lambda cls, arch, *a, **k: for_arch(cls, "sm_86", *a, **k)))
    monkeypatch.setattr(AttnFwdSpec, "supports_arch", lambda self, arch: True)
    with attention.forced(tma=False):
        gen = torch.Generator().manual_seed(20 + D)
        lens_q, lens_k = [1, 1, 1], [300, 1000, 37]
        case = build_case(lens_q, lens_k, 8, 2, D, 16, "NHD", torch.bfloat16, kv, "tensor", gen)
        o = attention.flash_attn_varlen_func(case["q"], case["kc"], case["vc"], 1, case["cu_q"], max(lens_k),
                                             seqused_k=case["seqused"], block_table=case["table"],
                                             num_splits=splits, k_descale=case["ks"], v_descale=case["vs"],
                                             kv_cache_dtype=kv)
        (plan,) = attention._PLANS.values()
        (variant,) = plan._kernels.values()
        assert variant.spec.small_smem and variant.spec.mode == "decode" and variant.spec.dynamic_smem() <= 99 * 1024
        args = (case["q"], case["kc"], case["vc"], case["cu_q"], case["seqused"], case["table"])
        kw = dict(kv_cache_dtype=kv, k_descale=case["ks"], v_descale=case["vs"])
        ref = reference.paged_attention(*args, **kw, compute_dtype=torch.float64)
        low = reference.paged_attention(*args, **kw, compute_dtype=torch.bfloat16)
        assert not o.isnan().any(), "NaN in the output"
        err, err_low = rel_l2(o, ref), rel_l2(low.to(torch.bfloat16), ref)
        assert err <= max(2 * err_low, 2e-3) and err < 2e-2, (err, err_low)


# mainloop_sm80.cuh writes some CuTe fragment, accumulator and register-view layouts out (Sm80Frags,
# Sm80AccLayout) instead of deriving them: cheaper for the compiler's front end, and only right while they
# equal what CuTe derives. PAGEDATTN_CHECK_TYPES=1 static_asserts each against CuTe's; the front end alone
# (-fdevice-syntax-only) runs those asserts, and those of the ldmatrix copies' written shared-memory
# offsets (Sm80Ldsm: every thread, copy and k-step against CuTe's partition, in swizzle atoms of 64, 32
# and 16 columns). One variant per kind of tile: decode and prefill d128 (one and four warps per
# group), prefill d256 (four 64-column atoms), prefill d192 (three), d64 (one), d80 and d96 (16- and
# 32-column atoms; multi: two MMA tiles per warp), TMA decode d512 (eight atoms, two column groups) and
# multi_tma d128 (two MMA tiles per warp, Q kept in registers). The wgmma mainloops' written
# accumulators, coordinates and descriptor fragments (WgmmaTiles, attn_wgmma.cuh): prefill_wgmma (four
# warpgroups) and prefill_ws (two; d64: one 64-column panel; d96: three 32-column ones; d80: five
# 16-column ones; fp8: fp16 tiles beside a bf16 Q). Each
# check is 3-16 s of one core: `make test` runs one of each kind (atom width, warps per group, multi,
# column groups, wgmma), `make test-all` the other head dims and dtypes too (marked slow).
_CHECK_OPTIONS = ("-fdevice-syntax-only", "-DPAGEDATTN_CHECK_TYPES=1", "-DPAGEDATTN_CHECK_TYPES_ONLY=1")


def _check(arch, dtype, d, mode, slow=False, kv="auto"):
    """A check build's parameters; the NVRTC farm compiles it in parallel with the others (`compiles`)."""
    spec = AttnFwdSpec.for_arch(arch, dtype, kv, d, mode)
    return pytest.param(arch, spec, marks=[pytest.mark.compiles((spec, arch, _CHECK_OPTIONS))]
                        + ([pytest.mark.slow] if slow else []),
                        id=f"{arch}-{dtype}-{d}-{mode}" + ("" if kv == "auto" else f"-{kv}"))


@pytest.mark.parametrize("arch,spec", [_check("sm_80", "bf16", 128, "decode"),
                                       _check("sm_80", "bf16", 128, "prefill", slow=True),
                                       _check("sm_80", "fp16", 256, "prefill"),
                                       _check("sm_80", "bf16", 192, "prefill", slow=True),
                                       _check("sm_80", "bf16", 64, "decode"),
                                       _check("sm_80", "fp16", 64, "prefill", slow=True),
                                       _check("sm_80", "bf16", 80, "decode", slow=True),
                                       _check("sm_80", "fp16", 80, "prefill", slow=True),
                                       _check("sm_80", "bf16", 80, "multi"), _check("sm_80", "fp16", 96, "decode"),
                                       _check("sm_80", "bf16", 96, "prefill", slow=True),
                                       _check("sm_80", "fp16", 96, "multi", slow=True),
                                       _check("sm_90a", "bf16", 512, "decode_tma"),
                                       _check("sm_90a", "bf16", 128, "multi_tma", slow=True),
                                       _check("sm_90a", "bf16", 128, "prefill_wgmma"),
                                       _check("sm_90a", "fp16", 256, "prefill_ws"),
                                       _check("sm_90a", "bf16", 128, "prefill_ws", kv="fp8_e4m3"),  # fp16 tiles
                                       _check("sm_90a", "bf16", 64, "prefill_ws", slow=True),
                                       _check("sm_90a", "bf16", 96, "prefill_ws"),  # 32-column panels (opt-in)
                                       _check("sm_90a", "fp16", 80, "prefill_ws"),  # 16-column panels (opt-in)
                                       _check("sm_90a", "bf16", 96, "decode_tma"),  # narrow TMA decode (opt-in)
                                       _check("sm_90a", "fp16", 80, "multi_tma", slow=True)])
def test_written_sm80_layouts_are_cutes(arch, spec):
    from pagedattn.codegen.compile import compile_source, nvrtc_options
    from pagedattn.codegen.toolchain import toolchain
    k = Kernel(spec)
    compile_source(k.source, variant=k.name, arch=arch, options=nvrtc_options(arch, toolchain()) + list(_CHECK_OPTIONS))


_DESC_OPTIONS = ("-DPAGEDATTN_CHECK_DESCS=1",)


def _descs(dtype, d, mode, kv="auto", slow=False):
    spec = AttnFwdSpec(dtype, kv, d, mode)
    return pytest.param(spec, marks=[pytest.mark.compiles((spec, "sm_90a", _DESC_OPTIONS))]
                        + ([pytest.mark.slow] if slow else []), id=f"{dtype}-{d}-{mode}-{kv}")


@pytest.mark.parametrize("spec", [_descs("bf16", 96, "prefill_ws"), _descs("fp16", 80, "prefill_ws"),
                                  _descs("bf16", 128, "prefill_ws"),
                                  _descs("fp16", 64, "prefill_ws", slow=True), _descs("bf16", 256, "prefill_ws", slow=True),
                                  _descs("bf16", 128, "prefill_ws", "fp8_e4m3", slow=True),
                                  _descs("bf16", 192, "prefill_wgmma", slow=True)])
def test_written_wgmma_descriptors_are_cutes(spec):
    """The values of WgmmaTiles' written descriptors (layout type, leading and stride byte offsets, start
    address, every k-step) equal make_gmma_desc's for CuTe's partitions of the same tiles, and the tiles the
    loaders write (Traits' layouts) are the GMMA layouts they describe: check_wgmma_descs, a full compile in
    which each comparison folds to a constant and an unequal one leaves a call to a function defined
    nowhere (ptxas fails). Head dims 96 and 80 check the 64- and 32-byte swizzles' 32- and 16-column panels."""
    from pagedattn.codegen.compile import compile_source, nvrtc_options
    from pagedattn.codegen.toolchain import toolchain
    k = Kernel(spec)
    res = compile_source(k.source, variant=k.name, arch="sm_90a",
                         options=nvrtc_options("sm_90a", toolchain()) + list(_DESC_OPTIONS))
    assert res.cubin[:4] == b"\x7fELF"


@pytest.mark.slow
@pytest.mark.parametrize("base,verdict", [("HEAD", "same"), ("9baa7eb", "differs")])
def test_sass_since_tells_unchanged_kernels_from_changed_ones(base, verdict, tmp_path):
    """tests/tools/sass_since.py: against HEAD every kernel of the selection has its own SASS; against
    9baa7eb (before 049ffed took a stack store out of every kernel's set-up) each one differs. Needs
    nvdisasm (NVDISASM=..., or on PATH)."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    if not (os.environ.get("NVDISASM") or shutil.which("nvdisasm") or Path("/usr/local/cuda/bin/nvdisasm").exists()):
        pytest.skip("needs nvdisasm")
    tool = Path(__file__).parent / "tools" / "sass_since.py"
    out = tmp_path / "record.json"
    subprocess.run([sys.executable, str(tool), "--base", base, "--modes", "decode", "--head-dims", "64",
                    "--jobs", "2", "--out", str(out)], check=True)
    record = json.loads(out.read_text())
    assert record["kernels"] == 8, record
    assert {v.split(":")[0] for v in record["verdicts"].values()} == {verdict}, record["verdicts"]
