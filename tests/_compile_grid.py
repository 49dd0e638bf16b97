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


def grid(specs, fast, options=None):
    """pytest params (spec, arch) over `specs` x ARCHS; a pair `fast(spec, arch)` refuses is `slow`.
    options(spec, arch): the NVRTC options the test adds to the JIT's for that pair, declared to the
    farm on the param (the test function then carries no `compiles` marker of its own)."""
    def marks(spec, arch):
        declared = [pytest.mark.compiles((spec, arch, options(spec, arch)))] if options else []
        return declared + ([] if fast(spec, arch) else [pytest.mark.slow])

    return [pytest.param(spec, arch, id=f"{variant_name(spec)}-{arch}", marks=marks(spec, arch))
            for spec in specs for arch in ARCHS]
