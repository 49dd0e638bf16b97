"""NVRTC: rendered source → cubin for one exact arch."""
from __future__ import annotations

import time
from dataclasses import dataclass

from .errors import CompileError, ToolchainError
from .render import include_root
from .toolchain import Toolchain

SUPPORTED_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a")


def nvrtc_options(arch: str, tc: Toolchain, debug: bool = False) -> list[str]:
    """Every NVRTC option in one place. `-default-device` is required by CUTLASS under NVRTC."""
    if arch not in SUPPORTED_ARCHS:
        raise ToolchainError(f"unsupported arch {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    opts = [
        f"--gpu-architecture={arch}",
        "-std=c++17",
        "-default-device",
        "-DNDEBUG",
        "-DCUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL=0",
    ]
    if debug:
        opts += ["-lineinfo", "-DPAGEDATTN_DEVICE_ASSERTS=1"]
    opts += [f"-I{include_root()}"] + [f"-I{d}" for d in tc.include_dirs]
    return opts


@dataclass(frozen=True)
class CompileResult:
    cubin: bytes
    log: str
    seconds: float


def _check(result, what: str) -> None:
    from cuda.bindings import nvrtc

    err = result[0] if isinstance(result, tuple) else result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise ToolchainError(f"{what} failed: {err}")


def compile_source(source: str, *, variant: str, arch: str, options: list[str],
                   source_path: str | None = None) -> CompileResult:
    """Compile with NVRTC; on failure raise CompileError with the whole log."""
    from cuda.bindings import nvrtc

    t0 = time.perf_counter()
    res = nvrtc.nvrtcCreateProgram(source.encode(), f"{variant}.cu".encode(), 0, [], [])
    _check(res, "nvrtcCreateProgram")
    prog = res[1]
    try:
        opts = [o.encode() for o in options]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _, log_size = nvrtc.nvrtcGetProgramLogSize(prog)
        log_buf = b" " * log_size
        nvrtc.nvrtcGetProgramLog(prog, log_buf)
        log = log_buf.rstrip(b"\x00 ").decode(errors="replace")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(variant, arch, log, source_path)
        res = nvrtc.nvrtcGetCUBINSize(prog)
        _check(res, "nvrtcGetCUBINSize")
        cubin = b" " * res[1]
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return CompileResult(cubin, log, time.perf_counter() - t0)
