"""flash_attn_varlen_func's steady state on the GPU: warm calls (a guard and the batch shape's launch
known) give bit-identical results to cold calls (empty plan cache) and match the reference; new bad
metadata after a warm-up is refused with the cold message; layers (caches) and batch shapes that
alternate stay right. tests/test_steady.py covers the same on CPU with the driver stubbed."""
import pytest
import torch
from test_attention import build_case, rel_l2

import pagedattn
from pagedattn import ContractError, reference
from pagedattn.ops import attention

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

    def run(**changes):
        args = dict(q=case["q"], k=case["kc"], v=case["vc"], **kw)
        args.update(changes)
        try:
            pagedattn.flash_attn_varlen_func(**args)
        except ContractError as exc:
            return str(exc)
        return None

    changes = BAD[bad](kw, case)
    attention._PLANS.clear()
    cold = run(**changes)
    assert cold is not None, f"{bad} was accepted"
    attention._PLANS.clear()
    for _ in range(3):
        assert run() is None
    assert run(**changes) == cold


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
