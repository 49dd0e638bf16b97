"""Registers, stack frame and spills of kernel variants, read from ptxas on this machine (no GPU): each variant
compiled with NVRTC plus `-Xptxas -v` (not cached), ptxas' summary lines printed, so that a template change can be
checked for register pressure and local memory before it reaches a GPU.

    python perf/resource_usage.py --arch sm_90a 'attn_fwd:dtype=bf16 kv_cache_dtype=auto head_dim=128 mode=decode_tma'
"""
from __future__ import annotations

import argparse
import re

from pagedattn.aot import parse_variant
from pagedattn.codegen.compile import compile_source, nvrtc_options
from pagedattn.codegen.toolchain import toolchain
from pagedattn.registry import Kernel

LINE = re.compile(r"(Used \d+ registers.*|\d+ bytes stack frame.*)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="+", metavar="'FAMILY:FIELD=VALUE ...'")
    p.add_argument("--arch", default="sm_90a")
    args = p.parse_args()
    for text in args.variants:
        kernel = Kernel(parse_variant(text))
        print(kernel.name)
        result = compile_source(kernel.source, variant=kernel.name, arch=args.arch,
                                options=nvrtc_options(args.arch, toolchain()) + ["-Xptxas=-v"])
        for line in LINE.findall(result.log):
            print("   ", line.strip())


if __name__ == "__main__":
    main()
