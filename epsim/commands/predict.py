"""``epsim predict``: one deployment under one ``vllm bench serve``-style benchmark.

Also holds what ``sweep``, ``tune`` and ``plan`` share: the serving arguments, turning them into a
:class:`epsim.sim.scenario.Scenario`, and the stderr progress bar.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Mapping
from typing import Any

from epsim.model.errors import EpsimError
from epsim.model.trace import TraceEvent, write_chrome_trace
from epsim.sim.metrics import METRICS, parse_percentile_metrics, parse_percentiles, percentile_word
from epsim.sim.scenario import Scenario, parse_disagg, run_scenario
from epsim.sim.serving import DP_BALANCE
from epsim.sim.workload import DATASETS, WorkloadSpec

from ..common import (
    add_model_arg,
    add_plan_args,
    emit_json,
    loads_help,
    non_negative_int,
    positive_float,
    positive_int,
    request_rate,
)

# --------------------------------------------------------------------------------------------
# Shared arguments
# --------------------------------------------------------------------------------------------


def add_serving_args(p: argparse.ArgumentParser, *, lists: bool = False,
                     hardware_required: bool = True) -> None:
    """The arguments of a deployment plus a benchmark (``lists``: comma lists where sweepable)."""
    many = " (comma list)" if lists else ""
    add_model_arg(p)
    p.add_argument("--hardware", required=hardware_required, metavar="H",
                   help="hardware profile name or path (e.g. mi300x)")
    add_plan_args(p)
    p.set_defaults(nodes=None)  # None: 1, or P + D under --disagg
    g = p.add_argument_group("benchmark (vllm bench serve semantics)")
    g.add_argument("--concurrency", "--max-concurrency", dest="concurrency",
                   type=str if lists else positive_int, default=None, metavar="C",
                   help="closed loop: requests in flight at most" + many)
    g.add_argument("--request-rate", type=str if lists else request_rate, default="inf" if lists
                   else math.inf, metavar="R",
                   help="open loop: requests/s, Poisson arrivals, or inf (default)" + many)
    g.add_argument("--burstiness", type=positive_float, default=1.0,
                   help="gamma shape of inter-arrival gaps (1: Poisson)")
    g.add_argument("--num-prompts", type=non_negative_int, default=None, metavar="N",
                   help="requests in the benchmark (default: the concurrency, else 1000)")
    g.add_argument("--dataset", "--dataset-name", dest="dataset", choices=DATASETS,
                   default=None, help="request lengths (default: fixed with --isl, else "
                   "sharegpt-like)")
    g.add_argument("--isl", "--random-input-len", dest="isl", type=str if lists else positive_int,
                   default=None, metavar="I", help="input tokens" + many)
    g.add_argument("--osl", "--random-output-len", dest="osl",
                   type=str if lists else positive_int, default=None, metavar="O",
                   help="output tokens (exact, as under --ignore-eos)" + many)
    g.add_argument("--random-range-ratio", type=float, default=0.0, metavar="r",
                   help="random dataset: lengths uniform in [L(1-r), L(1+r)] (default 0)")
    g.add_argument("--dataset-path", default=None, metavar="FILE",
                   help="a local ShareGPT JSON for --dataset sharegpt-like")
    g.add_argument("--seed", type=int, default=0, help="seeds requests and routing (default 0)")
    g.add_argument("--metric-percentiles", default=",".join(
        percentile_word(p) for p in (10, 25, 50, 75, 90, 99)),
        help="percentiles reported (default 10,25,50,75,90,99)")
    g.add_argument("--percentile-metrics", default=",".join(METRICS),
                   help=f"metrics with percentiles (default {','.join(METRICS)})")
    o = p.add_argument_group("execution options")
    o.add_argument("--no-dbo", action="store_true", help="one microbatch (no dual-batch overlap)")
    o.add_argument("--no-eplb", action="store_true", help="contiguous expert placement")
    o.add_argument("--no-graph", action="store_true", help="eager launches (no graph replay)")
    o.add_argument("--kv-dtype", default="fp8", type=str if lists else None,
                   choices=None if lists else ("fp8", "bf16"),
                   help="KV-cache dtype (default fp8)" + many)
    o.add_argument("--loads", default=None, metavar="NAME|FILE",
                   help=loads_help("expert load statistics for routing (default: synthetic)"))
    o.add_argument("--disagg", default=None, metavar="P:D",
                   help="prefill on P nodes, decode on D nodes (KV shipped over the NIC)")
    o.add_argument("--chunked-prefill-size", type=positive_int, default=8192,
                   help="prompt tokens one rank prefills per step (default 8192)")
    o.add_argument("--dp-balance", choices=DP_BALANCE, default="round_robin",
                   help="how requests are spread over dp ranks (default round_robin)")
    o.add_argument("--mem-fraction", type=float, default=0.9,
                   help="share of HBM for weights + activations + KV (default 0.9)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


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
        n = conc if conc is not None else 1000
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
# Progress bar
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}"
    if isinstance(value, Mapping):
        return ", ".join(f"{k} {v:.2f}" for k, v in value.items()) or "-"
    return str(value)


def print_result(r: Mapping[str, Any]) -> None:
    """The result the way ``vllm bench serve`` prints it, then epsim's own lines."""
    line = "{:<40} {:<10}"
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result (simulated) ", n=60, c="="))
    dis = f", disagg {r['disagg']}" if r.get("disagg") else ""
    print(f"{r['model']} on {r['nodes']} x {r['gpus_per_node']} {r['hardware']}: dp {r['dp']}, "
          f"tp {r['tp']}, ep {r['ep']}, DBO {'on' if r['dbo'] else 'off'}, EPLB "
          f"{'on' if r['eplb'] else 'off'}, graph {'on' if r['graph'] else 'off'}, KV "
          f"{r['kv_dtype']}{dis}")
    rows = [("Successful requests:", r["completed"]),
            ("Maximum request concurrency:", r["max_concurrency"]),
            ("Request rate (req/s):", r["request_rate"]),
            ("Benchmark duration (s):", r["duration"]),
            ("Total input tokens:", r["total_input_tokens"]),
            ("Total generated tokens:", r["total_output_tokens"]),
            ("Request throughput (req/s):", r["request_throughput"]),
            ("Output token throughput (tok/s):", r["output_throughput"]),
            ("Total token throughput (tok/s):", r["total_token_throughput"])]
    for k, v in rows:
        print(line.format(k, _fmt(v)))
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token "
                        "(excl. 1st token)"), ("itl", "Inter-token Latency"),
                        ("e2el", "End-to-end Latency")):
        print("{s:{c}^{n}}".format(s=title, n=60, c="-"))
        up = name.upper()
        print(line.format(f"Mean {up} (ms):", _fmt(r[f"mean_{name}_ms"])))
        print(line.format(f"Median {up} (ms):", _fmt(r[f"median_{name}_ms"])))
        for k, v in r.items():
            if k.startswith("p") and k.endswith(f"_{name}_ms"):
                print(line.format(f"P{k[1:-len(name) - 4]} {up} (ms):", _fmt(v)))
    print("{s:{c}^{n}}".format(s=" epsim ", n=60, c="-"))
    for k in ("decode_throughput", "mean_decode_step_ms", "expert_imbalance", "kv_cache_usage",
              "max_kv_cache_usage", "max_running_per_rank", "num_steps", "step_sim_calls",
              "sim_wall_s"):
        print(line.format(f"{k}:", _fmt(r[k])))
    print(line.format("step_breakdown_ms:", _fmt(r["step_breakdown_ms"])))
    print("=" * 60)


def write_trace(run_steps: list[Mapping[str, Any]], path: str, meta: Mapping[str, Any]) -> None:
    events = [TraceEvent(op_id=f"step{n}.{s['kind']}", kind=s["kind"], rank=s["pid"],
                         stream="compute", start_us=s["start_s"] * 1e6, dur_us=s["seconds"] * 1e6,
                         args={k: s[k] for k in ("decode_tokens", "prefill_tokens", "max_seqs",
                                                 "context", "kv_usage")})
              for n, s in enumerate(run_steps)]
    write_chrome_trace(events, path, meta)


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "predict", help="simulate a vllm-bench-serve benchmark against a deployment",
        description="Simulate a benchmark (vllm bench serve semantics) against a deployment: "
        "continuous batching per dp rank, KV-cache admission, chunked or disaggregated prefill, "
        "step times from the step simulator. Prints vLLM's metrics plus decode-only throughput.")
    add_serving_args(p)
    p.add_argument("--trace", metavar="OUT", default=None,
                   help="write the serving timeline (one event per step) as Chrome trace JSON")
    p.set_defaults(run=run)


def predict(args: argparse.Namespace) -> dict[str, Any]:
    sc = scenario_from_args(args)
    steps: list[dict[str, Any]] = []
    result = run_scenario(sc, steps_out=steps if args.trace else None)
    if args.trace:
        write_trace(steps, args.trace, {"model": result["model"], "hardware": result["hardware"]})
    return result


def run(args: argparse.Namespace) -> int:
    result = predict(args)
    if args.json:
        emit_json(result)
    else:
        print_result(result)
    return 0

