"""Suite name -> its cases, the modules loaded lazily ("sweep" runs only when named; a name "_X" is a test
suite, the cases of importable module _X: tests/_selftest.py, the harness's own test); the machine's two
ceilings, measured first in every run: a device-to-device copy of 2 GiB (1 GiB with --quick; bytes read +
written) and a bf16 8192^3 matmul on random data (never zeros: they run faster; flops = 2 n^3).
"""
from __future__ import annotations

import importlib

import torch

from .common import Case, Ctx, Recorder

ORDER = ("write", "decode", "prefill", "features", "jit")
_TABLE = {"ceilings": "suites:ceiling_cases", "write": "write:cases", "decode": "attention:decode_cases",
          "prefill": "attention:prefill_cases", "features": "attention:feature_cases",
          "sweep": "attention:sweep_cases", "jit": "jit:cases"}


def get(name: str):
    """(available(ctx) -> (ok, reason), cases(ctx) -> [Case]); a module without `available` always is."""
    module, cases = _TABLE[name].split(":") if name in _TABLE else (name, "cases")
    mod = importlib.import_module(f"pagedattn.bench.{module}" if name in _TABLE else module)
    return getattr(mod, "available", lambda ctx: (True, None)), getattr(mod, cases)


def parse(spec: str) -> list[str]:
    """'all' or a comma-separated list -> suite names in run order."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names or "all" in names:
        return list(ORDER)
    unknown = [n for n in names if (n not in _TABLE and not n.startswith("_")) or n == "ceilings"]
    if unknown:
        raise ValueError(f"unknown suite(s) {', '.join(unknown)}; choose from all, {', '.join(ORDER)}, sweep")
    return [n for n in ORDER if n in names] + [n for n in names if n not in ORDER]


def _copy(ctx: Ctx, rec: Recorder) -> None:
    nbytes = 16 * 2**20 if ctx.tiny or not ctx.is_cuda else (1 if ctx.quick else 2) * 2**30
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=ctx.device).uniform_(-1, 1)
    dst = torch.empty_like(src)
    rec.work("GB/s", 2 * nbytes, None)
    rec.extra(buffer_bytes=nbytes)
    rec.ours("torch copy_", lambda k: dst.copy_(src))


def _matmul(ctx: Ctx, rec: Recorder) -> None:
    n = 256 if (ctx.tiny or not ctx.is_cuda) else 8192
    dtype = torch.bfloat16 if ctx.is_cuda else torch.float32
    a, b, c = (torch.randn(n, n, dtype=dtype, device=ctx.device) for _ in range(3))
    rec.work("TFLOP/s", 2 * n ** 3, None)
    rec.extra(n=n, dtype=str(dtype).replace("torch.", ""))
    rec.ours("torch.mm", lambda k: torch.mm(a, b, out=c))


def ceiling_cases(ctx: Ctx) -> list[Case]:
    return [Case("ceilings/copy", "ceilings", {"what": "device-to-device copy, read+write"}, _copy),
            Case("ceilings/matmul", "ceilings", {"what": "bf16 matmul 8192^3, random data"}, _matmul)]
