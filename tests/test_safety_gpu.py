"""Issue #18 on the GPU: bad metadata never corrupts memory or returns silent garbage.

Regression tests for the two defects (cu_seqlens_q[-1] past q.shape[0] wrote past `out`;
max_seqlen_q below the longest query left rows unwritten: now every row is computed), the hints at their extremes, contiguous
K/V with cu_seqlens_k past k.shape[0], and a small fixed-seed run of tests/fuzz/fuzz_metadata.py. Every
tensor is a view inside a guard buffer whose margins hold a NaN payload (fuzz_metadata.Guarded):
a write past a tensor changes a margin, a read past it pulls NaN into the result. Expected results
come from fuzz_metadata.expected_attention (the clamping contract over pagedattn.reference).
bf16, head dims 128 and 64 only (few kernels to compile)."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

FUZZ = Path(__file__).resolve().parent / "fuzz"


def _load_fuzzer():
    spec = importlib.util.spec_from_file_location("fuzz_metadata", FUZZ / "fuzz_metadata.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_metadata"] = mod
    spec.loader.exec_module(mod)
    return mod


fuzz = _load_fuzzer()
DEV = "cuda"
NARROW = fuzz.Space(dtypes=("bf16",), head_dims=(64, 128), kv_cache_dtypes=("auto",))


@pytest.fixture(autouse=True)
def _no_debug_checks(monkeypatch):
    """PAGEDATTN_DEBUG's host checks would refuse the corrupt metadata before any kernel runs."""
    monkeypatch.delenv("PAGEDATTN_DEBUG", raising=False)


def attn_desc(lens_q, lens_k, *, cu_q=None, D=128, heads=(8, 2), bs=16, causal=True, num_splits=1,
              max_q=None, max_k=None, cu_k=None, out_given=True, seed=0):
    """A fuzz_metadata case description (paged unless cu_k is given) with explicit metadata."""
    cu_q = cu_q if cu_q is not None else fuzz.prefix_sums(lens_q)
    d = dict(op="attn", index=0, fuzz_seed=0, kinds=["regression"], cls="meta", dtype="bf16", head_dim=D,
             heads=list(heads), block_size=bs, layout="NHD", kv="auto", causal=causal, out_given=out_given,
             num_splits=num_splits, seed=seed, malformed=None, table_edits=[], lens_q=list(lens_q),
             lens_k=list(lens_k), cu_q=list(cu_q))
    d["class"] = "meta"
    if cu_k is None:
        need = [-(-n // bs) for n in lens_k]
        d.update(mode="paged", num_blocks=sum(need) + 2, width=max(need) + 1, seqused=list(lens_k))
    else:
        d.update(mode="contiguous", cu_k=list(cu_k), seqused=None)
    spans = fuzz.clamp_spans(cu_q, sum(lens_q))
    d["max_seqlen_q"] = max(e - s for s, e in spans) if max_q is None else max_q
    d["max_seqlen_k"] = max(lens_k) if max_k is None else max_k
    return d


def checked_call(desc, **override):
    """Build the case, call flash_attn_varlen_func (args overridden by `override`), wait, and assert
    that no input changed and no guard of `out` was written. Returns (case, out, lse)."""
    case = fuzz.build_attn(desc, DEV, fuzz.kernel_ops())
    for g in case.guards.values():
        g.snapshot()
    fuzz.sync(DEV)
    out, lse = fuzz.pagedattn.flash_attn_varlen_func(**{**case.expected["args"], **override})
    fuzz.sync(DEV)
    problems = fuzz.untouched(case, skip=("out",))
    if "out" in case.guards:
        problems += [p for p in [case.guards["out"].damage()] if p]
    assert not problems, problems
    assert fuzz.split_counters_problem() is None
    return case, out, lse


def assert_matches_contract(case, out, lse):
    problems = fuzz.compare_attention(out, lse, case.expected["requests"])
    assert not problems, problems


# ---------------------------------------------------------------- (a) cu_seqlens_q[-1] > total_q
@pytest.mark.parametrize("hint", ["true", "from_cu"])
@pytest.mark.parametrize("extra", [1, 37, 300])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("q_len", [1, 100])
def test_cu_seqlens_q_past_total_q_writes_nothing_past_out(q_len, splits, extra, hint):
    lens_q = [q_len] * (4 if q_len == 1 else 2)
    lens_k = [300, 17, 1000, 64] if q_len == 1 else [100, 400]
    cu_q = fuzz.prefix_sums(lens_q)
    cu_q[-1] += extra                       # the last request claims rows q does not have
    max_q = q_len if hint == "true" else q_len + extra
    desc = attn_desc(lens_q, lens_k, cu_q=cu_q, num_splits=splits, max_q=max_q)
    case, out, lse = checked_call(desc)
    assert out is case.expected["args"]["out"]
    assert not out.isnan().any(), "a row of q was left unwritten"   # every row belongs to a request here
    assert_matches_contract(case, out, lse)


# ---------------------------------------------------------------- (b) max_seqlen_q below the longest query
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("hint", [33, 17, 1, 0])
def test_max_seqlen_q_too_small_is_still_right(hint, splits, D):
    """Rows past the grid's row tiles (attn_fwd.cuh: attn_rows_past_grid) are computed like the rest,
    whatever the hint; validate=True still names the understatement."""
    lens_q, lens_k = [40, 90], [200, 333]
    desc = attn_desc(lens_q, lens_k, D=D, num_splits=splits, max_q=hint)
    case, out, lse = checked_call(desc)
    assert not out.isnan().any(), "a row was left unwritten"
    assert_matches_contract(case, out, lse)
    again, _ = fuzz.pagedattn.flash_attn_varlen_func(**{**case.expected["args"], "out": None})
    assert torch.equal(again.view(torch.int16), out.view(torch.int16)), "rerun is not bit-identical"
    with pytest.raises(fuzz.pagedattn.ContractError, match="max_seqlen_q"):
        fuzz.pagedattn.flash_attn_varlen_func(**{**case.expected["args"], "validate": True})


# ---------------------------------------------------------------- (c) hints far too large
@pytest.mark.parametrize("which", ["q", "k", "both"])
@pytest.mark.parametrize("q_len", [1, 100])
@pytest.mark.parametrize("splits", [0, 1, 3])
def test_huge_hints_work(which, q_len, splits):
    lens_q = [q_len] * (3 if q_len == 1 else 2)
    lens_k = [500, 1, 64][:len(lens_q)] if q_len == 1 else [100, 257]
    desc = attn_desc(lens_q, lens_k, num_splits=splits, max_q=10**7 if which in ("q", "both") else None,
                     max_k=10**7 if which in ("k", "both") else None)
    case, out, lse = checked_call(desc)
    assert not out.isnan().any()
    assert_matches_contract(case, out, lse)


# ---------------------------------------------------------------- (d) contiguous K/V, cu_seqlens_k past total_k
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("corrupt", ["last", "interior", "huge"])
def test_cu_seqlens_k_past_total_k_reads_nothing_past_k(corrupt, splits, D):
    lens_q, lens_k = [5, 130, 1], [70, 130, 333]
    total_k = sum(lens_k)
    cu_k = {"last": [0, 70, 200, total_k + 50],
            "interior": [0, 70, total_k + 10, total_k + 60],
            "huge": [0, 70, 200, 2**31 - 1]}[corrupt]
    desc = attn_desc(lens_q, lens_k, D=D, cu_k=cu_k, num_splits=splits, max_k=max(lens_k) + 60)
    case, out, lse = checked_call(desc)
    # k and v sit between NaN margins: a read past total_k would show as NaN here
    assert not out.isnan().any()   # ("interior" leaves request 2 no keys: zeros, LSE -inf)
    assert_matches_contract(case, out, lse)
    # the clamped reference is the plain varlen reference on clamped cu_seqlens_k
    a = case.expected["args"]
    clamped = torch.tensor([min(x, total_k) for x in cu_k], dtype=torch.int32, device=DEV)
    want = fuzz.reference.varlen_attention(a["q"], a["k"], a["v"], a["cu_seqlens_q"], clamped, causal=True,
                                           compute_dtype=torch.float64)
    assert fuzz.rel_l2(out, want) < fuzz.ATTN_TOL


# ---------------------------------------------------------------- (e) a small fixed-seed fuzz run
@pytest.mark.parametrize("op,n", [("attn", 120), ("write", 40), ("legacy", 40)])
def test_fuzz_run(op, n):
    results = fuzz.run_in_process(op, 2024, range(n), NARROW, DEV, fuzz.kernel_ops())
    failures = [f"{fuzz.describe(r['desc']) if r.get('desc') else r['index']}: {r['message'][:500]}"
                for r in results if r["status"] == "failed"]
    assert not failures, "\n".join(failures)
    assert len(results) == n
    covered = {k for r in results for k in r["kinds"]}
    assert covered == set(fuzz.KINDS[op])
    malformed = [r for r in results if r["cls"] == "malformed"]
    assert malformed and all(r["status"] == "refused" for r in malformed)
