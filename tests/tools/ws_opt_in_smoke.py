"""prefill_ws's opt-in tile fields on a few small cases, each (fields, case) pair in a process of its own
under a time limit, so that a kernel that hangs is reported as such and the others still run: the first
thing a device call runs after these fields change (perf/h200.sh stage wssmoke). Prints one line per
pair and a JSON summary (--out DIR writes it as ws_opt_in_smoke.json); exit status 1 if any pair failed
or hung.

A pair passes when the output is finite, within the bf16 tolerance of a float64 reference read through
the block table, bit-identical on a rerun, and the LSE matches."""
import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

FIELDS = {
    "defaults": {},
    "lagging": {"kLazyMax": 3},
    "feed": {"kWsQFeed": True},
    "feed_bulk": {"kWsQFeed": True, "kWsOBulk": True},
    "bulk": {"kWsOBulk": True},
    "chain": {"kWsQFeed": 2},
    "all": {"kWsQFeed": 2, "kWsOBulk": True, "kLazyMax": 3},
    "pair": {"kWsPair": True},
    "pair_feed": {"kWsPair": True, "kWsQFeed": True, "kWsOBulk": True, "kLazyMax": 3},
    "pair_all": {"kWsPair": True, "kWsQFeed": 2, "kWsOBulk": True, "kLazyMax": 3},
}
# (head dim, cache dtype, causal, splits); lengths are ragged, with a request of no keys and more row
# tiles than SMs in "many_items"; "d96_narrow" and "d80_narrow": head dims compiled as such (forced
# narrow: 32- and 16-column panels, the 64- and 32-byte swizzles), where the dispatch runs them on the
# 128 tile
CASES = {
    "d128": (128, "auto", True, 1),
    "d128_split3": (128, "auto", True, 3),
    "d64": (64, "auto", False, 1),
    "d256": (256, "auto", True, 1),
    "fp8": (128, "fp8_e4m3", True, 1),
    "many_items": (128, "auto", True, 1),
    "d96_narrow": (96, "auto", True, 1),
    "d80_narrow": (80, "auto", True, 1),
}


def run_one(fields: str, case: str) -> dict:
    import torch

    from pagedattn import CacheSpec, reference
    from pagedattn.ops import attention as attention_ops
    from pagedattn.ops.attention import flash_attn_varlen_func

    D, kv, causal, splits = CASES[case]
    gen = torch.Generator().manual_seed(7)
    Hq, Hkv, bs = 16, 4, 16
    lens = [700, 0, 130, 1029] if case != "many_items" else [2048, 37, 0, 4000, 999, 3000, 1]
    nb = [-(-n // bs) + 1 for n in lens]
    fp8 = kv != "auto"
    spec = CacheSpec(sum(nb) + 5, bs, Hkv, D, torch.uint8 if fp8 else torch.bfloat16, kv)
    kc, vc = spec.allocate("cuda", fill=float("nan"))
    for cache in (kc, vc):
        values = torch.randn(cache.shape, generator=gen)
        cache.copy_(values.to(torch.float8_e4m3fn).view(torch.uint8) if fp8 else values.bfloat16())
    # each request's pages shuffled over the cache; the table's unused entries are page 0
    pages = torch.randperm(spec.num_blocks, generator=gen)[:sum(nb)].split(nb)
    table = torch.nn.utils.rnn.pad_sequence(list(pages), batch_first=True).to(torch.int32).cuda()
    cu_q = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(int(cu_q[-1]), Hq, D, generator=gen).bfloat16().cuda()
    scale = dict(k_descale=torch.ones(1, device="cuda"), v_descale=torch.ones(1, device="cuda")) if fp8 else {}
    kw = dict(seqused_k=seq, block_table=table, causal=causal, num_splits=splits, return_softmax_lse=True,
              kv_cache_dtype=kv, **scale)
    with attention_ops.forced(prefill="prefill_ws", tiles={"prefill_ws": FIELDS[fields]},
                              narrow=case.endswith("_narrow")):
        out, lse = flash_attn_varlen_func(q, kc, vc, max(lens), cu_q, max(lens), **kw)
        again, lse_again = flash_attn_varlen_func(q, kc, vc, max(lens), cu_q, max(lens), **kw)
    torch.cuda.synchronize()
    ref, ref_lse = reference.paged_attention(q, kc, vc, cu_q, seq, table, causal=causal, kv_cache_dtype=kv,
                                             return_lse=True, compute_dtype=torch.float64, **scale)
    err = float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))
    finite = torch.isfinite(ref_lse)
    lse_err = float((lse[finite].double() - ref_lse[finite]).abs().max()) if finite.any() else 0.0
    same = torch.equal(out.view(torch.int16), again.view(torch.int16)) and torch.equal(lse, lse_again)
    ok = bool(torch.isfinite(out).all()) and err < 1e-2 and lse_err < 2e-2 and same
    return dict(ok=ok, rel_l2=err, lse_err=lse_err, bit_identical=same)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--one", nargs=2, metavar=("FIELDS", "CASE"), help=argparse.SUPPRESS)
    ap.add_argument("--fields", default="defaults,lagging,feed,bulk,chain,all,pair,pair_feed,pair_all",
                    help=f"comma-separated names of FIELDS ({', '.join(FIELDS)})")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated names of CASES")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per pair (compiling included)")
    ap.add_argument("--jobs", type=int, default=8, help="pairs at once")
    ap.add_argument("--out", help="directory for ws_opt_in_smoke.json")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(*args.one)))
        return 0
    def pair(fields: str, case: str) -> dict:
        t0 = time.time()
        try:
            res = subprocess.run([sys.executable, __file__, "--one", fields, case], capture_output=True, text=True,
                                 timeout=args.timeout)
            if res.returncode == 0:
                row = json.loads(res.stdout.strip().splitlines()[-1])
            else:
                row = dict(ok=False, error=(res.stderr or res.stdout).strip().splitlines()[-1:])
        except subprocess.TimeoutExpired:
            row = dict(ok=False, error=f"timed out after {args.timeout:.0f} s (a hang?)")
        row.update(fields=fields, case=case, seconds=round(time.time() - t0, 1))
        print(f"{'ok  ' if row['ok'] else 'FAIL'} {fields:10s} {case:12s} {row['seconds']:6.1f} s "
              f"{ {k: v for k, v in row.items() if k not in ('ok', 'fields', 'case', 'seconds')} }", flush=True)
        return row

    pairs = [(f, c) for f in args.fields.split(",") for c in args.cases.split(",")]
    with ThreadPoolExecutor(args.jobs) as pool:  # processes compile their kernels at once (one disk cache)
        rows = list(pool.map(lambda fc: pair(*fc), pairs))
    bad = sum(not row["ok"] for row in rows)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ws_opt_in_smoke.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print(f"{len(rows) - bad} of {len(rows)} passed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
