"""Render → compile → cache → load → launch. Generic: nothing in here knows about attention."""
from .errors import CompileError, MissingKernelError, ToolchainError
from .toolchain import Toolchain, toolchain

__all__ = ["CompileError", "MissingKernelError", "ToolchainError", "Toolchain", "toolchain"]
