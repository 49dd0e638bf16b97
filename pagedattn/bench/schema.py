"""The results file (`pagedattn-bench/1`, described in perf/README.md "The results file"): new records,
the derived numbers (throughput, fraction of the ceiling, ratios, goals met) and a validator.

Timed under several methods (timing.METHODS), an Impl's headline numbers are the WORSE method's and each
ratio is the smallest over the methods both sides have, so a goal met on the headline holds under every
method.
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
NUMBERS = ("p10", "p90", "min", "value", "fraction")


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _need(errors: list[str], ok, message: str) -> None:
    if not ok:
        errors.append(message)


def _validate_numbers(where: str, entry: dict, errors: list[str]) -> None:
    for key in NUMBERS:
        _need(errors, entry.get(key) is None or _num(entry[key]), f"{where}.{key}: must be a number or null")


def _validate_impl(where: str, impl, errors: list[str]) -> None:
    if not isinstance(impl, dict):
        errors.append(f"{where}: must be an object")
        return
    _need(errors, isinstance(impl.get("name"), str), f"{where}.name: must be a string")
    if impl.get("error") is not None:
        _need(errors, isinstance(impl["error"], str), f"{where}.error: must be a string or null")
        return
    positive = "must be a positive number (median microseconds)"
    _need(errors, _num(impl.get("us")) and impl["us"] > 0, f"{where}.us: {positive}")
    _validate_numbers(where, impl, errors)
    for key in ("reps", "sets"):
        value = impl.get(key)
        positive_int = value is None or (isinstance(value, int) and value >= 1)
        _need(errors, positive_int, f"{where}.{key}: must be a positive int")
    method = impl.get("method")
    _need(errors, method is None or method in METHODS, f"{where}.method: {method!r} not in {METHODS}")
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
            errors.append(f"{where}.methods.{m}.us: {positive}")
        else:
            _validate_numbers(f"{where}.methods.{m}", entry, errors)
    if method in methods and _num(impl.get("us")):
        worst = max(e.get("us") or 0 for e in methods.values() if isinstance(e, dict))
        _need(errors, impl["us"] == worst, f"{where}.us: must be the worse (larger) of its methods' medians")


def validate_case(case, where: str = "case") -> list[str]:
    if not isinstance(case, dict):
        return [f"{where}: must be an object"]
    errors = [f"{where}: missing key {key!r}" for key in CASE_KEYS if key not in case]
    if errors:
        return errors
    where = f"{where} {case['id']!r}"
    status, unit, ceiling, peers, ratios, check = (case[k] for k in ("status", "unit", "ceiling", "peers",
                                                                      "ratios", "check"))
    _need(errors, isinstance(case["id"], str) and case["id"], f"{where}: id must be a non-empty string")
    _need(errors, status in STATUSES, f"{where}: status {status!r} not in {STATUSES}")
    _need(errors, unit is None or unit in UNITS, f"{where}: unit {unit!r} not in {UNITS}")
    _need(errors, ceiling is None or ceiling in CEILINGS, f"{where}: ceiling {ceiling!r} not in {CEILINGS}")
    _need(errors, case["work"] is None or _num(case["work"]), f"{where}: work must be a number or null")
    _need(errors, isinstance(case["params"], dict), f"{where}: params must be an object")
    _need(errors, status not in ("ok", "check_failed") or case["ours"] is not None,
          f"{where}: status {status!r} needs an 'ours' measurement")
    _need(errors, status not in ("error", "crashed", "timeout") or case["error"],
          f"{where}: status {status!r} needs an error message")
    if case["ours"] is not None:
        _validate_impl(f"{where}.ours", case["ours"], errors)
    if isinstance(peers, dict):
        for name, impl in peers.items():
            _validate_impl(f"{where}.peers[{name!r}]", impl, errors)
    else:
        errors.append(f"{where}: peers must be an object")
    if not isinstance(ratios, dict) or not all(_num(v) for v in ratios.values()):
        errors.append(f"{where}: ratios must map peer names to numbers")
    elif isinstance(peers, dict):
        errors += [f"{where}: ratio for unknown peer {name!r}" for name in ratios if name not in peers]
    goals = case.get("goals")
    _need(errors, goals is None or isinstance(goals, list), f"{where}: goals must be a list")
    for i, g in enumerate(goals if isinstance(goals, list) else []):
        _need(errors, isinstance(g, dict) and g.get("unit") == "ratio" and _num(g.get("value"))
              and isinstance(g.get("peer"), str),
              f"{where}: goals[{i}] must be {{'unit': 'ratio', 'value': number, 'peer': name, 'met': bool|null}}")
    floor = case.get("floor_us")
    _need(errors, floor is None or _num(floor), f"{where}: floor_us must be a number or null")
    _need(errors, check is None or (isinstance(check, dict) and isinstance(check.get("ok"), bool)),
          f"{where}: check must be null or an object with a bool 'ok'")
    _need(errors, not (status == "check_failed" and isinstance(check, dict) and check.get("ok")),
          f"{where}: status check_failed but check.ok is true")
    return errors


def validate(results) -> list[str]:
    """Every problem found in a results object, as readable strings ([] = valid)."""
    if not isinstance(results, dict):
        return ["results: must be a JSON object"]
    errors: list[str] = []
    tag = results.get("schema")
    _need(errors, tag == SCHEMA, f"schema: expected {SCHEMA!r}, got {tag!r}")
    meta = results.get("metadata")
    if isinstance(meta, dict):
        errors += [f"metadata: missing key {key!r}" for key in REQUIRED_METADATA if key not in meta]
        _need(errors, isinstance(meta.get("sample"), bool), "metadata.sample: must be true or false")
        gpu = meta.get("gpu")
        _need(errors, isinstance(gpu, str) and gpu, "metadata.gpu: must be a non-empty string")
    else:
        errors.append("metadata: must be an object")
    ceilings = results.get("ceilings")
    if isinstance(ceilings, dict):
        for name in CEILINGS:
            c = ceilings.get(name)
            if c is not None:
                _validate_impl(f"ceilings.{name}", c, errors)
                _need(errors, c.get("error") or _num(c.get("value")),
                      f"ceilings.{name}.value: must be a number ({CEILING_UNIT[name]})")
    else:
        errors.append("ceilings: must be an object")
    suites = results.get("suites")
    if not isinstance(suites, dict):
        return errors + ["suites: must be an object"]
    for name, suite in suites.items():
        where = f"suites.{name}"
        known = name in SUITES or name.startswith("_")  # "_name": the harness's own tests
        _need(errors, known, f"{where}: unknown suite (known: {', '.join(SUITES)})")
        if not isinstance(suite, dict):
            errors.append(f"{where}: must be an object")
            continue
        status = suite.get("status")
        _need(errors, status in SUITE_STATUSES, f"{where}.status: {status!r} not in {SUITE_STATUSES}")
        cases = suite.get("cases")
        if not isinstance(cases, list):
            errors.append(f"{where}.cases: must be a list")
            continue
        seen = set()
        for i, case in enumerate(cases):
            errors += validate_case(case, f"{where}.cases[{i}]")
            cid = case.get("id") if isinstance(case, dict) else None
            _need(errors, cid not in seen, f"{where}: duplicate case id {cid!r}")
            seen.add(cid)
            if isinstance(case, dict):
                _need(errors, case.get("suite") == name, f"{where}.cases[{i}]: suite {case.get('suite')!r} != {name!r}")
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
