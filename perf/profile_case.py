"""One attention case (or, kind write_<NHD|HND>_<auto|fp8_e4m3>[_head], the write suite's T=65536 cache write,
random slots) launched a few times, for `ncu` (perf/h200.sh stages ncu, ncusrc). Kind <kind>_cudnn runs a peer
instead: torch SDPA's cuDNN backend on an unpaged copy of the case (NCU_KERNELS=sdpa|fprop|fmha); <kind>_fa4
FlashAttention-4 on the same paged cache, num_splits=1 (its best there; NCU_KERNELS=kernel_cutlass)."""
import contextlib
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from pagedattn.bench import attention, peers, write
from pagedattn.bench.common import Ctx

# kind: (B, ctx, q_len, kv cache dtype, num_splits, head dim, the op's feature arguments); all causal, as in the bench
KINDS = {"decode": (64, 4096, 1, "auto", 1, 128, {}), "decode_fp8": (64, 4096, 1, "fp8_e4m3", 1, 128, {}),
         "b1": (1, 32768, 1, "auto", 0, 128, {}), "prefill": (4, 4096, 4096, "auto", 1, 128, {}),
         "prefill_fp8": (4, 4096, 4096, "fp8_e4m3", 1, 128, {}), "decode_d512": (16, 4096, 1, "auto", 0, 512, {}),
         "prefill_softcap": (4, 4096, 4096, "auto", 1, 128, {"softcap": 30.0})}
kind = sys.argv[1] if len(sys.argv) > 1 else "decode"
peer = kind.rsplit("_", 1)[-1] if kind.endswith(("_cudnn", "_fa4")) else None
if kind.startswith("write"):
    _, layout, kv = kind.split("_", 2)
    p = dict(T=65536, layout=layout, kv_cache_dtype=kv.removesuffix("_head"),
             scale="head" if kv.endswith("_head") else "tensor")
    fn = write.ours_fn(write.inputs(Ctx.make("cuda", quick=True), p))
else:
    B, ctx, q_len, kv, splits, d, features = KINDS[kind.removesuffix(f"_{peer}") if peer else kind]
    data = attention.build(Ctx(torch.device("cuda")), dict(B=B, q_len=q_len, ctx=ctx, hq=32, hkv=8, d=d, bs=16,
                                                           kv_cache_dtype=kv), sets=1)  # shuffled table
    fn = attention.ours_fn(data, splits, **features)
    if peer == "fa4":
        fn = dict(peers.fa4_candidates(data))["paged, num_splits=1"]()
    elif peer == "cudnn":
        kk, vv = data.contiguous_kv(0)
        qq = data.q[0].view(B, q_len, 32, d).transpose(1, 2)
        fn = lambda k: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            qq, kk, vv, enable_gqa=True, is_causal=q_len > 1)
torch.cuda.synchronize()
with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]) if peer == "cudnn" else contextlib.nullcontext():
    for _ in range(4):
        fn(0)
torch.cuda.synchronize()
