"""Several GPUs (issue 21): tensor-parallel heads and context-parallel decode over NCCL, one process per GPU.

    torchrun --nproc_per_node=2 perf/multigpu.py [--out perf/results] [--ctx 131072]

tp: rank r owns Hkv / world KV heads and their query heads (B=8 ctx 4096): the all-gathered output equals one
    GPU's bit for bit (same num_splits). cp: a B=1 request's pages over --ctx keys split by tokens across ranks,
    each rank's (out, LSE) gathered and merged by pagedattn.merge_attn_states: within 4e-3 relative L2 of one
    GPU's output (bf16 rounding: below); timed (each call synchronised, host time in) against one GPU's call.
Every rank builds the same cache (same seed) and computes the single-GPU result itself; world size 1 is a smoke
test. Rank 0 writes perf/results/multigpu_<gpu>_<date>_x<world>_<commit>.json."""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

import pagedattn
from pagedattn.bench.meta import write_quick
from pagedattn.bench.timing import median_us
from pagedattn.info import git_commit

HQ, HKV, D, BS = 32, 8, 128, 16


def cache(B: int, ctx: int, device):
    torch.manual_seed(0)
    pages = -(-ctx // BS)
    kc = torch.randn(B * pages + 1, BS, HKV, D, dtype=torch.bfloat16, device=device)
    vc = torch.randn_like(kc)
    table = torch.randperm(B * pages + 1, device=device)[:B * pages].view(B, pages).int()
    return torch.randn(B, HQ, D, dtype=torch.bfloat16, device=device), kc, vc, table


def call(q, kc, vc, table, used, max_k, **kw):
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return pagedattn.flash_attn_varlen_func(q, kc, vc, 1, cu, max_k, seqused_k=used, block_table=table, causal=True,
                                            **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="perf/results")
    ap.add_argument("--ctx", type=int, default=131072)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    res = {}  # tp: every rank its own cache of its heads
    q, kc, vc, table = cache(8, 4096, dev)
    used = torch.full((8,), 4096, dtype=torch.int32, device=dev)
    full = call(q, kc, vc, table, used, 4096, num_splits=2)
    kh, qh = (slice(rank * h // world, (rank + 1) * h // world) for h in (HKV, HQ))
    mine = call(q[:, qh].contiguous(), kc[:, :, kh].contiguous(), vc[:, :, kh].contiguous(), table, used, 4096,
                num_splits=2)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    res["tp_bit_identical"] = bool(torch.equal(torch.cat(gathered, dim=1), full))
    # cp: this rank's pages of the request (whole pages, by token order) and its key count
    q, kc, vc, table = cache(1, args.ctx, dev)
    used_full = torch.tensor([args.ctx], dtype=torch.int32, device=dev)
    full = call(q, kc, vc, table, used_full, args.ctx)
    lo, hi = table.shape[1] * rank // world, table.shape[1] * (rank + 1) // world
    n = max(0, min(args.ctx, hi * BS) - lo * BS)
    shard, used = table[:, lo:hi].contiguous(), torch.tensor([n], dtype=torch.int32, device=dev)

    def cp_step():
        o, lse = call(q, kc, vc, shard, used, max(n, 1), return_softmax_lse=True)
        outs, lses = [torch.empty_like(o) for _ in range(world)], [torch.empty_like(lse) for _ in range(world)]
        dist.all_gather(outs, o)
        dist.all_gather(lses, lse)
        return pagedattn.merge_attn_states(outs, lses)
    err = ((cp_step().float() - full.float()).norm() / full.float().norm()).item()
    # 4e-3: three bf16 roundings (each rank's output, the merge's, one GPU's) put exact parts 2.85e-3 apart here
    timed = dict(cp_us=cp_step, cp_attention_us=lambda: call(q, kc, vc, shard, used, max(n, 1)),
                 single_gpu_us=lambda: call(q, kc, vc, table, used_full, args.ctx))
    res.update(cp_rel_l2=err, cp_ok=err <= 4e-3, **{k: median_us(f, reps=50, before=dist.barrier)
                                                    for k, f in timed.items()})
    if rank == 0:
        write_quick(args.out, "multigpu", res, suffix=f"_x{world}_{(git_commit() or 'nocommit')[:7]}",
                    world_size=world, hq=HQ, hkv=HKV, d=D, shapes={"tp": "B=8 ctx 4096", "cp": f"B=1 ctx {args.ctx}"})
        print(json.dumps(res))
    dist.destroy_process_group()
    if not (res["tp_bit_identical"] and res["cp_ok"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
