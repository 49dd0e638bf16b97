"""Content-addressed kernel artifacts: memory dict → AOT bundles → disk cache → NVRTC.

A disk entry is one folder `<variant>-<arch>-<key16>/` holding `kernel.cubin`, `source.cu` and
`meta.json` (written last: an entry without a valid meta.json does not exist). Writes go to a temp file
followed by os.replace; one file lock per key, re-checked once taken, so racing processes compile once.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from .. import envs
from .compile import compile_source, nvrtc_options
from .errors import CompileError, MissingKernelError
from .render import headers_digest
from .toolchain import toolchain

log = logging.getLogger("pagedattn")

CUBIN, SOURCE, META = "kernel.cubin", "source.cu", "meta.json"


def package_version() -> str:
    from .. import __version__

    return __version__


@dataclass(frozen=True)
class Artifact:
    variant: str
    arch: str
    key: str
    cubin: bytes
    origin: str           # "memory", "aot:<dir>", "jit-disk", "jit-compiled", "jit-memory"
    path: Path | None = None


def key_material(variant: str, source: str, arch: str, options: list[str]) -> dict:
    """Everything a cubin depends on. Include paths are left out (machine-specific) and
    replaced by the header packages' versions and a digest of the shipped headers the source includes."""
    tc = toolchain()
    return {
        "variant": variant,
        "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
        "headers_sha256": headers_digest(source),
        "toolchain": tc.fingerprint(),
        "options": [o for o in options if not o.startswith("-I")],
        "arch": arch,
        "pagedattn": package_version(),
    }


def cache_key(material: dict) -> str:
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def entry_name(variant: str, arch: str, key: str) -> str:
    return f"{variant}-{arch}-{key[:16]}"


def atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; other users of a shared cache must read it
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_entry(folder: Path, key: str, *, quiet: bool = False) -> bytes | None:
    """The cubin of a valid entry, or None. A damaged entry (meta.json unreadable or not this key's,
    kernel.cubin missing, cut short or altered) is reported as missing, with one warning naming the
    damaged file unless `quiet` (a re-check of an entry already warned about)."""
    meta_path, cubin_path = folder / META, folder / CUBIN
    if not meta_path.is_file():
        return None  # absent, or being written: meta.json comes last
    try:
        meta = json.loads(meta_path.read_text())
        if not isinstance(meta, dict) or not isinstance(meta.get("key"), str):
            raise ValueError("not a cache entry's metadata")
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        problem = f"cache file {meta_path} is unreadable ({exc})"
    else:
        # The folder name holds 16 hex digits of the key: another key here means a damaged meta.json.
        if meta["key"] != key:
            problem = f"cache file {meta_path} names another key ({meta['key'][:16]}...)"
        else:
            try:
                cubin = cubin_path.read_bytes()
            except OSError as exc:
                problem = f"cache file {cubin_path} is unreadable ({exc})"
            else:
                if len(cubin) != meta.get("size"):
                    problem = (f"cache file {cubin_path} is corrupt ({len(cubin)} bytes, "
                               f"{meta_path} says {meta.get('size')})")
                elif hashlib.sha256(cubin).hexdigest() != meta.get("sha256"):
                    problem = f"cache file {cubin_path} is corrupt (sha256 differs from {meta_path})"
                else:
                    return cubin
    if not quiet:
        log.warning("%s: rebuilding", problem)
    return None


def write_entry(folder: Path, *, key: str, material: dict, variant: str, arch: str, cubin: bytes,
                source: str, options: list[str], seconds: float, origin: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    # A stale meta.json (rebuilding a damaged entry) goes first, so no reader pairs it with the new cubin.
    (folder / META).unlink(missing_ok=True)
    atomic_write(folder / SOURCE, source.encode())
    atomic_write(folder / CUBIN, cubin)
    meta = {
        "key": key,
        "variant": variant,
        "arch": arch,
        "sha256": hashlib.sha256(cubin).hexdigest(),
        "size": len(cubin),
        "compile_seconds": round(seconds, 3),
        "created": time.time(),
        "origin": origin,
        "options": [o for o in options if not o.startswith("-I")],
        "material": material,
    }
    atomic_write(folder / META, json.dumps(meta, indent=1, sort_keys=True).encode())


class KernelCache:
    """Process-wide front of the artifact store (see module docstring)."""

    def __init__(self):
        self._memory: dict[str, Artifact] = {}
        self._lock = threading.Lock()
        self._warned_readonly = False
        self.compiles = 0  # cold compiles done by this process (tests read it)

    def clear_memory(self) -> None:
        with self._lock:
            self._memory.clear()

    def get(self, variant: str, source: str, arch: str, *, debug: bool = False,
            precompile_hint: str | None = None) -> Artifact:
        options = nvrtc_options(arch, toolchain(), debug=debug)
        material = key_material(variant, source, arch, options)
        key = cache_key(material)
        hit = self._memory.get(key)
        if hit is not None:
            return hit
        with self._lock:  # one thread per process works on a miss; others wait and hit memory
            hit = self._memory.get(key)
            if hit is None:
                hit = self._resolve(variant, source, arch, options, material, key, precompile_hint)
                self._memory[key] = hit
        return hit

    # -- the slow path ----------------------------------------------------------------------------
    def _resolve(self, variant, source, arch, options, material, key, precompile_hint) -> Artifact:
        from . import bundle  # AOT bundles are searched first

        found = bundle.lookup(key)
        if found is not None:
            cubin, path = found
            return Artifact(variant, arch, key, cubin, f"aot:{path.parent.parent}", path)

        root = envs.cache_dir()
        folder = root / entry_name(variant, arch, key)
        cubin = read_entry(folder, key)
        if cubin is not None:
            return Artifact(variant, arch, key, cubin, "jit-disk", folder)

        if envs.jit_disabled():
            hint = precompile_hint or "pagedattn precompile --help"
            raise MissingKernelError(
                f"kernel {variant} for {arch} is not in any bundle of PAGEDATTN_AOT_DIR "
                f"({':'.join(map(str, envs.aot_dirs())) or 'unset'}) nor in the cache {root}, and "
                f"PAGEDATTN_DISABLE_JIT=1 forbids compiling it. Produce it with:\n  {hint}")

        try:
            folder.mkdir(parents=True, exist_ok=True)
            lock = FileLock(str(folder) + ".lock")
            lock.acquire()
        except OSError as exc:
            return self._compile_in_memory(variant, source, arch, options, key, exc)
        try:
            # Someone else may have finished while we waited; damage was warned about above.
            cubin = read_entry(folder, key, quiet=True)
            if cubin is not None:
                return Artifact(variant, arch, key, cubin, "jit-disk", folder)
            try:
                atomic_write(folder / SOURCE, source.encode())
            except OSError as exc:
                return self._compile_in_memory(variant, source, arch, options, key, exc)
            result = self._compile(variant, source, arch, options, str(folder / SOURCE))
            try:
                write_entry(folder, key=key, material=material, variant=variant, arch=arch,
                            cubin=result.cubin, source=source, options=options,
                            seconds=result.seconds, origin="jit")
            except OSError as exc:
                self._warn_readonly(exc)
                return Artifact(variant, arch, key, result.cubin, "jit-memory", None)
            return Artifact(variant, arch, key, result.cubin, "jit-compiled", folder)
        finally:
            lock.release()

    def _compile(self, variant, source, arch, options, source_path):
        log.info("compiling %s for %s (first use: in no bundle, not in the JIT cache; %s)...", variant, arch,
                 describe_estimate(compile_estimate(envs.cache_dir(), variant, arch), variant),
                 extra={"partial": True})
        try:
            result = compile_source(source, variant=variant, arch=arch, options=options,
                                    source_path=source_path)
        except CompileError as exc:
            log.info(" failed", extra={"tail": True})
            if exc.source_path is None:  # compiled in memory: keep the source where the user can open it
                kept = keep_source(variant, source)
                if kept is not None:
                    raise CompileError(variant, arch, exc.log, kept) from None
            raise
        except BaseException:
            log.info(" failed", extra={"tail": True})
            raise
        self.compiles += 1
        log.info(" %.1f s", result.seconds, extra={"tail": True})
        return result

    def _compile_in_memory(self, variant, source, arch, options, key, exc) -> Artifact:
        self._warn_readonly(exc)
        result = self._compile(variant, source, arch, options, None)
        return Artifact(variant, arch, key, result.cubin, "jit-memory", None)

    def _warn_readonly(self, exc: Exception) -> None:
        # Once per process (this object is the process's cache), not once per kernel.
        if not self._warned_readonly:
            self._warned_readonly = True
            log.warning("cache dir %s is not writable (%s): compiling in memory only, again in every "
                        "process; set PAGEDATTN_CACHE_DIR to a writable folder to keep compiled kernels",
                        envs.cache_dir(), exc)


def family_of(variant: str) -> str:
    """The family part of a variant name for estimates: its first two words (attn_fwd, kv_write)."""
    return "_".join(variant.split("_")[:2])


def compile_estimate(root: Path, variant: str, arch: str, most: int = 256) -> tuple[float, int] | None:
    """(median seconds, count) of the earlier compiles of `variant`'s family for `arch` recorded in
    the cache at `root` (meta.json of at most `most` entries), or None when it holds none."""
    prefix, tag = family_of(variant) + "_", f"-{arch}-"
    seconds = []
    try:
        names = sorted(n for n in os.listdir(root) if n.startswith(prefix) and tag in n)
    except OSError:
        return None
    for name in names[:most]:
        try:
            meta = json.loads((root / name / META).read_text())
            if meta.get("origin") == "jit":
                seconds.append(float(meta["compile_seconds"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if not seconds:
        return None
    seconds.sort()
    return seconds[len(seconds) // 2], len(seconds)


def describe_estimate(estimate: tuple[float, int] | None, variant: str) -> str:
    if estimate is None:
        return f"no earlier {family_of(variant)} compile here to estimate from"
    median, count = estimate
    return f"~{median:.0f} s, the median of {count} earlier {family_of(variant)} compile{'s' if count > 1 else ''} here"


def keep_source(variant: str, source: str) -> str | None:
    """Write a source NVRTC rejected to a temp file (the cache dir being unusable); its path, or None."""
    try:
        fd, path = tempfile.mkstemp(prefix=f"pagedattn-{variant}-", suffix=".cu")
        with os.fdopen(fd, "w") as f:
            f.write(source)
    except OSError:
        return None
    return path


_CACHE = KernelCache()


def kernel_cache() -> KernelCache:
    return _CACHE


# -- maintenance (the CLI's `cache ls / clear / verify`) -------------------------------------------
@dataclass
class EntryInfo:
    folder: Path
    variant: str
    arch: str
    size: int
    age_days: float
    origin: str
    valid: bool


def list_entries(root: Path | None = None) -> list[EntryInfo]:
    root = root or envs.cache_dir()
    out = []
    if not root.is_dir():
        return out
    now = time.time()
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        meta_path = folder / META
        try:
            meta = json.loads(meta_path.read_text())
            if not isinstance(meta, dict):
                raise ValueError("not a cache entry's metadata")
        except (OSError, ValueError):  # a failed or interrupted compile leaves only source.cu
            out.append(EntryInfo(folder, folder.name, "?", 0, 0.0, "incomplete", False))
            continue
        valid = read_entry(folder, meta.get("key", "")) is not None
        out.append(EntryInfo(folder, meta.get("variant", "?"), meta.get("arch", "?"),
                             meta.get("size", 0), (now - meta.get("created", now)) / 86400,
                             meta.get("origin", "jit"), valid))
    return out


def clear(root: Path | None = None, older_than_days: float | None = None) -> int:
    root = root or envs.cache_dir()
    removed = 0
    for entry in list_entries(root):
        if older_than_days is None or entry.age_days > older_than_days:
            shutil.rmtree(entry.folder, ignore_errors=True)
            try:
                os.unlink(str(entry.folder) + ".lock")
            except OSError:
                pass
            removed += 1
    return removed


def dir_size(root: Path) -> tuple[int, int]:
    """(bytes, entries) of a cache folder."""
    if not root.is_dir():
        return 0, 0
    total = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    entries = sum(1 for p in root.iterdir() if p.is_dir())
    return total, entries
