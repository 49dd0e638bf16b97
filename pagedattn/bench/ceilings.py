"""The machine's two ceilings, measured in the same run as the cases they judge.

copy: device-to-device copy of a ~2 GiB buffer (1 GiB with --quick); bytes = read + written.
matmul: bf16 8192 x 8192 x 8192 matrix product on random data (never zeros: they run faster);
        flops = 2 * n^3.
"""
from __future__ import annotations

import torch

from .common import Case, Ctx, Recorder

NAME = "ceilings"


def _copy(ctx: Ctx, rec: Recorder) -> None:
    if ctx.tiny or not ctx.is_cuda:
        nbytes = 16 * 2**20
    else:
        nbytes = (1 if ctx.quick else 2) * 2**30
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=ctx.device).uniform_(-1, 1)
    dst = torch.empty_like(src)
    rec.work("GB/s", 2 * nbytes, None)
    rec.extra(buffer_bytes=nbytes)
    rec.ours("torch copy_", lambda k: dst.copy_(src))


def _matmul(ctx: Ctx, rec: Recorder) -> None:
    n = 256 if (ctx.tiny or not ctx.is_cuda) else 8192
    dtype = torch.bfloat16 if ctx.is_cuda else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=ctx.device)
    b = torch.randn(n, n, dtype=dtype, device=ctx.device)
    c = torch.empty(n, n, dtype=dtype, device=ctx.device)
    rec.work("TFLOP/s", 2 * n ** 3, None)
    rec.extra(n=n, dtype=str(dtype).replace("torch.", ""))
    rec.ours("torch.mm", lambda k: torch.mm(a, b, out=c))


def available(ctx: Ctx):
    return True, None


def cases(ctx: Ctx) -> list[Case]:
    return [Case("ceilings/copy", NAME, {"what": "device-to-device copy, read+write"}, _copy),
            Case("ceilings/matmul", NAME, {"what": "bf16 matmul 8192^3, random data"}, _matmul)]
