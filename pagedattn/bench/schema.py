"""The results file: its shape, the derived numbers, and a validator (no extra dependency).

A results file is one JSON object::

    {"schema": "pagedattn-bench/1",
     "metadata": {...},                       # the machine and software, see REQUIRED_METADATA
     "ceilings": {"copy": Impl, "matmul": Impl},   # each null when not measured
     "suites": {"write": {"status", "reason", "seconds", "cases": [Case, ...]}, ...}}

A Case is one measured configuration::

    {"id": "write/NHD/bf16/T65536", "suite": "write", "params": {...},
     "status": "ok" | "check_failed" | "error" | "skipped" | "crashed" | "timeout",
     "error": str | null,
     "unit": "GB/s" | "TFLOP/s" | "s" | "ms" | "us",   # what `value` is in
     "work": bytes (GB/s) or flops (TFLOP/s) | null,
     "ceiling": "copy" | "matmul" | null,             # which ceiling `fraction` is of
     "ours": Impl | null, "peers": {name: Impl}, "ratios": {name: peer_us / ours_us},
     "ratios_by_method": {method: {name: ratio}},     # when ours and the peer have `methods`
     "floor_us": float | null,                        # work / the ceiling: the bytes (or flops) alone
     "check": {"ok": bool, "kind": str, "detail": str, ...} | null,
     "target": {"value": float, "unit": "us"|"s"|"ms"|"fraction"|"GB/s"|"TFLOP/s", "met": bool|null}
               | null,                                  # a goal from the issues; met is derived
     "goals": [{"value": float, "unit": "ratio", "peer": name, "met": bool|null}, ...],
               # relative goals: ratios[peer] >= value (e.g. ahead of cuDNN: 1.0)
     "notes": str | null, "extra": {...}}

An Impl is {"name", "us" (median), "p10", "p90", "min", "reps", "sets", "method", "value", "fraction",
"error"}; a failed peer keeps only name and error. `ratios` > 1 means ours is faster than that peer.
Timed under several methods (timing.METHODS: "rot" back to back with rotated inputs, "flush" with
the L2 flushed before every call), an Impl also has "methods": {method: {"us", "p10", "p90", "min",
"reps", "sets", "value", "fraction"}}, and its headline numbers (us, value, fraction, `method`) are the
WORSE method's; each ratio is then the smallest over the methods both sides have (the least
favourable to ours), so a goal met on the headline holds under every method.
"""
from __future__ import annotations

import math

SCHEMA = "pagedattn-bench/1"
SUITES = ("write", "decode", "prefill", "features", "legacy", "jit")
STATUSES = ("ok", "check_failed", "error", "skipped", "crashed", "timeout")
SUITE_STATUSES = ("ok", "partial", "skipped", "error")
UNITS = ("GB/s", "TFLOP/s", "s", "ms", "us")
METHODS = ("rot", "flush")  # timing.METHODS (not imported: this module needs no torch)
CEILINGS = ("copy", "matmul")
CEILING_UNIT = {"copy": "GB/s", "matmul": "TFLOP/s"}
REQUIRED_METADATA = ("sample", "gpu", "sm_count", "capability", "arch", "driver", "cuda", "torch",
                     "pagedattn", "git_commit", "date", "quick", "suites")
CASE_KEYS = ("id", "suite", "params", "status", "error", "unit", "work", "ceiling", "ours", "peers",
             "ratios", "check")


def new_case(case_id: str, suite: str, params: dict | None = None) -> dict:
    return {"id": case_id, "suite": suite, "params": dict(params or {}), "status": "ok", "error": None,
            "unit": None, "work": None, "ceiling": None, "ours": None, "peers": {}, "ratios": {},
            "check": None, "target": None, "goals": [], "notes": None, "extra": {}}


def impl_from_timing(name: str, timing: dict) -> dict:
    """An Impl from timing.Timing.as_dict() (value/fraction filled by `derive`)."""
    out = {"name": name, "value": None, "fraction": None, "error": None}
    out.update(timing)
    return out


def impl_from_methods(name: str, timings: dict) -> dict:
    """An Impl from {method: timing.Timing.as_dict()}: headline numbers from the slower method."""
    if len(timings) == 1:
        return impl_from_timing(name, next(iter(timings.values())))
    worst = max(timings, key=lambda m: timings[m]["us"])
    out = impl_from_timing(name, timings[worst])
    out["methods"] = {m: {k: v for k, v in t.items() if k != "method"} | {"value": None, "fraction": None}
                      for m, t in timings.items()}
    return out


def impl_error(name: str, error: str) -> dict:
    return {"name": name, "error": error}


def throughput(unit: str | None, work: float | None, us: float | None) -> float | None:
    """GB/s from bytes or TFLOP/s from flops over a time in microseconds."""
    if not work or not us or us <= 0 or unit not in ("GB/s", "TFLOP/s"):
        return None
    return work / (us * 1e3) if unit == "GB/s" else work / (us * 1e6)


def ceiling_value(ceilings: dict | None, which: str | None) -> float | None:
    if not ceilings or not which:
        return None
    c = ceilings.get(which)
    if not isinstance(c, dict):
        return None
    v = c.get("value")
    return v if isinstance(v, (int, float)) and v > 0 else None


def _fill(entry: dict, case: dict, ceil: float | None) -> None:
    if case.get("unit") in ("GB/s", "TFLOP/s"):
        entry["value"] = throughput(case["unit"], case.get("work"), entry["us"])
    if ceil and entry.get("value") is not None:
        entry["fraction"] = entry["value"] / ceil


def floor_us(case: dict, ceilings: dict | None) -> float | None:
    """The case's work at the ceiling of the same run, in µs (K/V bytes / copy bandwidth for decode)."""
    ceil = ceiling_value(ceilings, case.get("ceiling"))
    work = case.get("work")
    if not ceil or not work or case.get("unit") not in ("GB/s", "TFLOP/s"):
        return None
    return work / (ceil * (1e3 if case["unit"] == "GB/s" else 1e6))


def _ratio(peer: dict, ours: dict) -> tuple[float, dict]:
    """(the ratio least favourable to ours, {method: ratio}) of peer time over ours."""
    pm, om = peer.get("methods") or {}, ours.get("methods") or {}
    by = {m: pm[m]["us"] / om[m]["us"] for m in METHODS if m in pm and m in om
          and pm[m].get("us") and om[m].get("us")}
    return (min(by.values()) if by else peer["us"] / ours["us"]), by


def derive(case: dict, ceilings: dict | None) -> dict:
    """Fill value (throughput), fraction of the ceiling (per method too), the floor, the ratio to each
    peer and whether the goals are met. Idempotent."""
    ceil = ceiling_value(ceilings, case.get("ceiling"))
    impls = ([case["ours"]] if case.get("ours") else []) + list(case.get("peers", {}).values())
    for impl in impls:
        if impl.get("error") or impl.get("us") is None:
            continue
        _fill(impl, case, ceil)
        for entry in (impl.get("methods") or {}).values():
            if entry.get("us"):
                _fill(entry, case, ceil)
    case["floor_us"] = floor_us(case, ceilings)
    ours = case.get("ours")
    ratios, by_method = {}, {}
    if ours and not ours.get("error") and ours.get("us"):
        for name, peer in case.get("peers", {}).items():
            if not peer.get("error") and peer.get("us"):
                ratios[name], by = _ratio(peer, ours)
                for m, r in by.items():
                    by_method.setdefault(m, {})[name] = r
    case["ratios"] = ratios
    if by_method:
        case["ratios_by_method"] = by_method
    else:
        case.pop("ratios_by_method", None)
    target = case.get("target")
    if isinstance(target, dict):
        target["met"] = target_met(target, ours)
    for goal in case.get("goals") or []:
        if isinstance(goal, dict):
            goal["met"] = goal_met(goal, case)
    return case


def goal_met(goal: dict, case: dict) -> bool | None:
    """A relative goal: unit "ratio", ratios[peer] >= value (the worse method's ratio)."""
    ours = case.get("ours")
    if not ours or ours.get("error") or goal.get("unit") != "ratio":
        return None
    r = case.get("ratios", {}).get(goal.get("peer"))
    return None if r is None or goal.get("value") is None else bool(r >= goal["value"])


def target_met(target: dict, ours: dict | None) -> bool | None:
    """Goal units: "us" and "s"/"ms" (at most), "fraction" (of the ceiling, at least),
    "GB/s"/"TFLOP/s" (at least)."""
    if not ours or ours.get("error"):
        return None
    unit, goal = target.get("unit"), target.get("value")
    if unit == "us":
        have, at_most = ours.get("us"), True
    elif unit in ("s", "ms"):
        have, at_most = ours.get("value"), True
    elif unit == "fraction":
        have, at_most = ours.get("fraction"), False
    else:
        have, at_most = ours.get("value"), False
    if have is None or goal is None:
        return None
    return bool(have <= goal) if at_most else bool(have >= goal)


# -- validation ------------------------------------------------------------------------------------
def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _validate_impl(where: str, impl, errors: list[str]) -> None:
    if not isinstance(impl, dict):
        errors.append(f"{where}: must be an object")
        return
    if not isinstance(impl.get("name"), str):
        errors.append(f"{where}.name: must be a string")
    if impl.get("error") is not None:
        if not isinstance(impl["error"], str):
            errors.append(f"{where}.error: must be a string or null")
        return
    if not _num(impl.get("us")) or impl["us"] <= 0:
        errors.append(f"{where}.us: must be a positive number (median microseconds)")
    for key in ("p10", "p90", "min", "value", "fraction"):
        if impl.get(key) is not None and not _num(impl[key]):
            errors.append(f"{where}.{key}: must be a number or null")
    for key in ("reps", "sets"):
        if impl.get(key) is not None and (not isinstance(impl[key], int) or impl[key] < 1):
            errors.append(f"{where}.{key}: must be a positive int")
    if impl.get("method") is not None and impl["method"] not in METHODS:
        errors.append(f"{where}.method: {impl['method']!r} not in {METHODS}")
    methods = impl.get("methods")
    if methods is None:
        return
    if not isinstance(methods, dict) or not methods:
        errors.append(f"{where}.methods: must be a non-empty object")
        return
    for m, entry in methods.items():
        if m not in METHODS:
            errors.append(f"{where}.methods: unknown method {m!r} (known: {METHODS})")
        elif not isinstance(entry, dict) or not _num(entry.get("us")) or entry["us"] <= 0:
            errors.append(f"{where}.methods.{m}.us: must be a positive number (median microseconds)")
        else:
            for key in ("p10", "p90", "min", "value", "fraction"):
                if entry.get(key) is not None and not _num(entry[key]):
                    errors.append(f"{where}.methods.{m}.{key}: must be a number or null")
    if impl.get("method") in methods and _num(impl.get("us")) and \
            impl["us"] != max(e.get("us") or 0 for e in methods.values() if isinstance(e, dict)):
        errors.append(f"{where}.us: must be the worse (larger) of its methods' medians")


def validate_case(case, where: str = "case") -> list[str]:
    errors: list[str] = []
    if not isinstance(case, dict):
        return [f"{where}: must be an object"]
    for key in CASE_KEYS:
        if key not in case:
            errors.append(f"{where}: missing key {key!r}")
    if errors:
        return errors
    where = f"{where} {case['id']!r}"
    if not isinstance(case["id"], str) or not case["id"]:
        errors.append(f"{where}: id must be a non-empty string")
    if case["status"] not in STATUSES:
        errors.append(f"{where}: status {case['status']!r} not in {STATUSES}")
    if case["unit"] is not None and case["unit"] not in UNITS:
        errors.append(f"{where}: unit {case['unit']!r} not in {UNITS}")
    if case["ceiling"] is not None and case["ceiling"] not in CEILINGS:
        errors.append(f"{where}: ceiling {case['ceiling']!r} not in {CEILINGS}")
    if case["work"] is not None and not _num(case["work"]):
        errors.append(f"{where}: work must be a number or null")
    if not isinstance(case["params"], dict):
        errors.append(f"{where}: params must be an object")
    if case["status"] in ("ok", "check_failed") and case["ours"] is None:
        errors.append(f"{where}: status {case['status']!r} needs an 'ours' measurement")
    if case["status"] in ("error", "crashed", "timeout") and not case["error"]:
        errors.append(f"{where}: status {case['status']!r} needs an error message")
    if case["ours"] is not None:
        _validate_impl(f"{where}.ours", case["ours"], errors)
    if not isinstance(case["peers"], dict):
        errors.append(f"{where}: peers must be an object")
    else:
        for name, impl in case["peers"].items():
            _validate_impl(f"{where}.peers[{name!r}]", impl, errors)
    if not isinstance(case["ratios"], dict) or not all(_num(v) for v in case["ratios"].values()):
        errors.append(f"{where}: ratios must map peer names to numbers")
    elif isinstance(case["peers"], dict):
        for name in case["ratios"]:
            if name not in case["peers"]:
                errors.append(f"{where}: ratio for unknown peer {name!r}")
    goals = case.get("goals")
    if goals is not None:
        if not isinstance(goals, list):
            errors.append(f"{where}: goals must be a list")
        else:
            for i, g in enumerate(goals):
                if not isinstance(g, dict) or g.get("unit") != "ratio" or not _num(g.get("value")) \
                        or not isinstance(g.get("peer"), str):
                    errors.append(f"{where}: goals[{i}] must be {{'unit': 'ratio', 'value': number, "
                                  f"'peer': name, 'met': bool|null}}")
    if case.get("floor_us") is not None and not _num(case["floor_us"]):
        errors.append(f"{where}: floor_us must be a number or null")
    check = case["check"]
    if check is not None and (not isinstance(check, dict) or not isinstance(check.get("ok"), bool)):
        errors.append(f"{where}: check must be null or an object with a bool 'ok'")
    if case["status"] == "check_failed" and check is not None and check.get("ok"):
        errors.append(f"{where}: status check_failed but check.ok is true")
    return errors


def validate(results) -> list[str]:
    """Every problem found in a results object, as readable strings ([] = valid)."""
    if not isinstance(results, dict):
        return ["results: must be a JSON object"]
    errors: list[str] = []
    if results.get("schema") != SCHEMA:
        errors.append(f"schema: expected {SCHEMA!r}, got {results.get('schema')!r}")
    meta = results.get("metadata")
    if not isinstance(meta, dict):
        errors.append("metadata: must be an object")
    else:
        for key in REQUIRED_METADATA:
            if key not in meta:
                errors.append(f"metadata: missing key {key!r}")
        if not isinstance(meta.get("sample"), bool):
            errors.append("metadata.sample: must be true or false")
        if not isinstance(meta.get("gpu"), str) or not meta.get("gpu"):
            errors.append("metadata.gpu: must be a non-empty string")
    ceilings = results.get("ceilings")
    if not isinstance(ceilings, dict):
        errors.append("ceilings: must be an object")
    else:
        for name in CEILINGS:
            c = ceilings.get(name)
            if c is None:
                continue
            _validate_impl(f"ceilings.{name}", c, errors)
            if not c.get("error") and not _num(c.get("value")):
                errors.append(f"ceilings.{name}.value: must be a number ({CEILING_UNIT[name]})")
    suites = results.get("suites")
    if not isinstance(suites, dict):
        errors.append("suites: must be an object")
        return errors
    for name, suite in suites.items():
        where = f"suites.{name}"
        if name not in SUITES and not name.startswith("_"):  # "_name": the harness's own tests
            errors.append(f"{where}: unknown suite (known: {', '.join(SUITES)})")
        if not isinstance(suite, dict):
            errors.append(f"{where}: must be an object")
            continue
        if suite.get("status") not in SUITE_STATUSES:
            errors.append(f"{where}.status: {suite.get('status')!r} not in {SUITE_STATUSES}")
        cases = suite.get("cases")
        if not isinstance(cases, list):
            errors.append(f"{where}.cases: must be a list")
            continue
        seen = set()
        for i, case in enumerate(cases):
            errors += validate_case(case, f"{where}.cases[{i}]")
            cid = case.get("id") if isinstance(case, dict) else None
            if cid in seen:
                errors.append(f"{where}: duplicate case id {cid!r}")
            seen.add(cid)
            if isinstance(case, dict) and case.get("suite") != name:
                errors.append(f"{where}.cases[{i}]: suite {case.get('suite')!r} != {name!r}")
    return errors


class SchemaError(ValueError):
    pass


def check(results, source: str = "results") -> None:
    errors = validate(results)
    if errors:
        shown = "\n  ".join(errors[:20])
        more = f"\n  ... {len(errors) - 20} more" if len(errors) > 20 else ""
        raise SchemaError(f"{source} is not a valid {SCHEMA} file:\n  {shown}{more}")


def all_cases(results: dict):
    for suite in results.get("suites", {}).values():
        yield from suite.get("cases", [])
