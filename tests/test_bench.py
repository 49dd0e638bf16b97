"""CPU tests of `pagedattn bench`: the results schema, RESULTS.md from the stored samples,
`bench compare`, the no-GPU message, and the harness itself (timer control flow, suites driven on the
CPU with torch stand-ins for the kernels, crash / hang recovery of the runner)."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import pagedattn
from pagedattn.bench import attention, common, peers, report, schema, suites, timing, write
from pagedattn.bench.common import Ctx, Recorder

DATA = Path(__file__).parent / "data"
SAMPLES = sorted(DATA.glob("bench_sample_*.json"))
REPO = Path(__file__).resolve().parent.parent


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])  # _selftest
    env.update(extra)
    return env


def _cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "pagedattn.cli", *args], capture_output=True, text=True,
                          env=env or _env(), timeout=timeout, cwd=REPO)


def _cpu_ctx(**kw) -> Ctx:
    return Ctx.make("cpu", quick=kw.pop("quick", False), tiny=True,
                    ceilings={"copy": {"value": 10.0}, "matmul": {"value": 1.0}}, **kw)


def _run_case(case, ctx) -> dict:
    rec = Recorder(case, ctx)
    try:
        case.run(ctx, rec)
    except Exception as exc:  # noqa: BLE001 - as the child does
        rec.fail(exc)
    return rec.finish()


# -- schema ----------------------------------------------------------------------------------------
def test_samples_exist_and_are_marked_sample():
    assert len(SAMPLES) >= 2
    for path in SAMPLES:
        data = json.loads(path.read_text())
        assert data["metadata"]["sample"] is True
        assert schema.validate(data) == [], path


def test_schema_catches_mistakes():
    good = json.loads(SAMPLES[0].read_text())
    assert schema.validate(good) == []

    def broken(mutate):
        d = copy.deepcopy(good)
        mutate(d)
        return schema.validate(d)

    assert any("schema" in e for e in broken(lambda d: d.update(schema="other/0")))
    assert any("metadata: missing key 'gpu'" in e for e in broken(lambda d: d["metadata"].pop("gpu")))
    assert any("metadata.sample" in e for e in broken(lambda d: d["metadata"].update(sample="yes")))
    first = lambda d: d["suites"]["write"]["cases"][0]  # noqa: E731
    assert any("status" in e for e in broken(lambda d: first(d).update(status="fine")))
    assert any(".us" in e for e in broken(lambda d: first(d)["ours"].update(us=-1.0)))
    assert any("needs an 'ours'" in e for e in broken(lambda d: first(d).update(ours=None)))
    assert any("needs an error" in e for e in broken(lambda d: first(d).update(status="crashed", error=None)))
    assert any("unknown peer" in e for e in broken(lambda d: first(d)["ratios"].update(ghost=2.0)))
    assert any("duplicate case id" in e
               for e in broken(lambda d: d["suites"]["write"]["cases"].append(copy.deepcopy(first(d)))))
    assert any("unknown suite" in e for e in broken(lambda d: d["suites"].update(nosuch={"status": "ok",
                                                                                          "cases": []})))
    assert any("ceilings.copy.value" in e for e in broken(lambda d: d["ceilings"]["copy"].update(value="x")))
    with pytest.raises(schema.SchemaError):
        schema.check({"schema": schema.SCHEMA})


def test_derive_fraction_ratio_and_goal():
    case = schema.new_case("write/x", "write")
    case.update(unit="GB/s", work=2e9, ceiling="copy",
                ours=schema.impl_from_methods("ours", {"rot": {"us": 500.0}}),
                peers={"p": schema.impl_from_methods("p", {"rot": {"us": 1500.0}}), "bad": schema.impl_error("bad", "no")},
                target={"value": 0.9, "unit": "fraction", "met": None})
    schema.derive(case, {"copy": {"value": 4000.0}})
    assert case["ours"]["value"] == pytest.approx(4000.0)      # 2e9 B / 500 µs
    assert case["ours"]["fraction"] == pytest.approx(1.0)
    assert case["peers"]["p"]["fraction"] == pytest.approx(1 / 3)
    assert case["ratios"] == {"p": pytest.approx(3.0)}          # peer time / ours: ours 3x faster
    assert case["target"]["met"] is True
    assert schema.throughput("TFLOP/s", 2e12, 1e6) == pytest.approx(2.0)
    assert schema.target_met({"unit": "us", "value": 6.0}, {"us": 7.0}) is False
    assert schema.target_met({"unit": "TFLOP/s", "value": 330.0}, {"value": 340.0}) is True
    assert schema.target_met({"unit": "us", "value": 6.0}, None) is None


# -- RESULTS.md, compare --------------------------------------------------------------------------
def test_results_md_from_samples(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for p in SAMPLES:
        (results / p.name).write_text(p.read_text())
    text = report.write_results_md(results, tmp_path / "RESULTS.md", include_samples=True).read_text()
    for suite in ("write", "decode", "prefill", "legacy", "jit"):
        assert f"## {report.SUITE_TITLES[suite]}" in text
    assert "| NHD/bf16/T65536 |" in text and "B64/ctx4096/bf16" in text
    assert "torch index_copy_" in text and "sdpa cudnn" in text
    assert "## Across architectures" in text
    assert text.count("| `bench_sample_") == len(SAMPLES)


def test_results_md_ignores_sample_files(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for p in SAMPLES:
        (results / p.name).write_text(p.read_text())
    (results / "garbage.json").write_text("{not json")
    (results / "other_tool.json").write_text('{"rows": []}')      # not ours: skipped silently
    bad = json.loads(SAMPLES[0].read_text())
    bad["metadata"]["sample"] = False
    bad["suites"]["write"]["cases"][0]["status"] = "bogus"
    (results / "broken_bench.json").write_text(json.dumps(bad))
    warnings = []
    text = report.write_results_md(results, tmp_path / "RESULTS.md", warn=warnings.append).read_text()
    assert "No results yet" in text and "bench_sample" not in text
    assert sorted(w.split()[1].rsplit("/", 1)[-1].rstrip(":") for w in warnings) == \
        ["broken_bench.json", "garbage.json"]


def test_latest_run_per_gpu_wins(tmp_path):
    old = json.loads(SAMPLES[0].read_text())
    new = copy.deepcopy(old)
    new["metadata"]["date"] = "2099-01-01T00:00:00+00:00"
    (tmp_path / "b_old.json").write_text(json.dumps(old))
    (tmp_path / "a_new.json").write_text(json.dumps(new))
    forced = copy.deepcopy(new)  # a newer run under --overrides: not the library's defaults, left out
    forced["metadata"].update(date="2099-02-01T00:00:00+00:00", overrides={"write": {"flat": False}})
    (tmp_path / "c_overrides.json").write_text(json.dumps(forced))
    files = report.load_folder(tmp_path, include_samples=True)
    assert [p.name for p, _ in files] == ["b_old.json", "a_new.json"]   # by date, not by name
    latest = report.latest_per_gpu(files, "write")
    assert [p.name for p, _ in latest.values()] == ["a_new.json"]


def test_compare_two_samples():
    a, b = (report.load(p) for p in SAMPLES[:2])
    header, rows, summary = report.compare(a, b)
    assert header[:3] == ["suite", "case", "impl"]
    n_common = len({c["id"] for c in schema.all_cases(a)} & {c["id"] for c in schema.all_cases(b)})
    assert len(rows) == 2 + n_common            # two ceilings + one row per common case
    assert rows[0][:2] == ["ceiling", "copy"] and rows[0][5].endswith("×")
    assert any("geometric mean" in s for s in summary)
    _, rows_peers, _ = report.compare(a, b, peers=True)
    assert len(rows_peers) > len(rows)


def test_compare_cli():
    r = _cli("bench", "compare", str(SAMPLES[0]), str(SAMPLES[1]))
    assert r.returncode == 0, r.stderr
    assert "B speed vs A" in r.stdout and "NHD/bf16/T65536" in r.stdout
    assert r.stdout.startswith("| suite | case |")
    r = _cli("bench", "compare", str(SAMPLES[0]), str(DATA / "no_such_file.json"))
    assert r.returncode != 0 and "Traceback" not in r.stderr


def test_ab_table_of_a_sweep():
    """`bench ab`: an A/B sweep's runs (two rounds each of the defaults and of kLazyMax 3, session 31's
    perf/results/ws_lag/call3_280c8ca) side by side, a column per --overrides point, every round's
    back-to-back / flushed times and the point's median over the defaults'."""
    files = sorted((REPO / "perf" / "results" / "ws_lag" / "call3_280c8ca").glob("*.json"))
    header, rows, summary = report.ab_table([report.load(p) for p in files])
    assert header == ["case", "defaults", "kLazyMax=3"]
    d128 = next(r for r in rows if r[0] == "prefill/d128/B4/S4096")
    assert d128[1] == "1112 / 1113, 1135 / 1101" and d128[2].startswith("1094 / 1084, 1088 / 1086 (0.97")
    assert summary[:2] == ["defaults: 2 run(s)", "kLazyMax=3: 2 run(s)"]
    assert report.overrides_label({"attention": {"prefill": "prefill_ws", "tiles": {"prefill_ws": {"kStages": 3}}}}) \
        == 'prefill="prefill_ws", kStages=3'
    r = _cli("bench", "ab", *map(str, files))
    assert r.returncode == 0 and r.stdout.startswith("| case | defaults | kLazyMax=3 |"), r.stderr


def test_nvidia_smi_reads_the_cuda_device_by_uuid(monkeypatch):
    """Clocks and driver come from nvidia-smi's row of the GPU that CUDA runs on (by UUID: nvidia-smi's
    order may differ from CUDA's); nothing usable -> None."""
    from pagedattn.bench import meta

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid="ab-12"))
    calls = []
    monkeypatch.setattr(meta, "_run", lambda cmd: calls.append(cmd) or "570.1, P0, 1980, 3201, 1980, 3201, 120.5, 700, 41")
    row = meta.nvidia_smi(0)
    assert calls[0][1] == "--id=GPU-ab-12" and row["driver_version"] == "570.1" and row["temperature.gpu"] == "41"
    monkeypatch.setattr(meta, "_run", lambda cmd: None)
    assert meta.nvidia_smi(0) is None


def test_no_gpu_message():
    r = _cli("bench", "--quick", env=_env(CUDA_VISIBLE_DEVICES=""), timeout=120)
    assert r.returncode != 0
    assert "no CUDA GPU" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


# -- the harness on the CPU ------------------------------------------------------------------------
def test_suite_names():
    assert suites.parse("all") == ["write", "decode", "prefill", "features", "jit"]
    assert suites.parse("jit,write") == ["write", "jit"]
    assert suites.parse("sweep,decode") == ["decode", "sweep"]   # sweep: only when named
    with pytest.raises(ValueError):
        suites.parse("write,bogus")


def test_rotation_sets():
    l2 = 60 * 2**20
    assert timing.rotation_sets(1 * 2**30, l2) == 1          # 1 GiB working set: no rotation
    assert timing.rotation_sets(100 * 2**20, l2) == 3        # ceil(240 / 100)
    assert timing.rotation_sets(1000, l2) == 64              # capped
    assert timing.rotation_sets(3 * 2**30, l2, max_total_bytes=2 * 2**30) == 1


def test_timer_control_flow_with_fake_cuda(monkeypatch):
    """The CUDA-event timer's loop (warm-up, probe, batches with a head start) on a fake clock."""
    slept = []
    _fake_events(monkeypatch, [])
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: slept.append(cycles), raising=False)
    calls = []
    t = timing.Timer(budget_s=0.01, min_reps=25, max_reps=60, warmup_s=0.0, batch=10)
    res = t.measure(lambda k: calls.append(k), 3, ("rot",))["rot"]
    assert 25 <= res["reps"] <= 60 and res["sets"] == 3
    assert res["min"] <= res["p10"] <= res["us"] <= res["p90"]
    assert set(calls) == {0, 1, 2}
    assert slept, "the timer gives the GPU a head start before each batch"


def test_cpu_timer():
    res = timing.CpuTimer(budget_s=0.001, min_reps=5, max_reps=10).measure(lambda k: sum(range(100)), 2, ("rot",))
    res = res["rot"]
    assert 5 <= res["reps"] <= 10 and res["us"] > 0 and res["method"] == "rot"


def _fake_events(monkeypatch, log):
    import time as _time

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self, stream=None):
            log.append("R")
            self.t = _time.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None, raising=False)


def test_flush_timer_structure_with_fake_cuda(monkeypatch):
    """"flush": every timed call is flush, start event, the call, end event — the flush outside the
    events, one flush per call (as do_bench); "rot" never flushes."""
    log = []
    _fake_events(monkeypatch, log)
    t = timing.Timer(budget_s=0.005, min_reps=12, max_reps=30, warmup_s=0.0, batch=5, l2_bytes=60 * 2**20)
    assert t.flush_nbytes == 256 * 2**20                      # >= 256 MiB and > 4x the 60 MiB L2
    t.flush = lambda: log.append("F")
    calls = []

    def fn(k):
        calls.append(k)
        log.append("C")
    res = t.measure(fn, sets=3)
    assert list(res) == ["rot", "flush"]
    rot, flush = res["rot"], res["flush"]
    assert rot["method"] == "rot" and flush["method"] == "flush" and 12 <= flush["reps"] <= 30
    text = "".join(log)
    first_flush = text.index("F")
    assert "F" not in text[:first_flush] and text[:first_flush].count("RCR") >= rot["reps"]
    flushed = text[first_flush:]
    # every call of the flush method is preceded by its own flush (warm-up and probe: F C; timed: F R C R)
    assert flushed.count("C") == flushed.count("F")
    assert all(flushed[i - 1] == "F" or flushed[i - 2:i] == "FR" for i, ch in enumerate(flushed) if ch == "C")
    assert flushed.count("FRCR") == flush["reps"]                # the timed calls: the events hold the call only
    assert set(calls) == {0, 1, 2}
    with pytest.raises(ValueError, match="unknown timing method"):
        t.measure(fn, methods=("warm",))


def test_flush_buffer_size_and_flush_on_cpu():
    assert timing.Timer(l2_bytes=60 * 2**20).flush_nbytes == 256 * 2**20     # H200: 60 MiB L2
    assert timing.Timer(l2_bytes=100 * 2**20).flush_nbytes == 400 * 2**20    # a larger L2: 4x
    assert timing.Timer().flush_nbytes == 256 * 2**20
    t = timing.CpuTimer(budget_s=0.001, min_reps=4, max_reps=8, flush_nbytes=4096, device="cpu")
    t.flush()
    assert t.flush_buf.numel() * t.flush_buf.element_size() == 4096
    t.flush_buf.fill_(7)
    t.flush()
    assert int(t.flush_buf.abs().sum()) == 0
    seen, orig = [], t.flush

    def counting():
        seen.append(t.flush_buf.numel())
        orig()
    t.flush = counting
    res = t.measure(lambda k: None, sets=1, methods=("flush",))
    assert res["flush"]["method"] == "flush" and len(seen) >= res["flush"]["reps"] and set(seen) == {1024}


def test_host_loops_and_median_us_before(monkeypatch):
    """The host-cost loops (perf/launch_overhead.py; sync and clock as a CPU run would pass them) and median_us's
    `before` (perf/multigpu.py's barrier): what runs where, on fake clocks and events."""
    log = []
    ticks = iter(range(0, 10**6, 10))
    loops = timing.host_loops(lambda: log.append("C"), 4, loops=3, warmup=2, before=lambda: log.append("B"),
                              sync=lambda: log.append("S"), clock=lambda: next(ticks) * 1e-6)
    assert "".join(log) == "CCS" + "BCCCCS" * 3
    assert loops == pytest.approx([2.5] * 3)  # one 10 µs tick over 4 calls
    _fake_events(monkeypatch, log)
    log.clear()
    assert timing.median_us(lambda: log.append("C"), reps=3, warmup=1, before=lambda: log.append("B")) >= 0
    assert "".join(log) == "C" + "BRCR" * 3


def _fake_flash(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k=None, causal=False,
                block_table=None, softmax_scale=None, return_softmax_lse=False, num_splits=0,
                k_descale=None, v_descale=None):
    from pagedattn import reference

    kw = {} if k_descale is None else {"kv_cache_dtype": "fp8_e4m3" if k.dtype == torch.float8_e4m3fn
                                       else "fp8_e5m2", "k_descale": k_descale, "v_descale": v_descale}
    return reference.paged_attention(q, k, v, cu_seqlens_q, seqused_k, block_table, causal=causal,
                                     softmax_scale=softmax_scale, **kw).to(q.dtype)


def _fake_flash_features(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k=None, causal=False,
                         block_table=None, softmax_scale=None, num_splits=0, s_aux=None, return_softmax_lse=False,
                         **features):
    from pagedattn import reference
    return reference.paged_attention(q, k, v, cu_seqlens_q, seqused_k, block_table, causal=causal,
                                     softmax_scale=softmax_scale, sinks=s_aux, **features).to(q.dtype)


def test_feature_cases_with_a_stand_in_kernel(monkeypatch):
    """The features suite: each case checks ours against pagedattn.reference and times the plain
    variant as its peer, with the ratio goal attached; head dim 512 is held to the copy ceiling."""
    monkeypatch.setattr(pagedattn, "flash_attn_varlen_func", _fake_flash_features, raising=False)
    ctx = _cpu_ctx()
    cases = attention.feature_cases(ctx)
    assert cases and {c.suite for c in cases} == {"features"}
    for case in cases:
        rec = _run_case(case, ctx)
        assert rec["status"] == "ok", (case.id, rec["error"])
        assert rec["check"]["ok"], rec["check"]
        assert attention.PLAIN in rec["peers"] and rec["goals"][0]["peer"] == attention.PLAIN
    real = [c.id for c in attention.feature_cases(Ctx.make("cpu", quick=True))]
    assert "decode/B16/ctx32768/window4096" in real and "decode/B16/ctx4096/d512" in real
    d512 = next(c for c in attention.feature_cases(Ctx.make("cpu", quick=True)) if c.id.endswith("d512"))
    assert d512.params["d"] == 512


def test_decode_and_prefill_cases_with_a_stand_in_kernel(monkeypatch):
    monkeypatch.setattr(pagedattn, "flash_attn_varlen_func", _fake_flash, raising=False)
    ctx = _cpu_ctx()
    cases = attention.decode_cases(ctx) + attention.prefill_cases(ctx)
    assert {c.suite for c in cases} == {"decode", "prefill"}
    roles = set()
    for case in cases:
        rec = _run_case(case, ctx)
        assert rec["status"] == "ok", (case.id, rec["error"])
        assert rec["check"]["ok"] and rec["check"]["rel_l2"] < 1e-2
        ours = rec["ours"]
        assert ours["us"] > 0 and ours["value"] > 0
        assert set(ours["methods"]) == set(timing.METHODS)           # every case under both methods
        assert ours["us"] == max(m["us"] for m in ours["methods"].values())
        assert all(m["fraction"] > 0 for m in ours["methods"].values())
        role = case.params["peers"]
        roles.add(role)
        if role in ("all", "torch"):
            gather = rec["peers"]["gather+sdpa"]      # torch SDPA on the CPU: an independent check of the
            assert gather.get("error") is None        # gather, the GQA handling and the causal alignment
            assert gather["rel_l2"] < 1e-2 and set(gather["methods"]) == set(timing.METHODS)
            assert "gather+sdpa" in rec["ratios"]
            assert set(rec["ratios_by_method"]) == set(timing.METHODS)
            assert rec["peers"]["sdpa cudnn"]["error"] == "needs CUDA"
        if role == "all" and case.suite == "decode":
            assert rec["peers"]["fa4 paged"]["error"] == "needs CUDA"
        if role == "base":                            # HND / other block sizes: against ours, plain
            assert set(rec["peers"]) == {attention.BASE_PEER}
            assert set(rec["peers"][attention.BASE_PEER]["methods"]) == set(timing.METHODS)
            assert attention.BASE_PEER in rec["ratios"]
        if role == "none":
            assert rec["peers"] == {} and "no peers" in rec["notes"]
        assert schema.validate_case(json.loads(json.dumps(rec))) == []
    assert roles == {"all", "torch", "none", "base"}


def test_decode_case_list_has_the_issue17_goal_cases():
    ctx = Ctx.make("cpu", quick=True)               # the real list (not the tiny one), not run here
    cases = {c.id: c for c in attention.decode_cases(ctx)}
    assert list(cases) == [
        "decode/B1/ctx32768/bf16", "decode/B1/ctx131072/bf16", "decode/B16/ctx4096/bf16",
        "decode/B64/ctx4096/bf16", "decode/B128/ctx2048/bf16", "decode/B64/ctx4096/fp8_e4m3",
        "decode/B64/ctx4096/fp8_e5m2", "decode/B64/ctx4096/bf16/HND", "decode/B64/ctx4096/bf16/bs32",
        "decode/B64/ctx4096/bf16/bs64", "decode/B64/ctx4096/bf16/bs128"]
    for c in cases.values():
        p = c.params
        assert (p["hq"], p["hkv"], p["d"], p["dtype"], p["q_len"]) == (32, 8, 128, "bf16", 1)
    assert cases["decode/B64/ctx4096/bf16/HND"].params["layout"] == "HND"
    assert [cases[f"decode/B64/ctx4096/bf16/bs{b}"].params["bs"] for b in (32, 64, 128)] == [32, 64, 128]
    assert {cid: c.params["peers"] for cid, c in cases.items() if c.params["peers"] != "all"} == {
        "decode/B64/ctx4096/fp8_e4m3": "torch", "decode/B64/ctx4096/fp8_e5m2": "none",
        "decode/B64/ctx4096/bf16/HND": "base", "decode/B64/ctx4096/bf16/bs32": "base",
        "decode/B64/ctx4096/bf16/bs64": "base", "decode/B64/ctx4096/bf16/bs128": "base"}
    assert cases["decode/B64/ctx4096/fp8_e5m2"].params["kv_cache_dtype"] == "fp8_e5m2"
    goals = {cid: (s.get("goal_us"), s.get("vs")) for s, cid in zip(attention.DECODE, cases)}
    assert goals["decode/B1/ctx32768/bf16"] == (40.0, None)
    assert goals["decode/B1/ctx131072/bf16"] == (None, ("sdpa cudnn", 0.85))
    assert goals["decode/B64/ctx4096/bf16"] == (245.0, ("sdpa cudnn", 1.0))
    assert goals["decode/B64/ctx4096/fp8_e5m2"][0] == 130.0
    assert goals["decode/B64/ctx4096/bf16/bs128"] == (None, (attention.BASE_PEER, pytest.approx(1 / 1.03)))
    # the same list with --quick and without (issue 17: the goal cases run in the quick suite)
    assert [c.id for c in attention.decode_cases(Ctx.make("cpu", quick=False))] == list(cases)


def test_prefill_case_list_has_the_issue16_goal_cases():
    ctx = Ctx.make("cpu", quick=True)               # the real list, not run here
    cases = {c.id: c for c in attention.prefill_cases(ctx)}
    assert list(cases) == [
        "prefill/B4/S4096/causal", "prefill/B4/S4096/causal/fp8_e4m3", "prefill/B1/S16384/causal",
        "prefill/B4/S4096/noncausal", "chunk/B8/q512/ctx8192/causal", "prefill/B4/S4096/causal/d64",
        "prefill/B4/S4096/causal/d256", "prefill/B4/S4096/causal/d96", "multi/B32/q8/ctx4096/causal",
        "multi/B32/q32/ctx4096/causal"]
    assert [c.params["causal"] for c in cases.values()].count(False) == 1
    assert cases["prefill/B4/S4096/noncausal"].params["causal"] is False
    assert [cases[f"prefill/B4/S4096/causal/d{d}"].params["d"] for d in (64, 256, 96)] == [64, 256, 96]
    fp8 = cases["prefill/B4/S4096/causal/fp8_e4m3"].params    # held to ours on a bf16 cache, same shape
    assert (fp8["peers"], fp8["base"]["kv_cache_dtype"], fp8["base_name"]) == ("base", "auto", attention.BF16)
    goals = {cid: s["goal"] for s, cid in zip(attention.PREFILL, cases)}
    assert goals["prefill/B4/S4096/causal"] == {"tflops": 560.0, "vs": (("sdpa cudnn", 1.0), ("fa4 paged", 1.0))}
    assert goals["prefill/B4/S4096/noncausal"]["tflops"] == 600.0 and goals["chunk/B8/q512/ctx8192/causal"]["tflops"] == 500.0
    assert goals["prefill/B4/S4096/causal/d256"] == {"vs": (("sdpa cudnn", 0.9),)}
    assert goals["multi/B32/q32/ctx4096/causal"] == {"us": 170.0}


def test_prefill_work_counts_the_keys_each_query_sees(monkeypatch):
    """TFLOP/s of the tiny prefill cases (square causal, and fewer queries than keys non-causal): the keys each
    query sees, summed (the multi-token cases, at most 64 queries over 8x as many keys, count KV bytes)."""
    monkeypatch.setattr(pagedattn, "flash_attn_varlen_func", _fake_flash, raising=False)
    ctx = _cpu_ctx()
    for case in attention.prefill_cases(ctx):
        p = case.params
        rec = _run_case(case, ctx)
        B, sq, L = p["B"], p["q_len"], p["ctx"]
        keys = sq * (L - sq) + sq * (sq + 1) / 2 if p["causal"] else sq * L
        assert rec["unit"] == "TFLOP/s" and rec["work"] == 4 * B * p["hq"] * p["d"] * keys, case.id


def _goal_record(monkeypatch, case_filter):
    """Run one tiny decode case with the goals of the real list attached (run_case skips them when tiny)."""
    monkeypatch.setattr(pagedattn, "flash_attn_varlen_func", _fake_flash, raising=False)
    ctx = _cpu_ctx()
    case = next(c for c in attention.decode_cases(ctx) if case_filter(c))
    rec = Recorder(case, ctx)
    case.run(ctx, rec)
    rec.target(1e9, "us")                         # any goal: the shapes are tiny
    rec.goal_ratio("gather+sdpa", 1e-6)
    return rec.finish(), ctx


def test_decode_json_schema_has_both_methods(monkeypatch):
    rec, ctx = _goal_record(monkeypatch, lambda c: c.params["peers"] == "all")
    rec = json.loads(json.dumps(rec))
    assert schema.validate_case(rec) == []
    ours = rec["ours"]
    assert set(ours["methods"]) == {"rot", "flush"} and ours["method"] in ("rot", "flush")
    for m, entry in ours["methods"].items():
        assert entry["us"] > 0 and entry["reps"] >= 1 and entry["value"] == pytest.approx(rec["work"] / (entry["us"] * 1e3))
        assert entry["fraction"] == pytest.approx(entry["value"] / ctx.ceilings["copy"]["value"])
    assert rec["floor_us"] == pytest.approx(rec["work"] / (ctx.ceilings["copy"]["value"] * 1e3))
    gather = rec["peers"]["gather+sdpa"]
    by = rec["ratios_by_method"]
    for m in ("rot", "flush"):
        assert by[m]["gather+sdpa"] == pytest.approx(gather["methods"][m]["us"] / ours["methods"][m]["us"])
    assert rec["ratios"]["gather+sdpa"] == pytest.approx(min(by[m]["gather+sdpa"] for m in by))
    assert rec["target"]["met"] is True and rec["goals"] == [
        {"value": 1e-6, "unit": "ratio", "peer": "gather+sdpa", "met": True}]
    assert "variant" in gather and "candidates" in gather  # which configuration ran, and what was tried

    def broken(mutate):
        d = copy.deepcopy(rec)
        mutate(d)
        return schema.validate_case(d)
    assert any("unknown method" in e for e in broken(lambda d: d["ours"]["methods"].update(warm={"us": 1.0})))
    assert any("worse" in e for e in broken(lambda d: d["ours"].update(us=d["ours"]["us"] / 2)))
    assert any("methods.rot.us" in e for e in broken(lambda d: d["ours"]["methods"]["rot"].update(us=-1)))
    assert any("goals must be" in e for e in broken(lambda d: d["goals"][0].update(unit="us")))


def test_derive_with_methods_uses_the_worse():
    t = lambda us, m: {"us": us, "p10": us, "p90": us, "min": us, "reps": 3, "sets": 1, "method": m}  # noqa: E731
    case = schema.new_case("decode/x", "decode")
    case.update(unit="GB/s", work=4e6, ceiling="copy",
                ours=schema.impl_from_methods("ours", {"rot": t(1.0, "rot"), "flush": t(2.0, "flush")}),
                peers={"p": schema.impl_from_methods("p", {"rot": t(3.0, "rot"), "flush": t(2.5, "flush")}),
                       "old": schema.impl_from_methods("old", {"rot": t(4.0, "rot")})},
                target={"value": 1.5, "unit": "us", "met": None},
                goals=[{"value": 1.2, "unit": "ratio", "peer": "p", "met": None}])
    schema.derive(case, {"copy": {"value": 1000.0}})
    assert case["ours"]["us"] == 2.0 and case["ours"]["method"] == "flush"   # the worse is the headline
    assert case["ours"]["value"] == pytest.approx(2000.0)                    # 4e6 B / 2 µs
    assert case["ours"]["methods"]["rot"]["fraction"] == pytest.approx(4.0)
    assert case["ratios_by_method"] == {"rot": {"p": pytest.approx(3.0)}, "flush": {"p": pytest.approx(1.25)}}
    assert case["ratios"]["p"] == pytest.approx(1.25)                        # least favourable to ours
    assert case["ratios"]["old"] == pytest.approx(2.0)                       # no methods: headline / headline
    assert case["target"]["met"] is False                                    # 2.0 µs under flush > 1.5
    assert case["goals"][0]["met"] is True                                   # 1.25 >= 1.2
    assert case["floor_us"] == pytest.approx(4.0)                            # 4e6 B at 1000 GB/s
    case["goals"][0]["value"] = 1.3
    assert schema.derive(case, {"copy": {"value": 1000.0}})["goals"][0]["met"] is False


def test_decode_table_renders_both_methods(monkeypatch):
    rec, _ = _goal_record(monkeypatch, lambda c: c.params["peers"] == "all")
    data = {"metadata": {"gpu": "cpu"}, "suites": {"decode": {"cases": [rec]}}}
    header, rows = report.suite_table(data, "decode")
    assert header[:3] == ["case", "us_rot", "us_flush"]
    assert "floor" in header and "goal (H200)" in header
    row = dict(zip(header, rows[0]))
    assert row["case"] == rec["id"].split("/", 1)[1]
    assert row["us_rot"] == report.fmt_us(rec["ours"]["methods"]["rot"]["us"])
    assert row["us_flush"] == report.fmt_us(rec["ours"]["methods"]["flush"]["us"])
    assert row["floor"] == report.fmt_us(rec["floor_us"])
    assert row["goal (H200)"].endswith("≥ 1e-06× gather+sdpa ✓") and "✓" in row["goal (H200)"].split(";")[0]
    cell = row["gather+sdpa"]
    assert cell.startswith(report.fmt_methods(rec["peers"]["gather+sdpa"])) and "(ours " in cell
    assert row["sdpa cudnn"] == "n/a"
    md = report.markdown_table(header, rows)
    assert md.startswith("| case | us_rot | us_flush |")
    line = report.describe(rec)
    assert line.startswith(rec["id"] + ": us_rot ") and "; gather+sdpa " in line
    pair = {"methods": {"rot": {"us": 50.12}, "flush": {"us": 52.3}}}
    assert report.fmt_methods(pair) == "50.1 / 52.3 µs"
    assert report.fmt_methods({"methods": {"rot": {"us": 9.5}, "flush": {"us": 150.0}}}) == "9.50 / 150 µs"
    # ours failed but the peers were timed: still the two-method layout
    failed = dict(rec, ours=None, status="error", error="boom")
    assert report.suite_table({"suites": {"decode": {"cases": [failed]}}}, "decode")[0][1] == "us_rot"
    # a suite timed by one method (write; and every suite of files from before the methods): one column
    sample = json.loads(SAMPLES[0].read_text())
    assert report.suite_table(sample, "write")[0][:2] == ["case", "ours"]
    assert report.suite_table(sample, "decode")[0][:3] == ["case", "us_rot", "us_flush"]


def test_unsupported_cache_dtype_is_skipped_not_failed(monkeypatch):
    from pagedattn.ops.attention import AttnFwdSpec

    monkeypatch.setattr(pagedattn, "flash_attn_varlen_func", _fake_flash, raising=False)
    ctx = _cpu_ctx()
    e5m2 = next(c for c in attention.decode_cases(ctx) if c.params["kv_cache_dtype"] == "fp8_e5m2")
    monkeypatch.setitem(AttnFwdSpec.SUPPORTED, "kv_cache_dtype", ("auto", "fp8_e4m3"))
    rec = _run_case(e5m2, ctx)
    assert rec["status"] == "skipped" and "unsupported by pagedattn" in rec["error"]
    assert schema.validate_case(json.loads(json.dumps(rec))) == []
    monkeypatch.undo()

    def refuses(*args, **kwargs):
        raise pagedattn.UnsupportedError("no fp8_e5m2 variant on this GPU")
    monkeypatch.setattr(pagedattn, "flash_attn_varlen_func", refuses, raising=False)
    rec = _run_case(e5m2, ctx)
    assert rec["status"] == "skipped" and "no fp8_e5m2 variant" in rec["error"]


def test_fastest_keeps_the_fastest_correct_configuration():
    ref = torch.ones(4)
    times = {}

    def cand(us, out=None, fail=False):
        def factory():
            if fail:
                raise RuntimeError("backend refuses this shape")

            def fn(k):
                return ref.clone() if out is None else out
            times[fn] = us
            return fn
        return factory
    ctx = types.SimpleNamespace(is_cuda=True, sync=lambda: None,
                                timer=types.SimpleNamespace(probe=lambda fn, sets=1: times[fn]))
    info = {}
    fn = peers.fastest(ctx, [("slow", cand(50.0)), ("refused", cand(1.0, fail=True)),
                             ("wrong", cand(0.5, out=torch.zeros(4))), ("fast", cand(20.0))], ref, info)
    assert times[fn] == 20.0 and info["variant"] == "fast" and info["rel_l2"] == 0.0
    assert "slow: 50.0 us" in info["candidates"] and "refused: RuntimeError" in info["candidates"]
    assert "wrong: wrong output" in info["candidates"]
    with pytest.raises(RuntimeError, match="refused"):
        peers.fastest(ctx, [("refused", cand(1.0, fail=True))], ref, {})


def test_sdpa_decode_offers_enable_gqa_first():
    ctx = _cpu_ctx()
    data = attention.build(ctx, attention.decode_cases(ctx)[0].params, sets=1)
    k, v = data.contiguous_kv(0)
    names = [n for n, _ in peers.sdpa_candidates(data, data.q, lambda i: (k, v))]
    assert names == ["enable_gqa", "gqa folded into q_len"]


def test_sdpa_peers_agree_with_the_reference():
    """The SDPA call shapes used for the cuDNN / flash peers, run on the CPU's default backend."""
    ctx = _cpu_ctx()
    for p in (attention.decode_cases(ctx)[0].params, attention.prefill_cases(ctx)[0].params):
        data = attention.build(ctx, p, sets=1)
        ref = attention.reference_out(data)
        k, v = data.contiguous_kv(0)
        for variant, factory in peers.sdpa_candidates(data, data.q, lambda i: (k, v)):
            assert common.rel_l2(factory()(0), ref) < 1e-2, variant


def test_a_wrong_kernel_fails_its_check(monkeypatch):
    def wrong(*args, **kwargs):
        out = _fake_flash(*args, **kwargs)
        return out.flip(0)
    monkeypatch.setattr(pagedattn, "flash_attn_varlen_func", wrong, raising=False)
    ctx = _cpu_ctx()
    rec = _run_case(attention.decode_cases(ctx)[0], ctx)
    assert rec["status"] == "check_failed" and rec["check"]["ok"] is False
    assert rec["ours"] is not None                # still timed, clearly marked


def test_write_cases_with_the_reference_as_kernel(monkeypatch):
    from pagedattn import reference

    ctx = _cpu_ctx()
    cases = write.cases(ctx)
    assert len(cases) == 2 * 2 * len(write.TINY_TOKENS)
    # on the CPU the real op refuses: the case errors, the torch peer is still measured
    rec = _run_case(cases[1], ctx)
    assert rec["status"] == "error" and "pagedattn" in rec["error"]
    assert rec["peers"]["torch index_copy_"].get("error") is None
    # with the reference standing in for the kernel every layout / dtype checks bit-exact
    monkeypatch.setattr(pagedattn, "reshape_and_cache_flash", reference.reshape_and_cache_flash)
    for case in cases:
        rec = _run_case(case, ctx)
        assert rec["status"] == "ok", (case.id, rec["error"], rec["check"])
        assert rec["check"]["kind"] == "bit-exact"
        assert rec["peers"]["torch index_copy_"].get("error") is None, rec["peers"]


def test_write_check_finds_a_wrong_and_a_stray_slot(monkeypatch):
    """The bit-exact check compares every slot with pagedattn.reference's write: a token written wrong, or a
    slot written that should not be, fails the case (still timed)."""
    from pagedattn import reference

    def wrong(key, value, kc, vc, slots, *args, **kw):
        reference.reshape_and_cache_flash(key, value, kc, vc, slots, *args)
        kc.view(torch.uint8)[0, 0, 0, 0] ^= 1          # a bit of slot 0 flipped
        vc.view(torch.uint8)[-1, -1].fill_(3)          # the last slot overwritten
    monkeypatch.setattr(pagedattn, "reshape_and_cache_flash", wrong)
    ctx = _cpu_ctx()
    rec = _run_case(next(c for c in write.cases(ctx) if c.params["T"] == 40), ctx)
    assert rec["status"] == "check_failed" and rec["ours"] is not None
    assert rec["check"]["detail"] == ("K: 1 slots differ from pagedattn.reference; "
                                      "V: 1 slots differ from pagedattn.reference"), rec["check"]


def test_write_peers_write_what_the_reference_writes():
    """The torch peers (NHD index_copy_, HND row index_copy_, fp8 quantise) are the same op."""
    from pagedattn import reference

    ctx = _cpu_ctx()
    for case in write.cases(ctx):
        if case.params["T"] != 16:
            continue
        inp = write.inputs(ctx, case.params)
        want_k, want_v = inp.kc.clone(), inp.vc.clone()
        write.torch_peer(inp)(0)
        reference.reshape_and_cache_flash(inp.keys[0], inp.values[0], want_k, want_v, inp.slots[0],
                                          case.params["kv_cache_dtype"], inp.k_scale, inp.v_scale)
        for got, want in ((inp.kc, want_k), (inp.vc, want_v)):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), case.id


def test_runner_end_to_end_survives_errors_and_crashes(tmp_path):
    """The real runner on the CPU: a case that raises, a process that dies in a case; the other cases
    complete, the results file validates, RESULTS.md is regenerated (and ignores this dry run)."""
    out = tmp_path / "perf" / "results"
    r = _cli("bench", "--device", "cpu", "--tiny", "--suite", "_selftest", "--out", str(out),
             "--case-timeout", "60", env=_env(PAGEDATTN_BENCH_SELFTEST="crash"), timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stdout
    files = list(out.glob("*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert schema.validate(data) == []
    assert data["metadata"]["sample"] is True and data["metadata"]["dry_run"] is True
    assert data["ceilings"]["copy"]["value"] > 0 and data["ceilings"]["matmul"]["value"] > 0
    cases = {c["id"]: c for c in data["suites"]["_selftest"]["cases"]}
    assert cases["_selftest/ok"]["status"] == "ok"
    assert cases["_selftest/ok"]["peers"]["broken peer"]["error"].startswith("RuntimeError")
    assert "clone" in cases["_selftest/ok"]["ratios"]
    assert cases["_selftest/raises"]["status"] == "error" and "planned failure" in cases["_selftest/raises"]["error"]
    assert cases["_selftest/crash"]["status"] == "crashed"
    assert cases["_selftest/crash"]["ours"] is not None          # what it measured before dying
    assert cases["_selftest/after"]["status"] == "ok"             # ran in a fresh process
    assert data["suites"]["_selftest"]["status"] == "partial"
    assert "No results yet" in (tmp_path / "perf" / "RESULTS.md").read_text()


def test_runner_drives_the_h200_commands_on_the_cpu(tmp_path):
    """`pagedattn bench --suite decode,write --quick --no-report` and `--suite prefill` (the H200
    stages benchdw / benchp; here in one call) through runner, child and suites on the CPU (the kernels refuse
    CPU tensors there: each case is an error with its torch peer measured; the checks are tested above)."""
    suites = "decode,write,prefill"
    out = tmp_path / "results"
    r = _cli("bench", "--device", "cpu", "--tiny", "--suite", suites, "--quick", "--no-report",
             "--out", str(out), timeout=280)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    (path,) = out.glob("*.json")
    data = json.loads(path.read_text())
    assert schema.validate(data) == [] and not (tmp_path / "RESULTS.md").exists()
    assert sorted(data["suites"]) == sorted(suites.split(","))
    for suite, body in data["suites"].items():
        peer = "torch index_copy_" if suite == "write" else "gather+sdpa"
        with_peer = [c for c in body["cases"] if peer in c["peers"]]
        assert with_peer, suite
        for case in body["cases"]:
            assert case["status"] == "error" and "CUDA" in case["error"], case["id"]
        for case in with_peer:
            assert case["peers"][peer].get("error") is None, (case["id"], case["peers"][peer])


def test_runner_records_overrides_and_applies_them_in_the_child(tmp_path):
    """--overrides: the child runs every case inside attention.forced(...) (the self-test cases do not call
    the op) and gives the write part to the write cases; the file is named after them and records them;
    RESULTS.md leaves such runs out."""
    out = tmp_path / "results"
    overrides = {"attention": {"prefill": "prefill_ws", "tiles": {"prefill_ws": {"kStages": 3}}},
                 "write": {"flat": False}}
    r = _cli("bench", "--device", "cpu", "--tiny", "--suite", "_selftest", "--out", str(out), "--no-report",
             "--overrides", json.dumps(overrides), timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    (path,) = out.glob("*.json")
    assert path.name.endswith("_attention-prefill-prefill-ws-tiles-prefill-ws-kStages-3-write-flat-false.json")
    data = json.loads(path.read_text())
    assert data["metadata"]["overrides"] == overrides and schema.validate(data) == []
    extra = data["suites"]["_selftest"]["cases"][0]["extra"]
    assert "prefill='prefill_ws'" in extra["forced"] and "('kStages', 3)" in extra["forced"]
    assert extra["write_overrides"] == {"flat": False}
    assert report.load_folder(out, include_samples=True) == []   # not the library's defaults
    r = _cli("bench", "--device", "cpu", "--tiny", "--suite", "_selftest", "--overrides", "{not json", timeout=60)
    assert r.returncode == 2 and "pagedattn bench:" in r.stderr


def test_runner_kills_a_hung_case(tmp_path):
    out = tmp_path / "results"
    r = _cli("bench", "--device", "cpu", "--tiny", "--suite", "_selftest", "--out", str(out),
             "--case-timeout", "8", "--no-report", env=_env(PAGEDATTN_BENCH_SELFTEST="hang"), timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(next(out.glob("*.json")).read_text())
    cases = {c["id"]: c for c in data["suites"]["_selftest"]["cases"]}
    assert cases["_selftest/crash"]["status"] == "timeout"
    assert cases["_selftest/after"]["status"] == "ok"
    assert not (tmp_path / "RESULTS.md").exists()


def test_attention_check_uses_pagedattn_reference(monkeypatch):
    """The decode / prefill checks ask pagedattn.reference (the one oracle), and a case passes its check
    against it."""
    from pagedattn import reference

    calls = []
    real = reference.paged_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("causal"))
        return real(*args, **kwargs)
    monkeypatch.setattr(reference, "paged_attention", spy)
    monkeypatch.setattr(pagedattn, "flash_attn_varlen_func", _fake_flash, raising=False)
    ctx = _cpu_ctx()
    for case in (attention.decode_cases(ctx)[0], attention.decode_cases(ctx)[1], attention.prefill_cases(ctx)[0]):
        calls.clear()
        rec = _run_case(case, ctx)
        assert calls and calls[0] is True, case.id
        assert rec["check"]["ok"] is True and rec["check"]["rel_l2"] < 1e-2, (case.id, rec["check"])
    data = attention.build(ctx, attention.decode_cases(ctx)[0].params, sets=1)
    calls.clear()
    attention.reference_out(data, causal=False)
    assert calls == [False]


def test_report_renders_the_stored_h200_results():
    """The results already in perf/results still load and render (the schema reads them unchanged)."""
    files = [(p, report.load(p)) for p in sorted((REPO / "perf" / "results").glob("h200_sm90_*.json"))]
    assert len(files) >= 2
    md = report.render_markdown(files)
    for path, data in files:
        assert path.name in md
        for suite, body in data["suites"].items():
            if body.get("cases") and suite in report.MEASURED_SUITES:
                assert report.SUITE_TITLES[suite] in md, (path.name, suite)


def test_jit_worker_writes_one_line_per_workload(monkeypatch, tmp_path):
    """The jit suite's fresh process (`python -m pagedattn.bench.jit NAMES OUT`, here in this process with
    stand-in workloads): each workload's first call timed, or its error, one JSON line each."""
    from pagedattn.bench import jit, runner

    fake_torch = types.SimpleNamespace(zeros=lambda *a, **k: torch.zeros(1),
                                       cuda=types.SimpleNamespace(synchronize=lambda: None))
    monkeypatch.setattr(jit, "torch", fake_torch)
    monkeypatch.setattr(jit, "WORKLOADS", {"ok": lambda dev: lambda: None, "bad": lambda dev: lambda: 1 / 0})
    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", str(tmp_path / "cache"))
    jit.worker("ok,bad", str(tmp_path / "out.jsonl"))
    ok, bad = runner.read_jsonl(tmp_path / "out.jsonl")
    assert ok["workload"] == "ok" and ok["first_call_s"] >= 0 and ok["compiles"] == 0 and ok["variants"] == {}
    assert bad["workload"] == "bad" and bad["error"].startswith("ZeroDivisionError")


def test_jit_workloads_build_on_the_bench_data():
    """The jit suite's attention workloads set up on the CPU (attention.build)."""
    from pagedattn.bench import jit

    for name, setup in jit.WORKLOADS.items():
        if not name.startswith("write"):
            assert callable(setup("cpu")), name


# -- on the GPU (the lead's H200 run: pytest -m gpu tests/test_bench.py) ---------------------------
def _gpu_decode_data(ctx, B=2, L=1024):
    """The decode suite's heads (Hq=32, Hkv=8, D=128, block 16) at a small batch and context."""
    p = dict(attention.decode_cases(Ctx.make("cpu", quick=True))[0].params, B=B, ctx=L)
    data = attention.build(ctx, p, sets=1)
    return data, attention.reference_out(data)


@pytest.mark.gpu
def test_flush_method_evicts_the_l2_on_gpu():
    dev = torch.device("cuda", torch.cuda.current_device())
    l2 = int(torch.cuda.get_device_properties(dev).L2_cache_size)
    t = timing.Timer(budget_s=0.05, min_reps=30, max_reps=300, l2_bytes=l2, device=dev)
    assert t.flush_nbytes >= max(256 * 2**20, 4 * l2)
    x = torch.ones(max(l2 // 2, 2**20) // 4, dtype=torch.float32, device=dev)  # half the L2
    res = t.measure(lambda k: x.sum(), sets=1)
    assert res["rot"]["reps"] >= 30 and res["flush"]["reps"] >= 30
    assert res["flush"]["us"] > res["rot"]["us"]   # same input back to back sits in L2; flushed, it does not
    assert t.flush_buf.numel() * 4 == t.flush_nbytes


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cudnn", "flash"])
def test_sdpa_peers_pick_a_correct_configuration_on_gpu(backend):

    ctx = Ctx.make("cuda", quick=True)
    data, ref = _gpu_decode_data(ctx)
    k, v = data.contiguous_kv(0)
    info = {}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([{"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]]):
        fn = peers.fastest(ctx, peers.sdpa_candidates(data, data.q, lambda i: (k, v)), ref, info)
        out = fn(0)
    assert info["variant"] in ("enable_gqa", "gqa folded into q_len"), info
    assert common.rel_l2(out, ref) < 2e-2, info


@pytest.mark.gpu
def test_optional_fa4_peer_is_correct_on_gpu():
    ctx = Ctx.make("cuda", quick=True)
    data, ref = _gpu_decode_data(ctx)
    try:
        cands = peers.fa4_candidates(data)
    except Exception as exc:  # noqa: BLE001 - optional package
        pytest.skip(f"fa4 not available: {exc}")
    info = {}
    fn = peers.fastest(ctx, cands, ref, info)
    assert common.rel_l2(fn(0), ref) < 2e-2, info
