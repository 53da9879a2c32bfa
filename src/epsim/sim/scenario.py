"""One deployment under one benchmark, simulated: what ``predict`` and ``sweep`` run.

    run_scenario   simulate a :class:`~epsim.sim.spec.Scenario` (its deployment resolved once by
                   ``epsim.sim.deployment``) -> vLLM-style metrics
                   (``epsim.sim.serving.metrics``) plus the deployment echoed
    side           co-located serving has one side (every node prefills and decodes);
                   disaggregated serving (``disagg=(P, D)``) has a prefill side of P nodes that
                   ships each prompt's KV cache over the NIC to a decode side of D nodes
    StepCache      step-time models shared between runs, keyed by everything a step depends on,
                   so a sweep over concurrencies simulates each (batch, context) grid point once

A :class:`StepCache` has an owner, never a module: whoever creates it (one ``sweep``, ``tune`` or
``plan`` call, or ``run_scenario`` itself when given none) keeps it, and it is freed with them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from epsim.model import accounting
from epsim.model.config import ModelConfig, load_model
from epsim.model.loads import read_loads
from epsim.model.mtp import expected_tokens
from epsim.model.plan import ParallelPlan
from epsim.sim.hardware import a2a
from epsim.sim.hardware.profile import HardwareProfile
from epsim.sim.serving.config import ServingConfig
from epsim.sim.serving.instances import aggregate, instance_metrics
from epsim.sim.serving.presets import EngineSettings
from epsim.sim.serving.simulate import ServingRun, simulate_serving

# the serving side's one door to the step simulator (StepMemo: what its models share)
from epsim.sim.serving.step_time import EngineStepTime, SimulatedStepTime, StepMemo, StepTimeModel
from epsim.sim.serving.window import measured_run
from epsim.sim.workload.spec import (
    Requests,
    WorkloadSpec,
    check_context,
    check_requests_context,
    sample_requests,
)
from epsim.sim.workload.traces import offered_rate

from .deployment import ResolvedDeployment, resolve_deployment
from .spec import Scenario

#: builds the step-time model of one side of a deployment (tests pass analytic ones)
StepModelFactory = Callable[[ModelConfig, ParallelPlan, HardwareProfile, "Scenario"], StepTimeModel]


# --------------------------------------------------------------------------------------------
# The step-time cache
# --------------------------------------------------------------------------------------------


@dataclass
class StepCache:
    """Step-time models shared between runs, keyed by what a step depends on.

    factory: builds one side's step-time model (tests pass analytic ones); None: the step
        simulator behind the (batch, context) memo, every model sharing ``memo``.
    models: ``(model name, plan, profile fingerprint, eplb, loads, step mode, seed) -> model``.
    memo: the step simulator's kept values (``epsim.sim.step.StepMemo``: compiled steps,
        routing samples, op costs), owned here and passed to every simulated model.

    Unbounded on purpose: one entry per distinct plan a search visits (a few dozen at most), each
    worth many step simulations; its owner (see the module docstring) decides its lifetime.
    """

    factory: StepModelFactory | None = None
    models: dict[tuple[Any, ...], StepTimeModel] = field(default_factory=dict)
    memo: StepMemo = field(default_factory=StepMemo)

    def get(self, model: ModelConfig, plan: ParallelPlan, profile: HardwareProfile,
            sc: Scenario) -> StepTimeModel:
        x = sc.deployment.execution
        key = (model.name, plan, profile.fingerprint, x.eplb, x.loads, sc.simulation.step_mode,
               sc.workload.seed)
        if key not in self.models:
            self.models[key] = (self.factory(model, plan, profile, sc) if self.factory is not None
                                else self._simulated(model, plan, profile, sc))
        return self.models[key]

    def _simulated(self, model: ModelConfig, plan: ParallelPlan, profile: HardwareProfile,
                   sc: Scenario) -> StepTimeModel:
        """The step simulator behind the (batch, context) memo, sharing this cache's memo."""
        x = sc.deployment.execution
        return SimulatedStepTime(model, plan, profile,
                                 loads=read_loads(x.loads) if x.loads else None,
                                 eplb=x.eplb, mode=sc.simulation.step_mode,
                                 seed=sc.workload.seed, memo=self.memo)


# --------------------------------------------------------------------------------------------
# Running a scenario
# --------------------------------------------------------------------------------------------


def _with_prefill_side(config: ServingConfig, r: ResolvedDeployment, sc: Scenario
                       ) -> tuple[ServingConfig, dict[str, Any]]:
    """Disaggregated serving: the decode side's ``config`` with the prefill side added (each
    prefill instance of ``r.layout.prefill_nodes`` nodes), and the keys that echo it."""
    p_nodes, d_nodes = r.layout.nodes
    pplan, profile = r.prefill, r.profile
    pbudget = accounting.memory_budget(r.model, pplan, profile.hbm_bytes)
    per_token = accounting.kv_bytes_per_token(r.model, sc.deployment.execution.kv_dtype, pplan.tp,
                                              accounting.draft_kv_layers(pplan))
    config = replace(config, prefill_dp=pplan.dp,
                     prefill_kv_capacity_tokens=pbudget.kv_capacity_tokens,
                     kv_transfer_s_per_token=per_token / profile.nic_bandwidth_per_gpu)
    isl = sc.workload.isl
    echo = {"prefill_nodes": p_nodes, "decode_nodes": d_nodes, "prefill_dp": pplan.dp,
            "prefill_tp": pplan.tp, "prefill_ep": pplan.ep,
            "kv_transfer_ms_per_request": per_token / profile.nic_bandwidth_per_gpu
            * float(isl or 0) * 1e3 if isl else None}
    return config, echo


def _deployment_echo(r: ResolvedDeployment) -> dict[str, Any]:
    """The deployment as the result reports it (before the disaggregation keys)."""
    d, plan, profile, gpn = r.spec, r.plan, r.profile, r.gpus_per_node
    x = d.execution
    nodes = r.layout.nodes
    total = sum(nodes)
    return {"model": r.model.name, "hardware": profile.name, "provenance": profile.provenance(),
            "nodes": total, "gpus_per_node": gpn, "gpus": total * gpn,
            "dp": plan.dp, "tp": plan.tp, "ep": plan.ep,
            "dbo": r.dbo, "eplb": x.eplb, "graph": x.graph, "kv_dtype": x.kv_dtype,
            "disagg": f"{nodes[0]}:{nodes[1]}" if d.instances.disagg else None,
            "kernels": profile.kernel_set, "a2a_mode": profile.a2a_mode,
            "shared_expert_in_moe": plan.fusion.shared_expert_in_moe,
            "redundant_experts": plan.redundant_experts,
            "slots_per_gpu": plan.slots_per_gpu(r.model),
            "mtp": plan.mtp, "mtp_acceptance": x.mtp_acceptance,
            "tokens_per_request_step": expected_tokens(plan.mtp, x.mtp_acceptance)}


def _benchmark_echo(sc: Scenario, kv_capacity_tokens: int, settings: EngineSettings
                    ) -> dict[str, Any]:
    """The benchmark as the result reports it, with the engine's settings."""
    w = sc.workload
    return {"dataset": w.dataset, "isl": w.isl, "osl": w.osl,
            "max_concurrency": w.concurrency,
            "request_rate": "trace" if w.kind.replays
            else "inf" if math.isinf(w.request_rate) else w.request_rate,
            "seed": w.seed, "bench_client": w.bench_client, **settings.echo(),
            "kv_capacity_tokens_per_rank": kv_capacity_tokens}


def _trace_echo(w: WorkloadSpec, requests: Requests) -> dict[str, Any]:
    """A replayed trace: which, how stretched and scaled, its arrival rate (req/s); else {}."""
    if not w.kind.replays:
        return {}
    return {"dataset_path": w.dataset_path, "time_scale": w.time_scale,
            "prefill_scale": w.prefill_scale, "decode_scale": w.decode_scale,
            "trace_arrival_rate": offered_rate(requests.issue_times_s)}


def engine_step_time(cache: StepCache, r: ResolvedDeployment, plan: ParallelPlan,
                     sc: Scenario) -> EngineStepTime:
    """One side's step costs: each (graph, DBO) variant of ``plan`` a cached step model (a
    variant no step meets is never simulated), run under the engine's step policy."""
    model, profile = r.model, r.profile
    spans = a2a.spans_nodes(np.arange(plan.world_size) // plan.gpus_per_node)
    mixed = profile.with_a2a_mode(a2a.with_prefill_choice(profile.a2a_mode, spans))

    chosen: dict[tuple[bool, bool, bool], StepTimeModel] = {}

    def variant(graph: bool, dbo: bool, with_prefill: bool = False) -> StepTimeModel:
        # asked once per costed part of every step: the plan's hash and replace are not free
        key = (graph, dbo, with_prefill)
        found = chosen.get(key)
        if found is None:
            found = chosen[key] = cache.get(
                model, plan.with_(graph_mode=graph, microbatches=2 if dbo else 1),
                mixed if with_prefill else profile, sc)
        return found

    return EngineStepTime(variant, r.engine.step_policy(sc.deployment.execution.graph))


def check_scenario(sc: Scenario) -> None:
    """What can be refused before any simulation: an unknown model or profile, a plan that does
    not fit the GPUs or the model (either side), or a benchmark whose requests can exceed the
    model's context (searches and sweeps check every point first)."""
    check_context(sc.workload, load_model(sc.model))
    # the engine's caps must agree (e.g. vLLM's max_num_batched_tokens >= max_num_seqs); the
    # KV capacity only sizes SGLang's default running cap, so any stands in here
    resolve_deployment(sc.deployment, kv_capacity_tokens=1 << 20)


def _serving_config(r: ResolvedDeployment, sc: Scenario) -> ServingConfig:
    """The serving loop's parameters for the decode (or co-located) side."""
    s, lay = r.engine, r.layout
    return ServingConfig(dp=r.plan.dp, kv_capacity_tokens=r.budget.kv_capacity_tokens,
                         chunked_prefill_size=s.chunked_prefill_size,
                         dp_balance=sc.deployment.execution.dp_balance, scheduler=s.scheduler,
                         max_running_per_rank=s.max_running_per_rank,
                         max_batched_tokens=s.max_batched_tokens,
                         mixed_chunk=s.mixed_chunk, mtp=r.plan.mtp,
                         mtp_acceptance=sc.deployment.execution.mtp_acceptance,
                         seed=sc.workload.seed, instances=lay.decode_instances,
                         prefill_instances=max(1, lay.prefill_instances),
                         router=sc.deployment.instances.router)


def run_scenario(sc: Scenario, cache: StepCache | None = None, *,
                 run_out: list[ServingRun] | None = None,
                 requests: Requests | None = None, details: bool = False,
                 progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Simulate one deployment under one benchmark -> metrics plus the deployment echoed.

    Steps: resolve the deployment (model, profile, plans, memory budget, engine and DBO:
    ``epsim.sim.deployment``); sample the requests; run the serving loop; compute the
    metrics; record the simulation's own wall time as ``sim_wall_s``. ``run_out`` (a list)
    receives the :class:`ServingRun` itself; ``details``: it keeps every step and every
    request's gaps (the serving trace, vLLM's per-request lists; ``simulate_serving``);
    ``progress(finished, total)``: the requests finished so far, about every 1/200 of them.
    ``requests``: these requests in place of sampling ``sc.workload`` (a measured benchmark
    replayed: ``epsim.sim.workload.bench_results``); each must fit the model's context.
    """
    t0 = time.perf_counter()
    m = sc.measurement
    measured = (m.percentiles, m.percentile_metrics, m.goodput)
    cache = cache or StepCache()
    r = resolve_deployment(sc.deployment)
    step_models = [engine_step_time(cache, r, r.plan, sc)]
    config = _serving_config(r, sc)
    disagg_echo: dict[str, Any] = {}
    if r.prefill is not None:
        config, disagg_echo = _with_prefill_side(config, r, sc)
        step_models.append(engine_step_time(cache, r, r.prefill, sc))
    if requests is not None:
        check_requests_context(requests, r.model)

    def simulate(req: Requests, steady: bool) -> ServingRun:  # steady: gaps, no rank counts
        return simulate_serving(req, config, *step_models, details=details or steady,
            rank_counts=details, concurrency=sc.workload.concurrency, progress=progress)

    lay = r.layout
    # sampling refuses requests beyond the context; steady: sized for its window
    run, metrics = measured_run(sc.workload, r.plan.dp * lay.decode_instances, requests,
                                lambda w: sample_requests(w, r.model), simulate, measured)
    requests = run.requests
    if run_out is not None:
        run_out.append(run)
    inst = sc.deployment.instances
    instances = None
    if inst.instance_nodes is not None:
        instances = _instance_entries(run, metrics, sc, r)
        metrics = aggregate(metrics, instances)
    out = {**_deployment_echo(r), **disagg_echo,
           **_benchmark_echo(sc, r.budget.kv_capacity_tokens, r.engine),
           **_trace_echo(sc.workload, requests), **metrics}
    if instances is not None:
        out.update(instance_nodes=inst.instance_nodes, router=inst.router,
                   num_instances=lay.prefill_instances + lay.decode_instances,
                   prefill_instances=lay.prefill_instances,
                   decode_instances=lay.decode_instances, instances=instances)
    out["sim_wall_s"] = time.perf_counter() - t0
    return out


def _instance_entries(run: ServingRun, metrics: dict[str, Any], sc: Scenario,
                      r: ResolvedDeployment) -> list[dict[str, Any]]:
    """Each instance's figures (``sim/serving/instances.py``) with its nodes and plan."""
    m, lay, gpn = sc.measurement, r.layout, r.gpus_per_node
    entries = instance_metrics(run, metrics["duration"], m.percentiles, m.percentile_metrics)
    out = []
    for e in entries:
        p = (r.prefill if e["role"] == "prefill" else None) or r.plan
        nodes = lay.prefill_nodes if e["role"] == "prefill" else lay.decode_nodes
        out.append({"role": e.pop("role"), "index": e.pop("index"), "nodes": nodes,
                    "gpus": nodes * gpn, "plan": {"dp": p.dp, "tp": p.tp, "ep": p.ep}, **e})
    return out
