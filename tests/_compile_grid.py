"""The (spec, arch) grids of the compile tests.

sm_80 and sm_90a compile one source per variant (the templates branch on the arch only in the TMA
copies, which are sm_90a-only variants), so compiling a variant for both archs checks the front end
twice and differs only in ptxas. Where a family's compiles are expensive (CuTe attention 20-60 s,
CuTe writes ~4 s on 2 cores), `make test` compiles a variant for the arch(s) `fast` picks -- each family
keeps real compiles for both archs -- and the rest of the grid runs under `slow` (`make test-all`).
"""
import pytest

from pagedattn.registry import variant_name

ARCHS = ("sm_80", "sm_90a")


def grid(specs, fast):
    """pytest params (spec, arch) over `specs` x ARCHS; a pair `fast(spec, arch)` refuses is `slow`."""
    return [pytest.param(spec, arch, id=f"{variant_name(spec)}-{arch}",
                         marks=() if fast(spec, arch) else pytest.mark.slow)
            for spec in specs for arch in ARCHS]
