"""``epsim balance``: place experts on GPUs from measured loads, and say how balanced it is."""

from __future__ import annotations

import argparse

import numpy as np

from epsim.model.eplb import DEFAULT_METHOD, DEFAULT_SNAPSHOTS_METHOD, balance_report
from epsim.model.errors import EpsimError
from epsim.model.loads import read_loads
from epsim.model.placement import read_placement
from epsim.model.trace import write_json_atomic
from epsim.sim.spec import ExecutionSpec, PlanSpec

from ..common import emit_json, loads_help, print_table
from ..inputs import add_flag
from ..options import add_field, add_json_arg, field_option
from ..work import add_force_arg, check_balance


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "balance", help="balance experts over GPUs from a load file (EPLB)",
        description="Split each MoE layer's experts over the GPUs, the same number of slots "
        "each, so the GPUs carry equal loads; report the imbalance (max GPU load / mean GPU "
        "load) before and after, and optionally on another load file.",
    )
    add_field(p, *field_option(ExecutionSpec, "loads"), listed=True, required=True)
    add_flag(p, "--gpus", required=True, metavar="G", help="GPUs (EP size)")
    # with several nodes, experts are placed on nodes first, then on each node's GPUs
    add_field(p, *field_option(PlanSpec, "nodes"), default=1)
    add_flag(p, "--expert-groups", default=None, metavar="K",
                   help="with --nodes: keep the model's K routing groups whole on one node "
                        "(DeepSeek-V3: 8)")
    add_field(p, *field_option(PlanSpec, "redundant_experts"))
    add_flag(p, "--previous", metavar="PLACEMENT",
                   help="the placement in use: number GPUs to move the fewest experts")
    add_flag(p, "--max-moves", default=None, metavar="K",
                   help="with --previous: only swap experts, at most K off their GPU per layer")
    add_flag(p, "--method", default=None,
                   help=f"packing algorithm (default {DEFAULT_METHOD} for one snapshot; "
                        f"{DEFAULT_SNAPSHOTS_METHOD}, which fits the worst snapshot, for "
                        f"several)")
    add_flag(p, "--eval", metavar="NAME|FILE",
                   help=loads_help("also measure the placement on these loads (held out)"))
    add_flag(p, "--out", metavar="PLACEMENT")
    add_json_arg(p)
    add_force_arg(p)
    p.set_defaults(run=run)


def read_snapshots(names: tuple[str, ...]) -> np.ndarray:
    """``[layers, experts]`` for one snapshot, ``[snapshots, layers, experts]`` for several
    (every file's windows, in order); files of different shapes are one error."""
    parts = [read_loads(name, windows=True) for name in names]
    for name, part in zip(names[1:], parts[1:], strict=True):
        if part.shape[1:] != parts[0].shape[1:]:
            raise EpsimError(f"load file {name} is {list(part.shape[1:])} layers x experts, "
                             f"{names[0]} {list(parts[0].shape[1:])}")
    loads = np.concatenate(parts)
    return loads[0] if len(loads) == 1 else loads


def run(args: argparse.Namespace) -> int:
    loads = read_snapshots(args.loads)
    check_balance(loads.shape, args.force)  # before any balancing (epsim/work.py)
    eval_loads = read_loads(args.eval) if args.eval else None
    previous = (read_placement(args.previous, num_layers=loads.shape[-2],
                               num_experts=loads.shape[-1]) if args.previous else None)
    placement, report = balance_report(
        loads, args.gpus, args.method, redundant=args.redundant_experts, nodes=args.nodes,
        expert_groups=args.expert_groups, previous=previous, max_moves=args.max_moves,
        eval_loads=eval_loads)
    if args.out:
        write_json_atomic({**placement.to_json(), "method": report["method"],
                           "loads": ",".join(args.loads)}, args.out)
        report["out"] = str(args.out)
    if args.json:
        emit_json(report)
        return 0

    def pair(obj: dict) -> str:
        return f"mean {obj['mean']:.5f}, worst layer {obj['max']:.5f}"

    rows = [
        ("layers", f"{report['layers']} MoE layers, {report['experts']} experts, "
                   f"{report['gpus']} GPUs x {report['slots_per_gpu']} slots"),
        (f"imbalance {report['before']}", pair(report["imbalance_before"])),
        (f"imbalance {report['method']}", pair(report["imbalance_after"])),
        ("lower bound", pair(report["lower_bound"])),
    ]
    if report["snapshots"] > 1:
        rows[1:] = [(f"{label} (worst snapshot)", value) for label, value in rows[1:]]
        rows += [(f"snapshot {i} {report['method']}", pair(one))
                 for i, one in enumerate(report["imbalance_after_per_snapshot"])]
    if "eval" in report:
        rows += [(f"held out {report['before']}", pair(report["eval"]["imbalance_before"])),
                 (f"held out {report['method']}", pair(report["eval"]["imbalance_after"]))]
    if "moved_experts" in report:
        rows.append(("moved experts", f"{report['moved_experts']} "
                                      f"(at most {report['moved_experts_max_layer']} per layer)"))
    rows.append(("wall", f"{report['wall_ms']:.1f} ms"))
    if args.out:
        rows.append(("written", args.out))
    print_table(rows, title="epsim balance (imbalance = max GPU load / mean GPU load)")
    return 0
