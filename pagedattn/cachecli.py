"""`pagedattn cache ls | clear | verify`."""
from __future__ import annotations

import json
import shutil
import sys
import time

from . import envs
from .codegen import cache as kcache
from .info import human_bytes, plural

COLUMNS = ("variant", "arch", "size", "age", "origin", "ok")


def _rows() -> list[dict]:
    """JIT cache entries, then the kernels of every bundle of PAGEDATTN_AOT_DIR."""
    from .codegen.bundle import check_entry, read_manifest

    rows = [{"variant": e.variant, "arch": e.arch, "size": e.size, "age_days": round(e.age_days, 2),
             "origin": e.origin, "ok": e.valid, "path": str(e.folder)} for e in kcache.list_entries()]
    for folder in envs.aot_dirs():
        manifest = read_manifest(folder)  # a bundle of another install: warned, not listed
        for v in (manifest or {}).get("variants", []):
            age = round((time.time() - v["created"]) / 86400, 2) if "created" in v else None
            rows.append({"variant": v["name"], "arch": v["arch"], "size": v["size"], "age_days": age,
                         "origin": f"aot:{folder}", "ok": check_entry(folder, v) is None,
                         "path": str(folder / v["file"])})
    return rows


def _cells(row: dict) -> list[str]:
    age = "-" if row["age_days"] is None else f"{row['age_days']:.1f} d"
    return [row["variant"], row["arch"], human_bytes(row["size"]), age, row["origin"],
            "yes" if row["ok"] else "CORRUPT"]


def _ls(args) -> int:
    rows = _rows()
    if args.json:
        print(json.dumps({"cache_dir": str(envs.cache_dir()),
                          "aot_dirs": [str(p) for p in envs.aot_dirs()], "kernels": rows}, indent=2))
        return 0
    n_aot = len(envs.aot_dirs())
    where = f"{envs.cache_dir()}" + (f" and {plural(n_aot, 'AOT bundle')}" if n_aot else "")
    if not rows:
        print(f"no kernels in {where}: kernels compile on first use, or run `pagedattn precompile`")
        return 0
    cells = [_cells(r) for r in rows]
    if sys.stdout.isatty():
        _print_for_terminal(cells, f"pagedattn cache: {where}")
    else:  # piped: plain aligned columns, whole values, no width limit (grep / awk friendly)
        widths = [max(len(x) for x in col) for col in zip(COLUMNS, *cells)]
        for c in [list(COLUMNS), *cells]:
            print("  ".join(x.ljust(w) for x, w in zip(c, widths)).rstrip())
    print(f"{plural(len(rows), 'kernel')}, {human_bytes(sum(r['size'] for r in rows))}")
    return 0


def _print_for_terminal(cells: list[list[str]], title: str) -> None:
    """A table as wide as the terminal. Names are never cut: when the whole names and the other
    columns do not fit side by side, each name gets its own line with its details below it."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    widths = [max(len(x) for x in col) for col in zip(COLUMNS, *cells)]
    need = sum(widths[:-2]) + min(widths[-2], 12) + widths[-1] + 2 * len(COLUMNS)
    if need <= console.width:
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
        for i, col in enumerate(COLUMNS):
            fold = col == "origin"  # a bundle's folder may fold; nothing else does
            table.add_column(col, no_wrap=not fold, overflow="fold" if fold else "ellipsis",
                             min_width=None if fold else widths[i])
        for c in cells:
            table.add_row(*c)
        console.print(table)
        return
    console.print(title, markup=False)
    for c in cells:
        console.print(c[0], style="bold", markup=False, overflow="fold")
        console.print("    " + "  ".join(c[1:]), markup=False, overflow="fold")


def _confirm(question: str) -> bool:
    try:
        return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")
    except EOFError:
        return False


def _clear(args) -> int:
    root = envs.cache_dir()
    doomed = [e for e in kcache.list_entries(root)
              if args.older_than is None or e.age_days > args.older_than]
    what = (f"{plural(len(doomed), 'cache entry', 'cache entries')}, "
            f"{human_bytes(sum(e.size for e in doomed))}")
    if not doomed:
        print(f"nothing to remove from {root}"
              + (f" (no entry older than {args.older_than:g} days)" if args.older_than is not None else ""))
        return 0
    if args.dry_run:
        for e in doomed:
            print(f"would remove {e.folder}")
        print(f"dry run: would remove {what} from {root}")
        return 0
    if not args.yes:
        if not sys.stdin.isatty():
            print(f"pagedattn cache clear: would remove {what} from {root}; pass --yes to confirm "
                  "(stdin is not a terminal to ask)", file=sys.stderr)
            return 2
        if not _confirm(f"remove {what} from {root}?"):
            print("nothing removed")
            return 1
    n = kcache.clear(root, older_than_days=args.older_than)
    print(f"removed {plural(n, 'cache entry', 'cache entries')} from {root}")
    return 0


def _verify(args) -> int:
    """The JIT cache, then every bundle of PAGEDATTN_AOT_DIR (`pagedattn bundle verify DIR` checks
    one bundle by path)."""
    from .codegen import bundle

    bad = [e for e in kcache.list_entries() if not e.valid]
    for e in bad:
        print(f"corrupt: {e.folder}")
        if args.delete:
            shutil.rmtree(e.folder, ignore_errors=True)
    total = len(kcache.list_entries()) + (len(bad) if args.delete else 0)
    print(f"{plural(total, 'entry', 'entries')} checked, {len(bad)} corrupt" + (" (deleted)" if args.delete and bad else ""))
    failed = bool(bad) and not args.delete
    for folder in envs.aot_dirs():
        report = bundle.verify(folder)
        for entry, why in report.corrupt:
            print(f"corrupt: {entry.get('name')} ({entry.get('arch')}) in AOT bundle {folder}: {why}")
        if report.problem:
            print(f"AOT bundle {folder}: {report.problem}")
            failed = True
        dropped = 0
        if args.delete and report.corrupt and not report.problem:
            try:
                dropped = bundle.drop_entries(folder, {e["key"] for e, _ in report.corrupt
                                                       if "key" in e})
            except OSError as exc:
                print(f"cannot delete from {folder} ({exc}); rerun `pagedattn precompile ... "
                      f"--out {folder}` where it is writable")
        failed |= len(report.corrupt) > dropped
        print(f"AOT bundle {folder}: {plural(report.checked, 'kernel')} checked, "
              f"{len(report.corrupt)} corrupt"
              + (f" ({dropped} removed from the manifest)" if dropped else ""))
    return 1 if failed else 0


def add_parser(sub) -> None:
    p = sub.add_parser("cache", help="inspect or clear the JIT cache",
                       description="The JIT cache (PAGEDATTN_CACHE_DIR, default $XDG_CACHE_HOME/pagedattn "
                                   "or ~/.cache/pagedattn) and the bundles of PAGEDATTN_AOT_DIR.")
    csub = p.add_subparsers(dest="cache_command", required=True, metavar="{ls,clear,verify}")
    q = csub.add_parser("ls", help="list cache entries (and AOT bundle variants)",
                        description="One row per kernel: variant, arch, size, age, origin (jit or "
                                    "aot:DIR) and whether its hash checks. On a terminal a table as "
                                    "wide as the terminal; piped, plain aligned columns.")
    q.add_argument("--json", action="store_true", help="print one JSON object (every row, with its path)")
    q.set_defaults(func=_ls)
    q = csub.add_parser("clear", help="delete cache entries",
                        description="Delete JIT cache entries (bundles are never touched). Asks first "
                                    "on a terminal; elsewhere needs --yes.")
    q.add_argument("--older-than", type=float, metavar="DAYS", default=None,
                   help="only entries older than DAYS")
    q.add_argument("-y", "--yes", action="store_true", help="do not ask")
    q.add_argument("-n", "--dry-run", action="store_true", help="list what would be removed, remove nothing")
    q.set_defaults(func=_clear)
    q = csub.add_parser("verify", help="recompute hashes of the cache and of the PAGEDATTN_AOT_DIR "
                                       "bundles; report corrupt entries")
    q.add_argument("--delete", action="store_true",
                   help="delete corrupt entries (from a bundle: drop them from its manifest)")
    q.set_defaults(func=_verify)
