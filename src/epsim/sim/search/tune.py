"""Tuning one deployment for an SLO: every point of a search space, the best and the frontier.

    point      one combination of knobs: concurrency, DBO, dp x tp split, KV dtype, graph mode,
               and where searched: hardware, nodes, MTP drafts, running-request cap, chunk size
    search     which points run (``epsim.sim.search.samplers``: every one, or optuna's sampler) and
               where (``epsim.sim.search.executors``: serial, a process pool, Ray); the result is the
               same wherever they run
    objective  the key maximised (``OBJECTIVES``): a throughput, or ``request_goodput``, vLLM's
               goodput (requests/s meeting every ``--goodput`` per-request SLO)
    bisection  ``--search bisect``: each deployment's highest load meeting the SLO
               (``epsim.sim.search.bisect``), the deployments' knobs searched around it
    frontier   the points no other point beats on both the objective and the SLO's latency
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from epsim.model.errors import EpsimError
from epsim.sim.scenario import StepCache, check_scenario, run_scenario
from epsim.sim.serving.metrics import NoSteadyWindow
from epsim.sim.spec import Scenario

from .bisect import boundaries, probe_budget
from .executors import Executor, split_diagnostics
from .frontier import pareto_mask
from .samplers import DEFAULT_TRIALS, SEARCHES, Outcome, choose
from .slo import SLO, is_latency_key, with_slo_metrics

#: the throughput keys ``tune`` may maximise
OBJECTIVES = ("output_throughput", "decode_throughput", "total_token_throughput",
              "request_goodput")
#: what ``--objective`` may also be called (vLLM's word)
OBJECTIVE_ALIASES = {"goodput": "request_goodput"}
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
    request_rate: open-loop rates, requests/s (``(None,)``: the scenario's own). Example:
        ``(0.5, 64.0)``, the range ``--search bisect --sla-variable request_rate`` bisects.
    hardware / nodes / mtp / max_num_seqs / chunked_prefill_size: further dimensions
        (``(None,)``: not searched, the scenario's own; a point names only searched ones).
        Example: ``max_num_seqs=(128, 256)``, the running-request cap per rank.
    """

    concurrency: tuple[int | None, ...]
    dbo: tuple[bool, ...] = (True,)
    graph: tuple[bool, ...] = (True,)
    splits: tuple[tuple[int, int] | None, ...] = (None,)
    kv_dtype: tuple[str, ...] = ("fp8",)
    hardware: tuple[str | None, ...] = (None,)
    nodes: tuple[int | None, ...] = (None,)
    mtp: tuple[int | None, ...] = (None,)
    max_num_seqs: tuple[int | None, ...] = (None,)
    chunked_prefill_size: tuple[int | None, ...] = (None,)
    request_rate: tuple[float | None, ...] = (None,)

    def dimensions(self) -> list[tuple[str, tuple[Any, ...]]]:
        """(point key, values) per dimension, outermost first; unsearched optional ones left
        out (so a point of today's five knobs reads as it always did)."""
        dims = [(k, getattr(self, k)) for k in OPTIONAL_DIMENSIONS[:2]]
        dims += [("split", self.splits), ("kv_dtype", self.kv_dtype), ("graph", self.graph),
                 ("dbo", self.dbo)]
        dims += [(k, getattr(self, k)) for k in OPTIONAL_DIMENSIONS[2:]]
        if self.request_rate != (None,):
            dims.append(("request_rate", self.request_rate))
        dims.append(("concurrency", self.concurrency))
        return [(k, v) for k, v in dims if k not in OPTIONAL_DIMENSIONS or v != (None,)]

    def point_at(self, choice: Mapping[str, Any]) -> dict[str, Any]:
        """A point from one value per dimension, its keys in the grid's order."""
        return {k: choice[k] for k, _ in self.dimensions()}

    def points(self) -> list[dict[str, Any]]:
        dims = self.dimensions()
        return [dict(zip([k for k, _ in dims], combo, strict=True))
                for combo in itertools.product(*(v for _, v in dims))]

    def size(self) -> int:
        return math.prod(len(v) for _, v in self.dimensions())


#: the dimensions a point names only when they are searched (also Scenario fields)
OPTIONAL_DIMENSIONS = ("hardware", "nodes", "mtp", "max_num_seqs", "chunked_prefill_size")


def apply_point(sc: Scenario, point: Mapping[str, Any], num_prompts: int | None) -> Scenario:
    """The scenario at one search point (num_prompts ``None``: as many as the concurrency, or
    under ``measure="steady"`` as many as its window needs, ``sim/serving/window.py``; an open
    loop without a cap keeps the scenario's own)."""
    split = point.get("split")
    changes: dict[str, Any] = {"dbo": point["dbo"], "graph": point["graph"],
                               "kv_dtype": point["kv_dtype"]}
    changes.update({k: point[k] for k in OPTIONAL_DIMENSIONS if point.get(k) is not None})
    if split is not None:
        dp, tp = split
        changes.update(dp=dp, tp=tp, ep=None)
    c = point["concurrency"]
    w = sc.workload  # a trace's rows; steady: None, sized by run_scenario for the plan's ranks
    own = (w.num_prompts if w.kind.replays or c is None and w.measure != "steady"
           else None if w.measure == "steady" else c)
    rate = point.get("request_rate")
    changes["workload"] = replace(
        sc.workload, concurrency=c, num_prompts=num_prompts or own,
        request_rate=w.request_rate if rate is None else float(rate))
    return sc.with_(**changes)


def pareto_frontier(points: Sequence[Mapping[str, Any]], objective: str, latency: str
                    ) -> list[Mapping[str, Any]]:
    """Points no other point beats on both ``objective`` (higher) and ``latency`` (lower),
    sorted by latency (``frontier.pareto_mask`` with latency as negative interactivity)."""
    keep = pareto_mask([-p[latency] for p in points], [p[objective] for p in points])
    ordered = sorted((i for i in range(len(points)) if keep[i]),
                     key=lambda i: (points[i][latency], -points[i][objective], i))
    return [points[i] for i in ordered]


@dataclass(frozen=True)
class TuneResult:
    """best: the feasible point with the highest objective (``None`` if none meets the SLO);
    frontier: the objective/latency Pareto frontier over every point; points: every point
    simulated; objective / latency: the frontier's axes; skipped: the points that could not
    run, each ``{"point": {...}, "reason": "..."}`` (e.g. the weights do not fit at that split);
    strategy: the search that picked the points (``"grid"``, ``"optuna"`` or ``"bisect"``).
    boundaries: under ``bisect``, per deployment its highest load meeting the SLO
        (``epsim.sim.search.bisect.boundaries``); empty otherwise.
    """

    best: dict[str, Any] | None
    frontier: list[dict[str, Any]]
    points: list[dict[str, Any]]
    objective: str
    latency: str
    skipped: list[dict[str, Any]] = field(default_factory=list)
    strategy: str = "grid"
    boundaries: list[dict[str, Any]] = field(default_factory=list)


def _point_row(point: Mapping[str, Any], result: Mapping[str, Any], slo: SLO) -> dict[str, Any]:
    row = {"concurrency": point["concurrency"], "dp": result["dp"], "tp": result["tp"],
           "ep": result["ep"], "dbo": point["dbo"], "graph": point["graph"],
           "kv_dtype": point["kv_dtype"]}
    row.update(split_diagnostics(result))
    row["meets_slo"] = slo.met(result)
    return row


def split_errors(base: Scenario, space: SearchSpace) -> dict[tuple[int, int], str]:
    """The splits of ``space`` that cannot make a plan of ``base``'s GPUs and model (dp x tp
    is not the world size, tp does not divide the heads, ...) at any searched hardware and node
    count, each with the (first) reason."""
    errors: dict[tuple[int, int], str] = {}
    for split in space.splits:
        if split is None:
            continue
        reasons = []
        for hw, nodes in itertools.product(space.hardware, space.nodes):
            point = {"split": split, "dbo": space.dbo[0], "graph": space.graph[0],
                     "kv_dtype": space.kv_dtype[0], "concurrency": 1, "hardware": hw,
                     "nodes": nodes}
            try:
                check_scenario(apply_point(base, point, None))
            except EpsimError as exc:
                reasons.append(str(exc))
            else:
                break
        else:
            errors[split] = reasons[0]
    return errors


def evaluate_point(job: tuple[Scenario, dict[str, Any], int | None], cache: StepCache
                   ) -> Outcome:
    """One point of a search (an executor's task): ``("ok", result)``; ``("overload", why)``
    when its steady window is empty (the load outruns the engine: over any SLO); ``("skip",
    why)`` when it cannot run for its memory or shape (weights or one request's KV do not fit)."""
    base, point, num_prompts = job
    try:
        return "ok", run_scenario(apply_point(base, point, num_prompts), cache)
    except NoSteadyWindow as exc:
        return "overload", str(exc)
    except EpsimError as exc:
        return "skip", str(exc)


def _plan_key(job: tuple[Scenario, dict[str, Any], int | None]) -> tuple[Any, ...]:
    """Points that share step models: the same point but for its load (concurrency, rate)."""
    return tuple(sorted((k, v) for k, v in job[1].items()
                        if k not in ("concurrency", "request_rate")))


@dataclass(frozen=True)
class SearchOptions:
    """How a search picks its points (``executor``, where they run, never changes the result).

    strategy: ``"auto"``, ``"grid"``, ``"optuna"`` or ``"bisect"`` (``epsim.sim.search.samplers``).
    trials: optuna's asks (``None``: ``DEFAULT_TRIALS``, at most the space's size). variable:
    what ``bisect`` searches, ``"max_concurrency"`` or ``"request_rate"`` (vLLM's
    ``--sla-variable``). executor: where points run (``None``: serially in this process, with
    the caller's cache).
    """

    strategy: str = "auto"
    trials: int | None = None
    executor: Executor | None = None
    variable: str = "max_concurrency"


def planned_points(space: SearchSpace, options: SearchOptions) -> int:
    """How many points the search of ``space`` runs at most (its progress bar's total)."""
    strategy = choose(options.strategy, space.size())
    if strategy == "grid":
        return space.size()
    if strategy == "bisect":
        return probe_budget(space.dimensions(), options.variable)
    return options.trials or min(DEFAULT_TRIALS, space.size())


def _search(base: Scenario, slo: SLO, space: SearchSpace, objective: str,
            num_prompts: int | None, cache: StepCache, options: SearchOptions,
            progress: Callable[[int, int], None] | None
            ) -> tuple[str, list[tuple[dict[str, Any], Outcome]]]:
    """The strategy run and every point it evaluated, with its outcome, in a fixed order."""
    executor = options.executor or Executor(cache=cache)
    strategy = choose(options.strategy, space.size())

    def evaluate(points, report):
        return executor.map(evaluate_point, [(base, p, num_prompts) for p in points], report,
                            group=_plan_key)

    trials = options.trials or min(DEFAULT_TRIALS, space.size())
    found = SEARCHES[strategy](space.points() if strategy == "grid" else [], evaluate,
                               progress, dimensions=space.dimensions(), objective=objective,
                               slo=slo, trials=trials, seed=base.workload.seed,
                               point_at=space.point_at, variable=options.variable)
    return strategy, found


def tune(base: Scenario, slo: SLO, space: SearchSpace, *, objective: str = OBJECTIVES[0],
         num_prompts: int | None = None, cache: StepCache | None = None,
         progress: Callable[[int, int], None] | None = None,
         check_splits: bool = True, options: SearchOptions | None = None) -> TuneResult:
    """Evaluate the points of ``space`` the search picks (every one, by default on a small
    space); the best meeting ``slo`` and the frontier.

    A split that cannot make a plan at all is an error before any point runs
    (``check_splits``; plan checks its splits over all its units instead). Points that cannot
    run for their memory (weights or one request's KV cache do not fit) are skipped, not fatal;
    if no point at all can run, the first such error is raised.
    """
    check_scenario(base)  # a point skipped for its lengths would hide why every point is
    objective = OBJECTIVE_ALIASES.get(objective, objective)
    if objective == "request_goodput" and not base.measurement.goodput:
        raise EpsimError("--objective goodput counts the requests meeting every per-request SLO "
                         "of --goodput (vLLM's goodput): give e.g. --goodput ttft:5000 tpot:100")
    if check_splits:
        for (dp, tp), why in split_errors(base, space).items():
            raise EpsimError(f"--splits {dp}x{tp}: {why}")
    options = options or SearchOptions()
    base = with_slo_metrics(base, slo)
    strategy, found = _search(base, slo, space, objective, num_prompts, cache or StepCache(),
                              options, progress)
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for point, (kind, value) in found:
        if kind == "ok":
            rows.append(_point_row(point, value, slo))
        else:
            skipped.append({"point": dict(point), "reason": value})
    if not rows:
        raise EpsimError(f"no point of the search space can run: {skipped[0]['reason']}")
    first_key = slo.terms[0][0]
    latency = first_key if is_latency_key(first_key) else DEFAULT_LATENCY
    feasible = [r for r in rows if r["meets_slo"]]
    best = max(feasible, key=lambda r: r[objective]) if feasible else None
    bounds = boundaries(found, options.variable, slo) if strategy == "bisect" else []
    return TuneResult(best, pareto_frontier(rows, objective, latency), rows, objective, latency,
                      skipped, strategy, bounds)
