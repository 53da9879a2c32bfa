"""``epsim describe``: a model's size, and with a plan and hardware, what one GPU holds."""

from __future__ import annotations

import argparse
from typing import Any

from epsim.model import ModelConfig, accounting, load_model, make_plan
from epsim.model.plan import KV_DTYPES
from epsim.sim.deployment import resolve_deployment
from epsim.sim.spec import ExecutionSpec

from ..common import emit_json, human_bytes, human_count, print_table
from ..options import (
    add_config_arg,
    add_fields,
    add_hardware_arg,
    add_json_arg,
    add_model_arg,
    add_plan_args,
    deployment_from_args,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "describe", help="parameters, KV bytes, and per-GPU memory under a plan",
        description="Describe a model: parameters, activated parameters, KV-cache bytes per "
        "token; with a plan and --hardware, weight bytes per GPU and the KV tokens that fit.",
    )
    add_model_arg(p)
    add_plan_args(p)
    add_hardware_arg(p, required=False)
    add_fields(p, ExecutionSpec, only=("kv_dtype", "mem_fraction"))
    add_config_arg(p)
    add_json_arg(p)
    p.set_defaults(run=run)


def attention_pattern(model: ModelConfig) -> dict[str, Any]:
    """Which layers are MoE and how each layer attends: ``attention_layers`` counts layers by
    type (``full``, ``sliding``, ``chunked``), ``attention_chunk`` is Llama-4's chunk,
    ``nope_layers`` its layers without RoPE, ``sparse_attention`` DSA's indexer (None for
    dense attention)."""
    a = model.attention
    counts: dict[str, int] = {}
    for kind in a.layer_types:
        counts[kind] = counts.get(kind, 0) + 1
    sparse = ({"index_n_heads": a.index_n_heads, "index_head_dim": a.index_head_dim,
               "index_topk": a.index_topk} if a.sparse else None)
    return {"moe_layer_indices": list(model.moe_layers), "attention_layers": counts,
            "attention_chunk": a.chunk_size, "sliding_window": a.sliding_window,
            "nope_layers": list(a.nope_layers), "sparse_attention": sparse}


def _attention_text(info: dict[str, Any]) -> str:
    """``MLA, DSA top-2048 (indexer 64 x 128)`` or ``GQA: 36 chunked (8192), 12 full``."""
    kinds = info["attention_layers"]
    parts = [f"{n} {kind}" + (f" ({info['attention_chunk']})" if kind == "chunked" else "")
             + (f" ({info['sliding_window']})" if kind == "sliding" else "")
             for kind, n in kinds.items()]
    text = f"{info['attention'].upper()}: {', '.join(parts)}"
    sparse = info["sparse_attention"]
    if sparse:
        text += (f"; DSA top-{sparse['index_topk']} (indexer {sparse['index_n_heads']} x "
                 f"{sparse['index_head_dim']})")
    return text


def describe(args: argparse.Namespace) -> dict[str, Any]:
    model = load_model(args.model)
    counts = accounting.param_counts(model)
    out: dict[str, Any] = {
        "model": model.name,
        "family": model.family,
        "total_params": counts.total,
        "activated_params_per_token": counts.activated_per_token,
        "params_by_component": {
            "attention": counts.attention, "dense_mlp": counts.dense_mlp,
            "routed_experts": counts.routed_experts, "shared_experts": counts.shared_experts,
            "router": counts.router, "norms": counts.norms, "embedding": counts.embedding,
            "lm_head": counts.lm_head,
        },
        "layers": model.num_layers,
        "moe_layers": len(model.moe_layers),
        "dense_layers": len(model.dense_layers),
        "experts": model.moe.num_experts,
        "top_k": model.moe.top_k,
        "shared_experts": model.moe.num_shared_experts,
        "attention": model.attention.kind,
        **attention_pattern(model),
        "weight_dtype": model.weight_dtype,
        "expert_weight_dtype": model.expert_weight_dtype,
        "kv_bytes_per_token": {
            dt: accounting.kv_bytes_per_token(model, dt) for dt in KV_DTYPES
        },
        "kv_window_bytes_per_sequence": {
            dt: accounting.kv_window_bytes_per_sequence(model, dt) for dt in KV_DTYPES
        },
    }
    wants_plan = any(getattr(args, k) is not None for k in ("dp", "tp", "ep")) or args.hardware
    if not wants_plan:
        return out
    budget = None
    if args.hardware:  # a deployment: its plan and budget as every command resolves them
        resolved = resolve_deployment(deployment_from_args(args))
        profile, plan, budget = resolved.profile, resolved.plan, resolved.budget
    else:  # the model under a plan alone, on 8 GPUs a node
        profile = None
        plan = make_plan(model, nodes=args.nodes or 1, gpus_per_node=args.gpus_per_node or 8,
                         dp=args.dp, tp=args.tp, ep=args.ep, kv_dtype=args.kv_dtype,
                         mem_fraction=args.mem_fraction,
                         redundant_experts=args.redundant_experts)
    weights = accounting.weight_bytes_per_rank(model, plan)
    out["plan"] = {"nodes": plan.nodes, "gpus_per_node": plan.gpus_per_node,
                   "world_size": plan.world_size, "dp": plan.dp, "tp": plan.tp, "ep": plan.ep,
                   "experts_per_rank": plan.slots_per_gpu(model),
                   "redundant_experts": plan.redundant_experts,
                   "expert_slots": plan.expert_slots(model),
                   "slots_per_gpu": plan.slots_per_gpu(model),
                   "kv_dtype": plan.kv_dtype}
    per_rank: dict[str, Any] = {
        "weight_bytes": weights["total"],
        "weight_bytes_by_component": {k: v for k, v in weights.items() if k != "total"},
        "kv_bytes_per_token": accounting.kv_bytes_per_token(model, plan.kv_dtype, plan.tp),
    }
    if profile is not None and budget is not None:
        per_rank.update({
            "hardware": profile.name, "provenance": profile.provenance(),
            "hbm_bytes": profile.hbm_bytes,
            "usable_bytes": budget.usable_bytes,
            "activation_reserve_bytes": budget.activation_reserve_bytes,
            "kv_bytes": budget.kv_bytes,
            "kv_capacity_tokens": budget.kv_capacity_tokens,
            "kv_capacity_tokens_by_dtype": {
                dt: accounting.memory_budget(model, plan.with_(kv_dtype=dt),
                                             profile.hbm_bytes).kv_capacity_tokens
                for dt in KV_DTYPES
            },
        })
    out["per_rank"] = per_rank
    return out


def _slots_text(plan: dict[str, Any]) -> str:
    """``32 experts/GPU``, or with replicas ``4 slots/GPU: 256 experts + 32 redundant``."""
    if not plan["redundant_experts"]:
        return f"{plan['experts_per_rank']} experts/GPU"
    return (f"{plan['slots_per_gpu']} slots/GPU: {plan['expert_slots'] - plan['redundant_experts']}"
            f" experts + {plan['redundant_experts']} redundant")


def run(args: argparse.Namespace) -> int:
    info = describe(args)
    if args.json:
        emit_json(info)
        return 0
    kv = info["kv_bytes_per_token"]
    rows = [
        ("family", f"{info['family']} ({info['attention'].upper()} attention)"),
        ("total parameters", human_count(info["total_params"])),
        ("activated / token", human_count(info["activated_params_per_token"])),
        ("layers", f"{info['layers']} ({info['moe_layers']} MoE, {info['dense_layers']} dense)"),
        ("attention", _attention_text(info)),
        ("experts", f"{info['experts']} routed, top-{info['top_k']}, "
                    f"{info['shared_experts']} shared"),
        ("weights", f"{info['weight_dtype']} (experts {info['expert_weight_dtype']})"),
        ("KV bytes / token", f"fp8 {kv['fp8']:.0f}, bf16 {kv['bf16']:.0f}"),
    ]
    if info["kv_window_bytes_per_sequence"]["fp8"]:
        win = info["kv_window_bytes_per_sequence"]
        rows.append(("KV window / seq", f"fp8 {human_bytes(win['fp8'])}, "
                                        f"bf16 {human_bytes(win['bf16'])} "
                                        "(sliding/chunked layers)"))
    print_table(rows, title=f"{info['model']}")
    if "plan" in info:
        plan, pr = info["plan"], info["per_rank"]
        rows = [
            ("plan", f"{plan['nodes']} node(s) x {plan['gpus_per_node']} GPUs: dp {plan['dp']}, "
                     f"tp {plan['tp']}, ep {plan['ep']} ({_slots_text(plan)})"),
            ("weights / GPU", human_bytes(pr["weight_bytes"])),
        ]
        for name, value in pr["weight_bytes_by_component"].items():
            if value:
                rows.append((f"  {name}", human_bytes(value)))
        if "kv_capacity_tokens" in pr:
            caps = pr["kv_capacity_tokens_by_dtype"]
            rows += [
                ("HBM / GPU", f"{human_bytes(pr['hbm_bytes'])} on {pr['hardware']}, "
                              f"{human_bytes(pr['usable_bytes'])} usable"),
                ("activations", human_bytes(pr["activation_reserve_bytes"])),
                ("KV cache / GPU", human_bytes(pr["kv_bytes"])),
                ("KV tokens / GPU", f"{caps['fp8']:,} (fp8), {caps['bf16']:,} (bf16)"),
            ]
        print_table(rows)
    return 0
