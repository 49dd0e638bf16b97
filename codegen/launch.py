"""Launch a loaded kernel on torch's current stream with its Params passed by value.

Each kernel takes ONE argument, a `Params` struct (`__grid_constant__`). The Python side describes it
with a ctypes.Structure (field names, types, offsets); `layout_asserts` renders static_asserts so a
drift in size or alignment fails at compile time. A launch packs its CUlaunchConfig (grid, block,
shared memory, stream) and the flattened Params values into one preallocated per-thread buffer with
one `struct.pack_into`, and calls the driver's cuLaunchKernelEx through ctypes with four prebuilt
arguments (config, function, kernel-argument array, NULL): no per-call allocation, no per-argument
conversion. A kernel launched again and again with the same geometry, where only addresses change,
takes a `Prepared` launch: grid, block and every field after the leading pointers packed once, so a
call packs only the stream and the pointers.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import struct
import threading

from .errors import ToolchainError
from .load import check, primary_context

_FORMAT = {
    ctypes.c_int32: "i", ctypes.c_uint32: "I", ctypes.c_int64: "q", ctypes.c_uint64: "Q",
    ctypes.c_float: "f", ctypes.c_void_p: "Q",
}


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h), cuLaunchKernelEx's first argument. A launch buffer holds one, the
    kernel's Params right after it; attrs / numAttrs stay NULL / 0 (no launch attributes)."""
    _fields_ = [("gridDimX", ctypes.c_uint32), ("gridDimY", ctypes.c_uint32), ("gridDimZ", ctypes.c_uint32),
                ("blockDimX", ctypes.c_uint32), ("blockDimY", ctypes.c_uint32), ("blockDimZ", ctypes.c_uint32),
                ("sharedMemBytes", ctypes.c_uint32), ("hStream", ctypes.c_void_p), ("attrs", ctypes.c_void_p),
                ("numAttrs", ctypes.c_uint32)]


CONFIG_BYTES = ctypes.sizeof(LaunchConfig)   # where the Params start in a launch buffer
STREAM_OFFSET = LaunchConfig.hStream.offset  # where a Prepared launch starts packing (stream, pointers)


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


_CONFIG_FIELDS = _flatten(LaunchConfig)[:8]  # the dims, shared memory and stream (attrs, numAttrs: zero)


def _params_fields(struct_type, start: int = 0, end: int | None = None) -> list:
    """The flattened Params fields [start:end] at their offsets in a launch buffer."""
    return [(CONFIG_BYTES + off, ch) for off, ch in _flatten(struct_type)[start:end]]


def launch_packer(struct_type: type[ctypes.Structure]) -> struct.Struct:
    """A struct.Struct of a whole launch buffer: grid (3), block (3), shared memory, stream, then the
    flattened Params fields, at the offsets of CUlaunchConfig and of the C++ compiler."""
    if CONFIG_BYTES % ctypes.alignment(struct_type):
        raise AssertionError(f"{struct_type.__name__} cannot follow CUlaunchConfig aligned")
    size = CONFIG_BYTES + ctypes.sizeof(struct_type)
    return struct.Struct(_layout(_CONFIG_FIELDS + _params_fields(struct_type), 0, size))


# Launch results that mean "this thread's current context is not the one the function lives in".
_WRONG_CONTEXT = {201, 400}   # CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_HANDLE


class _Driver:
    """cuLaunchKernelEx and the context stack straight from libcuda through ctypes.

    cuLaunchKernelEx is bound through `PyDLL` with no `argtypes`: its four arguments are prebuilt
    ctypes arguments (pointer_arg, byref: the config's and the argument array's addresses, the
    function) and None, so ctypes converts nothing and keeps the GIL (a launch only queues work).
    A steady decode launch's pack and call, measured on CPU with a no-op C function in place of the
    driver: 0.36 µs, against 0.69 with cuLaunchKernel's eleven arguments (grid, block and shared
    memory as ints, the stream as a new c_void_p, the function as a c_void_p)."""

    def __init__(self):
        try:
            lib = ctypes.PyDLL("libcuda.so.1")
        except OSError as exc:
            raise ToolchainError(f"cannot load libcuda.so.1 ({exc}): is an NVIDIA driver installed?") from exc
        try:
            self.launch = lib.cuLaunchKernelEx
        except AttributeError:
            raise ToolchainError("libcuda.so.1 has no cuLaunchKernelEx: pagedattn needs an NVIDIA driver "
                                 "of CUDA 11.8 or later") from None
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


def pointer_arg(address: int):
    """A prebuilt ctypes argument passing `address` as a pointer: byref() of an object placed at that
    address (never read through). ctypes passes such a CArgObject as it is, where a c_void_p costs a
    conversion object per call (0.15-0.3 µs over a launch's arguments, measured on CPU)."""
    return ctypes.byref(ctypes.c_char.from_address(address)) if address else None


def _launch_buffer(size: int, template: bytes = b""):
    """(bytearray of `size` bytes starting with `template`; the config argument (its address); the
    kernel-argument argument (the address of a void*[1] holding the Params' address, CONFIG_BYTES
    in)). The arguments hold the ctypes objects that pin the bytearray: it can never move."""
    buf = bytearray(size)
    buf[:len(template)] = template
    view = (ctypes.c_char * size).from_buffer(buf)
    argv = (ctypes.c_void_p * 1)(ctypes.addressof(view) + CONFIG_BYTES)
    return buf, ctypes.byref(view), ctypes.byref(argv)


def read_launch(config, argv, params_size: int) -> tuple:
    """(grid, block, shared memory, stream, Params bytes) of a launch's arguments: for stand-in launch
    functions (the tests) that record what a launch would have passed."""
    c = LaunchConfig.from_address(ctypes.addressof(config._obj))
    return ((c.gridDimX, c.gridDimY, c.gridDimZ), (c.blockDimX, c.blockDimY, c.blockDimZ), c.sharedMemBytes,
            c.hStream or 0, ctypes.string_at(argv._obj[0], params_size))


class Launcher:
    """A CUfunction bound to one device, with one reusable launch buffer (config + Params) per thread.

    The steady state is: current stream, pack, launch. No context query: the launch itself tells
    us when this thread's current context is not the device's primary context (none yet, or another
    device's); only then is the right one pushed for that launch and popped again, so the caller's
    current device is left as it was."""

    def __init__(self, func, params_type: type[ctypes.Structure], device: int, dynamic_smem: int = 0):
        import torch

        self._driver = _lib()
        self._bind(self._driver.launch, func, params_type, device, dynamic_smem, int(primary_context(device)),
                   torch._C._cuda_getCurrentRawStream)

    @classmethod
    def stand_in(cls, launch, params_type: type[ctypes.Structure], device: int = 0,
                 raw_stream=lambda device: 0) -> "Launcher":
        """A Launcher without a driver whose cuLaunchKernelEx is `launch(config, func, argv, extra)`
        (the tests: record or ignore launches on a machine without a GPU)."""
        lau = cls.__new__(cls)
        lau._driver = None
        lau._bind(launch, 0, params_type, device, 0, 0, raw_stream)
        return lau

    def _bind(self, launch, func, params_type, device: int, dynamic_smem: int, ctx: int, raw_stream) -> None:
        self._launch = launch
        self._handle = int(func)
        self._func = pointer_arg(self._handle)
        self._ctx = ctx
        self._device = device
        self._smem = dynamic_smem
        self._params = params_type
        self._pack = launch_packer(params_type).pack_into
        self._size = CONFIG_BYTES + ctypes.sizeof(params_type)
        self._local = threading.local()
        self._raw_stream = raw_stream

    def _thread_buffer(self):
        """The calling thread's launch buffer (_launch_buffer)."""
        self._local.state = state = _launch_buffer(self._size)
        return state

    def __call__(self, grid: tuple[int, int, int], block: tuple[int, int, int], values: tuple,
                 stream: int | None = None) -> None:
        """Pack the flattened Params `values` and launch on torch's current stream (or `stream`)."""
        if stream is None:
            stream = self._raw_stream(self._device)
        try:
            buf, config, argv = self._local.state
        except AttributeError:
            buf, config, argv = self._thread_buffer()
        self._pack(buf, 0, *grid, *block, self._smem, stream, *values)
        err = self._launch(config, self._func, argv, None)
        if err:
            self._failed(err, config, argv)

    def prepare(self, grid: tuple[int, int, int], block: tuple[int, int, int], n_head: int,
                tail: tuple) -> "Prepared":
        """A launch of this grid and block whose Params fields after the first `n_head` are `tail`
        (flattened, as `values` of __call__): calling it with the `n_head` leading values launches."""
        return Prepared(self, grid, block, n_head, tail)

    def _failed(self, err: int, config, argv) -> None:
        """A launch returned `err`: retry in the device's primary context when this thread's current
        context is not it; raise for anything else."""
        if err in _WRONG_CONTEXT:
            err = self._launch_in_own_context((config, self._func, argv, None))
        if err:
            from cuda.bindings import driver

            check((driver.CUresult(err),), "cuLaunchKernelEx")

    def max_active_blocks(self, threads: int) -> int:
        """CTAs of `threads` threads (with this launcher's dynamic shared memory) that fit on one SM at
        once (the driver's occupancy calculator)."""
        from cuda.bindings import driver

        from .load import in_context
        with in_context(self._device):
            return int(check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(self._handle, threads, self._smem),
                             "cuOccupancyMaxActiveBlocksPerMultiprocessor"))

    def max_active_clusters(self, threads: int, cluster: int) -> int | None:
        """Clusters of `cluster` CTAs (the kernel's compile-time cluster shape) of `threads` threads that
        fit on the device at once (cuOccupancyMaxActiveClusters; a GPU may hold fewer than SMs / cluster
        where its SMs do not pair up); None for a stand-in launcher, or where the driver cannot say
        (logged: the caller then assumes every SM pairs up)."""
        if self._driver is None:
            return None
        from cuda.bindings import driver

        from .load import in_context
        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = cluster, 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
        config.sharedMemBytes = self._smem
        try:
            with in_context(self._device):
                return int(check(driver.cuOccupancyMaxActiveClusters(self._handle, config),
                                 "cuOccupancyMaxActiveClusters"))
        except Exception as exc:  # noqa: BLE001 - an older driver; the launch itself still says what is wrong
            logging.getLogger("pagedattn").warning("cuOccupancyMaxActiveClusters failed (%s); assuming clusters "
                                                   "of %d fill every SM", exc, cluster)
            return None

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
def _split(struct_type: type[ctypes.Structure], n_head: int) -> tuple[struct.Struct, struct.Struct, int]:
    """A Prepared launch's packers: of the stream and the first `n_head` flattened Params fields (from
    STREAM_OFFSET), of the other fields (from the returned offset), at their launch-buffer offsets."""
    fields = _flatten(struct_type)
    size = CONFIG_BYTES + ctypes.sizeof(struct_type)
    split = CONFIG_BYTES + fields[n_head][0] if n_head < len(fields) else size
    head = _layout(_CONFIG_FIELDS[-1:] + _params_fields(struct_type, 0, n_head), STREAM_OFFSET, split)
    return struct.Struct(head), struct.Struct(_layout(_params_fields(struct_type, n_head), split, size)), split


_DIMS = struct.Struct(_layout(_CONFIG_FIELDS[:-1], 0, STREAM_OFFSET))  # grid, block, shared memory


class Prepared:
    """One launch configuration of a Launcher: grid, block and the trailing Params fields, packed once
    into a buffer per thread; a call packs the stream and the leading fields (the addresses) and
    launches on torch's current stream. What a steady-state decode step repeats costs one short pack
    and the driver call."""
    __slots__ = ("_launcher", "_launch", "_func", "_stream", "_device", "_pack_head", "_template", "_local")

    def __init__(self, launcher: Launcher, grid, block, n_head: int, tail: tuple):
        head, tail_format, split = _split(launcher._params, n_head)
        self._launcher = launcher
        self._launch, self._func = launcher._launch, launcher._func
        self._stream, self._device = launcher._raw_stream, launcher._device
        self._pack_head = head.pack_into
        template = bytearray(launcher._size)
        _DIMS.pack_into(template, 0, *grid, *block, launcher._smem)
        tail_format.pack_into(template, split, *tail)
        self._template = bytes(template)
        self._local = threading.local()

    def _thread_buffer(self):
        self._local.state = state = _launch_buffer(self._launcher._size, self._template)
        return state

    def launch(self, *head) -> None:
        """Launch with these leading Params fields (`prepared.launch(...)`: a method call costs half
        of calling the instance, which goes through type slots)."""
        try:
            buf, config, argv = self._local.state
        except AttributeError:
            buf, config, argv = self._thread_buffer()
        self._pack_head(buf, STREAM_OFFSET, self._stream(self._device), *head)
        err = self._launch(config, self._func, argv, None)
        if err:
            self._launcher._failed(err, config, argv)

    __call__ = launch
