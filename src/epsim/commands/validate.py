"""``epsim validate``: the simulator against measurements, in one of two ways (subcommands):

    epsim validate grid --profile PROFILE   run the runtime over a grid, simulate the same,
                                            compare step times (``epsim.calibrate.validate``)
    epsim validate bench FILE --model M --hardware H
                                            a measured ``vllm bench serve`` / SGLang
                                            ``bench_serving`` result, replayed under the
                                            deployment the flags give
                                            (``epsim.sim.workload.bench_results`` reads it,
                                            ``epsim.sim.replay`` replays and compares)

The spellings from before the subcommands keep their meaning: ``epsim validate --profile P``
is ``grid``, ``epsim validate --bench FILE`` is ``bench`` (``epsim.modes``). This module
parses, calls and prints.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

from epsim.calibrate.validate import DEFAULT_GRID, shipped_grids
from epsim.model.errors import EpsimError
from epsim.sim.workload.spec import WorkloadSpec

from ..common import emit_json
from ..inputs import add_flag, spec_for
from ..modes import add_modes, legacy_flags
from ..options import (
    add_bench_client_arg,
    add_config_arg,
    add_engine_args,
    add_execution_args,
    add_field,
    add_goodput_arg,
    add_hardware_arg,
    add_json_arg,
    add_model_arg,
    add_plan_args,
    field_option,
    scenario_from_args,
)

_GRID = ("Run every configuration of a grid on local runtime ranks, simulate the same "
         "configurations with the profile (sim.step.simulate.simulate_step), and report measured "
         "against predicted step times and per-op-kind times.")
_BENCH = ("Replay a vllm bench serve --save-result JSON or an SGLang bench_serving result line "
          "(its requests, concurrency or rate) under the deployment the flags give, and report "
          "every metric it measured against the prediction.")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "validate", help="check the simulator against the runtime under a (fitted) profile "
        "(grid), or against a measured vllm/sglang benchmark result (bench)",
        description="grid: " + _GRID + " bench: " + _BENCH,
    )
    with legacy_flags(p, "epsim validate --profile P (grid), --bench FILE (bench)"):
        _add_grid_args(p, required=False)
        _add_bench_args(p, positional=False)
        add_json_arg(p)
    p.set_defaults(run=run)
    add_modes(p, {
        "grid": ("the runtime over a grid against the simulator under a profile",
                 _add_grid_args, run_grid, _GRID),
        "bench": ("a measured vllm/sglang benchmark result against its replay",
                  _add_bench_args, run_bench, _BENCH),
    })


def _add_grid_args(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    add_flag(p, "--profile", metavar="PROFILE", required=required,
             **({} if required else {"default": None}),
             help="a profile JSON (epsim calibrate micro --out) or a shipped hardware name")
    add_flag(p, "--grid", metavar="NAME|FILE", default=DEFAULT_GRID,
             help="the configurations: a shipped grid (" + ", ".join(shipped_grids())
             + f") or a JSON list of them (default: the shipped {DEFAULT_GRID!r})")
    add_flag(p, "--steps", command="validate", default=6)
    add_flag(p, "--repeats", default=3,
             help="passes over the grid, alternating world sizes; a case is the median of its "
             "passes' medians (default 3)")
    add_flag(p, "--device", default="cpu")
    p.add_argument("--no-probe-scaling", action="store_true",
                   help="report the machine probe but do not scale the predictions by it "
                   "(docs/validation.md, 'How a case is judged')")
    add_flag(p, "--plot", metavar="OUT.png", default=None)


def _add_bench_args(p: argparse.ArgumentParser, *, positional: bool = True) -> None:
    g = p.add_argument_group("measured benchmark and the deployment that ran it")
    what = ("a vllm bench serve --save-result JSON (--save-detailed: its request lengths "
            "are replayed) or an SGLang bench_serving --output-file line (the last one)")
    if positional:
        add_flag(g, "bench", spec=spec_for("--bench"), metavar="FILE", help=what)
    else:
        add_flag(g, "--bench", metavar="FILE", default=None, help=what)
    add_model_arg(g, required=False)
    add_hardware_arg(g, required=False)
    add_bench_client_arg(g, default=None)
    add_field(g, *field_option(WorkloadSpec, "seed"), default=None)
    add_goodput_arg(g)
    add_plan_args(p)
    p.set_defaults(nodes=None)
    add_execution_args(p)
    add_engine_args(p)
    add_config_arg(p)


def run(args: argparse.Namespace) -> int:
    """The legacy form: the mode its flags name."""
    if args.bench and args.profile:
        raise EpsimError("--bench and --profile are two modes of validate: give one")
    if args.bench:
        if args.no_probe_scaling:
            raise EpsimError("--no-probe-scaling is about the runtime grid's machine probe: "
                             "a --bench replay runs no probe")
        return run_bench(args)
    if not args.profile:
        raise EpsimError("validate needs --profile PROFILE (the runtime over a grid) or "
                         "--bench FILE (a measured benchmark result): epsim validate grid "
                         "--profile PROFILE, or epsim validate bench FILE")
    if args.model or args.hardware:
        raise EpsimError("--model and --hardware describe a --bench replay; the runtime mode "
                         "takes its models from --grid")
    return run_grid(args)


def run_grid(args: argparse.Namespace) -> int:
    """``epsim validate grid``: the runtime over a grid against the simulator."""
    from epsim.calibrate.validate import validate

    t0 = time.perf_counter()
    log = None if args.json else (lambda msg: print(f"  ... {msg}", file=sys.stderr))
    report = validate(args.profile, args.grid, steps=args.steps,
                      repeats=args.repeats, device=args.device, plot=args.plot, log=log,
                      probe_scaling=not args.no_probe_scaling)
    report["wall_s"] = time.perf_counter() - t0
    if args.json:
        from epsim.sim.hardware.profile import load_profile

        emit_json(report, load_profile(args.profile).provenance())
        return 0
    print(f"epsim validate: {report['profile']} on {len(report['cases'])} configurations")
    print(f"  {'configuration':<40} {'measured ms':>11} {'passes':>8} {'predicted ms':>12} "
          f"{'error':>8}")
    for c in report["cases"]:
        print(f"  {c['label']:<40} {c['measured_ms']:>11.2f} {c['pass_spread_pct']:>7.1f}% "
              f"{c['predicted_ms']:>12.2f} {c['error_pct']:>+7.1f}%")
    load = {k: "unknown" if v is None else f"{v:.2f}" for k, v in report["load_average"].items()}
    print(f"  |error| median {report['median_abs_error_pct']:.1f}%, p90 "
          f"{report['p90_abs_error_pct']:.1f}%, max {report['max_abs_error_pct']:.1f}%; "
          f"each case: the median of its {report['repeats']} passes (spread: max - min over "
          f"the median); load average {load['before']} -> {load['after']}; "
          f"wall {report['wall_s']:.1f} s")
    if args.plot:
        print(f"  plot: {args.plot}")
    return 0


def run_bench(args: argparse.Namespace) -> int:
    """``epsim validate bench``: a measured benchmark result against its replay."""
    from epsim.sim.deployment import deployment_profile
    from epsim.sim.replay import replay
    from epsim.sim.serving.metrics import goodput_slos
    from epsim.sim.workload.bench_results import read_bench_file

    if args.model is None or args.hardware is None:
        raise EpsimError("--bench needs --model and --hardware: the deployment that ran it")
    bench = read_bench_file(args.bench, args.bench_client)
    if args.seed is None:
        seed = bench.epsim.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise EpsimError(f"{args.bench}: epsim.seed must be a non-negative integer, got "
                             f"{seed!r}")
        args.seed = seed
    # the scenario's workload is a placeholder: replay() puts the file's in its place
    sc = scenario_from_args(
        args, dataset="fixed", isl=1, osl=1, concurrency=None, num_prompts=1,
        random_range_ratio=0.0, request_rate=math.inf, burstiness=1.0, dataset_path=None,
        percentiles=(50.0,), percentile_metrics=("ttft",), bench_client=bench.client)
    report = replay(bench, sc, goodput=goodput_slos(args.goodput))
    if args.json:
        emit_json(report, deployment_profile(sc.deployment).provenance())
    else:
        print_bench_report(report)
    return 0


def _cell(v: Any) -> str:
    return "-" if v is None else f"{v:,.2f}"


def print_bench_report(r: dict[str, Any]) -> None:
    w, d = r["workload"], r["deployment"]
    print(f"epsim validate --bench {r['bench']} ({r['format']} format)")
    print(f"  workload: {w['num_prompts']} requests, {w['mean_input_len']:.1f} in / "
          f"{w['mean_output_len']:.1f} out on average (lengths {w['lengths']}), max "
          f"concurrency {w['max_concurrency']}, request rate {w['request_rate']} (arrivals "
          f"{w['arrivals']})")
    print(f"  deployment: {d.get('model')} on {d.get('gpus')} x {d.get('hardware')}, dp "
          f"{d.get('dp')} tp {d.get('tp')} ep {d.get('ep')}, "
          + (f"engine {d['engine']}" if d.get("engine") else "epsim's own scheduler"))
    for note in r["notes"]:
        print(f"  note: {note}")
    print(f"  {'metric':<32} {'measured':>12} {'predicted':>12} {'error':>9}")
    for name, m in r["metrics"].items():
        err = "-" if m["error_pct"] is None else f"{m['error_pct']:+.1f}%"
        print(f"  {name:<32} {_cell(m['measured']):>12} {_cell(m['predicted']):>12} {err:>9}")
    for name, why in r["skipped"].items():
        print(f"  {name:<32} skipped: {why}")
    for name, why in r["ignored"].items():
        print(f"  {name:<32} ignored: {why}")
    if r["median_abs_error_pct"] is not None:
        print(f"  |error| median {r['median_abs_error_pct']:.1f}%, max "
              f"{r['max_abs_error_pct']:.1f}%; simulated in {r['sim_wall_s']:.1f} s")
