"""`pagedattn cache ls | clear | verify`."""
from __future__ import annotations

import shutil

from . import envs
from .codegen import cache as kcache
from .info import human_bytes


def _ls(args) -> int:
    from rich.console import Console
    from rich.table import Table

    rows = kcache.list_entries()
    table = Table(title=f"pagedattn cache: {envs.cache_dir()}")
    for col in ("variant", "arch", "size", "age", "origin", "ok"):
        table.add_column(col)
    for e in rows:
        table.add_row(e.variant, e.arch, human_bytes(e.size), f"{e.age_days:.1f} d", e.origin,
                      "yes" if e.valid else "CORRUPT")
    import time

    from .codegen.bundle import check_entry, read_manifest

    for folder in envs.aot_dirs():
        manifest = read_manifest(folder)  # a bundle of another install: warned, not listed
        for v in (manifest or {}).get("variants", []):
            age = f"{(time.time() - v['created']) / 86400:.1f} d" if "created" in v else "-"
            table.add_row(v["name"], v["arch"], human_bytes(v["size"]), age, f"aot:{folder}",
                          "yes" if check_entry(folder, v) is None else "CORRUPT")
    Console().print(table)
    return 0


def _clear(args) -> int:
    n = kcache.clear(older_than_days=args.older_than)
    print(f"removed {n} cache entr{'y' if n == 1 else 'ies'} from {envs.cache_dir()}")
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
    print(f"{total} entries checked, {len(bad)} corrupt" + (" (deleted)" if args.delete and bad else ""))
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
        print(f"AOT bundle {folder}: {report.checked} kernels checked, {len(report.corrupt)} corrupt"
              + (f" ({dropped} removed from the manifest)" if dropped else ""))
    return 1 if failed else 0


def add_parser(sub) -> None:
    p = sub.add_parser("cache", help="inspect or clear the JIT cache")
    csub = p.add_subparsers(dest="cache_command", required=True)
    q = csub.add_parser("ls", help="list cache entries (and AOT bundle variants)")
    q.set_defaults(func=_ls)
    q = csub.add_parser("clear", help="delete cache entries")
    q.add_argument("--older-than", type=float, metavar="DAYS", default=None,
                   help="only entries older than DAYS")
    q.set_defaults(func=_clear)
    q = csub.add_parser("verify", help="recompute hashes of the cache and of the PAGEDATTN_AOT_DIR "
                                       "bundles; report corrupt entries")
    q.add_argument("--delete", action="store_true",
                   help="delete corrupt entries (from a bundle: drop them from its manifest)")
    q.set_defaults(func=_verify)
