"""`pagedattn bench --suite _selftest` (pagedattn.bench.suites: a suite "_X" is importable module _X, here with
tests/ on PYTHONPATH): the harness's own test on the CPU, used by tests/test_bench.py's runner tests.
"""
import os
import time

import torch

from pagedattn.bench.common import Case, Ctx, Recorder


# A normal case, a failing case, a failing peer, a process crash and a hang;
# the crash and the hang only with PAGEDATTN_BENCH_SELFTEST=crash / =hang, to test the restart logic
def _ok(ctx: Ctx, rec: Recorder) -> None:
    from pagedattn.ops.attention import overrides

    rec.extra(forced=repr(overrides.current()), write_overrides=ctx.overrides.get("write"))  # what --overrides set
    a = torch.randn(64, 64, device=ctx.device)
    b = torch.empty_like(a)
    rec.work("GB/s", 2 * a.numel() * 4, "copy")
    rec.check(True, "trivial", "copy")
    rec.ours("copy_", lambda k: b.copy_(a))
    rec.peer("clone", lambda: (lambda k: a.clone()))
    rec.peer("broken peer", lambda: (_ for _ in ()).throw(RuntimeError("this peer cannot run")))


def _raises(ctx: Ctx, rec: Recorder) -> None:
    rec.work("GB/s", 1024, "copy")
    raise ValueError("planned failure")


def _crash(ctx: Ctx, rec: Recorder) -> None:
    a = torch.randn(16, device=ctx.device)
    rec.work("GB/s", 64, "copy")
    rec.ours("noop", lambda k: a.add(1))
    mode = os.environ.get("PAGEDATTN_BENCH_SELFTEST", "")
    if mode == "crash":
        os._exit(9)
    if mode == "hang":
        time.sleep(3600)


def cases(ctx: Ctx) -> list[Case]:
    return [Case("_selftest/ok", "_selftest", {"n": 64}, _ok), Case("_selftest/raises", "_selftest", {}, _raises),
            Case("_selftest/crash", "_selftest", {}, _crash), Case("_selftest/after", "_selftest", {"n": 64}, _ok)]
