"""``epsim step``: simulate one decode or prefill step and show where the time goes."""

from __future__ import annotations

import argparse
import time
from typing import Any

from epsim.model import Batch, accounting, load_model
from epsim.model.config import check_context_length
from epsim.model.errors import EpsimError
from epsim.model.loads import read_loads
from epsim.model.mtp import expected_tokens
from epsim.model.trace import write_chrome_trace
from epsim.sim.deployment import resolve_deployment
from epsim.sim.spec import ExecutionSpec
from epsim.sim.step.simulate import MODES, simulate_step
from epsim.sim.workload.spec import WorkloadSpec

from ..common import emit_json, print_table
from ..fidelity import STEP_HEADLINE, band_text, regime_of, stamp
from ..inputs import add_flag
from ..options import (
    add_config_arg,
    add_field,
    add_fields,
    add_hardware_arg,
    add_json_arg,
    add_model_arg,
    add_plan_args,
    deployment_from_args,
    field_option,
)
from ..work import add_force_arg, check_step


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "step", help="simulate one forward step: step time and its breakdown",
        description="Simulate one decode (or prefill) step of every rank: compute streams, EP "
        "dispatch/combine over the fabric, dual-batch overlap, graph replay, and this step's "
        "sampled expert routing. --batch is per dp rank.",
    )
    add_model_arg(p)
    add_hardware_arg(p)
    add_plan_args(p)
    add_flag(p, "--batch", required=True)
    add_flag(p, "--context", required=True)
    add_flag(p, "--phase", default="decode", help="the step's phase (default decode)")
    # a step has no scheduler: DBO is off unless asked, as vLLM and SGLang run without it
    x = add_fields(p, ExecutionSpec, only=("dbo", "eplb", "graph", "kv_dtype", "mem_fraction",
                                           "kernels", "a2a_mode", "mtp", "mtp_acceptance"))
    loads = x.add_mutually_exclusive_group()
    add_field(loads, *field_option(ExecutionSpec, "loads"))
    loads.add_argument("--uniform", action="store_true",
                       help="uniform routing instead of the synthetic skewed loads")
    add_flag(p, "--mode", default=MODES[0],
                   help="fast (vectorised) or exact (simpy, every op of every rank)")
    p.add_argument("--explain", action="store_true",
                   help="show where each op kind's time comes from: the kernel-table points "
                   "(and their sources) or the roofline used, and the shapes outside every table")
    add_field(p, *field_option(WorkloadSpec, "seed"))
    add_config_arg(p)
    add_flag(p, "--trace", metavar="OUT")
    add_json_arg(p)
    add_force_arg(p)
    p.set_defaults(run=run)


def simulate(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    model = load_model(args.model)
    # a verify step's last draft sits mtp positions past the context
    check_context_length(model, args.context + args.mtp, f"--context {args.context}"
                         + (f" + --mtp {args.mtp}" if args.mtp else ""))
    # the step's plan, DBO and memory budget as every command resolves them
    resolved = resolve_deployment(deployment_from_args(args))
    profile, plan, budget = resolved.profile, resolved.plan, resolved.budget
    check_step(plan.ep, plan.tp, args.force)  # before the collectives' rank x rank matrices
    batch = Batch(args.phase, args.batch, args.context)
    # the batch's KV cache must fit next to the weights
    need = accounting.kv_bytes_for_sequence(
        model, plan.kv_dtype, args.context + plan.mtp, plan.tp,
        accounting.draft_kv_layers(plan)) * args.batch
    if need > budget.kv_bytes:
        raise EpsimError(
            f"batch {args.batch} x context {args.context} needs {need / 1e9:.1f} GB of KV cache "
            f"per GPU, only {budget.kv_bytes / 1e9:.1f} GB fit on {profile.name} "
            f"({plan.kv_dtype} KV, mem fraction {plan.mem_fraction:g})")
    loads = read_loads(args.loads) if args.loads else None
    started = time.perf_counter()
    result = simulate_step(model, plan, batch, profile, loads=loads, eplb=args.eplb,
                           mode=args.mode, seed=args.seed, trace=bool(args.trace),
                           synthetic="uniform" if args.uniform else "skewed",
                           explain=args.explain)
    wall = time.perf_counter() - started
    out: dict[str, Any] = {
        "model": model.name, "hardware": profile.name, "provenance": profile.provenance(),
        "plan": {"nodes": plan.nodes, "gpus_per_node": plan.gpus_per_node, "dp": plan.dp,
                 "tp": plan.tp, "ep": plan.ep, "dbo": plan.microbatches == 2,
                 "graph": plan.graph_mode and batch.phase == "decode", "kv_dtype": plan.kv_dtype,
                 "eplb": args.eplb, "mem_fraction": plan.mem_fraction,
                 "kernels": profile.kernel_set, "a2a_mode": result.a2a_mode,
                 "shared_expert_in_moe": plan.fusion.shared_expert_in_moe,
                 "redundant_experts": plan.redundant_experts,
                 "slots_per_gpu": plan.slots_per_gpu(model),
                 "mtp": plan.mtp, "mtp_acceptance": args.mtp_acceptance},
        "batch": {"phase": batch.phase, "seqs_per_rank": batch.seqs, "context": batch.context},
        # tokens a sequence advances per decode step on average: sum of P**k, k = 0..mtp
        "tokens_per_request_step": (expected_tokens(plan.mtp, args.mtp_acceptance)
                                    if batch.phase == "decode" else 1.0),
        "loads": args.loads or ("uniform" if args.uniform else "synthetic-skewed"),
        "kv_bytes_per_gpu": need, "kv_bytes_available": budget.kv_bytes,
        **result.to_json(),
        "sim_wall_s": wall,
    }
    stamp(out, regime_of(ep=plan.ep, phase=batch.phase), STEP_HEADLINE)
    if args.trace:
        write_chrome_trace(result.events, args.trace,
                           metadata={k: out[k] for k in ("model", "hardware", "plan", "batch")})
        out["trace"] = args.trace
    return out, result


def run(args: argparse.Namespace) -> int:
    out, _ = simulate(args)
    if args.json:
        emit_json(out)
        return 0
    plan, b = out["plan"], out["batch"]
    rows = [
        ("model", f"{out['model']} on {out['hardware']}: dp {plan['dp']}, tp {plan['tp']}, "
                  f"ep {plan['ep']}{_slots_text(plan)}, {'DBO' if plan['dbo'] else 'no DBO'}, "
                  f"{'graph' if plan['graph'] else 'eager'}, KV {plan['kv_dtype']}"),
        ("batch", f"{b['phase']}: {b['seqs_per_rank']} seqs/rank, context {b['context']}"),
        ("step", f"{out['step_ms']:.2f} ms ({out['mode']}, seed {out['seed']})"),
    ]
    if plan["mtp"]:
        rows.append(("MTP", f"{plan['mtp']} draft token(s) verified per sequence, acceptance "
                            f"{plan['mtp_acceptance']:g}: {out['tokens_per_request_step']:.3f} "
                            f"tokens per sequence per step; draft module "
                            f"{out['draft_module_ms']:.2f} ms"))
    for name, ms in out["breakdown_ms"].items():
        share = 100 * ms / out["step_ms"] if out["step_ms"] else 0.0
        rows.append((f"  {name}", f"{ms:8.2f} ms  {share:5.1f}%"))
    busy = sum(out["comm_busy_ms"].values())
    rows += [
        ("comm in flight", f"{busy:.2f} ms, {out['overlapped_comm_ms']:.2f} ms hidden behind "
                           f"compute, {out['exposed_comm_ms']:.2f} ms exposed"),
        ("comm interference", f"{out['compute_slowdown_ms']:.2f} ms (inside the compute parts)"),
        ("expert imbalance", f"{out['expert_imbalance']:.3f} mean, "
                             f"{out['expert_imbalance_max']:.3f} worst layer ({out['loads']})"),
    ]
    rows.append(("kernels", f"{out['kernels']} (op kinds, ms on the critical rank)"))
    for kind, ms in sorted(out["op_kinds_ms"].items(), key=lambda kv: -kv[1]):
        rows.append((f"  {kind}", f"{ms:8.3f} ms"))
    if "trace" in out:
        rows.append(("trace", out["trace"]))
    rows.append(("error band", band_text(out["error_band"])))
    print_table(rows)
    if "kernel_inventory" in out:
        print_inventory(out["kernel_inventory"])
    if "kernel_sources" in out:
        print_kernel_sources(out["kernel_sources"])
    return 0


def print_inventory(inv: dict[str, Any]) -> None:
    """``--explain`` without ``--json``: the kernels each op runs and what each kernel costs."""
    print(f"kernel inventory: {inv['kernel_set']} ({inv['engine']}), "
          f"{inv['kernels_per_step']} kernels per step"
          + (f"; list read from {inv['source']}" if inv["source"] else ""))
    print(f"  per kernel: floor {inv['kernel_floor_s'] * 1e6:.3f} us on the device, graph gap "
          f"{inv['graph_node_s'] * 1e6:.3f} us; host launch {inv['kernel_launch_s'] * 1e6:.3f} us "
          f"+ framework dispatch {inv['framework_dispatch_s'] * 1e6:.3f} us (0: captured graph)")
    for name, entry in inv["ops"].items():
        kernels = " + ".join(entry["kernels"]) or "(fused into a neighbour)"
        print(f"  {name:<22} {entry['kind']:<16} x{entry['count']:<4} {kernels}")


def _slots_text(plan: dict[str, Any]) -> str:
    """`` (4 expert slots/GPU, 32 redundant)`` with replicas, else nothing (as before)."""
    if not plan["redundant_experts"]:
        return ""
    return f" ({plan['slots_per_gpu']} expert slots/GPU, {plan['redundant_experts']} redundant)"


def _source_text(source: dict[str, Any]) -> str:
    if "key" in source:  # a profile figure the roofline reads: its own source text
        return f"{source.get('profile', '')} {source['key']}: {source.get('source', '')}"
    if "url" in source:
        return source["url"]
    ref = source.get("commit") or (f"PR #{source['pr']}" if "pr" in source else "")
    return " ".join(filter(None, [source.get("repository"), source.get("path"), ref]))


def print_kernel_sources(sources: dict[str, Any]) -> None:
    """``--explain`` without ``--json``: per op kind the method, the points used and their
    sources, then the shapes that fell outside every table."""
    print("where the time comes from (per op kind):")
    for kind, info in sources.items():
        methods = ", ".join(f"{m} x{n}" for m, n in info.get("methods", {}).items())
        formats = ", ".join(info.get("dtypes", {}))
        print(f"  {kind}: {info.get('method')} ({methods}); computes in {formats}")
        for t in info.get("tables", []):
            note = f": {t['note']}" if t.get("note") else ""
            print(f"      table {t['table']} (deployment {t['deployment']}, {t['ops']} ops){note}")
        for p in info.get("points", [])[:4]:
            feats = ", ".join(f"{k} {v:g}" for k, v in p["features"].items())
            eff = (f", {p['implied_efficiency']:.1%} of the {p['bound']} roof"
                   + (" (below the table guard's floor)" if p["below_floor"] else "")
                   + (" (above peak as the cost model counts the work)"
                      if p["implied_efficiency"] > 1 else "")
                   if "implied_efficiency" in p else "")
            print(f"      point {feats}: {p['time']:g} {p['unit']} [{p['source']}]{eff}")
        for sid, src in info.get("sources", {}).items():
            print(f"      source {sid}: {_source_text(src)}")
        for o in info.get("outside", [])[:3]:
            feats = ", ".join(f"{k} {v:g}" for k, v in o["features"].items())
            # a transfer (another shape, or a table measured at other head widths) names its
            # scaling: the nearest point's time times this roofline ratio
            ratio = (f"; nearest point x {o['roofline_ratio']:.4g} (roofline ratio)"
                     if "roofline_ratio" in o else "")
            print(f"      outside every table ({o['method']}, {o['count']} ops): {feats}{ratio}")
