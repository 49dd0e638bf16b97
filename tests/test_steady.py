"""flash_attn_varlen_func's steady state (attention/steady.py guards, _Launch) on CPU, with the driver
stubbed as perf/host_profile.py does: a warm call packs exactly the Params of a cold call (empty plan
cache), skips the checks, and a call with new metadata after a warm-up is refused exactly as on a cold
cache (same exception, same message) -- the guards never weaken validation."""
import ctypes

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_fuzz_validators import ATTN_SCALARS, ATTN_TENSORS, FUZZ, mutate_scalar, mutate_tensor  # noqa: E402

import pagedattn  # noqa: E402
from pagedattn import CacheSpec  # noqa: E402
from pagedattn.ops import attention, workspace  # noqa: E402
from pagedattn.ops.params import AttnParams  # noqa: E402

LAUNCHES = []


class _RecordingKernel:
    """get_kernel's stand-in: a real Launcher whose cuLaunchKernel records grid, block and Params."""

    def __init__(self, spec):
        self.spec = spec

    def launcher(self, device):
        from pagedattn.codegen import launch

        size = ctypes.sizeof(self.spec.PARAMS)

        def record(func, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
            LAUNCHES.append(((gx, gy, gz, bx, by, bz), ctypes.string_at(argv[0], size)))
            return 0

        import threading
        lau = launch.Launcher.__new__(launch.Launcher)
        lau._launch, lau._func, lau._device, lau._smem, lau._ctx = record, ctypes.c_void_p(0), device, 0, 0
        lau._params, lau._pack, lau._size = self.spec.PARAMS, launch.packer(self.spec.PARAMS).pack_into, size
        lau._local, lau._raw_stream = threading.local(), (lambda device: 0)
        return lau


@pytest.fixture(autouse=True)
def stub_cuda(monkeypatch):
    monkeypatch.setattr(attention, "get_kernel", _RecordingKernel)
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
    LAUNCHES.clear()
    yield
    attention._PLANS.clear()


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
    if form == "split4":
        kw["num_splits"] = 4
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
    (guard,) = attention._PLANS.steady.forms[form in ("out", "fp8", "fp8_same")]  # the first call's
    # a warm call never reaches the checks
    monkeypatch.setattr(attention, "check_call", lambda *a, **k: pytest.fail("the steady path ran check_call"))
    assert _outcome(kw) == cold


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
    kw = _base(form)
    for _ in range(2):  # warm: a plan, its guard and the launch of this batch shape
        assert _outcome(kw)[2]
    kw.update(changes)
    warm = _outcome(kw)
    attention._PLANS.clear()
    cold = _outcome(kw)
    assert warm == cold
