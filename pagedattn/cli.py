"""The `pagedattn` command: info, list, cache, precompile, bench.

Each command group lives in its own module and adds itself through `add_parser(subparsers)`.
Conventions (pip's, huggingface-cli's): `--version`; exit code 2 for a bad command line, printed with
the usage of the subcommand that was given; no traceback when the reader of stdout goes away
(`pagedattn list | head -1`); every subcommand's `--help` ends with examples (EXAMPLES below).
"""
from __future__ import annotations

import argparse
import os
import sys

from . import __version__

# `--help` examples, one entry per command path (the subcommands of every module, in one place).
EXAMPLES = {
    "info": ["pagedattn info", "pagedattn info --json | python -m json.tool"],
    "list": ["pagedattn list", "pagedattn list attn_fwd -v | grep decodetma"],
    "cache": ["pagedattn cache ls", "pagedattn cache clear --older-than 30 --dry-run"],
    "cache ls": ["pagedattn cache ls", "pagedattn cache ls --json",
                 "PAGEDATTN_AOT_DIR=/opt/pagedattn/bundle pagedattn cache ls"],
    "cache clear": ["pagedattn cache clear --dry-run", "pagedattn cache clear --older-than 30 --yes"],
    "cache verify": ["pagedattn cache verify", "pagedattn cache verify --delete"],
    "precompile": ["pagedattn precompile --arch sm_90a --preset default --out /opt/pagedattn/bundle",
                   "pagedattn precompile --arch sm_80,sm_90a --model-config config.json --out DIR",
                   "pagedattn precompile --arch sm_90a --preset default --dry-run"],
    "bundle": ["pagedattn bundle verify /opt/pagedattn/bundle"],
    "bundle verify": ["pagedattn bundle verify /opt/pagedattn/bundle"],
    "bench": ["pagedattn bench --suite decode,write --quick",
              "pagedattn bench --suite all --out perf/results   # the repository's recorded results",
              "pagedattn bench --suite sweep --overrides '{\"attention\": {\"prefill\": \"prefill_ws\"}}'",
              "pagedattn bench compare a.json b.json"],
    "bench compare": ["pagedattn bench compare perf/results/a.json perf/results/b.json --peers"],
    "bench ab": ["pagedattn bench ab perf/results/ws_lag/call3_280c8ca/*.json   # one sweep's points side by side"],
    "bench report": ["pagedattn bench report --results perf/results   # the repository's RESULTS.md"],
}


def _cmd_info(args) -> int:
    from .info import collect, render_text

    info = collect()
    if args.json:
        import json

        print(json.dumps(info, indent=2))
    else:
        print(render_text(info))
    return 0


def _cmd_list(args) -> int:
    from .info import plural
    from .registry import FAMILIES, variant_name

    families = args.family or list(FAMILIES)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        print(f"pagedattn list: unknown family {', '.join(unknown)}; registered: {', '.join(FAMILIES)}",
              file=sys.stderr)
        return 2
    for fam in families:
        cls = FAMILIES[fam]
        specs = list(cls.all_variants())
        print(f"{fam}: {plural(len(specs), 'variant')}  ({cls.__doc__.strip().splitlines()[0]})")
        for name, values in cls.SUPPORTED.items():
            print(f"  {name}: {', '.join(map(str, values))}")
        if args.verbose:
            for spec in specs:
                print(f"    {variant_name(spec)}")
    return 0


def _subparsers(parser: argparse.ArgumentParser):
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) of every subcommand below `parser`."""
    action = _subparsers(parser)
    for name, child in (action.choices.items() if action else ()):
        yield path + (name,), child
        yield from _walk(child, path + (name,))


class _ExamplesFormatter(argparse.HelpFormatter):
    """Wraps descriptions as usual; keeps the lines of an "examples:" epilog as they are."""

    def _fill_text(self, text, width, indent):
        if text.startswith("examples:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _add_examples(parser: argparse.ArgumentParser) -> None:
    for path, child in _walk(parser):
        lines = EXAMPLES.get(" ".join(path))
        if lines and not child.epilog:
            child.epilog = "examples:\n" + "\n".join(f"  {line}" for line in lines)
            child.formatter_class = _ExamplesFormatter


def _chosen(parser: argparse.ArgumentParser, args) -> argparse.ArgumentParser:
    """The innermost subcommand parser that `args` went through (its usage names the flags)."""
    while (action := _subparsers(parser)) is not None:
        name = getattr(args, action.dest, None)
        if name not in action.choices:
            break
        parser = action.choices[name]
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedattn", description=__doc__.splitlines()[0],
                                     epilog="Run `pagedattn COMMAND --help` for a command's options "
                                            "and examples.")
    parser.add_argument("-V", "--version", action="version",
                        version=f"pagedattn {__version__} ({os.path.dirname(os.path.abspath(__file__))})")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("info", help="versions, headers, NVRTC, GPUs, cache and AOT dirs",
                       description="What this install will compile and run with: package versions, "
                                   "CUDA headers, NVRTC, GPUs and their target arch, cache and bundles.")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("list", help="the registered variant space",
                       description="Every registered kernel family, its spec fields and their values.")
    p.add_argument("family", nargs="*", help="kernel families to show (default: all)")
    p.add_argument("-v", "--verbose", action="store_true", help="print every variant name")
    p.set_defaults(func=_cmd_list)

    from . import aotcli, bench, cachecli
    for group in (cachecli, aotcli, bench):  # each command group adds its subcommands
        group.add_parser(sub)
    _add_examples(parser)
    return parser


def _bad_bundle_dir(args) -> str | None:
    """`bundle verify DIR` of a folder that is not there is a bad command line (exit 2)."""
    if getattr(args, "command", None) == "bundle" and getattr(args, "bundle_command", None) == "verify":
        if not os.path.isdir(args.dir):
            return f"{args.dir}: no such folder (give the bundle folder that `precompile --out` wrote)"
    return None


def _stdout_gone() -> int:
    """The reader closed the pipe (`| head`): stop quietly, as a SIGPIPE-killed tool would."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not fail again
    return 128 + 13


def parse(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """The command line as a Namespace; errors (exit 2) print the usage of the subcommand they are in.
    Words after a subcommand's options go to its trailing list argument, as they would before them
    (`list attn_fwd -v kv_write`: argparse alone refuses `kv_write` there)."""
    args, extra = parser.parse_known_args(argv)
    chosen = _chosen(parser, args)
    positionals = [a for a in chosen._actions if not a.option_strings]
    if extra and positionals and positionals[-1].nargs in ("*", "+") and not any(e.startswith("-") for e in extra):
        getattr(args, positionals[-1].dest).extend(extra)
        extra = []
    if extra:
        chosen.error(f"unrecognized arguments: {' '.join(extra)}")
    problem = _bad_bundle_dir(args)
    if problem:
        chosen.error(problem)
    return args


def main(argv=None) -> int:
    args = parse(build_parser(), argv)
    from . import ops  # noqa: F401  (registers every kernel family)

    try:
        rc = int(args.func(args) or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        return _stdout_gone()
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback
        print("pagedattn: interrupted", file=sys.stderr)
        return 130
    return rc


if __name__ == "__main__":
    sys.exit(main())
