"""jit suite: what the JIT costs a user (perf/README.md, "jit suite"): cold and warm first calls in fresh
processes (`worker`). The steady-state host cost of a call is perf/launch_overhead.py's, which replays the
launches `capture_launches` records.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import pagedattn
from pagedattn import envs
from pagedattn.codegen.cache import kernel_cache

from .attention import build, ours_fn
from .common import Case, Ctx, Recorder, short_error
from .runner import read_jsonl

H, D, BLOCK = 8, 128, 16
_MEMO: dict = {}


def available(ctx: Ctx):
    return (True, None) if ctx.is_cuda else (False, "needs CUDA")


# -- the workloads: setup(device) -> our call -----------------------------------------------------------
def _write(layout: str, kv: str):
    def setup(device):
        fp8 = kv != "auto"
        spec = pagedattn.CacheSpec(64, BLOCK, H, D, torch.uint8 if fp8 else torch.bfloat16, kv_cache_dtype=kv,
                                   layout=layout)
        kc, vc = spec.allocate(device)
        k, v = (torch.randn(1, H, D, dtype=torch.bfloat16, device=device) for _ in range(2))
        slots = torch.tensor([37], dtype=torch.int64, device=device)
        scale = torch.tensor([0.02], dtype=torch.float32, device=device) if fp8 else None
        return lambda: pagedattn.reshape_and_cache_flash(k, v, kc, vc, slots, kv, scale, scale)
    return setup


def _attention(kv: str, q_len: int, L: int):
    """The bench's paged inputs for one request (Hq=32, Hkv=8, D=128, block 16), one input set."""
    def setup(device):
        p = dict(B=1, q_len=q_len, ctx=L, hq=32, hkv=H, d=D, bs=BLOCK, kv_cache_dtype=kv)
        fn = ours_fn(build(Ctx(torch.device(device)), p, sets=1))
        return lambda: fn(0)
    return setup


WORKLOADS = {
    "write_nhd_bf16": _write("NHD", "auto"), "write_hnd_bf16": _write("HND", "auto"),
    "write_nhd_fp8": _write("NHD", "fp8_e4m3"), "write_hnd_fp8": _write("HND", "fp8_e4m3"),
    "decode_bf16": _attention("auto", 1, 256), "decode_fp8": _attention("fp8_e4m3", 1, 256),
    "prefill_bf16": _attention("auto", 256, 256),
}
QUICK = ("write_nhd_bf16", "write_nhd_fp8", "decode_bf16")


def _names(ctx: Ctx) -> list[str]:
    return list(QUICK if ctx.quick else WORKLOADS)


def cases(ctx: Ctx) -> list[Case]:
    return [Case(f"jit/{kind}/{n}", "jit", {"workload": n, "what": what},
                 lambda ctx, rec, n=n, kind=kind: _first_call(ctx, rec, n, kind))
            for kind, what in (("cold", "first call, empty cache"), ("warm", "first call, disk hit"))
            for n in _names(ctx)]


# -- fresh processes: `python -m pagedattn.bench.jit WORKLOADS OUT` (`worker`) --------------------------
def worker(names: str, out_path: str) -> None:
    """Time the first call of each workload (with a sync) in this fresh process, and note which kernel variants
    it compiled and how long each took (the cache entries' meta.json): with an empty PAGEDATTN_CACHE_DIR the
    cold path, on a filled one the warm path. One JSON line per workload."""
    def entries() -> dict:  # the disk cache's entries: folder name -> its meta.json
        return {m.parent.name: json.loads(m.read_text()) for m in envs.cache_dir().glob("*/meta.json")}

    torch.zeros(1, device="cuda").add_(1)
    torch.cuda.synchronize()  # context creation stays out of the first-call times
    with open(out_path, "a", buffering=1) as out:
        for name in names.split(","):
            rec = {"workload": name}
            try:
                fn = WORKLOADS[name]("cuda")
                torch.cuda.synchronize()
                before, compiles = entries(), kernel_cache().compiles
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                rec.update(first_call_s=time.perf_counter() - t0, compiles=kernel_cache().compiles - compiles,
                           variants={m.get("variant", k): m.get("compile_seconds")
                                     for k, m in entries().items() if k not in before},
                           origins=sorted({a.origin for a in kernel_cache()._memory.values()}))
            except Exception as exc:  # noqa: BLE001
                rec["error"] = short_error(exc)
            out.write(json.dumps(rec) + "\n")


def _run_worker(ctx: Ctx, cache_dir: str, timeout_s: float) -> dict:
    """workload -> its worker record, and "_failed": why the others are missing."""
    out_path = Path(cache_dir) / "jit_worker.jsonl"
    env = dict(os.environ, PAGEDATTN_CACHE_DIR=cache_dir, PAGEDATTN_AOT_DIR="", PAGEDATTN_DISABLE_JIT="0")
    env.pop("PAGEDATTN_ARCH", None)
    try:  # in this suite process's group: if the runner kills it, the worker goes too
        rc = subprocess.run([sys.executable, "-m", "pagedattn.bench.jit", ",".join(_names(ctx)), str(out_path)],
                            env=env, timeout=timeout_s).returncode
        failed = f"the fresh process exited with code {rc} before this workload finished"
    except subprocess.TimeoutExpired:  # (killed by subprocess.run)
        failed = f"the fresh process timed out after {timeout_s:.0f} s before this workload finished"
    records = {r["workload"]: r for r in read_jsonl(out_path)} if out_path.exists() else {}
    out_path.unlink(missing_ok=True)
    return {**records, "_failed": failed}


def _first_call(ctx: Ctx, rec: Recorder, name: str, which: str) -> None:
    """The first call of workload `name` in the cold run (an empty cache folder: s) or the warm one (the same
    folder, filled: ms); each runs once, for every workload, within the runner's no-progress limit."""
    if "cold" not in _MEMO:
        _MEMO["dir"] = tempfile.mkdtemp(prefix="pagedattn-bench-cold-")
        timeout = min(150.0 if ctx.quick else 360.0, 0.8 * ctx.case_timeout)
        print(f"  jit: cold compiles in a fresh process, empty cache {_MEMO['dir']} (up to {timeout:.0f} s)",
              flush=True)
        _MEMO["cold"] = _run_worker(ctx, _MEMO["dir"], timeout)
    if which == "warm" and "warm" not in _MEMO:
        print("  jit: warm first calls in a fresh process (disk hit)", flush=True)
        _MEMO["warm"] = _run_worker(ctx, _MEMO["dir"], min(180.0, 0.8 * ctx.case_timeout))
        shutil.rmtree(_MEMO["dir"], ignore_errors=True)
    w = _MEMO[which].get(name) or {"error": _MEMO[which]["_failed"]}
    if w.get("error"):
        raise RuntimeError(w["error"])
    rec.work("s" if which == "cold" else "ms")
    rec.extra(compiles=w["compiles"], origins=w["origins"])
    if which == "cold":
        rec.extra(variants=w["variants"], compile_s_total=sum(v or 0 for v in w["variants"].values()))
    elif w["compiles"]:
        rec.note(f"{w['compiles']} compile(s) on a filled cache: the disk cache missed")
    rec.value(w["first_call_s"] * (1 if which == "cold" else 1e3), us=w["first_call_s"] * 1e6)


# -- the raw launcher (perf/launch_overhead.py) --------------------------------------------------------
def capture_launches(fn):
    """Run fn once, every op's plan cache emptied first (a known call would take a launch prepared before,
    unrecorded), recording every launch: a Launcher call (its values repacked on replay) or a Prepared launch
    (the attention and write ops' own; its leading fields read back from the launch buffer and repacked on
    replay). Returns (replays: each launch again as the op packed it, fn's result)."""
    from pagedattn.codegen import launch
    from pagedattn.ops import attention, kv_write, legacy_attention

    orig_call, orig_init = launch.Launcher.__call__, launch.Prepared.__init__
    launches, prepared = [], []

    def recording_call(self, grid, block, values, stream=None):
        launches.append(lambda: orig_call(self, grid, block, values, stream))
        return orig_call(self, grid, block, values, stream)

    def recording_init(self, *args):
        orig_init(self, *args)
        raw = self._launch

        def recording_launch(config, func, argv, extra):
            _, *head = self._pack_head.__self__.unpack_from(self._local.state[0], launch.STREAM_OFFSET)
            launches.append(lambda: launch.Prepared.launch(self, *head))
            return raw(config, func, argv, extra)
        prepared.append((self, raw))
        self._launch = recording_launch

    for plans in (attention._PLANS, kv_write._PLANS, legacy_attention._PLANS):
        plans.clear()
    launch.Launcher.__call__, launch.Prepared.__init__ = recording_call, recording_init
    try:
        result = fn()
        torch.cuda.synchronize()
    finally:
        launch.Launcher.__call__, launch.Prepared.__init__ = orig_call, orig_init
        for p, raw in prepared:  # the launches prepared meanwhile launch unrecorded from now on
            p._launch = raw
    return launches, result


if __name__ == "__main__":
    worker(*sys.argv[1:3])
