"""Every sm_90a warpgroup-MMA kernel (prefill_wgmma, prefill_ws: each dtype, cache, head dim and feature
set of AttnFwdSpec.all_variants), and optionally prefill_ws under tile overrides, compiled with
`ptxas -v` and checked for its "Potential Performance Loss" notes, such as C7515: "wgmma.mma_async
instructions are serialized due to non wgmma instructions defining accumulator registers of a wgmma
between start and end of the pipeline stage". ptxas then waits for every MMA batch as it is issued, so
nothing overlaps the tensor cores. The kernel
still runs correctly, so only this check (or a benchmark) notices. Session 33 found it in the chained
items of kWsQFeed 2 (perf/results/ws_feed/README.md).

Prints one line per kernel and exits 1 if any is serialised or fails to compile. CPU only (NVRTC).
  python tests/tools/wgmma_serialization.py [--jobs N] [--tiles JSON] [--narrow]
  (--tiles: prefill_ws overrides; --narrow: the opt-in prefill_ws kernels of head dims 80 and 96 instead,
  every dtype and feature set)"""
import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor


def _specs(narrow: bool = False):
    import dataclasses

    from pagedattn.ops.attention import FEATURE_SETS, NARROW_HEAD_DIMS, WGMMA_MODES, AttnFwdSpec

    if narrow:  # not among all_variants (not dispatched): built here, each feature set
        return [dataclasses.replace(AttnFwdSpec(dtype, "auto", d, "prefill_ws"),
                                    **{f: True for f in fs.split("+") if fs != "none"})
                for d in NARROW_HEAD_DIMS for dtype in AttnFwdSpec.SUPPORTED["dtype"] for fs in FEATURE_SETS]
    return [s for s in AttnFwdSpec.all_variants() if s.mode in WGMMA_MODES and s.supports_arch("sm_90a")]


def _check(job):
    spec, tiles = job
    from pagedattn.codegen.compile import compile_source, nvrtc_options
    from pagedattn.codegen.toolchain import toolchain
    from pagedattn.ops.attention.overrides import forced
    from pagedattn.registry import Kernel

    with forced(tiles={"prefill_ws": tiles} if tiles else None):
        kernel = Kernel(spec)
        source = kernel.source
    try:
        res = compile_source(source, variant=kernel.name, arch="sm_90a",
                             options=nvrtc_options("sm_90a", toolchain()) + ["-Xptxas=-v"])
    except Exception as exc:  # noqa: BLE001 - reported, the others still run
        return kernel.name, spec.features, f"compile error: {str(exc).splitlines()[0][:160]}"
    losses = [line.split(": ", 1)[-1][:120] for line in res.log.splitlines() if "Performance Loss" in line]
    return kernel.name, spec.features, "; ".join(losses) or "ok"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2, help="compiles at once")
    ap.add_argument("--tiles", type=json.loads, default=None,
                    help='prefill_ws tile overrides (JSON), e.g. \'{"kWsQFeed": 2}\': prefill_ws kernels only')
    ap.add_argument("--narrow", action="store_true", help="the opt-in prefill_ws kernels of head dims 80 and 96")
    args = ap.parse_args(argv)
    specs = [s for s in _specs(args.narrow) if not args.tiles or s.mode == "prefill_ws"]
    bad = 0
    with ProcessPoolExecutor(args.jobs) as pool:
        for name, features, verdict in pool.map(_check, [(s, args.tiles) for s in specs]):
            print(f"{name} [{features}] {verdict}", flush=True)
            bad += verdict != "ok"
    print(f"{len(specs)} kernels, {bad} with a performance loss or failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
