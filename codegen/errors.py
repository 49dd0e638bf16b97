from __future__ import annotations


class ToolchainError(RuntimeError):
    """NVRTC or the headers it needs are missing or do not match each other, torch or the driver."""


class CompileError(RuntimeError):
    """NVRTC rejected a rendered source. Carries the full log and where the source was kept."""

    def __init__(self, variant: str, arch: str, log: str, source_path: str | None):
        self.variant, self.arch, self.log, self.source_path = variant, arch, log, source_path
        where = f"\nrendered source kept at: {source_path}" if source_path else ""
        body = log or "(NVRTC wrote no log)"
        super().__init__(f"NVRTC failed to compile {variant} for {arch}{where}\n{body}")


class MissingKernelError(RuntimeError):
    """JIT is disabled and no precompiled artifact holds the requested variant."""
