"""Which attention kernels compile to other SASS than at an earlier commit (the last one measured on a GPU)?

    python tests/tools/sass_since.py --base COMMIT [--arch sm_90a] [--all | --dtype .. --kv-cache-dtype ..
                                     --features ..] [--modes M,..] [--head-dims D,..] [--jobs N] [--out FILE]

Exports COMMIT's tree (`git archive`) and compiles the same AttnFwdSpecs from it and from this checkout,
each in worker processes that import pagedattn from that tree, in NVRTC programs of a few kernels of one
mode and kind of cache, as the AOT bundles group them (tests/tools/program_sass.py: there a kernel's SASS
is its SASS alone). Disassembles both with nvdisasm (NVDISASM=..., or on PATH) and compares each kernel's
normalised instructions. Verdicts, best first:
  same        the SASS is unchanged: what the GPU runs at COMMIT proved of the kernel still holds;
  renumbered  the SASS differs, but the PTX (register and label numbers removed) has the same instructions
              in the same order, which ptxas allocated or ordered otherwise: likely the same code, not proved;
  reordered   each opcode as often (NOPs aside): another allocation or order;
  differs     the kernels the next device session must test first.
Without --all, a sample: bf16, caches auto and fp8_e4m3, feature sets none, window+softcap, sinks and
alibi, every mode and head dim (--dtype, --kv-cache-dtype, --features set other values). Prints one line
per kernel that is not "same" and a count per mode; --out writes the JSON record. CPU only.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SAMPLE = {"dtype": ("bf16",), "kv_cache_dtype": ("auto", "fp8_e4m3"),
          "features": ("none", "window+softcap", "sinks", "alibi")}
PER_PROGRAM = 6


def _specs(arch: str, everything: bool, sample: dict = SAMPLE) -> list[dict]:
    from pagedattn.ops.attention import AttnFwdSpec

    specs = [s for s in AttnFwdSpec.all_variants() if s.supports_arch(arch)]
    if not everything:
        specs = [s for s in specs if all(getattr(s, k) in v for k, v in sample.items())]
    return [dataclasses.asdict(s) for s in specs]


def _key(spec: dict) -> str:
    return "/".join(f"{k}={v}" for k, v in sorted(spec.items()) if v is not False)


def _nvdisasm() -> str:
    return os.environ.get("NVDISASM") or shutil.which("nvdisasm") or "/usr/local/cuda/bin/nvdisasm"


def _root_imports(root: str):
    """In a worker: pagedattn imported from root (asserted), its nvrtc_options and toolchain, and a
    spec dict -> Kernel (the fields root's AttnFwdSpec has)."""
    sys.path.insert(0, root)
    from pagedattn.codegen.compile import nvrtc_options
    from pagedattn.codegen.toolchain import toolchain
    from pagedattn.ops.attention import AttnFwdSpec
    from pagedattn.registry import Kernel

    assert Path(sys.modules["pagedattn"].__file__).resolve().is_relative_to(Path(root).resolve()), root
    fields = {f.name for f in dataclasses.fields(AttnFwdSpec)}
    return nvrtc_options, toolchain, lambda s: Kernel(AttnFwdSpec(**{k: v for k, v in s.items() if k in fields}))


def _compile_part(root: str, arch: str, specs: list[dict]) -> list[tuple[str, list[str] | str]]:
    """In a worker whose pagedattn is root's: [(key, instructions, or the compile error)]."""
    nvrtc_options, toolchain, kernel = _root_imports(root)
    from pagedattn.codegen.compile import compile_program, program_key

    sys.path.insert(0, str(Path(__file__).parent))
    from program_sass import _sass

    programs = collections.defaultdict(list)  # kernels of one preamble share a program (compile.program_key)
    for s in specs:
        k = kernel(s)
        programs[program_key(k.source)].append((s, k))
    out = []
    for members in programs.values():
        try:
            res = compile_program([k.source for _, k in members], variants=[k.name for _, k in members],
                                  arch=arch, options=nvrtc_options(arch, toolchain()))
        except Exception as exc:  # noqa: BLE001 - reported per kernel
            out += [(_key(s), f"compile error: {str(exc).splitlines()[0][:200]}") for s, _ in members]
            continue
        sass = _sass(res.cubin, _nvdisasm())
        out += [(_key(s), sass.get(k.name, "not in the cubin")) for s, k in members]
    return out


def kernel_ptx(source: str, name: str, arch: str, options: list[str]) -> str:
    """The PTX NVRTC makes of a kernel source for compute_XX (options: nvrtc_options(arch, ...), whose
    --gpu-architecture is turned to the virtual one). Imports nothing of pagedattn: shared by the tests."""
    from cuda.bindings import nvrtc

    options = [o.replace(f"--gpu-architecture={arch}", f"--gpu-architecture=compute_{arch[3:]}").encode()
               for o in options]
    _, prog = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"{name}: NVRTC {err}")
        _, size = nvrtc.nvrtcGetPTXSize(prog)
        buf = b" " * size
        nvrtc.nvrtcGetPTX(prog, buf)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return buf.rstrip(b"\0 ").decode()


def _ptx(root: str, arch: str, spec: dict) -> str:
    """In a worker whose pagedattn is root's: the kernel's PTX, its code only (no .global or .reg
    declarations), virtual registers' and labels' numbers removed."""
    nvrtc_options, toolchain, kernel = _root_imports(root)
    kernel = kernel(spec)
    try:
        ptx = kernel_ptx(kernel.source, kernel.name, arch, nvrtc_options(arch, toolchain()))
    except RuntimeError as exc:
        return f"compile error: {exc}"
    # registers and labels without their numbers: the same text is the same instructions in the same
    # order; not a proof of the same data flow (a renaming by first use is not one either: NVVM's copies
    # into loop-carried registers come in another order), which the GPU tests must still show
    return "\n".join(re.sub(r"%(r|rd|f|fd|p|rs|h|hh)\d+\b", r"%\1", re.sub(r"\$L__BB[0-9_]+", "L", x))
                     for x in ptx.splitlines() if not x.startswith(".global") and not x.lstrip().startswith(".reg "))


def _parts(specs: list[dict]) -> list[list[dict]]:
    groups = collections.defaultdict(list)  # as AttnFwdSpec.program_group: one mode and kind of cache
    for s in specs:
        groups[(s["mode"], s["kv_cache_dtype"] == "auto", s["head_dim"])].append(s)
    return [g[i:i + PER_PROGRAM] for g in groups.values() for i in range(0, len(g), PER_PROGRAM)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the commit to compare with")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--all", action="store_true", help="every variant, not the sample")
    for axis in SAMPLE:
        ap.add_argument(f"--{axis.replace('_', '-')}", default=None,
                        help=f"the sample's {axis} values, comma-separated (default: {','.join(SAMPLE[axis])})")
    ap.add_argument("--modes", default=None, help="only these modes, comma-separated")
    ap.add_argument("--head-dims", default=None, help="only these head dims, comma-separated")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=None, help="write the JSON record here")
    ap.add_argument("--dump", default=None, help="write both SASS of each kernel that differs into this folder")
    args = ap.parse_args(argv)
    base = subprocess.run(["git", "-C", str(REPO), "rev-parse", args.base], capture_output=True, text=True,
                          check=True).stdout.strip()
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "templates", "pagedattn", "codegen"],
                           capture_output=True, text=True, check=True).stdout.strip()
    if dirty:
        head += " with uncommitted changes"
    sample = {axis: tuple(getattr(args, axis).split(",")) if getattr(args, axis) else values
              for axis, values in SAMPLE.items()}
    specs = [s for s in _specs(args.arch, args.all, sample)
             if (not args.modes or s["mode"] in args.modes.split(","))
             and (not args.head_dims or str(s["head_dim"]) in args.head_dims.split(","))]
    parts = _parts(specs)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", base], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        # a fresh spawned process per task: each imports pagedattn from its own tree
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                                 max_tasks_per_child=1) as pool:
            futs = {root: [pool.submit(_compile_part, root, args.arch, p) for p in parts]
                    for root in (tmp, str(REPO))}
            got = {root: dict(x for f in fs for x in f.result()) for root, fs in futs.items()}
            old, new = got[tmp], got[str(REPO)]
            # kernels whose SASS differs: is their PTX the same but for register numbering?
            differ = [s for s in specs if old.get(_key(s)) != new.get(_key(s))
                      and not isinstance(old.get(_key(s)), str) and not isinstance(new.get(_key(s)), str)]
            ptx = {(root, _key(s)): pool.submit(_ptx, root, args.arch, s) for s in differ for root in (tmp, str(REPO))}
            ptx = {k: f.result() for k, f in ptx.items()}
    verdicts = {}
    for s in specs:
        k = _key(s)
        a, b = old.get(k), new.get(k)
        if isinstance(a, str) or isinstance(b, str):
            verdicts[k] = f"base: {a if isinstance(a, str) else 'ok'}; head: {b if isinstance(b, str) else 'ok'}"
        elif a == b:
            verdicts[k] = "same"
        else:
            ca = collections.Counter(x.split()[0] for x in a)
            cb = collections.Counter(x.split()[0] for x in b)
            moved = {op: cb[op] - ca[op] for op in sorted(set(ca) | set(cb)) if cb[op] != ca[op] and op != "NOP;"}
            verdicts[k] = (f"reordered: {len(a)} instructions, each opcode as often (registers, order)" if not moved
                           else f"differs: {len(a)} -> {len(b)} instructions; opcodes {moved}")
            if ptx[(tmp, k)] == ptx[(str(REPO), k)]:
                verdicts[k] = "renumbered: the same PTX instructions, register numbers aside; " + verdicts[k]
    if args.dump:
        Path(args.dump).mkdir(parents=True, exist_ok=True)
        for k, v in verdicts.items():
            if v != "same":
                stem = Path(args.dump) / k.replace("/", ",")
                stem.with_suffix(".base.sass").write_text("\n".join(old[k]) + "\n")
                stem.with_suffix(".head.sass").write_text("\n".join(new[k]) + "\n")
    per_mode = collections.defaultdict(collections.Counter)
    for s in specs:
        v = verdicts[_key(s)]
        per_mode[s["mode"]][v.split(":")[0]] += 1
        if v != "same":
            print(_key(s), v, flush=True)
    for mode, c in sorted(per_mode.items()):
        print(f"{mode}: {dict(c)}")
    print(f"{sum(v == 'same' for v in verdicts.values())} of {len(specs)} kernels ({args.arch}) have "
          f"{base[:7]}'s SASS; {time.perf_counter() - t0:.0f} s")
    if args.out:
        record = {"what": "SASS of each attention kernel at HEAD against the base commit's "
                          "(tests/tools/sass_since.py), normalised as tests/tools/program_sass.py",
                  "base": base, "head": head, "arch": args.arch,
                  "sample": None if args.all else {k: list(v) for k, v in sample.items()},
                  "kernels": len(specs), "per_mode": {m: dict(c) for m, c in per_mode.items()},
                  "verdicts": verdicts, "host_cpus": os.cpu_count(), "date": datetime.date.today().isoformat(),
                  "nvdisasm": " ".join(re.findall(r"release \S+ V\S+", subprocess.run(
                      [_nvdisasm(), "--version"], capture_output=True, text=True).stdout))}
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
