"""Relocatable AOT bundles: DIR/manifest.json + DIR/kernels/<entry>.cubin.

A bundle is usable only when it was made by the same pagedattn, NVRTC and header packages as this
process; any other bundle is skipped with one warning naming the mismatch.
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
from pathlib import Path

from .. import envs
from .toolchain import toolchain

log = logging.getLogger("pagedattn")

SCHEMA = 1
MANIFEST = "manifest.json"

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
    for field in ("schema", "pagedattn", "nvrtc", "cuda_headers", "packages"):
        if manifest.get(field) != want[field]:
            return f"{field}: bundle has {manifest.get(field)!r}, this install has {want[field]!r}"
    return None


def read_manifest(folder: Path) -> dict | None:
    path = folder / MANIFEST
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return None
    with _lock:
        cached = _manifests.get(folder)
        if cached and cached[0] == mtime:
            return cached[1]
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        _warn_once(folder, f"unreadable manifest ({exc})")
        manifest = None
    if manifest is not None:
        why = mismatch(manifest)
        if why:
            _warn_once(folder, why)
            manifest = None
        else:
            manifest["_by_key"] = {v["key"]: v for v in manifest.get("variants", [])}
    with _lock:
        _manifests[folder] = (mtime, manifest)
    return manifest


def _warn_once(folder: Path, why: str) -> None:
    if (folder, why) not in _warned:
        _warned.add((folder, why))
        log.warning("ignoring AOT bundle %s: %s", folder, why)


def lookup(key: str) -> tuple[bytes, Path] | None:
    """The cubin for a cache key from the first bundle in PAGEDATTN_AOT_DIR that holds it intact."""
    for folder in envs.aot_dirs():
        manifest = read_manifest(folder)
        if not manifest:
            continue
        entry = manifest["_by_key"].get(key)
        if entry is None:
            continue
        path = folder / entry["file"]
        try:
            cubin = path.read_bytes()
        except OSError:
            _warn_once(folder, f"missing file {entry['file']}")
            continue
        if len(cubin) != entry["size"] or hashlib.sha256(cubin).hexdigest() != entry["sha256"]:
            _warn_once(folder, f"corrupt file {entry['file']} (hash mismatch)")
            continue
        return cubin, path
    return None


def forget() -> None:
    """Drop cached manifests and warnings (tests, or after rewriting a bundle)."""
    with _lock:
        _manifests.clear()
        _warned.clear()
