"""The steady states of flash_attn_varlen_func and reshape_and_cache_flash on the GPU: warm calls (a
guard and the launch of the batch shape / token count known) give bit-identical results to cold calls
(empty plan cache) and match the reference (the write: bit for bit, on NaN-poisoned caches); new bad
metadata after a warm-up is refused with the cold message; layers (caches), batch shapes and token
counts that alternate stay right. tests/test_steady.py covers the same on CPU with the driver stubbed."""
import pytest
import torch
from test_attention import build_case, rel_l2

import pagedattn
from pagedattn import ContractError, reference
from pagedattn.ops import attention, kv_write

pytestmark = pytest.mark.gpu

FORMS = ["plain", "out", "lse", "split4", "heuristic", "hnd", "fp8_same", "fp8_head"]


def _case(form, seed, lens_k=(300, 17, 1000, 64)):
    gen = torch.Generator().manual_seed(seed)
    kv = "fp8_e4m3" if form.startswith("fp8") else "auto"
    case = build_case([1] * len(lens_k), list(lens_k), 8, 2, 128, 16, "HND" if form == "hnd" else "NHD",
                      torch.bfloat16, kv, "head" if form == "fp8_head" else "tensor", gen)
    kw = dict(max_seqlen_q=1, cu_seqlens_q=case["cu_q"], max_seqlen_k=max(lens_k), seqused_k=case["seqused"],
              block_table=case["table"], num_splits={"split4": 4, "heuristic": 0}.get(form, 1))
    if kv != "auto":
        kw.update(kv_cache_dtype=kv, k_descale=case["ks"], v_descale=case["ks"] if form == "fp8_same" else case["vs"])
    if form == "lse":
        kw["return_softmax_lse"] = True
    return case, kw


def _call(case, kw, form):
    out = torch.empty_like(case["q"]) if form == "out" else None
    got = pagedattn.flash_attn_varlen_func(case["q"], case["kc"], case["vc"], out=out, **kw)
    return tuple(t.clone() for t in (got if isinstance(got, tuple) else (got,)))


@pytest.mark.parametrize("form", FORMS)
def test_warm_calls_equal_cold_ones_and_the_reference(form):
    case, kw = _case(form, 7 + FORMS.index(form))
    attention._PLANS.clear()
    cold = _call(case, kw, form)
    warm = [_call(case, kw, form) for _ in range(3)]
    assert any(attention._PLANS.steady.forms), "no guard was kept"
    for got in warm:
        assert all(torch.equal(a, b) for a, b in zip(cold, got))
    args = (case["q"], case["kc"], case["vc"], case["cu_q"], case["seqused"], case["table"])
    ref = reference.paged_attention(*args, kv_cache_dtype=kw.get("kv_cache_dtype", "auto"),
                                    k_descale=kw.get("k_descale"), v_descale=kw.get("v_descale"),
                                    compute_dtype=torch.float64)
    assert not cold[0].isnan().any() and rel_l2(cold[0], ref) < 2e-2


def _misaligned(t):
    flat = torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)[1:1 + t.numel()]
    return flat.view(t.shape).copy_(t)


BAD = {
    "block_table column-major": lambda kw, case: {"block_table": kw["block_table"].t().contiguous().t()},
    "seqused_k int64": lambda kw, case: {"seqused_k": kw["seqused_k"].long()},
    "cu_seqlens_q on cpu": lambda kw, case: {"cu_seqlens_q": kw["cu_seqlens_q"].cpu()},
    "q misaligned": lambda kw, case: {"q": _misaligned(case["q"])},
    "q fp16": lambda kw, case: {"q": case["q"].half()},
    "out rows": lambda kw, case: {"out": torch.empty(case["q"].shape[0] + 1, *case["q"].shape[1:],
                                                     dtype=case["q"].dtype, device="cuda")},
    "out misaligned": lambda kw, case: {"out": _misaligned(torch.empty_like(case["q"]))},
    "v transposed": lambda kw, case: {"v": case["vc"].transpose(1, 2)},
    "max_seqlen_k negative": lambda kw, case: {"max_seqlen_k": -1},
    "num_splits bool": lambda kw, case: {"num_splits": True},
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_new_bad_metadata_after_a_warm_up_is_refused_as_cold(bad):
    case, kw = _case("plain", 3, lens_k=(40, 7, 33))
    kw["out"] = torch.empty_like(case["q"])  # the warm form with out=, so that "out ..." meets a guard
    args = dict(q=case["q"], k=case["kc"], v=case["vc"], **kw)
    _assert_refused_warm_as_cold(bad, pagedattn.flash_attn_varlen_func, attention._PLANS, args, BAD[bad](kw, case))


def _refusal(op, args):
    """The ContractError message of op(**args), or None when it runs."""
    try:
        op(**args)
    except ContractError as exc:
        return str(exc)
    return None


def _assert_refused_warm_as_cold(bad, op, plans, args, changes):
    """`changes` to a call is refused on a cold cache, and again, with the same message, after three
    warm calls of the unchanged one."""
    plans.clear()
    cold = _refusal(op, {**args, **changes})
    assert cold is not None, f"{bad} was accepted"
    plans.clear()
    for _ in range(3):
        assert _refusal(op, args) is None
    assert _refusal(op, {**args, **changes}) == cold


def test_alternating_layers_and_batch_shapes():
    """Two caches of one geometry (two layers), and a second batch size: every call equals its cold
    result, whichever guard and launch it meets."""
    cases = [_case("plain", 11 + i, lens_k=lens) for i, lens in enumerate([(300, 17, 1000, 64), (300, 17, 1000, 64),
                                                                           (5, 900, 33)])]
    attention._PLANS.clear()
    want = []
    for case, kw in cases:
        attention._PLANS.clear()
        want.append(_call(case, kw, "plain"))
    attention._PLANS.clear()
    for step in range(4):
        for i in (0, 1, 2, 1, 0):
            got = _call(*cases[i], "plain")
            assert torch.equal(got[0], want[i][0]), (step, i)


# ---------------------------------------------------------------- reshape_and_cache_flash
WRITE_FORMS = ["i64", "i32", "hnd", "same_kv", "misaligned", "padded", "fp8", "fp8_head", "fp8_same",
               "e5m2_many"]


def _write_case(form, seed, tokens=None):
    """A write into a 128-block cache (4 heads, D 128): int64 or int32 slots (one -1), NHD or HND, bf16 or
    fp8 (one scale or one per head), value the same tensor as key, key not 16-byte aligned (span/head
    in place of flat), key/value padded past the slots, or 1200 tokens (the streaming flat launch)."""
    gen = torch.Generator().manual_seed(seed)
    kv = "fp8_e4m3" if form.startswith("fp8") else "fp8_e5m2" if form.startswith("e5m2") else "auto"
    spec = pagedattn.CacheSpec(128, 16, 4, 128, torch.bfloat16 if kv == "auto" else torch.uint8, kv,
                               "HND" if form in ("hnd", "fp8_head") else "NHD", "head" if form == "fp8_head" else "tensor")
    t = tokens or (1200 if form.endswith("many") else 5)
    slots = torch.randperm(spec.num_slots, generator=gen)[:t]
    slots[t // 2] = -1
    rows = t + (3 if form == "padded" else 0)
    key = torch.randn(rows, 4, 128, generator=gen).to(torch.bfloat16).cuda()
    kw = dict(key=key, value=key if form == "same_kv" else torch.randn(rows, 4, 128, generator=gen).to(torch.bfloat16).cuda(),
              slot_mapping=slots.to(torch.int32 if form == "i32" else torch.int64).cuda())
    if form == "misaligned":
        kw["key"] = _misaligned(key)
    if kv != "auto":
        shape = (4,) if form == "fp8_head" else (1,)
        kw.update(kv_cache_dtype=kv, k_scale=(torch.rand(shape, generator=gen) + 0.25).cuda())
        kw["v_scale"] = kw["k_scale"] if form == "fp8_same" else (torch.rand(shape, generator=gen) + 0.25).cuda()
    return spec, kw


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _write(spec, kw, fn=None):
    """Write into fresh NaN-poisoned caches of `spec` (new addresses, the same metadata): the caches."""
    kc, vc = spec.allocate("cuda", fill=float("nan"))
    (fn or pagedattn.reshape_and_cache_flash)(key_cache=kc, value_cache=vc, **kw)
    return _bits(kc), _bits(vc)


def _same(got, want):
    return all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("form", WRITE_FORMS)
def test_warm_writes_equal_cold_ones_and_the_reference(form):
    spec, kw = _write_case(form, 21 + WRITE_FORMS.index(form))
    kv_write._PLANS.clear()
    cold = _write(spec, kw)
    warm = [_write(spec, kw) for _ in range(3)]
    assert any(kv_write._PLANS.steady.forms), "no guard was kept"
    assert all(_same(got, cold) for got in warm)
    assert _same(cold, _write(spec, kw, reference.reshape_and_cache_flash))


def test_writes_after_a_metadata_change_equal_the_reference():
    """Warm, then another token count, slot dtype, padding, alignment and cache layout, alternating:
    every write equals the reference bit for bit, whichever guard and launch it meets."""
    cases = [_write_case("i64", 31), _write_case("i64", 32, tokens=3), _write_case("i32", 33),
             _write_case("padded", 34), _write_case("misaligned", 35), _write_case("hnd", 36),
             _write_case("fp8", 37), _write_case("fp8", 38, tokens=7)]
    want = [_write(spec, kw, reference.reshape_and_cache_flash) for spec, kw in cases]
    kv_write._PLANS.clear()
    for _ in range(3):
        _write(*cases[0])
    for step in range(3):
        for i in (1, 0, 2, 3, 0, 4, 5, 6, 7, 6, 0):
            assert _same(_write(*cases[i]), want[i]), (step, i)


def _offset_cache(t):
    """t's metadata at an address 2 bytes past 16-byte alignment."""
    flat = torch.empty(t.untyped_storage().nbytes() // t.element_size() + 8, dtype=t.dtype, device=t.device)
    return flat[1:].as_strided(t.shape, t.stride())


WRITE_BAD = {
    "slot_mapping int16": lambda kw, kc: {"slot_mapping": kw["slot_mapping"].to(torch.int16)},
    "slot_mapping 2-D": lambda kw, kc: {"slot_mapping": kw["slot_mapping"][None]},
    "slot_mapping strided": lambda kw, kc: {"slot_mapping": kw["slot_mapping"].repeat(2)[::2]},
    "slot_mapping on cpu": lambda kw, kc: {"slot_mapping": kw["slot_mapping"].cpu()},
    "slot_mapping too long": lambda kw, kc: {"slot_mapping": torch.cat([kw["slot_mapping"]] * 2)},
    "slot past the cache (validate)": lambda kw, kc: {"slot_mapping": kw["slot_mapping"] + 10**6, "validate": True},
    "key fp16": lambda kw, kc: {"key": kw["key"].half(), "value": kw["value"].half()},
    "value fewer tokens": lambda kw, kc: {"value": kw["value"][:-1]},
    "key heads": lambda kw, kc: {"key": kw["key"][:, :2]},
    "key_cache misaligned": lambda kw, kc: {"key_cache": _offset_cache(kc)},
    "key_cache transposed": lambda kw, kc: {"key_cache": kc.transpose(1, 2)},
    "kv_cache_dtype fp8 on bf16": lambda kw, kc: {"kv_cache_dtype": "fp8_e4m3"},
}


@pytest.mark.parametrize("bad", sorted(WRITE_BAD))
def test_new_bad_write_metadata_after_a_warm_up_is_refused_as_cold(bad):
    spec, kw = _write_case("i64", 41)
    kc, vc = spec.allocate("cuda", fill=0.0)
    _assert_refused_warm_as_cold(bad, pagedattn.reshape_and_cache_flash, kv_write._PLANS,
                                 dict(kw, key_cache=kc, value_cache=vc), WRITE_BAD[bad](kw, kc))


# ---------------------------------------------------------------- the stream and the threads of a warm launch
SLEEP_CYCLES = 50_000_000  # ~25 ms at 2 GHz: far longer than the calls queued behind it take to issue


def _refuse_checks(monkeypatch):
    """From here on a call that leaves the steady path fails the test."""
    monkeypatch.setattr(attention, "check_call", lambda *a, **k: pytest.fail("the steady path ran check_call"))
    monkeypatch.setattr(kv_write, "check_metadata", lambda *a, **k: pytest.fail("the steady path validated"))


def test_warm_decode_runs_on_the_callers_stream(monkeypatch):
    """A warm decode (TMA and split-KV forms) issued on a side stream behind a long sleep, after that
    stream rewrote q: it reads the rewritten q, so it ran on the side stream (on any other stream it
    would have run during the sleep, on the old q)."""
    for form in ("plain", "split4"):
        case, kw = _case(form, 61)
        attention._PLANS.clear()
        q = case["q"]
        q_new = torch.randn(q.shape, generator=torch.Generator().manual_seed(62)).to(q.dtype).cuda()
        args = (case["kc"], case["vc"])
        for _ in range(2):  # warm: the guard and the launch of this batch shape
            pagedattn.flash_attn_varlen_func(q, *args, **kw)
        want = pagedattn.flash_attn_varlen_func(q_new, *args, **kw).clone()
        with monkeypatch.context() as m:
            _refuse_checks(m)
            buf = q.clone()
            side = torch.cuda.Stream()
            torch.cuda.synchronize()
            with torch.cuda.stream(side):
                torch.cuda._sleep(SLEEP_CYCLES)
                buf.copy_(q_new)
                got = pagedattn.flash_attn_varlen_func(buf, *args, **kw)
            side.synchronize()
        assert torch.equal(got, want), form
        assert not torch.equal(want, pagedattn.flash_attn_varlen_func(q, *args, **kw))


def test_warm_write_runs_on_the_callers_stream(monkeypatch):
    spec, kw = _write_case("i64", 63)
    kv_write._PLANS.clear()
    key_new = torch.randn(kw["key"].shape, generator=torch.Generator().manual_seed(64)).to(torch.bfloat16).cuda()
    for _ in range(2):
        _write(spec, kw)
    want = _write(spec, dict(kw, key=key_new), reference.reshape_and_cache_flash)
    kc, vc = spec.allocate("cuda", fill=float("nan"))
    with monkeypatch.context() as m:
        _refuse_checks(m)
        buf = kw["key"].clone()
        side = torch.cuda.Stream()
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            buf.copy_(key_new)
            pagedattn.reshape_and_cache_flash(buf, kw["value"], kc, vc, kw["slot_mapping"])
        side.synchronize()
    assert _same((_bits(kc), _bits(vc)), want)


def test_warm_decodes_from_threads_equal_one_thread(monkeypatch):
    """Two threads issuing warm decodes (each its own q) through the same launches: per-thread launch
    buffers, so each gets its own q's result, equal to the single-thread one."""
    import threading

    case, kw = _case("plain", 65)
    attention._PLANS.clear()
    gen = torch.Generator().manual_seed(66)
    qs = [torch.randn(case["q"].shape, generator=gen).to(case["q"].dtype).cuda() for _ in range(2)]
    want = [pagedattn.flash_attn_varlen_func(q, case["kc"], case["vc"], **kw).clone() for q in qs]
    results = [None, None]

    def worker(i):
        outs = [pagedattn.flash_attn_varlen_func(qs[i], case["kc"], case["vc"], **kw) for _ in range(50)]
        torch.cuda.synchronize()
        results[i] = all(torch.equal(o, want[i]) for o in outs)

    with monkeypatch.context() as m:
        _refuse_checks(m)
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results == [True, True]
