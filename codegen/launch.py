"""Launch a loaded kernel on torch's current stream with its Params passed by value.

Each kernel takes ONE argument, a `Params` struct (`__grid_constant__`). The Python side mirrors it as
a ctypes.Structure; `layout_asserts` renders static_asserts so a drift between the two fails at compile
time (size and alignment). The launcher keeps one Params instance and one argument array, so a launch only refills fields.
"""
from __future__ import annotations

import ctypes
import threading

from .load import check, make_current

_CTYPE_TO_CPP = {
    ctypes.c_int32: "int32_t", ctypes.c_uint32: "uint32_t", ctypes.c_int64: "int64_t",
    ctypes.c_uint64: "uint64_t", ctypes.c_float: "float", ctypes.c_void_p: "void const*",
}


def layout_asserts(struct: type[ctypes.Structure], cpp_name: str) -> str:
    """C++ static_asserts pinning `cpp_name`'s size and alignment to the ctypes mirror.
    (NVRTC has no constant offsetof, so field order is covered by the GPU tests.)"""
    return (f'static_assert(sizeof({cpp_name}) == {ctypes.sizeof(struct)}, '
            f'"{cpp_name}: size differs from the Python mirror");\n'
            f'static_assert(alignof({cpp_name}) == {ctypes.alignment(struct)}, '
            f'"{cpp_name}: alignment differs from the Python mirror");')


class Launcher:
    """A CUfunction bound to one device plus a reusable Params buffer."""

    def __init__(self, func, params_type: type[ctypes.Structure], device: int, dynamic_smem: int = 0):
        from cuda.bindings import driver

        self._driver_launch = driver.cuLaunchKernel
        self._ok = driver.CUresult.CUDA_SUCCESS
        self._func = func
        self._device = device
        self._smem = dynamic_smem
        self._params = params_type()
        self._argv = (ctypes.c_void_p * 1)(ctypes.addressof(self._params))
        self._argv_addr = ctypes.addressof(self._argv)
        self._lock = threading.Lock()
        import torch

        self._raw_stream = torch._C._cuda_getCurrentRawStream

    def __call__(self, grid: tuple[int, int, int], block: tuple[int, int, int], values: tuple,
                 stream: int | None = None) -> None:
        """Fill Params positionally from `values` and launch on torch's current stream."""
        if stream is None:
            stream = self._raw_stream(self._device)
        with self._lock:
            make_current(self._device)
            ctypes.Structure.__init__(self._params, *values)
            err, = self._driver_launch(self._func, grid[0], grid[1], grid[2], block[0], block[1],
                                       block[2], self._smem, stream, self._argv_addr, 0)
        if err != self._ok:
            check((err,), "cuLaunchKernel")
