"""``epsim tune``: the highest throughput whose percentiles meet an SLO, over a search space.

The parser, the checks, the search's run and the outputs are ``epsim.search_command``'s (shared
with ``epsim plan``); this module keeps the search it calls and how it reports the answer.
"""

from __future__ import annotations

import argparse
from typing import Any

from epsim.sim.search.tune import TuneResult, tune

from ..common import print_columns
from ..fidelity import SERVING_HEADLINE, band_text, regime_of, stamp
from ..frontier_chart import frontier_of, series_label
from ..search_command import add_search_parser, finish, run_search, search_inputs


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    add_search_parser(
        subparsers, "tune", run=run,
        help="best throughput meeting an SLO over concurrency, DBO, splits, KV, graph",
        description="Simulate every point of the search space (concurrency, DBO on/off, dp x tp "
        "splits, KV dtype, graph mode) and report the highest throughput whose metrics meet "
        "the SLO, with the throughput/latency frontier; --search bisect finds each "
        "deployment's highest concurrency or request rate within the SLO instead.")


COLS = ("concurrency", "dp", "tp", "ep", "dbo", "graph", "kv_dtype", "output_throughput",
        "decode_throughput", "median_ttft_ms", "p90_ttft_ms", "median_itl_ms", "meets_slo")


def summary(res: TuneResult, slo: str) -> dict[str, Any]:
    out = {"slo": slo, "objective": res.objective, "search": res.strategy, "best": res.best,
           "frontier": res.frontier, "points": res.points, "skipped": res.skipped}
    if res.strategy == "bisect":  # each deployment's highest load within the SLO
        out["boundaries"] = res.boundaries
    if res.best is not None:  # the band of the answer: the best point's regime
        b = res.best
        stamp(out, regime_of(ep=b["ep"], disaggregated=bool(b.get("disagg"))),
              SERVING_HEADLINE, figures=b)
    return out


def run(args: argparse.Namespace) -> int:
    slo = args.slo
    inputs = search_inputs(args)
    searched = run_search("tune", args, inputs, lambda options, bar: tune(
        inputs.base, slo, inputs.space, objective=args.objective, num_prompts=args.num_prompts,
        progress=bar, options=options))
    res = searched.result
    # one series per hardware/engine: the best of every configuration at each interactivity
    points = frontier_of(res.points, lambda r: series_label(r, ()), args.gpu_hour_usd)
    return finish("tune", args, points, res.points[0] if res.points else None,
                  lambda: {**summary(res, str(slo)), "interactivity_frontier": points,
                           "diagnostics": searched.diagnostics(res.strategy)},
                  lambda: print_text(res, args))


def print_text(res: TuneResult, args: argparse.Namespace) -> None:
    """The answer as text: the best point, its error band, the frontier, the boundaries."""
    slo = args.slo
    cols = tuple(dict.fromkeys([*COLS[:-1], *(k for k, _, _ in slo.terms), COLS[-1]]))
    print(f"SLO {slo}; maximising {res.objective}; {len(res.points)} points simulated "
          f"({res.strategy} search)"
          + (f", {len(res.skipped)} skipped (first: {res.skipped[0]['reason']})"
             if res.skipped else ""))
    if res.best is None:
        print("no point meets the SLO; the frontier:")
    else:
        b = res.best
        rate = b.get("request_rate")  # the result's echo: a number, or "inf" (closed loop)
        rate = f", {rate:g} req/s" if isinstance(rate, float | int) else ""
        unit = "req/s" if res.objective == "request_goodput" else "tok/s"
        cap = "open loop" if b["concurrency"] is None else f"concurrency {b['concurrency']}"
        print(f"best: {cap}{rate}, dp {b['dp']} tp {b['tp']} "
              f"ep {b['ep']}, DBO {'on' if b['dbo'] else 'off'}, graph "
              f"{'on' if b['graph'] else 'off'}, KV {b['kv_dtype']}: "
              f"{b[res.objective]:,.1f} {unit} "
              + ", ".join(f"{k} {b[k]:.1f}" for k, _, _ in slo.terms))
        print(f"error band: {band_text(summary(res, str(slo))['error_band'])}")
        print("frontier (throughput vs " + res.latency + "):")
    print_columns(res.frontier, cols)
    print_boundaries(res.boundaries, args.sla_variable)


def print_boundaries(rows: list[dict[str, Any]], variable: str) -> None:
    """Under --search bisect: each deployment's highest load meeting the SLO."""
    if not rows:
        return
    print(f"highest {variable} meeting the SLO, per deployment (bisection):")
    for row in rows:
        knobs = ", ".join(f"{k} {v}" for k, v in row["deployment"].items() if v is not None)
        found = "none" if row[variable] is None else f"{row[variable]:g}"
        print(f"  {knobs or 'the deployment'}: {found} ({row['probes']} probes)")
