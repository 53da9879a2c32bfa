"""``epsim sweep``: ``predict`` over comma lists (concurrency, request rate, lengths, KV dtype)."""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from epsim.sim.scenario import check_scenario
from epsim.sim.search.executors import Executor, run_scenario_task, split_diagnostics

from ..common import Progress, emit_json, print_columns, write_csv
from ..frontier_chart import (
    add_frontier_args,
    chart_title,
    check_prices,
    frontier_of,
    require_matplotlib,
    series_label,
    write_frontier_plot,
)
from ..inputs import add_flag, as_list
from ..options import add_scenario_args, scenario_from_args
from ..search_args import (
    add_executor_args,
    executor_from_args,
    search_diagnostics,
)
from ..work import check_grid


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "sweep", help="predict over comma lists of concurrency, rate, lengths, KV dtype",
        description="Run predict for every combination of the comma lists given (e.g. "
        "--concurrency 1024,2048,3072,4096); print a table, or write --csv / --plot.")
    add_scenario_args(p, lists=True, hardware_lists=True)
    add_executor_args(p, search=False)
    add_flag(p, "--csv", metavar="OUT", default=None, help="write the results as CSV")
    add_frontier_args(p)
    p.set_defaults(run=run)


#: the swept flags, outermost first (the grid's order)
SWEPT = ("hardware", "concurrency", "request_rate", "isl", "osl", "kv_dtype")


def sweep(args: argparse.Namespace, progress: Callable[[int, int], None] | None = None,
          executor: Executor | None = None) -> list[dict[str, Any]]:
    """Every combination of the lists (hardware outermost), in ``itertools.product`` order, on
    ``executor``
    (serial by default); each row's wall time and step count under ``"diagnostics"``."""
    grid = list(itertools.product(*(as_list(getattr(args, k)) for k in SWEPT)))
    scenarios = [scenario_from_args(args, hardware=hw, concurrency=conc, request_rate=rate,
                                    isl=isl, osl=osl, kv_dtype=kv)
                 for hw, conc, rate, isl, osl, kv in grid]
    for sc in scenarios:  # every point's lengths, before any point is simulated
        check_scenario(sc)
    # points that differ only in their benchmark share step models: one task each
    rows = (executor or Executor()).map(run_scenario_task, scenarios, progress,
                                        group=lambda sc: sc.with_(workload=None))
    return [split_diagnostics(r) for r in rows]


#: the swept keys that split the frontier chart's series (concurrency moves along a line)
SERIES_KEYS = ("isl", "osl", "kv_dtype", "request_rate")


def frontier(args: argparse.Namespace, rows: Sequence[Mapping[str, Any]]
             ) -> list[dict[str, Any]]:
    """The sweep's points on the frontier chart: one series per hardware/engine and each other
    swept value, concurrency along it."""
    split = [k for k in SERIES_KEYS if len({str(r[k]) for r in rows}) > 1]
    return frontier_of([{**r, "concurrency": r["max_concurrency"]} for r in rows],
                       lambda r: series_label(r, split), args.gpu_hour_usd)


def write_plot(points: Sequence[Mapping[str, Any]], rows: Sequence[Mapping[str, Any]],
               path: str) -> None:
    """The frontier chart of the sweep (``epsim.frontier_chart``)."""
    write_frontier_plot(points, path, chart_title(rows[0], "sweep over concurrency"))


def run(args: argparse.Namespace) -> int:
    if args.plot:
        require_matplotlib()
    check_prices(args.gpu_hour_usd, args.hardware)
    check_grid("sweep", args, {k: as_list(getattr(args, k)) for k in SWEPT})
    bar = Progress("sweep", enabled=not args.json)
    t0 = time.perf_counter()
    try:
        with executor_from_args(args) as executor:
            rows = sweep(args, bar, executor)
    finally:
        bar.close()
    points = frontier(args, rows)
    if args.csv:
        write_csv(rows, args.csv)
    if args.frontier_csv:
        write_csv(points, args.frontier_csv)
    if args.plot:
        write_plot(points, rows, args.plot)
    if args.json:
        diagnostics = search_diagnostics(executor, "grid", time.perf_counter() - t0)
        emit_json({"results": rows, "interactivity_frontier": points,
                   "diagnostics": diagnostics})
        return 0
    shown = ("max_concurrency", "request_rate", "isl", "osl", "kv_dtype", "output_throughput",
             "decode_throughput", "median_ttft_ms", "median_itl_ms", "p90_itl_ms",
             "mean_decode_step_ms", "kv_cache_usage")
    if len(args.hardware) > 1:  # rows labelled by the hardware they ran on
        shown = ("hardware", *shown)
    print_columns(rows, shown, digits=2, indent="")
    return 0
