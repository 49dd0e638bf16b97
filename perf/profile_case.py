"""One attention case, launched a few times, for `ncu` (perf/h200.sh stage `ncu`)."""
import sys

import torch

import pagedattn
from pagedattn import CacheSpec

kind = sys.argv[1] if len(sys.argv) > 1 else "decode"
B, ctx, q_len, causal = (64, 4096, 1, False) if kind == "decode" else (4, 4096, 4096, True)
nb = B * ctx // 16
kc, vc = CacheSpec(nb + 8, 16, 8, 128, torch.bfloat16).allocate("cuda")
kc.normal_()
vc.normal_()
table = torch.randperm(nb + 8, device="cuda")[:nb].view(B, -1).int()
q = torch.randn(B * q_len, 32, 128, dtype=torch.bfloat16, device="cuda")
cu_q = torch.arange(0, (B + 1) * q_len, q_len, dtype=torch.int32, device="cuda")
seq = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
for _ in range(4):
    pagedattn.flash_attn_varlen_func(q, kc, vc, q_len, cu_q, ctx, seqused_k=seq, block_table=table,
                                     causal=causal, num_splits=1)
torch.cuda.synchronize()
