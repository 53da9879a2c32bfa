"""One forward step of a deployment, simulated: ``simulate_step`` and its ``StepResult``.

What happens in a call:

1. the op graph of one rank (``epsim.model.graph.build_step_graph``) is compiled into a
   :class:`sim.step.executor.Program`: every op's cost-model time (:mod:`sim.step.cost`), the host's issue
   times (eager) or the graph-replay costs (captured), the collective groups
   (:mod:`sim.step.compile`). The program's structure is built once per plan and phase; a new
   batch is costed on it, and each compiled batch is memoised, so repeated calls (the serving
   simulator's) pay only for steps 2-4, and for step 4 alone once a batch's routing under a
   seed is known (its sample and routed times are memoised, :mod:`sim.step.routed`);
2. this step's routing is sampled (:mod:`sim.step.routing`): per MoE layer, microbatch and rank a
   multinomial over the load statistics, mapped to GPUs by the placement (balanced by
   ``epsim.model.eplb.default_placement``: balanced unless ``eplb=False``, then contiguous);
3. each rank's fused-MoE time follows its own experts' counts, and each dispatch/combine lasts as
   long as its busiest link (traffic matrix from the sampled routing);
4. the executor runs every rank (:mod:`sim.step.executor`): ``mode="exact"`` through simpy, ``"fast"`` the
   same semantics vectorised (they agree; a test checks it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from epsim.model.config import ModelConfig
from epsim.model.eplb import default_placement
from epsim.model.errors import EpsimError
from epsim.model.loads import LOAD_KINDS, synthetic_loads
from epsim.model.opgraph import OP_KINDS, Batch
from epsim.model.placement import Placement
from epsim.model.plan import ParallelPlan
from epsim.model.trace import TraceEvent
from epsim.sim.hardware.profile import HardwareProfile

from .compile import Compiled, compile_step
from .cost import timing
from .executor import CATEGORIES, Program, Timeline, run_exact, run_fast
from .kernels import inventory_json
from .memo import StepMemo, remember
from .routed import route_step
from .routing import placed_frequencies

MODES = ("fast", "exact")


@dataclass(frozen=True)
class StepResult:
    """A simulated step.

    step_s / step_ms: the step time (the last rank's end). Example: 0.0612 / 61.2.
    breakdown_ms: ``{category: ms}`` on the rank that finishes last: attention, moe_experts,
        dense, other (compute busy time, including comm interference), dispatch, combine,
        tp_comm (time its compute stream sat waiting for that collective, or, eager, for a host
        waiting on it: exposed communication, stragglers included), launch (waiting for the
        host to launch kernels, graph launch, the per-kernel GPU gap; on CPU ranks sharing
        cores, the slowest rank's lateness, ``efficiency.rank_skew_by_group_s``).
        The values sum to ``step_ms``.
    exposed_comm_ms: dispatch + combine + tp_comm of ``breakdown_ms``.
    comm_busy_ms: ``{category: ms}`` that rank's collectives were in flight (overlapped or not).
    overlapped_comm_ms: ``sum(comm_busy_ms) - exposed_comm_ms``, at least 0.
    compute_slowdown_ms: compute time added by comm kernels running alongside (inside the
        compute categories).
    expert_imbalance: mean over MoE layers and microbatches of the busiest GPU's routed pairs over
        the mean GPU's (1.0 without EP). Example: 1.04 balanced, 1.9 contiguous on real loads.
    expert_imbalance_max: the worst layer's.
    critical_rank: the rank that finished last.
    rank_ms: ``[ranks]`` each rank's end.
    mode / seed: as called.
    events: per-op trace events (``epsim.model.trace.TraceEvent``, op ids = the graph's) when
        ``trace=True``, else empty.
    op_kinds_ms: ``{op kind: ms}`` the critical rank's ops of each kind take by the cost model
        (kernel time: no per-kernel gap, no comm interference; collectives start to end).
        Example: ``{"grouped_gemm": 38.9, "attention_decode": 66.1, ...}``.
    kernels: the kernel set the profile had selected (``"none"``: the roofline alone).
    kernel_sources: with ``explain=True``, per op kind how its ops on the critical rank were
        timed (``epsim.sim.step.cost.timing.explain``), else None.
    kernel_inventory: with ``explain=True``, the kernels each op runs, the kernel floor and
        the host's per-kernel launch and dispatch (``sim.step.kernels.inventory_json``).
    draft_ms: the critical rank's MTP draft-module ops by the cost model (as ``op_kinds_ms``;
        0 without MTP).
    a2a_mode: the mode the EP dispatch/combine ran in (``epsim.sim.hardware.a2a``: ``"low_latency"``
        or ``"normal"``).
    """

    step_s: float
    breakdown_ms: dict[str, float]
    exposed_comm_ms: float
    comm_busy_ms: dict[str, float]
    overlapped_comm_ms: float
    compute_slowdown_ms: float
    expert_imbalance: float
    expert_imbalance_max: float
    critical_rank: int
    rank_ms: tuple[float, ...]
    mode: str
    seed: int
    events: tuple[TraceEvent, ...] = field(default=(), repr=False)
    op_kinds_ms: dict[str, float] = field(default_factory=dict)
    kernels: str = "none"
    kernel_sources: dict[str, Any] | None = field(default=None, repr=False)
    #: with ``explain=True``: the kernels run per op and their floor and host costs
    #: (``sim.step.kernels.inventory_json``)
    kernel_inventory: dict[str, Any] | None = field(default=None, repr=False)
    draft_ms: float = 0.0
    a2a_mode: str = "normal"

    @property
    def step_ms(self) -> float:
        return self.step_s * 1e3

    def to_json(self) -> dict[str, Any]:
        """The ``epsim step --json`` keys."""
        return {
            "step_ms": self.step_ms,
            "breakdown_ms": dict(self.breakdown_ms),
            "exposed_comm_ms": self.exposed_comm_ms,
            "comm_busy_ms": dict(self.comm_busy_ms),
            "overlapped_comm_ms": self.overlapped_comm_ms,
            "compute_slowdown_ms": self.compute_slowdown_ms,
            "expert_imbalance": self.expert_imbalance,
            "expert_imbalance_max": self.expert_imbalance_max,
            "critical_rank": self.critical_rank,
            "rank_ms": list(self.rank_ms),
            "mode": self.mode,
            "seed": self.seed,
            "op_kinds_ms": dict(self.op_kinds_ms),
            "kernels": self.kernels,
            "draft_module_ms": self.draft_ms,
            "a2a_mode": self.a2a_mode,
            **({"kernel_sources": self.kernel_sources} if self.kernel_sources is not None
               else {}),
            **({"kernel_inventory": self.kernel_inventory}
               if self.kernel_inventory is not None else {}),
        }


# --------------------------------------------------------------------------------------------
# Memoised inputs (the compiled step itself: sim.step.compile)
# --------------------------------------------------------------------------------------------


def _loads_key(loads: np.ndarray, memo: StepMemo) -> tuple:
    # the synthetic loads (read-only, shared) carry their digest: asked once per step
    for shared, key in memo.synthetic.values():
        if loads is shared:
            return key
    return _digest(loads)


def _digest(loads: np.ndarray) -> tuple:
    return (hashlib.sha1(np.ascontiguousarray(loads).tobytes()).hexdigest(), loads.shape)


def _default_placement(loads_key: tuple, loads: np.ndarray, gpus: int, eplb: bool,
                       redundant: int, memo: StepMemo) -> Placement:
    """``epsim.model.eplb.default_placement``: the balancer's placement for ``loads`` (its
    ``redundant`` replicas chosen from them), or with ``eplb`` off the contiguous one (redundant
    slots wrapping round); ``epsim run`` places its experts by the same function."""
    key = (loads_key, gpus, eplb, redundant)
    hit = memo.placements.get(key)
    if hit is None:
        placement = default_placement(loads, gpus, balanced=eplb, redundant=redundant)
        hit = remember(memo.placements, key, placement)
    return hit


def _slot_frequencies(loads_key: tuple, loads: np.ndarray, placement: Placement,
                      model: ModelConfig, memo: StepMemo) -> np.ndarray:
    key = (loads_key, id(placement))
    hit = memo.frequencies.get(key)
    if hit is None or hit[0] is not placement:
        rows = np.asarray(model.moe_layers, dtype=np.int64)
        hit = remember(memo.frequencies, key,
                       (placement, placed_frequencies(loads, placement, rows)))
    return hit[1]


def _synthetic_loads(model: ModelConfig, kind: str, memo: StepMemo) -> np.ndarray:
    key = (model, kind)
    hit = memo.synthetic.get(key)
    if hit is None:
        loads = synthetic_loads(model, kind)
        loads.setflags(write=False)  # shared by every caller
        hit = remember(memo.synthetic, key, (loads, _digest(loads)))
    else:
        memo.synthetic.move_to_end(key)
    return hit[0]


# --------------------------------------------------------------------------------------------
# One step
# --------------------------------------------------------------------------------------------


def simulate_step(model: ModelConfig, plan: ParallelPlan, batch: Batch,
                  profile: HardwareProfile, *, loads: np.ndarray | None = None,
                  placement: Placement | None = None, eplb: bool = True, mode: str = "fast",
                  seed: int = 0, trace: bool = False, synthetic: str = "skewed",
                  explain: bool = False, memo: StepMemo | None = None) -> StepResult:
    """Simulate one forward step of every rank.

    Args:
        model / plan / batch: what runs; ``batch`` is per dp rank (``Batch.decode(512, 2100)``).
        profile: the hardware (with efficiency tables).
        loads: ``[num_layers, num_experts]`` expert counts (``epsim.model.loads.read_loads``); ``None``:
            the synthetic distribution ``synthetic`` (``"skewed"`` or ``"uniform"``).
        placement: where the experts sit; ``None``: balanced over the EP GPUs for ``loads``
            (``epsim.model.eplb.balance_placement``, the plan's ``redundant_experts`` replicas
            given to the experts with the most load per replica), or contiguous when
            ``eplb=False``. Its slots must be the plan's (experts + redundant experts).
        mode: ``"fast"`` or ``"exact"``.
        seed: seeds this step's routing sample; same seed, same result.
        trace: also return per-op trace events of every rank.
        explain: also say how every op of the critical rank was timed (``kernel_sources``:
            table points and their sources, roofline, extrapolations).
        memo: what calls of one owner share (compiled steps, routing samples, op costs:
            ``sim.step.memo``); None: a fresh one, nothing shared. The result is the same
            either way; a memo only spares work.

    Returns:
        A :class:`StepResult`.
    """
    if mode not in MODES:
        raise EpsimError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise EpsimError(f"seed must be a non-negative integer, got {seed!r}")
    if synthetic not in LOAD_KINDS:
        raise EpsimError(f"synthetic loads must be one of {', '.join(LOAD_KINDS)}, got {synthetic!r}")
    plan.validate(model)
    if memo is None:
        memo = StepMemo()
    comp = compile_step(model, plan, batch, profile, memo)
    prog = comp.program
    imbalance = np.ones((1, 1))
    swept: dict[str, np.ndarray] = {}
    if comp.routed:
        if loads is None:
            loads = _synthetic_loads(model, synthetic, memo)
        loads = np.asarray(loads, dtype=np.float64)
        if loads.ndim != 2 or loads.shape != (model.num_layers, model.moe.num_experts):
            raise EpsimError(f"loads of shape {list(loads.shape)} do not match {model.name}'s "
                             f"[{model.num_layers}, {model.moe.num_experts}] layers x experts")
        key = _loads_key(loads, memo)
        if placement is None:
            placement = _default_placement(key, loads, plan.ep, eplb, plan.redundant_experts,
                                           memo)
        elif placement.num_gpus != plan.ep:
            raise EpsimError(f"placement spreads experts over {placement.num_gpus} GPUs, the plan "
                             f"has ep {plan.ep}")
        elif placement.num_slots != plan.expert_slots(model):
            raise EpsimError(f"placement has {placement.num_slots} expert slots, the plan "
                             f"{plan.expert_slots(model)} ({model.moe.num_experts} experts + "
                             f"{plan.redundant_experts} redundant)")
        p_slot = _slot_frequencies(key, loads, placement, model, memo)
        prog, swept, imbalance = route_step(comp, model, plan, profile, key, loads, placement,
                                            p_slot, int(seed), memo, explain)
    timeline = run_exact(prog) if mode == "exact" else run_fast(prog, fold=not trace)
    skew = profile.require_efficiency().rank_skew(min(plan.world_size, plan.gpus_per_node))
    result = _result(comp, prog, timeline, imbalance, mode, seed, trace, profile.kernel_set,
                     skew)
    if explain:
        result = replace(result, kernel_sources=_explain(comp, plan, profile, swept,
                                                         result.critical_rank),
                         kernel_inventory=inventory_json(comp.ops, profile, comp.captured,
                                                          comp.deployment))
    return result


def _explain(comp: Compiled, plan: ParallelPlan, profile: HardwareProfile,
             swept: dict[str, np.ndarray], rank: int) -> dict[str, Any]:
    """``kernel_sources`` of the ops of ``rank`` (routed ops at this step's features)."""
    prog = comp.program
    ctx = comp.cost.with_profile(profile)
    tokens: dict[int, float] = {}
    for role, values in swept.items():
        idx = comp.routed[role]
        picked = values[..., rank] if role == "experts" else values
        for i, v in zip(idx.reshape(-1).tolist(), picked.reshape(-1).tolist(), strict=True):
            tokens[i] = v
    entries = []
    cache: dict[tuple, dict[str, Any]] = {}
    for i, op_id in enumerate(prog.op_ids):
        op = comp.ops[i]
        if op.id != op_id:  # a representative op stands for it: list the op by its own id
            op = replace(op, id=op_id, layer=prog.layers[i])
        key = (op.kind, op.name, op.flops, op.bytes, op.peer_bytes, tokens.get(i))
        if key not in cache:
            cache[key] = timing.describe(op, ctx, tokens=tokens.get(i))
        entries.append((op, cache[key]))
    return timing.explain(entries, profile)


def _result(comp: Compiled, prog: Program, tl: Timeline, imbalance: np.ndarray, mode: str,
            seed: int, trace: bool, kernels: str, skew_s: float = 0.0) -> StepResult:
    """The step's figures from its critical rank; ``skew_s``: how much longer the slowest rank
    takes than the simulated ones, which run alike (``Efficiency.rank_skew``, CPU ranks sharing
    cores): it lengthens the critical rank's step as host time (``launch``)."""
    critical = int(np.argmax(tl.rank_end))
    step_s = float(tl.rank_end[critical])
    parts = {c: float(tl.breakdown[critical, i] * 1e3) for i, c in enumerate(CATEGORIES)}
    rank_ms = [float(x * 1e3) for x in tl.rank_end]
    if skew_s > 0.0:
        step_s += skew_s
        parts["launch"] += skew_s * 1e3
        rank_ms[critical] += skew_s * 1e3
    comm_cats = ("dispatch", "combine", "tp_comm")
    exposed = sum(parts[c] for c in comm_cats)
    busy = {c: float(tl.comm_busy[critical, CATEGORIES.index(c)] * 1e3) for c in comm_cats}
    events: tuple[TraceEvent, ...] = ()
    if trace:
        events = tuple(_events(prog, tl))
    return StepResult(
        step_s=step_s, breakdown_ms=parts, exposed_comm_ms=exposed, comm_busy_ms=busy,
        overlapped_comm_ms=max(0.0, sum(busy.values()) - exposed),
        compute_slowdown_ms=float(tl.slowdown_s[critical] * 1e3),
        expert_imbalance=float(imbalance.mean()), expert_imbalance_max=float(imbalance.max()),
        critical_rank=critical, rank_ms=tuple(rank_ms),
        mode=mode, seed=seed, events=events,
        op_kinds_ms=_op_kinds_ms(comp, prog, critical), kernels=kernels,
        draft_ms=_draft_ms(comp, prog, critical),
        a2a_mode=comp.exchange.name if comp.exchange is not None else "normal",
    )


def _draft_ms(comp: Compiled, prog: Program, rank: int) -> float:
    """``rank``'s MTP draft-module ops by the cost model, ms (``StepResult.draft_ms``)."""
    if not comp.draft_mask.any():
        return 0.0
    kernel = np.maximum(prog.work[comp.draft_mask, rank] - prog.node_s, 0.0)
    return float(kernel.sum() * 1e3)


def _op_kinds_ms(comp: Compiled, prog: Program, rank: int) -> dict[str, float]:
    """``{kind: ms}`` of ``rank``'s ops by the cost model (``StepResult.op_kinds_ms``)."""
    kernel = np.maximum(prog.work[:, rank] - prog.node_s, 0.0)
    sums = np.bincount(comp.kind_index, weights=kernel, minlength=len(OP_KINDS))
    present = np.bincount(comp.kind_index, minlength=len(OP_KINDS)) > 0
    return {k: float(sums[j] * 1e3) for j, k in enumerate(OP_KINDS) if present[j]}


def _events(prog: Program, tl: Timeline) -> list[TraceEvent]:
    out: list[TraceEvent] = []
    for i, op_id in enumerate(prog.op_ids):
        stream = "comm" if prog.is_coll[i] else "compute"
        for r in range(prog.ranks):
            s, e = tl.start[i, r], tl.end[i, r]
            if np.isnan(s) or np.isnan(e):
                continue
            out.append(TraceEvent(op_id=op_id, kind=prog.kinds[i], rank=r, stream=stream,
                                  start_us=float(s * 1e6), dur_us=float((e - s) * 1e6),
                                  layer=prog.layers[i], microbatch=prog.microbatches[i],
                                  args={"category": CATEGORIES[prog.categories[i]]}))
    return out
