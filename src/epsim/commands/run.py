"""``epsim run``: execute decode steps of a model for real with the torch runtime.

Spawns ``--world-size`` local ranks (gloo on the CPU), or, started under ``torchrun``, runs as one
of its ranks. torch is an optional extra: it is imported only here, inside ``run``, so every other
command works without it.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from epsim.model.errors import EpsimError
from epsim.sim.spec import ExecutionSpec, PlanSpec
from epsim.sim.workload.spec import WorkloadSpec

from ..common import emit_json, print_table
from ..inputs import add_flag
from ..options import (
    add_config_arg,
    add_field,
    add_fields,
    add_json_arg,
    add_model_arg,
    field_option,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run", help="run decode steps for real (torch runtime, local ranks or torchrun)",
        description="Execute the op graph of a decode step with torch on W local ranks "
        "(DP attention + EP MoE over torch.distributed), timing every op; with --check compare "
        "every rank's outputs with a dense single-process reference.",
    )
    add_model_arg(p)
    add_flag(p, "--world-size", default=None, metavar="W",
                   help="ranks (default 1; under torchrun its WORLD_SIZE)")
    # the runtime runs DP attention over every rank (dp = world) and tp = 1
    add_fields(p, PlanSpec, only=("dp", "tp", "ep", "redundant_experts"))
    add_flag(p, "--batch", required=True)
    add_flag(p, "--context", required=True)
    add_flag(p, "--steps", default=4)
    add_fields(p, ExecutionSpec, only=("dbo", "kv_dtype", "mtp", "mtp_acceptance"))
    p.add_argument("--static", action="store_true",
                   help="static-shape dispatch/combine and MoE (padded to a fixed capacity)")
    p.add_argument("--capture", action="store_true",
                   help="capture the decode step as a CUDA/HIP graph (GPU only; implies --static)")
    where = p.add_mutually_exclusive_group()
    add_flag(where, "--placement", metavar="FILE", help="expert placement file (epsim balance "
             "--out); default: contiguous, or balanced with --redundant-experts / --loads")
    # the loads the placement is balanced from (default with --redundant-experts: the model's
    # synthetic skewed loads)
    add_field(where, *field_option(ExecutionSpec, "loads"))
    add_flag(p, "--dtype", default="fp32",
                   help="compute dtype (default fp32)")
    add_flag(p, "--device", default="cpu")
    p.add_argument("--unfused", action="store_true",
                   help="unfused graph: separate RoPE, shared gate/up and routed-expert ops")
    p.add_argument("--shared-expert-in-moe", action="store_true",
                   help="run the shared expert inside the fused-MoE op as one more local expert "
                   "(aiter's 33-expert kernels) instead of as its own GEMMs")
    p.add_argument("--prefill", action="store_true",
                   help="fill the KV cache with a real prefill step over random prompts of "
                   "context - 1 tokens (timed and checked) instead of drawn cache entries")
    p.add_argument("--check", action="store_true",
                   help="compare with the dense single-process reference (fp32)")
    add_flag(p, "--trace", metavar="OUT")
    add_field(p, *field_option(WorkloadSpec, "seed"))  # here: the weights and inputs
    add_flag(p, "--timeout", default=120, metavar="S",
                   help="seconds a collective may wait before the run fails (default 120)")
    add_flag(p, "--stall-timeout", default=40, metavar="S",
             help="local ranks: when no rank finishes any work (an op, a step) for S seconds, "
             "the run is hung and ends naming the rank that progressed last longest ago, "
             "whether or not its heartbeat beats (default 40: named within 60 s)")
    add_json_arg(p)
    add_config_arg(p)
    p.set_defaults(run=run)


def _balanced_table(args: argparse.Namespace, world: int) -> tuple[tuple[int, ...], ...] | None:
    """Without ``--placement``: the default placement over the EP ranks
    (``epsim.model.eplb.default_placement``, as the simulator's), balanced when
    ``--redundant-experts`` or ``--loads`` is given (its replicas chosen from the loads, the
    synthetic ones by default), as a table every rank receives; else None (the file, or the
    contiguous placement the runtime builds itself, ``RunOptions.placement`` None)."""
    balanced = bool(args.redundant_experts or args.loads)
    if args.placement or not balanced:
        return None
    from epsim.model.config import load_model
    from epsim.model.eplb import default_placement
    from epsim.model.loads import read_loads, synthetic_loads
    from epsim.model.plan import make_plan

    model = load_model(args.model)
    loads = read_loads(args.loads) if args.loads else synthetic_loads(model)
    if loads.shape != (model.num_layers, model.moe.num_experts):
        raise EpsimError(f"loads {args.loads} of shape {list(loads.shape)} do not match "
                         f"{model.name}'s [{model.num_layers}, {model.moe.num_experts}] layers x "
                         "experts")
    # the plan's own checks first (ep divides the slots, replicas need EP), in its words
    plan = make_plan(model, nodes=1, gpus_per_node=world, dp=world, tp=1, ep=args.ep,
                     redundant_experts=args.redundant_experts)
    gpus = plan.ep if plan.expert_parallel else 1
    placement = default_placement(loads, gpus, balanced=balanced,
                                  redundant=args.redundant_experts)
    return tuple(tuple(row) for row in placement.physical_to_logical.tolist())


def run(args: argparse.Namespace) -> int:
    import importlib.util

    try:  # find_spec, not import: the parent of the ranks never needs torch itself
        torch_spec = importlib.util.find_spec("torch")
    except Exception:  # a broken install or an import blocker: as good as missing
        torch_spec = None
    if torch_spec is None:
        raise EpsimError("epsim run needs torch: pip install 'epsim[runtime]' (CPU: first "
                         "pip install torch==2.13.0)")
    from epsim.model.trace import write_chrome_trace
    from epsim.runtime import RunOptions, launch_local, run_rank, under_torchrun

    if args.tp not in (None, 1):
        raise EpsimError(f"the runtime runs tp = 1 (DP attention + EP MoE), got --tp {args.tp}")
    torchrun = under_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else (args.world_size or 1)
    if torchrun and args.world_size not in (None, world):
        raise EpsimError(f"--world-size {args.world_size} but torchrun started {world} ranks")
    opts = RunOptions(
        model=args.model, world_size=world, batch=args.batch, context=args.context,
        steps=args.steps, dp=args.dp, ep=args.ep, dbo=bool(args.dbo), static=args.static,
        capture=args.capture, placement=args.placement, kv_dtype=args.kv_dtype,
        check=args.check, seed=args.seed, dtype=args.dtype, device=args.device,
        unfused=args.unfused, shared_expert_in_moe=args.shared_expert_in_moe,
        trace=bool(args.trace), prefill=args.prefill, mtp=args.mtp,
        mtp_acceptance=args.mtp_acceptance,
        placement_table=_balanced_table(args, world), redundant_experts=args.redundant_experts)
    if torchrun:
        rank = int(os.environ["RANK"])
        try:
            results = run_rank([opts], rank, world, "env://", args.timeout)
        except EpsimError:
            raise
        except Exception as exc:  # one line, as the local launcher reports it; torchrun stops
            raise EpsimError(f"rank {rank} failed: {type(exc).__name__}: {exc}") from exc
        if results is None:  # ranks other than 0 report nothing
            return 0
    else:
        results = launch_local([opts], world, args.timeout, stall_s=args.stall_timeout)
    summary: dict[str, Any] = results[0]
    if opts.placement_table is not None:
        summary["placement"] = f"balanced from {args.loads or 'synthetic loads'}"
    events = summary.pop("trace_events", None)
    summary.pop("next_tokens", None)
    if args.trace:
        write_chrome_trace(events or [], args.trace,
                           metadata={k: v for k, v in summary.items() if not isinstance(v, dict)})
        summary["trace"] = args.trace
    if args.json:
        emit_json(summary)
        return 0
    st = summary["step_ms"]
    rows = [
        ("plan", f"{world} rank(s): dp {world}, ep {world if world > 1 and args.ep != 1 else 1}, "
                 + (f"{summary['redundant_experts']} redundant experts, "
                    if summary.get("redundant_experts") else "")
                 + f"{summary['batch_per_rank']} seqs/rank, context {summary['context']}"),
        ("mode", ", ".join(filter(None, [
            "DBO" if args.dbo else "no DBO", "static" if summary["static"] else "dynamic",
            "captured" if args.capture else "eager", f"kv {args.kv_dtype}", args.dtype,
            f"placement {summary['placement']}"]))),
        ("step ms", f"mean {st['mean']:.2f}, median {st['median']:.2f}, p10 {st['p10']:.2f}, "
                    f"p90 {st['p90']:.2f} ({summary['steps_timed']} timed)"),
        ("tokens/s", f"{summary['tokens_per_s']:.1f}"),
    ]
    if "mtp" in summary:
        m = summary["mtp"]
        rows.append(("MTP", f"{m['draft_tokens']} draft token(s) per step, acceptance "
                            f"{m['acceptance']:g} (simulated): {m['tokens_per_request_step']:.3f} "
                            "tokens per sequence per step"))
    if args.prefill:
        rows.append(("prefill ms", f"{summary['prefill_ms']:.2f} "
                                   f"({summary['prefill_tokens_per_s']:.1f} prompt tokens/s)"))
    for kind, ms in sorted(summary["op_ms_per_step_by_kind"].items(), key=lambda kv: -kv[1]):
        rows.append((f"  {kind}", f"{ms:.3f} ms/step"))
    if args.check:
        rows.append(("max rel err", f"{summary['max_rel_err']:.2e} vs the dense reference "
                                    f"({summary['token_mismatches']} token mismatches)"))
    if args.trace:
        rows.append(("trace", args.trace))
    print_table(rows, title=f"epsim run: {summary['model']}")
    return 0
