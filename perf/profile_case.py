"""One attention case (or, with kind write_<NHD|HND>_<auto|fp8_e4m3>, one cache write), launched a few
times, for `ncu` (perf/h200.sh stage `ncu`). Kind decode_cudnn runs the peer instead: torch SDPA's cuDNN
backend on an unpaged copy of the decode case (NCU_KERNELS=sdpa|fprop|fmha)."""
import sys

import torch

import pagedattn
from pagedattn import CacheSpec

# kind: (B, ctx, q_len, causal, kv cache dtype, num_splits)
KINDS = {"decode": (64, 4096, 1, False, "auto", 1), "decode_fp8": (64, 4096, 1, False, "fp8_e4m3", 1),
         "b1": (1, 32768, 1, False, "auto", 0), "prefill": (4, 4096, 4096, True, "auto", 1)}
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
B, ctx, q_len, causal, kv, splits = KINDS[kind.removesuffix("_cudnn")]
nb = B * ctx // 16
fp8 = kv != "auto"
kc, vc = CacheSpec(nb + 8, 16, 8, 128, torch.uint8 if fp8 else torch.bfloat16, kv).allocate("cuda")
if fp8:
    kc.random_(0, 0x70)
    vc.random_(0, 0x70)
else:
    kc.normal_()
    vc.normal_()
s = torch.tensor([0.05], device="cuda") if fp8 else None
table = torch.randperm(nb + 8, device="cuda")[:nb].view(B, -1).int()
q = torch.randn(B * q_len, 32, 128, dtype=torch.bfloat16, device="cuda")
cu_q = torch.arange(0, (B + 1) * q_len, q_len, dtype=torch.int32, device="cuda")
seq = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
if peer:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kk = kc[table.long()].reshape(B, ctx, 8, 128).transpose(1, 2)
    vv = vc[table.long()].reshape(B, ctx, 8, 128).transpose(1, 2)
    qq = q.view(B, q_len, 32, 128).transpose(1, 2)
    torch.cuda.synchronize()
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        for _ in range(4):
            torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True, is_causal=causal and q_len > 1)
    torch.cuda.synchronize()
    sys.exit(0)
for _ in range(4):
    pagedattn.flash_attn_varlen_func(q, kc, vc, q_len, cu_q, ctx, seqused_k=seq, block_table=table,
                                     causal=causal, num_splits=splits, kv_cache_dtype=kv, k_descale=s,
                                     v_descale=s)
torch.cuda.synchronize()
