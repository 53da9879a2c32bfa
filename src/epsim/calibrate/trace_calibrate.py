"""``epsim calibrate --from-trace``: a profiler trace's kernel time per op kind, beside the
simulator's, and the per-kind factors fitted from it.

``map_trace`` needs no simulation: the kernels in scope (``kineto.kernels_under``), each named
to an op kind by ``kernel_names.FAMILIES`` or listed as unmapped with its time. ``simulate_kinds``
times the same deployment's layers in the simulator (the first ``layers`` MoE layers of rank
``rank``: per op kind the sum of the ops' durations, collectives start to end).
``fit_profile`` turns measured / simulated into ``efficiency.op_time_scale`` of a profile whose
source entry says where the factors came from.
"""

from __future__ import annotations

import copy
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from epsim.model.errors import EpsimError
from epsim.model.opgraph import Batch
from epsim.sim.hardware.profile import HardwareProfile

from . import plausible
from .kernel_names import FAMILIES, KernelFamily, classify, short_name
from .kineto import GpuKernel, KinetoTrace, Span, kernels_under

#: op kinds whose factor a trace may fit: compute kinds, timed by ``sim.step.cost.roofline.calibrated`` (a
#: collective's trace time includes waiting for its peers, and its profile figures are link
#: rates, not per-kind factors)
FITTABLE = frozenset({"gemm", "grouped_gemm", "attention_decode", "attention_prefill", "norm",
                      "rope", "router", "elementwise", "embedding", "lm_head", "sample"})
#: the fit's fixed-point rounds at most (each one simulation) and the relative gap between
#: measured and refitted time per kind at which it stops
FIT_ROUNDS = 10
FIT_TOLERANCE = 1e-4


@dataclass(frozen=True)
class TraceMapping:
    """The kernels in scope, mapped.

    kernel_us: their total time; mapped_us: the part some family names; mapped_fraction:
    mapped_us / kernel_us. kinds: ``{kind: {"us", "count", "families": {family: us}}}``.
    unmapped: ``[{"name", "us", "count"}]``, longest first. annotations: ``{name: {"count",
    "kernel_us", "mapped_us"}}``. copy_us: memcpy/memset time in scope (not kernels: apart).
    """

    kernel_us: float
    mapped_us: float
    kinds: dict[str, dict[str, Any]]
    unmapped: list[dict[str, Any]]
    annotations: dict[str, dict[str, Any]]
    kernels: int
    copy_us: float = 0.0
    families: dict[str, KernelFamily] = field(default_factory=dict, repr=False)

    @property
    def mapped_fraction(self) -> float:
        return self.mapped_us / self.kernel_us if self.kernel_us > 0 else 0.0

    def kind_us(self) -> dict[str, float]:
        return {kind: row["us"] for kind, row in self.kinds.items()}

    def to_json(self) -> dict[str, Any]:
        return {"kernels": self.kernels, "kernel_us": self.kernel_us,
                "mapped_us": self.mapped_us, "mapped_fraction": self.mapped_fraction,
                "copy_us": self.copy_us, "kinds": self.kinds, "unmapped": self.unmapped,
                "annotations": self.annotations}


def map_kernels(pairs: Sequence[tuple[GpuKernel, str]], copies: Sequence[tuple[GpuKernel, str]]
                = (), families: Sequence[KernelFamily] = FAMILIES) -> TraceMapping:
    """Map ``(kernel, annotation)`` pairs to op kinds (first matching family; else unmapped)."""
    kinds: dict[str, dict[str, Any]] = {}
    unmapped_us: Counter[str] = Counter()
    unmapped_n: Counter[str] = Counter()
    notes: dict[str, dict[str, Any]] = defaultdict(lambda: {"count": 0, "kernel_us": 0.0,
                                                            "mapped_us": 0.0})
    cache: dict[str, KernelFamily | None] = {}
    seen: dict[str, KernelFamily] = {}
    total = mapped = 0.0
    for k, note in pairs:
        if k.name not in cache:
            cache[k.name] = classify(k.name, families)
        fam = cache[k.name]
        total += k.dur_us
        notes[note]["count"] += 1
        notes[note]["kernel_us"] += k.dur_us
        if fam is None:
            unmapped_us[short_name(k.name)] += k.dur_us
            unmapped_n[short_name(k.name)] += 1
            continue
        seen[fam.name] = fam
        mapped += k.dur_us
        notes[note]["mapped_us"] += k.dur_us
        row = kinds.setdefault(fam.kind, {"us": 0.0, "count": 0, "families": {}})
        row["us"] += k.dur_us
        row["count"] += 1
        row["families"][fam.name] = row["families"].get(fam.name, 0.0) + k.dur_us
    unmapped = [{"name": n, "us": us, "count": unmapped_n[n]}
                for n, us in sorted(unmapped_us.items(), key=lambda kv: (-kv[1], kv[0]))]
    return TraceMapping(total, mapped, dict(sorted(kinds.items(), key=lambda kv: -kv[1]["us"])),
                        unmapped, dict(notes), len(pairs),
                        copy_us=sum(k.dur_us for k, _ in copies), families=seen)


def map_trace(trace: KinetoTrace, spans: Sequence[Span]) -> TraceMapping:
    """:func:`map_kernels` over the kernels launched under ``spans`` (every kernel: empty)."""
    return map_kernels(kernels_under(trace, spans),
                       kernels_under(trace, spans, trace.copies))


def layers_in(spans: Sequence[Span]) -> int:
    """Layers a scope covers: how often its most frequent annotation occurs (DualPipe opens
    ``attn(F)`` once per layer), 1 without annotations."""
    counts = Counter(s.name for s in spans)
    return max(counts.values()) if counts else 1


# --------------------------------------------------------------------------------------------
# The simulator's side
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TracedStep:
    """The traced step as the simulator runs it for the comparison (a deployment at one batch,
    context and layer scope, on one rank), and where each figure came from."""

    model: str
    hardware: str
    kernels: str | None
    nodes: int
    gpus_per_node: int | None
    dp: int
    ep: int
    tp: int | None
    batch: int
    context: int
    layers: int
    rank: int
    kv_dtype: str = "bf16"
    origin: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "hardware": self.hardware, "kernels": self.kernels,
                "nodes": self.nodes, "dp": self.dp, "ep": self.ep, "tp": self.tp,
                "batch": self.batch, "context": self.context, "phase": "prefill",
                "layers": self.layers, "rank": self.rank, "microbatches": 1,
                "kv_dtype": self.kv_dtype,
                "routing": "uniform", "from": self.origin}


def simulate_kinds(dep: TracedStep, kernels: str | None = None,
                   profile: HardwareProfile | None = None) -> dict[str, float]:
    """``{kind: us}`` of ``dep.layers`` MoE layers of rank ``dep.rank`` in one prefill step of
    ``dep`` (one microbatch, uniform routing: the trace's balanced routing): each op's duration
    on the timeline (compute slowed by communication running alongside; collectives start to
    end). ``kernels`` overrides ``dep.kernels``; ``profile`` replaces ``dep.hardware``."""
    from epsim.model import load_model, make_plan
    from epsim.model.plan import with_implied_fusions
    from epsim.sim.hardware.profile import load_profile
    from epsim.sim.step.simulate import simulate_step

    model = load_model(dep.model)
    chosen = kernels if kernels is not None else dep.kernels
    profile = (load_profile(dep.hardware, kernels=chosen) if profile is None
               else profile.with_kernels(chosen))
    plan = make_plan(model, nodes=dep.nodes, gpus_per_node=dep.gpus_per_node or
                     profile.gpus_per_node, dp=dep.dp, tp=dep.tp, ep=dep.ep, microbatches=1,
                     kv_dtype=dep.kv_dtype)
    plan = with_implied_fusions(plan, model, profile.plan_options)
    result = simulate_step(model, plan, Batch("prefill", dep.batch, dep.context), profile,
                           synthetic="uniform", trace=True)
    rank = min(dep.rank, plan.world_size - 1)
    events = [e for e in result.events if e.rank == rank and e.stream != "host"]
    moe_layers = sorted({e.layer for e in events if e.kind == "grouped_gemm" and e.layer >= 0})
    picked = set(moe_layers[: dep.layers])
    out: dict[str, float] = defaultdict(float)
    for e in events:
        if e.layer in picked:
            out[e.kind] += e.dur_us
    return dict(out)


def compare(measured: Mapping[str, float], simulated: Mapping[str, float]
            ) -> dict[str, dict[str, float | None]]:
    """Per op kind ``{"measured_us", "simulated_us", "ratio"}`` (ratio: measured / simulated)."""
    rows: dict[str, dict[str, float | None]] = {}
    for kind in sorted(set(measured) | set(simulated),
                       key=lambda k: -max(measured.get(k, 0.0), simulated.get(k, 0.0))):
        m, s = measured.get(kind, 0.0), simulated.get(kind, 0.0)
        rows[kind] = {"measured_us": m, "simulated_us": s, "ratio": m / s if s > 0 else None}
    return rows


def fit_factors(measured: Mapping[str, float], simulated: Mapping[str, float],
                base: Mapping[str, float]) -> dict[str, float]:
    """``op_time_scale``: ``base[kind] * measured / simulated`` for every fittable kind both
    sides have (``simulated`` timed under ``base``; an op's roofline time is linear in it)."""
    return {kind: base.get(kind, 1.0) * measured[kind] / simulated[kind]
            for kind in sorted(measured) if kind in FITTABLE
            and measured[kind] > 0 and simulated.get(kind, 0.0) > 0}


def fit_trace(dep: TracedStep, measured: Mapping[str, float], raw: Mapping[str, Any],
              note: str, rounds: int = FIT_ROUNDS
              ) -> tuple[dict[str, Any], dict[str, float], list[dict[str, Any]]]:
    """Profile ``raw`` refitted to ``measured`` under the roofline (``--kernels none``, where
    ``op_time_scale`` acts): ``rounds`` rounds of :func:`_step_factors`, since an op's
    timeline duration also moves with the communication overlapping it. A factor outside the
    plausible range (``calibrate.plausible``) is refused: its kind keeps ``raw``'s value and
    drops out of the later rounds (its ``fitted`` is the first estimate outside the range). Returns the profile object, the roofline's ``{kind: us}``
    under it and the refusals (``[{"factor", "fitted", "range", "kept"}]``)."""
    from epsim.sim.hardware.profile import profile_from_dict

    base = dict(profile_from_dict(raw, "profile").require_efficiency().op_time_scale)
    obj, fitted, refused = copy.deepcopy(dict(raw)), False, []
    todo, last = dict(measured), {}
    for _ in range(rounds):
        profile = profile_from_dict(obj, "fitted profile")
        simulated = simulate_kinds(dep, kernels="none", profile=profile)
        factors = _step_factors(todo, simulated, dict(profile.require_efficiency().op_time_scale),
                                last)
        if not factors and not refused:
            raise EpsimError("no op kind both in the trace and in the simulated layers to fit")
        bad = plausible.refusals(factors, base)
        if bad:  # keep the sourced value; the kind drops out of the fit
            refused += bad
            for r in bad:
                todo.pop(r["factor"])
                factors.pop(r["factor"])
            if not factors:  # every fitted kind refused: the profile as it was
                obj = copy.deepcopy(dict(raw))
                return obj, simulate_kinds(dep, kernels="none",
                                           profile=profile_from_dict(obj)), refused
        # a round that refused a kind refits without it: the profile must not keep the
        # refused kind's earlier (in-range) estimate
        if fitted and not bad and all(abs(simulated[k] - todo[k]) <= FIT_TOLERANCE * todo[k]
                                      for k in factors):
            return obj, simulated, refused
        obj, fitted = fit_profile(raw, factors, note), True
    return obj, simulate_kinds(dep, kernels="none", profile=profile_from_dict(obj)), refused


def _step_factors(measured: Mapping[str, float], simulated: Mapping[str, float],
                  scale: Mapping[str, float], last: dict[str, tuple[float, float]]
                  ) -> dict[str, float]:
    """The next factors: :func:`fit_factors` (proportional) on a kind's first round, then the
    secant through its last two ``(factor, simulated)`` pairs (``last``, updated): an op's
    duration is a fixed part (launch gap, latency) plus the scaled roofline, so the proportional
    step alone creeps towards the factor where the fixed part dominates."""
    factors = fit_factors(measured, simulated, scale)
    for kind in factors:
        s, t = scale.get(kind, 1.0), simulated[kind]
        if kind in last and last[kind][0] != s and last[kind][1] != t:
            s0, t0 = last[kind]
            factors[kind] = s + (measured[kind] - t) * (s - s0) / (t - t0)
        last[kind] = (s, t)
    return factors


def fit_profile(raw: Mapping[str, Any], factors: Mapping[str, float], note: str
                ) -> dict[str, Any]:
    """Profile ``raw`` with ``efficiency.op_time_scale`` updated by ``factors`` and its source
    entry saying where they came from (``note``)."""
    obj = copy.deepcopy(dict(raw))
    eff = obj.setdefault("efficiency", {})
    scale = dict(eff.get("op_time_scale", {}))
    scale.update(factors)
    eff["op_time_scale"] = scale
    sources = obj.setdefault("sources", {})
    before = sources.get("efficiency.op_time_scale")
    sources["efficiency.op_time_scale"] = note + (f"; other kinds: {before}" if before else "")
    if not str(obj.get("name", "")).endswith("-trace-fit"):
        obj["name"] = f"{obj.get('name', 'profile')}-trace-fit"
    return obj
