"""`pagedattn bench` [--suite ...] [--quick] [--out DIR] [--only IDS] [--overrides JSON], `bench compare A B`,
`bench ab FILES`, `bench report`: per-architecture performance comparisons (issue 6; perf/README.md explains the lot)."""
from __future__ import annotations

import argparse
import sys


def _cmd_run(args) -> int:
    from . import runner

    return runner.run(args)


def _cmd_compare(args) -> int:
    from . import report

    try:
        a, b = report.load(args.a), report.load(args.b)
    except (OSError, ValueError) as exc:  # schema.SchemaError is a ValueError
        print(f"pagedattn bench compare: {exc}", file=sys.stderr)
        return 2
    header, rows, summary = report.compare(a, b, peers=args.peers)
    print(report.markdown_table(header, rows) + "\n\n" + "\n".join(f"- {s}" for s in summary))
    return 0


def _cmd_ab(args) -> int:
    from . import report

    try:
        runs = [report.load(path) for path in args.files]
    except (OSError, ValueError) as exc:
        print(f"pagedattn bench ab: {exc}", file=sys.stderr)
        return 2
    header, rows, summary = report.ab_table(runs)
    print(report.markdown_table(header, rows) + "\n\n" + "\n".join(f"- {s}" for s in summary))
    return 0


def _cmd_report(args) -> int:
    from . import report

    print(f"wrote {report.write_results_md(args.results, warn=print)}")
    return 0


def add_parser(sub) -> None:
    from ..envs import bench_results_dir

    out = str(bench_results_dir())
    p = sub.add_parser("bench", help="benchmark the kernels against torch peers and the machine's ceilings",
                       description="Measure the kernels on this GPU against torch peers and the ceilings measured "
                                   "in the same run; write OUT/<gpu>_<sm>_<date>.json, and RESULTS.md "
                                   "beside OUT. See perf/README.md.")
    p.add_argument("--suite", default="all", help="write|decode|prefill|features|jit|all, or a comma-separated "
                   "list (default: all); sweep: ours alone at the tile and mode studies' shapes (not in all)")
    p.add_argument("--quick", action="store_true", help="fewer repetitions and cases (~3 min on an H200)")
    p.add_argument("--out", default=out, help="results folder; RESULTS.md goes beside it (default: "
                   "$XDG_DATA_HOME/pagedattn/bench/results, here %(default)s; the repository's: perf/results)")
    p.add_argument("--only", default="", help="run only the cases whose id contains one of these comma-separated "
                                               "substrings")
    p.add_argument("--overrides", default="", help='JSON: {"attention": the arguments of '
                   'pagedattn.ops.attention.forced (e.g. {"prefill": "prefill_ws", "tiles": {"prefill_ws": '
                   '{"kStages": 3}}}), "write": reshape_and_cache_flash\'s overrides= (e.g. {"flat": false})}, for '
                   'every case; the run is left out of RESULTS.md')
    p.add_argument("--no-report", action="store_true", help="don't regenerate RESULTS.md")
    p.add_argument("--case-timeout", type=float, default=600.0,
                   help="seconds without progress before a case is declared hung (default 600)")
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": harness self-test only
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # test shapes only
    p.set_defaults(func=_cmd_run)
    bsub = p.add_subparsers(dest="bench_command", metavar="{compare,ab,report}")
    c = bsub.add_parser("compare", help="case-by-case ratios of two results files (e.g. two GPUs)")
    c.add_argument("a", help="results file A (the baseline)")
    c.add_argument("b", help="results file B")
    c.add_argument("--peers", action="store_true", help="also compare each peer")
    c.set_defaults(func=_cmd_compare)
    ab = bsub.add_parser("ab", help="an A/B sweep's runs side by side: each --overrides point's times per case")
    ab.add_argument("files", nargs="+", help="results files of one sweep (rounds in any order)")
    ab.set_defaults(func=_cmd_ab)
    r = bsub.add_parser("report", help="regenerate RESULTS.md from a results folder (no GPU needed)")
    r.add_argument("--results", default=out, help="results folder, RESULTS.md is written beside it "
                   "(default: where `pagedattn bench` writes, %(default)s; the repository's: perf/results)")
    r.set_defaults(func=_cmd_report)
