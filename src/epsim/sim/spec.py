"""What a user asks for: one deployment under one benchmark, as nested data (and as a file).

    Scenario           what ``predict`` and ``sweep`` run, what ``tune`` and ``plan`` vary
      deployment       what is deployed (:class:`Deployment`)
        model, hardware    shipped names or paths
        plan           how the GPUs are split (:class:`PlanSpec`: nodes, dp, tp, ep, ...)
        engine         the serving engine and the values that override its preset
                       (:class:`EngineSpec`)
        execution      how each step runs: DBO, EPLB, graphs, KV dtype, kernels, MTP, ...
                       (:class:`ExecutionSpec`)
        instances      disaggregation, instances behind a router, the prefill side's plan
                       (:class:`InstanceSpec`)
      workload         what the benchmark client sends (``epsim.sim.workload.WorkloadSpec``)
      measurement      which percentiles and SLOs the metrics report (:class:`MeasurementSpec`)
      simulation       how the simulator itself runs (:class:`SimulationSpec`)

Every field of the groups carries its command-line flag and help text in its metadata
(``epsim.model.fields.option``), so the command line is generated from these classes (``epsim/options.py``) and a
deployment file (``--config FILE``) uses the same names. Each field has one *flat name* (the
field's own name, unique over all groups: ``dp``, ``engine``, ``dbo``, ...); :meth:`Scenario.of`
builds a scenario from flat names and :meth:`Scenario.with_` changes them, so a search varies
``dbo`` or ``dp`` without knowing which group holds it.

Nothing here decides anything: which engine runs and whether DBO is on are resolved once, from
these values, by ``epsim.sim.deployment.resolve_deployment``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field, replace
from typing import Any

from epsim.model.errors import EpsimError
from epsim.model.fields import option
from epsim.model.mtp import DEFAULT_ACCEPTANCE
from epsim.model.plan import DEFAULT_MEM_FRACTION
from epsim.sim.serving.metrics import DEFAULT_PERCENTILE_METRICS, DEFAULT_PERCENTILES
from epsim.sim.workload.spec import WorkloadSpec

# --------------------------------------------------------------------------------------------
# The deployment
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanSpec:
    """How the GPUs are split (``epsim.model.plan.make_plan`` fills what is ``None``); under
    ``disagg`` this is the decode side."""

    nodes: int | None = option(None, "--nodes", "nodes (default 1; P + D under --disagg)",
                               swept="search")
    gpus_per_node: int | None = option(
        None, "--gpus-per-node", "GPUs per node (default: the hardware profile's, else 8)")
    dp: int | None = option(None, "--dp", "data-parallel attention groups")
    tp: int | None = option(None, "--tp", "tensor-parallel degree")
    ep: int | None = option(None, "--ep", "expert-parallel degree: 1 or the world size "
                                          "(default: world if dp > 1)")
    redundant_experts: int = option(
        0, "--redundant-experts", "replica slots per MoE layer for the hottest experts "
        "(balanced from the loads): experts + R slots, ep must divide them (default 0)",
        aliases=("--redundant",), metavar="R")


@dataclass(frozen=True)
class EngineSpec:
    """The serving engine (``None``: the hardware vendor's) and explicit values in place of its
    preset's (``None``: the preset's; ``sim/serving/presets.py``)."""

    engine: str | None = option(
        None, "--engine", "schedule as this engine does, with its defaults: vllm (V1: decode "
        "first, prompt chunks in the same step), sglang (prefill first, reservation and "
        "retraction), split (separate prefill and decode queues), prefill_first (epsim's own: "
        "prefill first, no caps, no host time); default: the hardware vendor's engine, vllm on "
        "AMD and sglang on NVIDIA")
    max_num_seqs: int | None = option(
        None, "--max-num-seqs", "requests one dp rank runs at most (vLLM max_num_seqs; SGLang "
        "max_running_requests / dp)", metavar="N", swept="search")
    max_num_batched_tokens: int | None = option(
        None, "--max-num-batched-tokens", "tokens in one rank's step at most (vLLM's budget, "
        "decodes included; SGLang's max_prefill_tokens)", metavar="T")
    chunked_prefill_size: int | None = option(
        None, "--chunked-prefill-size", "prompt tokens one rank prefills per step (default: the "
        "engine's; 8192 under --engine prefill_first)", swept="search")
    cuda_graph_max_bs: int | None = option(
        None, "--cuda-graph-max-bs", "the largest decode batch per rank a captured graph "
        "replays; larger steps run eagerly", metavar="B")
    host_ms_per_step: float | None = option(
        None, "--host-ms-per-step", "pin the engine's host time per step to a flat value "
        "(scheduling, inputs, sampling, output processing); default: the engine's host model, "
        "by requests per rank (docs/serving.md); 0 under prefill_first", metavar="MS")
    host_overlap: bool | None = option(
        None, "--no-host-overlap", "the host's work adds to each step instead of overlapping "
        "the GPU (vLLM before async scheduling became its default, or --no-async-scheduling; "
        "SGLang --disable-overlap-schedule)", switch=False)


@dataclass(frozen=True)
class ExecutionSpec:
    """How each step runs."""

    dbo: bool | None = option(
        None, "--dbo", "two microbatches (dual-batch overlap): on or off (--dbo alone: on; "
        "--no-dbo: off); default: the engine's, on only under --engine split; tune and plan "
        "try a comma list (default on,off)", aliases=("--no-dbo",), metavar="on|off",
        swept="search")
    eplb: bool = option(True, "--no-eplb", "contiguous expert placement", switch=False)
    graph: bool = option(True, "--graph", "graph replay: on or off (--graph alone: on; "
                         "--no-graph: eager launches); tune and plan try a comma list (default "
                         "on)", aliases=("--no-graph",), metavar="on|off", swept="search")
    kv_dtype: str = option("fp8", "--kv-dtype", "KV-cache dtype", swept="sweep")
    loads: str | None = option(
        None, "--loads", "expert load statistics in SGLang's expert-distribution format: a "
        "simulation routes by them (default: synthetic skewed loads), balance and run place "
        "the experts from them; balance takes several (a comma list, or a dump's windows) as "
        "snapshots, each weighed the same: a shipped name ({loads}) or a file "
        '{{"logical_count": [layers][experts]}} (.json, or .pt with torch)', metavar="NAME|FILE")
    kernels: str | None = option(
        None, "--kernels", "the hardware profile's kernel set: measured kernel tables of one "
        "library (e.g. aiter, no-aiter on mi300x; default: the profile's own default set; none: "
        "the roofline alone); the fusions the set implies join the plan", metavar="SET")
    a2a_mode: str = option(
        "auto", "--a2a-mode", "how EP dispatch/combine run: low_latency (pure RDMA per target "
        "GPU, kernels that free the compute units: no interference), normal (node-then-GPU: one "
        "NIC crossing per destination node, forwarded over the node's fabric; occupies compute "
        "units); auto (default): across nodes as SGLang's --deepep-mode auto (low_latency for "
        "decode, normal for a step with any prefill), normal within one node (epsim's "
        "assumption; SGLang would pick low_latency there)")
    mtp: int = option(0, "--mtp", "MTP speculative decoding: draft tokens per decode step, "
                      "verified by the next step (1 + N query tokens per sequence) and proposed "
                      "by the model's MTP draft module run N times (default 0: off)",
                      metavar="N", swept="search")
    mtp_acceptance: float = option(
        DEFAULT_ACCEPTANCE, "--mtp-acceptance", "probability that a draft token is accepted "
        "given the one before it was", metavar="P")
    mem_fraction: float = option(DEFAULT_MEM_FRACTION, "--mem-fraction",
                                 "share of HBM for weights + activations + KV")
    dp_balance: str = option("round_robin", "--dp-balance",
                             "how requests are spread over dp ranks")


@dataclass(frozen=True)
class InstanceSpec:
    """Disaggregation, instances behind a router, and the prefill side's own plan."""

    disagg: tuple[int, int] | None = option(
        None, "--disagg", "prefill on P nodes, decode on D nodes (KV shipped over the NIC)",
        metavar="P:D")
    instance_nodes: int | None = option(
        None, "--instance-nodes", "cut each side (prefill and decode under --disagg P:D, else "
        "--nodes) into independent instances of K nodes, each running the plan over its own "
        "GPUs, behind a router (K must divide each side's nodes; default: one instance per "
        "side)", metavar="K")
    router: str = option("round_robin", "--router", "how requests are spread over the "
                         "instances: round_robin or least_loaded (fewest outstanding requests; "
                         "Vidur's global schedulers)")
    prefill_tp: int | None = option(None, "--prefill-tp", "--disagg: the prefill side's tp "
                                    "(default: the decode side's tp and EP choice over a "
                                    "prefill instance's GPUs)")
    prefill_dp: int | None = option(None, "--prefill-dp", "--disagg: the prefill side's dp "
                                    "(default: the decode side's tp and EP choice over a "
                                    "prefill instance's GPUs)")
    prefill_ep: int | None = option(None, "--prefill-ep", "--disagg: the prefill side's ep "
                                    "(default: the decode side's tp and EP choice over a "
                                    "prefill instance's GPUs)")


@dataclass(frozen=True)
class Deployment:
    """What is deployed: the model on the hardware, split by the plan, served by the engine,
    each step run as the execution options say, cut into instances."""

    model: str = option("", "--model", "shipped model name (e.g. deepseek-r1) or path to a "
                        "config.json", metavar="M")
    hardware: str = option("", "--hardware", "hardware profile name or path (e.g. mi300x)",
                           metavar="H", swept="sweep")
    plan: PlanSpec = field(default_factory=PlanSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    execution: ExecutionSpec = field(default_factory=ExecutionSpec)
    instances: InstanceSpec = field(default_factory=InstanceSpec)


# --------------------------------------------------------------------------------------------
# Measurement and simulation
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeasurementSpec:
    """What the metrics report (``epsim.sim.serving.metrics``): percentiles of which metrics,
    and vLLM's ``--goodput`` SLOs, ``(("ttft", ms), ...)`` (with any, ``request_goodput``)."""

    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    percentile_metrics: tuple[str, ...] = DEFAULT_PERCENTILE_METRICS
    goodput: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class SimulationSpec:
    """How the simulator runs: the step executor's mode (``epsim.sim.step.MODES``)."""

    step_mode: str = "fast"


#: the groups of a deployment, by the attribute that holds each
DEPLOYMENT_GROUPS: dict[str, type] = {"plan": PlanSpec, "engine": EngineSpec,
                                      "execution": ExecutionSpec, "instances": InstanceSpec}
#: the groups of a scenario besides the deployment and the workload
SCENARIO_GROUPS: dict[str, type] = {"measurement": MeasurementSpec,
                                    "simulation": SimulationSpec}


def _flat_index() -> dict[str, tuple[str, ...]]:
    """flat name -> path of attributes from the scenario (``dp`` -> deployment.plan.dp)."""
    index: dict[str, tuple[str, ...]] = {"model": ("deployment", "model"),
                                         "hardware": ("deployment", "hardware"),
                                         "workload": ("workload",)}
    paths = [(f.name, ("deployment", group, f.name)) for group, cls in DEPLOYMENT_GROUPS.items()
             for f in dataclasses.fields(cls)]
    paths += [(f.name, (group, f.name)) for group, cls in SCENARIO_GROUPS.items()
              for f in dataclasses.fields(cls)]
    for name, path in paths:
        if name in index:  # one word, one meaning: a flat name names one field
            raise AssertionError(f"field {name!r} is in two groups")
        index[name] = path
    return index


#: every field's flat name -> where it sits (names are unique over all groups)
FLAT_NAMES: dict[str, tuple[str, ...]] = _flat_index()


def _replace_path(obj: Any, path: tuple[str, ...], value: Any) -> Any:
    if len(path) == 1:
        return replace(obj, **{path[0]: value})
    return replace(obj, **{path[0]: _replace_path(getattr(obj, path[0]), path[1:], value)})


@dataclass(frozen=True)
class Scenario:
    """One deployment under one benchmark (the module docstring maps its groups)."""

    deployment: Deployment
    workload: WorkloadSpec
    measurement: MeasurementSpec = field(default_factory=MeasurementSpec)
    simulation: SimulationSpec = field(default_factory=SimulationSpec)

    @classmethod
    def of(cls, *, model: str, hardware: str, workload: WorkloadSpec, **flat: Any) -> Scenario:
        """A scenario from flat names, every other field at its default. Example:
        ``Scenario.of(model="deepseek-r1", hardware="mi300x", workload=w, dp=8, ep=8)``."""
        return cls(Deployment(model=model, hardware=hardware), workload).with_(**flat)

    def with_(self, **changes: Any) -> Scenario:
        """This scenario with fields changed by flat name (``dbo=True``, ``dp=4``)."""
        out = self
        for name, value in changes.items():
            path = FLAT_NAMES.get(name)
            if path is None:
                raise EpsimError(f"a scenario has no field {name!r}")
            out = _replace_path(out, path, value)
        return out

    def flat(self) -> dict[str, Any]:
        """Every field by flat name (the inverse of :meth:`of`)."""
        out: dict[str, Any] = {}
        for name, path in FLAT_NAMES.items():
            value: Any = self
            for attr in path:
                value = getattr(value, attr)
            out[name] = value
        return out

    # the few fields every layer reads, by their plain names
    @property
    def model(self) -> str:
        return self.deployment.model

    @property
    def hardware(self) -> str:
        return self.deployment.hardware


def parse_disagg(text: str) -> tuple[int, int]:
    """``"1:2"`` -> ``(1, 2)``: prefill nodes, decode nodes (each at least 1)."""
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text or "")
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise EpsimError(f"--disagg must be P:D with positive node counts (e.g. 1:1), got {text!r}")
    return int(m.group(1)), int(m.group(2))
