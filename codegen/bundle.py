"""Relocatable AOT bundles: DIR/manifest.json + DIR/kernels/*.cubin.xz.

A bundle is usable only when it was made by the same pagedattn, NVRTC and header packages as this
process; any other bundle is skipped with one warning naming the mismatch.

manifest.json (schema 2): the header of `expected_header()` (schema, pagedattn, nvrtc, cuda_headers,
packages) and `variants`, a list of {name, family, spec, arch, key, file, sha256, size, compression,
stored_size, compile_seconds, program_size, created}. Kernels compiled as one NVRTC program (aot.build)
share one cubin, stored once as kernels/program-<arch>-<sha16>.cubin.xz: their entries name the same
file, sha256 and size, and each compile_seconds is its share of the program's. Cubins are stored
xz-compressed (stdlib lzma, preset 1: about 14x smaller, ~10 ms to decompress a 1.5 MiB cubin, once per
process); sha256 and size are those of the cubin itself, so corruption of the stored file is caught
either way. Schema 1 bundles (plain .cubin files, no compression field) are still read. `file` is
relative to the bundle folder, so a bundle can be moved or copied into an image anywhere; `key` is the
cache key (codegen.cache.cache_key), which leaves out include paths, so the same install on another
machine computes the same keys.
Failed compiles leave their NVRTC log under DIR/logs/ (not part of the manifest).
"""
from __future__ import annotations

import hashlib
import json
import logging
import lzma
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from .. import envs
from .toolchain import toolchain

log = logging.getLogger("pagedattn")

SCHEMA = 2
READABLE_SCHEMAS = (1, 2)     # schema 1: uncompressed cubins
MANIFEST = "manifest.json"
COMPRESSION = "xz"
_XZ_PRESET = 1                # 6 is ~10 % smaller and 6x slower to write; reading costs the same

_lock = threading.Lock()
_manifests: dict[Path, tuple[float, dict | None]] = {}   # dir -> (mtime, manifest or None)
_warned: set[tuple[Path, str]] = set()


def expected_header() -> dict:
    from .cache import package_version

    fp = toolchain().fingerprint()
    return {"schema": SCHEMA, "pagedattn": package_version(), "nvrtc": fp["nvrtc"],
            "cuda_headers": fp["cuda_headers"], "packages": fp["packages"]}


def mismatch(manifest: dict) -> str | None:
    """None when the manifest was made by this toolchain, else a sentence naming the difference."""
    want = expected_header()
    if manifest.get("schema") not in READABLE_SCHEMAS:
        return f"schema: bundle has {manifest.get('schema')!r}, this install reads {list(READABLE_SCHEMAS)}"
    for field in ("pagedattn", "nvrtc", "cuda_headers", "packages"):
        if manifest.get(field) != want[field]:
            return f"{field}: bundle has {manifest.get(field)!r}, this install has {want[field]!r}"
    return None


def read_manifest(folder: Path) -> dict | None:
    """The manifest of a bundle made by this install (with a `_by_key` index), else None (warned
    once when the folder holds a manifest this install cannot use)."""
    path = folder / MANIFEST
    try:
        st = path.stat()
    except OSError:
        _warn_once(folder, f"no {MANIFEST} there (make one with `pagedattn precompile ... --out "
                           f"{folder}`)")
        return None
    mtime = (st.st_mtime_ns, st.st_size)
    with _lock:
        cached = _manifests.get(folder)
        if cached and cached[0] == mtime:
            return cached[1]
    manifest, why = _load_manifest_file(folder)
    if manifest is not None:
        why = mismatch(manifest)
        if why:
            manifest = None
        else:
            manifest["_by_key"] = {v["key"]: v for v in manifest["variants"]
                                   if isinstance(v, dict) and "key" in v}
    if why:
        _warn_once(folder, why)
    with _lock:
        _manifests[folder] = (mtime, manifest)
    return manifest


def _warn_once(folder: Path, why: str, what: str = "AOT bundle") -> None:
    if (folder, why) not in _warned:
        _warned.add((folder, why))
        log.warning("ignoring %s %s: %s", what, folder, why)


def lookup(key: str) -> tuple[bytes, Path] | None:
    """The cubin for a cache key from the first bundle in PAGEDATTN_AOT_DIR that holds it intact."""
    for folder in envs.aot_dirs():
        manifest = read_manifest(folder)
        if not manifest:
            continue
        entry = manifest["_by_key"].get(key)
        if entry is None:
            continue
        cubin, why = read_checked(folder, entry)
        if cubin is None:
            _warn_once(folder, why, f"{entry.get('name')} ({entry.get('arch')}) of AOT bundle")
            continue
        return cubin, folder / entry["file"]
    return None


def forget() -> None:
    """Drop cached manifests and warnings (tests, or after rewriting a bundle)."""
    with _lock:
        _manifests.clear()
        _warned.clear()


# -- writing (`pagedattn precompile`) and checking (`pagedattn bundle verify`) ---------------------
KERNELS = "kernels"
LOGS = "logs"


def kernel_file(variant: str, arch: str, key: str) -> str:
    """Path of a cubin inside a bundle, relative to the bundle folder (bundles are relocatable)."""
    from .cache import entry_name

    return f"{KERNELS}/{entry_name(variant, arch, key)}.cubin.xz"


def pack(cubin: bytes) -> bytes:
    """A cubin as a bundle stores it (COMPRESSION)."""
    return lzma.compress(cubin, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=_XZ_PRESET)


def unpack(stored: bytes, compression: str | None) -> bytes:
    """The cubin of a stored file; raises ValueError when it cannot be decoded."""
    if not compression:
        return stored
    if compression != COMPRESSION:
        raise ValueError(f"unknown compression {compression!r}")
    try:
        return lzma.decompress(stored, format=lzma.FORMAT_XZ)
    except lzma.LZMAError as exc:
        raise ValueError(f"undecodable {compression} data ({exc})") from None


def _umask() -> int:
    try:  # Linux: read it without touching it (os.umask sets it, racing other threads)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_file(path: Path, data: bytes) -> None:
    """atomic_write, then the permissions of a plain new file (mkstemp makes 0600): a bundle built
    as root in a Docker build stage must stay readable by the serving user."""
    from .cache import atomic_write

    atomic_write(path, data)
    try:
        os.chmod(path, 0o666 & ~_umask())
    except OSError:
        pass


def _safe_relative(file: str) -> bool:
    p = PurePosixPath(file)
    return bool(file) and not p.is_absolute() and ".." not in p.parts


def read_checked(folder: Path, entry: dict) -> tuple[bytes | None, str | None]:
    """(cubin, None) when the entry's file is present and matches its size and sha256, else
    (None, why not)."""
    file = entry.get("file", "")
    if not isinstance(file, str) or not _safe_relative(file):
        return None, f"file {file!r} is not a relative path inside the bundle"
    try:
        stored = (folder / file).read_bytes()
    except OSError as exc:
        return None, f"missing file {file} ({exc.strerror or exc})"
    try:
        cubin = unpack(stored, entry.get("compression"))
    except ValueError as exc:
        return None, f"corrupt file {file}: {exc}"
    if len(cubin) != entry.get("size"):
        return None, f"corrupt file {file}: {len(cubin)} bytes, manifest says {entry.get('size')}"
    if hashlib.sha256(cubin).hexdigest() != entry.get("sha256"):
        return None, f"corrupt file {file}: sha256 mismatch"
    return cubin, None


def check_entry(folder: Path, entry: dict) -> str | None:
    """None when the entry's file is intact, else why not."""
    return read_checked(folder, entry)[1]


def _load_manifest_file(folder: Path) -> tuple[dict | None, str | None]:
    """(manifest, None) or (None, why); a folder without manifest.json gives (None, None)."""
    path = folder / MANIFEST
    if not path.exists():
        return None, None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return None, f"unreadable manifest ({exc})"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("variants", []), list):
        return None, "manifest.json is not a pagedattn bundle manifest"
    return manifest, None


class BundleWriter:
    """Adds cubins to a bundle folder and keeps its manifest.json in step.

    Entries of an existing manifest made by this install are kept (a rerun only adds what is missing
    or broken); a manifest made by another install is replaced, and `discarded` says why. Files are
    written with atomic_write, the manifest last, so a reader never sees an entry without its file.
    """

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.discarded: str | None = None
        self.entries: dict[str, dict] = {}      # cache key -> manifest entry
        self._intact: dict[str, tuple] = {}      # file -> (sha256, size, compression) it was found to hold
        manifest, why = _load_manifest_file(self.folder)
        if manifest is not None:
            why = mismatch(manifest)
            if why is None:
                self.entries = {v["key"]: v for v in manifest["variants"] if "key" in v}
        self.discarded = why
        self.dirty = why is not None or manifest is None   # save() has something to write

    def present(self, key: str) -> bool:
        """The bundle holds this key and its file is intact (each file read once: programs share one)."""
        entry = self.entries.get(key)
        if entry is None:
            return False
        memo = (entry.get("sha256"), entry.get("size"), entry.get("compression"))
        if self._intact.get(entry.get("file")) != memo:
            if check_entry(self.folder, entry) is not None:
                return False
            self._intact[entry["file"]] = memo
        return True

    def add_program(self, kernels: list[dict], cubin: bytes) -> list[dict]:
        """Entries for kernels that one cubin holds (one NVRTC program: aot.build), all of one arch,
        each given as {name, family, spec, arch, key, compile_seconds}, stored in one file. A kernel's
        compile_seconds is its share of the program's; program_size says how many shared it."""
        for k in kernels:
            for old_key in [o for o, v in self.entries.items()
                            if v.get("name") == k["name"] and v.get("arch") == k["arch"] and o != k["key"]]:
                self.remove(old_key)   # built from older sources: its key can never be asked for again
        first = kernels[0]
        digest = hashlib.sha256(cubin).hexdigest()
        file = (kernel_file(first["name"], first["arch"], first["key"]) if len(kernels) == 1 else
                f"{KERNELS}/program-{first['arch']}-{digest[:16]}.cubin.xz")
        (self.folder / KERNELS).mkdir(parents=True, exist_ok=True)
        stored = pack(cubin)
        write_file(self.folder / file, stored)
        self._intact.pop(file, None)
        created = round(time.time(), 3)
        added = []
        for k in kernels:
            entry = {**k, "file": file, "sha256": digest, "size": len(cubin), "compression": COMPRESSION,
                     "stored_size": len(stored), "compile_seconds": round(k["compile_seconds"], 3),
                     "program_size": len(kernels), "created": created}
            self.entries[k["key"]] = entry
            added.append(entry)
        self.dirty = True
        return added

    def remove(self, key: str) -> None:
        """Drop an entry, and its file unless another entry (of the same program) still names it."""
        entry = self.entries.pop(key, None)
        self.dirty = True
        if entry and _safe_relative(entry.get("file", "")) and \
                all(v.get("file") != entry["file"] for v in self.entries.values()):
            self._intact.pop(entry["file"], None)
            try:
                (self.folder / entry["file"]).unlink()
            except OSError:
                pass

    def manifest(self) -> dict:
        variants = sorted(self.entries.values(), key=lambda v: (v["name"], v["arch"], v["key"]))
        return {**expected_header(), "variants": variants}

    def save(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        data = json.dumps(self.manifest(), indent=1, sort_keys=True).encode()
        write_file(self.folder / MANIFEST, data)
        self.dirty = False
        with _lock:  # this process's readers must see the new manifest even within one mtime tick
            _manifests.clear()

    def prune(self) -> list[str]:
        """Delete cubins under kernels/ that the manifest does not name (left by an interrupted run
        or by a replaced manifest). Returns their relative paths."""
        keep = {v["file"] for v in self.entries.values()}
        removed = []
        kdir = self.folder / KERNELS
        if kdir.is_dir():
            for p in sorted([*kdir.glob("*.cubin"), *kdir.glob("*.cubin.xz")]):
                rel = f"{KERNELS}/{p.name}"
                if rel not in keep:
                    try:
                        p.unlink()
                        removed.append(rel)
                    except OSError:
                        pass
        return removed

    def size(self) -> int:
        """Bytes on disk (stored, i.e. compressed, sizes; a program's file once)."""
        return sum(v.get("stored_size", v["size"]) for v in _by_file(self.entries.values()))

    def cubin_size(self) -> int:
        """Bytes of the cubins once decompressed."""
        return sum(v["size"] for v in _by_file(self.entries.values()))


def _by_file(entries) -> list[dict]:
    """One entry per stored file (the kernels of one program share theirs)."""
    return list({v.get("file"): v for v in entries}.values())


@dataclass
class VerifyReport:
    folder: Path
    problem: str | None = None                       # the bundle as a whole is unusable here
    checked: int = 0
    corrupt: list[tuple[dict, str]] = field(default_factory=list)
    stray: list[str] = field(default_factory=list)   # files in kernels/ the manifest does not name
    total_bytes: int = 0
    read_ms: list[float] = field(default_factory=list)  # per entry: read, decompress, size and sha256 check

    @property
    def ok(self) -> bool:
        return self.problem is None and not self.corrupt


def verify(folder: Path) -> VerifyReport:
    """Recompute every hash of a bundle and check it was made by this install."""
    folder = Path(folder)
    report = VerifyReport(folder)
    manifest, why = _load_manifest_file(folder)
    if manifest is None:
        report.problem = why or f"no {MANIFEST} in {folder}"
        return report
    why = mismatch(manifest)
    if why:  # the files may be intact, but this install would ignore the bundle
        report.problem = f"made by another install, so it would be ignored here: {why}"
    named = set()
    for entry in manifest["variants"]:
        report.checked += 1
        t0 = time.perf_counter()
        bad = check_entry(folder, entry)
        report.read_ms.append(1e3 * (time.perf_counter() - t0))
        if bad:
            report.corrupt.append((entry, bad))
        elif entry.get("file") not in named:  # a program's file counts once
            report.total_bytes += entry.get("stored_size", entry["size"])
        named.add(entry.get("file"))
    kdir = folder / KERNELS
    if kdir.is_dir():
        report.stray = [f"{KERNELS}/{p.name}" for p in sorted(kdir.iterdir())
                        if f"{KERNELS}/{p.name}" not in named and not p.name.startswith(".")]
    return report


def drop_entries(folder: Path, keys: set[str]) -> int:
    """Remove entries (and their files) from a bundle made by this install; returns how many."""
    writer = BundleWriter(folder)
    if writer.discarded:
        return 0
    n = 0
    for key in keys:
        if key in writer.entries:
            writer.remove(key)
            n += 1
    if n:
        writer.save()
    return n
