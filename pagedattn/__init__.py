"""pagedattn: CuTe kernels for the paged KV cache of LLM inference, JIT-compiled with NVRTC."""
__version__ = "0.1.0"

from . import _logging

_logging.setup()

from .codegen.errors import CompileError, MissingKernelError, ToolchainError  # noqa: E402
from .contract import CacheSpec, ContractError  # noqa: E402
from .registry import KernelSpec, UnsupportedError, get_kernel, variant_name  # noqa: E402
from .ops.kv_write import reshape_and_cache_flash  # noqa: E402
from .ops.attention import flash_attn_varlen_func  # noqa: E402
from .ops.kvcache import flash_attn_with_kvcache  # noqa: E402
from .ops.merge import merge_attn_states  # noqa: E402

__all__ = [
    "__version__", "CacheSpec", "ContractError", "CompileError", "MissingKernelError",
    "ToolchainError", "UnsupportedError", "KernelSpec", "get_kernel", "variant_name",
    "reshape_and_cache_flash", "flash_attn_varlen_func", "flash_attn_with_kvcache", "merge_attn_states",
]
