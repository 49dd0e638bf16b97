"""`pagedattn cache ls | clear | verify`."""
from __future__ import annotations

import shutil
import sys

from . import envs
from .codegen import cache as kcache


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _ls(args) -> int:
    from rich.console import Console
    from rich.table import Table

    rows = kcache.list_entries()
    table = Table(title=f"pagedattn cache: {envs.cache_dir()}")
    for col in ("variant", "arch", "size", "age", "origin", "ok"):
        table.add_column(col)
    for e in rows:
        table.add_row(e.variant, e.arch, _human(e.size), f"{e.age_days:.1f} d", e.origin,
                      "yes" if e.valid else "CORRUPT")
    for folder in envs.aot_dirs():
        from .codegen.bundle import read_manifest

        manifest = read_manifest(folder)
        for v in (manifest or {}).get("variants", []):
            table.add_row(v["name"], v["arch"], _human(v["size"]), "-", f"aot:{folder}", "")
    Console().print(table)
    return 0


def _clear(args) -> int:
    n = kcache.clear(older_than_days=args.older_than)
    print(f"removed {n} cache entr{'y' if n == 1 else 'ies'} from {envs.cache_dir()}")
    return 0


def _verify(args) -> int:
    bad = [e for e in kcache.list_entries() if not e.valid]
    for e in bad:
        print(f"corrupt: {e.folder}")
        if args.delete:
            shutil.rmtree(e.folder, ignore_errors=True)
    total = len(kcache.list_entries()) + (len(bad) if args.delete else 0)
    print(f"{total} entries checked, {len(bad)} corrupt" + (" (deleted)" if args.delete and bad else ""))
    return 1 if bad and not args.delete else 0


def add_parser(sub) -> None:
    p = sub.add_parser("cache", help="inspect or clear the JIT cache")
    csub = p.add_subparsers(dest="cache_command", required=True)
    q = csub.add_parser("ls", help="list cache entries (and AOT bundle variants)")
    q.set_defaults(func=_ls)
    q = csub.add_parser("clear", help="delete cache entries")
    q.add_argument("--older-than", type=float, metavar="DAYS", default=None,
                   help="only entries older than DAYS")
    q.set_defaults(func=_clear)
    q = csub.add_parser("verify", help="recompute hashes; report corrupt entries")
    q.add_argument("--delete", action="store_true", help="delete corrupt entries")
    q.set_defaults(func=_verify)
