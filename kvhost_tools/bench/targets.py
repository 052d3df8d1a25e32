"""PASS or FAIL of a scenario's target, point by point."""

from __future__ import annotations

import math
from typing import Any

from kvhost_tools.bench.methods import KVHOST
from kvhost_tools.bench.workloads import Scenario


def evaluate(scenario: Scenario, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """PASS/FAIL of a scenario's target, with the figure each point was held to."""
    target = scenario.target
    if target is None or not rows:
        return None
    checks: list[dict[str, Any]] = []
    for row in rows:
        methods = row["methods"]
        where = f"{row['requests']} requests"
        if target.min_fraction is not None:
            value = methods[KVHOST]["fraction"]
            checks.append(check(where, "kvhost/memcpy", value, ">=", target.min_fraction))
        if target.min_speedup is not None:
            value = methods[KVHOST]["speedup"]
            checks.append(check(where, "baseline/kvhost", value, ">=", target.min_speedup))
        if target.identity:
            checks.append(check(where, "bytes moved", row["bytes"], "<=", 0))
            empty, same = methods["empty"], methods[KVHOST]
            noise = max(m["p75_s"] - m["p25_s"] for m in (empty, same))
            # A call handed n requests looks at each of them (its type and its length), whatever it does with them.
            extra = same["median_s"] - empty["median_s"] - methods["visit"]["median_s"]
            row["identity_extra_s"], row["empty_noise_s"] = extra, noise
            checks.append(check(where, "identity - empty - visit (us)", extra * 1e6, "<=", noise * 1e6))
        if target.max_front_share is not None:
            share = front_end_share(methods)
            row["front_end_share"] = share
            checks.append(check(where, "front end/transform", share, "<", target.max_front_share))
    return {
        "scenario": scenario.name,
        "target": target.text,
        "passed": all(c["passed"] for c in checks),
        "checks": checks,
    }


def front_end_share(methods: dict[str, Any]) -> float:
    """The front end's time as a share of the transform it prepares."""
    return float(methods["front end"]["median_s"] / methods["transform"]["median_s"])


def check(where: str, what: str, value: float, op: str, limit: float) -> dict[str, Any]:
    passed = {"<=": value <= limit, ">=": value >= limit, "<": value < limit}[op]
    return {"point": where, "what": what, "value": value, "op": op, "limit": limit, "passed": passed}


def worst(checks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The check closest to its limit: the headroom as a share of the limit (an exact
    check against zero that holds has none to report)."""

    def margin(c: dict[str, Any]) -> float:
        value, limit = float(c["value"]), float(c["limit"])
        headroom = value - limit if c["op"] == ">=" else limit - value
        return headroom / abs(limit) if limit else math.inf

    return min(checks, key=margin) if checks else None
