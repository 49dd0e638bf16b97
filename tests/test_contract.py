"""CacheSpec: allocation, inference from tensors, and clear rejections."""
import pytest
import torch

from pagedattn import CacheSpec, ContractError


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype,kv", [(torch.bfloat16, "auto"), (torch.float16, "auto"),
                                      (torch.float32, "auto"), (torch.uint8, "fp8_e4m3"),
                                      (torch.float8_e5m2, "fp8_e5m2")])
def test_allocate_round_trip(layout, dtype, kv):
    spec = CacheSpec(7, 16, 4, 64, dtype, kv, layout)
    k, v = spec.allocate("cpu")
    assert tuple(k.shape) == (7, 16, 4, 64) and k.stride() == spec.strides()
    assert CacheSpec.from_tensors(k, v, kv_cache_dtype=kv) == spec
    if layout == "HND":
        assert k.permute(0, 2, 1, 3).is_contiguous()
    else:
        assert k.is_contiguous()


def test_fp8_alias_and_float8_inference():
    spec = CacheSpec(2, 16, 2, 64, torch.uint8, "fp8")
    assert spec.kv_cache_dtype == "fp8_e4m3"
    k, v = CacheSpec(2, 16, 2, 64, torch.float8_e4m3fn, "fp8_e4m3").allocate("cpu")
    assert CacheSpec.from_tensors(k, v).kv_cache_dtype == "fp8_e4m3"


def _pair(shape=(4, 16, 2, 64), dtype=torch.float16):
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


REJECT = {
    "3-D cache": lambda: (torch.zeros(4, 16, 128), torch.zeros(4, 16, 128)),
    "K/V shape differ": lambda: (torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 32)),
    "K/V dtype differ": lambda: (torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64, dtype=torch.float16)),
    "K/V strides differ": lambda: (torch.zeros(4, 16, 2, 64),
                                   torch.zeros(4, 2, 16, 64).permute(0, 2, 1, 3)),
    "head dim not contiguous": lambda: (torch.zeros(4, 16, 64, 2).transpose(2, 3),) * 2,
    "strides neither NHD nor HND": lambda: (torch.zeros(16, 4, 2, 64).transpose(0, 1),) * 2,
    "unaligned base": lambda: (torch.zeros(4 * 16 * 2 * 64 + 1)[1:].view(4, 16, 2, 64),) * 2,
    "not a tensor": lambda: ([[1.0]], torch.zeros(1)),
    "unknown dtype": lambda: (torch.zeros(4, 16, 2, 64, dtype=torch.int16),) * 2,
    "fp8 kv dtype on a bf16 cache": lambda: _pair(dtype=torch.bfloat16) + ("fp8_e4m3",),
    "uint8 cache with auto": lambda: _pair(dtype=torch.uint8),
    "unknown kv_cache_dtype": lambda: _pair() + ("int4",),
    "padded block stride": lambda: (torch.zeros(4, 17, 2, 64)[:, :16],) * 2,
    "empty dim": lambda: (torch.zeros(0, 16, 2, 64),) * 2,
    "kv_cache_dtype not a string": lambda: _pair() + (8,),
}


@pytest.mark.parametrize("case", sorted(REJECT))
def test_from_tensors_rejects(case):
    args = REJECT[case]()
    k, v = args[0], args[1]
    kv = args[2] if len(args) > 2 else "auto"
    with pytest.raises(ContractError) as info:
        CacheSpec.from_tensors(k, v, kv_cache_dtype=kv)
    assert "key_cache" in str(info.value) or "kv_cache_dtype" in str(info.value)  # names the argument


@pytest.mark.parametrize("kwargs,field", [
    (dict(layout="NDH"), "layout"), (dict(scale="channel"), "scale"), (dict(block_size=0), "block_size"),
])
def test_spec_fields_validated(kwargs, field):
    base = dict(num_blocks=2, block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    base.update(kwargs)
    with pytest.raises(ContractError, match=field):
        CacheSpec(**base)


def test_check_tensors_names_the_difference():
    spec = CacheSpec(4, 16, 2, 64, torch.float16, layout="NHD")
    k, v = CacheSpec(4, 16, 2, 64, torch.float16, layout="HND").allocate("cpu")
    with pytest.raises(ContractError, match="layout"):
        spec.check_tensors(k, v)


def test_plan_cache_is_bounded_and_shared_by_every_op():
    from pagedattn.ops import attention, kv_write, legacy_attention
    from pagedattn.ops.plans import PlanCache

    cache = PlanCache(limit=3)
    for i in range(3):
        cache.remember(i, f"plan {i}")
    assert len(cache) == 3
    cache.remember(3, "plan 3")          # full: forgets everything, keeps the newest
    assert dict(cache) == {3: "plan 3"}
    assert cache.remember(None, "x") == "x" and None not in cache   # no key: not cached
    for op in (attention, kv_write, legacy_attention):
        assert isinstance(op._PLANS, PlanCache) and op._PLANS.limit == 256
