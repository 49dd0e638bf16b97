"""AOT: `pagedattn precompile`, relocatable bundles, JIT-off mode, `bundle verify` / `cache verify`.

CPU only: NVRTC compiles sm_90a without a GPU. One small bundle (6 kv_write variants) is built once
per module; tests that change a bundle work on a copy. 7 kernels, each compiled once per session
(conftest.py), and 2 again by the serial run that must give the same bytes.
"""
import argparse
import collections
import dataclasses
import json
import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from pagedattn import aot, aotcli, cachecli
from pagedattn.codegen import bundle
from pagedattn.codegen.cache import write_entry
from pagedattn.codegen.errors import MissingKernelError
from pagedattn.ops.kv_write import KvWriteSpec
from pagedattn.registry import FAMILIES, KernelSpec, all_specs, get_kernel, precompile_command

DATA = Path(__file__).parent / "data"
LLAMA = DATA / "llama2_7b_config.json"
QWEN = DATA / "qwen3_0.6b_config.json"
SMALL = ["--ops", "kv_write", "--dtypes", "bf16", "--kv-cache-dtypes", "auto,fp8_e4m3"]
ARCH = "sm_90a"
# What this module compiles, started at the beginning of the session in parallel (conftest.py):
# the SMALL matrix and the good one of test_failed_variant_does_not_stop_others.
pytestmark = pytest.mark.compiles(*[(KvWriteSpec("bf16", kv, path), ARCH) for kv in ("auto", "fp8_e4m3")
                                    for path in ("span", "head", "flat")],
                                  (KvWriteSpec("fp16", "auto", "head"), ARCH))


def precompile(*argv) -> int:
    return aotcli.main(["precompile", "--arch", ARCH, "-q", *map(str, argv)])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(bundle dir, summary of the run) for the SMALL matrix, compiled with 2 processes, one kernel per
    program (a file per kernel: the tests of single entries; test_kernels_share_an_nvrtc_program and
    test_partition_does_not_depend_on_jobs cover programs)."""
    out = tmp_path_factory.mktemp("aot") / "bundle"
    jobs = aot.plan(aot.select(ops=["kv_write"], filters={"dtypes": ["bf16"],
                                                          "kv_cache_dtypes": ["auto", "fp8_e4m3"]}
                               ).specs, [ARCH])
    summary = aot.precompile(jobs, out, n_jobs=2, progress=False, per_program=1)
    assert summary.compiled == 6 and not summary.failed, summary
    return out, summary


@pytest.fixture
def bundle_copy(built, tmp_path):
    """A private, moved copy of the module bundle (bundles are relocatable)."""
    dst = tmp_path / "moved" / "bundle"
    shutil.copytree(built[0], dst)
    bundle.forget()
    yield dst
    bundle.forget()


@pytest.fixture
def jit_off(fresh_cache, monkeypatch):
    monkeypatch.setenv("PAGEDATTN_DISABLE_JIT", "1")
    bundle.forget()
    yield fresh_cache
    bundle.forget()


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def _spec(entry: dict):
    return FAMILIES[entry["family"]](**entry["spec"])


# -- a fake family with the fields later families have (head_dim, layout); never compiled ---------
@dataclass(frozen=True)
class FakeAttnSpec(KernelSpec):
    """Stand-in attention family (selection tests only)."""
    FAMILY: ClassVar[str] = "fake_attn"
    SUPPORTED: ClassVar[dict] = {"dtype": ("fp16", "bf16"), "head_dim": (64, 128, 256, 512),
                                 "layout": ("NHD", "HND"), "causal": (True, False)}
    dtype: str
    head_dim: int
    layout: str
    causal: bool


@pytest.fixture
def fake_family(monkeypatch):
    monkeypatch.setitem(FAMILIES, FakeAttnSpec.FAMILY, FakeAttnSpec)
    return FakeAttnSpec


# -- building ------------------------------------------------------------------------------------
def test_manifest(built):
    out, summary = built
    m = _manifest(out)
    header = bundle.expected_header()
    for k, v in header.items():
        assert m[k] == v
    assert {"schema", "pagedattn", "nvrtc", "packages"} <= set(m)
    assert "nvidia-cutlass" in m["packages"]
    names = sorted(v["name"] for v in m["variants"])
    assert names == sorted(f"kv_write_bf16_{kv}_{p}" for kv in ("auto", "fp8e4m3")
                           for p in ("span", "head", "flat"))
    for v in m["variants"]:
        assert v["arch"] == ARCH and v["family"] == "kv_write"
        assert not Path(v["file"]).is_absolute() and v["file"].startswith("kernels/")
        assert v["file"].endswith(".cubin.xz") and v["compression"] == "xz"
        stored = (out / v["file"]).read_bytes()
        assert len(stored) == v["stored_size"] < v["size"] / 2   # kv_write cubins compress about 3.5x
        data = bundle.unpack(stored, "xz")
        assert data[:4] == b"\x7fELF" and len(data) == v["size"]
        import hashlib
        assert hashlib.sha256(data).hexdigest() == v["sha256"]
        spec = _spec(v)
        # the key is the one the run-time lookup computes
        assert aot.plan([spec], [ARCH])[0].key == v["key"]
    assert str(out) not in (out / "manifest.json").read_text()   # relocatable: no absolute paths
    assert summary.bundle_kernels == 6 and summary.bundle_bytes == sum(v["stored_size"] for v in m["variants"])


def test_rerun_compiles_nothing(built, capsys):
    out, _ = built
    before = (out / "manifest.json").stat().st_mtime_ns
    assert precompile(*SMALL, "--out", out) == 0
    text = capsys.readouterr().out
    assert "compiled 0, already present 6, failed 0" in text
    assert (out / "manifest.json").stat().st_mtime_ns == before     # not even rewritten


def test_rerun_rebuilds_only_missing_corrupt_or_stale(bundle_copy, capsys):
    m = _manifest(bundle_copy)
    gone, bad, stale = m["variants"][0], m["variants"][1], m["variants"][2]
    (bundle_copy / gone["file"]).unlink()
    p = bundle_copy / bad["file"]
    data = p.read_bytes()
    p.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    stale_key = stale["key"]
    stale["key"] = "0" * 64          # as if built from older templates: never looked up again
    (bundle_copy / "manifest.json").write_text(json.dumps(m))
    assert aotcli.main(["bundle", "verify", str(bundle_copy)]) == 1
    assert "1 kernel was built from other kernel sources" in capsys.readouterr().out
    jobs = aot.plan([_spec(v) for v in m["variants"]], [ARCH])
    summary = aot.precompile(jobs, bundle_copy, n_jobs=1, progress=False, per_program=1)
    assert (summary.compiled, summary.present, summary.failed) == (3, 3, [])
    after = _manifest(bundle_copy)
    assert sorted(v["key"] for v in after["variants"]) == sorted(
        [stale_key] + [v["key"] for v in m["variants"] if v is not stale])   # stale one replaced
    assert bundle.verify(bundle_copy).ok and not bundle.verify(bundle_copy).stray
    assert after["variants"][1]["sha256"] == bad["sha256"]                 # same bytes again


def test_partition_does_not_depend_on_jobs(tmp_path, real_nvrtc):
    """12 kv_write kernels with 1 and 2 processes: the same programs, so the same files byte for byte."""
    both = [*SMALL[:2], "--dtypes", "fp16,bf16", *SMALL[4:]]
    assert precompile(*both, "--jobs", 1, "--out", tmp_path / "serial") == 0
    assert precompile(*both, "--jobs", 2, "--out", tmp_path / "parallel") == 0
    serial, parallel = (_manifest(tmp_path / d)["variants"] for d in ("serial", "parallel"))
    assert [(v["key"], v["file"], v["sha256"]) for v in serial] == [(v["key"], v["file"], v["sha256"]) for v in parallel]
    assert len(serial) == 12 and len({v["file"] for v in serial}) == 2          # two programs of 6
    for v in serial:
        assert (tmp_path / "serial" / v["file"]).read_bytes() == (tmp_path / "parallel" / v["file"]).read_bytes()


def test_failed_variant_does_not_stop_others(bundle_copy, monkeypatch, capsys):
    real_plan = aot.plan

    def plan_with_broken(specs, archs):
        jobs = real_plan(specs, archs)
        jobs[0] = dataclasses.replace(jobs[0], source=jobs[0].source + "\nthis_is_not_cuda;\n")
        return jobs

    monkeypatch.setattr(aot, "plan", plan_with_broken)
    rc = precompile("--variant", "kv_write:dtype=fp16 kv_cache_dtype=auto path=span",
                    "--variant", "kv_write:dtype=fp16 kv_cache_dtype=auto path=head",
                    "--jobs", 2, "--out", bundle_copy)
    text = capsys.readouterr().out
    assert rc == 1
    assert "compiled 1, already present 0, failed 1" in text
    log = bundle_copy / "logs" / f"kv_write_fp16_auto_span-{ARCH}.log"
    assert f"FAILED kv_write_fp16_auto_span ({ARCH}): log {log}" in text
    assert "this_is_not_cuda" in log.read_text() and log.with_suffix(".cu").is_file()
    names = {v["name"] for v in _manifest(bundle_copy)["variants"]}
    assert "kv_write_fp16_auto_head" in names and "kv_write_fp16_auto_span" not in names
    assert len(names) == 7 and bundle.verify(bundle_copy).ok


def test_kernels_share_an_nvrtc_program(built, tmp_path, jit_off, monkeypatch):
    """Four kernels as one program: one stored file that four entries name, each kernel resolved from
    it with its own entry point; the file stays until its last entry goes."""
    specs = [_spec(v) for v in _manifest(built[0])["variants"]][:4]
    out = tmp_path / "programs"
    summary = aot.precompile(aot.plan(specs, [ARCH]), out, n_jobs=1, progress=False)
    assert (summary.compiled, summary.programs, summary.failed) == (4, 1, [])
    assert "1 NVRTC program" in summary.line()
    m = _manifest(out)
    assert len({v["file"] for v in m["variants"]}) == 1 and len({v["sha256"] for v in m["variants"]}) == 1
    assert m["variants"][0]["file"].startswith(f"kernels/program-{ARCH}-")
    assert {v["program_size"] for v in m["variants"]} == {4}
    report = bundle.verify(out)
    assert report.ok and not report.stray and report.checked == 4
    assert report.total_bytes == summary.bundle_bytes == m["variants"][0]["stored_size"]
    monkeypatch.setenv("PAGEDATTN_AOT_DIR", str(out))
    for v in m["variants"]:
        art = get_kernel(_spec(v)).artifact(ARCH)
        assert art.origin.startswith("aot:") and f"{v['name']}\0".encode() in art.cubin
    first = m["variants"][0]
    assert bundle.drop_entries(out, {first["key"]}) == 1
    assert (out / first["file"]).is_file() and bundle.verify(out).ok     # the other three still name it
    again = aot.precompile(aot.plan(specs, [ARCH]), out, n_jobs=1, progress=False)
    assert (again.compiled, again.present, again.programs) == (1, 3, 1)
    assert len({v["file"] for v in _manifest(out)["variants"]}) == 2 and bundle.verify(out).ok


def test_failed_program_compiles_its_kernels_one_by_one(tmp_path):
    jobs = aot.plan([KvWriteSpec("fp16", "auto", "span"), KvWriteSpec("fp16", "auto", "head")], [ARCH])
    jobs[0] = dataclasses.replace(jobs[0], source=jobs[0].source + "\nthis_is_not_cuda;\n")
    summary = aot.precompile(jobs, tmp_path / "b", n_jobs=1, progress=False, per_program=2)
    assert (summary.compiled, len(summary.failed), summary.programs) == (1, 1, 1)
    assert "this_is_not_cuda" in summary.failed[0][1].read_text()
    (v,) = _manifest(tmp_path / "b")["variants"]
    assert v["name"] == "kv_write_fp16_auto_head" and v["program_size"] == 1


def test_programs_group_by_preamble_and_fill_evenly():
    from pagedattn.aot.build import PROGRAM_SIZE, programs
    from pagedattn.codegen.compile import program_key

    specs = [s for s in all_specs(["kv_write", "attn_fwd"]) if s.FAMILY == "kv_write" or s.head_dim == 64][:60]
    jobs = aot.plan(specs, [ARCH])
    groups = programs(jobs, per_program=8)
    assert sorted(j.key for g in groups for j in g) == sorted(j.key for j in jobs)
    for g in groups:
        assert len({(j.arch, j.options, program_key(j.source)) for j in g}) == 1 and 1 <= len(g) <= 8
    sizes = collections.Counter(program_key(j.source) for j in jobs).values()
    assert len(groups) == sum(-(-n // 8) for n in sizes)       # as few programs as 8 a program allows
    assert max(len(g) for g in groups) - min(len(g) for g in groups) <= 2   # filled evenly (27: 7 7 7 6)
    assert max(len(g) for g in programs(jobs)) == PROGRAM_SIZE


# -- run time ------------------------------------------------------------------------------------
def test_jit_off_resolves_every_variant_from_bundle(bundle_copy, jit_off, monkeypatch):
    monkeypatch.setenv("PAGEDATTN_AOT_DIR", f"/nonexistent/elsewhere:{bundle_copy}")
    for v in _manifest(bundle_copy)["variants"]:
        art = get_kernel(_spec(v)).artifact(v["arch"])
        assert art.origin.startswith("aot:") and str(bundle_copy) in art.origin
        assert art.cubin == bundle.unpack((bundle_copy / v["file"]).read_bytes(), v["compression"])
    assert jit_off.compiles == 0
    # a variant outside the bundle: MissingKernelError, still no compile
    with pytest.raises(MissingKernelError, match="kv_write_fp32_auto_span"):
        get_kernel(KvWriteSpec("fp32", "auto", "span")).artifact(ARCH)
    assert jit_off.compiles == 0


def test_missing_kernel_hint_is_a_working_command(jit_off, monkeypatch, tmp_path):
    target = tmp_path / "deploy bundle"     # a space: the hint must quote it
    monkeypatch.setenv("PAGEDATTN_AOT_DIR", str(target))
    spec = KvWriteSpec("fp16", "fp8_e5m2", "head")
    with pytest.raises(MissingKernelError) as info:
        get_kernel(spec).artifact(ARCH)
    command = str(info.value).split("Produce it with:\n", 1)[1].strip()
    assert command == precompile_command(spec, ARCH)
    argv = shlex.split(command)
    assert argv[:2] == ["pagedattn", "precompile"] and argv[argv.index("--out") + 1] == str(target)
    assert aotcli.main(argv[1:] + ["-q"]) == 0
    art = get_kernel(spec).artifact(ARCH)
    assert art.origin.startswith("aot:") and jit_off.compiles == 0


def test_hint_without_aot_dir_names_a_folder(monkeypatch):
    monkeypatch.delenv("PAGEDATTN_AOT_DIR", raising=False)
    hint = precompile_command(KvWriteSpec("bf16", "auto", "span"), "sm_80")
    argv = shlex.split(hint, comments=True)
    assert argv[argv.index("--out") + 1] == "./pagedattn-bundle" and "PAGEDATTN_AOT_DIR" in hint


@pytest.mark.parametrize("field,value", [("pagedattn", "0.0.1-other"), ("nvrtc", "12.4"),
                                         ("packages", {"nvidia-cutlass": "3.9.0"})])
def test_manifest_of_other_version_is_ignored_with_warning(bundle_copy, jit_off, monkeypatch,
                                                           pagedattn_log, field, value):
    m = _manifest(bundle_copy)
    m[field] = value
    (bundle_copy / "manifest.json").write_text(json.dumps(m))
    monkeypatch.setenv("PAGEDATTN_AOT_DIR", str(bundle_copy))
    spec = _spec(m["variants"][0])
    for _ in range(2):
        with pytest.raises(MissingKernelError):
            get_kernel(spec).artifact(ARCH)
    warnings = [r.getMessage() for r in pagedattn_log.records if "ignoring AOT bundle" in r.getMessage()]
    assert len(warnings) == 1, warnings                       # one warning, not one per lookup
    assert str(bundle_copy) in warnings[0] and f"{field}: bundle has {value!r}" in warnings[0]
    assert jit_off.compiles == 0
    report = bundle.verify(bundle_copy)
    assert not report.ok and "another install" in report.problem and not report.corrupt


# -- verify --------------------------------------------------------------------------------------
def _cache_cli(argv) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    cachecli.add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


def test_stored_file_that_decodes_to_another_cubin_is_corrupt(bundle_copy, pagedattn_log):
    """A well-formed xz file holding different bytes fails the cubin's own sha256."""
    victim = _manifest(bundle_copy)["variants"][1]
    path = bundle_copy / victim["file"]
    cubin = bytearray(bundle.unpack(path.read_bytes(), "xz"))
    cubin[len(cubin) // 2] ^= 0xFF
    path.write_bytes(bundle.pack(bytes(cubin)))
    report = bundle.verify(bundle_copy)
    assert [e["key"] for e, _ in report.corrupt] == [victim["key"]]
    assert "sha256 mismatch" in report.corrupt[0][1]


def test_schema_1_bundle_of_plain_cubins_is_still_read(bundle_copy, jit_off, monkeypatch):
    """Bundles written before compression (schema 1: .cubin files, no compression field) load as
    they are."""
    m = _manifest(bundle_copy)
    for v in m["variants"]:
        plain = v["file"][: -len(".xz")]
        (bundle_copy / plain).write_bytes(bundle.unpack((bundle_copy / v["file"]).read_bytes(), "xz"))
        (bundle_copy / v["file"]).unlink()
        v["file"] = plain
        del v["compression"], v["stored_size"]
    m["schema"] = 1
    (bundle_copy / "manifest.json").write_text(json.dumps(m))
    bundle.forget()
    monkeypatch.setenv("PAGEDATTN_AOT_DIR", str(bundle_copy))
    assert bundle.verify(bundle_copy).ok
    for v in m["variants"]:
        art = get_kernel(_spec(v)).artifact(v["arch"])
        assert art.origin.startswith("aot:") and art.cubin == (bundle_copy / v["file"]).read_bytes()
    assert jit_off.compiles == 0


def test_corrupt_artifact_found_by_bundle_verify_and_cache_verify(bundle_copy, fresh_cache,
                                                                   monkeypatch, capsys,
                                                                   pagedattn_log):
    assert aotcli.main(["bundle", "verify", str(bundle_copy)]) == 0
    assert "6 kernels checked, 0 corrupt" in capsys.readouterr().out
    victim = _manifest(bundle_copy)["variants"][2]
    path = bundle_copy / victim["file"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF                               # same size, different bytes
    path.write_bytes(bytes(data))

    assert aotcli.main(["bundle", "verify", str(bundle_copy)]) == 1
    out = capsys.readouterr().out
    assert f"corrupt: {victim['name']} ({ARCH}): corrupt file {victim['file']}: undecodable xz" in out
    assert "rebuild: pagedattn precompile" in out and "1 corrupt" in out

    # a JIT cache entry with a bad cubin, beside the bundle
    folder = Path(os.environ["PAGEDATTN_CACHE_DIR"])
    entry = folder / "fake_variant-sm_90a-0123456789abcdef"
    write_entry(entry, key="k" * 64, material={}, variant="fake_variant", arch="sm_90a",
                cubin=b"\x7fELF good", source="// x", options=[], seconds=0.1, origin="jit")
    (entry / "kernel.cubin").write_bytes(b"\x7fELF bad!")
    monkeypatch.setenv("PAGEDATTN_AOT_DIR", str(bundle_copy))
    assert _cache_cli(["cache", "verify"]) == 1
    out = capsys.readouterr().out
    assert f"corrupt: {entry}" in out
    assert f"corrupt: {victim['name']} ({ARCH}) in AOT bundle {bundle_copy}" in out

    # the run-time lookup refuses the corrupt file (warning), JIT off -> MissingKernelError
    monkeypatch.setenv("PAGEDATTN_DISABLE_JIT", "1")
    with pytest.raises(MissingKernelError):
        get_kernel(_spec(victim)).artifact(ARCH)
    assert any("corrupt file" in r.getMessage() for r in pagedattn_log.records)

    # --delete: the JIT entry goes, the bundle entry leaves the manifest; then all is clean
    assert _cache_cli(["cache", "verify", "--delete"]) == 0
    assert not entry.exists()
    assert victim["key"] not in {v["key"] for v in _manifest(bundle_copy)["variants"]}
    assert bundle.verify(bundle_copy).ok


def test_cache_ls_shows_aot_origin(bundle_copy, fresh_cache, monkeypatch, capsys):
    monkeypatch.setenv("PAGEDATTN_AOT_DIR", str(bundle_copy))
    monkeypatch.setenv("COLUMNS", "240")
    assert _cache_cli(["cache", "ls"]) == 0
    out = capsys.readouterr().out
    assert "kv_write_bf16_auto_span" in out and f"aot:{bundle_copy}" in out


# -- selection -----------------------------------------------------------------------------------
def test_dry_run_lists_the_matrix(built, capsys):
    out, _ = built
    assert precompile("--ops", "kv_write", "--preset", "default", "--dry-run") == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.startswith("kv_write_")]
    assert len(rows) == 18 and all(r[1] == ARCH and r[2] == "compile" for r in rows)
    assert {r[0] for r in rows} == {f"kv_write_{d}_{kv}_{p}" for d in ("fp16", "bf16")
                                   for kv in ("auto", "fp8e4m3", "fp8e5m2") for p in ("span", "head", "flat")}
    assert lines[-1] == (f"dry run: 18 kernels (18 variants of kv_write x 1 arch: {ARCH}); "
                         "0 present, 18 to compile")
    # against an existing bundle: what it holds is marked, nothing is written
    before = sorted(p.name for p in out.rglob("*"))
    assert aotcli.main(["precompile", "--arch", "sm_80,sm_90a", "--ops", "kv_write", "--dtypes", "bf16",
                     "--dry-run", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert sum(line.endswith(" present") for line in text.splitlines()) == 6
    assert text.strip().endswith("6 present, 12 to compile")
    assert sorted(p.name for p in out.rglob("*")) == before


def test_model_configs():
    llama, qwen = aot.read_model_config(LLAMA), aot.read_model_config(QWEN)
    assert (llama.head_size, llama.num_heads, llama.num_kv_heads, llama.dtype) == (128, 32, 32, "fp16")
    # Qwen3-0.6B: head_dim (128) wins over hidden_size / heads (1024 / 16 = 64); GQA 16:8
    assert (qwen.head_size, qwen.num_heads, qwen.num_kv_heads, qwen.dtype) == (128, 16, 8, "bf16")
    assert "Hq=16 Hkv=8" in qwen.describe()


@pytest.mark.parametrize("config,dtype", [(LLAMA, "fp16"), (QWEN, "bf16")])
def test_model_config_narrows_dtype_and_head_size(fake_family, config, dtype, capsys):
    sel = aot.select(model_configs=[config])
    kv = [s for s in sel.specs if s.FAMILY == "kv_write"]
    fake = [s for s in sel.specs if s.FAMILY == "fake_attn"]
    assert {s.dtype for s in kv} == {dtype} and len(kv) == 9        # all cache dtypes, all 3 paths
    assert {(s.dtype, s.head_dim) for s in fake} == {(dtype, 128)} and len(fake) == 4
    # explicit flags win over the config
    sel = aot.select(model_configs=[config], filters={"dtypes": ["fp32"]}, ops=["kv_write"])
    assert {s.dtype for s in sel.specs} == {"fp32"}
    # through the CLI
    assert precompile("--model-config", config, "--ops", "kv_write", "--dry-run") == 0
    text = capsys.readouterr().out
    assert text.startswith(f"model {config.name}:") and f"dtype={dtype}" in text
    assert "9 kernels" in text


def test_two_model_configs_give_the_union(fake_family):
    sel = aot.select(model_configs=[LLAMA, QWEN], ops=["fake_attn"])
    assert {s.dtype for s in sel.specs} == {"fp16", "bf16"} and {s.head_dim for s in sel.specs} == {128}


def test_filters_map_onto_fields_by_name(fake_family):
    sel = aot.select(filters={"head_sizes": ["64", "256"], "layouts": ["hnd"], "dtypes": ["bfloat16"]})
    fake = [s for s in sel.specs if s.FAMILY == "fake_attn"]
    assert {(s.dtype, s.head_dim, s.layout) for s in fake} == {("bf16", 64, "HND"), ("bf16", 256, "HND")}
    kv = [s for s in sel.specs if s.FAMILY == "kv_write"]       # no head_dim / layout fields
    assert len(kv) == 9 and {s.dtype for s in kv} == {"bf16"}
    # kv_write alone: --head-sizes narrows nothing, and says so
    sel = aot.select(ops=["kv_write"], filters={"head_sizes": ["128"], "kv_cache_dtypes": ["fp8"]})
    assert any("--head-sizes" in n for n in sel.notes)
    assert {s.kv_cache_dtype for s in sel.specs} == {"fp8_e4m3"} and len(sel.specs) == 9


def test_preset_is_quietly_intersected(fake_family):
    sel = aot.select(preset="default")
    fake = [s for s in sel.specs if s.FAMILY == "fake_attn"]
    assert {s.head_dim for s in fake} == {64, 128, 256}              # 80/96 unsupported, 512 not in it
    assert {s.dtype for s in sel.specs} == {"fp16", "bf16"} and not sel.notes
    kv = [s for s in sel.specs if s.FAMILY == "kv_write"]
    assert {s.kv_cache_dtype for s in kv} == set(KvWriteSpec.SUPPORTED["kv_cache_dtype"])


@pytest.mark.parametrize("kwargs,message", [
    ({"filters": {"dtypes": ["fp64"]}}, "--dtypes: fp64 not supported"),
    ({"filters": {"head_sizes": ["72"]}, "ops": ["fake_attn"]}, "--head-sizes: 72 not supported"),
    ({"ops": ["attn_nope"]}, "unknown family attn_nope"),
    ({"preset": "huge"}, "known presets: default"),
    ({"variants": ["kv_write:dtype=bf16 kv_cache_dtype=auto"]}, "missing path (one of span, head, flat)"),
    ({"variants": ["kv_write:dtype=bf16 kv_cache_dtype=auto path=diag"]}, "path='diag'"),
    ({"variants": ["kv_write:dtype=bf16 kv_cache_dtype=auto path=span"], "ops": ["kv_write"]},
     "do not combine"),
    ({"variants": ["nope:dtype=bf16"]}, "family among"),
])
def test_selection_errors(fake_family, kwargs, message):
    with pytest.raises(aot.SelectionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        aot.select(**kwargs)


def test_variant_form_round_trips(fake_family, monkeypatch):
    monkeypatch.delenv("PAGEDATTN_AOT_DIR", raising=False)
    tuned = KvWriteSpec("bf16", "fp8_e4m3", "flat", stream_items=2, min_blocks=0)  # fields off their default
    specs = list(all_specs()) + [tuned]
    assert any(s.FAMILY == "fake_attn" for s in specs)
    assert aot.format_variant(tuned) == ("kv_write:dtype=bf16 kv_cache_dtype=fp8_e4m3 path=flat stream_items=2 "
                                         "min_blocks=0")
    assert aot.format_variant(KvWriteSpec("bf16", "auto", "span")) == \
        "kv_write:dtype=bf16 kv_cache_dtype=auto path=span"  # defaults (None) are left out
    parser = argparse.ArgumentParser()
    aotcli.add_parser(parser.add_subparsers())
    for spec in specs:
        assert aot.parse_variant(aot.format_variant(spec)) == spec
        argv = shlex.split(precompile_command(spec, ARCH), comments=True)
        args = parser.parse_args(argv[1:])
        assert aotcli._selection_from_args(args).specs == [spec]


def test_arch_resolution(monkeypatch):
    assert aot.resolve_archs("sm_80, sm_90a,sm_80") == ["sm_80", "sm_90a"]
    assert aot.resolve_archs("all")[-1] == "sm_90a"
    with pytest.raises(aot.SelectionError, match="sm_70"):
        aot.resolve_archs("sm_70")
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(aot.SelectionError, match="no CUDA GPU is visible.*--arch sm_90a"):
        aot.resolve_archs("native")


def test_arch_native_with_gpus(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    caps = {0: (9, 0), 1: (8, 0), 2: (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: caps[i])
    monkeypatch.delenv("PAGEDATTN_ARCH", raising=False)
    assert aot.resolve_archs("native") == ["sm_90a", "sm_80"]


def test_cli_errors_exit_2(capsys):
    assert aotcli.main(["precompile", "--arch", "sm_90a", "--dtypes", "fp64", "--dry-run"]) == 2
    assert "--dtypes: fp64" in capsys.readouterr().err
    assert aotcli.main(["precompile", "--arch", "sm_90a", "--ops", "kv_write"]) == 2
    assert "--out DIR is required" in capsys.readouterr().err


# -- GPU: run from a bundle with JIT off ---------------------------------------------------------
@pytest.mark.gpu
def test_gpu_write_and_decode_run_from_bundle_with_jit_off(fresh_cache, monkeypatch, tmp_path):
    """Cache write + decode attention with PAGEDATTN_DISABLE_JIT=1: zero compiles. The bundle is
    $PAGEDATTN_TEST_BUNDLE when set (one built on the CPU machine and carried over: `pagedattn
    precompile --arch sm_90a --ops kv_write,attn_fwd --dtypes bf16 --kv-cache-dtypes
    auto --head-sizes 128 --out DIR`), else that command runs here first (NVRTC gives the same bytes
    on any host)."""
    import torch

    import pagedattn
    from pagedattn import reference
    from pagedattn.registry import arch_for_device

    arch = arch_for_device(0)
    given = os.environ.get("PAGEDATTN_TEST_BUNDLE")
    folder = Path(given) if given else tmp_path / "bundle"
    if not given:
        assert aotcli.main(["precompile", "-q", "--arch", arch, "--ops", "kv_write,attn_fwd",
                         "--dtypes", "bf16", "--kv-cache-dtypes", "auto", "--head-sizes", "128",
                         "--out", str(folder)]) == 0
    assert bundle.verify(folder).ok
    monkeypatch.setenv("PAGEDATTN_AOT_DIR", str(folder))
    monkeypatch.setenv("PAGEDATTN_DISABLE_JIT", "1")
    bundle.forget()

    torch.manual_seed(0)
    B, Hq, Hkv, D, bs, num_blocks = 4, 8, 2, 128, 16, 64
    spec = pagedattn.CacheSpec(num_blocks=num_blocks, block_size=bs, num_kv_heads=Hkv, head_size=D,
                               dtype=torch.bfloat16, layout="NHD")
    key_cache, value_cache = spec.allocate("cuda", fill=0.0)
    lens = [37, 1, 100, 64]
    table = torch.randperm(num_blocks, device="cuda")[: B * 8].view(B, 8).to(torch.int32)
    slots = [int(table[b, t // bs]) * bs + t % bs for b in range(B) for t in range(lens[b])]
    slot_mapping = torch.tensor(slots, device="cuda", dtype=torch.int64)
    k = torch.randn(len(slots), Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    pagedattn.reshape_and_cache_flash(k, v, key_cache, value_cache, slot_mapping)

    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    cu_q = torch.arange(B + 1, device="cuda", dtype=torch.int32)
    seqused = torch.tensor(lens, device="cuda", dtype=torch.int32)
    out = pagedattn.flash_attn_varlen_func(q, key_cache, value_cache, 1, cu_q, max(lens),
                                           seqused_k=seqused, block_table=table)
    torch.cuda.synchronize()
    assert fresh_cache.compiles == 0

    ref_k, ref_v = spec.allocate("cuda", fill=0.0)
    reference.reshape_and_cache_flash(k, v, ref_k, ref_v, slot_mapping)
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)
    ref = reference.paged_attention(q, key_cache, value_cache, cu_q, seqused, table)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_head_size_96_selects_the_tiles_its_prefill_runs_on():
    """A model of head size 96 (Phi-3) precompiles the 96 variants and the warpgroup-MMA prefills at 128
    its prefill runs on (heuristics.wgmma_head_dim), for 16-bit and fp8 caches."""
    from pagedattn.ops.attention import WGMMA_MODES

    sel = aot.select(ops=["attn_fwd"], filters={"head_sizes": ["96"], "dtypes": ["bf16"], "features": ["none"],
                                                "kv_cache_dtypes": ["auto", "fp8_e4m3"]})
    got = {(s.mode, s.head_dim, s.kv_cache_dtype) for s in sel.specs}
    assert {("prefill_ws", 128, "auto"), ("prefill_wgmma", 128, "auto"), ("decode", 96, "auto"),
            ("prefill_ws", 128, "fp8_e4m3"), ("prefill_wgmma", 128, "fp8_e4m3"), ("decode_tma", 96, "fp8_e4m3")} <= got
    assert all(s.head_dim == 96 or s.mode in WGMMA_MODES for s in sel.specs)
    assert ("prefill_ws", 96, "auto") not in got  # the opt-in narrow kernel is no variant of the bundles


def test_a_head_size_between_compiled_ones_selects_what_runs_it():
    """Head size 72 (a model config or --head-sizes) selects the variants its plans launch: the 80 ones,
    and the warpgroup-MMA prefills at 128 that 80 runs on; 112 the 128 ones. 132 runs on nothing."""
    sel = aot.select(ops=["attn_fwd"], filters={"head_sizes": ["72"], "dtypes": ["bf16"], "features": ["none"],
                                                "kv_cache_dtypes": ["auto"]})
    assert {(s.mode, s.head_dim) for s in sel.specs} >= {("decode", 80), ("prefill", 80), ("prefill_ws", 128)}
    assert {s.head_dim for s in sel.specs} == {80, 128}
    sel = aot.select(ops=["attn_fwd"], filters={"head_sizes": ["112"], "dtypes": ["bf16"], "features": ["none"]})
    assert {s.head_dim for s in sel.specs} == {128}
    with pytest.raises(aot.SelectionError, match="132 not supported"):
        aot.select(ops=["attn_fwd"], filters={"head_sizes": ["132"]})
