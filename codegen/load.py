"""Load a cubin once per (artifact, CUDA device) into the primary context torch uses."""
from __future__ import annotations

import contextlib
import threading

from .errors import ToolchainError

_lock = threading.Lock()
_modules: dict[tuple[str, int], object] = {}     # (cache key, device) -> CUmodule
_contexts: dict[int, object] = {}                  # device -> primary CUcontext


def check(result, what: str):
    from cuda.bindings import driver

    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise ToolchainError(f"{what} failed: {name.decode() if name else err}")
    return rest[0] if len(rest) == 1 else (tuple(rest) if rest else None)


def primary_context(device: int):
    """The device's primary context (the one torch uses), retained once."""
    ctx = _contexts.get(device)
    if ctx is None:
        from cuda.bindings import driver

        with _lock:
            ctx = _contexts.get(device)
            if ctx is None:
                check(driver.cuInit(0), "cuInit")
                dev = check(driver.cuDeviceGet(device), "cuDeviceGet")
                ctx = check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
                _contexts[device] = ctx
    return ctx


@contextlib.contextmanager
def in_context(device: int):
    """The device's primary context current on this thread inside the block, and the caller's again after
    it (pushed and popped: loading a module for cuda:1 must not leave cuda:1 torch's current device)."""
    from cuda.bindings import driver

    check(driver.cuCtxPushCurrent(primary_context(device)), "cuCtxPushCurrent")
    try:
        yield
    finally:
        check(driver.cuCtxPopCurrent(), "cuCtxPopCurrent")


def load_function(key: str, cubin: bytes, entry: str, device: int, dynamic_smem: int = 0):
    """CUfunction for `entry` in the cubin, on `device`; the dynamic shared-memory limit is set once."""
    from cuda.bindings import driver

    with in_context(device):
        with _lock:
            module = _modules.get((key, device))
            if module is None:
                module = check(driver.cuModuleLoadData(cubin), f"cuModuleLoadData({entry})")
                _modules[(key, device)] = module
        func = check(driver.cuModuleGetFunction(module, entry.encode()), f"cuModuleGetFunction({entry})")
        if dynamic_smem > 48 * 1024:
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(driver.cuFuncSetAttribute(func, attr, dynamic_smem), "cuFuncSetAttribute")
    return func
