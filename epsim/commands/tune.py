"""``epsim tune``: the highest throughput whose percentiles meet an SLO, over a search space."""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping, Sequence
from typing import Any

from epsim.model.errors import EpsimError
from epsim.sim.slo import parse_slo
from epsim.sim.tune import SearchSpace, TuneResult, tune

from ..common import comma_list, emit_json, kv_dtype, positive_int, request_rate
from .predict import Progress, add_serving_args, scenario_from_args

OBJECTIVES = ("output_throughput", "decode_throughput", "total_token_throughput")
DEFAULT_CONCURRENCY = "256,512,1024,2048,3072,4096"


def _onoff(text: str) -> bool:
    if text in ("on", "true", "1"):
        return True
    if text in ("off", "false", "0"):
        return False
    raise ValueError(text)


def _split(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(?:dp)?(\d+)\s*[x/]\s*(?:tp)?(\d+)", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(text)
    return int(m.group(1)), int(m.group(2))


def add_space_args(p: argparse.ArgumentParser) -> None:
    """The search-space and SLO arguments ``tune`` and ``plan`` share."""
    add_serving_args(p, lists=True, hardware_required=False)
    g = p.add_argument_group("SLO and search space")
    g.add_argument("--slo", required=True,
                   help='bounds on metric keys, e.g. "median_itl_ms<=100,p90_ttft_ms<=5000"')
    g.add_argument("--objective", choices=OBJECTIVES, default="output_throughput",
                   help="what to maximise (default output_throughput)")
    g.add_argument("--dbo", default="on,off", help="DBO values to try (default on,off)")
    g.add_argument("--graph", default="on", help="graph-mode values to try (default on)")
    g.add_argument("--splits", default=None,
                   help="dp x tp splits to try, e.g. 8x1,4x2,1x8 (default: the plan's own)")
    p.set_defaults(concurrency=None)


def space_from_args(args: argparse.Namespace) -> SearchSpace:
    conc = args.concurrency or DEFAULT_CONCURRENCY
    return SearchSpace(
        concurrency=tuple(comma_list(conc, positive_int, "concurrency")),
        # --no-dbo / --no-graph pin the knob off; otherwise the lists say what to try
        dbo=(False,) if args.no_dbo else tuple(dict.fromkeys(
            comma_list(args.dbo, _onoff, "dbo"))),
        graph=(False,) if args.no_graph else tuple(dict.fromkeys(
            comma_list(args.graph, _onoff, "graph"))),
        splits=tuple(comma_list(args.splits, _split, "splits")) if args.splits else (None,),
        kv_dtype=tuple(dict.fromkeys(comma_list(args.kv_dtype, kv_dtype, "kv-dtype"))),
    )


def base_from_args(args: argparse.Namespace, hardware: str):
    """The scenario the search varies (first value of each list stands in until varied)."""
    def one(value: Any, convert, name: str) -> Any:
        values = comma_list(value, convert, name)
        if len(values) > 1:
            raise EpsimError(f"--{name} takes one value here")
        return values[0]

    return scenario_from_args(
        args, hardware=hardware, concurrency=1,
        isl=one(args.isl, positive_int, "isl"), osl=one(args.osl, positive_int, "osl"),
        request_rate=one(str(args.request_rate), request_rate, "request-rate"), kv_dtype="fp8")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "tune", help="best throughput meeting an SLO over concurrency, DBO, splits, KV, graph",
        description="Simulate every point of the search space (concurrency, DBO on/off, dp x tp "
        "splits, KV dtype, graph mode) and report the highest throughput whose metrics meet "
        "the SLO, with the throughput/latency frontier.")
    add_space_args(p)
    p.set_defaults(run=run)


COLS = ("concurrency", "dp", "tp", "ep", "dbo", "graph", "kv_dtype", "output_throughput",
        "decode_throughput", "median_ttft_ms", "p90_ttft_ms", "median_itl_ms", "meets_slo")


def _cell(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.1f}"
    return str(v)


def print_rows(rows: Sequence[Mapping[str, Any]], cols: Sequence[str]) -> None:
    cells = [[_cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  " + "  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for row in cells:
        print("  " + "  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def summary(res: TuneResult, slo: str) -> dict[str, Any]:
    return {"slo": slo, "objective": res.objective, "best": res.best,
            "frontier": res.frontier, "points": res.points}


def run(args: argparse.Namespace) -> int:
    slo = parse_slo(args.slo)
    space = space_from_args(args)
    base = base_from_args(args, args.hardware or "mi300x")
    bar = Progress("tune", enabled=not args.json)
    try:
        res = tune(base, slo, space, objective=args.objective,
                   num_prompts=args.num_prompts, progress=bar)
    finally:
        bar.close()
    if args.json:
        emit_json(summary(res, str(slo)))
        return 0
    cols = tuple(dict.fromkeys([*COLS[:-1], *(k for k, _, _ in slo.terms), COLS[-1]]))
    print(f"SLO {slo}; maximising {res.objective}; {len(res.points)} points simulated")
    if res.best is None:
        print("no point meets the SLO; the frontier:")
    else:
        b = res.best
        print(f"best: concurrency {b['concurrency']}, dp {b['dp']} tp {b['tp']} ep {b['ep']}, "
              f"DBO {'on' if b['dbo'] else 'off'}, graph {'on' if b['graph'] else 'off'}, "
              f"KV {b['kv_dtype']}: {b[res.objective]:,.1f} tok/s "
              + ", ".join(f"{k} {b[k]:.1f}" for k, _, _ in slo.terms))
        print("frontier (throughput vs " + res.latency + "):")
    print_rows(res.frontier, cols)
    return 0
