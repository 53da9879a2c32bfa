"""Tuning one deployment for an SLO: every point of a search space, the best and the frontier.

    point      one combination of knobs: concurrency, DBO, dp x tp split, KV dtype, graph mode
    objective  the throughput key maximised (``OBJECTIVES``)
    frontier   the points no other point beats on both the objective and the SLO's latency
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from epsim.model.errors import EpsimError

from .scenario import Scenario, StepCache, check_scenario, run_scenario
from .slo import SLO, is_latency_key, with_slo_metrics

#: the throughput keys ``tune`` may maximise
OBJECTIVES = ("output_throughput", "decode_throughput", "total_token_throughput")
#: the frontier's latency axis when the SLO's first term is not a latency
DEFAULT_LATENCY = "median_itl_ms"


@dataclass(frozen=True)
class SearchSpace:
    """The knobs ``tune`` tries (every combination).

    concurrency: closed-loop caps. Example: ``(1024, 2048, 3072, 4096)``.
    dbo / graph: on/off values. Example: ``(True, False)``.
    splits: ``(dp, tp)`` pairs over the deployment's GPUs. Example: ``((8, 1), (4, 2))``;
        ``None`` entries mean the scenario's own.
    kv_dtype: Example: ``("fp8", "bf16")``.
    """

    concurrency: tuple[int, ...]
    dbo: tuple[bool, ...] = (True,)
    graph: tuple[bool, ...] = (True,)
    splits: tuple[tuple[int, int] | None, ...] = (None,)
    kv_dtype: tuple[str, ...] = ("fp8",)

    def points(self) -> list[dict[str, Any]]:
        return [{"split": split, "kv_dtype": kv, "graph": graph, "dbo": dbo, "concurrency": c}
                for split, kv, graph, dbo, c in itertools.product(
                    self.splits, self.kv_dtype, self.graph, self.dbo, self.concurrency)]

    def size(self) -> int:
        return (len(self.concurrency) * len(self.dbo) * len(self.graph) * len(self.splits)
                * len(self.kv_dtype))


def apply_point(sc: Scenario, point: Mapping[str, Any], num_prompts: int | None) -> Scenario:
    """The scenario at one search point (num_prompts ``None``: as many as the concurrency)."""
    split = point.get("split")
    changes: dict[str, Any] = {"dbo": point["dbo"], "graph": point["graph"],
                               "kv_dtype": point["kv_dtype"]}
    if split is not None:
        dp, tp = split
        changes.update(dp=dp, tp=tp, ep=None)
    c = point["concurrency"]
    own = sc.workload.num_prompts if sc.workload.dataset == "trace" else c  # a trace's rows
    changes["workload"] = replace(sc.workload, max_concurrency=c, num_prompts=num_prompts or own)
    return sc.with_(**changes)


def pareto_frontier(points: Sequence[Mapping[str, Any]], objective: str, latency: str
                    ) -> list[Mapping[str, Any]]:
    """Points no other point beats on both ``objective`` (higher) and ``latency`` (lower),
    sorted by latency."""
    ordered = sorted(points, key=lambda p: (p[latency], -p[objective]))
    frontier, best = [], -math.inf
    for p in ordered:
        if p[objective] > best:
            frontier.append(p)
            best = p[objective]
    return frontier


@dataclass(frozen=True)
class TuneResult:
    """best: the feasible point with the highest objective (``None`` if none meets the SLO);
    frontier: the objective/latency Pareto frontier over every point; points: every point
    simulated; objective / latency: the frontier's axes; skipped: the points that could not
    run, each ``{"point": {...}, "reason": "..."}`` (e.g. the weights do not fit at that split).
    """

    best: dict[str, Any] | None
    frontier: list[dict[str, Any]]
    points: list[dict[str, Any]]
    objective: str
    latency: str
    skipped: list[dict[str, Any]] = field(default_factory=list)


def _point_row(point: Mapping[str, Any], result: Mapping[str, Any], slo: SLO) -> dict[str, Any]:
    row = {"concurrency": point["concurrency"], "dp": result["dp"], "tp": result["tp"],
           "ep": result["ep"], "dbo": point["dbo"], "graph": point["graph"],
           "kv_dtype": point["kv_dtype"]}
    row.update(result)
    row["meets_slo"] = slo.met(result)
    return row


def split_errors(base: Scenario, space: SearchSpace) -> dict[tuple[int, int], str]:
    """The splits of ``space`` that cannot make a plan of ``base``'s GPUs and model (dp x tp
    is not the world size, tp does not divide the heads, ...), each with the reason."""
    errors: dict[tuple[int, int], str] = {}
    for split in space.splits:
        if split is None:
            continue
        try:
            check_scenario(apply_point(base, {"split": split, "dbo": space.dbo[0],
                                              "graph": space.graph[0],
                                              "kv_dtype": space.kv_dtype[0],
                                              "concurrency": 1}, None))
        except EpsimError as exc:
            errors[split] = str(exc)
    return errors


def tune(base: Scenario, slo: SLO, space: SearchSpace, *, objective: str = OBJECTIVES[0],
         num_prompts: int | None = None, cache: StepCache | None = None,
         progress: Callable[[int, int], None] | None = None,
         check_splits: bool = True) -> TuneResult:
    """Evaluate every point of ``space``; the best meeting ``slo`` and the frontier.

    A split that cannot make a plan at all is an error before any point runs
    (``check_splits``; plan checks its splits over all its units instead). Points that cannot
    run for their memory (weights or one request's KV cache do not fit) are skipped, not fatal;
    if no point at all can run, the first such error is raised.
    """
    check_scenario(base)  # a point skipped for its lengths would hide why every point is
    if check_splits:
        for (dp, tp), why in split_errors(base, space).items():
            raise EpsimError(f"--splits {dp}x{tp}: {why}")
    cache = cache or StepCache()
    base = with_slo_metrics(base, slo)
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    pts = space.points()
    for n, point in enumerate(pts, 1):
        try:
            result = run_scenario(apply_point(base, point, num_prompts), cache)
        except EpsimError as exc:
            skipped.append({"point": dict(point), "reason": str(exc)})
        else:
            rows.append(_point_row(point, result, slo))
        if progress:
            progress(n, len(pts))
    if not rows:
        raise EpsimError(f"no point of the search space can run: {skipped[0]['reason']}")
    first_key = slo.terms[0][0]
    latency = first_key if is_latency_key(first_key) else DEFAULT_LATENCY
    feasible = [r for r in rows if r["meets_slo"]]
    best = max(feasible, key=lambda r: r[objective]) if feasible else None
    return TuneResult(best, pareto_frontier(rows, objective, latency), rows, objective, latency,
                      skipped)
