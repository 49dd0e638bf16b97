"""torch.ops.pagedattn and flash_attn_with_kvcache without a GPU: schemas, fake tensors, the eager
messages kept at trace time, Dynamo tracing with zero graph breaks (meta tensors: the fake
implementations run), torch.library.opcheck against CPU kernels built from pagedattn.reference, and
flash_attn_with_kvcache's argument checks."""
import pytest
import torch
from torch._subclasses import FakeTensorMode

import pagedattn
from pagedattn import ContractError, reference
from pagedattn.ops import kvcache

OPS = torch.ops.pagedattn
NO_FEATURES = ([-1, -1], 0.0, None, None)


def decode_inputs(device="cpu", B=3, Hq=8, Hkv=2, D=64, bs=16, blocks=16, width=4, gen=None):
    gen = gen or torch.Generator().manual_seed(0)
    kc = torch.randn(blocks, bs, Hkv, D, generator=gen).bfloat16()
    return dict(
        q=torch.randn(B, Hq, D, generator=gen).bfloat16(), kc=kc, vc=torch.randn(kc.shape, generator=gen).bfloat16(),
        key=torch.randn(B, Hkv, D, generator=gen).bfloat16(),
        slots=torch.randperm(blocks * bs, generator=gen)[:B].long(),
        table=torch.randperm(blocks, generator=gen)[: B * width].view(B, width).int(),
        cu=torch.arange(B + 1, dtype=torch.int32),
        seq=torch.randint(1, width * bs + 1, (B,), generator=gen).int(),
        w=torch.randn(Hq * D, 32, generator=gen).bfloat16(),
    ) if device == "cpu" else {k: v.to(device) for k, v in decode_inputs("cpu", B, Hq, Hkv, D, bs, blocks, width,
                                                                          gen).items()}


def varlen_args(x, **over):
    args = dict(q=x["q"], k=x["kc"], v=x["vc"], max_seqlen_q=1, cu_seqlens_q=x["cu"], max_seqlen_k=64,
                cu_seqlens_k=None, seqused_k=x["seq"], softmax_scale=None, causal=False, block_table=x["table"],
                num_splits=0, k_descale=None, v_descale=None, kv_cache_dtype=None, window_size=[-1, -1],
                softcap=0.0, alibi_slopes=None, sinks=None)
    args.update(over)
    return tuple(args.values())


def test_ops_are_registered():
    assert "Tensor(a2!) key_cache" in str(OPS.reshape_and_cache_flash.default._schema)
    assert str(OPS.flash_attn_varlen_func.default._schema).endswith("-> (Tensor, Tensor)")
    assert "Tensor(a19!) out) -> Tensor" in str(OPS.flash_attn_varlen_func.out._schema)
    schema = str(OPS.flash_attn_with_kvcache.default._schema)
    assert "Tensor(a1!) k_cache" in schema and "Tensor(a2!) v_cache" in schema
    assert pagedattn.flash_attn_with_kvcache is kvcache.flash_attn_with_kvcache


def test_fake_outputs():
    with FakeTensorMode():  # fake CUDA tensors need no GPU
        q = torch.empty(6, 8, 64, dtype=torch.bfloat16, device="cuda")
        kc = torch.empty(16, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
        cu = torch.empty(4, dtype=torch.int32, device="cuda")
        seq = torch.empty(3, dtype=torch.int32, device="cuda")
        table = torch.empty(3, 4, dtype=torch.int32, device="cuda")
        out, lse = OPS.flash_attn_varlen_func(q, kc, kc, 2, cu, 64, None, seq, None, True, table, 0, None, None,
                                              None, *NO_FEATURES)
        assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
        assert lse.shape == (8, 6) and lse.dtype == torch.float32
        given = torch.empty_like(q)
        assert OPS.flash_attn_varlen_func.out(q, kc, kc, 2, cu, 64, None, seq, None, True, table, 0, None, None,
                                              None, *NO_FEATURES, given).shape == (8, 6)
        # the public functions route fake tensors to the ops
        assert pagedattn.flash_attn_varlen_func(q, kc, kc, 2, cu, 64, seqused_k=seq, block_table=table).shape == q.shape
        q4 = torch.empty(3, 2, 8, 64, dtype=torch.bfloat16, device="cuda")
        k4 = torch.empty(3, 2, 2, 64, dtype=torch.bfloat16, device="cuda")
        out, lse = pagedattn.flash_attn_with_kvcache(q4, kc, kc, k4, k4, cache_seqlens=seq, block_table=table,
                                                     causal=True, return_softmax_lse=True)
        assert out.shape == q4.shape and lse.shape == (3, 8, 2)  # FlashAttention's [B, Hq, Sq]
        pagedattn.reshape_and_cache_flash(k4.view(6, 2, 64), k4.view(6, 2, 64), kc, kc,
                                          torch.empty(6, dtype=torch.int64, device="cuda"))


def _message(fn):
    with pytest.raises(ContractError) as info:
        fn()
    return str(info.value)


BAD_ATTENTION = {
    "seqused_k int64": dict(seqused_k="seq64"),
    "q fp32": dict(q="q32"),
    "GQA": dict(q="q3heads"),
    "table rows": dict(block_table="table2"),
    "window": dict(window_size=[-3, 0]),
    "softcap": dict(softcap=-1.0),
    "scale": dict(softmax_scale=-1.0),
}


def _bad(x, name):
    return {"seq64": x["seq"].long(), "q32": x["q"].float(), "q3heads": x["q"][:, :3].contiguous(),
            "table2": x["table"][:2]}.get(name, name) if isinstance(name, str) else name


@pytest.mark.parametrize("case", sorted(BAD_ATTENTION))
def test_fake_attention_keeps_eager_messages(case):
    """The same metadata, real CPU tensors through the eager function (it validates before asking for
    CUDA) and fake CUDA tensors through the op: the same ContractError message."""
    x = decode_inputs()
    over = {k: _bad(x, v) for k, v in BAD_ATTENTION[case].items()}
    args = varlen_args(x, **over)
    keys = ("q", "k", "v", "max_seqlen_q", "cu_seqlens_q", "max_seqlen_k", "cu_seqlens_k", "seqused_k",
            "softmax_scale", "causal", "block_table", "num_splits", "k_descale", "v_descale", "kv_cache_dtype",
            "window_size", "softcap", "alibi_slopes", "sinks")
    kw = dict(zip(keys, args))
    eager = _message(lambda: pagedattn.flash_attn_varlen_func(**{k: (tuple(v) if k == "window_size" else v)
                                                                for k, v in kw.items()}))
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        traced = _message(lambda: OPS.flash_attn_varlen_func(*fake))
    assert traced == eager and "cuda" not in eager.lower()


@pytest.mark.parametrize("case", ["key dtype", "slot dtype", "heads", "cache shape"])
def test_fake_write_keeps_eager_messages(case):
    x = decode_inputs()
    key, value, kc, vc, slots = x["key"], x["key"], x["kc"], x["vc"], x["slots"]
    if case == "key dtype":
        key = key.float()
    elif case == "slot dtype":
        slots = slots.float()
    elif case == "heads":
        key = value = torch.cat([key, key], 1)
    else:
        vc = vc[:8]
    args = (key, value, kc, vc, slots, "auto", None, None)
    eager = _message(lambda: pagedattn.reshape_and_cache_flash(*args))
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        assert _message(lambda: OPS.reshape_and_cache_flash(*fake)) == eager


def _meta(x):
    return {k: v.to("meta") for k, v in x.items()}


def decode_step(x):
    pagedattn.reshape_and_cache_flash(x["key"], x["key"], x["kc"], x["vc"], x["slots"])
    o = pagedattn.flash_attn_varlen_func(x["q"], x["kc"], x["vc"], 1, x["cu"], 64, seqused_k=x["seq"],
                                         block_table=x["table"])
    return o.flatten(1) @ x["w"]


def test_dynamo_traces_a_decode_step_without_graph_breaks():
    """write + attention + matmul: one graph, zero breaks (meta tensors: the fake implementations run,
    so Dynamo's execution of the graph needs no GPU)."""
    torch._dynamo.reset()
    explain = torch._dynamo.explain(decode_step)(_meta(decode_inputs()))
    assert explain.graph_count == 1 and explain.graph_break_count == 0, explain.break_reasons
    code = explain.graphs[0].code
    assert "torch.ops.pagedattn.reshape_and_cache_flash" in code and "flash_attn_varlen_func.default" in code


def test_dynamo_traces_out_and_kvcache():
    def step(x, out):
        pagedattn.flash_attn_varlen_func(x["q"], x["kc"], x["vc"], 1, x["cu"], 64, seqused_k=x["seq"],
                                         block_table=x["table"], out=out, window_size=(8, 0), softcap=5.0)
        q4 = x["q"].view(3, 1, 8, 64)
        k4 = x["key"].view(3, 1, 2, 64)
        o, lse = pagedattn.flash_attn_with_kvcache(q4, x["kc"], x["vc"], k4, k4, cache_seqlens=x["seq"],
                                                   block_table=x["table"], causal=True, return_softmax_lse=True)
        return out + o.view(3, 8, 64), lse

    torch._dynamo.reset()
    x = _meta(decode_inputs())
    explain = torch._dynamo.explain(step)(x, torch.empty_like(x["q"]))
    assert explain.graph_count == 1 and explain.graph_break_count == 0, explain.break_reasons
    assert "flash_attn_varlen_func.out" in explain.graphs[0].code
    assert "flash_attn_with_kvcache" in explain.graphs[0].code


def test_compile_fails_at_trace_time_with_the_eager_message():
    x = decode_inputs()
    x["seq"] = x["seq"].long()
    eager = _message(lambda: pagedattn.flash_attn_varlen_func(x["q"], x["kc"], x["vc"], 1, x["cu"], 64,
                                                              seqused_k=x["seq"], block_table=x["table"]))
    assert "seqused_k must be a contiguous int32" in eager
    seen = []

    def backend(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(decode_step, backend=backend, fullgraph=True)(_meta(x))
    # Dynamo reports it inside its TorchRuntimeError, naming the ContractError and its message
    assert f"ContractError({eager.replace('on cpu', 'on meta')!r})" in str(info.value) and not seen


# ---------------------------------------------------------------- opcheck with CPU reference kernels
def _cpu_write(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    reference.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale,
                                      v_scale)


def _cpu_attend(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, seqused_k, softmax_scale, causal,
                block_table, num_splits, k_descale, v_descale, kv_cache_dtype, window_size, softcap, alibi_slopes,
                sinks, out=None):
    o, lse = reference.paged_attention(q, k, v, cu_seqlens_q, seqused_k, block_table, causal=causal,
                                       softmax_scale=softmax_scale, return_lse=True, window_size=tuple(window_size),
                                       softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    out = torch.empty_like(q) if out is None else out
    out.copy_(o)
    return out, lse


def _cpu_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, window_size, softcap,
                 alibi_slopes, num_splits, k_descale, v_descale, kv_cache_dtype, sinks, max_seqlen_k):
    B, Sq, Hq, D = q.shape
    seqused = cache_seqlens
    if k is not None:
        slots = kvcache._slots(cache_seqlens, block_table, k_cache.shape[1], k.shape[1])
        reference.reshape_and_cache_flash(k.flatten(0, 1), v.flatten(0, 1), k_cache, v_cache, slots)
        seqused = cache_seqlens + k.shape[1]
    cu = torch.arange(B + 1, dtype=torch.int32) * Sq
    o, lse = reference.paged_attention(q.flatten(0, 1), k_cache, v_cache, cu, seqused, block_table, causal=causal,
                                       softmax_scale=softmax_scale, return_lse=True, window_size=tuple(window_size),
                                       softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    return o.to(q.dtype).view(B, Sq, Hq, D), lse.view(Hq, B, Sq).permute(1, 0, 2)


@pytest.fixture(scope="module")
def cpu_kernels():
    """CPU implementations of the ops from the reference, so that opcheck can compare the fake
    implementations with real outputs here (the real kernels are CUDA-only)."""
    lib = torch.library.Library("pagedattn", "IMPL")
    lib.impl("reshape_and_cache_flash", _cpu_write, "CPU")
    lib.impl("flash_attn_varlen_func", _cpu_attend, "CPU")
    lib.impl("flash_attn_varlen_func.out", lambda *a: _cpu_attend(*a[:-1], out=a[-1])[1], "CPU")
    lib.impl("flash_attn_with_kvcache", _cpu_kvcache, "CPU")
    yield
    lib._destroy()


def test_opcheck_with_cpu_reference_kernels(cpu_kernels):
    x = decode_inputs()
    torch.library.opcheck(OPS.reshape_and_cache_flash.default,
                          (x["key"], x["key"], x["kc"].clone(), x["vc"].clone(), x["slots"], "auto", None, None))
    for causal in (False, True):
        torch.library.opcheck(OPS.flash_attn_varlen_func.default, varlen_args(x, causal=causal))
        torch.library.opcheck(OPS.flash_attn_varlen_func.out, varlen_args(x, causal=causal) + (torch.empty_like(x["q"]),))
    q4 = x["q"].view(3, 1, 8, 64)
    k4 = x["key"].view(3, 1, 2, 64)
    seq = (x["seq"] - 1).clamp_min(0)
    for new in (None, k4):
        torch.library.opcheck(OPS.flash_attn_with_kvcache.default,
                              (q4, x["kc"].clone(), x["vc"].clone(), new, new, seq, x["table"], None, True,
                               [-1, -1], 0.0, None, 0, None, None, None, None, 64))


# ---------------------------------------------------------------- flash_attn_with_kvcache's arguments
def _kv(**over):
    x = decode_inputs()
    args = dict(q=x["q"].view(3, 1, 8, 64), k_cache=x["kc"], v_cache=x["vc"], k=x["key"].view(3, 1, 2, 64),
                v=x["key"].view(3, 1, 2, 64), cache_seqlens=x["seq"] - 1, block_table=x["table"])
    args.update(over)
    return args


@pytest.mark.parametrize("name", ["rotary_cos", "rotary_sin", "cache_batch_idx", "cache_leftpad"])
def test_kvcache_not_implemented(name):
    with pytest.raises(NotImplementedError, match=name.split("_")[0] if "rotary" in name else name):
        pagedattn.flash_attn_with_kvcache(**_kv(**{name: torch.zeros(3)}))


@pytest.mark.parametrize("over, match", [
    (dict(q=torch.zeros(3, 8, 64, dtype=torch.bfloat16)), r"q must be a 4-D tensor \[B, Sq, Hq, D\]"),
    (dict(v=None), "give both k and v"),
    (dict(cache_seqlens=None), "appending k/v needs cache_seqlens"),
    (dict(cache_seqlens=10_000), r"cache_seqlens=10000 is outside \[0, 64\]"),
    (dict(cache_seqlens=torch.zeros(3, dtype=torch.int64)), "cache_seqlens must be a contiguous int32"),
    (dict(cache_seqlens=torch.zeros(2, dtype=torch.int32)), "cache_seqlens has 2 entries, q's batch is 3"),
    (dict(k=torch.zeros(3, 1, 4, 64, dtype=torch.bfloat16)), r"k \(the new tokens\) must be \[B, Snew, Hkv, D\]"),
    (dict(block_table=torch.zeros(3, 4, dtype=torch.int64)), "block_table must be an int32"),
    (dict(block_table=None), r"without a block_table, k_cache \[B, S_cache, Hkv, D\] needs B = 3"),
    (dict(k_cache=torch.zeros(16, 16, 2, 64)), "k, v .the paged caches.: key_cache .* and value_cache"),
])
def test_kvcache_bad_input(over, match):
    with pytest.raises(ContractError, match=match):
        pagedattn.flash_attn_with_kvcache(**_kv(**over))


def test_kvcache_bad_input_traced():
    """In fake mode (fake CUDA tensors) the append's checks run too, with the eager messages."""
    with FakeTensorMode() as mode:
        args = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in _kv().items()}
        args["k"] = args["v"] = args["k"].float()
        with pytest.raises(ContractError, match="appending k/v to the cache: kv_cache_dtype='auto' needs the cache"):
            pagedattn.flash_attn_with_kvcache(**args)


def test_kvcache_unknown_and_unsupported_keywords():
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        pagedattn.flash_attn_with_kvcache(**_kv(), bogus=1)
    with pytest.raises(NotImplementedError, match="q_descale"):
        pagedattn.flash_attn_with_kvcache(**_kv(), q_descale=torch.ones(1))
    with pytest.raises(ContractError, match="kernels need CUDA tensors"):  # valid input, CPU tensors
        pagedattn.flash_attn_with_kvcache(**_kv())


def test_kvcache_refuses_before_writing():
    """A refused call leaves the cache as it was: every check runs before the append."""
    args = _kv(q=torch.zeros(3, 1, 8, 64, dtype=torch.float16))
    before = args["k_cache"].clone()
    with pytest.raises(ContractError, match="q dtype|KV dtype"):
        pagedattn.flash_attn_with_kvcache(**args)
    assert torch.equal(args["k_cache"], before)


def test_kvcache_slots():
    gen = torch.Generator().manual_seed(3)
    table = torch.randperm(40, generator=gen)[:12].view(3, 4).int()
    seqlens = torch.tensor([0, 17, 62], dtype=torch.int32)
    slots = kvcache._slots(seqlens, table, 16, 3).view(3, 3)
    for b in range(3):
        for i in range(3):
            pos = int(seqlens[b]) + i
            want = int(table[b, pos // 16]) * 16 + pos % 16 if pos < 64 else -1
            assert int(slots[b, i]) == want


def test_compiled_step_matches_the_ops_with_cpu_reference_kernels(cpu_kernels):
    """aot_eager functionalizes the cache writes: the attention that follows in the same graph must
    read the written cache, and the caches and out= must come back mutated exactly as eager does."""
    x = decode_inputs()
    pos = x["seq"].long() - 1  # the new token is each request's last key
    x["slots"] = x["table"].long().gather(1, (pos // 16)[:, None])[:, 0] * 16 + pos % 16
    q4, k4 = x["q"].view(3, 1, 8, 64), x["key"].view(3, 1, 2, 64)
    lens = (x["seq"] - 1).clamp_min(0)

    def step(kc, vc, out):
        pagedattn.reshape_and_cache_flash(x["key"], x["key"], kc, vc, x["slots"])
        o = pagedattn.flash_attn_varlen_func(x["q"], kc, vc, 1, x["cu"], 64, seqused_k=x["seq"], block_table=x["table"])
        o4, lse = pagedattn.flash_attn_with_kvcache(q4, kc, vc, k4, k4, cache_seqlens=lens, block_table=x["table"],
                                                    causal=True, return_softmax_lse=True)
        pagedattn.flash_attn_varlen_func(x["q"], kc, vc, 1, x["cu"], 64, seqused_k=x["seq"], block_table=x["table"],
                                         out=out, window_size=(8, 0), softcap=5.0)
        return o.flatten(1) @ x["w"], o4, lse, out * 2

    def step_ops(kc, vc, out):  # what eager on the GPU runs: the same implementations, op by op
        OPS.reshape_and_cache_flash(x["key"], x["key"], kc, vc, x["slots"], "auto", None, None)
        o, _ = OPS.flash_attn_varlen_func(*varlen_args(dict(x, kc=kc, vc=vc)))
        o4, lse = OPS.flash_attn_with_kvcache(q4, kc, vc, k4, k4, lens, x["table"], None, True, [-1, -1], 0.0, None,
                                              0, None, None, None, None, 64)
        OPS.flash_attn_varlen_func.out(*varlen_args(dict(x, kc=kc, vc=vc), window_size=[8, 0], softcap=5.0), out)
        return o.flatten(1) @ x["w"], o4, lse, out * 2

    torch._dynamo.reset()
    eager = [x["kc"].clone(), x["vc"].clone(), torch.empty_like(x["q"])]
    traced = [x["kc"].clone(), x["vc"].clone(), torch.empty_like(x["q"])]
    want = step_ops(*eager)
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(*traced)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert all(torch.equal(a, b) for a, b in zip(eager, traced))


def test_compiled_kvcache_fails_at_trace_time_with_the_eager_message():
    """flash_attn_with_kvcache's own checks run while Dynamo traces it (before the op): the same message."""
    x = decode_inputs()
    eager = _message(lambda: pagedattn.flash_attn_with_kvcache(x["q"], x["kc"], x["vc"], cache_seqlens=x["seq"],
                                                               block_table=x["table"]))
    assert eager.startswith("q must be a 4-D tensor")

    def step(x):
        return pagedattn.flash_attn_with_kvcache(x["q"], x["kc"], x["vc"], cache_seqlens=x["seq"],
                                                 block_table=x["table"])

    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(step, backend=lambda gm, example_inputs: gm.forward, fullgraph=True)(_meta(x))
    assert eager.replace("on cpu", "on meta") in str(info.value)
