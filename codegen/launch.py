"""Launch a loaded kernel on torch's current stream with its Params passed by value.

Each kernel takes ONE argument, a `Params` struct (`__grid_constant__`). The Python side describes it
with a ctypes.Structure (field names, types, offsets); `layout_asserts` renders static_asserts so a
drift in size or alignment fails at compile time. A launch packs the flattened field values into one
preallocated buffer with `struct.pack_into` and calls the driver's cuLaunchKernel through ctypes:
a per-thread buffer, so no per-call allocation. A kernel launched again and again with the same
geometry, where only addresses change, takes a `Prepared` launch: grid, block and every field after
the leading pointers packed once, so a call packs only the pointers.
"""
from __future__ import annotations

import ctypes
import functools
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


def _layout(fields, start: int, end: int) -> str:
    """struct format of `fields` [(offset, char)] laid out from byte `start` to byte `end`."""
    fmt, pos = "<", start
    for off, ch in fields:
        fmt += "x" * (off - pos) + ch
        pos = off + struct.calcsize("<" + ch)
    return fmt + "x" * (end - pos)


def packer(struct_type: type[ctypes.Structure]) -> struct.Struct:
    """A struct.Struct laying out the flattened fields exactly as the C++ compiler does."""
    fmt = _layout(_flatten(struct_type), 0, ctypes.sizeof(struct_type))
    assert struct.calcsize(fmt) == ctypes.sizeof(struct_type)
    return struct.Struct(fmt)


# Launch results that mean "this thread's current context is not the one the function lives in".
_WRONG_CONTEXT = {201, 400}   # CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_HANDLE


class _Driver:
    """cuLaunchKernel and the context stack straight from libcuda through ctypes.

    cuLaunchKernel is bound through `PyDLL` with no `argtypes`: every argument is an int or a
    prebuilt `c_void_p`, so ctypes does no per-argument conversion and keeps the GIL (a launch only
    queues work). This costs a third of the converted call."""

    def __init__(self):
        try:
            lib = ctypes.PyDLL("libcuda.so.1")
        except OSError as exc:
            raise ToolchainError(f"cannot load libcuda.so.1 ({exc}): is an NVIDIA driver installed?") from exc
        self.launch = lib.cuLaunchKernel
        self.launch.restype = ctypes.c_int
        self.push = lib.cuCtxPushCurrent_v2
        self.push.argtypes = [ctypes.c_void_p]
        self.push.restype = ctypes.c_int
        self.pop = lib.cuCtxPopCurrent_v2
        self.pop.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self.pop.restype = ctypes.c_int


_driver: _Driver | None = None


def _lib() -> _Driver:
    global _driver
    if _driver is None:
        _driver = _Driver()
    return _driver


class Launcher:
    """A CUfunction bound to one device, with one reusable Params buffer per thread.

    The steady state is: current stream, pack, launch. No context query: the launch itself tells
    us when this thread's current context is not the device's primary context (none yet, or another
    device's); only then is the right one pushed for that launch and popped again, so the caller's
    current device is left as it was."""

    def __init__(self, func, params_type: type[ctypes.Structure], device: int, dynamic_smem: int = 0):
        import torch

        self._driver = _lib()
        self._launch = self._driver.launch
        self._func = ctypes.c_void_p(int(func))
        self._ctx = int(primary_context(device))
        self._device = device
        self._smem = dynamic_smem
        self._params = params_type
        self._pack = packer(params_type).pack_into
        self._size = ctypes.sizeof(params_type)
        self._local = threading.local()
        self._raw_stream = torch._C._cuda_getCurrentRawStream

    def _thread_buffer(self):
        """(bytearray, void*[1] pointing at it) owned by the calling thread."""
        buf = bytearray(self._size)
        view = (ctypes.c_char * self._size).from_buffer(buf)   # pins buf: it can never move
        argv = (ctypes.c_void_p * 1)(ctypes.addressof(view))
        self._local.state = state = (buf, argv, view)
        return state

    def __call__(self, grid: tuple[int, int, int], block: tuple[int, int, int], values: tuple,
                 stream: int | None = None) -> None:
        """Pack the flattened Params `values` and launch on torch's current stream (or `stream`)."""
        if stream is None:
            stream = self._raw_stream(self._device)
        try:
            buf, argv, _ = self._local.state
        except AttributeError:
            buf, argv, _ = self._thread_buffer()
        self._pack(buf, 0, *values)
        stream = ctypes.c_void_p(stream)
        err = self._launch(self._func, grid[0], grid[1], grid[2], block[0], block[1], block[2], self._smem,
                           stream, argv, None)
        if err:
            self._failed(err, (grid[0], grid[1], grid[2], block[0], block[1], block[2], self._smem), stream, argv)

    def prepare(self, grid: tuple[int, int, int], block: tuple[int, int, int], n_head: int,
                tail: tuple) -> "Prepared":
        """A launch of this grid and block whose Params fields after the first `n_head` are `tail`
        (flattened, as `values` of __call__): calling it with the `n_head` leading values launches."""
        return Prepared(self, grid, block, n_head, tail)

    def _failed(self, err: int, dims: tuple, stream, argv) -> None:
        """A launch returned `err`: retry in the device's primary context when this thread's current
        context is not it; raise for anything else."""
        if err in _WRONG_CONTEXT:
            err = self._launch_in_own_context((self._func, *dims, stream, argv, None))
        if err:
            from cuda.bindings import driver

            check((driver.CUresult(err),), "cuLaunchKernel")

    def max_active_blocks(self, threads: int) -> int:
        """CTAs of `threads` threads (with this launcher's dynamic shared memory) that fit on one SM at
        once (the driver's occupancy calculator)."""
        from cuda.bindings import driver

        from .load import make_current
        make_current(self._device)
        return int(check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(self._func.value, threads, self._smem),
                         "cuOccupancyMaxActiveBlocksPerMultiprocessor"))

    def _launch_in_own_context(self, args) -> int:
        drv = self._driver
        err = drv.push(self._ctx)
        if err:
            return err
        try:
            return self._launch(*args)
        finally:
            drv.pop(ctypes.byref(ctypes.c_void_p()))


@functools.lru_cache(maxsize=None)
def _split(struct_type: type[ctypes.Structure], n_head: int) -> tuple[struct.Struct, struct.Struct]:
    """Packers of the first `n_head` flattened fields and of the rest, at the C++ compiler's offsets."""
    fields = _flatten(struct_type)
    size = ctypes.sizeof(struct_type)
    split = fields[n_head][0] if n_head < len(fields) else size
    return struct.Struct(_layout(fields[:n_head], 0, split)), struct.Struct(_layout(fields[n_head:], split, size))


class Prepared:
    """One launch configuration of a Launcher: grid, block and the trailing Params fields, packed once
    into a buffer per thread; a call packs the leading fields (the addresses) and launches on torch's
    current stream. What a steady-state decode step repeats costs one short pack and the driver call."""
    __slots__ = ("_launcher", "_dims", "_pack_head", "_tail", "_local")

    def __init__(self, launcher: Launcher, grid, block, n_head: int, tail: tuple):
        head, tail_format = _split(launcher._params, n_head)
        self._launcher = launcher
        self._dims = (*grid, *block, launcher._smem)
        self._pack_head = head.pack_into
        self._tail = tail_format.pack(*tail)
        self._local = threading.local()

    def _thread_buffer(self):
        buf = bytearray(self._launcher._size)
        buf[len(buf) - len(self._tail):] = self._tail
        view = (ctypes.c_char * len(buf)).from_buffer(buf)   # pins buf: it can never move
        argv = (ctypes.c_void_p * 1)(ctypes.addressof(view))
        self._local.state = state = (buf, argv, view)
        return state

    def __call__(self, *head) -> None:
        try:
            buf, argv, _ = self._local.state
        except AttributeError:
            buf, argv, _ = self._thread_buffer()
        self._pack_head(buf, 0, *head)
        lau = self._launcher
        stream = ctypes.c_void_p(lau._raw_stream(lau._device))
        err = lau._launch(lau._func, *self._dims, stream, argv, None)
        if err:
            lau._failed(err, self._dims, stream, argv)
