"""A deployment resolved once: what every command that simulates reads.

    resolve_deployment(deployment) -> ResolvedDeployment
        model, profile     the model config and the hardware profile (its kernel set selected)
        layout             how the nodes are cut (:class:`Layout`: per side, instance nodes and
                           count)
        plan / prefill     the decode (or co-located) side's plan, and the prefill side's under
                           disaggregation (``None`` otherwise)
        budget             one decode rank's memory budget (weights, activations, KV capacity;
                           ``None`` on a check, which does not size the KV cache)
        engine             the engine's name, its preset applied and the scenario's explicit
                           values in place (``EngineSettings``), including the step policy
        dbo                whether a step runs two microbatches, decided here and nowhere else

This module is the one place where the engine and DBO are decided:

* the engine: ``--engine``, else the hardware vendor's (``presets.default_engine``);
* DBO: ``--dbo on|off``, else the engine preset's default, else off; an explicit ``--dbo on``
  on a plan without EP is refused (:data:`DBO_NEEDS_EP`), a preset's default simply does
  not apply there.

``step`` and ``describe`` resolve the same deployment without a benchmark; a check before any
simulation (``check_scenario``) passes ``kv_capacity_tokens`` and leaves the budget out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from epsim.model import accounting
from epsim.model.config import ModelConfig, load_model
from epsim.model.errors import EpsimError
from epsim.model.plan import ParallelPlan, make_plan, with_implied_fusions
from epsim.sim.hardware.profile import HardwareProfile, load_profile
from epsim.sim.serving.presets import (
    EngineContext,
    EngineOverrides,
    EngineSettings,
    default_engine,
    engine_preset,
)

from .spec import Deployment

#: vLLM's DBO and SGLang's TBO split the batch of a DP-attention + EP deployment around its
#: dispatch and combine (vLLM: ``--enable-dbo`` with an all2all backend; SGLang:
#: ``--enable-two-batch-overlap`` with ``--moe-a2a-backend deepep``); neither runs on TP-only MoE
DBO_NEEDS_EP = ("--dbo needs an expert-parallel plan (ep > 1): vLLM's DBO and SGLang's TBO "
                "overlap the EP dispatch and combine; a TP-only plan runs one microbatch")


@dataclass(frozen=True)
class Layout:
    """How a deployment's nodes are cut: per side, the nodes of one instance and how many
    instances (``prefill_instances`` 0 when co-located)."""

    prefill_nodes: int
    prefill_instances: int
    decode_nodes: int
    decode_instances: int

    @property
    def nodes(self) -> tuple[int, int]:
        """(prefill nodes, decode nodes) in all; co-located serving has no prefill side (0)."""
        return (self.prefill_nodes * self.prefill_instances,
                self.decode_nodes * self.decode_instances)


@dataclass(frozen=True)
class ResolvedDeployment:
    """A deployment with every default applied and every decision taken (module docstring)."""

    spec: Deployment
    model: ModelConfig
    profile: HardwareProfile
    gpus_per_node: int
    layout: Layout
    plan: ParallelPlan
    prefill: ParallelPlan | None
    budget: accounting.MemoryBudget | None
    engine: EngineSettings

    @property
    def dbo(self) -> bool:
        return self.plan.microbatches == 2


def deployment_profile(d: Deployment) -> HardwareProfile:
    """The deployment's hardware with its kernel set and exchange mode selected."""
    return load_profile(d.hardware, kernels=d.execution.kernels, a2a_mode=d.execution.a2a_mode)


def decide_dbo(asked: bool | None, engine: str, plan: ParallelPlan) -> bool:
    """Two microbatches or one: ``asked`` (the ``--dbo`` flag), else ``engine``'s preset
    default; never without EP (an explicit ``--dbo on`` there is refused)."""
    dbo = engine_preset(engine).dbo_default if asked is None else asked
    if dbo and not plan.expert_parallel:
        if asked:
            raise EpsimError(DBO_NEEDS_EP)
        return False
    return dbo


def _split(d: Deployment) -> tuple[int, int]:
    """(prefill nodes, decode nodes); co-located serving has no prefill side (0)."""
    inst = d.instances
    if not inst.disagg:
        return 0, d.plan.nodes or 1
    p_nodes, d_nodes = inst.disagg
    if d.plan.nodes is not None and d.plan.nodes != p_nodes + d_nodes:
        raise EpsimError(f"--disagg {p_nodes}:{d_nodes} needs {p_nodes + d_nodes} nodes but "
                         f"--nodes is {d.plan.nodes}")
    return p_nodes, d_nodes


def deployment_layout(d: Deployment) -> Layout:
    """The sides' instances: ``instance_nodes`` must divide each side's nodes; the
    ``prefill_*`` plan needs ``disagg``."""
    inst = d.instances
    p_nodes, d_nodes = _split(d)
    if not inst.disagg and (inst.prefill_tp, inst.prefill_dp, inst.prefill_ep) != (None,) * 3:
        raise EpsimError("--prefill-tp, --prefill-dp and --prefill-ep need --disagg P:D")
    k = inst.instance_nodes
    if k is None:
        return Layout(p_nodes, 1 if p_nodes else 0, d_nodes, 1)
    if k < 1:
        raise EpsimError(f"--instance-nodes must be at least 1, got {k}")
    sides = (("prefill", p_nodes), ("decode", d_nodes)) if inst.disagg else (("", d_nodes),)
    for name, n in sides:
        if n % k:
            where = f"the {n} {name} nodes of --disagg" if name else f"--nodes {n}"
            raise EpsimError(f"--instance-nodes {k} does not divide {where}")
    return Layout(k if p_nodes else 0, p_nodes // k, k, d_nodes // k)


def _plan_options(d: Deployment, dbo: bool) -> dict[str, Any]:
    """What both sides' plans take from the execution options."""
    x = d.execution
    return dict(microbatches=2 if dbo else 1, kv_dtype=x.kv_dtype, graph_mode=x.graph,
                mem_fraction=x.mem_fraction, redundant_experts=d.plan.redundant_experts,
                mtp=x.mtp)


def _decode_plan(model: ModelConfig, d: Deployment, nodes: int, gpn: int,
                 profile: HardwareProfile, engine: str) -> ParallelPlan:
    """The decode (or co-located) side: the deployment's own dp/tp/ep, DBO decided on it."""
    p = d.plan
    single = make_plan(model, nodes=nodes, gpus_per_node=gpn, dp=p.dp, tp=p.tp, ep=p.ep,
                       **_plan_options(d, False))
    dbo = decide_dbo(d.execution.dbo, engine, single)
    plan = single.with_(microbatches=2) if dbo else single
    return with_implied_fusions(plan, model, profile.plan_options)


def _prefill_plan(model: ModelConfig, d: Deployment, nodes: int, gpn: int,
                  profile: HardwareProfile, dbo: bool) -> ParallelPlan:
    """The prefill side: ``prefill_tp/dp/ep`` where given, else the decode side's tp and
    EP/TP-MoE choice over its own GPUs."""
    inst, p = d.instances, d.plan
    world = nodes * gpn
    tp = inst.prefill_tp if inst.prefill_tp is not None else (
        None if inst.prefill_dp is not None else p.tp or 1)
    if tp is not None and world % tp:
        raise EpsimError(f"tp {tp} does not divide the prefill side's {world} GPUs")
    ep = inst.prefill_ep
    if ep is None:
        groups = world // tp if tp is not None else inst.prefill_dp
        ep = world if (p.ep is None and groups > 1) or (p.ep or 0) > 1 else 1
    plan = make_plan(model, nodes=nodes, gpus_per_node=gpn, dp=inst.prefill_dp, tp=tp, ep=ep,
                     **_plan_options(d, dbo))
    return with_implied_fusions(plan, model, profile.plan_options)


def _engine_settings(d: Deployment, engine: str, model: ModelConfig,
                     profile: HardwareProfile, plan: ParallelPlan, kv_capacity_tokens: int
                     ) -> EngineSettings:
    """The engine's settings for this deployment, the explicit values in place and DBO as
    decided on the plan."""
    e = d.engine
    context = EngineContext(hbm_bytes=profile.hbm_bytes, dp=plan.dp, tp=plan.tp,
                            kv_capacity_tokens=kv_capacity_tokens,
                            context_len=model.max_position_embeddings)
    fitted = profile.efficiency.host_ms_per_step if profile.efficiency is not None else None
    overrides = EngineOverrides(
        max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
        chunked_prefill_size=e.chunked_prefill_size, cuda_graph_max_bs=e.cuda_graph_max_bs,
        dbo=d.execution.dbo,
        host_ms_per_step=e.host_ms_per_step if e.host_ms_per_step is not None else fitted,
        host_overlap=e.host_overlap)
    settings = engine_preset(engine).settings(context, overrides)
    dbo = plan.microbatches == 2
    return settings if settings.dbo == dbo else replace(settings, dbo=dbo)


def resolve_deployment(d: Deployment, *, kv_capacity_tokens: int | None = None
                       ) -> ResolvedDeployment:
    """Every default applied, every decision taken (the module docstring); refuses, in one
    line, an unknown model or profile or a plan that does not fit the GPUs or the model.
    ``kv_capacity_tokens``: size the engine's caps for this KV capacity and leave the memory
    budget out (``None``; a check before any simulation)."""
    model = load_model(d.model)
    profile = deployment_profile(d)
    gpn = d.plan.gpus_per_node or profile.gpus_per_node
    layout = deployment_layout(d)
    engine = d.engine.engine or default_engine(profile.vendor)
    plan = _decode_plan(model, d, layout.decode_nodes, gpn, profile, engine)
    budget = None
    if kv_capacity_tokens is None:  # a check does not size the KV cache (nor refuse on it)
        budget = accounting.memory_budget(model, plan, profile.hbm_bytes)
        kv_capacity_tokens = budget.kv_capacity_tokens
    settings = _engine_settings(d, engine, model, profile, plan, kv_capacity_tokens)
    prefill = (_prefill_plan(model, d, layout.prefill_nodes, gpn, profile,
                             plan.microbatches == 2) if layout.prefill_instances else None)
    return ResolvedDeployment(d, model, profile, gpn, layout, plan, prefill, budget, settings)

