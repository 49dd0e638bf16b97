"""Several GPUs (issue 21): tensor-parallel heads and context-parallel decode over NCCL, one process
per GPU. Checks, then times CP decode B=1 ctx 131072 against the same call on one GPU.

    torchrun --nproc_per_node=2 perf/multigpu.py [--out perf/results]

  tp: rank r owns Hkv / world KV heads of the cache and their query heads; the all-gathered output
      must equal the single-GPU output bit for bit (same num_splits).
  cp: each request's pages are split by tokens across ranks; each rank returns (out, LSE), the LSEs
      and outputs are all-gathered and merged with pagedattn.merge_attn_states; the result must be
      within 2e-3 relative L2 of the single-GPU output.
Every rank builds the same cache (same seed) and computes the single-GPU result itself. With one
process (world size 1) it runs as a smoke test of the code path. Rank 0 writes
perf/results/multigpu_<gpu>_<date>_x<world>_<commit>.json."""
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
    q = torch.randn(B, HQ, D, dtype=torch.bfloat16, device=device)
    return q, kc, vc, table


def call(q, kc, vc, table, used, max_k, **kw):
    B = q.shape[0]
    cu = torch.arange(B + 1, dtype=torch.int32, device=q.device)
    return pagedattn.flash_attn_varlen_func(q, kc, vc, 1, cu, max_k, seqused_k=used, block_table=table,
                                            causal=True, **kw)


def cp_shard(table, ctx: int, rank: int, world: int):
    """This rank's pages of each request (whole pages, by token order) and its key count."""
    pages = table.shape[1]
    lo, hi = pages * rank // world, pages * (rank + 1) // world
    used = max(0, min(ctx, hi * BS) - lo * BS)
    return table[:, lo:hi].contiguous(), used


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="perf/results")
    ap.add_argument("--ctx", type=int, default=131072)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    res = {}

    # tensor-parallel heads: B=8 ctx 4096, every rank its heads
    q, kc, vc, table = cache(8, 4096, dev)
    used = torch.full((8,), 4096, dtype=torch.int32, device=dev)
    full = call(q, kc, vc, table, used, 4096, num_splits=2)
    kh = slice(rank * HKV // world, (rank + 1) * HKV // world)
    qh = slice(rank * HQ // world, (rank + 1) * HQ // world)
    mine = call(q[:, qh].contiguous(), kc[:, :, kh].contiguous(), vc[:, :, kh].contiguous(), table, used, 4096,
                num_splits=2)  # this rank's own cache of its heads
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    res["tp_bit_identical"] = bool(torch.equal(torch.cat(gathered, dim=1), full))

    # context-parallel decode: B=1 over args.ctx keys
    q, kc, vc, table = cache(1, args.ctx, dev)
    used_full = torch.tensor([args.ctx], dtype=torch.int32, device=dev)
    full = call(q, kc, vc, table, used_full, args.ctx)
    shard, n = cp_shard(table, args.ctx, rank, world)
    used = torch.tensor([n], dtype=torch.int32, device=dev)

    def cp_step():
        o, lse = call(q, kc, vc, shard, used, max(n, 1), return_softmax_lse=True)
        outs = [torch.empty_like(o) for _ in range(world)]
        lses = [torch.empty_like(lse) for _ in range(world)]
        dist.all_gather(outs, o)
        dist.all_gather(lses, lse)
        return pagedattn.merge_attn_states(outs, lses)
    merged = cp_step()
    err = ((merged.float() - full.float()).norm() / full.float().norm()).item()
    res["cp_rel_l2"] = err
    res["cp_ok"] = err <= 2e-3
    res["cp_us"] = median_us(cp_step, reps=50, before=dist.barrier)
    res["single_gpu_us"] = median_us(lambda: call(q, kc, vc, table, used_full, args.ctx), reps=50,
                                     before=dist.barrier)
    if rank == 0:
        suffix = f"_x{world}_{(git_commit() or 'nocommit')[:7]}"
        write_quick(args.out, "multigpu", res, suffix=suffix, world_size=world, hq=HQ, hkv=HKV, d=D,
                    shapes={"tp": "B=8 ctx 4096", "cp": f"B=1 ctx {args.ctx}"})
        print(json.dumps(res))
    dist.destroy_process_group()
    if not (res["tp_bit_identical"] and res["cp_ok"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
