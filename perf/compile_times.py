"""Cold NVRTC compile time of attention variants on this machine (issue 19: <= 6 s per variant on 2 cores), split
into NVRTC's phases (`-time`: front end, NVVM optimiser, PTX translation), no GPU needed.

    python perf/compile_times.py [--out perf/results] [--tag NAME] [--repeat 1] [--commit SHA]

Each variant compiles in this process, one at a time, with the package as installed (to compare two builds, run
this once per build with its install on PYTHONPATH, interleaved). Writes
<out>/compile_times_cpu<cores>_<date>[_<tag>].json.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

VARIANTS = [("sm_80", "bf16", "auto", 128, "decode", ()), ("sm_80", "bf16", "auto", 128, "prefill", ()),
            ("sm_90a", "bf16", "auto", 128, "decode_tma", ()), ("sm_90a", "bf16", "auto", 128, "multi_tma", ()),
            ("sm_90a", "bf16", "fp8_e4m3", 128, "decode_tma", ()), ("sm_90a", "bf16", "auto", 128, "prefill_ws", ()),
            ("sm_90a", "bf16", "auto", 128, "decode_tma", (True, True, False, True))]


def compile_one(arch, dtype, kv, d, mode, flags) -> dict:
    from pagedattn.codegen.compile import compile_source, nvrtc_options
    from pagedattn.codegen.toolchain import toolchain
    from pagedattn.ops.attention import AttnFwdSpec
    from pagedattn.registry import Kernel

    k = Kernel(AttnFwdSpec.for_arch(arch, dtype, kv, d, mode, tuple(flags) or (False,) * 4))
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "time.csv")
        r = compile_source(k.source, variant=k.name, arch=arch, options=nvrtc_options(arch, toolchain())
                           + [f"-time={trace}"])
        phases = {}
        for line in Path(trace).read_text().splitlines()[1:]:
            _, phase, ms, _ = (x.strip() for x in line.split(","))
            phases[phase] = phases.get(phase, 0.0) + float(ms) / 1e3
    return dict(variant=k.name, arch=arch, seconds=round(r.seconds, 2), phases_s=phases)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="perf/results")
    ap.add_argument("--tag", default="")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--commit", default=None, help="the commit of the installed build (default: this checkout's)")
    args = ap.parse_args(argv)
    import pagedattn
    from pagedattn.bench.meta import host

    rows = []
    for v in VARIANTS * args.repeat:
        rows.append(compile_one(*v))
        print(f"{rows[-1]['variant']:58s} {rows[-1]['arch']:7s} {rows[-1]['seconds']:6.1f} s  "
              + "  ".join(f"{p} {s:.1f}" for p, s in rows[-1]["phases_s"].items()), flush=True)
    meta = host()
    meta.update(package=str(Path(pagedattn.__file__).parent), commit=args.commit or meta["commit"], tag=args.tag)
    path = Path(args.out) / (f"compile_times_cpu{os.cpu_count()}_{meta['date'].replace('-', '')}"
                             f"{'_' + args.tag if args.tag else ''}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(kind="compile_times", metadata=meta, results=rows), indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
