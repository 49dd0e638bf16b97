"""Find NVRTC and one consistent set of headers (CUTLASS, CCCL, CUDA runtime), and check they match.

Search order for the CUDA headers: the pip wheels (nvidia-cuda-cccl / nvidia-cuda-runtime, or their
-cu12 twins), then $CUDA_HOME, then /usr/local/cuda. CUTLASS always comes from the nvidia-cutlass wheel.
"""
from __future__ import annotations

import functools
import importlib.metadata as md
import importlib.util
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ToolchainError

# Distributions whose versions enter every cache key.
HEADER_PACKAGES = (
    "nvidia-cutlass",
    "nvidia-cuda-cccl",
    "nvidia-cuda-runtime",
    "nvidia-cuda-nvrtc",
    "nvidia-cuda-cccl-cu12",
    "nvidia-cuda-runtime-cu12",
    "nvidia-cuda-nvrtc-cu12",
)


def dist_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class HeaderSet:
    origin: str            # "pip" or the CUDA_HOME it came from
    runtime_include: Path  # holds cuda_runtime_api.h, cuda_fp8.h ...
    cccl_include: Path     # holds cuda/std/..., cub, thrust
    cuda_version: int      # CUDART_VERSION, e.g. 13000
    cccl_version: str      # CCCL_VERSION as major.minor.patch, e.g. 3.0.1


@dataclass(frozen=True)
class Toolchain:
    nvrtc_version: tuple[int, int]
    cutlass_include: Path
    headers: HeaderSet
    package_versions: dict[str, str] = field(default_factory=dict)

    @property
    def include_dirs(self) -> list[Path]:
        dirs = [self.cutlass_include, self.headers.cccl_include, self.headers.runtime_include]
        out: list[Path] = []
        for d in dirs:  # CUDA 12 keeps CCCL inside include/: no duplicates
            if d not in out:
                out.append(d)
        return out

    def fingerprint(self) -> dict:
        """What a cubin depends on besides our own sources: NVRTC's version and the versions the
        headers declare. Where the headers live (pip wheel or CUDA_HOME) is left out on purpose, so a
        bundle built from the pip wheels is found by a runtime whose identical headers come from a
        toolkit, and vice versa."""
        return {
            "nvrtc": "%d.%d" % self.nvrtc_version,
            "cuda_headers": self.headers.cuda_version,
            "packages": {"nvidia-cutlass": self.package_versions.get("nvidia-cutlass"),
                         "cccl": self.headers.cccl_version},
        }


def _cutlass_include() -> Path:
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise ToolchainError(
            "CUTLASS headers not found: install the 'nvidia-cutlass==4.2.0.0' package "
            "(pip install nvidia-cutlass==4.2.0.0)")
    for loc in spec.submodule_search_locations:
        inc = Path(loc) / "source" / "include"
        if (inc / "cute" / "tensor.hpp").is_file():
            return inc
    raise ToolchainError(f"nvidia-cutlass is installed but has no source/include/cute under "
                         f"{list(spec.submodule_search_locations)}; reinstall nvidia-cutlass==4.2.0.0")


def _cudart_version(runtime_include: Path) -> int:
    text = (runtime_include / "cuda_runtime_api.h").read_text(errors="replace")
    m = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", text)
    if not m:
        raise ToolchainError(f"cannot read CUDART_VERSION from {runtime_include / 'cuda_runtime_api.h'}")
    return int(m.group(1))


def _cccl_version(cccl_include: Path) -> str:
    path = cccl_include / "cuda" / "std" / "__cccl" / "version.h"
    try:
        m = re.search(r"#define\s+CCCL_VERSION\s+(\d+)", path.read_text(errors="replace"))
    except OSError:
        m = None
    if not m:
        return "unknown"
    v = int(m.group(1))
    return f"{v // 1000000}.{v // 1000 % 1000}.{v % 1000}"


def _pip_header_candidates():
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []
    for root in map(Path, roots):
        # CUDA 13 wheels: nvidia/cu13/include (+ /cccl)
        for cu in sorted(root.glob("cu[0-9]*")):
            yield cu / "include", cu / "include" / "cccl"
        # CUDA 12 wheels: nvidia/cuda_runtime/include + nvidia/cuda_cccl/include
        yield root / "cuda_runtime" / "include", root / "cuda_cccl" / "include"


SYSTEM_CUDA_DIRS = ("/usr/local/cuda",)


def _system_header_candidates():
    seen = set()
    for base in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), *SYSTEM_CUDA_DIRS):
        if not base or base in seen:
            continue
        seen.add(base)
        inc = Path(base) / "include"
        yield base, inc, (inc / "cccl" if (inc / "cccl" / "cuda").is_dir() else inc)


def find_headers(nvrtc_major: int | None = None) -> HeaderSet:
    """The first complete header set whose major version matches NVRTC's."""
    tried: list[str] = []
    candidates = [("pip", rt, cccl) for rt, cccl in _pip_header_candidates()]
    candidates += list(_system_header_candidates())
    for origin, rt, cccl in candidates:
        if not (rt / "cuda_runtime_api.h").is_file():
            tried.append(f"{rt}: no cuda_runtime_api.h")
            continue
        if not (cccl / "cuda" / "std" / "type_traits").is_file():
            tried.append(f"{cccl}: no CCCL (cuda/std/type_traits)")
            continue
        version = _cudart_version(rt)
        if nvrtc_major is not None and version // 1000 != nvrtc_major:
            tried.append(f"{rt}: CUDA {version // 1000} headers, NVRTC is {nvrtc_major}")
            continue
        return HeaderSet(origin, rt, cccl, version, _cccl_version(cccl))
    extra = f"cu{nvrtc_major}" if nvrtc_major else "cu13"
    raise ToolchainError(
        "no usable CUDA header set found (CCCL + runtime headers matching NVRTC). Install "
        f"'pagedattn[{extra}]' (nvidia-cuda-cccl and nvidia-cuda-runtime wheels) or set CUDA_HOME.\n"
        "looked at:\n  " + "\n  ".join(tried or ["(nothing found)"]))


def nvrtc_version() -> tuple[int, int]:
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # pragma: no cover - dependency is declared
        raise ToolchainError("cuda-bindings is not installed: pip install 'pagedattn[cu13]'") from exc
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # libnvrtc could not be loaded
        raise ToolchainError(
            f"NVRTC could not be loaded ({exc}). Install the NVRTC wheel matching torch's CUDA: "
            "pip install 'pagedattn[cu13]' (CUDA 13 torch) or 'pagedattn[cu12]' (CUDA 12 torch)") from exc
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise ToolchainError(f"nvrtcVersion failed: {err}")
    return int(major), int(minor)


def check_against_torch_and_driver(nvrtc_major: int) -> None:
    """A CUDA torch must share NVRTC's major version, and the driver must be at least that new."""
    try:
        import torch
    except ImportError:
        return
    torch_cuda = getattr(torch.version, "cuda", None)
    if torch_cuda:
        torch_major = int(torch_cuda.split(".")[0])
        if torch_major != nvrtc_major:
            raise ToolchainError(
                f"torch is built for CUDA {torch_cuda} but NVRTC is CUDA {nvrtc_major}: "
                f"pip install 'pagedattn[cu{torch_major}]' so kernels match torch's CUDA")
    if torch.cuda.is_available():
        from cuda.bindings import driver
        err, version = driver.cuDriverGetVersion()
        if err == driver.CUresult.CUDA_SUCCESS and version // 1000 < nvrtc_major:
            raise ToolchainError(
                f"the driver supports CUDA {version // 1000}.{version % 1000 // 10} but NVRTC is "
                f"CUDA {nvrtc_major}: its cubins may not load. Install 'pagedattn[cu{version // 1000}]'")


@functools.lru_cache(maxsize=1)
def toolchain() -> Toolchain:
    major, minor = nvrtc_version()
    check_against_torch_and_driver(major)
    headers = find_headers(major)
    versions = {name: v for name in HEADER_PACKAGES if (v := dist_version(name))}
    return Toolchain((major, minor), _cutlass_include(), headers, versions)
