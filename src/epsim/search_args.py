"""The flags of a search (sweep, tune, plan): the SLO, the search space, and where the points
run (``sim/search/executors.py``) and how they are picked (``sim/search/samplers.py``); docs/performance.md."""

from __future__ import annotations

import argparse
import math
from typing import Any

from epsim.model.errors import EpsimError
from epsim.sim.search.executors import Executor, make_executor
from epsim.sim.search.samplers import DEFAULT_TRIALS, GRID_MAX_POINTS
from epsim.sim.search.tune import OBJECTIVES, SearchOptions, SearchSpace
from epsim.sim.spec import ExecutionSpec, Scenario

from .inputs import add_flag
from .options import add_scenario_args, scenario_from_args
from .work import add_force_arg

# --------------------------------------------------------------------------------------------
# A search: scenario + SLO + search space (tune, plan)
# --------------------------------------------------------------------------------------------

#: the concurrencies tune and plan try when --concurrency is not given: powers of two from 1,
#: so a strict TTFT term still finds a point
DEFAULT_SEARCH_CONCURRENCY = tuple(2 ** i for i in range(13))  # 1 .. 4096
#: the hardware tune and plan search when --hardware is not given
DEFAULT_SEARCH_HARDWARE = "mi300x"
#: the open-loop range ``--search bisect --sla-variable request_rate`` spans when
#: --request-rate is not given, requests/s (vLLM's serve_sla spans 1..65536; a deployment of
#: this tool's size serves far less, and the bottom must reach a strict TTFT's rate)
DEFAULT_RATE_RANGE = (0.125, 1024.0)
#: what --search bisect searches when --sla-variable is not given
VARIABLES_DEFAULT = "max_concurrency"


def add_search_args(parser: argparse.ArgumentParser) -> None:
    """A scenario (comma lists, hardware optional) plus the SLO, the search space (a comma list
    on each searched flag: tune searches several hardware profiles, plan compares them) and how
    the search runs (``add_executor_args``)."""
    add_scenario_args(parser, lists=True, hardware_required=False, hardware_lists=True,
                      search=True)
    g = parser.add_argument_group("SLO and search space")
    add_flag(g, "--slo", required=True,
             help='bounds on metric keys, e.g. "median_itl_ms<=100,p90_ttft_ms<=5000"')
    add_flag(g, "--objective", default=OBJECTIVES[0],
             help=f"what to maximise (default {OBJECTIVES[0]}; goodput: vLLM's requests/s "
             "meeting every --goodput per-request SLO)")
    add_flag(g, "--splits", lists=True, default=None,
             help="dp x tp splits to try, e.g. 8x1,4x2,1x8 (default: the plan's own)")
    parser.set_defaults(concurrency=None, measure="steady")  # a service level: steady state
    parser.epilog = ("Defaults of a search: --concurrency "
                     f"{','.join(map(str, DEFAULT_SEARCH_CONCURRENCY))}, --measure steady "
                     "(docs/serving.md).")
    add_executor_args(parser, search=True)


def add_executor_args(parser: argparse.ArgumentParser, *, search: bool) -> None:
    """Where the points run (sweep, tune, plan) and, for a search, how they are picked."""
    g = parser.add_argument_group("where the points run (docs/performance.md)")
    add_flag(g, "--workers", default=None, metavar="N",
             help="local worker processes (default: the cores this process may use; 1: serial)")
    add_flag(g, "--ray", default=None, metavar="auto|local|ADDRESS",
             help="run the points as Ray tasks: auto joins the running cluster, local starts "
             "one here, or a cluster address (pip install 'epsim[ray]')")
    add_force_arg(g)
    if search:
        add_flag(g, "--search", default="auto",
                 help=f"every point (grid), optuna's TPE sampler with the SLO as a constraint, "
                 "or each deployment's highest load within the SLO by bisection (bisect, "
                 f"--sla-variable) (default auto: grid up to {GRID_MAX_POINTS} points)")
        add_flag(g, "--trials", default=None, metavar="N",
                 help=f"optuna's trials (default {DEFAULT_TRIALS}, at most the space's size)")
        add_flag(g, "--sla-variable", default=VARIABLES_DEFAULT,
                 help="--search bisect: the load bisected per deployment between the lowest "
                 "and highest value of its list, max_concurrency (closed loop, --concurrency) "
                 "or request_rate (open loop, --request-rate LO,HI, default "
                 f"{DEFAULT_RATE_RANGE[0]:g},{DEFAULT_RATE_RANGE[1]:g}; no concurrency cap "
                 f"unless --concurrency is given) (default {VARIABLES_DEFAULT})")


def executor_from_args(args: argparse.Namespace) -> Executor:
    """The executor ``--workers`` / ``--ray`` ask for (a context manager owning its workers)."""
    return make_executor(args.workers, args.ray)


def search_options_from_args(args: argparse.Namespace, executor: Executor) -> SearchOptions:
    return SearchOptions(strategy=args.search, trials=args.trials, executor=executor,
                         variable=args.sla_variable)


def _rate_bisect(args: argparse.Namespace) -> bool:
    return args.search == "bisect" and args.sla_variable == "request_rate"


def _rates(args: argparse.Namespace) -> tuple[float | None, ...]:
    """The request-rate dimension: a searched list, or the range an open-loop bisection spans."""
    given = tuple(args.request_rate or ())
    if not _rate_bisect(args):
        return _searched(given or None)
    if given in ((), (math.inf,)):  # the flag's default: the open loop not bounded
        return DEFAULT_RATE_RANGE
    if len(given) < 2 or not all(math.isfinite(r) for r in given):
        raise EpsimError("--sla-variable request_rate bisects between the lowest and highest "
                         "of --request-rate: give two finite rates, e.g. 0.5,64")
    return given


def search_diagnostics(executor: Executor, strategy: str, wall_s: float) -> dict[str, Any]:
    """What ran a search and how long it took: the JSON's ``"diagnostics"`` (not results)."""
    return {**executor.describe(), "search": strategy, "wall_s": wall_s}


def _searched(values: tuple[Any, ...] | None) -> tuple[Any, ...]:
    """A comma list as a search dimension: two or more values; one is the base's own."""
    return tuple(values) if values is not None and len(values) > 1 else (None,)


def search_space_from_args(args: argparse.Namespace, *, units: bool = False) -> SearchSpace:
    """The space the flags describe (``units``: plan's, whose hardware and nodes are the units
    it compares, not point dimensions)."""
    if units and args.nodes is not None and len(args.nodes) > 1:
        raise EpsimError("plan: --nodes is the co-located unit's size and takes one value")
    return SearchSpace(
        hardware=(None,) if units else _searched(args.hardware),
        nodes=(None,) if units else _searched(args.nodes),
        mtp=_searched(args.mtp), max_num_seqs=_searched(args.max_num_seqs),
        chunked_prefill_size=_searched(args.chunked_prefill_size),
        concurrency=tuple(args.concurrency or ((None,) if _rate_bisect(args)
                                               else DEFAULT_SEARCH_CONCURRENCY)),
        request_rate=_rates(args),
        # the lists say what to try (--no-dbo / --no-graph: off alone)
        dbo=tuple(args.dbo), graph=tuple(args.graph),
        splits=tuple(args.splits) if args.splits else (None,),
        kv_dtype=tuple(args.kv_dtype),
    )


def search_base_from_args(args: argparse.Namespace, hardware: str) -> Scenario:
    """The scenario the search varies (first value of each list stands in until varied)."""
    def one(flag: str, values: tuple[Any, ...] | None) -> Any:
        if values is not None and len(values) > 1:
            raise EpsimError(f"{flag} takes one value here")
        return values[0] if values else None

    def first(values: tuple[Any, ...] | None) -> Any:  # a searched list: each point sets it
        return values[0] if values else None

    return scenario_from_args(
        args, hardware=hardware, concurrency=1, disagg=None, nodes=first(args.nodes),
        mtp=first(args.mtp) or 0, max_num_seqs=first(args.max_num_seqs),
        chunked_prefill_size=first(args.chunked_prefill_size),
        isl=one("--isl", args.isl), osl=one("--osl", args.osl),
        request_rate=first(args.request_rate),
        kv_dtype=ExecutionSpec.kv_dtype)  # each point sets its own
