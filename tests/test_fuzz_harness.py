"""tests/fuzz/fuzz_metadata.py's harness on CPU: guard buffers see writes into their margins, cases are
deterministic and cover every corruption kind, the clamping reference agrees with pagedattn.reference
(and with hand-made clamped metadata), the whole check passes with the torch references in place of
the kernels and fails on each kind of sabotage, and the child-process runner survives dying and
hanging workers. (The kernels themselves: tests/test_safety_gpu.py.)"""
import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pagedattn import reference

FUZZ = Path(__file__).resolve().parent / "fuzz"


def _load():
    spec = importlib.util.spec_from_file_location("fuzz_metadata", FUZZ / "fuzz_metadata.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_metadata"] = mod   # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


fuzz = _load()
SMALL = fuzz.Space(small=True)


def cases(op, n, seed=0, space=SMALL, where=lambda d: True, start=0):
    return [d for d in (fuzz.generate_case(op, seed, i, space) for i in range(start, start + n)) if where(d)]


# ---------------------------------------------------------------- guard buffers
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.int32,
                                   torch.int64])
def test_guard_detects_writes_past_either_end(dtype):
    g = fuzz.Guarded("t", 100, dtype, "cpu", pad=10)
    t = g.view((10, 10))
    assert t.data_ptr() % 16 == 0 and g.pad % 64 == 0
    assert g.damage() is None
    t.fill_(1)                                    # inside: not damage
    assert g.damage() is None
    g.snapshot()
    assert g.changed() is None
    g.buf[g.pad + 100] = 0                        # one element after the end
    assert "after" in g.damage() and "element 100 of 100" in g.damage()
    assert "guard after" in g.changed()
    g2 = fuzz.Guarded("t", 100, dtype, "cpu")
    g2.buf[g2.pad - 3] = 0                        # before the start
    assert "before" in g2.damage() and "element -3" in g2.damage()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sentinel_is_a_nan_arithmetic_does_not_make(dtype):
    g = fuzz.Guarded("t", 8, dtype, "cpu")
    assert g.buf.isnan().all()                      # a read past the tensor shows as NaN
    g.buf[0] = float("nan")                         # a computed (canonical) NaN stored into the margin
    assert g.damage() is not None


def test_guard_interior_change_and_diff():
    g = fuzz.Guarded("cache", 64, torch.uint8, "cpu")
    g.flat().fill_(3)
    g.snapshot()
    want = g.buf.clone()
    g.flat()[5] = 4
    assert "element 5" in g.changed() and "element 5" in g.diff(want)
    want.copy_(g.buf)
    assert g.diff(want) is None


def test_guarded_tensor_copies_values():
    g, t = fuzz.guarded_tensor("table", [[1, 2], [3, fuzz.INT32_MAX]], torch.int32, "cpu")
    assert t.tolist() == [[1, 2], [3, 2**31 - 1]] and g.damage() is None


# ---------------------------------------------------------------- case generation
@pytest.mark.parametrize("op", fuzz.OPS)
def test_cases_are_deterministic_and_serialisable(op):
    for i in (0, 5, 77, 1234):
        a, b = fuzz.generate_case(op, 42, i), fuzz.generate_case(op, 42, i)
        assert a == b and json.loads(json.dumps(a)) == a
    assert [fuzz.generate_case(op, 1, i) for i in range(30, 40)] != [fuzz.generate_case(op, 2, i)
                                                                      for i in range(30, 40)]


@pytest.mark.parametrize("op", fuzz.OPS)
def test_every_kind_is_produced(op):
    first = [fuzz.generate_case(op, 0, i)["kinds"] for i in range(len(fuzz.KINDS[op]))]
    assert [k for ks in first for k in ks] == list(fuzz.KINDS[op])   # one each, in order
    drawn = {k for i in range(100, 700) for k in fuzz.generate_case(op, 0, i)["kinds"]}
    assert drawn == set(fuzz.KINDS[op])                              # and the random draws reach them all


def test_malformed_sub_kinds_are_all_drawn():
    subs = {d["malformed"] for d in cases("attn", 3000, where=lambda d: d["malformed"], start=30)}
    assert subs == set(fuzz.ATTN_MALFORMED)
    subs = {d["malformed"] for d in cases("legacy", 3000, where=lambda d: d["malformed"], start=30)}
    assert subs == set(fuzz.LEGACY_MALFORMED) | set(fuzz.LEGACY_WRITE_MALFORMED)


def test_cases_stay_small():
    for d in cases("attn", 400, space=fuzz.Space()):
        assert sum(d["lens_q"]) <= 300 and max(d["lens_k"]) <= 2048 and sum(d["lens_k"]) <= 4096
        assert d["head_dim"] in fuzz.HEAD_DIMS and d["block_size"] in fuzz.BLOCK_SIZES
        assert 0 <= d["num_splits"] <= 300
    narrow = fuzz.Space(dtypes=("bf16",), head_dims=(64, 128), kv_cache_dtypes=("auto",))
    for op in fuzz.OPS:
        for d in cases(op, 100, space=narrow):
            assert d["dtype"] == "bf16" and d["head_dim"] in (64, 128) and d["kv"] == "auto"


def test_corruptions_do_what_they_say():
    by_kind = {}
    for d in cases("attn", 600, space=fuzz.Space(), start=30):
        if len(d["kinds"]) == 1:
            by_kind.setdefault(d["kinds"][0], []).append(d)
    for d in by_kind["cu_q_last_big"]:
        assert d["cu_q"][-1] > sum(d["lens_q"])
    for d in by_kind["cu_q_last_small"]:
        assert d["cu_q"][-1] < sum(d["lens_q"])
    for d in by_kind["cu_q_first_nonzero"]:
        assert d["cu_q"][0] != 0
    for d in by_kind["cu_q_nonmonotone"]:
        assert any(a > b for a, b in zip(d["cu_q"], d["cu_q"][1:]))
    for d in by_kind["block_id_int_max"]:
        assert any(v == 2**31 - 1 for _, _, v in d["table_edits"])
    for d in by_kind["block_id_past_end"]:
        assert all(v >= d["num_blocks"] for _, _, v in d["table_edits"])
    for d in by_kind["seqused_past_table"]:
        assert max(d["seqused"]) > d["width"] * d["block_size"]
    for d in by_kind["max_q_huge"]:
        assert d["max_seqlen_q"] >= 10**6
    for d in by_kind["cu_k_past_total"]:
        assert max(d["cu_k"]) > sum(d["lens_k"])
    for d in cases("write", 300, space=fuzz.Space(), start=10):
        n = d["num_blocks"] * d["block_size"]
        if d["kinds"] == ["slot_past_end"]:
            assert all(v >= n for _, v in d["slot_edits"])
        if d["kinds"] == ["slot_negative"]:
            assert all(v < 0 for _, v in d["slot_edits"])


def test_clamp_spans():
    assert fuzz.clamp_spans([0, 3, 10], 8) == [(0, 3), (3, 8)]            # last past total_q
    assert fuzz.clamp_spans([0, 5, 2, 8], 8) == [(0, 5), (5, 5), (2, 8)]  # non-monotone: empty, overlap
    assert fuzz.clamp_spans([-4, 2, 2], 8) == [(0, 2), (2, 2)]
    assert fuzz.clamp_spans([9, 12], 8) == [(8, 8)]


# ---------------------------------------------------------------- building is deterministic
def test_build_is_deterministic():
    ops = fuzz.reference_ops()
    for d in cases("attn", 8) + cases("write", 5) + cases("legacy", 13):
        a = fuzz.BUILDERS[d["op"], d.get("kind") == "write"](d, "cpu", ops)
        b = fuzz.BUILDERS[d["op"], d.get("kind") == "write"](d, "cpu", ops)
        assert a.guards.keys() == b.guards.keys()
        for name in a.guards:
            assert torch.equal(fuzz.as_ints(a.guards[name].buf), fuzz.as_ints(b.guards[name].buf)), name


# ---------------------------------------------------------------- the clamping reference
def _valid(d):
    return d["class"] in ("clean", "hint") and not (d["mode"] == "contiguous" and d["kv"] != "auto")


def test_clamping_reference_matches_pagedattn_reference_on_valid_metadata():
    ops = fuzz.reference_ops()
    checked = set()
    for d in cases("attn", 300, where=_valid):
        c = fuzz.build_attn(d, "cpu", ops)
        a = c.expected["args"]
        if d["mode"] == "paged":
            want, want_lse = reference.paged_attention(
                a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["seqused_k"], a["block_table"], causal=d["causal"],
                kv_cache_dtype=d["kv"], k_descale=a.get("k_descale"), v_descale=a.get("v_descale"),
                return_lse=True, compute_dtype=torch.float64)
        else:
            want, want_lse = reference.varlen_attention(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"],
                                                        causal=d["causal"], return_lse=True,
                                                        compute_dtype=torch.float64)
        for r in c.expected["requests"]:
            assert torch.allclose(r.out, want[r.start:r.stop], atol=1e-5), fuzz.describe(d)
            assert torch.equal(torch.isinf(r.lse), torch.isinf(want_lse[:, r.start:r.stop]))
            fin = torch.isfinite(r.lse)
            assert torch.allclose(r.lse[fin], want_lse[:, r.start:r.stop][fin], atol=1e-5)
        checked.add((d["mode"], d["kv"], d["causal"]))
    assert {("paged", "auto", True), ("paged", "fp8_e4m3", False), ("contiguous", "auto", True)} <= checked


def _paged(B=3, Hq=4, Hkv=2, D=16, bs=4, N=12, W=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(N, bs, Hkv, D, generator=gen)
    v = torch.randn(N, bs, Hkv, D, generator=gen)
    table = torch.randperm(N, generator=gen)[:B * W].view(B, W).int()
    return k, v, table


def _close(requests, want, want_lse=None):
    for r in requests:
        assert torch.allclose(r.out, want[r.start:r.stop].float(), atol=1e-5)
        if want_lse is not None:
            assert torch.allclose(r.lse, want_lse[:, r.start:r.stop].float(), atol=1e-5)


def test_corrupt_block_ids_read_as_a_zero_page():
    k, v, table = _paged()
    q = torch.randn(6, 4, 16)
    cu = torch.tensor([0, 1, 3, 6], dtype=torch.int32)
    seq = torch.tensor([13, 16, 5], dtype=torch.int32)
    bad = table.clone()
    bad[0, 1], bad[1, 3], bad[2, 0] = -1, 12, 2**31 - 1
    got = fuzz.expected_attention(q, k, v, cu, causal=True, block_table=bad, seqused_k=seq)
    # by hand: a 13th block of zeros, the corrupt ids pointing at it
    kz, vz = torch.cat([k, torch.zeros(1, *k.shape[1:])]), torch.cat([v, torch.zeros(1, *v.shape[1:])])
    fixed = bad.clone()
    fixed[0, 1] = fixed[1, 3] = fixed[2, 0] = 12
    want, want_lse = reference.paged_attention(q, kz, vz, cu, seq, fixed, causal=True, return_lse=True,
                                               compute_dtype=torch.float64)
    assert len(got) == 3
    _close(got, want, want_lse)


def test_seqused_is_clamped_to_the_table_and_to_zero():
    k, v, table = _paged()
    q = torch.randn(3, 4, 16)
    cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    seq = torch.tensor([10**6, -5, 7], dtype=torch.int32)
    got = fuzz.expected_attention(q, k, v, cu, causal=False, block_table=table, seqused_k=seq)
    want, want_lse = reference.paged_attention(q, k, v, cu, torch.tensor([16, 0, 7]), table, return_lse=True,
                                               compute_dtype=torch.float64)
    _close(got, want, want_lse)
    assert (got[1].out == 0).all() and torch.isneginf(got[1].lse).all()


def test_cu_seqlens_q_past_total_q_and_non_monotone():
    k, v, table = _paged()
    q = torch.randn(6, 4, 16)
    seq = torch.tensor([9, 9, 9], dtype=torch.int32)
    got = fuzz.expected_attention(q, k, v, torch.tensor([0, 2, 40, 50], dtype=torch.int32), causal=True,
                                  block_table=table, seqused_k=seq)
    assert [(r.b, r.start, r.stop) for r in got] == [(0, 0, 2), (1, 2, 6)]   # request 2: no rows left
    want = reference.paged_attention(q, k, v, torch.tensor([0, 2, 6, 6], dtype=torch.int32), seq, table,
                                     causal=True, compute_dtype=torch.float64)
    _close(got, want)
    got = fuzz.expected_attention(q, k, v, torch.tensor([0, 4, 1, 6], dtype=torch.int32), causal=False,
                                  block_table=table, seqused_k=seq)
    assert [(r.b, r.start, r.stop) for r in got] == [(0, 0, 4), (2, 1, 6)]   # request 1 empty, rows 1-3 shared


def test_contiguous_keys_are_clamped_to_total_k_and_capped_by_seqused():
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(5, 4, 16, generator=gen), torch.randn(30, 2, 16, generator=gen), torch.randn(30, 2, 16)
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
    got = fuzz.expected_attention(q, k, v, cu_q, causal=True, cu_seqlens_k=torch.tensor([0, 12, 99], dtype=torch.int32))
    want = reference.varlen_attention(q, k, v, cu_q, torch.tensor([0, 12, 30], dtype=torch.int32), causal=True,
                                      compute_dtype=torch.float64)
    _close(got, want)
    got = fuzz.expected_attention(q, k, v, cu_q, causal=False,
                                  cu_seqlens_k=torch.tensor([0, 12, 30], dtype=torch.int32),
                                  seqused_k=torch.tensor([5, 2**31 - 1], dtype=torch.int32))
    want = reference.varlen_attention(q, torch.cat([k[:5], k[12:30]]), torch.cat([v[:5], v[12:30]]), cu_q,
                                      torch.tensor([0, 5, 23], dtype=torch.int32), compute_dtype=torch.float64)
    _close(got, want)


# ---------------------------------------------------------------- the whole check, with references as the ops
@pytest.mark.parametrize("op", fuzz.OPS)
def test_references_pass_and_malformed_input_is_refused(op):
    ops = fuzz.reference_ops()
    for i in range(len(fuzz.KINDS[op]) + 12):
        d = fuzz.generate_case(op, 5, i, SMALL)
        r = fuzz.run_case(d, "cpu", ops)
        want = "refused" if d["class"] == "malformed" else "passed"
        assert r["status"] == want, (fuzz.describe(d), r["message"])


def _sabotaged(**over):
    ops = fuzz.reference_ops()
    for name, wrap in over.items():
        setattr(ops, name, wrap(getattr(ops, name)))
    return ops


def _first(op, pred, start=0, seed=0, space=SMALL):
    for i in range(start, start + 3000):
        d = fuzz.generate_case(op, seed, i, space)
        if pred(d):
            return d
    raise AssertionError("no such case")


def _status(d, ops):
    r = fuzz.run_case(d, "cpu", ops)
    return r["status"], r["message"]


def test_write_past_out_is_caught():
    def past_end(attn):
        def f(*a, **kw):
            res = attn(*a, **kw)
            o = kw["out"]
            torch.as_strided(o, (1,), (1,), o.storage_offset() + o.numel()).fill_(1.0)
            return res
        return f
    d = _first("attn", lambda d: d["class"] == "clean" and d["out_given"] and sum(d["lens_q"]))
    status, msg = _status(d, _sabotaged(attn=past_end))
    assert status == "failed" and msg.startswith("out: 1 guard element(s) after the tensor")


def test_attention_writing_its_inputs_is_caught():
    def scribble(attn):
        def f(*a, **kw):
            kw["k"].view(torch.uint8).flatten()[0] ^= 1
            return attn(*a, **kw)
        return f
    d = _first("attn", lambda d: d["class"] == "meta" and d["mode"] == "paged")
    status, msg = _status(d, _sabotaged(attn=scribble))
    assert status == "failed" and msg.startswith("k:")


def test_wrong_rows_unwritten_rows_and_wrong_lse_are_caught():
    def wrong_row(attn):
        def f(*a, **kw):
            o, lse = attn(*a, **kw)
            o[-1] += 1.0
            return o, lse
        return f

    def unwritten(attn):
        def f(*a, **kw):
            o, lse = attn(*a, **kw)
            o[0] = float("nan")
            return o, lse
        return f

    def bad_lse(attn):
        def f(*a, **kw):
            o, lse = attn(*a, **kw)
            return o, lse + 0.5
        return f
    d = _first("attn", lambda d: d["class"] == "clean" and d["lens_q"][0] and min(d["lens_k"]) > 0
               and len(d["lens_q"]) > 1)
    assert _status(d, fuzz.reference_ops())[0] == "passed"
    assert "relative error" in _status(d, _sabotaged(attn=wrong_row))[1]
    assert "non-finite" in _status(d, _sabotaged(attn=unwritten))[1]
    assert "LSE" in _status(d, _sabotaged(attn=bad_lse))[1]


def test_ignoring_the_clamping_contract_is_caught():
    """An op that reads corrupt block ids as block 0 (instead of a zero page) returns garbage."""
    def block_zero(attn):
        def f(*a, **kw):
            t = kw["block_table"]
            kw["block_table"] = torch.where((t >= 0) & (t < kw["k"].shape[0]), t, torch.zeros_like(t))
            return attn(*a, **kw)
        return f
    d = _first("attn", lambda d: d["kinds"] == ["block_id_past_end"] and d["heads"][1] > 1)
    assert _status(d, fuzz.reference_ops())[0] == "passed"
    assert _status(d, _sabotaged(attn=block_zero))[0] == "failed"


def test_exceptions_refusals_and_accepted_malformed_input():
    def type_error(attn):
        def f(*a, **kw):
            raise TypeError("boom")
        return f

    def refuse_after_writing(attn):
        def f(*a, **kw):
            kw["out"].zero_()
            raise fuzz.ContractError("too late")
        return f

    def no_validation(attn):
        return lambda *a, **kw: (torch.zeros_like(kw["q"]), None)
    clean = _first("attn", lambda d: d["class"] == "clean" and d["out_given"])
    status, msg = _status(clean, _sabotaged(attn=type_error))
    assert status == "failed" and msg.startswith("TypeError: boom")
    status, msg = _status(clean, _sabotaged(attn=refuse_after_writing))
    assert status == "failed" and "after writing" in msg
    bad = _first("attn", lambda d: d["malformed"] == "q_fp32")
    status, msg = _status(bad, _sabotaged(attn=no_validation))
    assert status == "failed" and "was accepted" in msg


def test_writer_defects_are_caught():
    def wraps_slots(write):   # slots past the cache written modulo its size
        def f(key, value, kc, vc, slots, *rest):
            n = kc.shape[0] * kc.shape[1]
            return write(key, value, kc, vc, torch.where(slots >= n, slots % n, slots), *rest)
        return f

    def past_cache(write):
        def f(key, value, kc, vc, slots, *rest):
            write(key, value, kc, vc, slots, *rest)
            torch.as_strided(vc, (1,), (1,), vc.storage_offset() + vc.numel() + 3).fill_(0)
        return f
    d = _first("write", lambda d: d["kinds"] == ["slot_past_end"] and d["layout"] == "NHD")
    assert _status(d, fuzz.reference_ops())[0] == "passed"
    status, msg = _status(d, _sabotaged(write=wraps_slots))
    assert status == "failed" and "differ" in msg
    status, msg = _status(d, _sabotaged(write=past_cache))
    assert status == "failed" and "value_cache" in msg and "guard" in msg


def test_legacy_defects_are_caught():
    def no_clamp(v1):   # reads seq_lens past the table as if it held them (here: table wraps)
        def f(out, query, kc, vc, hkv, scale, table, seq_lens, *rest):
            cap = table.shape[1] * kc.shape[3]
            v1(out, query, kc, vc, hkv, scale, table, seq_lens, *rest)
            if bool((seq_lens > cap).any()):
                out.mul_(0.5)
        return f

    def tmp_overrun(v2):
        def f(out, es, ml, tmp, *rest):
            v2(out, es, ml, tmp, *rest)
            torch.as_strided(tmp, (1,), (1,), tmp.storage_offset() + tmp.numel()).fill_(0)
        return f
    d = _first("legacy", lambda d: d.get("kinds") == ["seq_len_past_table"] and d["kind"] == "v1")
    assert _status(d, fuzz.reference_ops())[0] == "passed"
    assert _status(d, _sabotaged(legacy_v1=no_clamp))[0] == "failed"
    d = _first("legacy", lambda d: d.get("kind") == "v2" and d["class"] == "clean")
    status, msg = _status(d, _sabotaged(legacy_v2=tmp_overrun))
    assert status == "failed" and "tmp_out" in msg


# ---------------------------------------------------------------- running many cases
STAND_IN = textwrap.dedent("""
    import json, os, sys, time
    start, stop = int(sys.argv[1]), int(sys.argv[2])
    for i in range(start, stop):
        print(f"BEGIN {i}", flush=True)
        if i == 2:
            os._exit(7)                      # dies mid-case (a sticky CUDA error, a segfault)
        if i == 4:
            time.sleep(60)                   # hangs
        status = "failed" if i == 5 else "passed"
        print("RESULT " + json.dumps(dict(op="attn", index=i, status=status, message="", kinds=["clean"])),
              flush=True)
        if i == 5:
            sys.exit(3)                      # a fatal result: the worker stops itself
""")


def test_children_survive_dying_and_hanging_workers(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(STAND_IN)
    logs = []
    results = fuzz.run_children("attn", 8, lambda a, b: [sys.executable, str(script), str(a), str(b)],
                                case_timeout=5, log=logs.append)
    by_index = {r["index"]: r for r in results}
    assert sorted(by_index) == list(range(8))
    assert [by_index[i]["status"] for i in range(8)] == ["passed", "passed", "failed", "passed", "failed", "failed",
                                                         "passed", "passed"]
    assert "worker died (exit status 7)" in by_index[2]["message"]
    assert "no progress" in by_index[4]["message"]


def test_children_give_up_on_a_worker_that_cannot_start(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("raise SystemExit('cannot import')\n")
    results = fuzz.run_children("write", 5, lambda a, b: [sys.executable, str(script)], case_timeout=5,
                                log=lambda *_: None)
    assert len(results) == 1 and "failed to start" in results[0]["message"] and "cannot import" in results[0]["message"]


def test_summary_counts_and_histogram():
    results = [dict(op="attn", index=0, status="passed", kinds=["clean"], cls="clean", message="", seconds=0.1),
               dict(op="attn", index=1, status="refused", kinds=["malformed"], cls="malformed",
                    message="ContractError: block_table must be an int32 tensor", seconds=0.1),
               dict(op="attn", index=2, status="failed", kinds=["cu_q_last_big"], cls="meta", message="guard",
                    desc=fuzz.generate_case("attn", 0, 2), seconds=0.1)]
    s = fuzz.summarize(results, {"attn": 4})["attn"]
    assert (s["cases"], s["passed"], s["refused"], s["failed"], s["not_run"]) == (3, 1, 1, 1, 1)
    assert s["refused_by"] == {"ContractError: block_table must be": 1}
    assert s["kinds"]["cu_q_last_big"] == {"cases": 1, "failed": 1}
    assert s["failures"][0]["case"].startswith("attn#2")


def test_cli_writes_results_through_child_workers(tmp_path, capsys):
    rc = fuzz.main(["--device", "cpu", "--cases", "12", "--small", "--ops", "write,legacy", "--seed", "3",
                    "--out", str(tmp_path)])
    assert rc == 0, capsys.readouterr().out
    (path,) = tmp_path.glob("fuzz_metadata_cpu_*.json")
    data = json.loads(path.read_text())
    assert data["metadata"]["seed"] == 3 and data["metadata"]["gpu"] == "cpu"
    assert {op: s["cases"] for op, s in data["ops"].items()} == {"write": 6, "legacy": 6}
    assert all(s["failed"] == 0 for s in data["ops"].values())
    assert "op" in capsys.readouterr().out


def test_cli_sanitize_subset_runs_every_kind_in_process(tmp_path):
    assert fuzz.main(["--device", "cpu", "--sanitize", "--ops", "write", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("fuzz_metadata_sanitize_cpu_*.json")
    ops = json.loads(path.read_text())["ops"]
    assert set(ops["write"]["kinds"]) == set(fuzz.KINDS["write"])


def test_replay_reruns_a_description(capsys):
    d = fuzz.generate_case("write", 0, 1, SMALL)
    assert fuzz.replay(json.dumps(d), "cpu", fuzz.reference_ops()) == 0
    assert capsys.readouterr().out.startswith("passed")


def test_sanitize_subset_size():
    assert 35 <= sum(len(k) for k in fuzz.KINDS.values()) <= 50


# ---------------------------------------------------------------- kernel variants
def test_kernel_variants_and_the_precompile_command_agree():
    from pagedattn import aot, variant_name

    specs = fuzz.kernel_specs()
    names = {variant_name(s) for s in specs}
    assert {"attn_fwd_bf16_kvauto_d128_decodetma", "attn_fwd_fp16_kvfp8e4m3_d80_prefill",
            "attn_fwd_bf16_kvauto_d64_prefillwgmma", "kv_write_fp16_fp8e4m3_flat",
            "legacy_attn_bf16_fp8e4m3_d128_bs32", "legacy_reduce_fp16_d64",
            "legacy_cache_write_bf16_auto"} <= names
    assert not any("fp8e5m2" in n or "d256" in n or "fp32" in n for n in names)
    words = fuzz.precompile_command().split()
    flag = lambda name: words[words.index(name) + 1].split(",")  # noqa: E731
    sel = aot.select(ops=flag("--ops"), filters={"dtypes": flag("--dtypes"),
                                                 "kv_cache_dtypes": flag("--kv-cache-dtypes"),
                                                 "head_sizes": flag("--head-sizes")})
    assert set(specs) <= set(sel.specs)
    narrow = fuzz.kernel_specs(fuzz.Space(dtypes=("bf16",), head_dims=(64, 128), kv_cache_dtypes=("auto",)))
    assert narrow and all(getattr(s, "dtype") == "bf16" for s in narrow)
    # 72 alone: the d80 kernels, and the warpgroup-MMA prefills at 128 its sm_90a plans run
    d72 = {(s.mode, s.head_dim) for s in fuzz.kernel_specs(fuzz.Space(head_dims=(72,))) if s.FAMILY == "attn_fwd"}
    assert ("decode", 80) in d72 and ("prefill_ws", 128) in d72 and ("decode", 128) not in d72
    sel72 = aot.select(ops=["attn_fwd"], filters={"head_sizes": ["72"]})
    assert {s for s in fuzz.kernel_specs(fuzz.Space(head_dims=(72,))) if s.FAMILY == "attn_fwd"} <= set(sel72.specs)
    assert all(str(fuzz.KERNEL_HEAD_DIM[d]) in fuzz.__doc__ for d in fuzz.HEAD_DIMS)
