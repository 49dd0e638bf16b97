"""Prefill tile sweep for the sm_90a warpgroup-MMA kernel (mode prefill_wgmma) on the issue's prefill
shape: B=4, S=4096, causal, Hq=32, Hkv=8, D=128, block 16, bf16, shuffled block table.

Each configuration runs in its own process (a kernel's tiles are fixed once it is built); the child
patches `tile_config` for prefill_wgmma, measures with the bench's Timer and prints one JSON line.
Usage: python perf/prefill_sweep.py OUT_DIR [config ...]       config = kBlockM,kBlockN,kWarpsM,kStages
       python perf/prefill_sweep.py --precompile ROOT config ...  (no GPU needed: build each config's
       kernel into ROOT/cfg_*; PREFILL_SWEEP_AOT=ROOT makes the children load them)
Writes <OUT_DIR>/prefill_sweep_<gpu>_<date>.json.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import date
from pathlib import Path

B, S, HQ, HKV, D, BS = 4, 4096, 32, 8, 128, 16
DEFAULT_CONFIGS = ["default", "256,64,16,3", "192,128,12,2", "128,128,8,2"]


def _aot_dir(root: str, config: str) -> Path:
    return Path(root) / ("cfg_" + config.replace(",", "_"))


def _patch(config: str) -> None:
    if config == "default":
        return
    from pagedattn.ops import attention

    bm, bn, wm, st = (int(x) for x in config.split(","))
    base = attention.tile_config

    def patched(head_dim, mode, fp8=False):
        cfg = base(head_dim, mode, fp8)
        if mode == "prefill_wgmma":
            cfg.update(kBlockM=bm, kBlockN=bn, kWarpsM=wm, kStages=st)
        return cfg

    attention.tile_config = patched


def precompile_child(root: str, config: str):
    from pagedattn import aot
    from pagedattn.ops.attention import AttnFwdSpec

    _patch(config)
    summary = aot.precompile(aot.plan([AttnFwdSpec("bf16", "auto", D, "prefill_wgmma")], ["sm_90a"]),
                             _aot_dir(root, config), n_jobs=1, progress=False)
    print(config, summary.compiled, "compiled", len(summary.failed), "failed", flush=True)


def child(config: str):
    root = os.environ.get("PREFILL_SWEEP_AOT")
    if root and _aot_dir(root, config).is_dir():
        os.environ["PAGEDATTN_AOT_DIR"] = ":".join(filter(None, [str(_aot_dir(root, config)),
                                                                 os.environ.get("PAGEDATTN_AOT_DIR", "")]))
    import torch

    import pagedattn
    from pagedattn import CacheSpec
    from pagedattn.bench.timing import Timer

    _patch(config)
    torch.manual_seed(0)
    nb = B * S // BS + 8
    kc, vc = CacheSpec(nb, BS, HKV, D, torch.bfloat16).allocate("cuda")
    kc.normal_()
    vc.normal_()
    table = torch.randperm(nb, device="cuda")[: B * S // BS].view(B, -1).int()
    q = torch.randn(B * S, HQ, D, dtype=torch.bfloat16, device="cuda")
    cu_q = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device="cuda")
    seq = torch.full((B,), S, dtype=torch.int32, device="cuda")
    fn = lambda k: pagedattn.flash_attn_varlen_func(  # noqa: E731
        q, kc, vc, S, cu_q, S, seqused_k=seq, block_table=table, causal=True)
    try:
        # correctness first: two requests of 300 and 517 tokens against the float32 reference
        from pagedattn import reference

        lens = [300, 517]
        qs = torch.randn(sum(lens), HQ, D, dtype=torch.bfloat16, device="cuda")
        cu_s = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device="cuda")
        seq_s = torch.tensor(lens, dtype=torch.int32, device="cuda")
        got = pagedattn.flash_attn_varlen_func(qs, kc, vc, max(lens), cu_s, max(lens), seqused_k=seq_s,
                                               block_table=table[:2], causal=True)
        ref = reference.paged_attention(qs, kc, vc, cu_s, seq_s, table[:2], causal=True,
                                        compute_dtype=torch.float32)
        err = float((got.float() - ref.float()).norm() / ref.float().norm())
        us = Timer(budget_s=0.3)(fn).us
        flops = 4 * B * HQ * D * S * S / 2
        row = dict(config=config, us=us, tflops=flops / us / 1e6, rel_l2_err=err)
    except Exception as exc:  # noqa: BLE001
        row = dict(config=config, error=str(exc)[:300])
    print("ROW " + json.dumps(row), flush=True)


def main(out_dir: str, configs: list[str]):
    import torch

    from pagedattn.info import git_commit

    rows = []
    for config in configs:
        try:
            proc = subprocess.run([sys.executable, __file__, "--child", config], capture_output=True, text=True,
                                  timeout=300)
        except subprocess.TimeoutExpired as exc:
            proc = subprocess.CompletedProcess(exc.cmd, -9, exc.stdout or "", "timed out after 300 s")
        got = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
        if proc.returncode or not got:
            got.append(dict(config=config, error=(proc.stderr or proc.stdout)[-600:]))
        for r in got:
            rows.append(r)
            print(f"{config:16s} " + (f"{r['us']:9.1f} us {r['tflops']:6.1f} TFLOP/s err {r['rel_l2_err']:.1e}" if "us" in r
                                      else f"ERROR {r.get('error', '')[-300:]}"), flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                commit=git_commit(), date=date.today().isoformat(),
                shape=f"B={B} S={S} causal Hq={HQ} Hkv={HKV} D={D} block {BS} NHD, bf16, shuffled table",
                timing="pagedattn.bench.timing.Timer (back-to-back device time)",
                config_format="kBlockM,kBlockN,kWarpsM,kStages (mode prefill_wgmma)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"prefill_sweep_{meta['gpu'].replace(' ', '_').lower()}_{meta['date'].replace('-', '')}.json"
    path.write_text(json.dumps(dict(kind="prefill_sweep", metadata=meta, results=rows), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2])
    elif len(sys.argv) > 2 and sys.argv[1] == "--precompile":
        for cfg in sys.argv[3:]:
            subprocess.run([sys.executable, __file__, "--precompile-child", sys.argv[2], cfg], check=False)
    elif len(sys.argv) > 2 and sys.argv[1] == "--precompile-child":
        precompile_child(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "perf/results", sys.argv[2:] or DEFAULT_CONFIGS)
