"""One deployment under one benchmark, simulated: what ``predict`` and ``sweep`` run.

    Scenario       one deployment + one benchmark (model, hardware, plan options, workload)
    side           co-located serving has one side (every node prefills and decodes);
                   disaggregated serving (``disagg=(P, D)``) has a prefill side of P nodes that
                   ships each prompt's KV cache over the NIC to a decode side of D nodes
    run_scenario   simulate it -> vLLM-style metrics (``epsim.sim.serving.metrics``) plus the deployment echoed
    StepCache      step-time models shared between runs, keyed by everything a step depends on,
                   so a sweep over concurrencies simulates each (batch, context) grid point once

A :class:`StepCache` has an owner, never a module: whoever creates it (one ``sweep``, ``tune`` or
``plan`` call, or ``run_scenario`` itself when given none) keeps it, and it is freed with them.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from epsim.model import accounting
from epsim.model.config import ModelConfig, load_model
from epsim.model.errors import EpsimError
from epsim.model.loads import read_loads
from epsim.model.mtp import DEFAULT_ACCEPTANCE, expected_tokens
from epsim.model.plan import DEFAULT_MEM_FRACTION, ParallelPlan, make_plan, with_implied_fusions
from epsim.sim.hardware import a2a
from epsim.sim.hardware.profile import HardwareProfile, load_profile
from epsim.sim.serving.config import ServingConfig
from epsim.sim.serving.instances import aggregate, instance_metrics
from epsim.sim.serving.metrics import (
    DEFAULT_PERCENTILE_METRICS,
    DEFAULT_PERCENTILES,
)
from epsim.sim.serving.presets import (
    EngineContext,
    EngineOverrides,
    EngineSettings,
    dbo_needs_ep,
    default_engine,
    engine_dbo_default,
    engine_settings,
)
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

#: builds the step-time model of one side of a deployment (tests pass analytic ones)
StepModelFactory = Callable[[ModelConfig, ParallelPlan, HardwareProfile, "Scenario"], StepTimeModel]


@dataclass(frozen=True)
class Scenario:
    """One deployment under one benchmark.

    model / hardware: shipped names or paths. Example: ``"deepseek-r1"`` / ``"mi300x"``.
    nodes / gpus_per_node / dp / tp / ep: the plan (``make_plan`` fills what is ``None``); with
        ``disagg`` they describe the decode side.
    dbo / eplb / graph / kv_dtype: execution options (DBO = two microbatches).
    loads: a load-statistics file for the step simulator's routing (``None``: synthetic).
    disagg: ``(prefill_nodes, decode_nodes)`` or ``None`` (prefill co-located).
    chunked_prefill_size / dp_balance / mem_fraction: scheduling and memory options
        (``chunked_prefill_size`` ``None``: the engine's, 8192 per rank without one).
    workload: the benchmark (``WorkloadSpec``).
    percentiles / percentile_metrics: what ``compute_metrics`` reports.
    step_mode: the step simulator's mode.
    kernels: the hardware profile's kernel set (``None``: its default; ``"none"``: the roofline
        alone); the fusions the set implies join both sides' plans. Example: ``"aiter"``.
    a2a_mode: how EP dispatch/combine run across nodes (``sim/hardware/a2a.py``): ``"auto"`` (each
        step's phase decides, as SGLang's ``--deepep-mode auto``), ``"low_latency"`` or
        ``"normal"``.
    redundant_experts: replica slots per MoE layer on both sides' plans (``ep`` must divide
        experts + R; the replicas are chosen by the balancer from ``loads``). Example: 32.
    mtp / mtp_acceptance: MTP speculative decoding: draft tokens per decode step (0: off; both
        sides' plans run the draft module) and each draft's acceptance probability.
    engine: an engine preset (``"vllm"``, ``"sglang"``, ``"split"``, or epsim's own
        ``"prefill_first"``: ``sim/serving/presets.py``) or ``None``: the hardware vendor's
        engine (``presets.default_engine``: vLLM on AMD, SGLang on NVIDIA); ``dbo`` ``None``
        takes the engine's default (off in vLLM and SGLang).
    max_num_seqs / max_num_batched_tokens / cuda_graph_max_bs / host_ms_per_step /
        host_overlap: explicit values in place of the engine's (``None``: the engine's;
        ``host_overlap=False``: the host's work adds to each step, as vLLM without async
        scheduling or SGLang with ``--disable-overlap-schedule`` run).
    goodput: vLLM's ``--goodput`` SLOs, ``(("ttft", ms), ...)`` (``metrics.goodput_slos``);
        with any, the result has ``request_goodput``.
    instance_nodes: each side (prefill and decode under ``disagg``, else ``nodes``) cut into
        independent instances of this many nodes, each running the side's plan over its own
        GPUs, behind ``router`` (``sim/serving/router.py``); ``None``: one instance per side.
        Example: 1 (``disagg=(2, 3)``: 2 prefill and 3 decode instances of one node).
    prefill_tp / prefill_dp / prefill_ep: the prefill side's plan under ``disagg`` (``None``:
        the decode side's tp and EP choice over a prefill instance's GPUs).
    """

    model: str
    hardware: str
    workload: WorkloadSpec
    nodes: int | None = None
    gpus_per_node: int | None = None
    dp: int | None = None
    tp: int | None = None
    ep: int | None = None
    dbo: bool | None = None
    eplb: bool = True
    graph: bool = True
    kv_dtype: str = "fp8"
    loads: str | None = None
    disagg: tuple[int, int] | None = None
    chunked_prefill_size: int | None = None
    dp_balance: str = "round_robin"
    mem_fraction: float = DEFAULT_MEM_FRACTION
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    percentile_metrics: tuple[str, ...] = DEFAULT_PERCENTILE_METRICS
    step_mode: str = "fast"
    kernels: str | None = None
    a2a_mode: str = "auto"
    redundant_experts: int = 0
    mtp: int = 0
    mtp_acceptance: float = DEFAULT_ACCEPTANCE
    engine: str | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    cuda_graph_max_bs: int | None = None
    host_ms_per_step: float | None = None
    host_overlap: bool | None = None
    goodput: tuple[tuple[str, float], ...] = ()
    instance_nodes: int | None = None
    router: str = "round_robin"
    prefill_tp: int | None = None
    prefill_dp: int | None = None
    prefill_ep: int | None = None

    @property
    def use_dbo(self) -> bool:
        """DBO as run: ``dbo``, or the engine's default when it is ``None``."""
        return engine_dbo_default(self.engine) if self.dbo is None else self.dbo

    def with_(self, **changes: Any) -> Scenario:
        return replace(self, **changes)


def parse_disagg(text: str) -> tuple[int, int]:
    """``"1:2"`` -> ``(1, 2)``: prefill nodes, decode nodes (each at least 1)."""
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text or "")
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise EpsimError(f"--disagg must be P:D with positive node counts (e.g. 1:1), got {text!r}")
    return int(m.group(1)), int(m.group(2))


# --------------------------------------------------------------------------------------------
# The sides' plans
# --------------------------------------------------------------------------------------------


def _plan_options(sc: Scenario) -> dict[str, Any]:
    """What both sides' plans take from the scenario's execution options."""
    return dict(microbatches=2 if sc.use_dbo else 1, kv_dtype=sc.kv_dtype, graph_mode=sc.graph,
                mem_fraction=sc.mem_fraction, redundant_experts=sc.redundant_experts,
                mtp=sc.mtp)


def scenario_profile(sc: Scenario) -> HardwareProfile:
    """The scenario's hardware with its kernel set selected."""
    return load_profile(sc.hardware, kernels=sc.kernels, a2a_mode=sc.a2a_mode)


def _decode_plan(model: ModelConfig, sc: Scenario, nodes: int, gpn: int,
                 profile: HardwareProfile) -> ParallelPlan:
    """The decode (or co-located) side: the scenario's own dp/tp/ep."""
    plan = make_plan(model, nodes=nodes, gpus_per_node=gpn, dp=sc.dp, tp=sc.tp, ep=sc.ep,
                     **_plan_options(sc))
    return with_implied_fusions(dbo_needs_ep(plan, asked=sc.dbo is True), model,
                                profile.plan_options)



def _prefill_plan(model: ModelConfig, sc: Scenario, nodes: int, gpn: int,
                  profile: HardwareProfile) -> ParallelPlan:
    """The prefill side: ``prefill_tp/dp/ep`` where given, else the decode side's tp and
    EP/TP-MoE choice over its own GPUs."""
    world = nodes * gpn
    tp = sc.prefill_tp if sc.prefill_tp is not None else (
        None if sc.prefill_dp is not None else sc.tp or 1)
    if tp is not None and world % tp:
        raise EpsimError(f"tp {tp} does not divide the prefill side's {world} GPUs")
    ep = sc.prefill_ep
    if ep is None:
        groups = world // tp if tp is not None else sc.prefill_dp
        ep = world if (sc.ep is None and groups > 1) or (sc.ep or 0) > 1 else 1
    plan = make_plan(model, nodes=nodes, gpus_per_node=gpn, dp=sc.prefill_dp, tp=tp, ep=ep,
                     **_plan_options(sc))
    return with_implied_fusions(plan, model, profile.plan_options)


def _node_split(sc: Scenario) -> tuple[int, int]:
    """(prefill nodes, decode nodes); co-located serving has no prefill side (0)."""
    if not sc.disagg:
        return 0, sc.nodes or 1
    p_nodes, d_nodes = sc.disagg
    if sc.nodes is not None and sc.nodes != p_nodes + d_nodes:
        raise EpsimError(f"--disagg {p_nodes}:{d_nodes} needs {p_nodes + d_nodes} nodes but "
                         f"--nodes is {sc.nodes}")
    return p_nodes, d_nodes


@dataclass(frozen=True)
class Layout:
    """How a scenario's nodes are cut: per side, the nodes of one instance and how many
    instances (``prefill_instances`` 0 when co-located)."""

    prefill_nodes: int
    prefill_instances: int
    decode_nodes: int
    decode_instances: int


def scenario_layout(sc: Scenario) -> Layout:
    """The sides' instances: ``instance_nodes`` must divide each side's nodes; the
    ``prefill_*`` plan needs ``disagg``."""
    p_nodes, d_nodes = _node_split(sc)
    if not sc.disagg and (sc.prefill_tp, sc.prefill_dp, sc.prefill_ep) != (None,) * 3:
        raise EpsimError("--prefill-tp, --prefill-dp and --prefill-ep need --disagg P:D")
    k = sc.instance_nodes
    if k is None:
        return Layout(p_nodes, 1 if p_nodes else 0, d_nodes, 1)
    if k < 1:
        raise EpsimError(f"--instance-nodes must be at least 1, got {k}")
    sides = (("prefill", p_nodes), ("decode", d_nodes)) if sc.disagg else (("", d_nodes),)
    for name, n in sides:
        if n % k:
            where = f"the {n} {name} nodes of --disagg" if name else f"--nodes {n}"
            raise EpsimError(f"--instance-nodes {k} does not divide {where}")
    return Layout(k if p_nodes else 0, p_nodes // k, k, d_nodes // k)


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
        key = (model.name, plan, profile.fingerprint, sc.eplb, sc.loads, sc.step_mode,
               sc.workload.seed)
        if key not in self.models:
            self.models[key] = (self.factory(model, plan, profile, sc) if self.factory is not None
                                else self._simulated(model, plan, profile, sc))
        return self.models[key]

    def _simulated(self, model: ModelConfig, plan: ParallelPlan, profile: HardwareProfile,
                   sc: Scenario) -> StepTimeModel:
        """The step simulator behind the (batch, context) memo, sharing this cache's memo."""
        return SimulatedStepTime(model, plan, profile,
                                 loads=read_loads(sc.loads) if sc.loads else None,
                                 eplb=sc.eplb, mode=sc.step_mode, seed=sc.workload.seed,
                                 memo=self.memo)


# --------------------------------------------------------------------------------------------
# Running a scenario
# --------------------------------------------------------------------------------------------


def _with_prefill_side(config: ServingConfig, model: ModelConfig, profile: HardwareProfile,
                       sc: Scenario, nodes: tuple[int, int], instance_nodes: int, gpn: int
                       ) -> tuple[ServingConfig, ParallelPlan, dict[str, Any]]:
    """Disaggregated serving: the decode side's ``config`` with the prefill side added (each
    prefill instance of ``instance_nodes`` nodes), the prefill side's plan, and the keys that
    echo it in the result."""
    p_nodes, d_nodes = nodes
    pplan = _prefill_plan(model, sc, instance_nodes, gpn, profile)
    pbudget = accounting.memory_budget(model, pplan, profile.hbm_bytes)
    per_token = accounting.kv_bytes_per_token(model, sc.kv_dtype, pplan.tp,
                                              accounting.draft_kv_layers(pplan))
    config = replace(config, prefill_dp=pplan.dp,
                     prefill_kv_capacity_tokens=pbudget.kv_capacity_tokens,
                     kv_transfer_s_per_token=per_token / profile.nic_bandwidth_per_gpu)
    isl = sc.workload.isl
    echo = {"prefill_nodes": p_nodes, "decode_nodes": d_nodes, "prefill_dp": pplan.dp,
            "prefill_tp": pplan.tp, "prefill_ep": pplan.ep,
            "kv_transfer_ms_per_request": per_token / profile.nic_bandwidth_per_gpu
            * float(isl or 0) * 1e3 if isl else None}
    return config, pplan, echo


def _deployment_echo(sc: Scenario, model: ModelConfig, profile: HardwareProfile,
                     plan: ParallelPlan, nodes: tuple[int, int], gpn: int) -> dict[str, Any]:
    """The deployment as the result reports it (before the disaggregation keys)."""
    total = sum(nodes)
    return {"model": model.name, "hardware": profile.name, "provenance": profile.provenance(),
            "nodes": total, "gpus_per_node": gpn, "gpus": total * gpn,
            "dp": plan.dp, "tp": plan.tp, "ep": plan.ep,
            "dbo": plan.microbatches == 2, "eplb": sc.eplb, "graph": sc.graph, "kv_dtype": sc.kv_dtype,
            "disagg": f"{nodes[0]}:{nodes[1]}" if sc.disagg else None,
            "kernels": profile.kernel_set, "a2a_mode": profile.a2a_mode,
            "shared_expert_in_moe": plan.fusion.shared_expert_in_moe,
            "redundant_experts": plan.redundant_experts,
            "slots_per_gpu": plan.slots_per_gpu(model),
            "mtp": plan.mtp, "mtp_acceptance": sc.mtp_acceptance,
            "tokens_per_request_step": expected_tokens(plan.mtp, sc.mtp_acceptance)}


def _benchmark_echo(sc: Scenario, kv_capacity_tokens: int, settings: EngineSettings
                    ) -> dict[str, Any]:
    """The benchmark as the result reports it, with the engine's settings."""
    w = sc.workload
    return {"dataset": w.dataset, "isl": w.isl, "osl": w.osl,
            "max_concurrency": w.max_concurrency,
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


def scenario_engine(sc: Scenario, model: ModelConfig, profile: HardwareProfile,
                    plan: ParallelPlan, kv_capacity_tokens: int) -> EngineSettings:
    """The engine's settings for this deployment, the scenario's explicit values in place."""
    deployment = EngineContext(hbm_bytes=profile.hbm_bytes, dp=plan.dp, tp=plan.tp,
                            kv_capacity_tokens=kv_capacity_tokens,
                            context_len=model.max_position_embeddings)
    overrides = EngineOverrides(
        max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.max_num_batched_tokens,
        chunked_prefill_size=sc.chunked_prefill_size, cuda_graph_max_bs=sc.cuda_graph_max_bs,
        dbo=sc.dbo, host_ms_per_step=sc.host_ms_per_step if sc.host_ms_per_step is not None
        else _fitted_host_ms(profile), host_overlap=sc.host_overlap)
    settings = engine_settings(sc.engine or default_engine(profile.vendor), deployment,
                               overrides)
    # an engine's DBO default needs EP (dbo_needs_ep refused an explicit --dbo)
    return settings if plan.expert_parallel else replace(settings, dbo=False)


def _fitted_host_ms(profile: HardwareProfile) -> float | None:
    """A profile fitted to measured runs may carry the engine's host time on that stack."""
    return profile.efficiency.host_ms_per_step if profile.efficiency is not None else None


def engine_step_time(cache: StepCache, model: ModelConfig, plan: ParallelPlan,
                     profile: HardwareProfile, sc: Scenario, settings: EngineSettings
                     ) -> EngineStepTime:
    """One side's step costs: each (graph, DBO) variant of ``plan`` a cached step model (a
    variant no step meets is never simulated), run under the engine's step policy."""
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

    return EngineStepTime(variant, settings.step_policy(sc.graph))


def check_scenario(sc: Scenario) -> None:
    """What can be refused before any simulation: an unknown model or profile, a plan that does
    not fit the GPUs or the model (either side), or a benchmark whose requests can exceed the
    model's context (searches and sweeps check every point first)."""
    model = load_model(sc.model)
    check_context(sc.workload, model)
    profile = scenario_profile(sc)
    gpn = sc.gpus_per_node or profile.gpus_per_node
    lay = scenario_layout(sc)
    plan = _decode_plan(model, sc, lay.decode_nodes, gpn, profile)
    # the engine's caps must agree (e.g. vLLM's max_num_batched_tokens >= max_num_seqs); the
    # KV capacity only sizes SGLang's default running cap, so any stands in here
    scenario_engine(sc, model, profile, plan, 1 << 20)
    if lay.prefill_instances:
        _prefill_plan(model, sc, lay.prefill_nodes, gpn, profile)


def run_scenario(sc: Scenario, cache: StepCache | None = None, *,
                 run_out: list[ServingRun] | None = None,
                 requests: Requests | None = None, details: bool = False,
                 progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Simulate one deployment under one benchmark -> metrics plus the deployment echoed.

    Steps: load the model and profile; build the decode (and prefill) plans; size the KV cache
    per rank from the memory accounting; sample the requests; run the serving loop; compute the
    metrics; record the simulation's own wall time as ``sim_wall_s``. ``run_out`` (a list)
    receives the :class:`ServingRun` itself; ``details``: it keeps every step and every
    request's gaps (the serving trace, vLLM's per-request lists; ``simulate_serving``);
    ``progress(finished, total)``: the requests finished so far, about every 1/200 of them.
    ``requests``: these requests in place of sampling ``sc.workload`` (a measured benchmark
    replayed: ``epsim.sim.workload.bench_results``); each must fit the model's context.
    """
    t0 = time.perf_counter()
    measured = (sc.percentiles, sc.percentile_metrics, sc.goodput)
    cache = cache or StepCache()
    model = load_model(sc.model)
    profile = scenario_profile(sc)
    gpn = sc.gpus_per_node or profile.gpus_per_node
    nodes = _node_split(sc)
    lay = scenario_layout(sc)
    plan = _decode_plan(model, sc, lay.decode_nodes, gpn, profile)
    budget = accounting.memory_budget(model, plan, profile.hbm_bytes)
    settings = scenario_engine(sc, model, profile, plan, budget.kv_capacity_tokens)
    step_models = [engine_step_time(cache, model, plan, profile, sc, settings)]
    config = ServingConfig(dp=plan.dp, kv_capacity_tokens=budget.kv_capacity_tokens,
                           chunked_prefill_size=settings.chunked_prefill_size,
                           dp_balance=sc.dp_balance, scheduler=settings.scheduler,
                           max_running_per_rank=settings.max_running_per_rank,
                           max_batched_tokens=settings.max_batched_tokens,
                           mixed_chunk=settings.mixed_chunk, mtp=plan.mtp,
                           mtp_acceptance=sc.mtp_acceptance, seed=sc.workload.seed,
                           instances=lay.decode_instances,
                           prefill_instances=max(1, lay.prefill_instances), router=sc.router)
    disagg_echo: dict[str, Any] = {}
    pplan = None
    if sc.disagg:
        config, pplan, disagg_echo = _with_prefill_side(config, model, profile, sc, nodes,
                                                        lay.prefill_nodes, gpn)
        step_models.append(engine_step_time(cache, model, pplan, profile, sc, settings))
    if requests is not None:
        check_requests_context(requests, model)

    def simulate(req: Requests, steady: bool) -> ServingRun:  # steady: gaps, no rank counts
        return simulate_serving(req, config, *step_models, details=details or steady,
            rank_counts=details, max_concurrency=sc.workload.max_concurrency, progress=progress)

    # sampling refuses requests beyond the context; steady: sized for its window
    run, metrics = measured_run(sc.workload, plan.dp * lay.decode_instances, requests,
                                lambda w: sample_requests(w, model), simulate, measured)
    requests = run.requests
    if run_out is not None:
        run_out.append(run)
    instances = None
    if sc.instance_nodes is not None:
        instances = _instance_entries(run, metrics, sc, lay, {"prefill": pplan}, plan, gpn)
        metrics = aggregate(metrics, instances)
    out = {**_deployment_echo(sc, model, profile, plan, nodes, gpn), **disagg_echo,
           **_benchmark_echo(sc, budget.kv_capacity_tokens, settings),
           **_trace_echo(sc.workload, requests), **metrics}
    if instances is not None:
        out.update(instance_nodes=sc.instance_nodes, router=sc.router,
                   num_instances=lay.prefill_instances + lay.decode_instances,
                   prefill_instances=lay.prefill_instances,
                   decode_instances=lay.decode_instances, instances=instances)
    out["sim_wall_s"] = time.perf_counter() - t0
    return out


def _instance_entries(run: ServingRun, metrics: dict[str, Any], sc: Scenario, lay: Layout,
                      plans: dict[str, ParallelPlan | None], plan: ParallelPlan, gpn: int
                      ) -> list[dict[str, Any]]:
    """Each instance's figures (``sim/serving/instances.py``) with its nodes and plan."""
    entries = instance_metrics(run, metrics["duration"], sc.percentiles, sc.percentile_metrics)
    out = []
    for e in entries:
        p = plans.get(e["role"]) or plan
        nodes = lay.prefill_nodes if e["role"] == "prefill" else lay.decode_nodes
        out.append({"role": e.pop("role"), "index": e.pop("index"), "nodes": nodes,
                    "gpus": nodes * gpn, "plan": {"dp": p.dp, "tp": p.tp, "ep": p.ep}, **e})
    return out
