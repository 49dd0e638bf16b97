"""Metadata of a run: GPU, driver, CUDA, torch, pagedattn version and commit, clocks (read, never set);
`write_quick` for the perf/ scripts."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch

import pagedattn
from pagedattn import info

from . import report

SMI_FIELDS = ("driver_version", "pstate", "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem",
              "power.draw", "power.limit", "temperature.gpu")


def _run(cmd: list[str]) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=10.0)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def nvidia_smi(index: int = 0) -> dict | None:
    """CUDA device `index`'s row of nvidia-smi (read only; by UUID, as nvidia-smi's order may differ from
    CUDA's), or None when nvidia-smi is not usable."""
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    which = "GPU-" + str(uuid).removeprefix("GPU-") if uuid else str(index)
    out = _run(["nvidia-smi", f"--id={which}", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"])
    vals = [v.strip() for v in (out or "").strip().split(",")]
    return dict(zip(SMI_FIELDS, vals)) if len(vals) == len(SMI_FIELDS) else None


def clocks() -> dict | None:
    row = nvidia_smi(torch.cuda.current_device()) if torch.cuda.is_available() else None
    return None if row is None else {**{k: row[k] for k in SMI_FIELDS[1:]}, "time": now()}


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def git_dirty() -> bool | None:
    """Whether the checkout has uncommitted changes to tracked files (None for an installed copy)."""
    root = Path(__file__).resolve().parents[2]
    status = _run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"])
    return bool(status.strip()) if status is not None and (root / ".git").exists() else None


def collect(device: str, quick: bool, suites: list[str], overrides: dict | None = None) -> dict:
    """The run's metadata: `pagedattn info`'s versions and GPU, the commit and `git_dirty`, nvidia-smi's
    driver and clocks."""
    about = info.collect()
    meta = {"sample": False, "pagedattn": about["pagedattn"], "git_commit": info.git_commit(),
            "git_dirty": git_dirty(), "date": now(), "quick": quick, "suites": list(suites), "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": about["python"], "argv": ["pagedattn"] + sys.argv[1:],
            "nvrtc": about.get("nvrtc") or f"unavailable ({about.get('toolchain_error')})",
            "driver_cuda": about.get("driver_cuda"), "overrides": overrides or None}
    if device == "cpu":
        return {**meta, "sample": True, "dry_run": True, "gpu": "cpu (dry run, not a measurement)", "sm_count": 0,
                "capability": "-", "arch": "-", "driver": None, "clocks": None}
    idx = torch.cuda.current_device()
    gpu, props = about["gpus"][idx], torch.cuda.get_device_properties(idx)
    row = nvidia_smi(idx)
    return {**meta, "gpu": gpu["name"], "sm_count": gpu["sms"], "capability": gpu["capability"], "arch": gpu["arch"],
            "memory_gib": gpu["memory_gib"], "l2_bytes": int(getattr(props, "L2_cache_size", 0) or 0) or None,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "driver": (row or {}).get("driver_version") or (
                f"CUDA {meta['driver_cuda']} (nvidia-smi unavailable)" if meta["driver_cuda"] else None),
            "clocks": {"start": clocks()} if row else None}


def results_name(meta: dict, folder: Path) -> Path:
    """<gpu>_<sm>_<yyyymmdd>[_<overrides>].json in folder; _2, _3 ... when that name is taken."""
    base = f"{report.gpu_key(meta)}_{meta['date'][:10].replace('-', '')}"
    if meta.get("overrides"):
        base += "_" + re.sub(r"[^A-Za-z0-9=]+", "-", json.dumps(meta["overrides"])).strip("-")[:80]
    path, n = folder / f"{base}.json", 2
    while path.exists():
        path, n = folder / f"{base}_{n}.json", n + 1
    return path


def write_quick(out_dir, kind: str, results, suffix: str = "", gpu: bool = True, **extra) -> Path:
    """<out_dir>/<kind>_<gpu name, or cpu<cores> with gpu=False>_<yyyymmdd><suffix>.json, as the perf/ scripts
    write it: {kind, metadata: this machine (CPU, cores, memory), software, commit, date, with gpu=True the
    GPU, its capability and driver, and `extra`; results}."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), None)
    mem = Path("/proc/meminfo")
    meta = dict(host=platform.node(), cpu=cpu or platform.processor(), cpus=os.cpu_count(),
                usable_cores=len(os.sched_getaffinity(0)),
                memory_gib=round(int(mem.read_text().split()[1]) / 2**20, 1) if mem.exists() else None,
                python=platform.python_version(), platform=platform.platform(), torch=torch.__version__,
                pagedattn=pagedattn.__version__, commit=info.git_commit(), git_dirty=git_dirty(),
                date=_dt.date.today().isoformat())
    if gpu:
        meta.update(gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                    driver=(nvidia_smi(torch.cuda.current_device()) or {}).get("driver_version"),
                    cuda=torch.version.cuda)
    meta.update(extra)
    machine = meta["gpu"].replace(" ", "_").lower() if gpu else f"cpu{os.cpu_count()}"
    path = Path(out_dir) / f"{kind}_{machine}_{meta['date'].replace('-', '')}{suffix}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(kind=kind, metadata=meta, results=results), indent=1) + "\n")
    return path
