"""The steady states of flash_attn_varlen_func (ops/steady.py guards, _Launch) and of
reshape_and_cache_flash (the same guards, Prepared launches) on CPU, with the driver stubbed: a warm call packs exactly the Params of a cold call (empty plan cache),
skips the checks, and a call with new metadata after a warm-up is refused exactly as on a cold cache
(same exception, same message) -- the guards never weaken validation."""
import ctypes

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_fuzz_validators import ATTN_SCALARS, ATTN_TENSORS, FUZZ, WRITE_TENSORS, mutate_scalar  # noqa: E402
from test_fuzz_validators import mutate_tensor, mutate_values  # noqa: E402

import pagedattn  # noqa: E402
from pagedattn import CacheSpec  # noqa: E402
from pagedattn.ops import attention, kv_write, workspace  # noqa: E402
from pagedattn.ops.params import AttnParams  # noqa: E402

LAUNCHES = []
STREAM = [0]  # torch's current raw stream as the stand-in launcher sees it (0: the legacy default stream)


class _RecordingKernel:
    """get_kernel's stand-in: a real Launcher whose cuLaunchKernelEx records grid, block and Params."""

    def __init__(self, spec):
        self.spec = spec

    def launcher(self, device):
        from pagedattn.codegen import launch

        size = ctypes.sizeof(self.spec.PARAMS)

        def record(config, func, argv, extra):
            grid, block, _, stream, params = launch.read_launch(config, argv, size)
            assert stream == STREAM[0], "not launched on the current stream"
            LAUNCHES.append(((*grid, *block), params))
            return 0

        lau = launch.Launcher.stand_in(record, self.spec.PARAMS, device, raw_stream=lambda device: STREAM[0])
        lau.max_active_blocks = lambda threads: 4
        return lau


@pytest.fixture(autouse=True)
def stub_cuda(monkeypatch):
    monkeypatch.setattr(attention, "get_kernel", _RecordingKernel)
    monkeypatch.setattr(kv_write, "get_kernel", _RecordingKernel)
    monkeypatch.setattr(kv_write, "_require_cuda", lambda t: None)
    monkeypatch.setattr(kv_write, "sm_count", lambda device: 132)
    monkeypatch.setattr(attention, "_require_cuda", lambda t: None)
    monkeypatch.setattr(attention, "arch_for_device", lambda device: "sm_90a")
    monkeypatch.setattr(attention, "sm_count", lambda device: 132)
    maps = torch.zeros(256, dtype=torch.uint8)
    monkeypatch.setattr(attention, "tma_maps", lambda k, v, call, head_dim: (maps, 2))
    monkeypatch.setattr(attention, "_is_capturing", lambda: False)
    monkeypatch.setattr(workspace, "_raw_stream", lambda device: 0)
    work = {}

    def cpu_get(kind, device, stream, numel, dtype, capturing):
        if kind not in work or work[kind].tensor.numel() < numel:
            work[kind] = workspace._Buffer(torch.zeros(max(numel, 1024), dtype=dtype), False)
        return work[kind]

    monkeypatch.setattr(workspace, "_get", cpu_get)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    attention._PLANS.clear()
    kv_write._PLANS.clear()
    LAUNCHES.clear()
    STREAM[0] = 0
    yield
    attention._PLANS.clear()
    kv_write._PLANS.clear()


def _base(form: str) -> dict:
    gen = torch.Generator().manual_seed(len(form))
    kv = "fp8_e4m3" if form.startswith("fp8") else "auto"
    spec = CacheSpec(16, 16, 2, 64, torch.uint8 if kv != "auto" else torch.bfloat16, kv,
                     "HND" if form == "hnd" else "NHD")
    kc, vc = spec.allocate("cpu", fill=0.0)
    q = torch.randn(3, 4, 64, generator=gen).to(torch.bfloat16)
    kw = dict(q=q, k=kc, v=vc, max_seqlen_q=1, cu_seqlens_q=torch.arange(4, dtype=torch.int32), max_seqlen_k=40,
              seqused_k=torch.tensor([40, 7, 33], dtype=torch.int32),
              block_table=torch.randperm(16, generator=gen)[:12].view(3, 4).int(), num_splits=1)
    if kv != "auto":
        ks = torch.full((2,), 0.5)
        kw.update(kv_cache_dtype=kv, k_descale=ks, v_descale=ks if form == "fp8_same" else torch.full((2,), 0.25))
    if form == "out":
        kw["out"] = torch.empty_like(q)
    if form == "split4":  # keys for four splits of a 64-key stage
        kw["k"], kw["v"] = CacheSpec(64, 16, 2, 64, torch.bfloat16).allocate("cpu", fill=0.0)
        kw.update(block_table=torch.randperm(64, generator=gen)[:48].view(3, 16).int(), max_seqlen_k=256,
                  seqused_k=torch.tensor([256, 100, 7], dtype=torch.int32), num_splits=4)
    if form == "lse":
        kw["return_softmax_lse"] = True
    return kw


FORMS = ("plain", "out", "fp8", "fp8_same", "split4", "lse", "hnd")


def _outcome(kw):
    """What a call did: the exception (type, message), or each launch's grid, block and Params with the
    addresses of what the call allocated (out, lse, split workspace) left out."""
    LAUNCHES.clear()
    try:
        got = pagedattn.flash_attn_varlen_func(**kw)
    except Exception as exc:  # noqa: BLE001 - compared, whatever it is
        return type(exc), str(exc)
    out = got[0] if isinstance(got, tuple) else got
    result = []
    for dims, raw in LAUNCHES:
        p = AttnParams.from_buffer_copy(raw)
        assert p.out == out.data_ptr()
        fields = {name: getattr(p, name) for name, _ in AttnParams._fields_
                  if name not in ("out", "lse", "o_accum", "lse_accum", "split_counters")}
        result.append((dims, fields, bool(p.lse), bool(p.o_accum)))
    return tuple(out.shape), out.stride(), result


@pytest.mark.parametrize("form", FORMS)
def test_a_warm_call_launches_what_a_cold_one_does(form, monkeypatch):
    kw = _base(form)
    cold = _outcome(kw)
    assert len(cold) == 3 and cold[2], cold
    assert cold[2][0][3] == (form == "split4")  # a split-KV launch (o_accum) for split4 only
    (guard,) = attention._PLANS.steady.forms[form in ("out", "fp8", "fp8_same")]  # the first call's
    # a warm call never reaches the checks
    monkeypatch.setattr(attention, "check_call", lambda *a, **k: pytest.fail("the steady path ran check_call"))
    assert _outcome(kw) == cold


@pytest.mark.parametrize("form", ["plain", "split4"])
def test_a_warm_call_launches_on_the_current_stream_and_asks_for_capture_off_the_default_one(form, monkeypatch):
    """The stream of a warm launch is the current one (the stand-in asserts it); the legacy default
    stream (0) cannot capture, so the capture state is asked for on other streams only; a capturing
    stream keeps the tensor maps for the graph (workspace.keep_for_graphs)."""
    kw = _base(form)
    cold = _outcome(kw)
    asked = []

    def capturing():
        asked.append(STREAM[0])
        return STREAM[0] == 9

    monkeypatch.setattr(attention, "_is_capturing", capturing)
    monkeypatch.setattr(workspace, "GRAPH_REFS", {})
    assert _outcome(kw) == cold and asked == []
    for stream in (7, 9):
        STREAM[0] = stream
        assert _outcome(kw) == cold
    assert asked == [7, 9] and len(workspace.GRAPH_REFS) == 1  # the maps, kept by the capturing call


def test_a_warm_split_call_takes_the_scratch_handed_out_now(monkeypatch):
    """A _Launch keeps its split-KV scratch addresses (workspace.GENERATION), so a warm call skips the
    workspace lookup; once another batch shape grows the workspace, the next call of the first shape
    takes the new buffers' addresses; a capturing call never keeps what it was handed."""
    def accum():
        return AttnParams.from_buffer_copy(LAUNCHES[0][1]).o_accum

    small = _base("split4")
    large = dict(small, q=torch.randn(300, 4, 64).to(torch.bfloat16),
                 cu_seqlens_q=torch.tensor([0, 100, 200, 300], dtype=torch.int32))
    _outcome(small)
    first = accum()
    (run,) = [r for plan in attention._PLANS.values() for r in plan.launches.values() if r.total_q == 3]
    assert first and run.scratch[2] == first
    generation = workspace.GENERATION
    _outcome(small)
    assert accum() == first and workspace.GENERATION == generation
    _outcome(large)  # grows the workspace: new buffers, a new generation
    grown = accum()
    assert workspace.GENERATION == generation + 1 and grown != first
    _outcome(small)
    assert accum() == grown and run.scratch[1:3] == (workspace.GENERATION, grown)
    kept = run.scratch
    STREAM[0] = 9
    monkeypatch.setattr(attention, "_is_capturing", lambda: True)
    _outcome(small)
    assert run.scratch == kept


def test_clearing_the_plans_clears_the_guards():
    kw = _base("plain")
    _outcome(kw)
    assert attention._PLANS.steady.forms[0]
    attention._PLANS.clear()
    assert not attention._PLANS.steady.forms[0] and not attention._PLANS.steady.forms[1]


@st.composite
def steady_then_mutated(draw):
    form = draw(st.sampled_from(FORMS))
    names = ATTN_TENSORS + ATTN_SCALARS + ("causal", "return_softmax_lse")
    changes = {}
    for _ in range(draw(st.integers(1, 2))):
        name = draw(st.sampled_from(names))
        base = _base(form)
        if name in ATTN_TENSORS:
            changes[name] = mutate_tensor(draw, base.get(name))
        elif name in ("causal", "return_softmax_lse"):
            changes[name] = draw(st.sampled_from([True, False, 1, 0, None, 2]))
        else:
            changes[name] = mutate_scalar(draw, name)
    return form, changes


@FUZZ
@given(steady_then_mutated())
def test_new_metadata_after_a_warm_up_is_judged_as_on_a_cold_cache(case):
    form, changes = case
    _judged_as_cold(_base(form), changes, _outcome, attention._PLANS, lambda res: res[2])


def _judged_as_cold(kw, changes, outcome, plans, warmed):
    """Two calls of `kw` (warm: a plan, its guard and the launch of this shape; `warmed(result)` holds),
    then `kw` with `changes`: its outcome equals the one on a cleared (cold) plan cache."""
    for _ in range(2):
        assert warmed(outcome(kw))
    kw.update(changes)
    warm = outcome(kw)
    plans.clear()
    assert warm == outcome(kw)


# ---------------------------------------------------------------- reshape_and_cache_flash
def _misaligned(t):
    flat = torch.empty(t.numel() + 1, dtype=t.dtype)[1:]
    return flat.view(t.shape).copy_(t)


def _write_base(form: str) -> dict:
    """A write of 3 tokens (key/value padded to 5) into a 16-block cache: int64 or int32 slots, NHD or
    HND, bf16 or fp8 (uint8 or float8 storage, one scale or one per head, v_scale the same tensor or
    not), value the same tensor as key, key not 16-byte aligned (span/head in place of flat), and a
    many-token write (the streaming flat launch of fp8)."""
    gen = torch.Generator().manual_seed(len(form))
    kv = "fp8_e4m3" if form.startswith("fp8") else "auto"
    storage = torch.bfloat16 if kv == "auto" else torch.float8_e4m3fn if form == "fp8_native" else torch.uint8
    spec = CacheSpec(16, 16, 2, 64, storage, kv, "HND" if form in ("hnd", "fp8_head") else "NHD",
                     "head" if form == "fp8_head" else "tensor")
    kc, vc = spec.allocate("cpu", fill=0.0)
    t = 1500 if form == "fp8_many" else 3
    key = torch.randn(t + 2, 2, 64, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(spec.num_slots, generator=gen)[:t] if t <= spec.num_slots else \
        torch.randint(-1, spec.num_slots, (t,), generator=gen)
    kw = dict(key=key, value=key if form == "same_kv" else torch.randn(t + 2, 2, 64, generator=gen).to(torch.bfloat16),
              key_cache=kc, value_cache=vc, slot_mapping=slots.to(torch.int32 if form == "i32" else torch.int64))
    if form == "misaligned":
        kw["key"] = _misaligned(key)
    if kv != "auto":
        shape = (2,) if form == "fp8_head" else (1,)
        kw.update(kv_cache_dtype=kv, k_scale=torch.full(shape, 0.5))
        kw["v_scale"] = kw["k_scale"] if form == "fp8_same" else torch.full(shape, 0.25)
    return kw


WRITE_FORMS = ("i64", "i32", "hnd", "same_kv", "misaligned", "fp8", "fp8_head", "fp8_same", "fp8_native",
               "fp8_many")


def _write_outcome(kw):
    """What a write did: the exception (type, message), or each launch's grid, block and Params bytes
    (every address is an input's: comparable between calls)."""
    LAUNCHES.clear()
    try:
        pagedattn.reshape_and_cache_flash(**kw)
    except Exception as exc:  # noqa: BLE001 - compared, whatever it is
        return type(exc), str(exc)
    return list(LAUNCHES)


@pytest.mark.parametrize("form", WRITE_FORMS)
def test_a_warm_write_launches_what_a_cold_one_does(form, monkeypatch):
    kw = _write_base(form)
    cold = _write_outcome(kw)
    assert isinstance(cold, list) and len(cold) == 1, cold
    (guard,) = kv_write._PLANS.steady.forms[form.startswith("fp8")]  # the first call's
    strict = []  # while true, the checks and _launch fail the test

    def refuse(real):
        return lambda *a, **k: pytest.fail("the steady path validated") if strict else real(*a, **k)

    monkeypatch.setattr(kv_write, "check_metadata", refuse(kv_write.check_metadata))
    monkeypatch.setattr(kv_write, "_launch", refuse(kv_write._launch))
    strict.append(1)
    for _ in range(2):
        assert _write_outcome(kw) == cold
    # another token count of the same metadata: validated once (its launch shape), then steady
    strict.clear()
    kv_write._PLANS.clear()
    fewer = dict(kw, slot_mapping=kw["slot_mapping"][:2])
    cold2 = _write_outcome(fewer)
    _write_outcome(kw)
    strict.append(1)
    assert cold2 != cold and _write_outcome(fewer) == cold2 and _write_outcome(kw) == cold


def test_a_warm_write_launches_on_the_current_stream():
    kw = _write_base("i64")
    cold = _write_outcome(kw)
    for stream in (0, 0x7F00_0000_1000, 3):
        STREAM[0] = stream
        assert _write_outcome(kw) == cold  # the stand-in asserts the stream


@pytest.mark.parametrize("rows", [("key", 2), ("value", 4), ("value", 6), ("both", 3), ("both", 7)])
def test_a_warm_write_with_other_rows_is_judged_as_cold(rows):
    """The steady path compares numel() for the rows (key / value [T, H, D], H and D fixed by the guard):
    fewer key rows than slots, value rows unlike key's, or both padded otherwise, are judged as cold."""
    which, t = rows
    kw = _write_base("i64")  # 3 slots, key and value of 5 rows
    for _ in range(2):
        assert isinstance(_write_outcome(kw), list)
    changed = dict(kw)
    for name in ("key", "value") if which == "both" else (which,):
        changed[name] = torch.randn(t, 2, 64).to(torch.bfloat16)
    warm = _write_outcome(changed)
    kv_write._PLANS.clear()
    assert warm == _write_outcome(changed)


def test_a_warm_write_packs_the_addresses_of_this_call():
    kw = _write_base("fp8")
    _write_outcome(kw)
    moved = {name: t.clone() for name, t in kw.items() if isinstance(t, torch.Tensor)}
    got = _write_outcome(dict(kw, **moved))
    kv_write._PLANS.clear()
    assert got == _write_outcome(dict(kw, **moved)) != _write_outcome(kw)


@pytest.mark.parametrize("op", ["decode", "decode_split4", "write", "write_fp8"])
def test_bench_captures_a_warm_call_and_replays_its_launches(op, monkeypatch):
    """perf/launch_overhead.py's raw launcher (bench.jit.capture_launches) on a call whose plan an earlier
    call made: every launch is recorded (Prepared ones too), replays with the Params the op packed,
    and later calls are no longer recorded."""
    from pagedattn.bench.jit import capture_launches

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    if op.startswith("decode"):
        kw = _base("split4" if op == "decode_split4" else "plain")
        call = lambda: pagedattn.flash_attn_varlen_func(**kw)  # noqa: E731
    else:
        kw = _write_base("fp8" if op == "write_fp8" else "i64")
        call = lambda: pagedattn.reshape_and_cache_flash(**kw)  # noqa: E731
    call(), call()
    LAUNCHES.clear()
    launches, keep = capture_launches(call)
    made = list(LAUNCHES)
    assert made and len(launches) == len(made)
    for replay in launches:
        replay()
    assert LAUNCHES[len(made):] == made
    call()
    assert len(launches) == len(made)
    del keep


def test_debug_validate_and_overrides_take_the_full_path(monkeypatch):
    kw = _write_base("i64")
    for _ in range(2):
        _write_outcome(kw)
    calls = []
    monkeypatch.setattr(kv_write, "check_slots", lambda *a: calls.append("slots"))
    _write_outcome(dict(kw, validate=True))
    monkeypatch.setenv("PAGEDATTN_DEBUG", "1")
    _write_outcome(kw)
    assert calls == ["slots", "slots"]
    monkeypatch.delenv("PAGEDATTN_DEBUG")
    flat = _write_outcome(kw)
    base = _write_outcome(dict(kw, overrides={"flat": False}))
    assert flat[0][0] != base[0][0]  # another grid: the override was applied
    assert _write_outcome(kw) == flat


@st.composite
def write_then_mutated(draw):
    form = draw(st.sampled_from(WRITE_FORMS[:-1]))
    base = _write_base(form)
    changes = {}
    for _ in range(draw(st.integers(1, 2))):
        name = draw(st.sampled_from(WRITE_TENSORS + ("kv_cache_dtype", "fewer", "values")))
        if name == "kv_cache_dtype":
            changes[name] = mutate_scalar(draw, name)
        elif name == "fewer":  # a token count the plan has not launched yet
            changes["slot_mapping"] = base["slot_mapping"][:draw(st.integers(0, 2))]
        elif name == "values":
            changes["slot_mapping"] = mutate_values(draw, base["slot_mapping"])
        else:
            changes[name] = mutate_tensor(draw, base.get(name))
    return form, changes


@FUZZ
@given(write_then_mutated())
def test_new_write_metadata_after_a_warm_up_is_judged_as_on_a_cold_cache(case):
    form, changes = case
    _judged_as_cold(_write_base(form), changes, _write_outcome, kv_write._PLANS, lambda res: isinstance(res, list))


@pytest.mark.parametrize("form", ["fp8_same", "fp8"])
@pytest.mark.parametrize("scale", ["k_scale", "v_scale"])
def test_a_warm_fp8_write_without_a_scale_is_refused_as_a_cold_one(form, scale):
    """Hypothesis found it: fp8_same warmed (k_scale and v_scale one tensor), then v_scale=None reached
    a scale's data_ptr on the steady path (AttributeError) where a cold call says what is missing."""
    _judged_as_cold(_write_base(form), {scale: None}, _write_outcome, kv_write._PLANS, lambda res: isinstance(res, list))


@pytest.mark.parametrize("scale", ["k_descale", "v_descale"])
def test_a_warm_fp8_call_without_a_descale_is_refused_as_a_cold_one(scale):
    """The attention twin: warmed with v_descale the same tensor as k_descale, then one of them None."""
    _judged_as_cold(_base("fp8_same"), {scale: None}, _outcome, attention._PLANS, lambda res: res[2])


def test_a_one_slot_mapping_with_another_stride_is_known_at_that_size_only():
    """slot_mapping [1] of stride 2 is contiguous, [3] of stride 2 is not: the guard of the first must
    not let the second through."""
    kw = _write_base("i64")
    strided = torch.arange(0, 12, 2)  # slots 0, 2, 4, ... stride 1 as values; the views below stride 2
    one = dict(kw, slot_mapping=strided.view(-1)[::2][:1].clone().as_strided((1,), (2,)))
    for _ in range(2):
        assert isinstance(_write_outcome(one), list)
    three = dict(kw, slot_mapping=strided[::2])
    warm = _write_outcome(three)
    kv_write._PLANS.clear()
    assert warm == _write_outcome(three) and warm[0] is pagedattn.ContractError


# ------------------------------------------------------------------ flash_attn_with_kvcache
def _kvcache_outcome(kw):
    """A with_kvcache call's two launches: the append-mode write's Params (seqused_out left out: the
    call allocates it) and the attention's (out, lse and seqused_k, the write's output, left out), with
    the check that the attention reads the seqused_k the write wrote."""
    from pagedattn.ops.params import KvWriteParams
    LAUNCHES.clear()
    out = pagedattn.flash_attn_with_kvcache(**kw)
    (wdims, wraw), (adims, araw) = LAUNCHES
    w, a = KvWriteParams.from_buffer_copy(wraw), AttnParams.from_buffer_copy(araw)
    assert w.seqused_out and a.seqused_k == w.seqused_out and a.out == out.data_ptr()
    assert not w.slot_mapping and w.cache_seqlens == kw["cache_seqlens"].data_ptr()
    write = {n: getattr(w, n) for n, _ in KvWriteParams._fields_ if n not in ("seqused_out", "cache")}
    write["cache"] = bytes(w.cache)
    attend = {n: getattr(a, n) for n, _ in AttnParams._fields_ if n not in ("out", "lse", "seqused_k")}
    return tuple(out.shape), (wdims, write), (adims, attend)


@pytest.mark.parametrize("snew, kv", [(1, "auto"), (3, "auto"), (1, "fp8_e4m3")])
def test_a_warm_kvcache_call_launches_what_a_cold_one_does(snew, kv, monkeypatch):
    """The steady path of flash_attn_with_kvcache (one guard, then the kept Appender and _Launch)
    packs the Params a validated call packs, reads this call's addresses, and runs no checks; fp8
    caches pass their descales (the write's scales too)."""
    from pagedattn.ops import kvcache
    gen = torch.Generator().manual_seed(snew)
    fp8 = kv != "auto"
    kc, vc = CacheSpec(40, 16, 2, 128, torch.uint8 if fp8 else torch.bfloat16, kv).allocate("cpu", fill=0.0)
    kw = dict(q=torch.randn(3, snew, 8, 128, generator=gen).bfloat16(), k_cache=kc, v_cache=vc,
              k=torch.randn(3, snew, 2, 128, generator=gen).bfloat16(),
              v=torch.randn(3, snew, 2, 128, generator=gen).bfloat16(),
              cache_seqlens=torch.tensor([0, 17, 60], dtype=torch.int32),
              block_table=torch.randperm(40, generator=gen)[:12].view(3, 4).int(), causal=True)
    if fp8:
        kw.update(kv_cache_dtype=kv, k_descale=torch.tensor([0.5]), v_descale=torch.tensor([0.25]))
    kvcache._STEADY.clear()
    kv_write._APPENDERS.clear()
    cold = _kvcache_outcome(kw)
    assert cold[1][1]["append_tokens"] == snew and cold[1][1]["batch"] == 3 and cold[1][1]["table_width"] == 4
    checks = kvcache.run
    monkeypatch.setattr(kvcache, "run", lambda *a, **k: pytest.fail("the steady path ran the checks"))
    assert _kvcache_outcome(kw) == cold
    moved = dict(kw, q=kw["q"].clone(), k=kw["k"].clone(), block_table=kw["block_table"].clone())
    warm = _kvcache_outcome(moved)
    assert warm[1][1]["key"] == moved["k"].data_ptr() and warm[2][1]["q"] == moved["q"].data_ptr()
    assert warm[1][1]["block_table"] == warm[2][1]["block_table"] == moved["block_table"].data_ptr()
    if fp8:
        assert warm[1][1]["k_scale"] == warm[2][1]["k_descale"] == kw["k_descale"].data_ptr()
        assert warm[1][1]["v_scale"] == warm[2][1]["v_descale"] == kw["v_descale"].data_ptr()
        ran = []  # another kv_cache_dtype (uint8 storage holds either format): the checks run again
        monkeypatch.setattr(kvcache, "run", lambda *a, **k: ran.append(1) or checks(*a, **k))
        pagedattn.flash_attn_with_kvcache(**dict(kw, kv_cache_dtype="fp8_e5m2"))
        assert ran == [1]


def test_forced_blocks_closed_out_of_order_leave_nothing_behind():
    """Two fixtures (decode_loader's tma=False, entered inside fp8_ws's prefill block) are torn down in
    their set-up order: closing the outer block first must not bring its prefill back when the inner
    one closes (it once did, and the d512 tests after fp8_ws on the same worker ran prefill_ws)."""
    o = attention.overrides
    stages = (("decode", (("kStages", 3),)),)
    outer = attention.forced(prefill="prefill_ws")
    outer.__enter__()
    inner = attention.forced(tma=False, tiles={"decode": {"kStages": 3}})
    assert inner.__enter__() == o.Forced(prefill="prefill_ws", tma=False, tiles=stages)
    outer.__exit__(None, None, None)
    assert o.current() == o.Forced(tma=False, tiles=stages)
    inner.__exit__(None, None, None)
    assert o.current() == o.Forced()


def test_forced_dispatch_holds_inside_its_block_only():
    """attention.forced (bench sweeps, perf/, tests): each plan made inside the block takes the forced
    prefill, multi-token decode setting and tiles; plans are dropped on entry and on exit."""
    kw = _base("plain")
    kw.update(q=torch.randn(3 * 12, 4, 64).to(torch.bfloat16), max_seqlen_q=12,
              cu_seqlens_q=torch.arange(0, 37, 12, dtype=torch.int32))  # 12 x group 2 = 24 rows per KV head

    def variants():
        return [v.spec for plan in attention._PLANS.values() for v in plan._kernels.values()]

    pagedattn.flash_attn_varlen_func(**kw)
    assert [s.mode for s in variants()] == ["multi_tma"]  # the dispatch: multi-token decode up to WS_ROWS
    with attention.forced(prefill="prefill_ws", multi=False):
        assert variants() == []
        pagedattn.flash_attn_varlen_func(**kw)
        assert [s.mode for s in variants()] == ["prefill_ws"]
        with attention.forced(tiles={"prefill_ws": {"kPingPong": False}}):  # adds to the outer block
            pagedattn.flash_attn_varlen_func(**kw)
            (spec,) = variants()
            assert spec.mode == "prefill_ws" and spec.tiles["kPingPong"] is False
        assert attention.tile_config(64, "prefill_ws")["kPingPong"] is True
    assert variants() == []
    pagedattn.flash_attn_varlen_func(**kw)
    assert [s.mode for s in variants()] == ["multi_tma"]


@pytest.mark.parametrize("clusters", [None, 30])
def test_ws_pair_launch_pairs_row_tiles_and_whole_clusters(clusters, monkeypatch):
    """prefill_ws with kWsPair runs in clusters of two CTAs that take work items 2 P and 2 P + 1
    together (ws_pair_item): the launch makes the row tiles of a column even (an odd count gets an
    empty tile more) and the persistent grid whole clusters, at most as many as fit at once
    (Launcher.max_active_clusters; a stand-in launcher has no driver to ask: SMs / 2)."""
    monkeypatch.setattr(_RecordingKernel, "launcher", _with_clusters(_RecordingKernel.launcher, clusters))
    gen = torch.Generator().manual_seed(7)
    kc, vc = CacheSpec(64, 16, 2, 128, torch.bfloat16).allocate("cpu", fill=0.0)

    def launch(tiles, q_len, batch):
        q = torch.randn(q_len * batch, 4, 128, generator=gen).to(torch.bfloat16)
        k_len = min(q_len, 256)  # the table's capacity
        kw = dict(q=q, k=kc, v=vc, max_seqlen_q=q_len, max_seqlen_k=k_len, causal=True, num_splits=1,
                  cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32) * q_len,
                  seqused_k=torch.full((batch,), k_len, dtype=torch.int32),
                  block_table=torch.randperm(64, generator=gen)[:batch * 16].view(batch, 16).int())
        LAUNCHES.clear()
        with attention.forced(prefill="prefill_ws", multi=False, tiles={"prefill_ws": tiles}):
            pagedattn.flash_attn_varlen_func(**kw)
        (dims, raw), = LAUNCHES
        return dims[0], AttnParams.from_buffer_copy(raw).grid_tiles

    # 96 queries x group 2 = 192 rows: two 128-row tiles; 160 queries: three, padded to four
    assert launch({}, 160, 1) == (2 * 3, 3)
    assert launch({"kWsPair": True}, 96, 1) == (2 * 2, 2)
    assert launch({"kWsPair": True}, 160, 1) == (2 * 4, 4)
    # 3 requests x 2 KV heads x 4 row tiles = 24 items
    assert launch({"kWsPair": True}, 160, 3) == (24, 4)
    # 4 requests x 2 KV heads x 16 row tiles = 128 items: as many CTAs as fit in whole clusters
    assert launch({"kWsPair": True}, 1024, 4) == (2 * clusters if clusters else 128, 16)
    assert launch({"kWsPair": True, "kWsQFeed": 2}, 160, 1) == (2 * 4, 4)  # with chained items too


def _with_clusters(launcher_fn, clusters):
    def launcher(self, device):
        lau = launcher_fn(self, device)
        lau.max_active_clusters = lambda threads, cluster: clusters
        return lau
    return launcher


@pytest.mark.parametrize("D,kv,bs,forced,want", [
    (96, "auto", 16, {}, [("prefill_ws", 128), ("decode", 96)]),    # the 128 tile, its columns past 96 zero
    (80, "auto", 16, {}, [("prefill_ws", 128), ("decode", 80)]),
    (72, "auto", 16, {}, [("prefill_ws", 128), ("decode", 80)]),    # compiled 80, so the 128 tile too
    (96, "auto", 8, {}, [("prefill_wgmma", 128), ("decode", 96)]),  # pages TMA cannot box: cp.async + wgmma
    (96, "fp8_e4m3", 16, {}, [("prefill_ws", 128), ("decode_tma", 96)]),  # fp8: maps for each head dim
    (128, "auto", 16, {}, [("prefill_ws", 128), ("decode_tma", 128)]),
    (96, "auto", 16, {"narrow": True}, [("prefill_ws", 96), ("decode_tma", 96)]),  # one set of maps, at 96
    (80, "auto", 16, {"narrow": True}, [("prefill_ws", 80), ("decode_tma", 80)]),
    (72, "auto", 16, {"narrow": True}, [("prefill_ws", 80), ("decode_tma", 80)]),
    (96, "auto", 8, {"narrow": True}, [("prefill_wgmma", 128), ("decode", 96)]),  # no TMA: as without narrow
    (96, "fp8_e4m3", 16, {"narrow": True}, [("prefill_ws", 128), ("decode_tma", 96)]),  # 16-bit only
])
def test_prefill_head_dim_of_a_plan(D, kv, bs, forced, want, monkeypatch):
    """heuristics.wgmma_head_dim on the plan: head dims 80 and 96 take the warpgroup-MMA prefills compiled
    at 128 (TMA maps encoded for 128), their decode its own head dim (an fp8 cache's decode_tma with maps
    of its own); forced narrow keeps 80 and 96 (NARROW_HEAD_DIMS) for prefill_ws and decode_tma, 16-bit
    caches of 16-key pages only."""
    specs, maps_dims = [], []
    monkeypatch.setattr(attention, "get_kernel", lambda spec: specs.append(spec) or _RecordingKernel(spec))
    maps = torch.zeros(256, dtype=torch.uint8)
    monkeypatch.setattr(attention, "tma_maps", lambda k, v, call, head_dim: maps_dims.append(head_dim) or (maps, 2))
    gen = torch.Generator().manual_seed(D)
    spec = CacheSpec(32, bs, 2, D, torch.uint8 if kv != "auto" else torch.bfloat16, kv)
    kc, vc = spec.allocate("cpu", fill=0.0)
    extra = dict(kv_cache_dtype=kv, k_descale=torch.full((2,), 0.5), v_descale=torch.full((2,), 0.5)) \
        if kv != "auto" else {}
    table = torch.randperm(32, generator=gen)[: 512 // bs].view(1, -1).int()
    with attention.forced(**forced):
        for q_len in (200, 1):  # 400 packed rows (group 2), then one
            q = torch.randn(q_len, 4, D, generator=gen).to(torch.bfloat16)
            pagedattn.flash_attn_varlen_func(q, kc, vc, q_len, torch.tensor([0, q_len], dtype=torch.int32), 300,
                                             seqused_k=torch.tensor([300], dtype=torch.int32), block_table=table,
                                             causal=True, **extra)
    assert [(s.mode, s.head_dim) for s in specs] == want
    tma = {m: d for m, d in want if m in ("prefill_ws", "decode_tma")}
    assert sorted(maps_dims) == sorted(set(tma.values()))  # encoded once per kernel head dim
