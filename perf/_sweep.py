"""What the configuration sweeps (decode_sweep.py, prefill_sweep.py) share: one child process per
configuration (a kernel's tiles are fixed once it is built), kernels precompiled off the GPU into an
AOT directory per configuration, and the results file.

A sweep script calls `cli(__file__, main, child, precompile_child, defaults)`; its child prints one
`ROW <json>` line per measurement, which `run_children` collects.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import date
from pathlib import Path


def aot_dir(root: str, config: str) -> Path:
    """Where --precompile puts the kernels of one configuration."""
    return Path(root) / ("cfg_" + config.replace(",", "_"))


def use_aot(env_var: str, config: str) -> None:
    """In a child: load this configuration's precompiled kernels when `env_var` names their root."""
    root = os.environ.get(env_var)
    if root and aot_dir(root, config).is_dir():
        os.environ["PAGEDATTN_AOT_DIR"] = ":".join(filter(None, [str(aot_dir(root, config)),
                                                                 os.environ.get("PAGEDATTN_AOT_DIR", "")]))


def run_children(script: str, configs: list[str], describe) -> list[dict]:
    """Each configuration in a child process of `script` (`--child CONFIG`); its ROW lines, or one
    row with the error. describe(row) -> the row's line for the log (rows with "us")."""
    rows = []
    for config in configs:
        try:
            proc = subprocess.run([sys.executable, script, "--child", config], capture_output=True, text=True,
                                  timeout=300)
        except subprocess.TimeoutExpired as exc:
            proc = subprocess.CompletedProcess(exc.cmd, -9, exc.stdout or "", "timed out after 300 s")
        got = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
        if proc.returncode or not got:
            got.append(dict(config=config, error=(proc.stderr or proc.stdout)[-600:]))
        for r in got:
            rows.append(r)
            print(f"{config:16s} " + (describe(r) if "us" in r else f"ERROR {r.get('error', '')[-300:]}"), flush=True)
    return rows


def write_results(out_dir: str, kind: str, rows: list[dict], **meta) -> Path:
    """<out_dir>/<kind>_<gpu>_<date>.json with the machine, the commit and `meta`."""
    import torch

    from pagedattn.info import git_commit

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                commit=git_commit(), date=date.today().isoformat(),
                timing="pagedattn.bench.timing.Timer (back-to-back device time)", **meta)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{kind}_{meta['gpu'].replace(' ', '_').lower()}_{meta['date'].replace('-', '')}.json"
    path.write_text(json.dumps(dict(kind=kind, metadata=meta, results=rows), indent=1))
    print(f"wrote {path}")
    return path


def cli(script: str, main, child, precompile_child, defaults: list[str]) -> None:
    """script OUT_DIR [config ...] | --child CONFIG | --precompile ROOT config ... (children build
    each configuration's kernels into aot_dir(ROOT, config); no GPU needed)."""
    argv = sys.argv
    if len(argv) > 2 and argv[1] == "--child":
        child(argv[2])
    elif len(argv) > 2 and argv[1] == "--precompile":
        for cfg in argv[3:]:
            subprocess.run([sys.executable, script, "--precompile-child", argv[2], cfg], check=False)
    elif len(argv) > 2 and argv[1] == "--precompile-child":
        precompile_child(argv[2], argv[3])
    else:
        main(argv[1] if len(argv) > 1 else "perf/results", argv[2:] or defaults)
