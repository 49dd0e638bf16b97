"""Every environment knob of pagedattn, read in one place.

Values are read on each access (cheap), so tests and long-running servers may change them.
"""
from __future__ import annotations

import os
from pathlib import Path

KNOBS = {
    "PAGEDATTN_CACHE_DIR": "JIT cache folder (default $XDG_CACHE_HOME/pagedattn or ~/.cache/pagedattn)",
    "PAGEDATTN_AOT_DIR": "':'-separated precompiled bundles searched before the JIT cache",
    "PAGEDATTN_DISABLE_JIT": "1: never compile; a missing kernel raises MissingKernelError",
    "PAGEDATTN_ARCH": "target override, e.g. sm_90a (compile on a machine without a GPU)",
    "PAGEDATTN_LOG_LEVEL": "logging level of the 'pagedattn' logger (default INFO)",
    "PAGEDATTN_DEBUG": "1: validate slot mappings and block tables on the host (syncs)",
}


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


# debug() runs on every kernel call: when the variable is unset (the usual case) one lookup in
# os.environ's own mapping answers, without encoding the name; os.environ writes update it.
_ENVIRON = getattr(os.environ, "_data", None)
_DEBUG_KEY = os.environ.encodekey("PAGEDATTN_DEBUG") if _ENVIRON is not None else None
# The steady paths of the ops test `DEBUG_KEY not in ENVIRON` inline (true: unset, debug() is False)
# and call debug() only otherwise: one Python frame less per call. Without os.environ's mapping,
# ENVIRON holds DEBUG_KEY, so that they always call debug().
ENVIRON = _ENVIRON if _ENVIRON is not None else {_DEBUG_KEY: None}
DEBUG_KEY = _DEBUG_KEY


def cache_dir() -> Path:
    explicit = os.environ.get("PAGEDATTN_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pagedattn"


def data_dir() -> Path:
    """Where pagedattn keeps what it produces for the user (bench results): $XDG_DATA_HOME/pagedattn
    or ~/.local/share/pagedattn (platformdirs' user data dir on Linux), whatever the working folder."""
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "pagedattn"


def bench_results_dir() -> Path:
    """`pagedattn bench --out` / `bench report --results` default; RESULTS.md goes beside it."""
    return data_dir() / "bench" / "results"


def aot_dirs() -> list[Path]:
    raw = os.environ.get("PAGEDATTN_AOT_DIR", "")
    return [Path(p).expanduser() for p in raw.split(":") if p.strip()]


def jit_disabled() -> bool:
    return _flag("PAGEDATTN_DISABLE_JIT")


def arch_override() -> str | None:
    value = os.environ.get("PAGEDATTN_ARCH", "").strip()
    return value or None


def log_level() -> str:
    return os.environ.get("PAGEDATTN_LOG_LEVEL", "INFO").strip().upper() or "INFO"


def debug() -> bool:
    if _ENVIRON is not None and _DEBUG_KEY not in _ENVIRON:
        return False
    return _flag("PAGEDATTN_DEBUG")


def snapshot() -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in KNOBS}
