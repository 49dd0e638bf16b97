"""Decode tile/loader sweep on the issue's decode shapes (Hq=32, Hkv=8, D=128, block 16, bf16 query).

Timing is the bench's (pagedattn.bench.timing.Timer: device time of calls queued back to back).
Each configuration runs in its own process (a kernel's tiles are fixed once it is built): the parent
passes `--child kWarpsN,kStages,kMinBlocks[,tma|cp[,kBlockN]]`, the child patches `tile_config` for decode
variants, measures, and prints one JSON line. Writes <out>/decode_sweep_<gpu>_<date>.json.
Usage: python perf/decode_sweep.py OUT_DIR [config ...]   (config e.g. 4,3,2,tma, or default)
       python perf/decode_sweep.py --precompile ROOT config ...  (no GPU needed: sm_90a kernels of each
       config into ROOT/cfg_*; DECODE_SWEEP_AOT=ROOT makes the children load them)
Environment: SPLITS=8,16,32 adds forced-split B=1 points; CASES_ONLY="B=1 ctx=32768;B=16 ctx=4096" keeps those;
VARIANTS="HND;seq;splits=2" adds B=64 ctx=4096 bf16 points with the HND layout, a page-ordered table
(request b owns consecutive pages: the unpaged access pattern) or forced splits; TMA_PROMOTION=NONE|L2_64B|
L2_128B|L2_256B sets the tensor maps' L2 promotion (attention.TMA_L2_PROMOTION).
"""
from __future__ import annotations

import json
import os

from _sweep import aot_dir, cli, run_children, use_aot, write_results  # perf/ is on sys.path as a script

# (name, B, ctx, kv cache dtype, num_splits); 0 = the heuristic
CASES = [("B=64 ctx=4096", 64, 4096, "auto", 0), ("B=64 ctx=4096 fp8", 64, 4096, "fp8_e4m3", 0),
         ("B=16 ctx=4096", 16, 4096, "auto", 0), ("B=1 ctx=32768", 1, 32768, "auto", 0),
         ("B=1 ctx=32768 fp8", 1, 32768, "fp8_e4m3", 0)]
# extra B=1 points with forced splits (SPLITS=8,16,32 in the environment)
SPLIT_CASES = [("B=1 ctx=32768 splits={}", 1, 32768, "auto")]
DEFAULT_CONFIGS = ["4,2,3,cp", "4,3,2,tma", "4,4,1,tma", "4,6,1,tma", "2,4,3,tma", "2,6,2,tma",
                   "8,3,1,tma"]


def _cases() -> list:
    """CASES, then the forced-split B=1 points of SPLITS; CASES_ONLY="name;name" keeps those names."""
    cases = list(CASES)
    for n in filter(None, os.environ.get("SPLITS", "").split(",")):
        cases += [(name.format(n), B, ctx, kv, int(n)) for name, B, ctx, kv in SPLIT_CASES]
    for v in filter(None, os.environ.get("VARIANTS", "").split(";")):
        cases.append((f"B=64 ctx=4096 {v}", 64, 4096, "auto", int(v[7:]) if v.startswith("splits=") else 0))
    only = [x for x in os.environ.get("CASES_ONLY", "").split(";") if x]
    return [c for c in cases if not only or c[0] in only or c[0].startswith("B=1 ctx=32768 splits")
            or c[0].startswith("B=64 ctx=4096 ") and c[0][14:] in os.environ.get("VARIANTS", "").split(";")]


def _patch(config: str) -> str:
    """Patch tile_config for decode variants as `config` says; returns the loader ("tma" or "cp")."""
    from pagedattn.ops import attention

    loader = "tma"
    if config != "default":  # "default": tile_config as shipped
        warps, stages, min_blocks, loader, block_n = (config.split(",") + ["tma", "16"][len(config.split(",")) - 3:])[:5]
        base = attention.tile_config

        def patched(head_dim, mode, fp8=False, arch="sm_90a"):
            cfg = base(head_dim, mode, fp8, arch)
            if mode.startswith("decode"):
                cfg.update(kWarpsN=int(warps), kStages=int(stages), kMinBlocks=int(min_blocks), kBlockN=int(block_n))
            return cfg

        attention.tile_config = patched
    if loader == "cp":
        attention.tma_ok = lambda call, arch, head_dim: False
    return loader


def precompile_child(root: str, config: str):
    """Build the sm_90a decode kernels this config's cases need into an AOT bundle of its own
    (on a machine without a GPU: the device then loads them instead of compiling)."""
    from pagedattn import aot
    from pagedattn.ops.attention import AttnFwdSpec

    loader = _patch(config)
    mode = "decode_tma" if loader == "tma" else "decode"
    specs = [AttnFwdSpec("bf16", kv, 128, mode) for kv in sorted({c[3] for c in _cases()})]
    summary = aot.precompile(aot.plan(specs, ["sm_90a"]), aot_dir(root, config), n_jobs=1, progress=False)
    print(config, summary.compiled, "compiled", len(summary.failed), "failed", flush=True)


def child(config: str):
    use_aot("DECODE_SWEEP_AOT", config)  # kernels precompiled for this config (--precompile)
    import torch

    import pagedattn

    from pagedattn.bench.timing import Timer

    from attn_quick import decode_case

    _patch(config)
    if os.environ.get("TMA_PROMOTION"):
        from pagedattn.ops.attention import tma
        tma.TMA_L2_PROMOTION = os.environ["TMA_PROMOTION"]  # tma_maps reads it there
    cases = _cases()
    timer = Timer(budget_s=0.2)  # the bench's method: device time of back-to-back calls
    for name, B, ctx, kv, splits in cases:
        words = name.split()
        q, kc, vc, table, cu_q, seq, s = decode_case(B, ctx, kv, layout="HND" if "HND" in words else "NHD",
                                                     table_order="seq" if "seq" in words else "random")
        fn = lambda k: pagedattn.flash_attn_varlen_func(  # noqa: E731
            q, kc, vc, 1, cu_q, ctx, seqused_k=seq, block_table=table, kv_cache_dtype=kv,
            k_descale=s, v_descale=s, num_splits=splits)
        try:
            us = timer(fn).us
            kv_bytes = 2 * B * ctx * 8 * 128 * (2 if kv == "auto" else 1)
            row = dict(config=config, case=name, us=us, kv_gbs=kv_bytes / us / 1e3)
            if os.environ.get("TMA_PROMOTION"):
                row["tma_promotion"] = os.environ["TMA_PROMOTION"]
        except Exception as exc:  # noqa: BLE001
            row = dict(config=config, case=name, error=str(exc)[:300])
        print("ROW " + json.dumps(row), flush=True)
        del q, kc, vc
        torch.cuda.empty_cache()


def main(out_dir: str, configs: list[str]):
    from _timing import copy_ceiling_gbs

    ceiling = copy_ceiling_gbs()
    rows = run_children(__file__, configs, lambda r: f"{r['case']:20s} {r['us']:8.1f} us {r['kv_gbs']:6.0f} GB/s "
                                                     f"({r['kv_gbs'] / ceiling:.0%})")
    for r in rows:
        if "kv_gbs" in r:
            r["frac_copy"] = r["kv_gbs"] / ceiling
    write_results(out_dir, "decode_sweep", rows, copy_ceiling_gbs=ceiling,
                  shape="Hq=32 Hkv=8 D=128 block 16 NHD, bf16 query, num_splits heuristic unless named",
                  config_format="kWarpsN,kStages,kMinBlocks,loader,kBlockN")
    print(f"copy ceiling {ceiling:.0f} GB/s")


if __name__ == "__main__":
    cli(__file__, main, child, precompile_child, DEFAULT_CONFIGS)
