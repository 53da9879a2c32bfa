"""``epsim calibrate bench FILES... --model M --hardware PROFILE --out PROFILE [deployment flags]``
(also spelled ``epsim calibrate --from-bench FILES...``): the flags and the run. The fit is
``epsim.calibrate.bench_fit`` (its docstring: the factors, the metrics fitted, the
identifiability rule); this module builds the deployment, reads the files, calls, writes the
profile and prints.

The deployment flags are ``epsim validate bench``'s (model, hardware, plan, kernel set, engine
and its overrides, MTP); ``--model``, ``--hardware``, ``--kernels``, ``--nodes``, ``--dp``,
``--ep``, ``--tp`` and ``--kv-dtype`` are the trace fit's too
(``calibrate_trace.add_deployment_args``).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from epsim.model import jsonout
from epsim.model.errors import EpsimError
from epsim.sim.serving.presets import charges_host
from epsim.sim.spec import ExecutionSpec, PlanSpec
from epsim.sim.workload.spec import WorkloadSpec

from .common import emit_json, print_table
from .inputs import add_flag, spec_for
from .options import (
    add_bench_client_arg,
    add_config_arg,
    add_engine_args,
    add_field,
    add_fields,
    field_option,
    scenario_from_args,
)
from .provenance import stamp_provenance

#: the factors fitted without --factors (host joins them under every engine but
#: prefill_first, which charges no host time)
DEFAULT_FACTORS = ("attention", "grouped_gemm")
#: what scenario_from_args reads that calibrate's parser does not define
_SCENARIO_DEFAULTS: dict[str, Any] = {
    "disagg": None, "chunked_prefill_size": None, "dp_balance": "round_robin",
    "mem_fraction": None, "goodput": None, "kv_dtype": None,
}


def add_bench_args(p: argparse.ArgumentParser, *, positional: bool = False) -> None:
    """The runs (``--from-bench FILE...``, or the positional ``FILE...`` of ``epsim calibrate
    bench``), the factors and the deployment's serving flags (its model, hardware and plan:
    ``calibrate_trace.add_deployment_args``)."""
    g = p.add_argument_group("from measured benchmark runs (--from-bench)")
    what = ("vllm bench serve --save-result JSONs / SGLang bench_serving lines of one "
            "deployment: fit --factors to them by least squares (each run replayed as "
            "validate bench does) and write the fitted profile to --out")
    if positional:
        add_flag(g, "from_bench", spec=spec_for("--from-bench"), nargs="+", metavar="FILE",
                 help=what)
    else:
        add_flag(g, "--from-bench", nargs="+", default=None, metavar="FILE", help=what)
    add_flag(g, "--factors", lists=True, default=None,
             help="the factors fitted (comma list; default attention,grouped_gemm, plus host "
             "unless --engine prefill_first): per op class multipliers on the final op time, host: the "
             "engine's host ms per step")
    g.add_argument("--no-loo", action="store_true",
                   help="skip the leave-one-out refits (one fit per run)")
    # the deployment's own flags (epsim/options.py); --bench-client reads the files without a
    # format marker as that client's
    add_fields(p, PlanSpec, only=("gpus_per_node", "redundant_experts"))
    add_fields(p, ExecutionSpec, only=("loads", "dbo", "eplb", "graph", "mtp", "mtp_acceptance"))
    add_bench_client_arg(g, default=None)
    add_field(g, *field_option(WorkloadSpec, "seed"))
    add_engine_args(p)
    add_config_arg(p)


def _scenario(args: argparse.Namespace):
    from epsim.sim.spec import ExecutionSpec

    missing = {k: v for k, v in _SCENARIO_DEFAULTS.items() if getattr(args, k, None) is None}
    missing["kv_dtype"] = args.kv_dtype or ExecutionSpec.kv_dtype
    missing["mem_fraction"] = ExecutionSpec.mem_fraction
    # the workload is a placeholder: replay() puts each file's in its place
    return scenario_from_args(
        args, **missing, dataset="fixed", isl=1, osl=1, concurrency=None, num_prompts=1,
        random_range_ratio=0.0, request_rate=math.inf, burstiness=1.0, dataset_path=None,
        percentiles=(50.0,), percentile_metrics=("ttft",), bench_client=None)


def run_bench_fit(args: argparse.Namespace) -> int:
    from epsim.calibrate import plausible
    from epsim.calibrate.bench_fit import fit_bench, fitted_profile
    from epsim.model.outputs import write_text_atomic
    from epsim.sim.deployment import deployment_profile, resolve_deployment
    from epsim.sim.hardware.profile import profile_from_bytes
    from epsim.sim.workload.bench_results import read_bench_file

    if args.model is None or args.hardware is None:
        raise EpsimError("--from-bench needs --model and --hardware: the deployment that ran "
                         "the benchmarks")
    if args.out is None:
        raise EpsimError("--from-bench needs --out PROFILE.json (the fitted profile)")
    runs = [read_bench_file(f, args.bench_client) for f in args.from_bench]
    sc = _scenario(args)
    names = tuple(args.factors) if args.factors else (
        DEFAULT_FACTORS + (("host",) if charges_host(sc.deployment.engine.engine) else ()))
    report = fit_bench(runs, sc, names, loo=not args.no_loo)
    plausible.warn(report["refused"], "calibrate --from-bench")
    d = sc.deployment
    p, x = d.plan, d.execution
    deployment = {"model": d.model, "hardware": d.hardware, "nodes": p.nodes,
                  "gpus_per_node": p.gpus_per_node, "dp": p.dp, "tp": p.tp, "ep": p.ep,
                  "kernels": x.kernels, "engine": d.engine.engine,
                  "dbo": resolve_deployment(d).dbo, "graph": x.graph, "eplb": x.eplb,
                  "kv_dtype": x.kv_dtype, "mtp": x.mtp,
                  "host_ms_per_step": d.engine.host_ms_per_step}
    obj = fitted_profile(report, str(args.hardware), args.from_bench, deployment)
    obj["provenance"] = deployment_profile(sc.deployment).provenance()  # the profile it was fitted from
    stamp_provenance(obj)
    text = jsonout.dumps(obj, indent=2) + "\n"
    write_text_atomic(text, args.out)
    out = {"profile": args.out, "factors": report["factors"], "start": report["start"],
           "runs": report["runs"], "leave_one_out": report["leave_one_out"],
           "iterations": report["iterations"], "evaluations": report["evaluations"],
           "refused": report["refused"],
           # every key of each file neither replayed nor compared, and why
           "ignored": {run.source: dict(run.ignored) for run in runs if run.ignored},
           "sources": {k: v for k, v in obj["sources"].items()
                       if k in ("efficiency.op_final_scale", "efficiency.host_ms_per_step")}}
    if args.json:
        # the profile just written (staged until the command ends: its text, not the file)
        emit_json(out, profile_from_bytes(text.encode(), args.out).provenance())
    else:
        _print(out)
    return 0


def _print(out: dict[str, Any]) -> None:
    rows = [("profile", out["profile"])]
    refused = {r["factor"]: r for r in out["refused"]}
    for name, value in out["factors"].items():
        unit = " ms" if name == "host" else "x"
        text = f"{value:.4g}{unit} (from {out['start'][name]:.4g})"
        if name in refused:
            r = refused[name]
            text = (f"{value:.4g}{unit} kept: fitted {r['fitted']:.4g}{unit} refused, outside "
                    f"[{r['range'][0]:g}, {r['range'][1]:g}]")
        rows.append((f"  {name}", text))
    for run in out["runs"]:
        rows.append((f"  {run['run']}", ", ".join(
            f"{m} {v['measured']:.4g} -> {v['predicted']:.4g} ({v['error_pct']:+.2f}%)"
            for m, v in run["metrics"].items())))
    for row in out["leave_one_out"]:
        text = ", ".join(f"{m} {v['error_pct']:+.2f}%" for m, v in row["metrics"].items()) \
            if row["determined"] else f"not determined by the others: {row['why']}"
        rows.append((f"  left out {row['run']}", text))
    rows.append(("fit", f"{out['iterations']} iterations, {out['evaluations']} replays"))
    for source, keys in out.get("ignored", {}).items():
        rows.append((f"  ignored in {source}", "; ".join(f"{k} ({why})"
                                                         for k, why in keys.items())))
    print_table(rows, title="epsim calibrate --from-bench")
