"""The JIT layer: render, NVRTC, cache (miss/hit, corruption, races, read-only), JIT-off, headers."""
import errno
import hashlib
import json
import logging
import multiprocessing as mp
import os
import re
import shutil
import time
import traceback
from pathlib import Path

import jinja2
import pytest

from pagedattn.codegen import cache as kcache
from pagedattn.codegen import render as krender
from pagedattn.codegen import toolchain as ktool
from pagedattn.codegen.compile import compile_source, nvrtc_options, program_key, program_source
from pagedattn.codegen.errors import CompileError, MissingKernelError, ToolchainError
from pagedattn.ops.kv_write import KvWriteSpec
from pagedattn.registry import Kernel, all_specs, get_kernel


SPAN = KvWriteSpec("bf16", "auto", "span")  # the kernel of most tests here
HEAD16 = KvWriteSpec("fp16", "auto", "head")  # a second one


def _kernel():
    return Kernel(SPAN)


def test_render_is_deterministic():
    a = Kernel(KvWriteSpec("fp16", "fp8_e4m3", "head")).source
    b = Kernel(KvWriteSpec("fp16", "fp8_e4m3", "head")).source
    assert a == b
    assert "Fp8Format::kE4M3" in a and "__half" in a


def test_entry_points_are_unique_c_names():
    """A kernel's entry point is its variant name (kernels share NVRTC programs in bundles)."""
    names = [get_kernel(spec).name for spec in all_specs()]
    assert len(set(names)) == len(names)
    assert all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n) for n in names)
    assert "\nkv_write_bf16_fp8e4m3_span(const __grid_constant__" in get_kernel(
        KvWriteSpec("bf16", "fp8_e4m3", "span")).source


def test_program_source_namespaces_each_body():
    a, b = (get_kernel(KvWriteSpec("bf16", "auto", p)) for p in ("span", "head"))
    src = program_source([a.source, b.source])
    assert src.count('#include "pagedattn/kv_write.cuh"') == 1
    assert "namespace pagedattn_program_0 {" in src and "namespace pagedattn_program_1 {" in src
    assert src.index(a.name + "(") < src.index("namespace pagedattn_program_1") < src.index(b.name + "(")
    wgmma = next(s for s in all_specs(["attn_fwd"]) if s.mode == "prefill_wgmma")
    decode = next(s for s in all_specs(["attn_fwd"]) if s.mode == "decode")
    assert program_key(get_kernel(wgmma).source) != program_key(get_kernel(decode).source)
    with pytest.raises(ValueError, match="preambles"):
        program_source([a.source, get_kernel(decode).source])


def test_render_strict_undefined():
    with pytest.raises(jinja2.UndefinedError):
        krender.render("kv_write.cu.j2", variant_name="x")


@pytest.mark.compiles((SPAN, "sm_80"), (SPAN, "sm_90a"))
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_nvrtc_compiles_cute_template(arch):
    k = _kernel()
    tc = ktool.toolchain()
    res = compile_source(k.source, variant=k.name, arch=arch, options=nvrtc_options(arch, tc))
    assert res.cubin[:4] == b"\x7fELF"
    assert k.name.encode() in res.cubin  # the entry point is named after the variant


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _block_cache_dir(tmp_path, monkeypatch) -> Path:
    """A cache dir that cannot be created (a file stands in its way): works as root too."""
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", str(blocker / "cache"))
    return blocker / "cache"


@pytest.mark.parametrize("where", ["cache_dir", "temp_file"])
def test_compile_error_shows_log_and_source(fresh_cache, where, tmp_path, monkeypatch):
    """The message holds NVRTC's log and the path of a file with the rendered source; with an unusable
    cache dir that file is a temp file."""
    if where == "temp_file":
        _block_cache_dir(tmp_path, monkeypatch)
    bad = "extern \"C\" __global__ void k() { this_is_not_defined(); }\n"
    with pytest.raises(CompileError) as info:
        fresh_cache.get("broken_kernel", bad, "sm_90a")
    err, msg = info.value, str(info.value)
    assert "this_is_not_defined" in err.log and err.log in msg
    assert err.source_path and f"rendered source kept at: {err.source_path}" in msg
    kept = Path(err.source_path)
    assert kept.is_file() and kept.read_text() == bad
    if where == "cache_dir":
        assert kept.parent.parent == tmp_path / "cache" and kept.name == "source.cu"
    else:
        assert tmp_path not in kept.parents and kept.name.startswith("pagedattn-broken_kernel-")
        kept.unlink()


def test_unknown_arch_is_rejected():
    with pytest.raises(ToolchainError, match="sm_70"):
        nvrtc_options("sm_70", ktool.toolchain())


@pytest.mark.compiles((SPAN, "sm_90a"))
def test_miss_then_hit(fresh_cache):
    k = _kernel()
    a = fresh_cache.get(k.name, k.source, "sm_90a")
    assert a.origin == "jit-compiled" and fresh_cache.compiles == 1
    again = fresh_cache.get(k.name, k.source, "sm_90a")
    assert again is a and fresh_cache.compiles == 1  # memory hit
    other_process = kcache.KernelCache()  # empty memory front, same disk
    b = other_process.get(k.name, k.source, "sm_90a")
    assert b.origin == "jit-disk" and other_process.compiles == 0 and b.cubin == a.cubin
    meta = json.loads((a.path / "meta.json").read_text())
    assert meta["size"] == len(a.cubin) and meta["arch"] == "sm_90a" and meta["key"] == a.key
    assert (a.path / "source.cu").read_text() == k.source


@pytest.mark.compiles((SPAN, "sm_90a"), (SPAN, "sm_80"))
def test_key_changes_with_arch_and_source(fresh_cache):
    k = _kernel()
    a = fresh_cache.get(k.name, k.source, "sm_90a")
    b = fresh_cache.get(k.name, k.source, "sm_80")
    c = fresh_cache.get(k.name, k.source + "\n// changed\n", "sm_90a")
    assert len({a.key, b.key, c.key}) == 3


def _flip_sha(meta: bytes) -> bytes:
    m = json.loads(meta)
    m["sha256"] = m["sha256"][:-1] + ("1" if m["sha256"][-1] == "0" else "0")
    return json.dumps(m).encode()


def _other_key(meta: bytes) -> bytes:
    m = json.loads(meta)
    m["key"] = "0" * 64
    return json.dumps(m).encode()


DAMAGE = {  # name -> (damaged file, what happens to its bytes)
    "cubin_half": ("kernel.cubin", lambda b: b[: len(b) // 2]),
    "cubin_empty": ("kernel.cubin", lambda b: b""),
    "cubin_flip": ("kernel.cubin", lambda b: b[:100] + bytes([b[100] ^ 0xFF]) + b[101:]),
    "meta_half": ("meta.json", lambda b: b[: len(b) // 2]),
    "meta_sha": ("meta.json", _flip_sha),
    "meta_key": ("meta.json", _other_key),
}


@pytest.fixture(scope="module")
def pristine_entry(tmp_path_factory):
    """(folder, cubin) of one compiled entry; tests damage copies of it (one compile per module)."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("PAGEDATTN_CACHE_DIR", str(tmp_path_factory.mktemp("pristine")))
        k = _kernel()
        art = kcache.KernelCache().get(k.name, k.source, "sm_90a")
    return art.path, art.cubin


@pytest.mark.compiles((SPAN, "sm_90a"))
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_entry_is_rebuilt(pristine_entry, fresh_cache, damage, pagedattn_log):
    """Truncated, emptied or altered files are caught with one warning naming the file, rebuilt, and
    the rebuilt entry is a hit."""
    src, cubin = pristine_entry
    folder = Path(os.environ["PAGEDATTN_CACHE_DIR"]) / src.name
    shutil.copytree(src, folder)
    name, damage_fn = DAMAGE[damage]
    victim = folder / name
    victim.write_bytes(damage_fn(victim.read_bytes()))
    k = _kernel()
    a = fresh_cache.get(k.name, k.source, "sm_90a")
    assert a.origin == "jit-compiled" and fresh_cache.compiles == 1 and a.cubin == cubin
    warnings = _warnings(pagedattn_log)
    assert len(warnings) == 1 and str(victim) in warnings[0] and "rebuilding" in warnings[0], warnings
    assert (folder / "kernel.cubin").read_bytes() == cubin
    other_process = kcache.KernelCache()
    b = other_process.get(k.name, k.source, "sm_90a")
    assert b.origin == "jit-disk" and other_process.compiles == 0 and b.cubin == cubin
    assert len(_warnings(pagedattn_log)) == 1


def _slow_compile(*args, **kwargs):
    """The session's compile of the kernel (see _nvrtc_farm), held long enough for all 8 to contend."""
    import _nvrtc_farm

    time.sleep(2.0)
    return _nvrtc_farm.compile_source(*args, **kwargs)


def _race_worker(cache_dir, barrier, queue):
    try:
        os.environ["PAGEDATTN_CACHE_DIR"] = cache_dir
        from pagedattn.codegen import cache as c

        c.compile_source = _slow_compile
        k = Kernel(HEAD16)
        src, cache = k.source, c.KernelCache()
        barrier.wait(timeout=240)  # everything slow (imports, rendering) is done before the start
        art = cache.get(k.name, src, "sm_90a")
        queue.put((art.origin, cache.compiles, hashlib.sha256(art.cubin).hexdigest()))
    except BaseException:
        queue.put(("error", 0, traceback.format_exc()))
        raise


@pytest.mark.compiles((HEAD16, "sm_90a"))
def test_eight_processes_race_compile_once(tmp_path):
    """8 processes start together on one cold variant: NVRTC runs once, all 8 get the same cubin."""
    n = 8
    # forked from this process: 8 processes without 8 imports of torch (the cache state they race on is
    # on disk; each builds its own KernelCache)
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    barrier, queue = ctx.Barrier(n), ctx.Queue()
    cache_dir = tmp_path / "c"
    procs = [ctx.Process(target=_race_worker, args=(str(cache_dir), barrier, queue)) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=300) for _ in procs]
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    errors = [r[2] for r in results if r[0] == "error"]
    assert not errors, errors[0]
    assert all(p.exitcode == 0 for p in procs)
    assert sum(r[1] for r in results) == 1  # NVRTC compiles, all processes together
    assert sorted(r[0] for r in results) == ["jit-compiled"] + ["jit-disk"] * (n - 1)
    (entry,) = [p for p in cache_dir.iterdir() if p.is_dir()]  # beside it: its .lock file
    on_disk = hashlib.sha256((entry / "kernel.cubin").read_bytes()).hexdigest()
    assert {r[2] for r in results} == {on_disk}


def _unwritable_cache(mode, tmp_path, monkeypatch) -> Path:
    """A cache dir that refuses to keep kernels, at one of the three places a write can fail."""
    if mode == "not_a_dir":  # the entry folder cannot be made
        return _block_cache_dir(tmp_path, monkeypatch)
    root = tmp_path / "cache"
    root.mkdir()
    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", str(root))
    real_write = kcache.atomic_write
    if mode == "read_only":  # the source write is refused
        root.chmod(0o555)
        try:
            (root / "probe").write_text("")
        except PermissionError:
            return root
        (root / "probe").unlink()  # root (or CAP_DAC_OVERRIDE) ignores the mode: refuse in code

        def refuse(path, data):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
    else:  # "disk_full": the source is written, the cubin is not
        def refuse(path, data):
            if path.name == kcache.CUBIN:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            real_write(path, data)
    monkeypatch.setattr(kcache, "atomic_write", refuse)
    return root


@pytest.mark.compiles((SPAN, "sm_90a"), (HEAD16, "sm_90a"))
@pytest.mark.parametrize("mode", ["not_a_dir", "read_only", "disk_full"])
def test_unwritable_cache_dir_warns_once(mode, tmp_path, monkeypatch, pagedattn_log):
    """Kernels compile in memory; one warning per process (not per kernel) names the dir and the fix."""
    root = _unwritable_cache(mode, tmp_path, monkeypatch)
    c = kcache.KernelCache()
    kernels = [_kernel(), Kernel(HEAD16)]
    arts = [c.get(k.name, k.source, "sm_90a") for k in kernels]
    assert [a.origin for a in arts] == ["jit-memory"] * 2 and c.compiles == 2
    assert all(a.cubin[:4] == b"\x7fELF" for a in arts)
    warnings = _warnings(pagedattn_log)
    assert len(warnings) == 1, warnings
    assert f"cache dir {root} is not writable" in warnings[0] and "PAGEDATTN_CACHE_DIR" in warnings[0]


def test_disable_jit_cold_key_raises(fresh_cache, monkeypatch):
    monkeypatch.setenv("PAGEDATTN_DISABLE_JIT", "1")
    spec = KvWriteSpec("fp32", "fp8_e5m2", "head")
    with pytest.raises(MissingKernelError) as info:
        Kernel(spec).artifact("sm_90a")
    msg = str(info.value)
    assert "kv_write_fp32_fp8e5m2_head" in msg and "pagedattn precompile" in msg
    assert fresh_cache.compiles == 0


@pytest.mark.compiles((SPAN, "sm_80"))
def test_compile_log_line(fresh_cache, capfd):
    k = _kernel()
    fresh_cache.get(k.name, k.source, "sm_80")
    err = capfd.readouterr().err
    assert f"pagedattn: compiling {k.name} for sm_80 (first use: in no bundle, not in the JIT cache; " in err
    assert err.rstrip().endswith("s")


def test_compile_estimate_from_earlier_compiles(tmp_path):
    """The compile line's estimate: the median of this cache's JIT compiles of the family and arch."""
    def entry(name, seconds, origin="jit"):
        (tmp_path / name).mkdir()
        (tmp_path / name / kcache.META).write_text(json.dumps({"compile_seconds": seconds, "origin": origin}))
    assert kcache.compile_estimate(tmp_path, "attn_fwd_bf16_x", "sm_90a") is None
    entry("attn_fwd_bf16_a-sm_90a-0123", 20.0)
    entry("attn_fwd_fp16_b-sm_90a-4567", 30.0)
    entry("attn_fwd_fp16_c-sm_90a-89ab", 26.0)
    entry("attn_fwd_fp16_d-sm_90a-cdef", 1.0, origin="aot")    # not a JIT compile of this machine
    entry("attn_fwd_fp16_e-sm_80-0123", 99.0)                  # another arch
    entry("kv_write_bf16_span-sm_90a-0123", 2.0)               # another family
    (tmp_path / "attn_fwd_broken-sm_90a-0000").mkdir()         # no meta.json: skipped
    assert kcache.compile_estimate(tmp_path, "attn_fwd_bf16_x", "sm_90a") == (26.0, 3)
    assert kcache.describe_estimate((26.0, 3), "attn_fwd_bf16_x") == "~26 s, the median of 3 earlier attn_fwd compiles here"
    assert "no earlier kv_write compile" in kcache.describe_estimate(None, "kv_write_bf16_span")
    assert kcache.compile_estimate(tmp_path / "missing", "attn_fwd_bf16_x", "sm_90a") is None


def test_missing_cutlass_is_named(monkeypatch):
    import importlib.util as iu

    real = iu.find_spec
    monkeypatch.setattr(ktool.importlib.util, "find_spec",
                        lambda name, *a: None if name == "cutlass_library" else real(name, *a))
    with pytest.raises(ToolchainError, match="nvidia-cutlass"):
        ktool._cutlass_include()


def test_missing_cuda_headers_are_named(monkeypatch, tmp_path):
    monkeypatch.setattr(ktool, "_pip_header_candidates", lambda: iter(()))
    monkeypatch.setattr(ktool, "SYSTEM_CUDA_DIRS", (str(tmp_path / "nowhere"),))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    with pytest.raises(ToolchainError) as info:
        ktool.find_headers(13)
    assert "pagedattn[cu13]" in str(info.value) and "nvidia-cuda-cccl" in str(info.value)


def test_header_major_must_match_nvrtc():
    with pytest.raises(ToolchainError, match="CUDA 13 headers, NVRTC is 12"):
        ktool.find_headers(12) if not Path("/usr/local/cuda/include/cuda_runtime_api.h").exists() \
            or ktool._cudart_version(Path("/usr/local/cuda/include")) // 1000 != 12 else \
            pytest.skip("a CUDA 12 toolkit is installed here")


def test_torch_cuda_mismatch_names_extra(monkeypatch):
    import torch

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(ToolchainError, match=r"pagedattn\[cu12\]"):
        ktool.check_against_torch_and_driver(13)


def test_cache_dir_resolution(monkeypatch, tmp_path):
    from pagedattn import envs

    monkeypatch.delenv("PAGEDATTN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert envs.cache_dir() == tmp_path / "pagedattn"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert envs.cache_dir() == Path.home() / ".cache" / "pagedattn"


def test_params_layout_asserts_render():
    from pagedattn.codegen.launch import layout_asserts
    from pagedattn.ops.params import KvWriteParams
    import ctypes

    text = layout_asserts(KvWriteParams, "Params")
    assert f"sizeof(Params) == {ctypes.sizeof(KvWriteParams)}" in text


def test_headers_digest_covers_exactly_the_included_headers(tmp_path, monkeypatch):
    """A cache key changes when a header the source includes (directly or through another shipped
    header) changes, and only then."""
    from pagedattn.codegen import render as render_mod

    root = tmp_path / "include"
    (root / "lib").mkdir(parents=True)
    (root / "lib/a.cuh").write_text('#include "lib/b.cuh"\n#include <cuda_fp16.h>\n')
    (root / "lib/b.cuh").write_text("// b\n")
    (root / "lib/c.cuh").write_text("// c\n")
    monkeypatch.setattr(render_mod, "include_root", lambda: root)

    def digest(source):
        render_mod.headers_digest.cache_clear()
        render_mod._includes_of.cache_clear()
        return render_mod.headers_digest(source)

    src = '#include "lib/a.cuh"\nextern "C" __global__ void k() {}\n'
    before = digest(src)
    (root / "lib/c.cuh").write_text("// c edited\n")
    assert digest(src) == before  # not included
    (root / "lib/b.cuh").write_text("// b edited\n")
    assert digest(src) != before  # included through a.cuh
    render_mod.headers_digest.cache_clear()
    render_mod._includes_of.cache_clear()


def test_skip_passed_reads_a_verbose_log(tmp_path):
    """PAGEDATTN_TEST_SKIP_PASSED (conftest.py): the PASSED lines of an xdist -v log, ids with spaces and
    folders of another invocation included, name the tests to leave out; FAILED ones stay in."""
    import gzip

    from conftest import _passed_before, _test_key

    log = tmp_path / "gpu.log.gz"
    with gzip.open(log, "wt") as f:
        f.write("[gw3] [ 10%] PASSED ../work/main/tests/test_legacy.py::test_bad[head size 0] \n"
                "[gw1] [ 11%] FAILED ../work/main/tests/test_legacy.py::test_bad[block 3] \n"
                "PASSED tests/test_merge.py::test_merge[a-b]\n")
    assert _passed_before(str(log)) == {"test_legacy.py::test_bad[head size 0]", "test_merge.py::test_merge[a-b]"}
    # PAGEDATTN_TEST_RERUN: what a later kernel change touches runs again
    assert _passed_before(str(log), "merge|cap[1-9]") == {"test_legacy.py::test_bad[head size 0]"}
    assert _test_key("tests/test_legacy.py::test_bad[head size 0]") == "test_legacy.py::test_bad[head size 0]"
