"""The `pagedattn` command: info, list, cache, precompile, bench.

Each command group lives in its own module and adds itself through `add_parser(subparsers)`.
"""
from __future__ import annotations

import argparse
import sys


def _cmd_info(args) -> int:
    from .info import collect, render_text

    print(render_text(collect()))
    return 0


def _cmd_list(args) -> int:
    from .registry import FAMILIES, variant_name

    families = args.family or list(FAMILIES)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        print(f"unknown family {unknown}; registered: {', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    for fam in families:
        cls = FAMILIES[fam]
        specs = list(cls.all_variants())
        print(f"{fam}: {len(specs)} variants  ({cls.__doc__.strip().splitlines()[0]})")
        for name, values in cls.SUPPORTED.items():
            print(f"  {name}: {', '.join(map(str, values))}")
        if args.verbose:
            for spec in specs:
                print(f"    {variant_name(spec)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedattn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="versions, headers, NVRTC, GPUs, cache and AOT dirs")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("list", help="the registered variant space")
    p.add_argument("family", nargs="*", help="kernel families to show (default: all)")
    p.add_argument("-v", "--verbose", action="store_true", help="print every variant name")
    p.set_defaults(func=_cmd_list)

    from . import aotcli, bench, cachecli
    for group in (cachecli, aotcli, bench):  # each command group adds its subcommands
        group.add_parser(sub)
    return parser


def main(argv=None) -> int:
    from . import ops  # noqa: F401  (registers every kernel family)

    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
