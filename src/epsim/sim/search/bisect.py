"""Bisection: the highest load each deployment serves within the SLO, as ``vllm bench sweep
serve_sla`` finds it (vllm/benchmarks/sweep/serve_sla.py, ``solve_sla``, at commit 0826bcfb).

    variable    the load searched, vLLM's ``--sla-variable``: ``max_concurrency`` (closed loop,
                an integer) or ``request_rate`` (open loop, requests/s)
    range       the lowest and highest value of the variable's dimension in the search space
                (``--concurrency 1,4096`` or ``--request-rate 0.5,64``)
    deployment  a point of the space without the variable (hardware, split, DBO, KV dtype, ...):
                each is bisected on its own, the deployments searched around it as a grid
    history     ``{value: met}``: the probes of one deployment, ``met`` whether the SLO held
                (``False`` too for a point with no steady window, the load outrunning the
                engine; ``None``: the point cannot run at all, e.g. the weights do not fit)
    boundary    the highest value that met the SLO: integers until the lowest failing value is
                the next integer, rates until it is within ``RATE_RESOLUTION`` of it

Probe order (vLLM's): the top of the range first (a deployment that meets the SLO there is
done), then the bottom (one that fails there meets it nowhere), then a point inside the
bracket between the highest passing and the lowest failing value. vLLM places that point where a
PCHIP interpolation of the SLO margin crosses zero; epsim takes the bracket's geometric mean, so
the number of probes does not depend on the metric's shape: a bracket of 1..4096 closes in at
most ``max_probes`` (18) simulations, 11 for a boundary near 256. The answer is exact for a metric that is monotone in the
load (met below the boundary, broken above); the SLO may therefore bound only what load can
only make worse (``check_monotone``).

Every probe is one executor batch per round over all open deployments, so the probes, and the
answer, are the same on one worker or many.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from epsim.model.errors import EpsimError

from .slo import SLO, is_latency_key

#: vLLM's ``--sla-variable`` values -> the search point's key
VARIABLES = {"max_concurrency": "concurrency", "request_rate": "request_rate"}
#: a rate boundary is found when the lowest failing rate is within this share of the highest
#: passing one (a precision, not a measurement: 2 % is below run-to-run noise of a real bench)
RATE_RESOLUTION = 0.02
#: the SLO keys, besides latency statistics, that more load can only raise
LOAD_RAISES = ("mean_decode_step_ms", "kv_cache_usage")

#: a probe's result: the SLO met (True), broken (False), or the point cannot run (None)
Met = bool | None


def check_monotone(slo: SLO) -> None:
    """Bisection needs an SLO that more load can only break: upper bounds on latencies, the step
    time or the KV use. A lower bound (e.g. on throughput) is refused in one line."""
    for key, op, _ in slo.terms:
        if op not in ("<", "<=") or not (is_latency_key(key) or key in LOAD_RAISES):
            raise EpsimError(
                f"--search bisect: SLO term {key}{op} is not broken by more load (bisection "
                f"needs upper bounds on latencies, mean_decode_step_ms or kv_cache_usage); "
                f"use --search grid")


def _done(history: Mapping[float, Met], passing: float, failing: float, integer: bool) -> bool:
    if integer:
        return failing - passing <= 1
    return failing <= passing * (1 + RATE_RESOLUTION)


def next_probe(history: Mapping[float, Met], lo: float, hi: float, integer: bool
               ) -> float | None:
    """The next value to simulate, or ``None`` when the boundary is known.

    history: ``{value: met}`` of the probes so far. Example: ``{4096: False, 1: True}`` -> 64.
    """
    if any(met is None for met in history.values()):
        return None  # the deployment cannot run: no load will do
    if hi not in history:
        return hi
    if history[hi]:
        return None  # met at the top of the range
    if lo not in history:
        return lo
    passing = max((v for v, met in history.items() if met), default=None)
    if passing is None:
        return None  # broken at the bottom of the range
    failing = min(v for v, met in history.items() if not met)
    if _done(history, passing, failing, integer):
        return None
    mid = math.sqrt(passing * failing)
    if integer:  # strictly inside the bracket
        return float(min(max(round(mid), passing + 1), failing - 1))
    return mid


def boundary(history: Mapping[float, Met]) -> float | None:
    """The highest value that met the SLO (``None``: none did)."""
    return max((v for v, met in history.items() if met), default=None)


def max_probes(lo: float, hi: float, integer: bool) -> int:
    """The most probes a deployment can take over ``[lo, hi]`` (the two ends, then the
    halvings of the bracket's log width down to the resolution at its top)."""
    if hi <= lo:
        return 1
    finest = math.log1p(1 / hi) if integer else math.log1p(RATE_RESOLUTION)
    return 2 + max(0, math.ceil(math.log2(math.log(hi / lo) / finest)))


def bisect(met: Callable[[float], bool], lo: float, hi: float, integer: bool
           ) -> tuple[float | None, dict[float, Met]]:
    """One deployment bisected serially: its boundary and every probe (``met(value)``)."""
    history: dict[float, Met] = {}
    while (value := next_probe(history, lo, hi, integer)) is not None:
        history[value] = met(value)
    return boundary(history), history


def _deployments(dimensions: Sequence[tuple[str, tuple[Any, ...]]], key: str
                 ) -> list[dict[str, Any]]:
    """Every combination of the dimensions but ``key``, in the grid's order."""
    others = [(k, v) for k, v in dimensions if k != key]
    return [dict(zip([k for k, _ in others], combo, strict=True))
            for combo in itertools.product(*(v for _, v in others))]


def load_range(dimensions: Sequence[tuple[str, tuple[Any, ...]]], key: str
               ) -> tuple[float, float]:
    """The lowest and highest value of the variable's dimension."""
    values = [v for v in dict(dimensions).get(key, ()) if v is not None]
    if not values:
        raise EpsimError(f"--search bisect: the search space has no {key} range "
                         f"(give two values, e.g. --{key.replace('_', '-')} 1,4096)")
    return float(min(values)), float(max(values))


def probe_budget(dimensions: Sequence[tuple[str, tuple[Any, ...]]], variable: str) -> int:
    """The most probes a bisection of the space can take (its deployments x ``max_probes``)."""
    key = VARIABLES[variable]
    lo, hi = load_range(dimensions, key)
    return len(_deployments(dimensions, key)) * max_probes(lo, hi, variable == "max_concurrency")


def bisect_search(points: Sequence[dict[str, Any]], evaluate: Callable[..., list[Any]],
                  progress: Callable[[int, int], None] | None, *,
                  dimensions: Sequence[tuple[str, tuple[Any, ...]]], slo: SLO,
                  variable: str, point_at: Callable[[Mapping[str, Any]], dict[str, Any]],
                  **_: Any) -> list[tuple[dict[str, Any], Any]]:
    """Each deployment of the space bisected on ``variable``; every probe with its outcome, in
    round order (within a round, the deployments' grid order)."""
    check_monotone(slo)
    key = VARIABLES[variable]
    lo, hi = load_range(dimensions, key)
    integer = variable == "max_concurrency"
    deployments = _deployments(dimensions, key)
    histories: list[dict[float, Met]] = [{} for _ in deployments]
    found: list[tuple[dict[str, Any], Any]] = []
    bound = probe_budget(dimensions, variable)
    while True:
        probes = [(i, v) for i, h in enumerate(histories)
                  if (v := next_probe(h, lo, hi, integer)) is not None]
        if not probes:
            break
        picked = [point_at({**deployments[i], key: int(v) if integer else v})
                  for i, v in probes]
        for (i, v), point, outcome in zip(probes, picked, evaluate(picked, None), strict=True):
            kind, result = outcome  # an overloaded point broke the SLO; a skipped one cannot run
            histories[i][v] = slo.met(result) if kind == "ok" else False if kind == "overload" \
                else None
            found.append((point, outcome))
        if progress:
            progress(len(found), max(bound, len(found)))
    return found


def boundaries(found: Sequence[tuple[Mapping[str, Any], Any]], variable: str, slo: SLO
               ) -> list[dict[str, Any]]:
    """Per deployment (first-probe order): its knobs, the boundary and the probes it took.
    Example: ``[{"deployment": {"dbo": False, ...}, "max_concurrency": 384, "probes": 11}]``."""
    key = VARIABLES[variable]
    rows: dict[tuple[Any, ...], dict[str, Any]] = {}
    for point, (kind, result) in found:
        knobs = {k: v for k, v in point.items() if k != key}
        row = rows.setdefault(tuple(sorted(knobs.items(), key=lambda kv: kv[0])),
                              {"deployment": knobs, variable: None, "probes": 0})
        row["probes"] += 1
        if kind == "ok" and slo.met(result):
            row[variable] = max(row[variable] or point[key], point[key])
    return list(rows.values())
