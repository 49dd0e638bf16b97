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
    return {"name": name, "value": None, "fraction": None, "error": None, **timing}


def impl_from_methods(name: str, timings: dict) -> dict:
    """An Impl from {method: timing.Timing.as_dict()}: headline numbers from the slower method."""
    if len(timings) == 1:
        return impl_from_timing(name, next(iter(timings.values())))
    out = impl_from_timing(name, timings[max(timings, key=lambda m: timings[m]["us"])])
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


def floor_us(case: dict, ceilings: dict | None) -> float | None:
    """The case's work at the ceiling of the same run, in µs (K/V bytes / copy bandwidth for decode)."""
    ceil = ceiling_value(ceilings, case.get("ceiling"))
    if not ceil or not case.get("work") or case.get("unit") not in ("GB/s", "TFLOP/s"):
        return None
    return case["work"] / (ceil * (1e3 if case["unit"] == "GB/s" else 1e6))


def derive(case: dict, ceilings: dict | None) -> dict:
    """Fill value (throughput), fraction of the ceiling (per method too), the floor, the ratio to each
    peer (the method least favourable to ours) and whether the goals are met. Idempotent."""
    ceil = ceiling_value(ceilings, case.get("ceiling"))
    ours, peers = case.get("ours"), case.get("peers", {})
    for impl in ([ours] if ours else []) + list(peers.values()):
        if impl.get("error") or impl.get("us") is None:
            continue
        for entry in [impl] + [e for e in (impl.get("methods") or {}).values() if e.get("us")]:
            if case.get("unit") in ("GB/s", "TFLOP/s"):
                entry["value"] = throughput(case["unit"], case.get("work"), entry["us"])
            if ceil and entry.get("value") is not None:
                entry["fraction"] = entry["value"] / ceil
    case["floor_us"] = floor_us(case, ceilings)
    ratios, by_method = {}, {}
    if ours and not ours.get("error") and ours.get("us"):
        om = ours.get("methods") or {}
        for name, peer in peers.items():
            if peer.get("error") or not peer.get("us"):
                continue
            pm = peer.get("methods") or {}
            by = {m: pm[m]["us"] / om[m]["us"] for m in METHODS
                  if m in pm and m in om and pm[m].get("us") and om[m].get("us")}
            ratios[name] = min(by.values()) if by else peer["us"] / ours["us"]
            for m, r in by.items():
                by_method.setdefault(m, {})[name] = r
    case["ratios"] = ratios
    if by_method:
        case["ratios_by_method"] = by_method
    else:
        case.pop("ratios_by_method", None)
    if isinstance(case.get("target"), dict):
        case["target"]["met"] = target_met(case["target"], ours)
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
    have = ours.get({"us": "us", "fraction": "fraction"}.get(unit, "value"))
    if have is None or goal is None:
        return None
    return bool(have <= goal) if unit in ("us", "s", "ms") else bool(have >= goal)


# -- validation: every problem as a readable string ---------------------------------------------------
def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _impl_problems(impl) -> list[str]:
    """What is wrong with one Impl (ours, a peer or a ceiling), each message starting with its key."""
    if not isinstance(impl, dict):
        return [": must be an object"]
    out = [] if isinstance(impl.get("name"), str) else [".name: must be a string"]
    if impl.get("error") is not None:
        return out + ([] if isinstance(impl["error"], str) else [".error: must be a string or null"])
    positive = "must be a positive number (median microseconds)"
    methods = impl.get("methods")
    entries = {"": impl, **({f".methods.{m}": e for m, e in methods.items() if isinstance(e, dict)}
                            if isinstance(methods, dict) else {})}
    for at, entry in entries.items():
        if not (_num(entry.get("us")) and entry["us"] > 0):
            out.append(f"{at}.us: {positive}")
        out += [f"{at}.{k}: must be a number or null" for k in ("p10", "p90", "min", "value", "fraction")
                if entry.get(k) is not None and not _num(entry[k])]
    out += [f".{k}: must be a positive int" for k in ("reps", "sets")
            if impl.get(k) is not None and not (isinstance(impl[k], int) and impl[k] >= 1)]
    if impl.get("method") not in (None, *METHODS):
        out.append(f".method: {impl['method']!r} not in {METHODS}")
    if methods is None:
        return out
    if not isinstance(methods, dict) or not methods:
        return out + [".methods: must be a non-empty object"]
    out += [f".methods: unknown method {m!r} (known: {METHODS})" for m in methods if m not in METHODS]
    out += [f".methods.{m}.us: {positive}" for m, e in methods.items() if not isinstance(e, dict)]
    if impl.get("method") in methods and _num(impl.get("us")):
        worst = max(e.get("us") or 0 for e in methods.values() if isinstance(e, dict))
        out += [] if impl["us"] == worst else [".us: must be the worse (larger) of its methods' medians"]
    return out


def validate_case(case, where: str = "case") -> list[str]:
    if not isinstance(case, dict):
        return [f"{where}: must be an object"]
    missing = [f"{where}: missing key {key!r}" for key in CASE_KEYS if key not in case]
    if missing:
        return missing
    where = f"{where} {case['id']!r}"
    status, peers, ratios, check, goals = (case.get(k) for k in ("status", "peers", "ratios", "check", "goals"))
    rules = [
        (isinstance(case["id"], str) and case["id"], "id must be a non-empty string"),
        (status in STATUSES, f"status {status!r} not in {STATUSES}"),
        (case["unit"] is None or case["unit"] in UNITS, f"unit {case['unit']!r} not in {UNITS}"),
        (case["ceiling"] is None or case["ceiling"] in CEILINGS, f"ceiling {case['ceiling']!r} not in {CEILINGS}"),
        (case["work"] is None or _num(case["work"]), "work must be a number or null"),
        (isinstance(case["params"], dict), "params must be an object"),
        (status not in ("ok", "check_failed") or case["ours"] is not None,
         f"status {status!r} needs an 'ours' measurement"),
        (status not in ("error", "crashed", "timeout") or case["error"], f"status {status!r} needs an error message"),
        (isinstance(peers, dict), "peers must be an object"),
        (isinstance(ratios, dict) and all(_num(v) for v in ratios.values()), "ratios must map peer names to numbers"),
        (goals is None or isinstance(goals, list), "goals must be a list"),
        (case.get("floor_us") is None or _num(case["floor_us"]), "floor_us must be a number or null"),
        (check is None or (isinstance(check, dict) and isinstance(check.get("ok"), bool)),
         "check must be null or an object with a bool 'ok'"),
        (not (status == "check_failed" and isinstance(check, dict) and check.get("ok")),
         "status check_failed but check.ok is true"),
    ]
    errors = [f"{where}: {message}" for ok, message in rules if not ok]
    impls = {".ours": case["ours"]} if case["ours"] is not None else {}
    impls.update({f".peers[{n!r}]": impl for n, impl in peers.items()} if isinstance(peers, dict) else {})
    errors += [f"{where}{at}{p}" for at, impl in impls.items() for p in _impl_problems(impl)]
    if isinstance(peers, dict) and isinstance(ratios, dict):
        errors += [f"{where}: ratio for unknown peer {name!r}" for name in ratios if name not in peers]
    return errors + [f"{where}: goals[{i}] must be {{'unit': 'ratio', 'value': number, 'peer': name, 'met': bool|null}}"
                     for i, g in enumerate(goals if isinstance(goals, list) else [])
                     if not (isinstance(g, dict) and g.get("unit") == "ratio" and _num(g.get("value"))
                             and isinstance(g.get("peer"), str))]


def validate(results) -> list[str]:
    """Every problem found in a results object, as readable strings ([] = valid)."""
    if not isinstance(results, dict):
        return ["results: must be a JSON object"]
    errors = [] if results.get("schema") == SCHEMA else [f"schema: expected {SCHEMA!r}, got {results.get('schema')!r}"]
    meta, ceilings, suites = (results.get(k) for k in ("metadata", "ceilings", "suites"))
    if isinstance(meta, dict):
        errors += [f"metadata: missing key {key!r}" for key in REQUIRED_METADATA if key not in meta]
        errors += [] if isinstance(meta.get("sample"), bool) else ["metadata.sample: must be true or false"]
        errors += [] if isinstance(meta.get("gpu"), str) and meta["gpu"] else ["metadata.gpu: must be a non-empty string"]
    else:
        errors.append("metadata: must be an object")
    if not isinstance(ceilings, dict):
        errors.append("ceilings: must be an object")
    for name, c in ((n, ceilings.get(n)) for n in CEILINGS if isinstance(ceilings, dict)):
        if c is not None:
            errors += [f"ceilings.{name}{p}" for p in _impl_problems(c)]
            if not (c.get("error") or _num(c.get("value"))):
                errors.append(f"ceilings.{name}.value: must be a number ({CEILING_UNIT[name]})")
    if not isinstance(suites, dict):
        return errors + ["suites: must be an object"]
    for name, suite in suites.items():
        where = f"suites.{name}"
        if name not in SUITES and not name.startswith("_"):  # "_name": the harness's own tests
            errors.append(f"{where}: unknown suite (known: {', '.join(SUITES)})")
        if not isinstance(suite, dict) or not isinstance(suite.get("cases"), list):
            errors.append(f"{where}: must be an object with a list of cases")
            continue
        if suite.get("status") not in SUITE_STATUSES:
            errors.append(f"{where}.status: {suite.get('status')!r} not in {SUITE_STATUSES}")
        ids = [c.get("id") if isinstance(c, dict) else None for c in suite["cases"]]
        errors += [f"{where}: duplicate case id {cid!r}" for i, cid in enumerate(ids) if cid in ids[:i]]
        for i, case in enumerate(suite["cases"]):
            errors += validate_case(case, f"{where}.cases[{i}]")
            if isinstance(case, dict) and case.get("suite") != name:
                errors.append(f"{where}.cases[{i}]: suite {case.get('suite')!r} != {name!r}")
    return errors


class SchemaError(ValueError):
    pass


def check(results, source: str = "results") -> None:
    errors = validate(results)
    if errors:
        more = f"\n  ... {len(errors) - 20} more" if len(errors) > 20 else ""
        raise SchemaError(f"{source} is not a valid {SCHEMA} file:\n  " + "\n  ".join(errors[:20]) + more)


def all_cases(results: dict):
    for suite in results.get("suites", {}).values():
        yield from suite.get("cases", [])
