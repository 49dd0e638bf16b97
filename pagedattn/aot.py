"""Ahead-of-time compilation: `pagedattn precompile` and `pagedattn bundle verify DIR`.

NVRTC needs no GPU, so a CPU-only build stage can compile every kernel a deployment will use into a
relocatable bundle (codegen/bundle.py: DIR/manifest.json + DIR/kernels/*.cubin). At run time
PAGEDATTN_AOT_DIR=DIR is searched before the JIT cache, and PAGEDATTN_DISABLE_JIT=1 turns any miss into
a MissingKernelError naming the `pagedattn precompile ...` command that produces the missing kernel.

Selection is generic over the registry: every family's variant space is its `SUPPORTED` fields, and the
CLI filters map onto fields by name where a family has them (FILTERS below). A family without a field
is not narrowed by that filter (the kv_write family has no head size, so `--head-sizes` leaves it whole).

Parallelism. Measured on the 2-core CI machine (kv_write variants, sm_90a, NVRTC 13.0, cuda-bindings
13.4): NVRTC does *not* hold the GIL -- a pure-Python counting thread kept 98 % of its speed while
another thread compiled -- yet two threads compiling at once took longer than compiling one after the
other (4 compiles: serial 4.4 s, 2 threads 5.2 s, each compile slowing from 1.1 s to 2-3 s): NVRTC
serializes compiles inside one process. Two worker processes did the same 4 compiles in 2.3 s (1.9x).
Hence a ProcessPoolExecutor; `--jobs 1` compiles in this process.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import shlex
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from .info import human_bytes

# -- the selection vocabulary --------------------------------------------------------------------------


@dataclass(frozen=True)
class Filter:
    option: str            # CLI flag without dashes
    fields: tuple          # spec field names it narrows (the first one a family has)
    what: str


FILTERS = (
    Filter("dtypes", ("dtype",), "activation / query dtype"),
    Filter("kv_cache_dtypes", ("kv_cache_dtype",), "what the KV cache stores"),
    Filter("head_sizes", ("head_dim", "head_size"), "head size"),
    Filter("layouts", ("layout",), "KV cache layout"),
    Filter("features", ("features",), "attention feature set (none, window, window+softcap, ...)"),
)
FILTER_BY_OPTION = {f.option: f for f in FILTERS}

# `--preset NAME`: the one place a documented matrix is defined. A value a family does not support is
# dropped quietly (presets are wider than any one family); None means every supported value.
PRESETS: dict[str, dict] = {
    "default": {
        "doc": "fp16 and bf16; head sizes 64, 80, 96, 128, 256 (Llama 3.2 1B/Qwen2.5 0.5B, "
               "Phi-2/Pythia, Phi-3, Llama/Mistral/Qwen/Mixtral, Gemma); every KV cache dtype "
               "(auto, fp8_e4m3, fp8_e5m2); every layout; every registered family",
        "dtypes": ("fp16", "bf16"),
        "kv_cache_dtypes": None,
        "head_sizes": (64, 80, 96, 128, 256),
        "layouts": None,
        "features": ("none",),  # feature variants: --features window,window+softcap,... (or JIT)
    },
}

_DTYPE_ALIASES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32",
                  "float": "fp32"}
_KV_ALIASES = {"fp8": "fp8_e4m3", "fp8e4m3": "fp8_e4m3", "fp8e5m2": "fp8_e5m2"}


def _norm(option: str, value) -> str:
    text = str(value).strip()
    low = text.lower()
    if option == "dtypes":
        return _DTYPE_ALIASES.get(low, low)
    if option == "kv_cache_dtypes":
        return _KV_ALIASES.get(low, low)
    return low


class SelectionError(ValueError):
    """The command line names nothing, or something the registry does not support."""


# -- Hugging Face model configs -----------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    path: str
    model_type: str | None
    head_size: int
    num_heads: int
    num_kv_heads: int
    dtype: str | None      # our short name, None when the config does not say

    def describe(self) -> str:
        group = self.num_heads // self.num_kv_heads if self.num_kv_heads else 0
        return (f"{Path(self.path).name}: {self.model_type or 'model'} head_size={self.head_size} "
                f"Hq={self.num_heads} Hkv={self.num_kv_heads} (group {group}) "
                f"dtype={self.dtype or 'unspecified'}")


def read_model_config(path) -> ModelConfig:
    """Head size (head_dim, else hidden_size / num_attention_heads), Hq, Hkv and dtype (torch_dtype,
    or `dtype` in newer transformers) of a Hugging Face config.json. Multimodal configs that keep the
    language model under `text_config` are read from there."""
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SelectionError(f"--model-config {path}: cannot read it ({exc})") from None
    if not isinstance(cfg, dict):
        raise SelectionError(f"--model-config {path}: not a JSON object")
    text = cfg.get("text_config")
    if isinstance(text, dict) and "num_attention_heads" not in cfg:
        cfg = {**cfg, **text}
    heads = cfg.get("num_attention_heads")
    if not isinstance(heads, int) or heads <= 0:
        raise SelectionError(f"--model-config {path}: no num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    head = cfg.get("head_dim")
    if not head:
        hidden = cfg.get("hidden_size")
        if not isinstance(hidden, int) or hidden % heads:
            raise SelectionError(f"--model-config {path}: no head_dim, and hidden_size={hidden!r} "
                                 f"is not a multiple of num_attention_heads={heads}")
        head = hidden // heads
    raw = cfg.get("torch_dtype") or cfg.get("dtype")
    dtype = None
    if raw not in (None, "auto"):
        dtype = _norm("dtypes", str(raw).replace("torch.", ""))
        if dtype not in ("fp16", "bf16", "fp32"):
            raise SelectionError(f"--model-config {path}: torch_dtype={raw!r} is not one of "
                                 "float16, bfloat16, float32")
    return ModelConfig(str(path), cfg.get("model_type"), int(head), heads, int(kv_heads), dtype)


# -- specs <-> command line ---------------------------------------------------------------------------


def spec_fields(spec) -> dict:
    """A spec's fields by name, without those left at None (a family's default)."""
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if getattr(spec, f.name) is not None}


def format_variant(spec) -> str:
    """`family:field=value ...`, the --variant form (registry.precompile_command prints it)."""
    fields = " ".join(f"{name}={value}" for name, value in spec_fields(spec).items())
    return f"{spec.FAMILY}:{fields}"


def _convert(cls, name: str, text: str):
    allowed = cls.SUPPORTED.get(name)
    if allowed is not None:
        for value in allowed:
            if str(value) == text:
                return value
        for value in allowed:
            if str(value).lower() == text.lower():
                return value
        raise SelectionError(f"--variant {cls.FAMILY}: {name}={text!r} is not supported; supported: "
                             f"{', '.join(map(str, allowed))}")
    ftype = {f.name: f.type for f in dataclasses.fields(cls)}[name]
    if ftype in (int, "int", "int | None"):
        return int(text)
    if ftype in (bool, "bool"):
        return text.lower() in ("1", "true", "yes")
    return text


def parse_variant(text: str):
    """The spec named by `family:field=value field=value` (commas also separate fields)."""
    from .registry import FAMILIES, UnsupportedError

    family, sep, rest = text.partition(":")
    family = family.strip()
    if not sep or family not in FAMILIES:
        raise SelectionError(f"--variant {text!r}: expected 'family:field=value ...' with a family "
                             f"among {', '.join(FAMILIES)}")
    cls = FAMILIES[family]
    names = [f.name for f in dataclasses.fields(cls)]
    given: dict[str, str] = {}
    for token in rest.replace(",", " ").split():
        name, eq, value = token.partition("=")
        if not eq or name not in names:
            raise SelectionError(f"--variant {text!r}: {token!r} is not field=value with a field of "
                                 f"{family} ({', '.join(names)})")
        given[name] = value
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in given
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise SelectionError(f"--variant {text!r}: missing " + ", ".join(
            f"{n} (one of {', '.join(map(str, cls.SUPPORTED.get(n, ('?',))))})" for n in missing))
    try:
        return cls(**{n: _convert(cls, n, v) for n, v in given.items()})
    except UnsupportedError as exc:
        raise SelectionError(f"--variant {text!r}: {exc}") from None


def resolve_archs(text: str) -> list[str]:
    """`sm_80,sm_90a`, `all`, or `native` (the arch of every visible GPU, via arch_for_device)."""
    from .codegen.compile import SUPPORTED_ARCHS

    out: list[str] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        if item == "native":
            import torch

            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0:
                raise SelectionError(
                    "--arch native: no CUDA GPU is visible here. Name the target(s) instead, e.g. "
                    f"--arch sm_90a (H100/H200) or --arch sm_80,sm_90a; supported: "
                    f"{', '.join(SUPPORTED_ARCHS)}")
            from .registry import arch_for_device

            archs = [arch_for_device(i) for i in range(count)]
        elif item == "all":
            archs = list(SUPPORTED_ARCHS)
        elif item in SUPPORTED_ARCHS:
            archs = [item]
        else:
            raise SelectionError(f"--arch {item!r} is not supported; use native, all or a list of "
                                 f"{', '.join(SUPPORTED_ARCHS)}")
        for arch in archs:
            if arch not in out:
                out.append(arch)
    if not out:
        raise SelectionError("--arch names no target")
    return out


@dataclass
class Selection:
    specs: list
    notes: list[str] = field(default_factory=list)
    models: list[ModelConfig] = field(default_factory=list)


def _family_field(cls, flt: Filter) -> str | None:
    # fields, and the derived properties a family selects by (AttnFwdSpec.features)
    names = {f.name for f in dataclasses.fields(cls)} | set(cls.SUPPORTED)
    return next((n for n in flt.fields if n in names), None)


def select(*, ops=None, preset: str | None = None, filters: dict[str, list] | None = None,
           model_configs=(), variants=()) -> Selection:
    """The specs a precompile run covers. Per filter the values come from (later wins) the preset,
    the model configs (dtype, head size) and the explicit flags; explicit and model values must be
    supported by some selected family, preset values are intersected quietly."""
    from .registry import FAMILIES

    filters = {k: v for k, v in (filters or {}).items() if v}
    if variants:
        if ops or preset or filters or model_configs:
            raise SelectionError("--variant selects exact variants; do not combine it with --ops, "
                                 "--preset, --model-config or the value filters")
        specs = []
        for text in variants:
            spec = parse_variant(text)
            if spec not in specs:
                specs.append(spec)
        return Selection(specs)

    ops = [o.strip() for o in (ops or []) if o.strip()]
    unknown = [o for o in ops if o not in FAMILIES]
    if unknown:
        raise SelectionError(f"--ops: unknown famil{'y' if len(unknown) == 1 else 'ies'} "
                             f"{', '.join(unknown)}; registered: {', '.join(FAMILIES)}")
    families = [FAMILIES[o] for o in (ops or FAMILIES)]
    sel = Selection([])

    wanted: dict[str, tuple[set[str], str | None]] = {}   # option -> (normalized values, source)
    # source None: a preset's values, intersected quietly; else the flag named in errors
    if preset is not None:
        if preset not in PRESETS:
            raise SelectionError(f"--preset {preset!r}: known presets: {', '.join(PRESETS)}")
        for option, values in PRESETS[preset].items():
            if option in FILTER_BY_OPTION and values is not None:
                wanted[option] = ({_norm(option, v) for v in values}, None)
    if model_configs:
        models = [m if isinstance(m, ModelConfig) else read_model_config(m) for m in model_configs]
        sel.models = models
        dtypes = {m.dtype for m in models if m.dtype}
        if dtypes:
            wanted["dtypes"] = (dtypes, "--model-config (dtype)")
        wanted["head_sizes"] = ({str(m.head_size) for m in models}, "--model-config (head size)")
    for option, values in filters.items():
        if option not in FILTER_BY_OPTION:
            raise SelectionError(f"unknown filter {option}")
        wanted[option] = ({_norm(option, v) for v in values}, "--" + option.replace("_", "-"))

    # check explicit values against what the selected families support
    for option, (values, flag) in wanted.items():
        flt = FILTER_BY_OPTION[option]
        strict = flag is not None
        having = [(cls, _family_field(cls, flt)) for cls in families]
        having = [(cls, name) for cls, name in having if name]
        if not having:
            if strict:
                sel.notes.append(f"{flag}: no selected family has a {'/'.join(flt.fields)} field; "
                                 "nothing is narrowed by it")
            continue
        known = {_norm(option, v) for cls, name in having for v in cls.SUPPORTED.get(name, ())}
        bad = sorted(values - known)
        if strict and bad:
            fams = "; ".join(f"{cls.FAMILY}: {', '.join(map(str, cls.SUPPORTED.get(name, ())))}"
                             for cls, name in having)
            raise SelectionError(f"{flag}: {', '.join(bad)} not supported by any selected family "
                                 f"({fams})")

    for cls in families:
        narrow = []
        for option, (values, _) in wanted.items():
            name = _family_field(cls, FILTER_BY_OPTION[option])
            if name:
                narrow.append((name, option, values))
        for spec in cls.all_variants():
            if all(_norm(option, getattr(spec, name)) in values for name, option, values in narrow):
                sel.specs.append(spec)
    if not sel.specs:
        raise SelectionError("no registered variant matches this selection "
                             "(see `pagedattn list` for each family's values)")
    return sel


# -- the compile plan ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    spec: object
    name: str
    arch: str
    source: str
    options: tuple
    key: str

    @property
    def label(self) -> str:
        return f"{self.name} ({self.arch})"


def plan(specs, archs) -> list[Job]:
    """One job per (spec, arch), with exactly the cache key the run-time lookup will compute."""
    from .codegen.cache import cache_key, key_material
    from .codegen.compile import nvrtc_options
    from .codegen.toolchain import toolchain
    from .registry import get_kernel

    tc = toolchain()
    jobs = []
    options = {arch: nvrtc_options(arch, tc, debug=False) for arch in archs}
    for spec in specs:
        kernel = get_kernel(spec)
        for arch in archs:
            if not spec.supports_arch(arch):
                continue
            key = cache_key(key_material(kernel.name, kernel.source, arch, options[arch]))
            jobs.append(Job(spec, kernel.name, arch, kernel.source, tuple(options[arch]), key))
    return jobs


def _compile_job(name: str, arch: str, source: str, options: tuple):
    """Runs in a worker process; returns plain data (never raises) so nothing odd is pickled."""
    from .codegen.compile import compile_source
    from .codegen.errors import CompileError

    try:
        result = compile_source(source, variant=name, arch=arch, options=list(options))
        return True, result.cubin, result.seconds, result.log
    except CompileError as exc:
        return False, b"", 0.0, f"NVRTC failed to compile {name} for {arch}\n\n{exc.log}"
    except BaseException:  # noqa: BLE001 - reported per variant, the run goes on
        return False, b"", 0.0, traceback.format_exc()


@dataclass
class Summary:
    total: int = 0
    compiled: int = 0
    present: int = 0
    failed: list[tuple[Job, Path]] = field(default_factory=list)
    seconds: float = 0.0
    jobs: int = 1
    bundle_kernels: int = 0
    bundle_bytes: int = 0
    discarded: str | None = None
    pruned: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (f"compiled {self.compiled}, already present {self.present}, failed "
                f"{len(self.failed)} in {self.seconds:.1f} s ({self.jobs} job"
                f"{'s' if self.jobs != 1 else ''}); bundle: {self.bundle_kernels} kernels, "
                f"{human_bytes(self.bundle_bytes)}")


class _Progress:
    """A rich progress bar on a terminal; one line per finished kernel otherwise (CI, docker build)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.bar = total, 0, None
        self.enabled = enabled and total > 0
        if not self.enabled:
            return
        from rich.console import Console

        self.console = Console(stderr=True)
        if self.console.is_terminal:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            self.bar = Progress(TextColumn("[bold]precompile"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                TextColumn("{task.description}"), console=self.console)
            self.task = self.bar.add_task("", total=total)

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def advance(self, job: Job, ok: bool, seconds: float) -> None:
        self.done += 1
        if not self.enabled:
            return
        status = f"{seconds:.1f} s" if ok else "FAILED"
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=f"{job.label} {status}")
        else:
            print(f"[{self.done}/{self.total}] {job.label} {status}", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()


def default_jobs() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _log_path(out: Path, job: Job) -> Path:
    from .codegen.bundle import LOGS

    return out / LOGS / f"{job.name}-{job.arch}.log"


def precompile(jobs: list[Job], out, *, n_jobs: int | None = None, progress: bool = True) -> Summary:
    """Compile every job whose kernel the bundle at `out` lacks (or holds corrupt) and record it in
    the manifest. Failures are logged to out/logs/<variant>-<arch>.log and do not stop the others."""
    from filelock import FileLock

    from .codegen.bundle import BundleWriter, write_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    n_jobs = max(1, n_jobs or default_jobs())
    with FileLock(str(out / ".precompile.lock")):   # two runs into one folder take turns
        writer = BundleWriter(out)
        summary = Summary(total=len(jobs), discarded=writer.discarded)
        todo, seen = [], set()
        for job in jobs:
            if writer.present(job.key):
                summary.present += 1
            elif job.key not in seen:
                seen.add(job.key)
                todo.append(job)
        summary.jobs = min(n_jobs, len(todo)) or 1

        def finish(job: Job, ok: bool, cubin: bytes, seconds: float, log_text: str) -> None:
            log_path = _log_path(out, job)
            if ok:
                writer.add(name=job.name, family=job.spec.FAMILY,
                           spec=spec_fields(job.spec),
                           arch=job.arch, key=job.key, cubin=cubin, compile_seconds=seconds)
                summary.compiled += 1
                log_path.unlink(missing_ok=True)
                log_path.with_suffix(".cu").unlink(missing_ok=True)
            else:
                log_path.parent.mkdir(parents=True, exist_ok=True)
                write_file(log_path.with_suffix(".cu"), job.source.encode())
                write_file(log_path, (f"variant: {job.name}\narch: {job.arch}\n"
                                        f"rebuild: {command_for(job.spec, job.arch, out)}\n"
                                        f"source: {log_path.with_suffix('.cu')}\n\n{log_text}\n"
                                        ).encode())
                summary.failed.append((job, log_path))

        pool = _Pool(todo, summary.jobs) if summary.jobs > 1 else None   # forks here
        clean = False
        try:
            with _Progress(len(todo), progress) as bar:
                results = pool.results() if pool else (
                    (job, _compile_job(job.name, job.arch, job.source, job.options)) for job in todo)
                last_save = time.monotonic()
                for job, (ok, cubin, seconds, log_text) in results:
                    finish(job, ok, cubin, seconds, log_text)
                    bar.advance(job, ok, seconds)
                    if time.monotonic() - last_save > 1.0:   # an interrupted run keeps its work
                        writer.save()
                        last_save = time.monotonic()
            clean = True
        finally:
            if pool:
                pool.close(wait=clean)
            if writer.dirty:
                writer.save()
        summary.pruned = writer.prune()
        summary.bundle_kernels = len(writer.entries)
        summary.bundle_bytes = writer.size()
    summary.seconds = time.perf_counter() - t0
    return summary


class _Pool:
    """Worker processes with every job submitted at construction.

    fork: workers inherit the imported modules and the loaded NVRTC (spawn would re-import torch,
    ~1 s per worker). A fork-context ProcessPoolExecutor forks all its workers at the first submit,
    which happens here, before the progress bar starts its refresh thread: no thread is forked."""

    def __init__(self, todo: list[Job], workers: int):
        from concurrent.futures import ProcessPoolExecutor

        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
        self.executor = ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
        self.futures = {self.executor.submit(_compile_job, j.name, j.arch, j.source, j.options): j
                        for j in todo}

    def results(self):
        from concurrent.futures import as_completed

        for fut in as_completed(self.futures):
            try:
                result = fut.result()
            except BaseException:  # noqa: BLE001 - a worker died (OOM kill, signal)
                result = (False, b"", 0.0, traceback.format_exc())
            yield self.futures[fut], result

    def close(self, wait: bool) -> None:
        self.executor.shutdown(wait=wait, cancel_futures=True)


def command_for(spec, arch: str, out) -> str:
    """The exact command that compiles one variant into a bundle (MissingKernelError's hint)."""
    return (f"pagedattn precompile --arch {arch} --variant {shlex.quote(format_variant(spec))} "
            f"--out {shlex.quote(str(out))}")


# -- the CLI ------------------------------------------------------------------------------------------


def _flatten(values) -> list[str]:
    return [v.strip() for item in (values or []) for v in item.split(",") if v.strip()]


def _selection_from_args(args) -> Selection:
    filters = {opt: _flatten(getattr(args, opt)) for opt in FILTER_BY_OPTION}
    return select(ops=_flatten(args.ops), preset=args.preset, filters=filters,
                  model_configs=args.model_config or (), variants=args.variant or ())


def _cmd_precompile(args) -> int:
    from .codegen.errors import ToolchainError

    try:
        sel = _selection_from_args(args)
        archs = resolve_archs(args.arch)
        jobs = plan(sel.specs, archs)
    except (SelectionError, ToolchainError) as exc:
        print(f"pagedattn precompile: {exc}", file=sys.stderr)
        return 2
    if args.out is None and not args.dry_run:
        print("pagedattn precompile: --out DIR is required (the bundle folder)", file=sys.stderr)
        return 2
    for m in sel.models:
        print(f"model {m.describe()}")
    for note in sel.notes:
        print(f"note: {note}")
    families = sorted({s.FAMILY for s in sel.specs})
    head = (f"{len(jobs)} kernels ({len(sel.specs)} variants of {', '.join(families)} x "
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
    summary = precompile(jobs, out, n_jobs=args.jobs, progress=not args.quiet)
    if summary.discarded:
        print(f"note: replaced the previous manifest ({summary.discarded})")
    print(summary.line())
    for job, log_path in summary.failed:
        print(f"FAILED {job.label}: log {log_path}")
    if summary.failed:
        print(f"{len(summary.failed)} of {summary.total} kernels failed; the bundle holds the "
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
            print(f"note: {len(stale)} kernel(s) were built from other kernel sources than this "
                  f"install's and will never be looked up (e.g. {stale[0]}); rerun precompile")
    print(f"{report.checked} kernels checked, {len(report.corrupt)} corrupt, "
          f"{human_bytes(report.total_bytes)} intact: {'OK' if report.ok else 'NOT OK'}")
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
            key = plan([cls(**entry["spec"])], [entry["arch"]])[0].key if cls else None
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
    p.add_argument("-j", "--jobs", type=int, default=None,
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
    (`python -m pagedattn.aot precompile ...`; the tests use it)."""
    from . import ops  # noqa: F401  (registers every kernel family)

    parser = argparse.ArgumentParser(prog="pagedattn")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
