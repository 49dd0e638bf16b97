"""One attention case (or, with kind write_<NHD|HND>_<auto|fp8_e4m3>, one cache write), launched a few
times, for `ncu` (perf/h200.sh stage `ncu`). Kind decode_cudnn runs the peer instead: torch SDPA's cuDNN
backend on an unpaged copy of the decode case (NCU_KERNELS=sdpa|fprop|fmha)."""
import contextlib
import sys

import torch

import pagedattn
from pagedattn import CacheSpec
from pagedattn.bench.sweeps import ours, paged

# kind: (B, ctx, q_len, causal, kv cache dtype, num_splits, head dim)
KINDS = {"decode": (64, 4096, 1, False, "auto", 1, 128), "decode_fp8": (64, 4096, 1, False, "fp8_e4m3", 1, 128),
         "b1": (1, 32768, 1, False, "auto", 0, 128), "prefill": (4, 4096, 4096, True, "auto", 1, 128),
         "prefill_fp8": (4, 4096, 4096, True, "fp8_e4m3", 1, 128), "decode_d512": (16, 4096, 1, False, "auto", 0, 512),
         "prefill_softcap": (4, 4096, 4096, True, "auto", 1, 128)}
FEATURES = {"prefill_softcap": dict(softcap=30.0)}  # the op's feature arguments of a kind
kind = sys.argv[1] if len(sys.argv) > 1 else "decode"
if kind.startswith("write"):  # write_<layout>_<kv>[_head]: T=65536 H=8 D=128 bf16 input, random slots
    _, layout, kvw = kind.split("_", 2)
    per_head = kvw.endswith("_head")
    kvw = kvw.removesuffix("_head")
    T = 65536
    spec = CacheSpec(4 * T // 16, 16, 8, 128, torch.uint8 if kvw != "auto" else torch.bfloat16, kvw, layout,
                     "head" if per_head else "tensor")
    kc, vc = spec.allocate("cuda")
    k, v = (torch.randn(T, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    slots = torch.randperm(spec.num_slots, device="cuda")[:T]
    s = torch.full((8 if per_head else 1,), 0.05, device="cuda")
    for _ in range(4):
        pagedattn.reshape_and_cache_flash(k, v, kc, vc, slots, kvw, s, s)
    torch.cuda.synchronize()
    sys.exit(0)
peer = kind.endswith("_cudnn")
B, ctx, q_len, causal, kv, splits, d = KINDS[kind.removesuffix("_cudnn")]
data = paged(B, ctx, kv, q_len=q_len, d=d)  # the sweeps' inputs: the bench's paged data, shuffled table
fn = ours(data, splits, **FEATURES.get(kind, {}))
if peer:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kk, vv = data.contiguous_kv(0)
    qq = data.q[0].view(B, q_len, 32, d).transpose(1, 2)
    fn = lambda k: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        qq, kk, vv, enable_gqa=True, is_causal=causal and q_len > 1)
torch.cuda.synchronize()
with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]) if peer else contextlib.nullcontext():
    for _ in range(4):
        fn(0)
torch.cuda.synchronize()
