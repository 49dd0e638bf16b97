"""The steady state of the eager ops (flash_attn_varlen_func, reshape_and_cache_flash): knowing, in
one C++ call, that a call's tensors have the metadata of a call validated before, and allocating
outputs without the dispatcher.

A plan (each op's `_Plan`) is validated once per tensor signature. Recognising that signature from
Python (shape, strides, dtype, device of six tensors, hashed into a key) costs about 4 µs; torch's own
guard check, `TensorGuards` (what torch.compile's guards on tensor inputs are made of), compares each
tensor's Python type, dispatch keys (device type, layout, autograd), dtype, device index,
requires_grad, rank, sizes and strides with a snapshot for about 0.1 µs a tensor. It holds no
reference to the tensors. Where this torch lacks it, `guard` returns None and calls take the
signature path, which checks the same metadata.
"""
from __future__ import annotations

import torch

from .plans import PlanCache

try:
    from torch._C._dynamo.guards import TensorGuards
except ImportError:  # pragma: no cover - a torch without Dynamo's guards
    TensorGuards = None


# The steady paths' gate against tracing: Dynamo's trace-time check, one Python frame (is_compiling
# adds torch.jit.is_scripting's). Dynamo folds it to True, so a traced call takes the custom op; the
# other tracers (torch.export's non-strict mode, make_fx, fake or dispatch modes) run the code on tensor
# subclasses or under dispatch modes, which a guard refuses (Python type, dispatch keys), and then the
# validated path sends them to the op (torch.compiler.is_compiling() or contract.traced()).
is_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)


class _Absent(torch.Tensor):
    """Stands for an optional tensor left out (None), so that one guard covers calls with and without
    it: no caller holds an instance, and a guard compares Python types first."""


# Stand-ins, distinct (a guard refuses the same tensor twice: one each): attention's out, k_descale,
# v_descale when None and v_descale when it is k_descale; the write's value when it is key, k_scale and
# v_scale when None and v_scale when it is k_scale; flash_attn_with_kvcache's v_cache is k_cache, v is
# k, k_descale and v_descale None, v_descale is k_descale (the first five). A guard sees metadata, not
# identity, so each has a shape of its own ([0, 1], [0, 2], ...): with one shape, a call warmed with
# v_scale=k_scale passed the guard with v_scale=None and reached None.data_ptr().
ABSENT = tuple(torch.empty(0, i + 1).as_subclass(_Absent) for i in range(6))


def guard(tensors: tuple, dynamic: tuple = ()):
    """A check that `tensors` (same positions) have these tensors' metadata, dim 0 of the positions in
    `dynamic` excepted (total_q, token counts); None where torch has no TensorGuards, or when one tensor
    is given twice (k is v: such calls always take the validated path)."""
    if TensorGuards is None:
        return None
    sizes = [[None, *t.shape[1:]] if i in dynamic else list(t.shape) for i, t in enumerate(tensors)]
    try:
        g = TensorGuards(*tensors, dynamic_dims_sizes=sizes, dynamic_dims_strides=[list(t.stride()) for t in tensors])
        return g if g.check(*tensors) else None
    except (TypeError, RuntimeError):  # another torch's signature
        return None


class Guards:
    """Guards of validated signatures in front of an op's plan cache, two lists by the call's form
    (attention: the usual six tensors, or those with out, k_descale and v_descale; the write: K/V,
    caches and slots, or those with the scales; ABSENT for a None). Each entry: (check, the string
    argument it was validated with (kv_cache_dtype), plan). Newest first, at most `limit` each: a call
    no guard knows pays `limit` failed checks (0.1 µs a tensor) before the validated path."""

    def __init__(self, limit: int = 4):
        self.limit = limit
        self.forms: tuple[list, list] = ([], [])

    def add(self, form: int, check, kv_cache_dtype, plan) -> None:
        """Remember `plan` behind `check` (nothing when guard() gave None)."""
        if check is not None:
            entries = self.forms[form]
            entries.insert(0, (check, kv_cache_dtype, plan))
            del entries[self.limit:]

    def clear(self) -> None:  # in place: the package holds the lists
        for entries in self.forms:
            entries.clear()


class Plans(PlanCache):
    """An op's plans by signature, and the guards in front of them (Guards): one clear() for both."""

    def __init__(self):
        super().__init__()
        self.steady = Guards()

    def clear(self) -> None:
        super().clear()
        self.steady.clear()


_empty_cpu = getattr(torch._C._dynamo.guards, "_empty_strided_cpu", None) if TensorGuards else None
_empty_cuda = getattr(torch._C._dynamo.guards, "_empty_strided_cuda", None) if TensorGuards else None
_cuda_device = getattr(torch._C, "_cuda_getDevice", None)


def empty_here(device: torch.device, index: int):
    """(empty, current): `empty(shape, stride, dtype)` allocates on the current device of `device`'s
    type without the dispatcher (Inductor's output buffers), right while `current() == index`, the
    index of `device` (on CUDA a device query); else empty_fn(device) allocates. empty_fn's work, split
    so that a caller can inline the device check (one Python frame less per call). On CPU `current()`
    is always `index`; without torch's functions never."""
    if device.type == "cpu" and _empty_cpu is not None:
        return _empty_cpu, (lambda: index)
    if device.type == "cuda" and _empty_cuda is not None and _cuda_device is not None:
        return _empty_cuda, _cuda_device
    return None, (lambda: None)


def empty_fn(device: torch.device):
    """(shape, stride, dtype) -> an uninitialised tensor on `device`: torch's own allocation without
    the dispatcher where torch has it (Inductor's output buffers; on CUDA only when `device` is the
    current device, which is where it allocates), else torch.empty_strided."""
    def general(shape, stride, dtype):
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)

    if device.type == "cpu" and _empty_cpu is not None:
        return _empty_cpu
    if device.type == "cuda" and _empty_cuda is not None and _cuda_device is not None:
        index = device.index

        def cuda(shape, stride, dtype):
            if _cuda_device() == index:
                return _empty_cuda(shape, stride, dtype)
            return general(shape, stride, dtype)
        return cuda
    return general
