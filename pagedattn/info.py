"""`pagedattn info`: everything needed to answer "what will this install compile and run?"."""
from __future__ import annotations

import platform

from . import __version__, envs
from .codegen.toolchain import HEADER_PACKAGES, dist_version

DEPENDENCIES = ("torch", "jinja2", "filelock", "cuda-bindings", "cuda-core", "cuda-pathfinder",
                "rich") + HEADER_PACKAGES


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def plural(n: int, word: str, many: str | None = None) -> str:
    """plural(1, "kernel") -> '1 kernel'; plural(2, "entry", "entries") -> '2 entries'."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def git_commit() -> str | None:
    """The source commit: $PAGEDATTN_GIT_COMMIT (set where .git does not travel), else git."""
    import os
    import subprocess
    from pathlib import Path

    if os.environ.get("PAGEDATTN_GIT_COMMIT"):
        return os.environ["PAGEDATTN_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent.parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def collect() -> dict:
    info: dict = {"pagedattn": __version__, "python": platform.python_version(),
                  "packages": {n: dist_version(n) for n in DEPENDENCIES}}
    try:
        from .codegen.toolchain import toolchain

        tc = toolchain()
        info["nvrtc"] = "%d.%d" % tc.nvrtc_version
        info["headers"] = {"origin": tc.headers.origin, "cuda_version": tc.headers.cuda_version,
                           "cutlass": str(tc.cutlass_include),
                           "cccl": str(tc.headers.cccl_include),
                           "runtime": str(tc.headers.runtime_include)}
    except Exception as exc:  # report, don't crash: info is the diagnosis tool
        info["toolchain_error"] = str(exc)
    import torch

    info["torch_cuda"] = torch.version.cuda
    gpus = []
    if torch.cuda.is_available():
        from .registry import arch_for_device

        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            try:
                arch = arch_for_device(i)
            except Exception as exc:
                arch = f"unsupported ({exc})"
            gpus.append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                         "sms": p.multi_processor_count, "memory_gib": round(p.total_memory / 2**30, 1),
                         "arch": arch})
        try:
            from cuda.bindings import driver

            driver.cuInit(0)
            _, v = driver.cuDriverGetVersion()
            info["driver_cuda"] = f"{v // 1000}.{v % 1000 // 10}"
        except Exception:
            pass
    info["gpus"] = gpus
    from .codegen.cache import dir_size

    size, entries = dir_size(envs.cache_dir())
    info["cache"] = {"dir": str(envs.cache_dir()), "bytes": size, "entries": entries}
    info["aot_dirs"] = [str(p) for p in envs.aot_dirs()]
    info["knobs"] = envs.snapshot()
    return info


def render_text(info: dict) -> str:
    lines = [f"pagedattn {info['pagedattn']}  (python {info['python']})", "packages:"]
    lines += [f"  {k:26s} {v or '-'}" for k, v in info["packages"].items()]
    if "toolchain_error" in info:
        lines.append(f"toolchain: ERROR {info['toolchain_error']}")
    else:
        h = info["headers"]
        lines += [f"nvrtc: {info['nvrtc']}",
                  f"headers ({h['origin']}, CUDA {h['cuda_version']}):",
                  f"  cutlass: {h['cutlass']}", f"  cccl:    {h['cccl']}", f"  runtime: {h['runtime']}"]
    lines.append(f"torch CUDA: {info['torch_cuda'] or 'none (CPU build)'}"
                 + (f", driver CUDA {info['driver_cuda']}" if info.get("driver_cuda") else ""))
    if info["gpus"]:
        for g in info["gpus"]:
            lines.append(f"gpu {g['index']}: {g['name']} (sm {g['capability']}, {g['sms']} SMs, "
                         f"{g['memory_gib']} GiB) -> {g['arch']}")
    else:
        lines.append("gpus: none found (kernels still compile; set PAGEDATTN_ARCH to pick a target)")
    c = info["cache"]
    lines.append(f"cache: {c['dir']}  ({plural(c['entries'], 'entry', 'entries')}, "
                 f"{c['bytes'] / 2**20:.1f} MiB)")
    lines.append(f"aot dirs: {', '.join(info['aot_dirs']) or '(none; PAGEDATTN_AOT_DIR unset)'}")
    knobs = ", ".join(f"{k}={v}" for k, v in info["knobs"].items() if v is not None)
    lines.append(f"knobs: {knobs or '(none set)'}")
    return "\n".join(lines)
