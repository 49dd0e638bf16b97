"""What every suite shares: the run context, case definitions, the per-case recorder, small helpers."""
from __future__ import annotations

import contextlib
import math
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import schema
from .timing import CpuTimer, Timer

H200_L2 = 60 * 2**20


@dataclass
class Ctx:
    """Everything a case needs to know about this run."""
    device: torch.device
    quick: bool = False
    tiny: bool = False  # test shapes (CPU tests); never used for real measurements
    timer: Timer = None
    ceilings: dict = field(default_factory=dict)
    l2_bytes: int = H200_L2
    case_timeout: float = 600.0
    overrides: dict = field(default_factory=dict)  # --overrides: {"attention": ..., "write": ...}

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @classmethod
    def make(cls, device: str, quick: bool, **fields) -> "Ctx":
        """A context on `device` (a CUDA device becomes the current one) with its timer and L2 size."""
        dev = torch.device(device)
        if dev.type != "cuda":
            timer = CpuTimer(budget_s=0.01, min_reps=3, max_reps=50, flush_nbytes=2**20, device=dev)
            return cls(dev, quick, timer=timer, l2_bytes=4 * 2**20, **fields)
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
        l2 = int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or H200_L2)
        timer = Timer(budget_s=0.12 if quick else 0.3, min_reps=15 if quick else 30, l2_bytes=l2, device=dev)
        return cls(dev, quick, timer=timer, l2_bytes=l2, **fields)

    def sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


@dataclass
class Case:
    id: str
    suite: str
    params: dict
    run: Callable[["Ctx", "Recorder"], None]


class Recorder:
    """Builds one case record. Every measurement goes through here, so that one failing peer is reported in
    the record and the others still run; each sends the record so far to `emit_partial` (the child's
    `partial` event: a case that crashes later keeps it)."""

    def __init__(self, case: Case, ctx: Ctx, emit_partial: Callable[[dict], None] | None = None):
        self.case, self.ctx = case, ctx
        self.record = schema.new_case(case.id, case.suite, case.params)
        self._emit = emit_partial or (lambda rec: None)

    def _update(self, name: str | None, impl: dict) -> dict:
        """Record ours (name None) or peer `name`, derive the numbers, send the record so far."""
        if name is None:
            self.record["ours"] = impl
        else:
            self.record["peers"][name] = impl
        schema.derive(self.record, self.ctx.ceilings)
        self._emit(self.record)
        return impl

    def work(self, unit: str, amount: float | None = None, ceiling: str | None = None) -> None:
        self.record.update(unit=unit, work=amount, ceiling=ceiling)

    def note(self, text: str) -> None:
        prev = self.record.get("notes")
        self.record["notes"] = f"{prev}; {text}" if prev else text

    def extra(self, **kw) -> None:
        self.record["extra"].update(kw)

    def target(self, value: float, unit: str) -> None:
        """A goal; `met` is derived from ours (schema.target_met) with the other numbers."""
        self.record["target"] = {"value": value, "unit": unit, "met": None}

    def goal_ratio(self, peer: str, value: float) -> None:
        """A relative goal: ours at least `value` times as fast as `peer` (schema.goal_met)."""
        self.record["goals"].append({"value": value, "unit": "ratio", "peer": peer, "met": None})

    def ours(self, name: str, fn, sets: int = 1, methods=("rot",)) -> dict:
        """Time our implementation under each of `methods` (timing.METHODS); failures propagate."""
        return self._update(None, schema.impl_from_methods(name, self.ctx.timer.measure(fn, sets, methods)))

    def peer(self, name: str, make_fn, sets: int = 1, context=None, methods=("rot",)) -> dict:
        """Time a peer: `make_fn()` builds fn(k) (or raises: the peer is reported unavailable with the
        reason); `context()` wraps the whole measurement."""
        try:
            with (context() if context is not None else contextlib.nullcontext()):
                impl = schema.impl_from_methods(name, self.ctx.timer.measure(make_fn(), sets, methods))
        except Exception as exc:  # noqa: BLE001 - a peer's failure is data
            impl = schema.impl_error(name, short_error(exc))
            assert_cuda_healthy(self.ctx)
        return self._update(name, impl)

    def value(self, value: float, us: float) -> dict:
        """Ours as a number that is not a CUDA-event timing (the jit suite's s or ms), and its µs."""
        return self._update(None, {"name": "pagedattn", "us": us, "value": value, "fraction": None, "error": None,
                                   "reps": 1, "sets": 1})

    def peer_failed(self, name: str, reason: str) -> None:
        self._update(name, schema.impl_error(name, reason))

    def check(self, ok: bool, kind: str, detail: str = "", **numbers) -> None:
        self.record["check"] = {"ok": bool(ok), "kind": kind, "detail": detail, **numbers}
        if not ok:
            self.record["status"] = "check_failed"
        self._emit(self.record)

    def check_close(self, out: torch.Tensor, ref: torch.Tensor, tolerance: float) -> None:
        """Relative L2 of `out` against the float32 reference, at most `tolerance`."""
        err = rel_l2(out, ref)
        if not math.isfinite(err):
            return self.check(False, "rel_l2", "output has NaN/Inf (or is unwritten)", rel_l2=None)
        self.check(err <= tolerance, "rel_l2", f"relative L2 {err:.2e} vs float32 reference (tolerance "
                   f"{tolerance:g})", rel_l2=err)

    @contextlib.contextmanager
    def attempt(self, what: str):
        """`with rec.attempt(what):` an exception in the block becomes this case's error (the case goes on to
        its peers, still worth having). A lost CUDA context is raised."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001
            self.fail(exc, prefix=f"{what}: ")
            assert_cuda_healthy(self.ctx)
            self._emit(self.record)

    def skip(self, reason: str) -> None:
        self.record.update(status="skipped", error=reason)

    def fail(self, exc: BaseException, prefix: str = "") -> None:
        self.record.update(status="error", error=prefix + short_error(exc))
        self.record["extra"]["traceback"] = traceback.format_exc(limit=8)[-3000:]

    def finish(self) -> dict:
        return schema.derive(self.record, self.ctx.ceilings)


def short_error(exc: BaseException, limit: int = 600) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class CudaContextLost(RuntimeError):
    """A sticky CUDA error: this process can run nothing more on the GPU."""


def assert_cuda_healthy(ctx: Ctx) -> None:
    """Raise CudaContextLost if the CUDA context is broken (after an illegal address, say); off CUDA, nothing."""
    if not ctx.is_cuda:
        return
    try:
        torch.cuda.synchronize()
        if float(torch.ones(4, device="cuda").sum().item()) != 4.0:
            raise RuntimeError("device arithmetic is wrong")
    except Exception as exc:  # noqa: BLE001
        raise CudaContextLost(short_error(exc)) from exc


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return float("nan")
    den = ref.norm().item()
    return (out - ref).norm().item() / (den if den > 0 else 1.0)


def shuffled_tables(num_blocks: int, batch: int, blocks_per_seq: int, sets: int, device) -> list[torch.Tensor]:
    """`sets` disjoint random block tables [batch, blocks_per_seq] int32 (shuffled, never in order)."""
    n = batch * blocks_per_seq
    if n * sets > num_blocks:
        raise ValueError(f"need {n * sets} blocks, cache has {num_blocks}")
    perm = torch.randperm(num_blocks)
    return [perm[s * n:(s + 1) * n].view(batch, blocks_per_seq).to(torch.int32).to(device) for s in range(sets)]


def nan_fill_(t: torch.Tensor) -> torch.Tensor:
    """Poison a tensor: NaN for float types, 0x7F (NaN in e4m3 and e5m2) for uint8/fp8 storage."""
    if t.dtype in (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2):
        t.view(torch.uint8).fill_(0x7F)
    else:
        t.fill_(float("nan"))
    return t
