"""``epsim sweep``: ``predict`` over comma lists (concurrency, request rate, lengths, KV dtype)."""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from epsim.model.errors import EpsimError
from epsim.model.outputs import staged_path, write_text_atomic
from epsim.sim.scenario import check_scenario
from epsim.sim.search.executors import Executor, run_scenario_task, split_diagnostics

from ..common import (
    Progress,
    add_scenario_args,
    emit_json,
    print_columns,
    scenario_from_args,
)
from ..inputs import add_flag, as_list
from ..search_args import (
    add_executor_args,
    executor_from_args,
    search_diagnostics,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "sweep", help="predict over comma lists of concurrency, rate, lengths, KV dtype",
        description="Run predict for every combination of the comma lists given (e.g. "
        "--concurrency 1024,2048,3072,4096); print a table, or write --csv / --plot.")
    add_scenario_args(p, lists=True)
    add_executor_args(p, search=False)
    add_flag(p, "--csv", metavar="OUT", default=None, help="write the results as CSV")
    add_flag(p, "--plot", metavar="OUT.png", default=None,
                   help="plot output throughput against median ITL, one point per concurrency "
                   "(needs matplotlib)")
    p.set_defaults(run=run)


def sweep(args: argparse.Namespace, progress: Callable[[int, int], None] | None = None,
          executor: Executor | None = None) -> list[dict[str, Any]]:
    """Every combination of the lists, in ``itertools.product`` order, on ``executor``
    (serial by default); each row's wall time and step count under ``"diagnostics"``."""
    grid = list(itertools.product(
        as_list(args.concurrency), as_list(args.request_rate), as_list(args.isl),
        as_list(args.osl), as_list(args.kv_dtype)))
    scenarios = [scenario_from_args(args, concurrency=conc, request_rate=rate, isl=isl, osl=osl,
                                    kv_dtype=kv) for conc, rate, isl, osl, kv in grid]
    for sc in scenarios:  # every point's lengths, before any point is simulated
        check_scenario(sc)
    # points that differ only in their benchmark share step models: one task each
    rows = (executor or Executor()).map(run_scenario_task, scenarios, progress,
                                        group=lambda sc: sc.with_(workload=None))
    return [split_diagnostics(r) for r in rows]


def flatten(obj: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level with dotted keys: ``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _csv_cell(value: Any) -> str:
    """A JSON value as a CSV cell, losing nothing: floats as ``repr`` (they read back exactly),
    booleans and lists as JSON spells them, ``None`` empty."""
    if value is None:
        return ""
    if isinstance(value, bool | list | tuple):
        return json.dumps(value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def write_csv(rows: Sequence[Mapping[str, Any]], path: str) -> None:
    """The sweep as CSV: one column per key of the points' JSON (nested keys dotted, e.g.
    ``step_breakdown_ms.attention``), in the JSON's order; written whole or not at all."""
    flat = [flatten(r) for r in rows]
    columns = list(dict.fromkeys(k for r in flat for k in r))
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(columns)
    for r in flat:
        w.writerow([_csv_cell(r.get(c)) for c in columns])
    write_text_atomic(buf.getvalue(), path)


def require_matplotlib() -> None:
    """An error before any work when --plot cannot be drawn."""
    import importlib.util

    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except Exception:  # a broken install: as good as missing
        found = False
    if not found:
        raise EpsimError("--plot needs matplotlib (pip install 'epsim[plot]')")


def write_plot(rows: Sequence[Mapping[str, Any]], path: str) -> None:
    """Output throughput against median ITL, one point per concurrency, like the reference
    report's figure (one line per other swept value). PNG written whole or not at all."""
    require_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["request_rate"], r["isl"], r["osl"], r["kv_dtype"]), []).append(r)
    for (rate, isl, osl, kv), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["median_itl_ms"])
        xs = [r["median_itl_ms"] for r in rs]
        ys = [r["output_throughput"] for r in rs]
        label = f"in {isl} out {osl}, KV {kv}" + ("" if rate == "inf" else f", {rate} req/s")
        line, = ax.plot(xs, ys, marker="o", label=f"{label}: output throughput")
        # the reference report's figure counts decode time only: show that series too
        ax.plot(xs, [r["decode_throughput"] for r in rs], marker="s", linestyle="--",
                color=line.get_color(), alpha=0.6, label=f"{label}: decode only")
        for r, x, y in zip(rs, xs, ys, strict=True):
            ax.annotate(str(r["max_concurrency"]), (x, y), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
    first = rows[0]
    ax.set_title(f"{first['model']} on {first['nodes']}x{first['gpus_per_node']} "
                 f"{first['hardware']} (simulated)")
    ax.set_xlabel("median ITL (ms)")
    ax.set_ylabel("tokens/s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    try:
        with staged_path(path) as tmp:
            fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png")
    finally:
        plt.close(fig)


def run(args: argparse.Namespace) -> int:
    if args.plot:
        require_matplotlib()
    bar = Progress("sweep", enabled=not args.json)
    t0 = time.perf_counter()
    try:
        with executor_from_args(args) as executor:
            rows = sweep(args, bar, executor)
    finally:
        bar.close()
    if args.csv:
        write_csv(rows, args.csv)
    if args.plot:
        write_plot(rows, args.plot)
    if args.json:
        emit_json({"results": rows, "diagnostics": search_diagnostics(
            executor, "grid", time.perf_counter() - t0)})
        return 0
    shown = ("max_concurrency", "request_rate", "isl", "osl", "kv_dtype", "output_throughput",
             "decode_throughput", "median_ttft_ms", "median_itl_ms", "p90_itl_ms",
             "mean_decode_step_ms", "kv_cache_usage")
    print_columns(rows, shown, digits=2, indent="")
    return 0
