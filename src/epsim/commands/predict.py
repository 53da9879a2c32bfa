"""``epsim predict``: one deployment under one ``vllm bench serve``-style benchmark."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from epsim.model import jsonout
from epsim.model.errors import EpsimError
from epsim.model.outputs import write_text_atomic
from epsim.sim.scenario import run_scenario
from epsim.sim.serving.bench_write import vllm_result
from epsim.sim.serving.presets import engine_preset
from epsim.sim.serving.simulate import ServingRun
from epsim.sim.serving.trace import write_serving_trace

from ..common import Progress, _jsonable, emit_json, print_columns
from ..fidelity import SERVING_HEADLINE, band_text, regime_of, stamp
from ..inputs import add_flag
from ..options import add_scenario_args, scenario_from_args
from ..provenance import stamp_provenance
from ..work import add_force_arg, estimate, point_requests
from ..work import check as check_work

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
    engine = r.get("engine")
    caption = engine_preset(engine).caption  # epsim's own policy has no caps to show
    print(f"scheduler {r.get('scheduler')}" + (f" (engine {engine}: max_num_seqs "
          f"{r['max_num_seqs']}, max_num_batched_tokens {r['max_num_batched_tokens']}, chunk "
          f"{r['chunked_prefill_size']}, graphs to batch {r['cuda_graph_max_bs']})"
          if caption is None else f" ({caption})"))
    rows = [("Successful requests:", r["completed"]),
            ("Maximum request concurrency:", r["max_concurrency"]),
            ("Request rate (req/s):", r["request_rate"]),
            *([("Trace arrival rate (req/s):", r["trace_arrival_rate"])]
              if "trace_arrival_rate" in r else []),
            ("Benchmark duration (s):", r["duration"]),
            ("Total input tokens:", r["total_input_tokens"]),
            ("Total generated tokens:", r["total_output_tokens"]),
            ("Request throughput (req/s):", r["request_throughput"]),
            ("Output token throughput (tok/s):", r["output_throughput"]),
            ("Total token throughput (tok/s):", r["total_token_throughput"])]
    if "window" in r:  # --measure steady: every figure above and below is the window's
        w = r["window"]
        rows.insert(1, ("Steady window (s):", f"{w['start_s']:,.2f} - {w['end_s']:,.2f}, "
                        f"{w['completions']} requests counted"))
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
              "max_kv_cache_usage", "max_running_per_rank", "preemptions", "num_steps",
              "step_sim_calls", "sim_wall_s"):
        print(line.format(f"{k}:", _fmt(r[k])))
    print(line.format("step_breakdown_ms:", _fmt(r["step_breakdown_ms"])))
    print(line.format("error band:", band_text(r["error_band"])))
    print("=" * 60)
    if r.get("instances"):
        print_instances(r)


def print_instances(r: Mapping[str, Any]) -> None:
    """One row per instance behind the router (``--instance-nodes``)."""
    print(f"{r['num_instances']} instances of {r['instance_nodes']} node(s), router "
          f"{r['router']}:")
    rows = [{"role": i["role"], "index": i["index"], "nodes": i["nodes"],
             "dp/tp/ep": "{dp}/{tp}/{ep}".format(**i["plan"]), "requests": i["requests"],
             "out tok/s": i["output_throughput"], "decode tok/s": i["decode_throughput"],
             "median TTFT ms": i["median_ttft_ms"],
             "median ITL ms": i.get("median_itl_ms", "-"), "steps": i["num_steps"]}
            for i in r["instances"]]
    print_columns(rows, list(rows[0]))


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "predict", help="simulate a vllm-bench-serve benchmark against a deployment",
        description="Simulate a benchmark (vllm bench serve semantics) against a deployment: "
        "continuous batching per dp rank, KV-cache admission, chunked or disaggregated prefill, "
        "step times from the step simulator. Prints vLLM's metrics plus decode-only throughput.")
    add_scenario_args(p)
    add_flag(p, "--trace", metavar="OUT", default=None)
    add_flag(p, "--save-result", metavar="OUT.json", default=None,
             help="write the result as vllm bench serve --save-result does (every key vLLM "
             "writes; epsim's own figures under \"epsim\"): epsim validate --bench reads it")
    p.add_argument("--save-detailed", action="store_true",
                   help="with --save-result: the per-request lists too (input_lens, "
                   "output_lens, ttfts, itls, start_times, ...), as vLLM's --save-detailed")
    add_force_arg(p)
    p.set_defaults(run=run)


def predict(args: argparse.Namespace) -> dict[str, Any]:
    if args.save_detailed and not args.save_result:
        raise EpsimError("--save-detailed needs --save-result FILE")
    sc = scenario_from_args(args)
    check_work("predict", estimate([(1, point_requests(sc))], 1), args.force)
    runs: list[ServingRun] = []
    keep = bool(args.trace or args.save_result)
    bar = Progress("requests", enabled=not args.json)
    try:
        result = run_scenario(sc, run_out=runs if keep else None,
                              details=bool(args.trace or args.save_detailed), progress=bar)
    finally:
        bar.close()
    stamp(result, regime_of(ep=result["ep"], disaggregated=bool(result["disagg"])),
          SERVING_HEADLINE)
    if args.trace:
        write_serving_trace(runs[0], args.trace,
                            {"model": result["model"], "hardware": result["hardware"]})
    if args.save_result:
        saved = vllm_result(runs[0], {**result, "burstiness": sc.workload.burstiness},
                            detailed=args.save_detailed, goodput=sc.measurement.goodput)
        stamp_provenance(saved["epsim"])  # epsim's keys: provenance first, as in --json
        write_text_atomic(jsonout.dumps(saved, default=_jsonable) + "\n", args.save_result)
    return result


def run(args: argparse.Namespace) -> int:
    result = predict(args)
    if args.json:
        emit_json(result)
    else:
        print_result(result)
    return 0

