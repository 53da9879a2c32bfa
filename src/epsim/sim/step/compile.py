"""A step compiled once per plan: ``compile_step(model, plan, batch, profile)``.

Glossary:
    structure   what a plan's step program shares across batches: the op graph's ops in issue
                order, their dependencies and collective groups, the schedule and the fast
                executor's steps (``sim.step.executor.plan_steps``). It depends on the model, the plan,
                the profile, the phase (decode or prefill) and the microbatch count (a one-sequence
                batch runs as one microbatch), never on the batch's sizes.
    costing     a batch's numbers on a structure: each op's duration from the cost model, the
                routed ops' tokens, the executor steps' category shares.
    representative op
                decoder layers of one class (``epsim.model.graph.layer_class``: first layer or
                not, MoE or dense, attention type) have equal ops at every batch, so a new batch
                is costed on the ops of one layer per class
                (``epsim.model.graph.build_representative_ops``): DeepSeek-R1's 61 layers are
                costed as 3. The first batch of a structure is costed on its full graph; a
                batch differing from a costed one in context alone (the serving simulator's
                grid points of one batch size) rebuilds and recosts only the ops that read the
                context (``epsim.model.graph.CONTEXT_KINDS``: the attention cores).

A compiled step (``Compiled``) is kept in the caller's ``StepMemo`` (``sim.step.memo``) per
(model, plan, batch, profile) and the structure per (model, plan, phase, microbatches,
profile): the serving simulator's hundreds of (batch, context) shapes build the graph once per
plan and variant. Costs are the same functions of the same ops in
the same order as a fresh build's, so step times equal a fresh build's bit for bit (a test
compares every key of the step's JSON).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from epsim.model.config import ModelConfig
from epsim.model.graph import (
    CONTEXT_KINDS,
    build_representative_ops,
    build_step_graph,
    representative_layers,
)
from epsim.model.ids import op_id
from epsim.model.mtp import draft_layer
from epsim.model.opgraph import OP_KINDS, Batch, Op, OpGraph
from epsim.model.plan import ParallelPlan
from epsim.sim.hardware import a2a
from epsim.sim.hardware.profile import HardwareProfile

from .cost import timing
from .cost.context import CostContext
from .cost.registry import moe_layout
from .cost.roofline import op_class
from .executor import CATEGORIES, LaunchPlan, Program, plan_steps
from .holds import EXCHANGES, dispatch_holds, host_holds, stragglers
from .kernels import NO_DEPLOYMENT, floored, host_launch, kernel_count
from .memo import OP_CACHE_SIZE, StepMemo, remember


@dataclass(frozen=True, eq=False)
class Compiled:
    """One batch's step compiled for one profile, before this step's routing is applied.

    graph: the op graph the structure was built on (its ids, edges and schedule; its ops' numbers
        are those of the batch it was built for, ``ops`` are this batch's).
    batch: the batch compiled.
    ops: ``[n]`` this batch's ops in issue order (representative ops, whose id and layer may be
        another layer's of the same class, when the batch was costed on a known structure).
    program: the executors' program: this batch's durations on the structure's steps.
    routed: ``{"experts" | "dispatch" | "combine": [rows, mb]}`` issue index of the routed ops.
    mb_tokens: dispatch tokens per rank per microbatch (the main layers'). Example: ``(256, 256)``.
    share: the fused MoE's slowdown when ranks share a node's cores (CPU profiles; 1 on GPUs).
    cost: what costing its ops reads besides the ops (``sim.step.cost.context``): the profile
        it was compiled on, the model's top-k (fused-MoE table features; None without MoE
        layers), ``captured``, the EP exchanges' mode (its phase's, so the structure's), the
        plan's MoE layout and each rank's node.
    kind_index: ``[n]`` each op's index in ``OP_KINDS``.
    row_tokens: ``[rows, mb]`` dispatch tokens per rank of each routed row (the MoE layers, then
        each MTP draft pass's MoE layer).
    draft_tokens: per draft pass, tokens per microbatch.
    draft_mask: ``[n]`` the MTP draft-module ops.
    memo: values the routing step derives once per compiled batch (``sim.step.routed``: the
        exchanges' uniform-routing times, the routed ops' signature): functions of the routed
        ops alone, so the batches of a structure that differ in context alone share one.
    """

    graph: OpGraph
    batch: Batch
    ops: tuple[Op, ...]
    program: Program
    routed: dict[str, np.ndarray]
    mb_tokens: tuple[int, ...]
    cost: CostContext
    share: float = 1.0
    kind_index: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    row_tokens: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    draft_tokens: tuple[tuple[int, ...], ...] = ()
    draft_mask: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    #: what the routing step works out once per compiled batch (its ops' uniform-routing times)
    memo: dict[str, Any] = field(default_factory=dict, repr=False)
    #: (MoE layout, exchange mode) of the step: which kernels the inventory lists for its ops
    deployment: tuple[str, str] = NO_DEPLOYMENT
    #: ``[n]`` seconds each EP exchange waits for its last rank beyond the average one (included
    #: in ``program``; the routing step adds them to the exchanges it re-times); None: none
    straggler: np.ndarray | None = None
    #: ``[n]`` the representative op each op is (its index among the structure's, in the order
    #: each first stands for an op) when costed on representative ops; None: its own ops
    rep_index: np.ndarray | None = None

    @property
    def captured(self) -> bool:
        return self.graph.captured

    @property
    def top_k(self) -> int | None:
        """The model's top-k (fused-MoE table features), None without MoE layers."""
        return self.cost.top_k

    @property
    def exchange(self) -> a2a.A2AMode | None:
        """The EP exchanges' mode in this step (``sim.hardware.a2a``; its phase's)."""
        return self.cost.mode


@dataclass(frozen=True, eq=False)
class _Structure:
    """A plan's step program without a batch's numbers (module docstring, "structure").

    first: the batch it was built for, compiled (its program, routed indices, masks).
    rep_ids: representative op ids, in the order each first stands for an op in issue order.
    rep_index: ``[n]`` each op's position in ``rep_ids``.
    run_ops / run_of_op / run_cat_rank: the fast executor's compute steps (folded runs): the
        issue index of every op in one (``[m]``), its run (``[m]``), its category's rank in the
        order the run first meets its categories (``[m]``); ``run_cats``: ``[runs, categories]``
        the categories in that order (-1 past the last), to recompute each run's category
        shares for a new batch as ``plan_steps`` computes them.
    """

    first: Compiled
    rep_ids: tuple[str, ...]
    rep_index: np.ndarray
    run_ops: np.ndarray
    run_of_op: np.ndarray
    run_cat_rank: np.ndarray
    run_cats: np.ndarray


def compile_step(model: ModelConfig, plan: ParallelPlan, batch: Batch,
                 profile: HardwareProfile, memo: StepMemo) -> Compiled:
    """One rank's step compiled for ``profile`` (kept in ``memo``; the structure once per
    plan)."""
    key = (model, plan, batch, profile.fingerprint)
    hit = memo.compiled.get(key)
    if hit is not None:
        memo.compiled.move_to_end(key)
        return hit
    skey = (model, plan, batch.phase, min(plan.microbatches, batch.seqs), profile.fingerprint)
    structure = memo.structures.get(skey)
    if structure is None:
        structure = remember(memo.structures, skey,
                             _build_structure(model, plan, batch, profile, memo))
        comp = structure.first
    else:
        memo.structures.move_to_end(skey)
        comp = _recost(structure, model, plan, batch, profile, memo)
    return remember(memo.compiled, key, comp)


# --------------------------------------------------------------------------------------------
# Costing
# --------------------------------------------------------------------------------------------


def _op_work(ops: Sequence[Op], plan: ParallelPlan, ctx: CostContext, memo: StepMemo
             ) -> np.ndarray:
    """``[len(ops)]`` seconds each op occupies its stream: the cost model's time in the step's
    ``ctx`` (ops of one signature costed once: layers repeat), the graph-node gap, and on CPU
    runtimes the stretch of ranks sharing a node's cores."""
    profile = ctx.profile
    eff = profile.require_efficiency()
    ranks = plan.world_size
    node_s = eff.graph_node_s  # the GPU-side gap between kernels, graph or not
    ranks_on_node = min(ranks, plan.gpus_per_node)
    work = []
    seen: dict[tuple, float] = {}
    shares: dict[str, float] = {}  # per op class: the same for every op of it
    # the MoE layout is in it: a DP plan without EP and one with EP have equal ranks and tp
    context = (profile.fingerprint, ranks, plan.tp, plan.gpus_per_node, ctx.captured,
               ctx.top_k, ctx.mode, ctx.layout)
    deployment = deployment_of(plan, ctx.mode)
    for op in ops:
        sig = (op.kind, op.name, op.flops, op.bytes_read, op.bytes_written, op.peer_bytes)
        seconds = seen.get(sig)
        if seconds is None:
            # batches of one plan share most ops (a new context changes only attention's):
            # each op's cost is kept across them, keyed by all that the cost models read
            key = (context, *op_cost_key(op))
            seconds = memo.op_seconds.get(key)
            if seconds is None:
                seconds = remember(memo.op_seconds, key, timing.op_time(op, ctx),
                                   OP_CACHE_SIZE)
            if not op.is_collective:  # the kernels' floors: once per signature
                seconds = floored(seconds, kernel_count(op, profile, deployment),
                                  eff.kernel_floor_s, node_s)
            seen[sig] = seconds
        seconds = seconds + node_s
        if not op.is_collective:
            kind = op_class(op)
            share = shares.get(kind)
            if share is None:
                share = shares[kind] = eff.core_share(ranks_on_node, kind)
            seconds = seconds * share
        work.append(seconds)
    return np.array(work, dtype=np.float64)


def op_cost_key(op: Op) -> tuple:
    """Everything of ``op`` the cost models read (its id, layer and microbatch aside): ops of
    equal keys cost the same under one profile and plan."""
    return (op.kind, op.name, op.category, op.dtype, tuple(op.dims.items()), op.flops,
            op.bytes_read, op.bytes_written, op.weight_bytes, op.peer_bytes, op.routed,
            op.draft is None)


def _routed_tokens(ops: Sequence[Op], routed: dict[str, np.ndarray], model: ModelConfig
                   ) -> tuple[np.ndarray, tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """``row_tokens`` ``[rows, mb]``, ``mb_tokens`` and ``draft_tokens`` of a batch's ops."""
    if not routed:
        return np.zeros((0, 0)), (), ()
    row_tokens = np.array([[ops[i].dims["tokens"] for i in row] for row in routed["dispatch"]],
                          dtype=np.float64)
    return _token_tuples(row_tokens, model)


def _token_tuples(row_tokens: np.ndarray, model: ModelConfig
                  ) -> tuple[np.ndarray, tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """``row_tokens`` with ``mb_tokens`` and ``draft_tokens`` read off it."""
    mb_tokens = tuple(int(t) for t in row_tokens[0])
    draft_tokens = tuple(tuple(int(t) for t in row)
                         for row in row_tokens[len(model.moe_layers):])
    return row_tokens, mb_tokens, draft_tokens


@dataclass(frozen=True, eq=False)
class _Costed:
    """A batch's representative ops costed on a structure, kept for the batches that differ
    from it in context alone (``epsim.model.graph.CONTEXT_KINDS``: only their attention cores
    differ; the rest, and everything derived from the routed ops, is theirs too).

    structure: a weak reference to the structure (an entry is used only for this very object,
        and keeps it alive no longer than the structure memo does: it holds the op graph).
    rep_ops: ``[reps]`` the batch's representative ops, in ``_Structure.rep_ids`` order.
    rep_work: ``[reps]`` their ``_op_work`` seconds.
    context_reps: ``[c]`` the positions of the ops that read the context.
    row_tokens / mb_tokens / draft_tokens: as ``Compiled``'s.
    memo: the ``Compiled.memo`` the batches share (its values follow the routed ops alone).
    """

    structure: weakref.ref
    rep_ops: tuple[Op, ...]
    rep_work: np.ndarray
    context_reps: tuple[int, ...]
    row_tokens: np.ndarray
    mb_tokens: tuple[int, ...]
    draft_tokens: tuple[tuple[int, ...], ...]
    memo: dict[str, Any]


def _costed_reps(s: _Structure, model: ModelConfig, plan: ParallelPlan, batch: Batch,
                 profile: HardwareProfile, memo: StepMemo) -> _Costed:
    """``batch``'s representative ops and their seconds: a batch differing from a costed one
    in context alone rebuilds and recosts its attention cores alone, the other ops (and their
    seconds, row tokens and routed memo) are the costed batch's, which a fresh build equals."""
    first = s.first
    key = (id(s), batch.phase, batch.seqs, batch.new_tokens_per_seq)
    known = memo.costed.get(key)
    if known is not None and known.structure() is s:
        memo.costed.move_to_end(key)
        fresh = build_representative_ops(model, plan, batch, CONTEXT_KINDS)
        rep_ops = list(known.rep_ops)
        for j in known.context_reps:
            rep_ops[j] = fresh[s.rep_ids[j]]
        rep_work = known.rep_work.copy()
        changed = list(known.context_reps)
        rep_work[changed] = _op_work([rep_ops[j] for j in changed], plan,
                                     first.cost.with_profile(profile), memo)
        return replace(known, rep_ops=tuple(rep_ops), rep_work=rep_work)
    reps = build_representative_ops(model, plan, batch)
    rep_ops = tuple(reps[r] for r in s.rep_ids)
    rep_work = _op_work(rep_ops, plan, first.cost.with_profile(profile), memo)
    row_tokens, mb_tokens, draft_tokens = np.zeros((0, 0)), (), ()
    if first.routed:  # each dispatch's tokens, read once per representative op it stands for
        reps_of_rows = s.rep_index[first.routed["dispatch"]]
        distinct, where = np.unique(reps_of_rows, return_inverse=True)
        tokens = np.array([rep_ops[j].dims["tokens"] for j in distinct.tolist()],
                          dtype=np.float64)
        row_tokens, mb_tokens, draft_tokens = _token_tuples(
            tokens[where].reshape(reps_of_rows.shape), model)
    context_reps = tuple(j for j, op in enumerate(rep_ops) if op.kind in CONTEXT_KINDS)
    costed = _Costed(weakref.ref(s), rep_ops, rep_work, context_reps, row_tokens, mb_tokens,
                     draft_tokens, {})
    return remember(memo.costed, key, costed)


def _recost(s: _Structure, model: ModelConfig, plan: ParallelPlan, batch: Batch,
            profile: HardwareProfile, memo: StepMemo) -> Compiled:
    """``batch`` costed on a known structure from the ops of one layer per class (only its
    attention cores where a batch differing in context alone was costed: ``_costed_reps``)."""
    first = s.first
    costed = _costed_reps(s, model, plan, batch, profile, memo)
    rep_ops, rep_work = costed.rep_ops, costed.rep_work
    ops = tuple(map(rep_ops.__getitem__, s.rep_index.tolist()))
    work = rep_work[s.rep_index]
    prog = first.program
    late = stragglers(ops, work, profile, plan)
    hold = dispatch_holds(ops, work, profile, plan)
    release = prog.host_release_s
    if late is not None:
        work = work + late
    if late is not None or hold is not None:
        _, release = host_holds(ops, prog.group_size, profile, first.captured, late, hold)
    program = replace(prog, work=np.tile(work[:, None], (1, prog.ranks)),
                      steps=_reshare(s, prog.steps, work - prog.node_s), host_release_s=release)
    return replace(first, ops=ops, program=program, row_tokens=costed.row_tokens,
                   mb_tokens=costed.mb_tokens, draft_tokens=costed.draft_tokens, batch=batch,
                   memo=costed.memo, straggler=late, rep_index=s.rep_index)


def _reshare(s: _Structure, steps: LaunchPlan | None, net: np.ndarray) -> LaunchPlan | None:
    """The structure's executor steps with each folded run's category shares of ``net`` (each
    op's own time), summed in the order ``plan_steps`` sums them."""
    if steps is None:
        return None
    runs, width = s.run_cats.shape
    # np.add.at's sums (each cell's in op order from 0), by bincount: the same additions
    by_cat = np.bincount(s.run_of_op * width + s.run_cat_rank, weights=net[s.run_ops],
                         minlength=runs * width).reshape(runs, width)
    total = np.zeros(runs)
    for j in range(width):  # left to right, as Python's sum over the run's categories
        total = total + by_cat[:, j]
    shares = by_cat / np.where(total > 0, total, 1.0)[:, None]
    share = np.zeros((runs, len(CATEGORIES)))
    rows, cols = np.nonzero(s.run_cats >= 0)
    share[rows, s.run_cats[rows, cols]] = shares[rows, cols]
    return steps.with_shares(share)


# --------------------------------------------------------------------------------------------
# Structure
# --------------------------------------------------------------------------------------------


def _build_structure(model: ModelConfig, plan: ParallelPlan, batch: Batch,
                     profile: HardwareProfile, memo: StepMemo) -> _Structure:
    first = _compile_graph(model, plan, batch, profile, memo)
    reps = representative_layers(model)
    rep_ids: dict[str, int] = {}
    rep_index = np.empty(len(first.ops), dtype=np.int64)
    for i, op in enumerate(first.ops):
        layer = op.layer
        if op.draft is None and 0 <= layer < model.num_layers:
            layer = reps[layer]
        rep_index[i] = rep_ids.setdefault(op_id(layer, op.name, op.microbatch, op.draft),
                                          len(rep_ids))
    return _Structure(first, tuple(rep_ids), rep_index, *_run_layout(first.program))


def _run_layout(prog: Program) -> tuple[np.ndarray, ...]:
    """``run_ops, run_of_op, run_cat_rank, run_cats`` of ``_Structure`` for ``prog``'s steps."""
    ops: list[int] = []
    runs: list[int] = []
    ranks: list[int] = []
    orders: list[list[int]] = []
    compute = prog.steps.compute_steps if prog.steps is not None else ()
    for j, st in enumerate(compute):
        order: list[int] = []
        for i in st.ops:
            c = int(prog.categories[i])
            if c not in order:
                order.append(c)
            ops.append(i)
            runs.append(j)
            ranks.append(order.index(c))
        orders.append(order)
    width = max((len(o) for o in orders), default=0)
    cats = np.full((len(orders), width), -1, dtype=np.int64)
    for j, order in enumerate(orders):
        cats[j, :len(order)] = order
    return (np.array(ops, dtype=np.int64), np.array(runs, dtype=np.int64),
            np.array(ranks, dtype=np.int64), cats)


def _compile_graph(model: ModelConfig, plan: ParallelPlan, batch: Batch,
                   profile: HardwareProfile, memo: StepMemo) -> Compiled:
    """Build ``batch``'s op graph and compile it: the structure's first batch."""
    eff = profile.require_efficiency()
    graph = build_step_graph(model, plan, batch)
    order = graph.schedule.order()
    index = {ident: i for i, ident in enumerate(order)}
    ranks = plan.world_size
    ops = tuple(graph.ops[o] for o in order)
    captured = graph.captured
    top_k = model.moe.top_k if model.moe_layers else None
    nodes_of = np.arange(ranks) // plan.gpus_per_node
    exchange = a2a.resolve(profile.a2a_mode, batch.phase, a2a.spans_nodes(nodes_of))
    deployment = deployment_of(plan, exchange)
    # what costing the step's ops reads besides them, built once (a fused MoE's table is the
    # one deployed with the step's exchange mode and the plan's MoE layout)
    cost = CostContext(profile, top_k, captured, exchange, moe_layout(plan),
                       tuple(nodes_of.tolist()), plan.tp)
    work = _op_work(ops, plan, cost, memo)
    late = stragglers(ops, work, profile, plan)
    hold = dispatch_holds(ops, work, profile, plan)
    if late is not None:
        work = work + late
    group_size = np.array([(ranks if op.dims["group"] == "ep" else plan.tp)
                           if op.is_collective else 0 for op in ops], dtype=np.int64)
    # captured: one graph launch; eager: the host launches every kernel and syncs on dispatch
    floor = np.full(len(ops), eff.graph_launch_s if captured else 0.0)
    host_sync, host_release_s = host_holds(ops, group_size, profile, captured, late, hold)
    # exchanges whose kernels free the compute units once their messages are issued
    quiet = np.array([op.kind in EXCHANGES and not exchange.occupies_cus for op in ops])
    program = Program(
        op_ids=tuple(order), kinds=tuple(op.kind for op in ops),
        categories=np.array([CATEGORIES.index(op.category) for op in ops]),
        layers=tuple(op.layer for op in ops), microbatches=tuple(op.microbatch for op in ops),
        is_coll=np.array([op.is_collective for op in ops]),
        deps=tuple(tuple(index[d] for d in graph.graph.predecessors(o)) for o in order),
        work=np.tile(work[:, None], (1, ranks)), node_s=eff.graph_node_s, floor=floor,
        launch_s=host_launch(ops, profile, captured, deployment),
        host_sync=host_sync,
        host_release_s=host_release_s, group_size=group_size, comm_slots=eff.comm_concurrency,
        slowdown=eff.comm_slowdown(min(ranks, plan.gpus_per_node)),
        quiet=quiet if quiet.any() else None,
    )
    # runs of compute ops fold only inside a captured graph (eager: the host may hold any op)
    program = replace(program, steps=plan_steps(program, fold=captured))
    # the ops whose cost this step's routing sets (sampled routing models the fused MoE under EP)
    routed: dict[str, np.ndarray] = {}
    if plan.expert_parallel and model.moe_layers and plan.fusion.fused_moe:
        rows = [(layer, None) for layer in model.moe_layers]
        if model.mtp_moe:  # each MTP draft pass's MoE layer is routed on its own
            rows += [(draft_layer(model), k) for k in range(plan.mtp)]
        routed = _routed_indices(ops, rows, len(graph.microbatch_tokens))
    row_tokens, mb_tokens, draft_tokens = _routed_tokens(ops, routed, model)
    ranks_on_node = min(ranks, plan.gpus_per_node)
    return Compiled(
        graph=graph, batch=batch, ops=ops, program=program, routed=routed, mb_tokens=mb_tokens,
        cost=cost, share=eff.core_share(ranks_on_node, "grouped_gemm"),
        kind_index=np.array([OP_KINDS.index(op.kind) for op in ops], dtype=np.int64),
        row_tokens=row_tokens, draft_tokens=draft_tokens,
        draft_mask=np.array([op.draft is not None for op in ops], dtype=bool),
        deployment=deployment, straggler=late)


def deployment_of(plan: ParallelPlan, exchange: a2a.A2AMode | None) -> tuple[str, str]:
    """The step's (MoE layout, exchange mode), as the kernel inventory keys deployments."""
    return (moe_layout(plan), exchange.name if exchange is not None else "")


#: routed ops (``Op.routed``) by kind: the role their duration plays in the routing step
_ROUTED_ROLES = {"grouped_gemm": "experts", "dispatch": "dispatch", "combine": "combine"}


def _routed_indices(ops: Sequence[Op], rows: Sequence[tuple[int, int | None]],
                    microbatches: int) -> dict[str, np.ndarray]:
    """``{role: [row, microbatch] -> issue index}`` of the routed ops of a fused-MoE EP graph
    (one fused expert op, one dispatch and one combine per MoE layer and microbatch); a row is
    ``(layer, draft pass)``: the MoE layers' (pass ``None``), then the MTP draft passes'."""
    where: dict[str, dict[tuple, int]] = {role: {} for role in _ROUTED_ROLES.values()}
    known = set(rows)
    for i, op in enumerate(ops):
        if op.routed:
            if op.kind not in _ROUTED_ROLES or (op.layer, op.draft) not in known:
                raise AssertionError(f"{op.id}: the simulator samples no routing for this "
                                     f"routed {op.kind} op")
            where[_ROUTED_ROLES[op.kind]][(op.layer, op.draft, op.microbatch)] = i
    return {role: np.array([[found[(layer, draft, mb)] for mb in range(microbatches)]
                            for layer, draft in rows])
            for role, found in where.items()}
