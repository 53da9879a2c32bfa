"""``epsim calibrate``: fit a hardware profile, in one of three ways (subcommands):

    epsim calibrate micro --out PROFILE.json    microbenchmarks of the device at hand
                                                (``epsim.calibrate.profile.calibrate``)
    epsim calibrate trace TRACE.json            a PyTorch profiler trace (``calibrate_trace``)
    epsim calibrate bench FILE... --out P.json  measured benchmark runs (``calibrate_bench``)

The spellings from before the subcommands keep their meaning: ``epsim calibrate --out P.json``
is ``micro``, ``--from-trace T`` is ``trace``, ``--from-bench FILE...`` is ``bench``. The legacy
form is the parent parser itself, with every mode's flags (hidden from its help), each added
by the same function that adds it to its subcommand (``epsim.modes``). This module parses,
calls and prints.
"""

from __future__ import annotations

import argparse
import sys
import time

from epsim.calibrate.exchange_fits import DEFAULT_EXCHANGE_FIT
from epsim.model.errors import EpsimError

from ..calibrate_bench import add_bench_args, run_bench_fit
from ..calibrate_trace import add_deployment_args, add_trace_args, run_trace
from ..common import emit_json, print_table
from ..inputs import add_flag
from ..modes import add_modes, legacy_flags
from ..options import add_json_arg
from ..provenance import stamp_provenance

_EXCHANGE_FIT_SCOPE = ("--exchange-fit chooses how a CPU calibration fits the all-to-all "
                       "table: it does not apply to --from-trace, --from-bench or --device cuda")


_MICRO = ("Time every op kind through the runtime's own implementations (single-rank decode "
          "steps of calibration-only model shapes, a GEMM grid), the EP all-to-all over "
          "message sizes at world sizes 2 and 4, and how ranks share the cores; save the "
          "tables as CSV beside the profile and fit a profile the simulator loads (epsim step "
          "--hardware PROFILE.json).")


def _add_micro_args(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    add_flag(p, "--device", default="cpu")
    add_flag(p, "--out", metavar="PROFILE.json", required=required,
             **({} if required else {"default": None}))
    p.add_argument("--quick", action="store_true", help="a small subset of every sweep (seconds; "
                   "for tests, not for a profile you rely on)")
    add_flag(p, "--base", metavar="HW", default=None,
             help="--device cuda: shipped profile whose communication figures are kept "
             "(default h200)")
    add_flag(p, "--exchange-fit", default=None,
             help="the EP exchange's fixed cost: the exchanges' median share of a step in "
             "the ranks sweep's decode steps, with how long issuing them held the host there "
             "(in-step, the default), the slowest rank's time in the "
             "all-to-all benchmark (slowest), or what the last rank to arrive waits plus the "
             "straggler measured in decode steps (last-plus-straggler); "
             "calibrate/exchange_fits.py")


def _add_trace_mode(p: argparse.ArgumentParser, *, positional: bool = True) -> None:
    add_trace_args(p, positional=positional)
    add_deployment_args(p)
    add_flag(p, "--out", metavar="PROFILE.json", default=None)


def _add_bench_mode(p: argparse.ArgumentParser, *, positional: bool = True) -> None:
    add_bench_args(p, positional=positional)
    add_deployment_args(p)
    add_flag(p, "--out", metavar="PROFILE.json", required=positional,
             **({} if positional else {"default": None}))


def _add_legacy(p: argparse.ArgumentParser) -> None:
    """Today's flags on the parent: every mode's, each defined once (``--out`` by micro's)."""
    _add_micro_args(p, required=False)
    add_trace_args(p)
    add_deployment_args(p)
    add_bench_args(p)
    add_json_arg(p)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate", help="fit a hardware profile: microbenchmarks on this machine (micro), a "
        "profiler trace (trace) or measured benchmark runs (bench)",
        description="Fit a hardware profile the simulator loads (epsim step --hardware "
        "PROFILE.json): from microbenchmarks of this machine (micro), a PyTorch profiler trace "
        "(trace) or measured vllm/sglang benchmark runs (bench).",
    )
    with legacy_flags(p, "epsim calibrate --out P.json (micro), --from-trace T (trace), "
                      "--from-bench FILE... (bench)"):
        _add_legacy(p)
    p.set_defaults(run=run)
    add_modes(p, {
        "micro": ("microbenchmark this machine and fit a profile", _add_micro_args, run_micro,
                  _MICRO),
        "trace": ("map a profiler trace to op kinds; with --model compare, with --out fit",
                  _add_trace_mode, run_trace),
        "bench": ("fit a profile to measured vllm/sglang benchmark runs", _add_bench_mode,
                  run_bench_fit),
    })


def run(args: argparse.Namespace) -> int:
    """The legacy form: the mode its flags name."""
    if args.from_trace and args.from_bench:
        raise EpsimError("--from-trace and --from-bench are two fits: give one")
    if args.exchange_fit is not None and (args.from_trace or args.from_bench):
        raise EpsimError(_EXCHANGE_FIT_SCOPE)
    if args.from_trace:
        return run_trace(args)
    if args.from_bench:
        return run_bench_fit(args)
    if args.out is None:
        raise EpsimError("--out PROFILE.json is required (unless --from-trace)")
    if args.factors:
        raise EpsimError("--factors names what --from-bench fits: give --from-bench FILES")
    return run_micro(args)


def run_micro(args: argparse.Namespace) -> int:
    """``epsim calibrate micro``: microbenchmark the device, fit and write the profile."""
    import importlib.util

    # here, not at the top: the recipes' fits import pandas, which the parser of every other
    # command would otherwise load (about 0.5 s and 100 MB)
    from epsim.calibrate.devices import DEVICES

    if args.exchange_fit is not None and not DEVICES[args.device].local_ranks:
        raise EpsimError(_EXCHANGE_FIT_SCOPE)
    try:
        has_torch = importlib.util.find_spec("torch") is not None
    except Exception:  # an import blocker or a broken install: as good as missing
        has_torch = False
    if not has_torch:
        raise EpsimError("epsim calibrate needs torch: pip install 'epsim[runtime]'")
    from epsim.calibrate.profile import calibrate, table_paths

    t0 = time.perf_counter()
    log = None if args.json else (lambda msg: print(f"  ... {msg}", file=sys.stderr))
    obj = calibrate(args.out, device=args.device, quick=args.quick, base=args.base, log=log,
                    exchange_fit=args.exchange_fit or DEFAULT_EXCHANGE_FIT,
                    stamp=stamp_provenance)
    wall = time.perf_counter() - t0
    eff = obj["efficiency"]
    tables = {k: str(v) for k, v in table_paths(args.out).items()}
    if args.json:
        import json

        from epsim.sim.hardware.profile import profile_from_bytes

        # the profile just written (its bytes as write_json_atomic wrote them; the file itself
        # is staged until the command ends): its name and hash identify it later
        emit_json({"profile": args.out, "tables": tables, "wall_s": wall,
                   "efficiency": eff, "calibration": obj["calibration"]},
                  profile_from_bytes(json.dumps(obj).encode(), args.out).provenance())
        return 0
    rows = [("profile", args.out), ("tables", ", ".join(tables.values())),
            ("roofline", f"{obj['calibration']['fit']['flops'] / 1e9:.1f} GFLOP/s, "
                         f"{obj['hbm_bandwidth'] / 1e9:.2f} GB/s (graph bytes)"),
            ("executor gap per op", f"{eff['graph_node_s'] * 1e6:.2f} us")]
    for kind, over in sorted(eff.get("op_overhead_s", {}).items()):
        extra = f", bytes scale {eff['op_bytes_scale'].get(kind, 1.0):.3g}" \
            if "op_bytes_scale" in eff else ""
        rows.append((f"  {kind}", f"overhead {over * 1e6:8.1f} us, scale "
                                  f"{eff.get('op_time_scale', {}).get(kind, 1.0):.3g}{extra}"))
    for kind, table in eff.get("a2a_latency_by_group_s", {}).items():
        rows.append((f"{kind} latency", ", ".join(f"{g} ranks: {v * 1e3:.3f} ms"
                                                  for g, v in table.items())))
    if "a2a_latency_by_group_s" in eff:
        rows.append(("link bandwidth", f"{eff['link_bandwidth_usable'] / 1e6:.1f} MB/s"))
    if "rank_compute_slowdown" in eff:
        rows.append(("ranks sharing cores", ", ".join(
            f"{w} ranks: {f:.2f}x" for w, f in eff["rank_compute_slowdown"].items())))
    if "a2a_host_block_fraction" in eff:
        rows.append(("dispatch host hold share", ", ".join(
            f"{w} ranks: {v:.3f}" for w, v in eff["a2a_host_block_fraction"].items())))
    if "rank_skew_by_group_s" in eff:
        rows.append(("slowest rank's lateness", ", ".join(
            f"{w} ranks: {v * 1e3:.2f} ms" for w, v in eff["rank_skew_by_group_s"].items())))
    by_group = eff.get("comm_compute_slowdown_by_group")
    rows.append(("comm/compute slowdown", ", ".join(
        f"{w} ranks: {v:.2f}" for w, v in by_group.items()) if by_group
        else f"{eff['comm_compute_slowdown']:.2f}"))
    rows.append(("wall time", f"{wall:.1f} s"))
    print_table(rows, title=f"epsim calibrate: {args.device}")
    return 0
