"""Capacity planning: how many deployment units serve a target output throughput within an SLO.

    unit      the replica a deployment is built of: ``unit_nodes`` co-located nodes, or a
              ``(P, D)`` prefill:decode split; tuned per hardware for the SLO (``epsim.sim.search.tune``)
    per node  the unit's output tok/s divided by its nodes: how units are compared
    units     independent replicas, so ``ceil(target / unit throughput)`` of them
    instances what the deployment is counted in: a unit holds one instance per side, or with
              ``--instance-nodes K`` each side's nodes / K instances (behind the unit's
              router, simulated with it); the plan reports the prefill, decode (or
              co-located) instances of the whole deployment
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from epsim.model.errors import EpsimError
from epsim.sim.deployment import deployment_layout
from epsim.sim.scenario import StepCache, check_scenario
from epsim.sim.spec import Scenario

from .slo import SLO
from .tune import SearchOptions, SearchSpace, TuneResult, planned_points, split_errors, tune


@dataclass(frozen=True)
class CapacityPlan:
    """How many deployment units serve a target output throughput.

    hardware: the profile. unit: the tuned unit's row (its config and metrics).
    unit_nodes / prefill_nodes_per_unit / decode_nodes_per_unit: one unit's node counts.
    units / nodes / prefill_nodes / decode_nodes / gpus: the whole deployment.
    per_node_output_throughput: the unit's output tok/s divided by its nodes.
    served_output_throughput: units x the unit's output tok/s (>= the target).
    gpu_hour_usd / cost_per_hour_usd / usd_per_million_output_tokens: with a GPU price.
    instance_nodes: nodes per instance (``None``: one instance per side of a unit).
    instances / prefill_instances / decode_instances: the deployment's instances, all / of the
        prefill side / decoding (co-located or the decode side).
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
    instance_nodes: int | None = None
    instances: int = 0
    prefill_instances: int = 0
    decode_instances: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def units_needed(target: float, unit_throughput: float) -> int:
    """The fewest units whose summed throughput reaches ``target``."""
    if unit_throughput <= 0:
        raise EpsimError("the deployment unit has no throughput")
    return max(1, math.ceil(target / unit_throughput - 1e-9))


@dataclass(frozen=True)
class UnitSearch:
    """One unit's search: its hardware, layout (``None``: co-located; else ``(P, D)``) and
    every point tuned (the plan keeps only the best; the frontier chart draws them all)."""

    hardware: str
    layout: tuple[int, int] | None
    result: TuneResult


@dataclass(frozen=True)
class _Unit:
    """The best unit of one hardware: its tuned row and its prefill / decode node counts."""

    per_node: float
    row: dict[str, Any]
    prefill_nodes: int
    decode_nodes: int


@dataclass
class _Progress:
    """Points done over every hardware x layout x point, reported through ``report``: each
    unit's search reports ``n`` of its ``per_unit`` points, after the units before it."""

    per_unit: int
    units: int
    report: Callable[[int, int], None] | None
    start: int = 0

    def tick(self, n: int, _of: int = 0) -> None:
        if self.report:
            self.report(self.start + n, self.per_unit * self.units)

    def next_unit(self) -> None:
        self.start += self.per_unit
        self.tick(0)


def _unit_scenario(base: Scenario, hw: str, layout: tuple[int, int] | None, unit_nodes: int
                   ) -> Scenario:
    """The unit of ``layout`` on ``hw`` (a co-located unit has no prefill plan)."""
    if layout:
        return base.with_(hardware=hw, disagg=layout, nodes=None)
    return base.with_(hardware=hw, disagg=None, nodes=unit_nodes, prefill_tp=None,
                      prefill_dp=None, prefill_ep=None)


def _check_splits(base: Scenario, space: SearchSpace, hardware: Sequence[str],
                  unit_layouts: Sequence[tuple[int, int] | None], unit_nodes: int) -> None:
    """A split that fits no unit of any hardware is an error (one that fits some is tried)."""
    failing: dict[tuple[int, int], str] | None = None
    for hw in hardware:
        for layout in unit_layouts:
            sc = _unit_scenario(base, hw, layout, unit_nodes)
            deployment_layout(sc.deployment)  # --instance-nodes must divide every unit's sides
            errors = split_errors(sc, space)
            failing = errors if failing is None else {
                s: why for s, why in failing.items() if s in errors}
    for (dp, tp), why in (failing or {}).items():
        raise EpsimError(f"--splits {dp}x{tp} fits no unit: {why}")


def _best_unit(base: Scenario, slo: SLO, space: SearchSpace, hw: str,
               unit_layouts: Sequence[tuple[int, int] | None], unit_nodes: int,
               num_prompts: int | None, cache: StepCache, progress: _Progress,
               options: SearchOptions | None, searched: list[UnitSearch] | None = None
               ) -> _Unit | None:
    """The layout of ``hw`` with the highest per-node throughput meeting the SLO, if any
    (each layout's search appended to ``searched``)."""
    best: _Unit | None = None
    for layout in unit_layouts:
        sc = _unit_scenario(base, hw, layout, unit_nodes)
        try:
            res = tune(sc, slo, space, num_prompts=num_prompts, cache=cache,
                       progress=progress.tick, check_splits=False, options=options)
        except EpsimError:  # this hardware/layout cannot run at all (e.g. weights too big)
            continue
        finally:
            progress.next_unit()
        if searched is not None:
            searched.append(UnitSearch(hw, layout, res))
        if res.best is None:
            continue
        p, d = layout if layout else (0, unit_nodes)
        per_node = res.best["output_throughput"] / (p + d)
        if best is None or per_node > best.per_node:
            best = _Unit(per_node, res.best, p, d)
    return best


def _size(hw: str, unit: _Unit, target: float, price: float | None,
          instance_nodes: int | None = None) -> CapacityPlan:
    """The deployment of ``unit`` replicas serving ``target``, priced when ``price`` is known."""
    row, p, d = unit.row, unit.prefill_nodes, unit.decode_nodes
    units = units_needed(target, row["output_throughput"])
    k = instance_nodes
    per_p = (p // k if k else 1) if p else 0
    per_d = d // k if k else 1
    gpn = row["gpus_per_node"]
    nodes = units * (p + d)
    cost = nodes * gpn * price if price is not None else None
    return CapacityPlan(
        hardware=hw, target_output_throughput=target, unit=row, unit_nodes=p + d,
        prefill_nodes_per_unit=p, decode_nodes_per_unit=d, units=units, nodes=nodes,
        prefill_nodes=units * p, decode_nodes=units * d, gpus=nodes * gpn,
        per_node_output_throughput=unit.per_node,
        served_output_throughput=units * row["output_throughput"],
        gpu_hour_usd=price, cost_per_hour_usd=cost,
        usd_per_million_output_tokens=(cost / (target * 3600) * 1e6) if cost is not None
        else None, instance_nodes=k, instances=units * (per_p + per_d),
        prefill_instances=units * per_p, decode_instances=units * per_d)


def plan_capacity(base: Scenario, slo: SLO, target: float, space: SearchSpace, *,
                  hardware: Sequence[str], unit_layouts: Sequence[tuple[int, int] | None],
                  unit_nodes: int = 1, gpu_hour_usd: Mapping[str, float] | None = None,
                  num_prompts: int | None = None, cache: StepCache | None = None,
                  progress: Callable[[int, int], None] | None = None,
                  options: SearchOptions | None = None,
                  searched: list[UnitSearch] | None = None) -> list[CapacityPlan]:
    """One :class:`CapacityPlan` per hardware that can meet the SLO, cheapest (or fewest nodes)
    first.

    A unit is ``unit_nodes`` co-located nodes (layout ``None``) or a ``(P, D)`` prefill/decode
    split. Units are independent replicas, so ``units = ceil(target / unit throughput)``.
    ``gpu_hour_usd``: USD per GPU-hour by hardware name, ``"*"`` for any other.
    ``options``: how each unit's search runs (strategy, trials, executor; not the result).
    ``searched``: a list that receives every unit search (e.g. for the frontier chart).
    """
    if not target > 0 or not math.isfinite(target):
        raise EpsimError(f"target output throughput must be a positive number, got {target}")
    check_scenario(base.with_(prefill_tp=None, prefill_dp=None, prefill_ep=None))  # co-located
    _check_splits(base, space, hardware, unit_layouts, unit_nodes)
    cache = cache or StepCache()
    prices = gpu_hour_usd or {}
    opts = options or SearchOptions()
    bar = _Progress(planned_points(space, opts), len(hardware) * len(unit_layouts), progress)
    plans: list[CapacityPlan] = []
    for hw in hardware:
        unit = _best_unit(base, slo, space, hw, unit_layouts, unit_nodes, num_prompts, cache,
                          bar, opts, searched)
        if unit is not None:
            plans.append(_size(hw, unit, target, prices.get(hw, prices.get("*")),
                               base.deployment.instances.instance_nodes))
    plans.sort(key=lambda c: (c.cost_per_hour_usd if c.cost_per_hour_usd is not None else 0.0,
                              c.nodes))
    return plans
