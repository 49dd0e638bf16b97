"""Property-based fuzzing of the validators, CPU only: no kernel runs.

Each example is a valid call on CPU tensors with a few random mutations: other dtypes (int64,
float64, bool, ...), non-contiguous views, transposes, misaligned bases, other ranks, 0-d and empty
tensors, the meta device, non-tensors, random scalars and random metadata values (with validate=True
the value checks run too). On CPU every call must be refused -- a valid one by the CUDA check -- and
the property is that the refusal is a ContractError / UnsupportedError / NotImplementedError whose
message names an argument: never an IndexError, TypeError, RuntimeError, ... from torch or from the
checks themselves.

Reproducible: derandomized, no example database.
"""
import itertools
import re

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import pagedattn  # noqa: E402
from pagedattn import CacheSpec, ContractError, legacy  # noqa: E402
from pagedattn.dtypes import NAME_TO_TORCH  # noqa: E402
from pagedattn.registry import UnsupportedError  # noqa: E402

ALLOWED = (ContractError, UnsupportedError, NotImplementedError)
FUZZ = settings(max_examples=250, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

ATTN_TENSORS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table", "out",
                "k_descale", "v_descale")
ATTN_SCALARS = ("max_seqlen_q", "max_seqlen_k", "softmax_scale", "num_splits", "kv_cache_dtype")
WRITE_TENSORS = ("key", "value", "key_cache", "value_cache", "slot_mapping", "k_scale", "v_scale")
LEGACY_TENSORS = ("out", "query", "key_cache", "value_cache", "block_tables", "seq_lens", "alibi_slopes",
                  "k_scale", "v_scale", "exp_sums", "max_logits", "tmp_out")
LEGACY_SCALARS = ("num_kv_heads", "scale", "block_size", "max_seq_len", "kv_cache_dtype")

DTYPES = (torch.int32, torch.int64, torch.int16, torch.uint8, torch.bool, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)
JUNK = (None, 0, 3, -1, 1.5, float("nan"), True, "x", [1, 2], (), {})


def names_an_argument(message: str, names) -> bool:
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", message) for n in names)


def refused_cleanly(fn, kw, names):
    """fn(**kw) raises one of ALLOWED, naming an argument (anything else propagates: a failure)."""
    with pytest.raises(ALLOWED) as info:
        fn(**kw)
    assert names_an_argument(str(info.value), names), f"no argument named in: {info.value}"


# ---------------------------------------------------------------- mutations
def _retype(t, dtype):
    try:
        return t.to(dtype)
    except (RuntimeError, TypeError):
        return torch.zeros(t.shape, dtype=dtype, device=t.device)


def mutate_tensor(draw, t):
    """A random wrong version of argument t (a tensor, None or anything)."""
    kinds = ["junk", "dtype", "shape", "meta"]
    if isinstance(t, torch.Tensor):
        kinds += ["transpose", "step", "offset", "unsqueeze", "flatten", "scalar", "empty", "expand",
                  "values", "scalar_like"]
    kind = draw(st.sampled_from(kinds))
    if kind == "junk":
        return draw(st.sampled_from(JUNK))
    if kind == "dtype":
        dtype = draw(st.sampled_from(DTYPES))
        return _retype(t, dtype) if isinstance(t, torch.Tensor) else torch.zeros(3, dtype=dtype)
    if kind == "shape":
        shape = draw(st.lists(st.integers(0, 5), max_size=5))
        dtype = t.dtype if isinstance(t, torch.Tensor) else draw(st.sampled_from(DTYPES))
        return torch.zeros(shape, dtype=dtype)
    if kind == "meta":
        return t.to("meta") if isinstance(t, torch.Tensor) else torch.zeros(3, device="meta")
    if t.device.type == "meta":
        return t
    if kind == "transpose":
        if t.dim() < 2:
            return t
        a, b = draw(st.integers(0, t.dim() - 1)), draw(st.integers(0, t.dim() - 1))
        return t.transpose(a, b)
    if kind == "step":
        if t.dim() == 0:
            return t
        d = draw(st.integers(0, t.dim() - 1))
        return torch.cat([t, t], d).narrow(d, 0, 2 * t.shape[d])[(slice(None),) * d + (slice(None, None, 2),)]
    if kind == "offset":  # same shape and values, base pointer one element past 16-byte alignment
        flat = torch.empty(t.numel() + 1, dtype=t.dtype)[1:]
        return flat.view(t.shape).copy_(t)
    if kind == "unsqueeze":
        return t[None]
    if kind == "flatten":
        return t.reshape(-1)
    if kind == "scalar":
        return t.reshape(-1)[0].clone() if t.numel() else torch.zeros((), dtype=t.dtype)
    if kind == "scalar_like":
        return torch.tensor(draw(st.floats(allow_nan=True, allow_infinity=True)), dtype=torch.float32)
    if kind == "empty":
        return t[:0] if t.dim() else t
    if kind == "expand":
        return t[:1].expand(t.shape) if t.dim() and t.shape[0] else t
    return mutate_values(draw, t)


def mutate_values(draw, t):
    """A few random elements, the same metadata."""
    if not t.numel() or not (t.dtype.is_floating_point and t.element_size() >= 2 or
                             t.dtype in (torch.int32, torch.int64)):
        return t
    if t.dtype.is_floating_point:
        element = st.floats(allow_nan=True, allow_infinity=True, width=16)
    else:
        element = st.one_of(st.integers(-3, 60), st.integers(-2**31, 2**31 - 1))
    t = t.clone()
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, t.numel() - 1))
        index = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), t.shape)) if t.dim() else ()
        t[index] = draw(element)
    return t


def mutate_scalar(draw, name):
    if name == "kv_cache_dtype":
        return draw(st.sampled_from([None, "auto", "fp8", "fp8_e4m3", "fp8_e5m2", "FP8_E5M2", "int8", "", 8,
                                     ["fp8"], torch.float16]))
    return draw(st.one_of(st.integers(-3, 2**40), st.floats(allow_nan=True, allow_infinity=True), st.none(),
                          st.booleans(), st.text(max_size=2), st.sampled_from(JUNK),
                          st.sampled_from([torch.tensor(3), torch.tensor(0.5), torch.ones(2)])))


def mutate(draw, kw, tensors, scalars, metadata=()):
    """Either wrong values in the metadata (what validate=True checks) or 1-3 wrong arguments."""
    if metadata and draw(st.booleans()):
        kw["validate"] = True
        for _ in range(draw(st.integers(1, 2))):
            name = draw(st.sampled_from(metadata))
            if isinstance(kw.get(name), torch.Tensor):
                kw[name] = mutate_values(draw, kw[name])
            elif name in kw:
                kw[name] = draw(st.integers(0, 50))
        return kw
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(tensors + scalars))
        kw[name] = mutate_scalar(draw, name) if name in scalars else mutate_tensor(draw, kw.get(name))
    return kw


def _cu(lens):
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)


# ---------------------------------------------------------------- flash_attn_varlen_func
@st.composite
def attention_calls(draw):
    B = draw(st.integers(0, 3))
    lens_q = draw(st.lists(st.integers(0, 4), min_size=B, max_size=B))
    lens_k = draw(st.lists(st.integers(0, 40), min_size=B, max_size=B))
    hkv = draw(st.sampled_from([1, 2]))
    hq = hkv * draw(st.sampled_from([1, 2, 3]))
    d = draw(st.sampled_from([8, 16, 64, 72]))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    kv = draw(st.sampled_from(["auto", "fp8_e4m3", "fp8_e5m2"]))
    storage = dtype if kv == "auto" else draw(st.sampled_from([torch.uint8, NAME_TO_TORCH[kv]]))
    q = torch.randn(sum(lens_q), hq, d).to(dtype)
    kw = dict(q=q, max_seqlen_q=max(lens_q, default=0), cu_seqlens_q=_cu(lens_q),
              max_seqlen_k=max(lens_k, default=0), causal=draw(st.booleans()),
              return_softmax_lse=draw(st.booleans()), num_splits=draw(st.integers(0, 8)),
              validate=draw(st.booleans()))
    if draw(st.booleans()):  # paged
        bs = draw(st.sampled_from([1, 4, 16]))
        width = max([-(-n // bs) for n in lens_k], default=0) + draw(st.integers(0, 2))
        num_blocks = max(1, B * width + draw(st.integers(0, 2)))
        spec = CacheSpec(num_blocks, bs, hkv, d, storage, kv, draw(st.sampled_from(["NHD", "HND"])))
        kc, vc = spec.allocate("cpu")
        ids = draw(st.lists(st.integers(0, num_blocks - 1), min_size=B * width, max_size=B * width))
        kw.update(k=kc, v=vc, block_table=torch.tensor(ids, dtype=torch.int32).reshape(B, width),
                  seqused_k=torch.tensor(lens_k, dtype=torch.int32))
    else:
        k = torch.zeros(sum(lens_k), hkv, d, dtype=storage)
        kw.update(k=k, v=k.clone(), cu_seqlens_k=_cu(lens_k))
        if draw(st.booleans()):
            kw["seqused_k"] = torch.tensor(lens_k, dtype=torch.int32)
    if storage == torch.uint8 or draw(st.booleans()):
        kw["kv_cache_dtype"] = kv
    if kv != "auto":
        shape = draw(st.sampled_from([(), (1,), (hkv,), (B, hkv)]))
        kw["k_descale"], kw["v_descale"] = torch.full(shape, 0.5), torch.full(shape, 0.25)
    if draw(st.booleans()):
        kw["out"] = torch.empty_like(q)
    if draw(st.booleans()):
        kw["softmax_scale"] = draw(st.floats(0.01, 2.0))
    return mutate(draw, kw, ATTN_TENSORS, ATTN_SCALARS, ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table",
                                                         "k_descale", "v_descale", "max_seqlen_q", "max_seqlen_k"))


ATTN_NAMES = ATTN_TENSORS + ATTN_SCALARS + ("key_cache", "value_cache")


@FUZZ
@given(attention_calls())
def test_attention_refuses_cleanly(kw):
    refused_cleanly(pagedattn.flash_attn_varlen_func, kw, ATTN_NAMES)


@FUZZ
@given(st.sampled_from(["window_size", "softcap", "alibi_slopes", "s_aux", "fa_version", "dropout_p",
                        "deterministic", "cp_world_size"]),
       st.one_of(st.sampled_from(JUNK), st.just(torch.ones(2)), st.just(torch.tensor(0.0)),
                 st.just((-1, -1)), st.just([-1, -1]), st.floats(allow_nan=True)))
def test_attention_unsupported_keywords(name, value):
    q = torch.zeros(2, 2, 64, dtype=torch.float16)
    kc, vc = CacheSpec(2, 16, 2, 64, torch.float16).allocate("cpu")
    kw = dict(q=q, k=kc, v=vc, max_seqlen_q=1, cu_seqlens_q=_cu([1, 1]), max_seqlen_k=3,
              seqused_k=torch.tensor([3, 1], dtype=torch.int32), block_table=torch.zeros(2, 1, dtype=torch.int32),
              **{name: value})
    refused_cleanly(pagedattn.flash_attn_varlen_func, kw, ATTN_NAMES + (name,))


# ---------------------------------------------------------------- reshape_and_cache_flash
@st.composite
def write_calls(draw):
    t = draw(st.integers(0, 6))
    h, d = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([8, 16, 36, 64]))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    kv = draw(st.sampled_from(["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]))
    name = "fp8_e4m3" if kv == "fp8" else kv
    storage = dtype if kv == "auto" else draw(st.sampled_from([torch.uint8, NAME_TO_TORCH[name]]))
    gran = "tensor" if kv == "auto" else draw(st.sampled_from(["tensor", "head"]))
    spec = CacheSpec(draw(st.integers(1, 4)), draw(st.sampled_from([1, 16])), h, d, storage, name,
                     draw(st.sampled_from(["NHD", "HND"])), gran)
    kc, vc = spec.allocate("cpu")
    key = torch.randn(t + draw(st.integers(0, 2)), h, d).to(dtype)
    slots = draw(st.lists(st.integers(-1, spec.num_slots - 1), min_size=t, max_size=t))
    kw = dict(key=key, value=key.clone(), key_cache=kc, value_cache=vc,
              slot_mapping=torch.tensor(slots, dtype=draw(st.sampled_from([torch.int64, torch.int32]))),
              kv_cache_dtype=kv, validate=draw(st.sampled_from([None, False, True])))
    if kv != "auto":
        shape = draw(st.sampled_from([(), (1,)])) if gran == "tensor" else (h,)
        kw["k_scale"], kw["v_scale"] = torch.full(shape, 0.5), torch.full(shape, 2.0)
    return mutate(draw, kw, WRITE_TENSORS, ("kv_cache_dtype",), ("slot_mapping", "k_scale", "v_scale"))


@FUZZ
@given(write_calls())
def test_writer_refuses_cleanly(kw):
    refused_cleanly(pagedattn.reshape_and_cache_flash, kw, WRITE_TENSORS + ("kv_cache_dtype",))


# ---------------------------------------------------------------- legacy: paged_attention_v1/v2, reshape_and_cache
@st.composite
def legacy_calls(draw):
    n = draw(st.integers(0, 3))
    hkv = draw(st.sampled_from([1, 2]))
    heads = hkv * draw(st.sampled_from([1, 2]))
    d = draw(st.sampled_from([64, 80, 64, 80, 48]))  # 48: not compiled
    bs = draw(st.sampled_from([8, 16, 32]))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    kv = draw(st.sampled_from(["auto", "fp8_e4m3", "fp8_e5m2"]))
    storage = dtype if kv == "auto" else draw(st.sampled_from([torch.uint8, NAME_TO_TORCH[kv]]))
    num_blocks = draw(st.integers(1, 6))
    kc, vc = CacheSpec(num_blocks, bs, hkv, d, storage, kv, "legacy").allocate("cpu")
    width = draw(st.integers(0, 3))
    lens = draw(st.lists(st.integers(0, width * bs), min_size=n, max_size=n))
    query = torch.randn(n, heads, d).to(dtype)
    ids = draw(st.lists(st.integers(-1, num_blocks), min_size=n * width, max_size=n * width))
    kw = dict(out=torch.empty_like(query), query=query, key_cache=kc, value_cache=vc, num_kv_heads=hkv,
              scale=draw(st.floats(0.01, 1.0)), block_tables=torch.tensor(ids, dtype=torch.int32).reshape(n, width),
              seq_lens=torch.tensor(lens, dtype=torch.int32), block_size=bs, max_seq_len=max(lens, default=0),
              alibi_slopes=torch.ones(heads) if draw(st.booleans()) else None, kv_cache_dtype=kv,
              validate=draw(st.sampled_from([None, True])))
    if kv != "auto":
        shape = draw(st.sampled_from([(), (1,)]))
        kw["k_scale"], kw["v_scale"] = torch.full(shape, 0.5), torch.full(shape, 2.0)
    version = draw(st.sampled_from(["v1", "v2", "auto"]))
    if version == "v2":
        kw["exp_sums"], kw["max_logits"], kw["tmp_out"] = legacy.allocate_partials(query, kw["max_seq_len"])
    tensors = LEGACY_TENSORS if version == "v2" else LEGACY_TENSORS[:-3]
    return version, mutate(draw, kw, tensors, LEGACY_SCALARS, ("block_tables", "seq_lens", "k_scale", "v_scale",
                                                              "max_seq_len"))


LEGACY = {"v1": legacy.paged_attention_v1, "v2": legacy.paged_attention_v2, "auto": legacy.paged_attention}


@FUZZ
@given(legacy_calls())
def test_legacy_attention_refuses_cleanly(case):
    version, kw = case
    refused_cleanly(LEGACY[version], kw, LEGACY_TENSORS + LEGACY_SCALARS)


@st.composite
def legacy_write_calls(draw):
    t, h, d = draw(st.integers(0, 5)), draw(st.sampled_from([1, 2])), draw(st.sampled_from([16, 64]))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    kv = draw(st.sampled_from(["auto", "fp8_e4m3", "fp8_e5m2"]))
    storage = dtype if kv == "auto" else draw(st.sampled_from([torch.uint8, NAME_TO_TORCH[kv]]))
    spec = CacheSpec(draw(st.integers(1, 3)), draw(st.sampled_from([8, 16])), h, d, storage, kv, "legacy")
    kc, vc = spec.allocate("cpu")
    key = torch.randn(t, h, d).to(dtype)
    slots = draw(st.lists(st.integers(-1, spec.num_slots + 1), min_size=t, max_size=t))
    kw = dict(key=key, value=key.clone(), key_cache=kc, value_cache=vc, slot_mapping=torch.tensor(slots),
              kv_cache_dtype=kv, validate=draw(st.sampled_from([None, True])))
    if kv != "auto":
        kw["k_scale"], kw["v_scale"] = torch.full((1,), 0.5), torch.full((), 2.0)
    return mutate(draw, kw, WRITE_TENSORS, ("kv_cache_dtype",), ("slot_mapping", "k_scale", "v_scale"))


@FUZZ
@given(legacy_write_calls())
def test_legacy_writer_refuses_cleanly(kw):
    refused_cleanly(legacy.reshape_and_cache, kw, WRITE_TENSORS + ("kv_cache_dtype",))


def test_names_an_argument():
    assert names_an_argument("q is on cpu", ("q",)) and not names_an_argument("seqused_k x", ("q", "k"))
