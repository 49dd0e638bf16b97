"""SM80 prefill against the sm_90a warpgroup-MMA prefill (prefill_wgmma):
- per head dim, on the issue's prefill shape otherwise (B=4, S=4096, causal, Hq=32, Hkv=8, block 16,
  bf16, shuffled table);
- per query length for short queries over a long history (B=32, ctx 4096, q_len 5 ... 64, D=128, e.g.
  speculative-decoding verification): packed rows of 20 ... 256 fill a 256-row wgmma tile only partly.
Each point is checked against the float32 reference on a short batch first.
Usage: python perf/prefill_modes.py OUT_DIR [long|short ...]   (writes prefill_modes_<gpu>_<date>.json)
"""
from __future__ import annotations

import sys

import torch

import pagedattn
from pagedattn import reference
from pagedattn.bench.timing import Timer
from pagedattn.ops import attention

from _sweep import write_results  # perf/ is on sys.path when run as a script
from attn_quick import decode_case

B, S, HQ, HKV, BS = 4, 4096, 32, 8, 16


def measure(D: int, wgmma: bool, batch: int = B, q_len: int = S, ctx: int = S) -> dict:
    """One point with the dispatch's choice (wgmma) or with prefill_wgmma turned off."""
    attention._PLANS.clear()
    use = attention.wgmma_ok
    attention.wgmma_ok = (lambda call, arch, head_dim: use(call, arch, head_dim)) if wgmma else \
        (lambda call, arch, head_dim: False)
    try:
        torch.manual_seed(D)
        q, kc, vc, table, cu_q, seq, _ = decode_case(batch, ctx, Hq=HQ, Hkv=HKV, D=D, bs=BS, q_len=q_len)
        fn = lambda k: pagedattn.flash_attn_varlen_func(  # noqa: E731
            q, kc, vc, q_len, cu_q, ctx, seqused_k=seq, block_table=table, causal=True)
        # correctness first: short queries as timed; long ones on two requests of 300 and 517 tokens
        if q_len <= 64:
            args = (q, cu_q, seq, table)
        else:
            lens = [300, 517]
            args = (torch.randn(sum(lens), HQ, D, dtype=torch.bfloat16, device="cuda"),
                    torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device="cuda"),
                    torch.tensor(lens, dtype=torch.int32, device="cuda"), table[:2])
        qc, cuc, seqc, tc = args
        got = pagedattn.flash_attn_varlen_func(qc, kc, vc, int((cuc[1:] - cuc[:-1]).max()), cuc,
                                               int(seqc.max()), seqused_k=seqc, block_table=tc, causal=True)
        ref = reference.paged_attention(qc, kc, vc, cuc, seqc, tc, causal=True)
        err = float((got.float() - ref).norm() / ref.norm())
        us = Timer(budget_s=0.2)(fn).us
        mode = next(iter(attention._PLANS.values())).prefill_mode
        # causal: query i of q_len sees ctx - q_len + i + 1 keys
        flops = 4 * batch * HQ * D * sum(ctx - q_len + i + 1 for i in range(q_len))
        return dict(head_dim=D, batch=batch, q_len=q_len, ctx=ctx, mode=mode, us=us, tflops=flops / us / 1e6,
                    kv_gbs=2 * batch * ctx * HKV * D * 2 / us / 1e3, rel_l2_err=err)
    finally:
        attention.wgmma_ok = use


def main(out_dir: str, parts: list[str]):
    points = []
    if "long" in parts:
        points += [dict(D=D) for D in (64, 128, 192, 256)]
    if "short" in parts:
        points += [dict(D=128, batch=32, q_len=n, ctx=4096) for n in (5, 8, 16, 32, 64)]
    rows = []
    for pt in points:
        for wgmma in (False, True):
            r = measure(wgmma=wgmma, **pt)
            rows.append(r)
            print(f"d{r['head_dim']:<4d} B={r['batch']:<3d} q_len={r['q_len']:<5d} {r['mode']:14s} {r['us']:9.1f} us "
                  f"{r['tflops']:6.1f} TFLOP/s {r['kv_gbs']:6.0f} GB/s err {r['rel_l2_err']:.1e}", flush=True)
    write_results(out_dir, "prefill_modes", rows,
                  shape=f"causal Hq={HQ} Hkv={HKV} block {BS} NHD, bf16, shuffled table; B, q_len, ctx per row")

if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "perf/results", sys.argv[2:] or ["long", "short"])
