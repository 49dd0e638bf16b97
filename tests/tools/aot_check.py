"""Deployment check (issue 5): with PAGEDATTN_DISABLE_JIT=1 and PAGEDATTN_AOT_DIR pointing at a bundle
built on a CPU-only machine, the write and decode paths run and compile nothing."""
import os
import sys

import torch

import pagedattn
from pagedattn import CacheSpec, reference
from pagedattn.codegen.cache import kernel_cache

assert os.environ.get("PAGEDATTN_DISABLE_JIT") == "1" and os.environ.get("PAGEDATTN_AOT_DIR"), \
    "run with PAGEDATTN_DISABLE_JIT=1 and PAGEDATTN_AOT_DIR set"
spec = CacheSpec(256, 16, 8, 128, torch.bfloat16)
kc, vc = spec.allocate("cuda", fill=0.0)
B, ctx = 8, 500
table = torch.randperm(256, device="cuda")[: B * 32].view(B, 32).int()
pos = torch.arange(ctx, device="cuda")
slots = (table[:, pos // 16].long() * 16 + pos % 16).reshape(-1)
key = torch.randn(B * ctx, 8, 128, dtype=torch.bfloat16, device="cuda")
val = torch.randn_like(key)
pagedattn.reshape_and_cache_flash(key, val, kc, vc, slots)
q = torch.randn(B, 32, 128, dtype=torch.bfloat16, device="cuda")
cu_q = torch.arange(B + 1, dtype=torch.int32, device="cuda")
seq = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
out = pagedattn.flash_attn_varlen_func(q, kc, vc, 1, cu_q, ctx, seqused_k=seq, block_table=table)
ref = reference.paged_attention(q, kc, vc, cu_q, seq, table)
err = ((out.float() - ref).norm() / ref.norm()).item()
origins = sorted({a.origin.split(":")[0] for a in kernel_cache()._memory.values()})
print(f"aot check: compiles={kernel_cache().compiles} origins={origins} decode rel err={err:.2e}")
sys.exit(0 if kernel_cache().compiles == 0 and origins == ["aot"] and err < 1e-2 else 1)
