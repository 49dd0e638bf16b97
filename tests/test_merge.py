"""merge_attn_states (context-parallel decode, issue 21): the merge of attention over disjoint key sets
equals attention over their union (CPU, float64 definition); on one GPU, the kernel over a request's
keys split by tokens into "ranks", merged, equals one call over all keys; tensor-parallel heads, one
call per rank's heads, equal the whole call bit for bit."""
import random

import pytest
import torch

import pagedattn
from pagedattn import ContractError, merge_attn_states

from test_attention import build_case, rel_l2


def _attn(q, k, v, scale):
    """q [T, H, D], k/v [K, H, D] -> out [T, H, D], lse [H, T] (natural log); no keys: 0 and -inf."""
    s = torch.einsum("thd,khd->htk", q, k) * scale
    lse = torch.logsumexp(s, dim=-1) if k.shape[0] else torch.full(s.shape[:2], float("-inf"), dtype=q.dtype)
    p = torch.exp(s - lse.unsqueeze(-1)) if k.shape[0] else s
    out = torch.einsum("htk,khd->thd", p, v) if k.shape[0] else torch.zeros_like(q)
    return out, lse


@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_merge_equals_attention_over_the_union(parts):
    gen = torch.Generator().manual_seed(parts)
    T, H, D, K = 3, 4, 16, 37
    q, k, v = (torch.randn(n, H, D, generator=gen, dtype=torch.float64) for n in (T, K, K))
    full, full_lse = _attn(q, k, v, 0.25)
    perm = torch.randperm(K, generator=gen)
    cuts = sorted(random.Random(parts).sample(range(K + 1), parts - 1)) if parts > 1 else []
    bounds = [0, *cuts, K]
    outs, lses = [], []
    for a, b in zip(bounds, bounds[1:]):
        o, lse = _attn(q, k[perm[a:b]], v[perm[a:b]], 0.25)
        outs.append(o.float())
        lses.append(lse.float())
    merged, lse = merge_attn_states(outs, lses, return_lse=True)
    assert merged.dtype == torch.float32
    torch.testing.assert_close(merged.double(), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), full_lse, rtol=1e-5, atol=1e-5)


def test_empty_parts_add_nothing_even_with_nan_rows():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 2, 8, generator=gen) for n in (2, 5, 5))
    o, lse = _attn(q, k, v, 0.3)
    empty_o = torch.full_like(o, float("nan"))
    empty_lse = torch.full_like(lse, float("-inf"))
    merged, mlse = merge_attn_states([empty_o.bfloat16(), o.bfloat16()], [empty_lse, lse], return_lse=True)
    assert not merged.isnan().any()
    torch.testing.assert_close(merged.float(), o.bfloat16().float())
    torch.testing.assert_close(mlse, lse)
    # a row no part saw: zeros and -inf, as the kernel gives
    none, none_lse = merge_attn_states([empty_o, empty_o], [empty_lse, empty_lse], return_lse=True)
    assert torch.equal(none, torch.zeros_like(o)) and torch.isneginf(none_lse).all()
    out = torch.empty_like(o)
    assert merge_attn_states([o], [lse], out=out) is out and torch.equal(out, o)


@pytest.mark.parametrize("case", ["no parts", "count", "dtype", "shape", "lse shape", "lse dtype", "out"])
def test_bad_input_is_a_clear_error(case):
    o, lse = torch.zeros(3, 4, 8, dtype=torch.bfloat16), torch.zeros(4, 3)
    args = {"no parts": ([], []), "count": ([o, o], [lse]), "dtype": ([o, o.half()], [lse, lse]),
            "shape": ([o, o[:2]], [lse, lse]), "lse shape": ([o], [lse.t()]),
            "lse dtype": ([o], [lse.double()]), "out": ([o], [lse])}[case]
    kw = {"out": torch.zeros(3, 4, 8)} if case == "out" else {}
    with pytest.raises(ContractError):
        merge_attn_states(*args, **kw)


# ---------------------------------------------------------------- one GPU standing in for several
def _decode_case(seed, bs=16, D=128, Hq=32, Hkv=8, kv="auto"):
    gen = torch.Generator().manual_seed(seed)
    lens_k = [5 * bs + 3, 12 * bs, 1]
    return build_case([1] * len(lens_k), lens_k, Hq, Hkv, D, bs, "NHD", torch.bfloat16, kv, "tensor", gen), lens_k


def _call(case, table, seqused, max_k, q=None, kc=None, vc=None, **kw):
    return pagedattn.flash_attn_varlen_func(q if q is not None else case["q"], kc if kc is not None else case["kc"],
                                            vc if vc is not None else case["vc"], 1, case["cu_q"], max_k,
                                            seqused_k=seqused, block_table=table, causal=True,
                                            k_descale=case["ks"], v_descale=case["vs"],
                                            kv_cache_dtype=case["spec"].kv_cache_dtype, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_context_parallel_decode_merge(ranks, kv):
    """Each request's pages split by tokens across `ranks` (each rank its own block table and
    seqused_k, whole pages); (out, LSE) of each merged equals one call over all keys."""
    bs = 16
    case, lens_k = _decode_case(ranks, bs=bs, kv=kv)
    table, seq = case["table"], case["seqused"]
    full = _call(case, table, seq, max(lens_k))
    outs, lses = [], []
    for r in range(ranks):
        pages = [-(-n // bs) for n in lens_k]
        lo = [p * r // ranks for p in pages]
        hi = [p * (r + 1) // ranks for p in pages]
        width = max(h - l for l, h in zip(lo, hi)) or 1
        t = torch.zeros(len(lens_k), width, dtype=torch.int32, device="cuda")
        used = []
        for b, (l, h) in enumerate(zip(lo, hi)):
            t[b, :h - l] = table[b, l:h]
            used.append(max(0, min(lens_k[b], h * bs) - l * bs))
        used_t = torch.tensor(used, dtype=torch.int32, device="cuda")
        o, lse = _call(case, t, used_t, max(max(used), 1), return_softmax_lse=True)
        outs.append(o)
        lses.append(lse)
    merged = merge_attn_states(outs, lses)
    assert rel_l2(merged, full) <= 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_heads_are_bit_identical(world, splits):
    """Rank r owns KV heads [r Hkv/world, ...) of the cache (its own cache, as a TP engine allocates
    it) and their query heads; its call equals that slice of the whole call bit for bit (same num_splits)."""
    case, lens_k = _decode_case(10 + world)
    Hq, Hkv = case["q"].shape[1], case["kc"].shape[2]
    full = _call(case, case["table"], case["seqused"], max(lens_k), num_splits=splits)
    parts = []
    for r in range(world):
        kh = slice(r * Hkv // world, (r + 1) * Hkv // world)
        qh = slice(r * Hq // world, (r + 1) * Hq // world)
        parts.append(_call(case, case["table"], case["seqused"], max(lens_k), q=case["q"][:, qh].contiguous(),
                           kc=case["kc"][:, :, kh].contiguous(), vc=case["vc"][:, :, kh].contiguous(),
                           num_splits=splits))
    assert torch.equal(torch.cat(parts, dim=1).view(torch.int16), full.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp_and_cp_over_nccl(tmp_path):
    """perf/multigpu.py under torchrun on two GPUs: TP bit-identical, CP merge within 4e-3 (bf16 parts)."""
    import pathlib
    import subprocess
    import sys
    script = pathlib.Path(__file__).resolve().parents[1] / "perf" / "multigpu.py"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(script),
                        "--out", str(tmp_path), "--ctx", "16384"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_two_devices_in_one_process(kv):
    """One process, the same write and decode on cuda:0 and cuda:1 while cuda:0 stays the current device:
    each device's module is loaded in its own primary context, and a launch on cuda:1 from a thread whose
    current context is cuda:0's takes the wrong-context path (codegen/launch.py). Both devices' outputs
    are bit-identical and match the reference; the current device is left as it was."""
    from pagedattn import reference

    case, lens_k = _decode_case(7, kv=kv)
    torch.cuda.set_device(0)
    outs, caches = [], []
    for dev in ("cuda:0", "cuda:1", "cuda:0", "cuda:1"):  # twice each: the steady path on each device too
        moved = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
        k_new = torch.randn(4, 8, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(dev)
        slots = torch.tensor([0, 1, 17, 40], dtype=torch.int64, device=dev)
        kc, vc = moved["kc"].clone(), moved["vc"].clone()
        pagedattn.reshape_and_cache_flash(k_new, k_new, kc, vc, slots, case["spec"].kv_cache_dtype,
                                          moved["ks"], moved["vs"])
        caches.append(kc.cpu())
        outs.append(_call(moved, moved["table"], moved["seqused"], max(lens_k), kc=kc, vc=vc).cpu())
        assert torch.cuda.current_device() == 0
    for o, kc in zip(outs[1:], caches[1:]):
        assert torch.equal(o.view(torch.int16), outs[0].view(torch.int16))
        assert torch.equal(kc.view(torch.uint8), caches[0].view(torch.uint8))
    kc_ref, vc_ref = case["kc"].clone(), case["vc"].clone()  # the same write by the reference, then its attention
    reference.reshape_and_cache_flash(k_new.to(kc_ref.device), k_new.to(kc_ref.device), kc_ref, vc_ref,
                                      slots.to(kc_ref.device), case["spec"].kv_cache_dtype, case["ks"], case["vs"])
    assert torch.equal(kc_ref.cpu().view(torch.uint8), caches[0].view(torch.uint8))
    want = reference.paged_attention(case["q"], kc_ref, vc_ref, case["cu_q"], case["seqused"], case["table"],
                                     causal=True, kv_cache_dtype=case["spec"].kv_cache_dtype,
                                     k_descale=case["ks"], v_descale=case["vs"])
    assert rel_l2(outs[1], want.cpu()) <= 2e-2
