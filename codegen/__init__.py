"""Render → compile → cache → load → launch. Generic: nothing in here knows about attention."""
from .errors import CompileError, MissingKernelError, ToolchainError

__all__ = ["CompileError", "MissingKernelError", "ToolchainError"]
