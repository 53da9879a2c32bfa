"""What users run the serving simulation for: predict one deployment, tune it for SLOs, plan capacity.

    Scenario      one deployment + one benchmark (model, hardware, plan options, workload)
    run_scenario  simulate it -> vLLM-style metrics (``epsim.sim.metrics``) plus the deployment echoed
    SLO           ``"median_itl_ms<=100,p90_ttft_ms<=5000"``: metric keys of ``compute_metrics``
    tune          every point of a search space (concurrency, DBO, dp/tp split, KV dtype, graph
                  mode); the best one meeting the SLO and the throughput/latency frontier
    plan_capacity the deployment unit (one co-located node group, or a prefill:decode split) with
                  the highest per-node throughput meeting the SLO, and how many units serve a
                  target output throughput

Step times are shared between runs through a cache keyed by everything a step depends on, so a
sweep over concurrencies simulates each (batch, context) grid point once.
"""

from __future__ import annotations

import itertools
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from epsim.model import accounting
from epsim.model.config import ModelConfig, load_model
from epsim.model.errors import EpsimError
from epsim.model.plan import ParallelPlan, make_plan

from .hardware import HardwareProfile, load_profile
from .metrics import (
    DEFAULT_PERCENTILE_METRICS,
    DEFAULT_PERCENTILES,
    METRICS,
    compute_metrics,
)
from .serving import ServingConfig, ServingRun, SimulatedStepTime, StepTimeModel, simulate_serving
from .workload import WorkloadSpec, sample_requests

#: builds the step-time model of one side of a deployment (tests pass analytic ones)
StepModelFactory = Callable[[ModelConfig, ParallelPlan, HardwareProfile, "Scenario"], StepTimeModel]


@dataclass(frozen=True)
class Scenario:
    """One deployment under one benchmark.

    model / hardware: shipped names or paths. Example: ``"deepseek-r1"`` / ``"mi300x"``.
    nodes / gpus_per_node / dp / tp / ep: the plan (``make_plan`` fills what is ``None``); with
        ``disagg`` they describe the decode side.
    dbo / eplb / graph / kv_dtype: execution options (DBO = two microbatches).
    loads: a load-statistics file for the step simulator's routing (``None``: synthetic).
    disagg: ``(prefill_nodes, decode_nodes)`` or ``None`` (prefill co-located).
    chunked_prefill_size / dp_balance / mem_fraction: scheduling and memory options.
    workload: the benchmark (``WorkloadSpec``).
    percentiles / percentile_metrics: what ``compute_metrics`` reports.
    step_mode: the step simulator's mode.
    """

    model: str
    hardware: str
    workload: WorkloadSpec
    nodes: int | None = None
    gpus_per_node: int | None = None
    dp: int | None = None
    tp: int | None = None
    ep: int | None = None
    dbo: bool = True
    eplb: bool = True
    graph: bool = True
    kv_dtype: str = "fp8"
    loads: str | None = None
    disagg: tuple[int, int] | None = None
    chunked_prefill_size: int = 8192
    dp_balance: str = "round_robin"
    mem_fraction: float = 0.9
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    percentile_metrics: tuple[str, ...] = DEFAULT_PERCENTILE_METRICS
    step_mode: str = "fast"

    def with_(self, **changes: Any) -> Scenario:
        return replace(self, **changes)


def parse_disagg(text: str) -> tuple[int, int]:
    """``"1:2"`` -> ``(1, 2)``: prefill nodes, decode nodes (each at least 1)."""
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text or "")
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise EpsimError(f"--disagg must be P:D with positive node counts (e.g. 1:1), got {text!r}")
    return int(m.group(1)), int(m.group(2))


def _side_plan(model: ModelConfig, sc: Scenario, nodes: int, gpn: int, *, decode_side: bool
               ) -> ParallelPlan:
    opts = dict(microbatches=2 if sc.dbo else 1, kv_dtype=sc.kv_dtype, graph_mode=sc.graph,
                mem_fraction=sc.mem_fraction)
    if decode_side:
        return make_plan(model, nodes=nodes, gpus_per_node=gpn, dp=sc.dp, tp=sc.tp, ep=sc.ep,
                         **opts)
    # the prefill side keeps the decode side's tp and EP/TP-MoE choice over its own GPUs
    tp = sc.tp or 1
    world = nodes * gpn
    if world % tp:
        raise EpsimError(f"tp {tp} does not divide the prefill side's {world} GPUs")
    ep = world if (sc.ep is None and world // tp > 1) or (sc.ep or 0) > 1 else 1
    return make_plan(model, nodes=nodes, gpus_per_node=gpn, tp=tp, ep=ep, **opts)


def simulated_step_model(model: ModelConfig, plan: ParallelPlan, profile: HardwareProfile,
                         sc: Scenario) -> StepTimeModel:
    """The default factory: the step simulator behind the memo."""
    loads = None
    if sc.loads:
        from epsim.model.loads import read_loads
        loads = read_loads(sc.loads)
    return SimulatedStepTime(model, plan, profile, loads=loads, eplb=sc.eplb, mode=sc.step_mode,
                             seed=sc.workload.seed)


@dataclass
class StepCache:
    """Step-time models shared between runs, keyed by what a step depends on."""

    factory: StepModelFactory = simulated_step_model
    models: dict[tuple[Any, ...], StepTimeModel] = field(default_factory=dict)

    def get(self, model: ModelConfig, plan: ParallelPlan, profile: HardwareProfile,
            sc: Scenario) -> StepTimeModel:
        key = (model.name, plan, profile.name, sc.eplb, sc.loads, sc.step_mode, sc.workload.seed)
        if key not in self.models:
            self.models[key] = self.factory(model, plan, profile, sc)
        return self.models[key]

    @property
    def calls(self) -> int:
        return sum(int(getattr(m, "calls", 0)) for m in self.models.values())


def _calls(models: Iterable[StepTimeModel]) -> int:
    return sum(int(getattr(m, "calls", 0)) for m in {id(m): m for m in models}.values())


def run_scenario(sc: Scenario, cache: StepCache | None = None, *,
                 steps_out: list[dict[str, Any]] | None = None,
                 run_out: list[ServingRun] | None = None) -> dict[str, Any]:
    """Simulate one deployment under one benchmark -> metrics plus the deployment echoed.

    Steps: load the model and profile; build the decode (and prefill) plans; size the KV cache
    per rank from the memory accounting; sample the requests; run the serving loop; compute the
    metrics; record the simulation's own wall time as ``sim_wall_s``. ``run_out`` receives the
    :class:`ServingRun` itself.
    """
    t0 = time.perf_counter()
    cache = cache or StepCache()
    model = load_model(sc.model)
    profile = load_profile(sc.hardware)
    gpn = sc.gpus_per_node or profile.gpus_per_node
    if sc.disagg:
        p_nodes, d_nodes = sc.disagg
        if sc.nodes is not None and sc.nodes != p_nodes + d_nodes:
            raise EpsimError(f"--disagg {p_nodes}:{d_nodes} needs {p_nodes + d_nodes} nodes but "
                             f"--nodes is {sc.nodes}")
    else:
        p_nodes, d_nodes = 0, sc.nodes or 1
    plan = _side_plan(model, sc, d_nodes, gpn, decode_side=True)
    budget = accounting.memory_budget(model, plan, profile.hbm_bytes)
    decode_model = cache.get(model, plan, profile, sc)
    prefill_model = None
    pplan = None
    extra: dict[str, Any] = {}
    if sc.disagg:
        pplan = _side_plan(model, sc, p_nodes, gpn, decode_side=False)
        pbudget = accounting.memory_budget(model, pplan, profile.hbm_bytes)
        prefill_model = cache.get(model, pplan, profile, sc)
        per_token = accounting.kv_bytes_per_token(model, sc.kv_dtype, pplan.tp)
        config = ServingConfig(
            dp=plan.dp, kv_capacity_tokens=budget.kv_capacity_tokens,
            chunked_prefill_size=sc.chunked_prefill_size, dp_balance=sc.dp_balance,
            prefill_dp=pplan.dp, prefill_kv_capacity_tokens=pbudget.kv_capacity_tokens,
            kv_transfer_s_per_token=per_token / profile.nic_bandwidth_per_gpu)
        extra = {"prefill_nodes": p_nodes, "decode_nodes": d_nodes, "prefill_dp": pplan.dp,
                 "kv_transfer_ms_per_request": per_token / profile.nic_bandwidth_per_gpu
                 * float(sc.workload.isl or 0) * 1e3 if sc.workload.isl else None}
    else:
        config = ServingConfig(dp=plan.dp, kv_capacity_tokens=budget.kv_capacity_tokens,
                               chunked_prefill_size=sc.chunked_prefill_size,
                               dp_balance=sc.dp_balance)
    calls_before = _calls([decode_model, *( [prefill_model] if prefill_model else [])])
    requests = sample_requests(sc.workload, model)  # refuses requests beyond the context
    run = simulate_serving(requests, config, decode_model, prefill_model,
                           max_concurrency=sc.workload.max_concurrency)
    if run_out is not None:  # the whole run, for the serving trace (sim.serving_trace)
        run_out.append(run)
    metrics = compute_metrics(run, sc.percentiles, sc.percentile_metrics)
    if steps_out is not None:  # the timeline, for a trace: pid 0 decode/co-located, 1 prefill
        steps_out.extend({"pid": 1 if s.engine == "prefill" else 0, "kind": s.kind,
                          "start_s": s.start_s, "seconds": s.seconds,
                          "decode_tokens": s.decode_tokens, "prefill_tokens": s.prefill_tokens,
                          "max_seqs": s.max_seqs, "context": s.context, "kv_usage": s.kv_usage}
                         for s in run.steps)
    metrics["step_sim_calls"] = _calls([decode_model, *([prefill_model] if prefill_model else [])]
                                       ) - calls_before
    w = sc.workload
    out: dict[str, Any] = {
        "model": model.name, "hardware": profile.name,
        "nodes": p_nodes + d_nodes, "gpus_per_node": gpn, "gpus": (p_nodes + d_nodes) * gpn,
        "dp": plan.dp, "tp": plan.tp, "ep": plan.ep,
        "dbo": sc.dbo, "eplb": sc.eplb, "graph": sc.graph, "kv_dtype": sc.kv_dtype,
        "disagg": f"{p_nodes}:{d_nodes}" if sc.disagg else None, **extra,
        "dataset": w.dataset, "isl": w.isl, "osl": w.osl,
        "max_concurrency": w.max_concurrency,
        "request_rate": "inf" if math.isinf(w.request_rate) else w.request_rate,
        "seed": w.seed, "chunked_prefill_size": sc.chunked_prefill_size,
        "kv_capacity_tokens_per_rank": budget.kv_capacity_tokens,
        **metrics,
    }
    out["sim_wall_s"] = time.perf_counter() - t0
    return out


# --------------------------------------------------------------------------------------------
# SLOs
# --------------------------------------------------------------------------------------------

_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": lambda a, b: a <= b, "<": lambda a, b: a < b,
    ">=": lambda a, b: a >= b, ">": lambda a, b: a > b,
}
_LATENCY_KEY = re.compile(r"(mean|median|std|p(\d+(?:\.\d+)?))_(" + "|".join(METRICS) + r")_ms")
#: non-latency metrics an SLO may bound too
SLO_OTHER_KEYS = ("output_throughput", "total_token_throughput", "request_throughput",
                  "decode_throughput", "mean_decode_step_ms", "kv_cache_usage",
                  "expert_imbalance")


@dataclass(frozen=True)
class SLO:
    """A conjunction of bounds on metric keys.

    terms: ``((metric, op, value), ...)``. Example: ``(("median_itl_ms", "<=", 100.0),)``.
    """

    terms: tuple[tuple[str, str, float], ...]

    def met(self, metrics: Mapping[str, Any]) -> bool:
        return all(_OPS[op](float(metrics[k]), v) for k, op, v in self.terms)

    def percentiles(self) -> tuple[float, ...]:
        """The percentiles the SLO names (they must be computed)."""
        out = []
        for k, _, _ in self.terms:
            m = _LATENCY_KEY.fullmatch(k)
            if m and m.group(2):
                out.append(float(m.group(2)))
        return tuple(out)

    def metrics(self) -> tuple[str, ...]:
        out = []
        for k, _, _ in self.terms:
            m = _LATENCY_KEY.fullmatch(k)
            if m and m.group(2):
                out.append(m.group(3))
        return tuple(out)

    def __str__(self) -> str:
        return ",".join(f"{k}{op}{v:g}" for k, op, v in self.terms)


def parse_slo(text: str) -> SLO:
    """``"median_itl_ms<=100,p90_ttft_ms<=5000"`` -> :class:`SLO`; one-line error otherwise."""
    terms = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.]+)\s*(<=|>=|<|>)\s*([-+0-9.eE]+)", part)
        if not m:
            raise EpsimError(f"SLO term {part!r} does not parse (expected e.g. median_itl_ms<=100)")
        key, op, value = m.group(1), m.group(2), m.group(3)
        if not (_LATENCY_KEY.fullmatch(key) or key in SLO_OTHER_KEYS):
            raise EpsimError(
                f"unknown SLO metric {key!r} (use mean_/median_/pNN_ of "
                f"{', '.join(METRICS)} with _ms, or one of {', '.join(SLO_OTHER_KEYS)})")
        pm = _LATENCY_KEY.fullmatch(key)
        if pm and pm.group(2) and not 0 <= float(pm.group(2)) <= 100:
            raise EpsimError(f"SLO metric {key!r}: percentile must be in [0, 100]")
        try:
            v = float(value)
        except ValueError:
            raise EpsimError(f"SLO term {part!r}: {value!r} is not a number") from None
        if not math.isfinite(v):
            raise EpsimError(f"SLO term {part!r}: bound must be finite")
        terms.append((key, op, v))
    if not terms:
        raise EpsimError(f"empty SLO {text!r} (expected e.g. median_itl_ms<=100)")
    return SLO(tuple(terms))


def with_slo_metrics(sc: Scenario, slo: SLO) -> Scenario:
    """``sc`` computing every percentile and metric the SLO names."""
    pct = tuple(dict.fromkeys([*sc.percentiles, *slo.percentiles()]))
    mets = tuple(dict.fromkeys([*sc.percentile_metrics, *slo.metrics()]))
    return sc.with_(percentiles=pct, percentile_metrics=mets)


# --------------------------------------------------------------------------------------------
# Tune
# --------------------------------------------------------------------------------------------


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
        out = []
        for split, kv, graph, dbo, c in itertools.product(
                self.splits, self.kv_dtype, self.graph, self.dbo, self.concurrency):
            out.append({"split": split, "kv_dtype": kv, "graph": graph, "dbo": dbo,
                        "concurrency": c})
        return out

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
    changes["workload"] = replace(sc.workload, max_concurrency=c,
                                  num_prompts=num_prompts or c)
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


@dataclass
class TuneResult:
    """best: the feasible point with the highest objective (``None`` if none meets the SLO);
    frontier: the objective/latency Pareto frontier over every point; points: every point."""

    best: dict[str, Any] | None
    frontier: list[dict[str, Any]]
    points: list[dict[str, Any]]
    objective: str
    latency: str


def _point_row(point: Mapping[str, Any], result: Mapping[str, Any], slo: SLO) -> dict[str, Any]:
    row = {"concurrency": point["concurrency"], "dp": result["dp"], "tp": result["tp"],
           "ep": result["ep"], "dbo": point["dbo"], "graph": point["graph"],
           "kv_dtype": point["kv_dtype"]}
    row.update(result)
    row["meets_slo"] = slo.met(result)
    return row


def tune(base: Scenario, slo: SLO, space: SearchSpace, *, objective: str = "output_throughput",
         num_prompts: int | None = None, cache: StepCache | None = None,
         progress: Callable[[int, int], None] | None = None) -> TuneResult:
    """Evaluate every point of ``space``; the best meeting ``slo`` and the frontier.

    Infeasible plans (a split that does not divide the model, weights that do not fit) are
    skipped, not fatal; if no point at all can run, the first such error is raised.
    """
    cache = cache or StepCache()
    base = with_slo_metrics(base, slo)
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    pts = space.points()
    for n, point in enumerate(pts, 1):
        try:
            result = run_scenario(apply_point(base, point, num_prompts), cache)
        except EpsimError as exc:
            errors.append(str(exc))
        else:
            rows.append(_point_row(point, result, slo))
        if progress:
            progress(n, len(pts))
    if not rows:
        raise EpsimError(f"no point of the search space can run: {errors[0]}")
    latency = slo.terms[0][0] if _LATENCY_KEY.fullmatch(slo.terms[0][0]) else "median_itl_ms"
    feasible = [r for r in rows if r["meets_slo"]]
    best = max(feasible, key=lambda r: r[objective]) if feasible else None
    return TuneResult(best, pareto_frontier(rows, objective, latency), rows, objective, latency)


# --------------------------------------------------------------------------------------------
# Plan
# --------------------------------------------------------------------------------------------


@dataclass
class CapacityPlan:
    """How many deployment units serve a target output throughput.

    hardware: the profile. unit: the tuned unit's row (its config and metrics).
    unit_nodes / prefill_nodes_per_unit / decode_nodes_per_unit: one unit's node counts.
    units / nodes / prefill_nodes / decode_nodes / gpus: the whole deployment.
    per_node_output_throughput: the unit's output tok/s divided by its nodes.
    served_output_throughput: units x the unit's output tok/s (>= the target).
    gpu_hour_usd / cost_per_hour_usd / usd_per_million_output_tokens: with a GPU price.
    """

    hardware: str
    target_output_throughput: float
    unit: dict[str, Any]
    unit_nodes: int
    prefill_nodes_per_unit: int
    decode_nodes_per_unit: int
    units: int
    nodes: int
    prefill_nodes: int
    decode_nodes: int
    gpus: int
    per_node_output_throughput: float
    served_output_throughput: float
    gpu_hour_usd: float | None = None
    cost_per_hour_usd: float | None = None
    usd_per_million_output_tokens: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def units_needed(target: float, unit_throughput: float) -> int:
    """The fewest units whose summed throughput reaches ``target``."""
    if unit_throughput <= 0:
        raise EpsimError("the deployment unit has no throughput")
    return max(1, math.ceil(target / unit_throughput - 1e-9))


def plan_capacity(base: Scenario, slo: SLO, target: float, space: SearchSpace, *,
                  hardware: Sequence[str], unit_layouts: Sequence[tuple[int, int] | None],
                  unit_nodes: int = 1, gpu_hour_usd: Mapping[str, float] | None = None,
                  num_prompts: int | None = None, cache: StepCache | None = None,
                  progress: Callable[[int, int], None] | None = None) -> list[CapacityPlan]:
    """One :class:`CapacityPlan` per hardware that can meet the SLO, cheapest (or fewest nodes)
    first.

    A unit is ``unit_nodes`` co-located nodes (layout ``None``) or a ``(P, D)`` prefill/decode
    split. Units are independent replicas, so ``units = ceil(target / unit throughput)``.
    """
    if not target > 0 or not math.isfinite(target):
        raise EpsimError(f"target output throughput must be a positive number, got {target}")
    cache = cache or StepCache()
    total = len(hardware) * len(unit_layouts) * space.size()
    done = [0]

    def tick(_n: int, _t: int) -> None:
        done[0] += 1
        if progress:
            progress(done[0], total)

    plans: list[CapacityPlan] = []
    for hw in hardware:
        best: tuple[float, dict[str, Any], int, int] | None = None
        for layout in unit_layouts:
            sc = base.with_(hardware=hw, disagg=layout,
                            nodes=None if layout else unit_nodes)
            start = done[0]
            try:
                res = tune(sc, slo, space, num_prompts=num_prompts, cache=cache, progress=tick)
            except EpsimError:  # this hardware/layout cannot run at all (e.g. weights too big)
                done[0] = start + space.size()
                continue
            if res.best is None:
                continue
            p, d = layout if layout else (0, unit_nodes)
            per_node = res.best["output_throughput"] / (p + d)
            if best is None or per_node > best[0]:
                best = (per_node, res.best, p, d)
        if best is None:
            continue
        per_node, row, p, d = best
        units = units_needed(target, row["output_throughput"])
        gpn = row["gpus_per_node"]
        nodes = units * (p + d)
        price = (gpu_hour_usd or {}).get(hw, (gpu_hour_usd or {}).get("*"))
        cost = nodes * gpn * price if price is not None else None
        plans.append(CapacityPlan(
            hardware=hw, target_output_throughput=target, unit=row, unit_nodes=p + d,
            prefill_nodes_per_unit=p, decode_nodes_per_unit=d, units=units, nodes=nodes,
            prefill_nodes=units * p, decode_nodes=units * d, gpus=nodes * gpn,
            per_node_output_throughput=per_node,
            served_output_throughput=units * row["output_throughput"],
            gpu_hour_usd=price, cost_per_hour_usd=cost,
            usd_per_million_output_tokens=(cost / (target * 3600) * 1e6) if cost is not None
            else None))
    plans.sort(key=lambda c: (c.cost_per_hour_usd if c.cost_per_hour_usd is not None else 0.0,
                              c.nodes))
    return plans
