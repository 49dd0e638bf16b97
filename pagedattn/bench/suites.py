"""Suite name -> (available(ctx) -> (bool, reason), cases(ctx) -> [Case]). Modules load lazily."""
from __future__ import annotations

import importlib

ORDER = ("write", "decode", "prefill", "features", "legacy", "jit")
_TABLE = {
    "ceilings": ("ceilings", "available", "cases"),
    "write": ("write", "available", "cases"),
    "decode": ("attention", "available", "decode_cases"),
    "prefill": ("attention", "available", "prefill_cases"),
    "features": ("features", "available", "cases"),
    "legacy": ("legacy", "available", "cases"),
    "jit": ("jit", "available", "cases"),
    "_selftest": ("_selftest", "available", "cases"),  # the harness's own test (CPU), hidden
}


def get(name: str):
    if name not in _TABLE:
        raise KeyError(f"unknown suite {name!r}; known: {', '.join(ORDER)}")
    module, avail, cases = _TABLE[name]
    mod = importlib.import_module(f"pagedattn.bench.{module}")
    return getattr(mod, avail), getattr(mod, cases)


def parse(spec: str) -> list[str]:
    """'all' or a comma-separated list -> suite names in run order."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names or "all" in names:
        return list(ORDER)
    unknown = [n for n in names if n not in _TABLE or n == "ceilings"]
    if unknown:
        raise ValueError(f"unknown suite(s) {', '.join(unknown)}; choose from all, {', '.join(ORDER)}")
    return [n for n in ORDER if n in names] + [n for n in names if n not in ORDER]
