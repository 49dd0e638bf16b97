"""Prefill tile sweep for the sm_90a warpgroup-MMA kernel (mode prefill_wgmma) on the issue's prefill
shape: B=4, S=4096, causal, Hq=32, Hkv=8, D=128, block 16, bf16, shuffled block table.

Each configuration runs in its own process (a kernel's tiles are fixed once it is built); the child
patches `tile_config` for prefill_wgmma and measures with prefill_modes.measure (reference check, then
the bench's Timer).
Usage: python perf/prefill_sweep.py OUT_DIR [config ...]       config = kBlockM,kBlockN,kWarpsM,kStages
       python perf/prefill_sweep.py --precompile ROOT config ...  (no GPU needed: build each config's
       kernel into ROOT/cfg_*; PREFILL_SWEEP_AOT=ROOT makes the children load them)
Writes <OUT_DIR>/prefill_sweep_<gpu>_<date>.json.
"""
from __future__ import annotations

import json

from _sweep import aot_dir, cli, run_children, use_aot, write_results  # perf/ is on sys.path as a script

B, S, HQ, HKV, D, BS = 4, 4096, 32, 8, 128, 16
DEFAULT_CONFIGS = ["default", "256,64,16,3", "192,128,12,2", "128,128,8,2"]


def _patch(config: str) -> None:
    if config == "default":
        return
    from pagedattn.ops import attention

    bm, bn, wm, st = (int(x) for x in config.split(","))
    base = attention.tile_config

    def patched(head_dim, mode, fp8=False, arch="sm_90a"):
        cfg = base(head_dim, mode, fp8, arch)
        if mode == "prefill_wgmma":
            cfg.update(kBlockM=bm, kBlockN=bn, kWarpsM=wm, kStages=st)
        return cfg

    attention.tile_config = patched


def precompile_child(root: str, config: str):
    from pagedattn import aot
    from pagedattn.ops.attention import AttnFwdSpec

    _patch(config)
    summary = aot.precompile(aot.plan([AttnFwdSpec("bf16", "auto", D, "prefill_wgmma")], ["sm_90a"]),
                             aot_dir(root, config), n_jobs=1, progress=False)
    print(config, summary.compiled, "compiled", len(summary.failed), "failed", flush=True)


def child(config: str):
    use_aot("PREFILL_SWEEP_AOT", config)
    from prefill_modes import measure  # checks against the reference first, then times

    _patch(config)
    try:
        row = dict(config=config, **measure(D, wgmma=True))
    except Exception as exc:  # noqa: BLE001
        row = dict(config=config, error=str(exc)[:300])
    print("ROW " + json.dumps(row), flush=True)


def main(out_dir: str, configs: list[str]):
    rows = run_children(__file__, configs,
                        lambda r: f"{r['us']:9.1f} us {r['tflops']:6.1f} TFLOP/s err {r['rel_l2_err']:.1e}")
    write_results(out_dir, "prefill_sweep", rows,
                  shape=f"B={B} S={S} causal Hq={HQ} Hkv={HKV} D={D} block {BS} NHD, bf16, shuffled table",
                  config_format="kBlockM,kBlockN,kWarpsM,kStages (mode prefill_wgmma)")


if __name__ == "__main__":
    cli(__file__, main, child, precompile_child, DEFAULT_CONFIGS)
