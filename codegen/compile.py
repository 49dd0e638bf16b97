"""NVRTC: rendered source → cubin for one exact arch."""
from __future__ import annotations

import re
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


# -- several kernels in one program ----------------------------------------------------------------
# A rendered source is a preamble (its leading #define / #include lines, comments and blank lines) and a
# body (the kernel's types and its extern "C" entry point). Sources whose preambles hold the same
# directives can compile as one NVRTC program: the headers are parsed and their common templates
# instantiated once. Measured on 2 cores for sm_90a (NVRTC 13.0): 8 attention variants took 44.1 s one
# by one and 23.9 s as one program, 4 took 20.3 s and 11.1 s. NVVM optimises a program as a whole, so a
# kernel's SASS can differ from its own compile's (a warp-specialised prefill beside fp8 prefills did):
# aot.build.programs groups only kernels of one spec.program_group, whose SASS was checked to stay the
# same (tests/tools/program_sass.py).
_PREAMBLE_LINE = re.compile(r"[ \t]*(#|//|$)")


def split_preamble(source: str) -> tuple[str, str]:
    """(preamble, body) of a rendered source."""
    lines = source.splitlines(keepends=True)
    n = 0
    while n < len(lines) and _PREAMBLE_LINE.match(lines[n]):
        n += 1
    return "".join(lines[:n]), "".join(lines[n:])


def program_key(source: str) -> tuple[str, ...]:
    """The preamble's directives: sources with the same key can share a program (program_source)."""
    return tuple(line.strip() for line in split_preamble(source)[0].splitlines() if line.lstrip().startswith("#"))


def program_source(sources: list[str]) -> str:
    """One program holding every source (all with one program_key, and entry points of distinct names):
    the preamble once, then each body in a namespace of its own, so that their types (Params, Traits,
    ...) do not collide; an extern "C" entry point keeps its plain name inside a namespace."""
    keys = {program_key(s) for s in sources}
    if len(keys) != 1:
        raise ValueError(f"sources with {len(keys)} different preambles cannot share a program")
    directives = [line for line in split_preamble(sources[0])[0].splitlines(keepends=True)
                  if line.lstrip().startswith("#")]
    parts = [f"// one NVRTC program of {len(sources)} kernels (codegen.compile.program_source)\n", *directives]
    for i, source in enumerate(sources):
        preamble, body = split_preamble(source)
        comments = "".join(line for line in preamble.splitlines(keepends=True) if line.lstrip().startswith("//"))
        parts.append(f"\nnamespace pagedattn_program_{i} {{\n{comments}{body}}}  // namespace pagedattn_program_{i}\n")
    return "".join(parts)


def compile_program(sources: list[str], *, variants: list[str], arch: str, options: list[str]) -> CompileResult:
    """Compile several rendered kernels as one program (program_source): one cubin holding every entry
    point. On failure CompileError names the variants; compile them one by one to learn which failed."""
    if len(sources) == 1:
        return compile_source(sources[0], variant=variants[0], arch=arch, options=options)
    return compile_source(program_source(sources), variant=f"{variants[0]}+{len(variants) - 1}", arch=arch,
                          options=options)
