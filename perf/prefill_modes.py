"""SM80 prefill against the sm_90a warpgroup-MMA prefill (prefill_wgmma) per head dim, on the issue's
prefill shape otherwise (B=4, S=4096, causal, Hq=32, Hkv=8, block 16, bf16, shuffled table): the
dispatch picks prefill_wgmma for every head dim that is a multiple of 64, so this shows where it wins.
Each point is checked against the float32 reference on a short batch first.
Usage: python perf/prefill_modes.py OUT_DIR     (writes prefill_modes_<gpu>_<date>.json)
"""
from __future__ import annotations

import json
import sys
from datetime import date
from pathlib import Path

import torch

import pagedattn
from pagedattn import CacheSpec, reference
from pagedattn.bench.timing import Timer
from pagedattn.info import git_commit
from pagedattn.ops import attention

B, S, HQ, HKV, BS = 4, 4096, 32, 8, 16


def measure(D: int, wgmma: bool) -> dict:
    attention._PLANS.clear()
    use = attention.wgmma_ok
    attention.wgmma_ok = (lambda call, arch, head_dim: use(call, arch, head_dim)) if wgmma else \
        (lambda call, arch, head_dim: False)
    try:
        torch.manual_seed(D)
        nb = B * S // BS + 8
        kc, vc = CacheSpec(nb, BS, HKV, D, torch.bfloat16).allocate("cuda")
        kc.normal_()
        vc.normal_()
        table = torch.randperm(nb, device="cuda")[: B * S // BS].view(B, -1).int()
        lens = [300, 517]
        qs = torch.randn(sum(lens), HQ, D, dtype=torch.bfloat16, device="cuda")
        cu_s = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device="cuda")
        seq_s = torch.tensor(lens, dtype=torch.int32, device="cuda")
        got = pagedattn.flash_attn_varlen_func(qs, kc, vc, max(lens), cu_s, max(lens), seqused_k=seq_s,
                                               block_table=table[:2], causal=True)
        ref = reference.paged_attention(qs, kc, vc, cu_s, seq_s, table[:2], causal=True)
        err = float((got.float() - ref).norm() / ref.norm())
        q = torch.randn(B * S, HQ, D, dtype=torch.bfloat16, device="cuda")
        cu_q = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device="cuda")
        seq = torch.full((B,), S, dtype=torch.int32, device="cuda")
        fn = lambda k: pagedattn.flash_attn_varlen_func(  # noqa: E731
            q, kc, vc, S, cu_q, S, seqused_k=seq, block_table=table, causal=True)
        us = Timer(budget_s=0.2)(fn).us
        mode = next(iter(attention._PLANS.values())).prefill_mode
        return dict(head_dim=D, mode=mode, us=us, tflops=4 * B * HQ * D * S * S / 2 / us / 1e6, rel_l2_err=err)
    finally:
        attention.wgmma_ok = use


def main(out_dir: str):
    rows = []
    for D in (64, 128, 192, 256):
        for wgmma in (False, True):
            r = measure(D, wgmma)
            rows.append(r)
            print(f"d{D:<4d} {r['mode']:14s} {r['us']:9.1f} us {r['tflops']:6.1f} TFLOP/s err {r['rel_l2_err']:.1e}",
                  flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                commit=git_commit(), date=date.today().isoformat(),
                shape=f"B={B} S={S} causal Hq={HQ} Hkv={HKV} block {BS} NHD, bf16, shuffled table",
                timing="pagedattn.bench.timing.Timer (back-to-back device time)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"prefill_modes_{meta['gpu'].replace(' ', '_').lower()}_{meta['date'].replace('-', '')}.json"
    path.write_text(json.dumps(dict(kind="prefill_modes", metadata=meta, results=rows), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "perf/results")
