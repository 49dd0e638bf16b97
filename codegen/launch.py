"""Launch a loaded kernel on torch's current stream with its Params passed by value.

Each kernel takes ONE argument, a `Params` struct (`__grid_constant__`). The Python side describes it
with a ctypes.Structure (field names, types, offsets); `layout_asserts` renders static_asserts so a
drift in size or alignment fails at compile time. A launch packs the flattened field values into one
preallocated buffer with `struct.pack_into` and calls the driver's cuLaunchKernel through ctypes:
no per-call allocation, ~2 µs of host time.
"""
from __future__ import annotations

import ctypes
import struct
import threading

from .errors import ToolchainError
from .load import check, primary_context

_FORMAT = {
    ctypes.c_int32: "i", ctypes.c_uint32: "I", ctypes.c_int64: "q", ctypes.c_uint64: "Q",
    ctypes.c_float: "f", ctypes.c_void_p: "Q",
}


def layout_asserts(struct_type: type[ctypes.Structure], cpp_name: str) -> str:
    """C++ static_asserts pinning `cpp_name`'s size and alignment to the ctypes mirror.
    (NVRTC has no constant offsetof, so field order is covered by the GPU tests.)"""
    return (f'static_assert(sizeof({cpp_name}) == {ctypes.sizeof(struct_type)}, '
            f'"{cpp_name}: size differs from the Python mirror");\n'
            f'static_assert(alignof({cpp_name}) == {ctypes.alignment(struct_type)}, '
            f'"{cpp_name}: alignment differs from the Python mirror");')


def _flatten(struct_type, base=0):
    """[(offset, format char)] of every scalar field, nested structs expanded in order."""
    out = []
    for name, ftype in struct_type._fields_:
        off = base + getattr(struct_type, name).offset
        if isinstance(ftype, type) and issubclass(ftype, ctypes.Structure):
            out += _flatten(ftype, off)
        else:
            out.append((off, _FORMAT[ftype]))
    return out


def packer(struct_type: type[ctypes.Structure]) -> struct.Struct:
    """A struct.Struct laying out the flattened fields exactly as the C++ compiler does."""
    fmt, pos = "<", 0
    for off, ch in _flatten(struct_type):
        fmt += "x" * (off - pos) + ch
        pos = off + struct.calcsize("<" + ch)
    fmt += "x" * (ctypes.sizeof(struct_type) - pos)
    assert struct.calcsize(fmt) == ctypes.sizeof(struct_type)
    return struct.Struct(fmt)


class _Driver:
    """cuLaunchKernel / cuCtxGetCurrent / cuCtxSetCurrent straight from libcuda via ctypes."""

    def __init__(self):
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise ToolchainError(f"cannot load libcuda.so.1 ({exc}): is an NVIDIA driver installed?") from exc
        vp, u = ctypes.c_void_p, ctypes.c_uint
        self.launch = lib.cuLaunchKernel
        self.launch.argtypes = [vp, u, u, u, u, u, u, u, vp, vp, vp]
        self.launch.restype = ctypes.c_int
        self.get_current = lib.cuCtxGetCurrent
        self.get_current.argtypes = [ctypes.POINTER(vp)]
        self.get_current.restype = ctypes.c_int
        self.set_current = lib.cuCtxSetCurrent
        self.set_current.argtypes = [vp]
        self.set_current.restype = ctypes.c_int


_driver: _Driver | None = None


def _lib() -> _Driver:
    global _driver
    if _driver is None:
        _driver = _Driver()
    return _driver


class Launcher:
    """A CUfunction bound to one device plus a reusable Params buffer."""

    def __init__(self, func, params_type: type[ctypes.Structure], device: int, dynamic_smem: int = 0):
        import torch

        lib = _lib()
        self._launch, self._get_ctx, self._set_ctx = lib.launch, lib.get_current, lib.set_current
        self._func = int(func)
        self._ctx = int(primary_context(device))
        self._device = device
        self._smem = dynamic_smem
        self._pack = packer(params_type).pack_into
        self._buf = ctypes.create_string_buffer(ctypes.sizeof(params_type))
        self._argv = (ctypes.c_void_p * 1)(ctypes.addressof(self._buf))
        self._current = ctypes.c_void_p()
        self._current_ref = ctypes.byref(self._current)
        self._lock = threading.Lock()
        self._raw_stream = torch._C._cuda_getCurrentRawStream

    def __call__(self, grid: tuple[int, int, int], block: tuple[int, int, int], values: tuple,
                 stream: int | None = None) -> None:
        """Pack the flattened Params `values` and launch on torch's current stream (or `stream`)."""
        if stream is None:
            stream = self._raw_stream(self._device)
        with self._lock:
            self._get_ctx(self._current_ref)
            if self._current.value != self._ctx:  # another device's context (or none) is current
                self._set_ctx(self._ctx)
            self._pack(self._buf, 0, *values)
            err = self._launch(self._func, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                               self._smem, stream, self._argv, None)
        if err:
            from cuda.bindings import driver

            check((driver.CUresult(err),), "cuLaunchKernel")
