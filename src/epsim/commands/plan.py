"""``epsim plan``: how many nodes serve a target output throughput within an SLO, and the cost.

The parser, the checks, the search's run and the outputs are ``epsim.search_command``'s (shared
with ``epsim tune``); this module keeps plan's flags (the target, the unit layouts, the prices),
the capacity search it calls and how it reports the plans.
"""

from __future__ import annotations

import argparse
from typing import Any

from epsim.model.errors import EpsimError
from epsim.sim.hardware.profile import load_profile
from epsim.sim.search.capacity import UnitSearch, plan_capacity
from epsim.sim.search.samplers import choose

from ..common import print_columns
from ..fidelity import SERVING_HEADLINE, band_text, regime_of, stamp
from ..frontier_chart import frontier_of, series_label
from ..inputs import add_flag
from ..search_command import add_search_parser, finish, run_search, search_inputs


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    add_search_parser(
        subparsers, "plan", run=run, before=[_add_target], after=[_add_units], prices=False,
        help="nodes, prefill/decode split and cost to serve a target throughput",
        description="Tune a deployment unit (co-located nodes, or a prefill:decode split) per "
        "hardware for the SLO, then size the deployment to the target output throughput.")


def _add_target(p: argparse.ArgumentParser) -> None:
    add_flag(p, "--target-output-throughput", required=True,
             metavar="TOK_S", help="output tokens/s the deployment must serve")


def _add_units(p: argparse.ArgumentParser) -> None:
    add_flag(p, "--disagg-splits", default=None, metavar="P:D,...",
             help="prefill:decode node splits to try as units (e.g. 1:1,1:2)")
    p.add_argument("--no-colocated", action="store_true",
                   help="do not try co-located units")
    add_flag(p, "--gpu-hour-usd", default=None)


def _layouts(args: argparse.Namespace) -> list[tuple[int, int] | None]:
    """The unit layouts compared: co-located (None) and each prefill:decode split."""
    layouts: list[tuple[int, int] | None] = [] if args.no_colocated else [None]
    layouts += list(args.disagg_splits or ())
    if args.disagg and args.disagg not in layouts:
        layouts.append(args.disagg)
    if not layouts:
        raise EpsimError("--no-colocated needs --disagg-splits")
    return layouts


def _check_profiles(args: argparse.Namespace, hardware: list[str]) -> None:
    for name in hardware:  # every profile readable before any point is simulated
        load_profile(name, kernels=args.kernels)


def run(args: argparse.Namespace) -> int:
    slo, prices = args.slo, args.gpu_hour_usd
    inputs = search_inputs(args, units=True, check=lambda hw: _check_profiles(args, hw))
    hardware, layouts = inputs.hardware, _layouts(args)
    searched: list[UnitSearch] = []
    done = run_search("plan", args, inputs, lambda options, bar: plan_capacity(
        inputs.base, slo, args.target_output_throughput, inputs.space, hardware=hardware,
        unit_layouts=layouts, unit_nodes=(args.nodes or (1,))[0], gpu_hour_usd=prices,
        num_prompts=args.num_prompts, progress=bar, options=options, searched=searched),
        units=len(hardware) * len(layouts))
    plans = done.result
    points = _frontier(searched, prices)
    if not plans:
        raise EpsimError(f"no configuration of {', '.join(hardware)} meets the SLO {slo}")
    return finish("plan", args, points, searched[0].result.points[0] if points else None,
                  lambda: {"slo": str(slo),
                           "target_output_throughput": args.target_output_throughput,
                           "plans": [_stamped(c.as_dict()) for c in plans],
                           "interactivity_frontier": points,
                           **({"boundaries": _boundaries(searched)}
                              if args.search == "bisect" else {}),
                           "error_band": _stamped(plans[0].as_dict())["error_band"],
                           "diagnostics": done.diagnostics(
                               choose(args.search, inputs.space.size()))},
                  lambda: print_plans(args, plans))


def print_plans(args: argparse.Namespace, plans: list[Any]) -> None:
    """The plans as a table, and the first plan's error band."""
    print(f"target {args.target_output_throughput:,.0f} output tok/s within {args.slo}")
    rows: list[dict[str, Any]] = []
    for c in plans:
        u = c.unit
        rows.append({
            "hardware": c.hardware, "nodes": c.nodes, "prefill": c.prefill_nodes,
            "decode": c.decode_nodes, "gpus": c.gpus, "instances": c.instances,
            "unit": (f"{c.prefill_nodes_per_unit}:{c.decode_nodes_per_unit}"
                     if c.prefill_nodes_per_unit else f"{c.unit_nodes} node co-located"),
            "conc/unit": u["concurrency"], "dp": u["dp"], "tp": u["tp"],
            "dbo": u["dbo"], "kv": u["kv_dtype"],
            "tok/s/node": c.per_node_output_throughput,
            "$/h": c.cost_per_hour_usd if c.cost_per_hour_usd is not None else "-",
            "$/Mtok": c.usd_per_million_output_tokens
            if c.usd_per_million_output_tokens is not None else "-",
        })
    print_columns(rows, list(rows[0]))
    print(f"error band (first plan): {band_text(_stamped(plans[0].as_dict())['error_band'])}")


def _boundaries(searched: list[UnitSearch]) -> list[dict[str, Any]]:
    """Under --search bisect: each unit's deployments with their highest load in the SLO."""
    return [{"hardware": u.hardware, "layout": list(u.layout) if u.layout else None, **b}
            for u in searched for b in u.result.boundaries]


def _stamped(plan: dict[str, Any]) -> dict[str, Any]:
    """A plan with the error band of its unit's regime."""
    u = plan["unit"]
    disagg = bool(plan.get("prefill_nodes_per_unit"))
    return stamp(plan, regime_of(ep=u["ep"], disaggregated=disagg), SERVING_HEADLINE,
                 figures=u)


def _frontier(searched: list[UnitSearch], prices: dict[str, float] | None
              ) -> list[dict[str, Any]]:
    """Every unit's points on the frontier chart: one series per hardware/engine and unit
    layout (each unit's every configuration and concurrency)."""
    rows = []
    for u in searched:
        unit = (f"{u.layout[0]}:{u.layout[1]} P:D" if u.layout else
                f"{u.result.points[0]['nodes']} node co-located")
        rows += [{**r, "unit": unit} for r in u.result.points]
    return frontier_of(rows, lambda r: series_label(r, ()) + f", {r['unit']}", prices) \
        if rows else []
