"""`pagedattn precompile ...` and `pagedattn bundle verify DIR` (pagedattn.aot does the work)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import aot
from .aot import FILTER_BY_OPTION, FILTERS, PRESETS, Selection, SelectionError, command_for, default_jobs
from .info import human_bytes, plural
from .registry import get_kernel


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _flatten(values) -> list[str]:
    return [v.strip() for item in (values or []) for v in item.split(",") if v.strip()]


def _selection_from_args(args) -> Selection:
    filters = {opt: _flatten(getattr(args, opt)) for opt in FILTER_BY_OPTION}
    return aot.select(ops=_flatten(args.ops), preset=args.preset, filters=filters,
                      model_configs=args.model_config or (), variants=args.variant or ())


def _cmd_precompile(args) -> int:
    from .codegen.errors import ToolchainError

    try:
        sel = _selection_from_args(args)
        archs = aot.resolve_archs(args.arch)
        jobs = aot.plan(sel.specs, archs)
    except (SelectionError, ToolchainError) as exc:
        print(f"pagedattn precompile: {exc}", file=sys.stderr)
        return 2
    unbuilt = [spec for spec in sel.specs if not any(spec.supports_arch(a) for a in archs)] if args.variant else []
    for spec in unbuilt:
        where = ", ".join(a for a in aot.resolve_archs("all") if spec.supports_arch(a)) or "no arch"
        print(f"pagedattn precompile: --variant {get_kernel(spec).name} is not built for {', '.join(archs)} "
              f"(it is for: {where})", file=sys.stderr)
    if unbuilt:
        return 2
    if args.out is None and not args.dry_run:
        print("pagedattn precompile: --out DIR is required (the bundle folder)", file=sys.stderr)
        return 2
    for m in sel.models:
        print(f"model {m.describe()}")
    for note in sel.notes:
        print(f"note: {note}")
    families = sorted({s.FAMILY for s in sel.specs})
    head = (f"{plural(len(jobs), 'kernel')} ({plural(len(sel.specs), 'variant')} of {', '.join(families)} x "
            f"{len(archs)} arch{'s' if len(archs) > 1 else ''}: {', '.join(archs)})")

    if args.dry_run:
        writer = None
        if args.out is not None:
            from .codegen.bundle import BundleWriter

            writer = BundleWriter(Path(args.out))
            if writer.discarded:
                print(f"note: the bundle in {args.out} would be replaced ({writer.discarded})")
        present = 0
        for job in jobs:
            state = "present" if writer is not None and writer.present(job.key) else "compile"
            present += state == "present"
            print(f"{job.name:48s} {job.arch:7s} {state}")
        print(f"dry run: {head}; {present} present, {len(jobs) - present} to compile")
        return 0

    out = Path(args.out)
    print(f"precompile: {head} -> {out}")
    summary = aot.precompile(jobs, out, n_jobs=args.jobs, progress=not args.quiet)
    if summary.discarded:
        print(f"note: replaced the previous manifest ({summary.discarded})")
    print(summary.line())
    for job, log_path in summary.failed:
        print(f"FAILED {job.label}: log {log_path}")
    if summary.failed:
        print(f"{len(summary.failed)} of {plural(summary.total, 'kernel')} failed; the bundle holds the "
              "others. Fix and rerun: only missing kernels are compiled.")
        return 1
    return 0


def _cmd_bundle_verify(args) -> int:
    from .codegen.bundle import verify

    folder = Path(args.dir)
    report = verify(folder)
    for entry, why in report.corrupt:
        print(f"corrupt: {entry.get('name')} ({entry.get('arch')}): {why}")
        spec_text = _entry_command(entry, folder)
        if spec_text:
            print(f"  rebuild: {spec_text}")
    for rel in report.stray:
        print(f"note: {rel} is not in the manifest (left by an interrupted run?)")
    if report.problem:
        print(f"bundle {folder}: {report.problem}")
    else:
        stale = _stale_entries(folder)
        if stale:
            print(f"note: {plural(len(stale), 'kernel')} {'was' if len(stale) == 1 else 'were'} built from other kernel sources than this "
                  f"install's and will never be looked up (e.g. {stale[0]}); rerun precompile")
    ms = sorted(report.read_ms)  # issue 19's goal: <= 50 ms a kernel
    read = f"; reading a kernel {ms[len(ms) // 2]:.1f} ms median, {ms[-1]:.1f} at most" if ms else ""
    print(f"{plural(report.checked, 'kernel')} checked, {len(report.corrupt)} corrupt, "
          f"{human_bytes(report.total_bytes)} intact: {'OK' if report.ok else 'NOT OK'}{read}")
    return 0 if report.ok else 1


def _stale_entries(folder: Path) -> list[str]:
    """Names of manifest entries whose key is not what this install computes for their spec (a
    bundle built from other templates/headers of the same version, e.g. in a development tree)."""
    from . import ops  # noqa: F401
    from .registry import FAMILIES

    manifest = json.loads((folder / "manifest.json").read_text())
    stale = []
    for entry in manifest.get("variants", []):
        cls = FAMILIES.get(entry.get("family", ""))
        try:
            key = aot.plan([cls(**entry["spec"])], [entry["arch"]])[0].key if cls else None
        except Exception:  # noqa: BLE001 - a spec this install no longer supports
            key = None
        if key != entry.get("key"):
            stale.append(f"{entry.get('name')} ({entry.get('arch')})")
    return stale


def _entry_command(entry: dict, folder: Path) -> str | None:
    from .registry import FAMILIES

    cls = FAMILIES.get(entry.get("family", ""))
    try:
        spec = cls(**entry["spec"]) if cls else None
    except Exception:  # noqa: BLE001 - a manifest of another version
        spec = None
    return command_for(spec, entry["arch"], folder) if spec is not None else None


def add_parser(sub) -> None:
    from .codegen.compile import SUPPORTED_ARCHS

    presets = "; ".join(f"{name}: {p['doc']}" for name, p in PRESETS.items())
    p = sub.add_parser(
        "precompile", help="compile kernels ahead of time into a relocatable bundle",
        description="Compile the selected kernel variants for the given archs into a bundle folder "
                    "(manifest.json + kernels/). Lists are comma-separated and flags may repeat. "
                    "Without any selector every registered variant is compiled. Use the bundle with "
                    "PAGEDATTN_AOT_DIR=DIR (and PAGEDATTN_DISABLE_JIT=1 to forbid compiling).")
    p.add_argument("--arch", default="native",
                   help=f"targets: native (every visible GPU), all, or a list of "
                        f"{', '.join(SUPPORTED_ARCHS)} (default: native)")
    p.add_argument("--ops", action="append", metavar="FAMILIES",
                   help="kernel families, e.g. kv_write,attn_fwd (default: all registered)")
    for flt in FILTERS:
        p.add_argument("--" + flt.option.replace("_", "-"), dest=flt.option, action="append",
                       metavar="LIST", help=f"{flt.what} (spec field {' or '.join(flt.fields)})")
    p.add_argument("--model-config", action="append", metavar="config.json",
                   help="Hugging Face config.json: narrows dtype (torch_dtype) and head size "
                        "(head_dim or hidden_size/num_attention_heads); explicit flags win; "
                        "several configs give the union")
    p.add_argument("--preset", choices=sorted(PRESETS), help=f"a documented matrix ({presets})")
    p.add_argument("--variant", action="append", metavar="'FAMILY:FIELD=VALUE ...'",
                   help="exactly one variant (repeatable), e.g. "
                        "'kv_write:dtype=bf16 kv_cache_dtype=auto path=span'")
    p.add_argument("--out", metavar="DIR", help="bundle folder (created; reruns add to it)")
    p.add_argument("-j", "--jobs", type=positive_int, default=None,
                   help=f"parallel compiler processes (default: CPU count, {default_jobs()} here)")
    p.add_argument("--dry-run", action="store_true",
                   help="list the matrix (and what --out already holds) without compiling")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=_cmd_precompile)

    p = sub.add_parser("bundle", help="inspect AOT bundles")
    bsub = p.add_subparsers(dest="bundle_command", required=True)
    q = bsub.add_parser("verify", help="recompute every hash of a bundle; nonzero exit if corrupt")
    q.add_argument("dir", metavar="DIR")
    q.set_defaults(func=_cmd_bundle_verify)


def main(argv=None) -> int:
    """`pagedattn precompile ...` / `pagedattn bundle verify ...` without the rest of the CLI
    (`python -m pagedattn.aotcli precompile ...`; the tests use it)."""
    from . import ops  # noqa: F401  (registers every kernel family)

    parser = argparse.ArgumentParser(prog="pagedattn")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
