"""``epsim calibrate trace TRACE.json`` (also spelled ``epsim calibrate --from-trace TRACE.json``):
the flags and the run (the work is in ``epsim.calibrate.trace_calibrate``; this module resolves
the deployment, calls and prints).

The deployment compared is the trace's where it says (``distributedInfo`` world size and rank,
the device name, a ``seqlen`` in the trace name, the layers its annotations cover), else the
flags'; flags given win. Without ``--model`` (a trace does not name its model) only the mapping
is reported.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Any

from epsim.model.errors import EpsimError
from epsim.sim.spec import ExecutionSpec, PlanSpec

from .common import emit_json, print_table
from .inputs import add_flag, spec_for
from .options import (
    add_field,
    add_fields,
    add_hardware_arg,
    add_kernels_arg,
    add_model_arg,
    field_option,
)


def add_trace_args(p: argparse.ArgumentParser, *, positional: bool = False) -> None:
    """The trace (``--from-trace TRACE.json``, or the positional ``TRACE.json`` of ``epsim
    calibrate trace``), its scope and the traced pass; the deployment's flags are
    :func:`add_deployment_args`."""
    g = p.add_argument_group("from a profiler trace (--from-trace)")
    what = ("a PyTorch profiler (Kineto) Chrome trace: map its GPU kernels to op kinds, "
            "compare them with the simulator's (with --model), fit per-kind factors (--out)")
    if positional:
        add_flag(g, "from_trace", spec=spec_for("--from-trace"), metavar="TRACE.json",
                 help=what)
    else:
        add_flag(g, "--from-trace", metavar="TRACE.json", default=None, help=what)
    add_flag(g, "--annotations", default=None, metavar="NAMES|all",
             help="CPU annotations whose launched kernels are in scope (default: DualPipe's "
             "forward attn(F),mlp(F),dispatch(F),combine(F) where the trace has them, else "
             "every kernel; all: every kernel)")
    add_flag(g, "--batch", default=1)
    add_flag(g, "--context", default=None)
    add_flag(g, "--layers", default=None,
             help="MoE layers the scope holds (default: how often its most frequent "
             "annotation occurs)")


def add_deployment_args(p: argparse.ArgumentParser) -> None:
    """The deployment measured, shared by the trace and the benchmark fits: ``--model``,
    ``--hardware``, ``--kernels``, ``--nodes``, ``--dp``, ``--ep``, ``--tp``, ``--kv-dtype``."""
    # the deployment's own flags (epsim/options.py), each with its one meaning; where a trace
    # reads one differently the command's description says so (a trace does not name its
    # model; its hardware defaults to the one its device name names, its plan to its world
    # size, its --kv-dtype to bf16: the attention math of the traced run)
    g = p.add_argument_group("the deployment measured")
    add_model_arg(g, required=False)
    add_hardware_arg(g, required=False)
    add_kernels_arg(g)
    add_fields(p, PlanSpec, only=("nodes", "dp", "ep", "tp"))
    add_field(g, *field_option(ExecutionSpec, "kv_dtype"), default=None)


def _hardware(args: argparse.Namespace, meta: dict[str, Any]) -> tuple[str, str]:
    from epsim.sim.hardware.profile import shipped_profiles

    if args.hardware:
        return args.hardware, "--hardware"
    device = str(meta.get("device", "")).lower()
    for name in shipped_profiles():
        if re.search(rf"\b{re.escape(name)}\b", device):
            return name, f"deviceProperties name {meta['device']!r}"
    raise EpsimError(f"the trace's device {meta.get('device') or '(none)'!r} names no shipped "
                     "hardware profile: give --hardware")


def deployment(args: argparse.Namespace, meta: dict[str, Any], layers: int):
    """The :class:`TracedStep` to simulate, or None without ``--model``."""
    from epsim.calibrate.trace_calibrate import TracedStep
    from epsim.sim.hardware.profile import load_profile

    if args.model is None:
        return None
    hardware, origin_hw = _hardware(args, meta)
    world = meta.get("world_size") if isinstance(meta.get("world_size"), int) else None
    origin = {"hardware": origin_hw}
    ep = args.ep or world
    dp = args.dp or world
    if ep is None or dp is None:
        raise EpsimError("the trace has no distributedInfo world size: give --dp and --ep")
    origin["dp/ep"] = "flags" if args.ep and args.dp else "distributedInfo world_size"
    context = args.context or meta.get("seq_len")
    if context is None:
        raise EpsimError("the trace name carries no seqlen: give --context")
    origin["context"] = "--context" if args.context else f"traceName {meta.get('trace_name')}"
    origin["layers"] = "--layers" if args.layers else "annotation count"
    gpn = load_profile(hardware).gpus_per_node
    tp = args.tp or 1
    nodes = args.nodes or max(1, math.ceil(dp * tp / gpn))
    per_node = min(gpn, math.ceil(dp * tp / nodes))  # a world smaller than a node: part of one
    rank = meta.get("rank") if isinstance(meta.get("rank"), int) else 0
    return TracedStep(model=args.model, hardware=hardware, kernels=args.kernels, nodes=nodes,
                      gpus_per_node=per_node, dp=dp, ep=ep, tp=tp, batch=args.batch,
                      context=int(context), layers=args.layers or layers, rank=rank,
                      kv_dtype=args.kv_dtype or "bf16", origin=origin)


def run_trace(args: argparse.Namespace) -> int:
    from epsim.calibrate import kineto
    from epsim.calibrate import trace_calibrate as tc

    trace = kineto.read_trace(args.from_trace)
    spans = kineto.scope_annotations(trace, args.annotations)
    mapping = tc.map_trace(trace, spans)
    layers = tc.layers_in(spans)
    out: dict[str, Any] = {
        "trace": args.from_trace, "metadata": dict(trace.metadata),
        "scope": {"annotations": sorted({s.name for s in spans}) or "all kernels",
                  "layers": layers, "kernels_without_launch": kineto.unlinked(trace)},
        "mapped_fraction": mapping.mapped_fraction, **mapping.to_json()}
    dep = deployment(args, dict(trace.metadata), layers)
    if dep is not None:
        simulated = tc.simulate_kinds(dep)
        out["deployment"] = dep.to_json()
        out["comparison"] = tc.compare(mapping.kind_us(), simulated)
        if args.out:
            if args.annotations == ():  # --annotations all
                # a training trace's backward kernels (FlashAttention's bwd, the weight grads)
                # would be fitted against a forward step
                raise EpsimError("--out fits a forward step: keep the forward annotations (the "
                                 "default) or name forward ones with --annotations, not all")
            out.update(_fit(args, trace, dep, mapping))
    elif args.out:
        raise EpsimError("--out fits factors against the simulator: give --model")
    if args.json:
        from epsim.sim.hardware.profile import load_profile

        emit_json(out, *([load_profile(dep.hardware, kernels=dep.kernels).provenance()]
                         if dep is not None else []))
    else:
        _print(out)
    return 0


def _fit(args: argparse.Namespace, trace, dep, mapping) -> dict[str, Any]:
    """Fit ``op_time_scale`` against the roofline (the factors act there) and write it."""
    from epsim.calibrate import trace_calibrate as tc
    from epsim.model.trace import write_json_atomic
    from epsim.sim.hardware.profile import load_profile

    meta = trace.metadata
    scope = ", ".join(sorted({s for s in mapping.annotations if s})) or "the whole trace"
    note = (f"fitted by epsim calibrate --from-trace {args.from_trace} "
            f"({meta.get('trace_name', '')}, {meta.get('device', '')}, rank {dep.rank} of "
            f"{meta.get('world_size', '?')}): per op kind the GPU kernel time under {scope} "
            f"over {dep.layers} MoE layers of {dep.model} (dp {dep.dp}, ep {dep.ep}, "
            f"{dep.batch} x {dep.context} tokens, prefill) / the roofline's (--kernels none); "
            "acts under --kernels none (kernel-table points are measurements of their own)")
    from epsim.calibrate import plausible

    obj, roofline, refused = tc.fit_trace(dep, mapping.kind_us(),
                                          load_profile(dep.hardware).raw, note)
    plausible.warn(refused, "calibrate --from-trace")
    write_json_atomic(obj, args.out)
    return {"profile": args.out, "fitted": obj["efficiency"].get("op_time_scale", {}),
            "fitted_source": note, "refused": refused,
            "refit_comparison": tc.compare(mapping.kind_us(), roofline)}


def _print(out: dict[str, Any]) -> None:
    rows = [("trace", f"{out['trace']} ({out['metadata'].get('device', '?')}, world "
                      f"{out['metadata'].get('world_size', '?')})"),
            ("scope", f"{out['scope']['annotations']} ({out['scope']['layers']} layers)"),
            ("mapped", f"{out['mapped_us']:.0f} of {out['kernel_us']:.0f} us of kernel time "
                       f"({out['mapped_fraction']:.1%}), {out['kernels']} kernels")]
    comparison = out.get("comparison", {})
    for kind, row in out["kinds"].items():
        sim = comparison.get(kind, {}).get("simulated_us")
        rows.append((f"  {kind}", f"{row['us']:10.0f} us" + (
            f"   simulated {sim:10.0f} us" if sim is not None else "")))
    for kind, row in comparison.items():
        if kind not in out["kinds"]:
            rows.append((f"  {kind}", f"{0:10.0f} us   simulated {row['simulated_us']:10.0f} us"))
    for item in out["unmapped"][:20]:
        rows.append(("  unmapped", f"{item['us']:10.0f} us  x{item['count']}  {item['name']}"))
    if "profile" in out:
        rows.append(("profile", f"{out['profile']} (op_time_scale: " + ", ".join(
            f"{k} {v:.3g}" for k, v in out["fitted"].items()) + ")"))
        for r in out["refused"]:
            rows.append(("  refused", f"{r['factor']} {r['fitted']:.3g}x outside "
                         f"[{r['range'][0]:g}, {r['range'][1]:g}]: kept {r['kept']:g}"))
    print_table(rows, title="epsim calibrate --from-trace")
