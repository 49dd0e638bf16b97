"""torch.ops.pagedattn, torch.compile, CUDA graphs and flash_attn_with_kvcache on the GPU.

Every test uses bf16, head dim 128, 16-slot pages and at most 16 packed rows per request, so that
they share one decode variant (plus one window+softcap variant and the bf16 write)."""
import pytest
import torch

import pagedattn
from pagedattn import reference
from pagedattn.ops import workspace

pytestmark = pytest.mark.gpu
OPS = torch.ops.pagedattn
B, HQ, HKV, D, BS = 3, 8, 2, 128, 16


def rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def paged_cache(num_blocks, gen, poison=False):
    kc = torch.randn(num_blocks, BS, HKV, D, generator=gen).bfloat16().cuda()
    vc = torch.randn(num_blocks, BS, HKV, D, generator=gen).bfloat16().cuda()
    if poison:
        kc.fill_(float("nan"))
        vc.fill_(float("nan"))
    return kc, vc


def shuffled_table(width, num_blocks, gen):
    table = torch.randperm(num_blocks, generator=gen)[: B * width].view(B, width).int()
    assert not torch.equal(table.flatten().sort().values, table.flatten())
    return table.cuda()


def last_slots(table, seq):
    """Slot of each request's newest token (position seq - 1)."""
    pos = seq.long() - 1
    return table.long().gather(1, (pos // BS)[:, None])[:, 0] * BS + pos % BS


def decode_state(gen, width=8, max_k=None):
    num_blocks = B * width + 5
    kc, vc = paged_cache(num_blocks, gen)
    table = shuffled_table(width, num_blocks, gen)
    seq = torch.tensor([1, width * BS // 2 + 3, width * BS], dtype=torch.int32).cuda()
    return dict(q=torch.randn(B, HQ, D, generator=gen).bfloat16().cuda(),
                key=torch.randn(B, HKV, D, generator=gen).bfloat16().cuda(),
                val=torch.randn(B, HKV, D, generator=gen).bfloat16().cuda(),
                kc=kc, vc=vc, table=table, seq=seq, slots=last_slots(table, seq),
                cu=torch.arange(B + 1, dtype=torch.int32).cuda(),
                w=(torch.randn(HQ * D, 64, generator=gen) / 32).bfloat16().cuda(), max_k=max_k or width * BS)


def decode_step(x, num_splits=0):
    """One layer's decode: write the new token, attend over the cache, project."""
    pagedattn.reshape_and_cache_flash(x["key"], x["val"], x["kc"], x["vc"], x["slots"])
    o = pagedattn.flash_attn_varlen_func(x["q"], x["kc"], x["vc"], 1, x["cu"], x["max_k"], seqused_k=x["seq"],
                                         block_table=x["table"], num_splits=num_splits)
    return o, o.flatten(1) @ x["w"]


def varlen_args(x, causal=False):
    return (x["q"], x["kc"], x["vc"], 1, x["cu"], x["max_k"], None, x["seq"], None, causal, x["table"], 0, None,
            None, None, [-1, -1], 0.0, None, None)


# ---------------------------------------------------------------- item 1: ops, opcheck, torch.compile
def test_opcheck_every_op():
    gen = torch.Generator().manual_seed(1)
    x = decode_state(gen)
    torch.library.opcheck(OPS.reshape_and_cache_flash.default,
                          (x["key"], x["val"], x["kc"], x["vc"], x["slots"], "auto", None, None))
    for causal in (False, True):
        torch.library.opcheck(OPS.flash_attn_varlen_func.default, varlen_args(x, causal))
        torch.library.opcheck(OPS.flash_attn_varlen_func.out, varlen_args(x, causal) + (torch.empty_like(x["q"]),))
    q4 = torch.randn(B, 2, HQ, D, generator=gen).bfloat16().cuda()
    k4 = torch.randn(B, 2, HKV, D, generator=gen).bfloat16().cuda()
    seq = (x["seq"] - 2).clamp_min(0)
    for new in (None, k4):
        torch.library.opcheck(OPS.flash_attn_with_kvcache.default,
                              (q4, x["kc"], x["vc"], new, new, seq, x["table"], None, True, [-1, -1], 0.0, None, 0,
                               None, None, None, None, x["max_k"]))


def _clone_state(x):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in x.items()}


def test_compiled_decode_step_is_bit_identical_without_graph_breaks():
    gen = torch.Generator().manual_seed(2)
    x = decode_state(gen)
    torch._dynamo.reset()
    explain = torch._dynamo.explain(decode_step)(_clone_state(x))
    assert explain.graph_count == 1 and explain.graph_break_count == 0, explain.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(decode_step, fullgraph=True)
    for it in range(3):  # new lengths, tables and slots each step: the same compiled graph
        if it:
            x["seq"] = torch.randint(1, x["max_k"] + 1, (B,), generator=gen).int().cuda()
            x["table"] = shuffled_table(x["table"].shape[1], x["kc"].shape[0], gen)
            x["slots"] = last_slots(x["table"], x["seq"])
            x["q"] = torch.randn(B, HQ, D, generator=gen).bfloat16().cuda()
        eager_x, comp_x = _clone_state(x), _clone_state(x)
        eo, ey = decode_step(eager_x)
        co, cy = compiled(comp_x)
        torch.cuda.synchronize()
        assert torch.equal(eo, co) and torch.equal(ey, cy)
        assert torch.equal(eager_x["kc"], comp_x["kc"]) and torch.equal(eager_x["vc"], comp_x["vc"])
        ref = reference.paged_attention(x["q"], eager_x["kc"], eager_x["vc"], x["cu"], x["seq"], x["table"])
        assert rel_l2(eo, ref) < 1e-2


def test_compiled_kvcache_step_is_bit_identical():
    gen = torch.Generator().manual_seed(3)
    x = decode_state(gen)
    q4 = torch.randn(B, 2, HQ, D, generator=gen).bfloat16().cuda()
    k4 = torch.randn(B, 2, HKV, D, generator=gen).bfloat16().cuda()
    v4 = torch.randn(B, 2, HKV, D, generator=gen).bfloat16().cuda()
    lens = (x["seq"] - 2).clamp_min(0)

    def step(kc, vc):
        o, lse = pagedattn.flash_attn_with_kvcache(q4, kc, vc, k4, v4, cache_seqlens=lens, block_table=x["table"],
                                                   causal=True, return_softmax_lse=True)
        return o.flatten(2) @ x["w"], lse

    torch._dynamo.reset()
    kc_e, vc_e, kc_c, vc_c = x["kc"].clone(), x["vc"].clone(), x["kc"].clone(), x["vc"].clone()
    ey, el = step(kc_e, vc_e)
    cy, cl = torch.compile(step, fullgraph=True)(kc_c, vc_c)
    torch.cuda.synchronize()
    assert torch.equal(ey, cy) and torch.equal(el, cl)
    assert torch.equal(kc_e, kc_c) and torch.equal(vc_e, vc_c)


# ---------------------------------------------------------------- item 2: CUDA graphs
@pytest.mark.parametrize("num_splits", [0, 1, 4])
def test_cuda_graph_replays_with_new_metadata(num_splits):
    """Capture write + decode (split-KV left to the heuristic, or forced) + matmul once; replay
    with new seqused_k / block_table / slot_mapping / q / k contents, lengths up to the captured
    max_seqlen_k: bit for bit what eager gives on the same inputs. The capture allocates no
    workspace (the warm-up on the capture stream did) and the counters are zero after every replay."""
    gen = torch.Generator().manual_seed(4)
    width = 64  # 1024 keys: with B * Hkv = 6 tiles the heuristic splits the KV range
    x = decode_state(gen, width=width)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            decode_step(x, num_splits)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    mine = {k: (b.tensor.data_ptr(), b.tensor.numel()) for k, b in workspace._BUFFERS.items()
            if k[2] == side.cuda_stream}
    if num_splits != 1:
        assert any(k[0] == "workspace" for k in mine), "the heuristic should split 1024 keys over 6 tiles"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        static_o, static_y = decode_step(x, num_splits)
    after = {k: (b.tensor.data_ptr(), b.tensor.numel()) for k, b in workspace._BUFFERS.items()
             if k[2] == side.cuda_stream}
    assert after == mine, "capture allocated split-KV scratch"
    lens_list = [[1, 17, 1024], [1024, 1024, 1024], [300, 2, 511], [16, 1023, 33]]
    for lens in lens_list:
        seq = torch.tensor(lens, dtype=torch.int32).cuda()
        table = shuffled_table(width, x["kc"].shape[0], gen)
        x["seq"].copy_(seq)
        x["table"].copy_(table)
        x["slots"].copy_(last_slots(table, seq))
        x["q"].copy_(torch.randn(B, HQ, D, generator=gen).bfloat16())
        x["key"].copy_(torch.randn(B, HKV, D, generator=gen).bfloat16())
        kc0, vc0 = x["kc"].clone(), x["vc"].clone()
        graph.replay()
        torch.cuda.synchronize()
        go, gy, gk, gv = static_o.clone(), static_y.clone(), x["kc"].clone(), x["vc"].clone()
        x["kc"].copy_(kc0)
        x["vc"].copy_(vc0)
        eo, ey = decode_step(x, num_splits)
        torch.cuda.synchronize()
        assert torch.equal(go, eo) and torch.equal(gy, ey), lens
        assert torch.equal(gk, x["kc"]) and torch.equal(gv, x["vc"])
        ref = reference.paged_attention(x["q"], x["kc"], x["vc"], x["cu"], x["seq"], x["table"])
        assert rel_l2(go, ref) < 1e-2
        assert all(int(b.abs().sum()) == 0 for b in workspace.counter_buffers().values())


# ---------------------------------------------------------------- item 3: flash_attn_with_kvcache
def _expected_append(kc, vc, k, v, lens, table):
    """The caches after appending k/v [B, Snew, Hkv, D] at positions lens (a plain loop)."""
    kc, vc = kc.clone(), vc.clone()
    bs = kc.shape[1]
    for b in range(k.shape[0]):
        for i in range(k.shape[1]):
            pos = int(lens[b]) + i
            block = int(table[b, pos // bs])
            kc[block, pos % bs] = k[b, i]
            vc[block, pos % bs] = v[b, i]
    return kc, vc


@pytest.mark.parametrize("sq, snew, causal, lens, paged", [
    (1, 1, True, [0, 37, 126], True),     # decode: the new token is the last key
    (3, 3, True, [5, 16, 100], True),     # several new tokens (speculative decoding)
    (2, 0, False, [1, 64, 128], True),    # no append, attention only
    (4, 2, True, [9, 30, 77], True),      # more queries than new keys: bottom-right causal
    (1, 1, True, [0, 60, 127], False),    # a contiguous [B, S_cache, Hkv, D] cache, no block_table
])
def test_kvcache_against_reference(sq, snew, causal, lens, paged):
    gen = torch.Generator().manual_seed(5 + sq + snew)
    width = 8  # capacity 128 keys per request
    if paged:
        num_blocks = B * width + 3
        kc, vc = paged_cache(num_blocks, gen)
        table = shuffled_table(width, num_blocks, gen)
    else:
        kc = torch.randn(B, width * BS, HKV, D, generator=gen).bfloat16().cuda()
        vc = torch.randn(B, width * BS, HKV, D, generator=gen).bfloat16().cuda()
        table = None
    q = torch.randn(B, sq, HQ, D, generator=gen).bfloat16().cuda()
    k = torch.randn(B, snew, HKV, D, generator=gen).bfloat16().cuda() if snew else None
    v = torch.randn(B, snew, HKV, D, generator=gen).bfloat16().cuda() if snew else None
    lens_t = torch.tensor(lens, dtype=torch.int32).cuda()
    ref_table = table if paged else torch.arange(B, dtype=torch.int32).view(B, 1).cuda()
    if snew:
        ref_kc, ref_vc = _expected_append(kc, vc, k, v, lens, ref_table)
    else:
        ref_kc, ref_vc = kc.clone(), vc.clone()
    out, lse = pagedattn.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens_t, block_table=table,
                                                 causal=causal, return_softmax_lse=True)
    torch.cuda.synchronize()
    assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)
    assert out.shape == (B, sq, HQ, D) and lse.shape == (B, HQ, sq)
    cu = torch.arange(B + 1, dtype=torch.int32).cuda() * sq
    ref_o, ref_lse = reference.paged_attention(q.flatten(0, 1), ref_kc, ref_vc, cu, lens_t + snew, ref_table,
                                               causal=causal, return_lse=True, compute_dtype=torch.float64)
    assert rel_l2(out.flatten(0, 1), ref_o) < 1e-2
    assert torch.allclose(lse.permute(1, 0, 2).reshape(HQ, B * sq), ref_lse.float(), atol=2e-2)
    again = pagedattn.flash_attn_with_kvcache(q, ref_kc.clone(), ref_vc.clone(), None, None,
                                              cache_seqlens=lens_t + snew, block_table=table, causal=causal)
    assert torch.equal(again, out)  # appending then attending == attending over the appended cache


def _appended(kc, vc, k, v, lens, table, num_blocks):
    """_expected_append where every position has a valid slot; positions past the row and corrupt
    block ids are skipped (what the write kernel's append mode does)."""
    kc, vc = kc.clone(), vc.clone()
    bs, width = kc.shape[1], table.shape[1]
    for b in range(k.shape[0]):
        for i in range(k.shape[1]):
            pos = int(lens[b]) + i
            if pos >= width * bs:
                continue
            block = int(table[b, pos // bs])
            if 0 <= block < num_blocks:
                kc[block, pos % bs] = k[b, i]
                vc[block, pos % bs] = v[b, i]
    return kc, vc


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("snew, sq", [(1, 1), (3, 3), (2, 4)])
def test_kvcache_steady_path_matches_a_validated_call(layout, snew, sq, monkeypatch):
    """After one validated call, calls with the same metadata take the steady path (two launches,
    no torch ops): each step's new lengths, tables, q and k/v give bit for bit what a validate=True call
    gives, and the caches what a plain loop writes (positions past a row's capacity dropped)."""
    from pagedattn import CacheSpec
    from pagedattn.ops import kvcache
    gen = torch.Generator().manual_seed(11 + snew + sq)
    width = 8
    num_blocks = B * width + 3
    kc, vc = CacheSpec(num_blocks, BS, HKV, D, torch.bfloat16, layout=layout).allocate("cuda", fill=float("nan"))
    kc.copy_(torch.randn(kc.shape, generator=gen))
    vc.copy_(torch.randn(vc.shape, generator=gen))
    lens = torch.zeros(B, dtype=torch.int32).cuda()
    table = shuffled_table(width, num_blocks, gen)
    q = torch.empty(B, sq, HQ, D, dtype=torch.bfloat16).cuda()
    k, v = (torch.empty(B, snew, HKV, D, dtype=torch.bfloat16).cuda() for _ in range(2))
    kvcache._STEADY.clear()
    capacity = width * BS
    steps = [[0, 17, 100], [capacity - snew, 1, 64], [capacity - 1, 0, 5], [33, capacity - snew, 126 - snew]]
    for step, step_lens in enumerate(steps):
        lens.copy_(torch.tensor(step_lens, dtype=torch.int32))
        table.copy_(shuffled_table(width, num_blocks, gen))
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=gen))
        want_kc, want_vc = _appended(kc, vc, k, v, step_lens, table, num_blocks)
        kc0, vc0 = kc.clone(), vc.clone()
        kvcache._STEADY.clear()  # the validated path (which registers the steady one again)
        ref_out, ref_lse = pagedattn.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table,
                                                             causal=True, return_softmax_lse=True)
        assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
        kc.copy_(kc0)
        vc.copy_(vc0)
        assert kvcache._STEADY.forms[1]
        with monkeypatch.context() as m:  # the steady path runs no checks
            m.setattr(kvcache, "run", lambda *a, **kw: pytest.fail("the steady path ran the checks"))
            out, lse = pagedattn.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table,
                                                         causal=True, return_softmax_lse=True)
            torch.cuda.synchronize()
        assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc), step
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse), step
        ends = (lens + snew).clamp(max=capacity)
        cu = torch.arange(B + 1, dtype=torch.int32).cuda() * sq
        ref = reference.paged_attention(q.flatten(0, 1), kc, vc, cu, ends, table, causal=True,
                                        compute_dtype=torch.float64)
        assert rel_l2(out.flatten(0, 1), ref) < 1e-2
    assert lens.tolist() == steps[-1][:B]  # cache_seqlens is read, never written


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_kvcache_fp8_steady_path_matches_the_validated_one(kv, monkeypatch):
    """fp8 caches on the steady path (descales also the write's scales): caches and outputs bit for bit
    those of the validated path, step after step, and the cache what the reference writer stores."""
    from pagedattn import CacheSpec
    from pagedattn.ops import kvcache
    gen = torch.Generator().manual_seed(13)
    width, num_blocks = 8, B * 8 + 3
    kc, vc = CacheSpec(num_blocks, BS, HKV, D, torch.uint8, kv).allocate("cuda")
    for c in (kc, vc):  # finite codes of either format (magnitude below 0x70), random signs
        c.copy_(torch.randint(0, 0x70, c.shape, generator=gen) | torch.randint(0, 2, c.shape, generator=gen) << 7)
    table = shuffled_table(width, num_blocks, gen)
    lens = torch.zeros(B, dtype=torch.int32).cuda()
    q = torch.empty(B, 2, HQ, D, dtype=torch.bfloat16).cuda()
    k, v = (torch.empty(B, 2, HKV, D, dtype=torch.bfloat16).cuda() for _ in range(2))
    kd, vd = torch.tensor([0.02]).cuda(), torch.tensor([0.03]).cuda()
    args = dict(cache_seqlens=lens, block_table=table, causal=True, return_softmax_lse=True, k_descale=kd,
                v_descale=vd, kv_cache_dtype=kv)
    for step_lens in ([0, 30, 100], [7, 126, 64], [64, 1, 127]):
        lens.copy_(torch.tensor(step_lens, dtype=torch.int32))
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=gen))
        want_kc, want_vc = kc.cpu(), vc.cpu()
        reference.reshape_and_cache_flash(k.flatten(0, 1).cpu(), v.flatten(0, 1).cpu(), want_kc, want_vc,
                                          kvcache._slots(lens, table, BS, 2).cpu(), kv, kd.cpu(), vd.cpu())
        kc0, vc0 = kc.clone(), vc.clone()
        kvcache._STEADY.clear()
        ref_out, ref_lse = pagedattn.flash_attn_with_kvcache(q, kc, vc, k, v, **args)
        ref_kc, ref_vc = kc.clone(), vc.clone()
        kc.copy_(kc0)
        vc.copy_(vc0)
        with monkeypatch.context() as m:
            m.setattr(kvcache, "run", lambda *a, **kw: pytest.fail("the steady path ran the checks"))
            out, lse = pagedattn.flash_attn_with_kvcache(q, kc, vc, k, v, **args)
            torch.cuda.synchronize()
        assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)
        assert torch.equal(kc.cpu(), want_kc) and torch.equal(vc.cpu(), want_vc)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
        assert torch.isfinite(out).all()


def test_kvcache_append_never_writes_outside_the_cache():
    """Corrupt block ids where the new tokens go (negative, past the cache, INT32_MAX): those tokens
    are dropped, the others land, and the guard pages around the cache stay as they were."""
    gen = torch.Generator().manual_seed(12)
    width, num_blocks = 4, B * 4 + 2
    big_k = torch.randn(num_blocks + 2, BS, HKV, D, generator=gen).bfloat16().cuda()
    big_v = torch.randn(num_blocks + 2, BS, HKV, D, generator=gen).bfloat16().cuda()
    kc, vc = big_k[1:-1], big_v[1:-1]
    before_k, before_v = big_k.clone(), big_v.clone()
    table = shuffled_table(width, num_blocks, gen)
    lens = [3, 20, 40]  # blocks 0, 1, 2 of each row
    table[0, 0], table[1, 1], table[2, 2] = -1, num_blocks + 1, 2**31 - 1
    q = torch.randn(B, 1, HQ, D, generator=gen).bfloat16().cuda()
    k = torch.randn(B, 1, HKV, D, generator=gen).bfloat16().cuda()
    v = torch.randn(B, 1, HKV, D, generator=gen).bfloat16().cuda()
    want_k, want_v = _appended(kc, vc, k, v, lens, table, num_blocks)
    for _ in range(2):  # the validated call, then the steady path
        out = pagedattn.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=torch.tensor(lens).int().cuda(),
                                                block_table=table, causal=True)
        torch.cuda.synchronize()
        assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
        assert torch.equal(big_k[0], before_k[0]) and torch.equal(big_k[-1], before_k[-1])
        assert torch.equal(big_v[0], before_v[0]) and torch.equal(big_v[-1], before_v[-1])
        assert torch.isfinite(out).all()
    with pytest.raises(pagedattn.ContractError):  # validate=True names the corrupt ids
        pagedattn.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=torch.tensor(lens).int().cuda(),
                                          block_table=table, causal=True, validate=True)


def test_kvcache_int_seqlens_window_and_softcap():
    """An int cache_seqlens, and window / softcap passed through to the kernel."""
    gen = torch.Generator().manual_seed(6)
    kc, vc = paged_cache(B * 8 + 3, gen)
    table = shuffled_table(8, kc.shape[0], gen)
    q = torch.randn(B, 2, HQ, D, generator=gen).bfloat16().cuda()
    k = torch.randn(B, 2, HKV, D, generator=gen).bfloat16().cuda()
    v = torch.randn(B, 2, HKV, D, generator=gen).bfloat16().cuda()
    ref_kc, ref_vc = _expected_append(kc, vc, k, v, [50] * B, table)
    out = pagedattn.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=50, block_table=table, causal=True,
                                            window_size=(16, 0), softcap=30.0)
    cu = torch.arange(B + 1, dtype=torch.int32).cuda() * 2
    seq = torch.full((B,), 52, dtype=torch.int32).cuda()
    ref = reference.paged_attention(q.flatten(0, 1), ref_kc, ref_vc, cu, seq, table, causal=True,
                                    window_size=(16, 0), softcap=30.0, compute_dtype=torch.float64)
    assert torch.equal(kc, ref_kc)
    assert rel_l2(out.flatten(0, 1), ref) < 1e-2
