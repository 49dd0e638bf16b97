"""The results file (`pagedattn-bench/1`, perf/README.md "The results file"): new records, the derived numbers
(throughput, fraction of the ceiling, ratios, goals met) and a light validator. Timed under several methods,
an Impl's headline numbers are the WORSE method's and each ratio is the smallest over the methods both sides
have, so a goal met on the headline holds under every method.
"""
from __future__ import annotations

import math

SCHEMA = "pagedattn-bench/1"
SUITES = ("write", "decode", "prefill", "features", "legacy", "jit", "sweep")  # legacy: files up to issue 20
STATUSES = ("ok", "check_failed", "error", "skipped", "crashed", "timeout")
METHODS = ("rot", "flush")  # timing.METHODS (not imported: this module needs no torch)
CEILING_UNIT = {"copy": "GB/s", "matmul": "TFLOP/s"}
REQUIRED_METADATA = ("sample", "gpu", "sm_count", "capability", "arch", "driver", "cuda", "torch", "pagedattn",
                     "git_commit", "date", "quick", "suites")


class SchemaError(ValueError):
    pass


def new_case(case_id: str, suite: str, params: dict | None = None) -> dict:
    return {"id": case_id, "suite": suite, "params": dict(params or {}), "status": "ok", "error": None, "unit": None,
            "work": None, "ceiling": None, "ours": None, "peers": {}, "ratios": {}, "check": None, "target": None,
            "goals": [], "notes": None, "extra": {}}


def impl_from_methods(name: str, timings: dict) -> dict:
    """An Impl from {method: timing.timing(...)}: the slower method's numbers, and with two or more
    methods each one's under `methods` (value / fraction filled by `derive`)."""
    out = {"name": name, "value": None, "fraction": None, "error": None,
           **max(timings.values(), key=lambda t: t["us"])}
    if len(timings) > 1:
        out["methods"] = {m: {k: v for k, v in t.items() if k != "method"} | {"value": None, "fraction": None}
                          for m, t in timings.items()}
    return out


def impl_error(name: str, error: str) -> dict:
    return {"name": name, "error": error}


def throughput(unit: str | None, work: float | None, us: float | None) -> float | None:
    """GB/s from bytes or TFLOP/s from flops over a time in microseconds."""
    if not work or not us or us <= 0 or unit not in ("GB/s", "TFLOP/s"):
        return None
    return work / (us * (1e3 if unit == "GB/s" else 1e6))


def ceiling_value(ceilings: dict | None, which: str | None) -> float | None:
    v = ((ceilings or {}).get(which) or {}).get("value") if which else None
    return v if isinstance(v, (int, float)) and v > 0 else None


def _ok(impl: dict | None) -> bool:
    return bool(impl) and not impl.get("error") and bool(impl.get("us"))


def derive(case: dict, ceilings: dict | None) -> dict:
    """Fill value (throughput), fraction of the ceiling (per method too), the floor (the work at the ceiling,
    µs), the ratio to each peer (the method least favourable to ours) and whether the goals are met."""
    ceil, unit = ceiling_value(ceilings, case.get("ceiling")), case.get("unit")
    ours, peers = case.get("ours"), case.get("peers", {})
    for impl in [i for i in [ours, *peers.values()] if i and not i.get("error") and i.get("us") is not None]:
        for entry in [impl] + [e for e in (impl.get("methods") or {}).values() if e.get("us")]:
            if unit in ("GB/s", "TFLOP/s"):
                entry["value"] = throughput(unit, case.get("work"), entry["us"])
            if ceil and entry.get("value") is not None:
                entry["fraction"] = entry["value"] / ceil
    floor = throughput(unit, case.get("work"), 1.0)  # the throughput of one µs, so work / ceiling in µs
    case["floor_us"] = floor / ceil if floor and ceil else None
    ratios, by_method = {}, {}
    for name, peer in peers.items() if _ok(ours) else ():
        if _ok(peer):
            om, pm = ours.get("methods") or {}, peer.get("methods") or {}
            by = {m: pm[m]["us"] / om[m]["us"] for m in METHODS if m in pm and m in om and pm[m].get("us")
                  and om[m].get("us")}
            ratios[name] = min(by.values()) if by else peer["us"] / ours["us"]
            for m, r in by.items():
                by_method.setdefault(m, {})[name] = r
    case["ratios"] = ratios
    case.pop("ratios_by_method", None)
    if by_method:
        case["ratios_by_method"] = by_method
    if isinstance(case.get("target"), dict):
        case["target"]["met"] = target_met(case["target"], ours)
    for goal in case.get("goals") or []:  # unit "ratio": ratios[peer] >= value
        r = ratios.get(goal.get("peer"))
        goal["met"] = None if not _ok(ours) or r is None or goal.get("value") is None else bool(r >= goal["value"])
    return case


def target_met(target: dict, ours: dict | None) -> bool | None:
    """Units "us", "s", "ms" (at most), "fraction" (of the ceiling, at least), "GB/s", "TFLOP/s" (at least)."""
    if not ours or ours.get("error"):
        return None
    unit, goal = target.get("unit"), target.get("value")
    have = ours.get({"us": "us", "fraction": "fraction"}.get(unit, "value"))
    if have is None or goal is None:
        return None
    return bool(have <= goal) if unit in ("us", "s", "ms") else bool(have >= goal)


# -- validation: the structure that report.py and compare rely on ----------------------------------------
def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _impl_problems(where: str, impl) -> list[str]:
    if not isinstance(impl, dict) or impl.get("error") is not None:
        return [] if isinstance(impl, dict) and isinstance(impl["error"], str) else [f"{where}: bad impl"]
    entries = {where: impl, **{f"{where}.methods.{m}": e for m, e in (impl.get("methods") or {}).items()}}
    out = [f"{at}.us: must be a positive number" for at, e in entries.items() if not _positive(e.get("us"))]
    out += [f"{where}.methods: unknown method {m!r}" for m in impl.get("methods") or {} if m not in METHODS]
    if impl.get("methods") and not out and impl["us"] != max(e["us"] for e in impl["methods"].values()):
        out.append(f"{where}.us: must be the worse (larger) of its methods' medians")
    return out


def validate_case(case: dict, where: str = "case") -> list[str]:
    where = f"{where} {case.get('id')!r}"
    status, peers = case.get("status"), case.get("peers") or {}
    rules = [(status in STATUSES, f"status {status!r} not in {STATUSES}"),
             (status not in ("ok", "check_failed") or case.get("ours") is not None,
              f"status {status!r} needs an 'ours' measurement"),
             (status not in ("error", "crashed", "timeout") or case.get("error"),
              f"status {status!r} needs an error message"),
             (all(name in peers for name in case.get("ratios") or {}), "a ratio for an unknown peer"),
             (all(g.get("unit") == "ratio" and g.get("peer") for g in case.get("goals") or []),
              "goals must be {'unit': 'ratio', 'value', 'peer', 'met'}")]
    impls = {".ours": case["ours"]} if case.get("ours") is not None else {}
    impls.update({f".peers[{n!r}]": impl for n, impl in peers.items()})
    return ([f"{where}: {message}" for ok, message in rules if not ok]
            + [p for at, impl in impls.items() for p in _impl_problems(where + at, impl)])


def validate(results) -> list[str]:
    """Every problem found in a results object, as readable strings ([] = valid)."""
    if not isinstance(results, dict) or results.get("schema") != SCHEMA:
        return [f"schema: expected {SCHEMA!r}"]
    meta, ceilings = results.get("metadata") or {}, results.get("ceilings") or {}
    errors = [f"metadata: missing key {key!r}" for key in REQUIRED_METADATA if key not in meta]
    errors += [] if isinstance(meta.get("sample"), bool) else ["metadata.sample: must be true or false"]
    errors += [f"ceilings.{n}.value: must be a number" for n, c in ceilings.items()
               if c and not c.get("error") and not _positive(c.get("value"))]
    for name, suite in (results.get("suites") or {}).items():
        if name not in SUITES and not name.startswith("_"):  # "_name": the harness's own tests
            errors.append(f"suites.{name}: unknown suite (known: {', '.join(SUITES)})")
        ids = [c.get("id") for c in suite.get("cases", [])]
        errors += [f"suites.{name}: duplicate case id {cid!r}" for i, cid in enumerate(ids) if cid in ids[:i]]
        errors += [e for i, c in enumerate(suite.get("cases", [])) for e in validate_case(c, f"suites.{name}[{i}]")]
    return errors


def check(results, source: str = "results"):
    """`results`, or SchemaError with what `validate` found."""
    errors = validate(results)
    if errors:
        raise SchemaError(f"{source} is not a valid {SCHEMA} file:\n  " + "\n  ".join(errors[:20]))
    return results


def all_cases(results: dict):
    for suite in results.get("suites", {}).values():
        yield from suite.get("cases", [])
