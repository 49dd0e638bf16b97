"""Kernel families, their variant spaces, and the cached spec → loaded kernel path.

A family is a frozen dataclass subclassing `KernelSpec`. Its fields are the compile-time choices; its
`SUPPORTED` maps each field to the allowed values, which drives validation, `pagedattn list` and the
AOT matrix. `variant_name(spec)` is the ONE place a readable name is made from a spec.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import itertools
import threading
from dataclasses import dataclass
from typing import ClassVar

from . import envs
from .codegen.cache import Artifact, kernel_cache
from .codegen.compile import SUPPORTED_ARCHS
from .codegen.launch import Launcher, layout_asserts
from .codegen.load import load_function
from .codegen.render import render


class UnsupportedError(ValueError):
    """A requested kernel variant lies outside the registered variant space."""


@dataclass(frozen=True)
class KernelSpec:
    FAMILY: ClassVar[str] = ""
    TEMPLATE: ClassVar[str] = ""
    PARAMS: ClassVar[type[ctypes.Structure]]
    SUPPORTED: ClassVar[dict[str, tuple]] = {}

    def __post_init__(self):
        for f in dataclasses.fields(self):
            allowed = self.SUPPORTED.get(f.name)
            value = getattr(self, f.name)
            if allowed is not None and value not in allowed:
                raise UnsupportedError(
                    f"{self.FAMILY}: {f.name}={value!r} is not supported; supported values: "
                    f"{', '.join(map(str, allowed))}")
        self.check()

    def check(self) -> None:
        """Cross-field rules; raise UnsupportedError naming the field."""

    def context(self) -> dict:
        """Jinja context: types and constants only."""
        raise NotImplementedError

    def dynamic_smem(self) -> int:
        return 0

    def supports_arch(self, arch: str) -> bool:
        """False for a variant that needs instructions `arch` lacks, or more shared memory than it gives
        a CTA: it is never compiled for it."""
        return True

    def program_group(self) -> tuple:
        """Variants of one group may compile in one NVRTC program (aot.build.programs); () : any."""
        return ()

    @classmethod
    def all_variants(cls):
        """Every combination of the SUPPORTED fields; other fields (tuning) keep their defaults."""
        names = [f.name for f in dataclasses.fields(cls) if f.name in cls.SUPPORTED]
        for combo in itertools.product(*(cls.SUPPORTED[n] for n in names)):
            try:
                yield cls(**dict(zip(names, combo)))
            except UnsupportedError:
                continue


def _name_part(value) -> str:
    if isinstance(value, bool):
        return ""
    return str(value).replace("_", "").lower()


def variant_name(spec: KernelSpec) -> str:
    """Readable, unique name of a variant, e.g. `kv_write_bf16_fp8e4m3_span`. Bool fields appear
    by name when true; None fields (a family's default) not at all."""
    parts = [spec.FAMILY]
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if value is None:
            continue
        if isinstance(value, bool):
            if value:
                parts.append(f.name)
        elif f.metadata.get("prefix") is not None:
            parts.append(f"{f.metadata['prefix']}{_name_part(value)}")
        else:
            parts.append(_name_part(value))
    return "_".join(parts)


FAMILIES: dict[str, type[KernelSpec]] = {}


def register(cls: type[KernelSpec]) -> type[KernelSpec]:
    FAMILIES[cls.FAMILY] = cls
    return cls


@functools.cache
def sm_count(device: int) -> int:
    """Streaming multiprocessors of a CUDA device (launch-shape heuristics size grids by it)."""
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def arch_for_device(device: int | None) -> str:
    """NVRTC target for a CUDA device (or PAGEDATTN_ARCH): the newest supported arch the device runs."""
    override = envs.arch_override()
    if override:
        if override not in SUPPORTED_ARCHS:
            raise UnsupportedError(f"PAGEDATTN_ARCH={override!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        return override
    if device is None:
        return "sm_90a"
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    if major == 9:
        return "sm_90a"
    if major == 8:
        return max((a for a in SUPPORTED_ARCHS if a.startswith("sm_8") and int(a[4]) <= minor),
                   key=lambda a: int(a[4]))
    raise UnsupportedError(f"GPU cuda:{device} has compute capability {major}.{minor}; pagedattn "
                           f"builds for {', '.join(SUPPORTED_ARCHS)} (Ampere, Ada, Hopper)")


class Kernel:
    """One variant: rendered source, artifacts per arch, launchers per device."""

    def __init__(self, spec: KernelSpec):
        self.spec = spec
        self.name = variant_name(spec)
        self._source: str | None = None
        self._launchers: dict[int, Launcher] = {}
        self._lock = threading.Lock()

    @property
    def source(self) -> str:
        if self._source is None:
            ctx = dict(self.spec.context())
            ctx.setdefault("params_asserts", layout_asserts(self.spec.PARAMS, "Params"))
            ctx.setdefault("variant_name", self.name)
            ctx.setdefault("entry", self.name)  # unique: kernels share NVRTC programs (aot)
            self._source = render(self.spec.TEMPLATE, **ctx)
        return self._source

    def artifact(self, arch: str) -> Artifact:
        if not self.spec.supports_arch(arch):
            built = ", ".join(a for a in SUPPORTED_ARCHS if self.spec.supports_arch(a))
            raise UnsupportedError(f"{self.name} needs instructions or shared memory {arch} does not have; "
                                   f"it is built for {built} only")
        return kernel_cache().get(self.name, self.source, arch, debug=False,
                                  precompile_hint=precompile_command(self.spec, arch))

    def launcher(self, device: int) -> Launcher:
        launcher = self._launchers.get(device)
        if launcher is None:
            with self._lock:
                launcher = self._launchers.get(device)
                if launcher is None:
                    art = self.artifact(arch_for_device(device))
                    func = load_function(art.key, art.cubin, self.name, device,
                                         self.spec.dynamic_smem())
                    launcher = Launcher(func, self.spec.PARAMS, device, self.spec.dynamic_smem())
                    self._launchers[device] = launcher
        return launcher


@functools.lru_cache(maxsize=None)
def get_kernel(spec: KernelSpec) -> Kernel:
    return Kernel(spec)


def precompile_command(spec: KernelSpec, arch: str) -> str:
    """The exact `pagedattn precompile` command producing this variant (MissingKernelError's hint):
    into the first PAGEDATTN_AOT_DIR bundle, or into a folder the user then names there."""
    from .aot import command_for

    dirs = envs.aot_dirs()
    if dirs:
        return command_for(spec, arch, dirs[0])
    return (command_for(spec, arch, "./pagedattn-bundle")
            + "  # then PAGEDATTN_AOT_DIR=$PWD/pagedattn-bundle")


def all_specs(families=None):
    for fam, cls in FAMILIES.items():
        if families is None or fam in families:
            yield from cls.all_variants()
