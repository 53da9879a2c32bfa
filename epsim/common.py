"""Argument groups and output helpers the commands share.

Every flag a group defines takes its choices and defaults from the package that owns them (KV
dtypes from ``epsim.model.plan``, datasets from ``epsim.sim.workload``, dp balancing from
``epsim.sim.serving``, the rest from :class:`~epsim.sim.scenario.Scenario`'s and
:class:`~epsim.sim.workload.WorkloadSpec`'s own defaults), so a help text cannot drift from
what runs.

    model / hardware / plan    what is deployed: ``add_model_arg``, ``add_hardware_arg``,
                               ``add_plan_args``
    workload                   the benchmark (``vllm bench serve`` flags): ``add_workload_args``
    execution                  how it is served (DBO, EPLB, KV dtype, disaggregation, ...):
                               ``add_execution_args``
    scenario                   all of the above plus ``--json``: ``add_scenario_args``, read back
                               by ``scenario_from_args`` (predict, sweep)
    search                     a scenario plus the SLO and search space: ``add_search_args``,
                               read back by ``search_space_from_args`` and
                               ``search_base_from_args`` (tune, plan)
    lists                      sweep, tune and plan take comma lists where a value is swept;
                               they stay strings until the command splits them
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from epsim.model.errors import EpsimError
from epsim.model.loads import shipped_loads
from epsim.model.plan import KV_DTYPES
from epsim.sim.metrics import (
    DEFAULT_PERCENTILE_METRICS,
    DEFAULT_PERCENTILES,
    parse_percentile_metrics,
    parse_percentiles,
    percentile_word,
)
from epsim.sim.scenario import Scenario, parse_disagg
from epsim.sim.serving import DP_BALANCE
from epsim.sim.tune import OBJECTIVES, SearchSpace
from epsim.sim.workload import DATASETS, WorkloadSpec


def loads_help(what: str) -> str:
    """Help text of a ``--loads``-like flag: a file or one of the shipped names."""
    return (f"{what}: a shipped name ({', '.join(shipped_loads())}) or a file "
            '{"logical_count": [layers][experts]} (.json, or .pt with torch)')


def _int_at_least(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "positive")


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, "non-negative")


def request_rate(text: str) -> float:
    """Requests per second: a positive number, or ``inf`` (all at once, as vllm bench serve)."""
    if text.strip().lower() == "inf":
        return math.inf
    return positive_float(text)


def kv_dtype(text: str) -> str:
    if text not in KV_DTYPES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(KV_DTYPES)}, got {text!r}")
    return text


def comma_list(text: str | None, convert: Callable[[str], Any], name: str) -> list[Any]:
    """``"1024,2048"`` -> ``[1024, 2048]`` through ``convert``; ``None`` -> ``[None]``. A value
    ``convert`` rejects (ValueError or ArgumentTypeError) is an :class:`EpsimError` naming it."""
    if text is None:
        return [None]
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            out.append(convert(part))
        except (ValueError, argparse.ArgumentTypeError):
            raise EpsimError(f"--{name}: {part!r} is not a valid value") from None
    if not out:
        raise EpsimError(f"--{name} is empty")
    return out


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="M",
                        help="shipped model name (e.g. deepseek-r1) or path to a config.json")


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallel plan")
    g.add_argument("--nodes", type=positive_int, default=1, help="nodes (default 1)")
    g.add_argument("--gpus-per-node", type=positive_int, default=None,
                   help="GPUs per node (default: the hardware profile's, else 8)")
    g.add_argument("--dp", type=positive_int, default=None, help="data-parallel attention groups")
    g.add_argument("--tp", type=positive_int, default=None, help="tensor-parallel degree")
    g.add_argument("--ep", type=positive_int, default=None,
                   help="expert-parallel degree: 1 or the world size (default: world if dp > 1)")


def add_hardware_arg(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    parser.add_argument("--hardware", required=required, metavar="H",
                        help="hardware profile name or path (e.g. mi300x)")


def add_json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")


# --------------------------------------------------------------------------------------------
# A scenario: deployment + benchmark (predict, sweep; tune and plan through add_search_args)
# --------------------------------------------------------------------------------------------


def _sweepable(lists: bool, convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """A flag's type: ``convert``, or the raw string when the command takes a comma list."""
    return str if lists else convert


def add_workload_args(parser: argparse.ArgumentParser, *, lists: bool = False) -> None:
    """The benchmark, with ``vllm bench serve``'s flag names and meanings."""
    many = " (comma list)" if lists else ""
    w = WorkloadSpec  # its field defaults are the flags' defaults
    g = parser.add_argument_group("benchmark (vllm bench serve semantics)")
    g.add_argument("--concurrency", "--max-concurrency", dest="concurrency",
                   type=_sweepable(lists, positive_int), default=None, metavar="C",
                   help="closed loop: requests in flight at most" + many)
    g.add_argument("--request-rate", type=_sweepable(lists, request_rate),
                   default="inf" if lists else w.request_rate, metavar="R",
                   help="open loop: requests/s, Poisson arrivals, or inf (default)" + many)
    g.add_argument("--burstiness", type=positive_float, default=w.burstiness,
                   help="gamma shape of inter-arrival gaps (1: Poisson)")
    g.add_argument("--num-prompts", type=non_negative_int, default=None, metavar="N",
                   help=f"requests in the benchmark (default: the concurrency, else "
                   f"{w.num_prompts})")
    g.add_argument("--dataset", "--dataset-name", dest="dataset", choices=DATASETS,
                   default=None, help="request lengths (default: fixed with --isl, else "
                   "sharegpt-like)")
    g.add_argument("--isl", "--random-input-len", dest="isl", type=_sweepable(lists, positive_int),
                   default=None, metavar="I", help="input tokens" + many)
    g.add_argument("--osl", "--random-output-len", dest="osl",
                   type=_sweepable(lists, positive_int), default=None, metavar="O",
                   help="output tokens (exact, as under --ignore-eos)" + many)
    g.add_argument("--random-range-ratio", type=float, default=w.random_range_ratio,
                   metavar="r", help="random dataset: lengths uniform in [L(1-r), L(1+r)] "
                   f"(default {w.random_range_ratio:g})")
    g.add_argument("--dataset-path", default=None, metavar="FILE",
                   help="a local ShareGPT JSON for --dataset sharegpt-like")
    g.add_argument("--seed", type=int, default=w.seed,
                   help=f"seeds requests and routing (default {w.seed})")
    percentiles = ",".join(percentile_word(p) for p in DEFAULT_PERCENTILES)
    g.add_argument("--metric-percentiles", default=percentiles,
                   help=f"percentiles reported (default {percentiles})")
    metrics = ",".join(DEFAULT_PERCENTILE_METRICS)
    g.add_argument("--percentile-metrics", default=metrics,
                   help=f"metrics with percentiles (default {metrics})")


def add_execution_args(parser: argparse.ArgumentParser, *, lists: bool = False) -> None:
    """How the deployment serves: overlap, placement, graphs, KV, disaggregation, scheduling."""
    many = " (comma list)" if lists else ""
    sc = Scenario  # its field defaults are the flags' defaults
    o = parser.add_argument_group("execution options")
    o.add_argument("--no-dbo", action="store_true", help="one microbatch (no dual-batch overlap)")
    o.add_argument("--no-eplb", action="store_true", help="contiguous expert placement")
    o.add_argument("--no-graph", action="store_true", help="eager launches (no graph replay)")
    o.add_argument("--kv-dtype", default=sc.kv_dtype, type=str if lists else None,
                   choices=None if lists else KV_DTYPES,
                   help=f"KV-cache dtype (default {sc.kv_dtype})" + many)
    o.add_argument("--loads", default=None, metavar="NAME|FILE",
                   help=loads_help("expert load statistics for routing (default: synthetic)"))
    o.add_argument("--disagg", default=None, metavar="P:D",
                   help="prefill on P nodes, decode on D nodes (KV shipped over the NIC)")
    o.add_argument("--chunked-prefill-size", type=positive_int, default=sc.chunked_prefill_size,
                   help=f"prompt tokens one rank prefills per step (default "
                   f"{sc.chunked_prefill_size})")
    o.add_argument("--dp-balance", choices=DP_BALANCE, default=sc.dp_balance,
                   help=f"how requests are spread over dp ranks (default {sc.dp_balance})")
    o.add_argument("--mem-fraction", type=float, default=sc.mem_fraction,
                   help=f"share of HBM for weights + activations + KV (default "
                   f"{sc.mem_fraction})")


def add_scenario_args(parser: argparse.ArgumentParser, *, lists: bool = False,
                      hardware_required: bool = True) -> None:
    """Everything a :class:`Scenario` is built from, plus ``--json`` (``lists``: comma lists
    where sweepable)."""
    add_model_arg(parser)
    add_hardware_arg(parser, required=hardware_required)
    add_plan_args(parser)
    parser.set_defaults(nodes=None)  # None: 1, or P + D under --disagg
    add_workload_args(parser, lists=lists)
    add_execution_args(parser, lists=lists)
    add_json_arg(parser)


def scenario_from_args(args: argparse.Namespace, **override: Any) -> Scenario:
    """A :class:`Scenario` from parsed arguments (``override`` replaces single values)."""
    v = {**vars(args), **override}
    isl, osl = v["isl"], v["osl"]
    dataset = v["dataset"] or ("fixed" if isl is not None else "sharegpt-like")
    if dataset == "fixed" and isl is not None and osl is None:
        raise EpsimError("--isl needs --osl")
    conc = v["concurrency"]
    n = v["num_prompts"]
    if n is None:
        n = conc if conc is not None else WorkloadSpec.num_prompts
    if n == 0:
        raise EpsimError("num-prompts must be a positive integer, got 0")
    workload = WorkloadSpec(
        dataset=dataset, num_prompts=n, isl=isl, osl=osl,
        random_range_ratio=v["random_range_ratio"], max_concurrency=conc,
        request_rate=v["request_rate"], burstiness=v["burstiness"],
        dataset_path=v["dataset_path"], seed=v["seed"]).validate()
    return Scenario(
        model=v["model"], hardware=v["hardware"], workload=workload, nodes=v["nodes"],
        gpus_per_node=v["gpus_per_node"], dp=v["dp"], tp=v["tp"], ep=v["ep"],
        dbo=not v["no_dbo"], eplb=not v["no_eplb"], graph=not v["no_graph"],
        kv_dtype=v["kv_dtype"], loads=v["loads"],
        disagg=parse_disagg(v["disagg"]) if v["disagg"] else None,
        chunked_prefill_size=v["chunked_prefill_size"], dp_balance=v["dp_balance"],
        mem_fraction=v["mem_fraction"],
        percentiles=parse_percentiles(v["metric_percentiles"]),
        percentile_metrics=parse_percentile_metrics(v["percentile_metrics"]),
    )


# --------------------------------------------------------------------------------------------
# A search: scenario + SLO + search space (tune, plan)
# --------------------------------------------------------------------------------------------

#: the concurrencies tune and plan try when --concurrency is not given
DEFAULT_SEARCH_CONCURRENCY = "256,512,1024,2048,3072,4096"
#: the hardware tune and plan search when --hardware is not given
DEFAULT_SEARCH_HARDWARE = "mi300x"


def _onoff(text: str) -> bool:
    if text in ("on", "true", "1"):
        return True
    if text in ("off", "false", "0"):
        return False
    raise ValueError(text)


def _dp_x_tp(text: str) -> tuple[int, int]:
    """``"4x2"``, ``"dp4xtp2"`` or ``"4/2"`` -> ``(4, 2)``."""
    m = re.fullmatch(r"(?:dp)?(\d+)\s*[x/]\s*(?:tp)?(\d+)", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(text)
    return int(m.group(1)), int(m.group(2))


def add_search_args(parser: argparse.ArgumentParser) -> None:
    """A scenario (comma lists, hardware optional) plus the SLO and the search space."""
    add_scenario_args(parser, lists=True, hardware_required=False)
    g = parser.add_argument_group("SLO and search space")
    g.add_argument("--slo", required=True,
                   help='bounds on metric keys, e.g. "median_itl_ms<=100,p90_ttft_ms<=5000"')
    g.add_argument("--objective", choices=OBJECTIVES, default=OBJECTIVES[0],
                   help=f"what to maximise (default {OBJECTIVES[0]})")
    g.add_argument("--dbo", default="on,off", help="DBO values to try (default on,off)")
    g.add_argument("--graph", default="on", help="graph-mode values to try (default on)")
    g.add_argument("--splits", default=None,
                   help="dp x tp splits to try, e.g. 8x1,4x2,1x8 (default: the plan's own)")
    parser.set_defaults(concurrency=None)


def search_space_from_args(args: argparse.Namespace) -> SearchSpace:
    conc = args.concurrency or DEFAULT_SEARCH_CONCURRENCY
    return SearchSpace(
        concurrency=tuple(comma_list(conc, positive_int, "concurrency")),
        # --no-dbo / --no-graph pin the knob off; otherwise the lists say what to try
        dbo=(False,) if args.no_dbo else tuple(dict.fromkeys(
            comma_list(args.dbo, _onoff, "dbo"))),
        graph=(False,) if args.no_graph else tuple(dict.fromkeys(
            comma_list(args.graph, _onoff, "graph"))),
        splits=tuple(comma_list(args.splits, _dp_x_tp, "splits")) if args.splits else (None,),
        kv_dtype=tuple(dict.fromkeys(comma_list(args.kv_dtype, kv_dtype, "kv-dtype"))),
    )


def search_base_from_args(args: argparse.Namespace, hardware: str) -> Scenario:
    """The scenario the search varies (first value of each list stands in until varied)."""
    def one(value: Any, convert: Callable[[str], Any], name: str) -> Any:
        values = comma_list(value, convert, name)
        if len(values) > 1:
            raise EpsimError(f"--{name} takes one value here")
        return values[0]

    return scenario_from_args(
        args, hardware=hardware, concurrency=1,
        isl=one(args.isl, positive_int, "isl"), osl=one(args.osl, positive_int, "osl"),
        request_rate=one(str(args.request_rate), request_rate, "request-rate"),
        kv_dtype=Scenario.kv_dtype)  # each point sets its own


def emit_json(obj: Mapping[str, Any]) -> None:
    """One JSON object on stdout and nothing else there."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


class Progress:
    """A one-line progress bar on stderr; silent under --json or when stderr is not a terminal."""

    def __init__(self, label: str, enabled: bool, width: int = 30) -> None:
        self.label, self.width = label, width
        self.enabled = enabled and sys.stderr.isatty() and os.environ.get("TERM") != "dumb"
        self._shown = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        fill = round(self.width * done / total)
        sys.stderr.write(f"\r{self.label} [{'#' * fill}{'.' * (self.width - fill)}] "
                         f"{done}/{total}")
        sys.stderr.flush()
        self._shown = True

    def close(self) -> None:
        if self._shown:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self._shown = False


def _column_cell(v: Any, digits: int) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def print_columns(rows: Sequence[Mapping[str, Any]], cols: Sequence[str], *, digits: int = 1,
                  indent: str = "  ") -> None:
    """One right-aligned column per key of ``cols``, one line per row (sweep's, tune's and
    plan's tables); floats with ``digits`` decimals."""
    cells = [[_column_cell(r.get(c), digits) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print(indent + "  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for row in cells:
        print(indent + "  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def print_table(rows: Sequence[tuple[str, str]], title: str | None = None) -> None:
    """Two aligned columns."""
    if title:
        print(title)
    width = max((len(k) for k, _ in rows), default=0)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    raise AssertionError


def human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"
