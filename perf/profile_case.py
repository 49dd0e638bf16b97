"""One attention case (or, with kind write_<NHD|HND>_<auto|fp8_e4m3>, one cache write), launched a few
times, for `ncu` (perf/h200.sh stage `ncu`). Kind decode_cudnn runs the peer instead: torch SDPA's cuDNN
backend on an unpaged copy of the decode case (NCU_KERNELS=sdpa|fprop|fmha)."""
import contextlib
import sys

import torch

from pagedattn.bench.attention import build, ours_fn
from pagedattn.bench.common import Ctx

# kind: (B, ctx, q_len, causal, kv cache dtype, num_splits, head dim)
KINDS = {"decode": (64, 4096, 1, False, "auto", 1, 128), "decode_fp8": (64, 4096, 1, False, "fp8_e4m3", 1, 128),
         "b1": (1, 32768, 1, False, "auto", 0, 128), "prefill": (4, 4096, 4096, True, "auto", 1, 128),
         "prefill_fp8": (4, 4096, 4096, True, "fp8_e4m3", 1, 128), "decode_d512": (16, 4096, 1, False, "auto", 0, 512),
         "prefill_softcap": (4, 4096, 4096, True, "auto", 1, 128)}
FEATURES = {"prefill_softcap": dict(softcap=30.0)}  # the op's feature arguments of a kind
kind = sys.argv[1] if len(sys.argv) > 1 else "decode"
if kind.startswith("write"):  # write_<layout>_<kv>[_head]: the write suite's T=65536 case, random slots
    from pagedattn.bench.write import inputs, ours_fn as write_fn

    _, layout, kvw = kind.split("_", 2)
    p = dict(T=65536, layout=layout, kv_cache_dtype=kvw.removesuffix("_head"),
             scale="head" if kvw.endswith("_head") else "tensor")
    write = write_fn(inputs(Ctx.make("cuda", quick=True), p))
    for _ in range(4):
        write(0)
    torch.cuda.synchronize()
    sys.exit(0)
peer = kind.endswith("_cudnn")
B, ctx, q_len, causal, kv, splits, d = KINDS[kind.removesuffix("_cudnn")]
params = dict(B=B, q_len=q_len, ctx=ctx, hq=32, hkv=8, d=d, bs=16, kv_cache_dtype=kv)
data = build(Ctx(torch.device("cuda")), params, sets=1)  # the bench's paged data, shuffled table
fn = ours_fn(data, splits, **FEATURES.get(kind, {}))
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
