"""Quick read-path measurements (the full harness is `pagedattn bench`): decode and prefill at the
issue's shapes, our kernel vs cuDNN SDPA on an unpaged copy, plus split-KV sweeps.
Writes <out>/attn_quick_<gpu>_<date>.json."""
from __future__ import annotations

import json
import sys
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

import pagedattn
from pagedattn import CacheSpec
from pagedattn.info import git_commit

from _timing import copy_ceiling_gbs, median_us  # perf/ is on sys.path when run as a script


def decode_case(B, ctx, kv="auto", Hq=32, Hkv=8, D=128, bs=16, q_len=1, layout="NHD", table_order="random"):
    """Inputs of one decode case; table_order "random" (a shuffled table over the whole cache) or
    "seq" (request b owns consecutive pages, in order: the unpaged access pattern)."""
    nb = B * (ctx // bs) + 8
    spec = CacheSpec(nb, bs, Hkv, D, torch.bfloat16 if kv == "auto" else torch.uint8, kv, layout)
    kc, vc = spec.allocate("cuda")
    if kv == "auto":
        kc.normal_(); vc.normal_()
    else:
        kc.view(torch.uint8).random_(0, 0x70); vc.view(torch.uint8).random_(0, 0x70)
    order = torch.randperm(nb, device="cuda") if table_order == "random" else torch.arange(nb, device="cuda")
    table = order[: B * (ctx // bs)].view(B, -1).int()
    q = torch.randn(B * q_len, Hq, D, dtype=torch.bfloat16, device="cuda")
    cu_q = torch.arange(0, (B + 1) * q_len, q_len, dtype=torch.int32, device="cuda")
    seq = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    s = torch.tensor([0.05], device="cuda") if kv != "auto" else None
    return q, kc, vc, table, cu_q, seq, s


def main(out_dir):
    torch.manual_seed(0)
    ceiling = copy_ceiling_gbs()
    rows = []

    def run(name, B, ctx, kv="auto", splits=0, causal=False, q_len=1):
        q, kc, vc, table, cu_q, seq, s = decode_case(B, ctx, kv, q_len=q_len)
        call = lambda: pagedattn.flash_attn_varlen_func(  # noqa: E731
            q, kc, vc, q_len, cu_q, ctx, seqused_k=seq, block_table=table, causal=causal,
            num_splits=splits, kv_cache_dtype=kv, k_descale=s, v_descale=s)
        us = median_us(call)
        kv_bytes = 2 * B * ctx * 8 * 128 * (2 if kv == "auto" else 1)
        flops = 4 * B * 32 * 128 * q_len * ctx * (0.5 if causal and q_len > 1 else 1)
        row = dict(case=name, B=B, ctx=ctx, kv=kv, splits=splits, us=us, kv_gbs=kv_bytes / us / 1e3,
                   frac_copy=kv_bytes / us / 1e3 / ceiling, tflops=flops / us / 1e6)
        if kv == "auto":  # cuDNN SDPA on an unpaged copy of the same KV
            kk = kc[table.long()].reshape(B, ctx, 8, 128).transpose(1, 2)
            vv = vc[table.long()].reshape(B, ctx, 8, 128).transpose(1, 2)
            qq = q.view(B, q_len, 32, 128).transpose(1, 2)
            from torch.nn.attention import SDPBackend, sdpa_kernel
            for be, tag in ((SDPBackend.CUDNN_ATTENTION, "cudnn"), (SDPBackend.FLASH_ATTENTION, "flash")):
                try:
                    with sdpa_kernel([be]):
                        fn = lambda: F.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True, is_causal=causal and q_len > 1)  # noqa: E731
                        row[f"{tag}_us"] = median_us(fn)
                except Exception as exc:  # noqa: BLE001
                    row[f"{tag}_us"] = None
                    row[f"{tag}_error"] = str(exc)[:200]
        rows.append(row)
        print(f"{name:34s} {us:9.1f} us  {row['kv_gbs']:7.0f} GB/s ({row['frac_copy']:.0%})  "
              f"{row['tflops']:6.1f} TF  cudnn {row.get('cudnn_us')}  flash {row.get('flash_us')}", flush=True)

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                commit=git_commit(), date=date.today().isoformat(), copy_ceiling_gbs=ceiling)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"attn_quick_{meta['gpu'].replace(' ', '_').lower()}_{meta['date'].replace('-', '')}.json"

    def save():
        path.write_text(json.dumps(dict(kind="attn_quick", metadata=meta, results=rows), indent=1))

    cases = [("decode B=64 ctx=4096", 64, 4096, "auto", 0, False, 1),
             ("decode B=16 ctx=4096", 16, 4096, "auto", 0, False, 1),
             ("decode B=1 ctx=32768", 1, 32768, "auto", 0, False, 1),
             ("decode fp8 B=64 ctx=4096", 64, 4096, "fp8_e4m3", 0, False, 1),
             ("prefill B=4 S=4096 causal", 4, 4096, "auto", 0, True, 4096)]
    cases += [(f"decode B=16 ctx=4096 splits={sp}", 16, 4096, "auto", sp, False, 1) for sp in (1, 2, 4, 8)]
    cases += [(f"decode B=1 ctx=32768 splits={sp}", 1, 32768, "auto", sp, False, 1) for sp in (8, 16, 32, 64)]
    for name, B, ctx, kv, splits, causal, q_len in cases:
        try:
            run(name, B, ctx, kv, splits, causal, q_len)
        except Exception as exc:  # noqa: BLE001  (one failing case must not hide the others)
            rows.append(dict(case=name, error=str(exc)[:300]))
            print(f"{name}: FAILED {exc}", flush=True)
        save()
    print(f"copy ceiling {ceiling:.0f} GB/s; wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "perf/results")
