"""A step's routing applied to its compiled program: ``route_step`` (steps 2-3 of ``sim.step.simulate``).

Glossary:
    sample      this step's routing (``sim.step.routing.RoutingSample``): the MoE layers', then each
                MTP draft pass's MoE layer's, drawn from ``np.random.default_rng(seed)``.
    routed times
                the seconds of the routed ops under a sample: each GPU's fused MoE ``[rows, mb,
                gpus]``, each dispatch and combine ``[rows, mb]`` (their busiest link).
    sample key  what a sample is a function of: the model, the loads, the placement, the
                dispatch tokens per rank of each microbatch (main and draft passes), the ranks
                and the seed. Never the context: a decode step's routing does not see it.
    kept seconds
                where a kernel table times the fused MoE, its seconds per token count
                (``SecondsByValue``, in the compiled batch's memo): a new sample of a known
                batch costs only the counts it has not met.

Both are kept in the caller's ``StepMemo`` (``sim.step.memo``). The serving simulator costs
hundreds of (batch, context) grid points with one seed, and the points of one batch share its
sample and its routed ops (their dims follow the tokens, not the context), so a new context
pays neither the draw nor the routed lookups again. A kept value is the value a fresh
computation gives (same draws from the same seed, same functions of the same ops): step times
do not move (a test compares them with a fresh memo's).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from epsim.model.config import ModelConfig
from epsim.model.mtp import draft_layer, routing_layer
from epsim.model.opgraph import Op
from epsim.model.placement import Placement
from epsim.model.plan import ParallelPlan
from epsim.sim.hardware import a2a
from epsim.sim.hardware.profile import HardwareProfile

from .compile import Compiled, op_cost_key
from .cost import comm, timing
from .cost.gemm import grouped_gemm_time, op_top_k
from .cost.roofline import calibrated
from .executor import Program
from .kernels import floored, kernel_count
from .memo import NOMINAL_KEPT, ROUTED_KEPT, SAMPLES_KEPT, StepMemo, remember
from .routing import (
    RoutingSample,
    node_tokens,
    sample_routing,
    sample_rows,
    stack_routing,
)


@dataclass(frozen=True, eq=False)
class _Sampled:
    """A memoised sample and what is derived from it alone (read-only arrays).

    placement: the placement it was drawn on (an entry is used only for this very object).
    routing: the sample.
    imbalance: ``[rows, mb]`` ``routing.imbalance()``.
    """

    placement: Placement
    routing: RoutingSample
    imbalance: np.ndarray


@dataclass(frozen=True, eq=False)
class _RoutedTimes:
    """The routed ops' seconds under one sample, before graph-node gaps and stragglers (kept
    without the sample itself, which is much larger).

    placement / graph: weak references to the placement the sample was drawn on and to the
        structure's op graph the routed indices belong to (an entry is used only for these very
        objects, and keeps neither alive: a graph is some MB).
    experts: ``[rows, mb, gpus]`` each GPU's fused MoE, times the ranks' core share.
    dispatch / combine: ``[rows, mb]`` each exchange's.
    imbalance: ``[rows, mb]`` the sample's expert imbalance.
    """

    placement: weakref.ref
    graph: weakref.ref
    experts: np.ndarray
    dispatch: np.ndarray
    combine: np.ndarray
    imbalance: np.ndarray


def route_step(comp: Compiled, model: ModelConfig, plan: ParallelPlan, profile: HardwareProfile,
               loads_key: tuple, loads: np.ndarray, placement: Placement, p_slot: np.ndarray,
               seed: int, memo: StepMemo, explain: bool = False
               ) -> tuple[Program, dict[str, np.ndarray], np.ndarray]:
    """``comp``'s program with this step's routed durations, the ``tokens`` feature each routed
    op was looked up at (only when ``explain``: ``{"experts": [L, mb, gpus], "dispatch": [L, mb],
    "combine": [L, mb]}``) and the ``[rows, mb]`` expert imbalance.

    ``loads_key`` names ``loads`` (its digest); ``p_slot``: ``[moe_layers, slots]`` the
    placement's per-slot pair probabilities for them; ``memo`` keeps samples and routed times
    (``StepMemo.samples`` / ``routed`` / ``nominal``)."""
    skey = (model, loads_key, id(placement), comp.mb_tokens, comp.draft_tokens,
            plan.world_size, seed)
    swept: dict[str, np.ndarray] = {}
    rkey = (skey, id(comp.graph), profile.fingerprint, comp.captured, comp.exchange,
            comp.share, comp.top_k, comp.row_tokens.tobytes(), _routed_signature(comp))
    times = None if explain else memo.routed.get(rkey)
    if times is not None and times.placement() is placement and times.graph() is comp.graph:
        memo.routed.move_to_end(rkey)
    else:
        sampled = _sampled(skey, comp, model, plan, loads, placement, p_slot, seed, memo)
        times, swept = _routed_times(comp, model, plan, profile, sampled, memo, explain)
        if not explain:
            remember(memo.routed, rkey, times, ROUTED_KEPT)
    prog = comp.program
    work = prog.work.copy()
    node_s = prog.node_s
    di_idx, co_idx = comp.routed["dispatch"], comp.routed["combine"]
    work[comp.routed["experts"]] = times.experts
    work[di_idx] = (times.dispatch + node_s)[..., None]
    work[co_idx] = (times.combine + node_s)[..., None]
    if comp.straggler is not None:  # the last rank's lateness, re-timed exchanges too
        work[di_idx] += comp.straggler[di_idx][..., None]
        work[co_idx] += comp.straggler[co_idx][..., None]
    return replace(prog, work=work), swept, times.imbalance


def _sampled(skey: tuple, comp: Compiled, model: ModelConfig, plan: ParallelPlan,
             loads: np.ndarray, placement: Placement, p_slot: np.ndarray, seed: int,
             memo: StepMemo) -> _Sampled:
    """The sample of ``skey`` (route_step's key), drawn from ``seed`` unless kept."""
    sampled = memo.samples.get(skey)
    if sampled is not None and sampled.placement is placement:
        memo.samples.move_to_end(skey)
        return sampled
    routing = _sample(comp, model, plan, loads, placement, p_slot, np.random.default_rng(seed))
    for a in (routing.slot_pairs, routing.pairs, routing.tokens):
        a.setflags(write=False)  # shared by every step of this sample
    imbalance = routing.imbalance()
    imbalance.setflags(write=False)
    return remember(memo.samples, skey, _Sampled(placement, routing, imbalance), SAMPLES_KEPT)


def _sample(comp: Compiled, model: ModelConfig, plan: ParallelPlan, loads: np.ndarray,
            placement: Placement, p_slot: np.ndarray, rng: np.random.Generator
            ) -> RoutingSample:
    """This step's routing of the MoE layers, then of each MTP draft pass's MoE layer (drawn
    after the main layers', so a plan without MTP draws exactly as before)."""
    main = sample_routing(model, loads, placement, comp.mb_tokens, plan.world_size, rng,
                          p_slot=p_slot)
    if not comp.draft_tokens:
        return main
    # the draft layer routes and sits like the routing layer (epsim.model.mtp.routing_layer)
    row = model.moe_layers.index(routing_layer(model))
    drafts = [sample_rows(np.array([draft_layer(model)]), p_slot[row:row + 1], model.moe.top_k,
                          placement, tokens, plan.world_size, rng)
              for tokens in comp.draft_tokens]
    return stack_routing([main, *drafts])


class SecondsByValue:
    """A routed op's seconds by swept value, for an op a kernel table times (a pure function of
    the value): the values met so far, sorted, and their seconds. A new routing sample of a
    known batch looks its 928 fused-MoE token counts up here, costing only the new ones (each
    value's lookup is elementwise: equal to costing them all at once).

    keys: ``[n]`` the values met, ascending. Example: ``[1984.5, 1990.0, ...]``.
    seconds: ``[n]`` their seconds.
    """

    __slots__ = ("keys", "seconds")
    #: values kept at most (a batch meets a few hundred distinct token counts per op)
    LIMIT = 65536

    def __init__(self) -> None:
        self.keys = np.zeros(0)
        self.seconds = np.zeros(0)

    def get(self, values: np.ndarray, compute: Callable[[np.ndarray], np.ndarray]
            ) -> np.ndarray:
        """``compute(values)`` (``[...]`` -> ``[...]``), from the kept seconds where known."""
        flat = np.asarray(values, dtype=np.float64).reshape(-1)
        if not np.isfinite(flat).all():  # a NaN never matches a key: nothing to keep
            return compute(values)
        pos = np.searchsorted(self.keys, flat)
        known = pos < len(self.keys)
        known[known] = self.keys[pos[known]] == flat[known]
        if not known.all():
            new = np.unique(flat[~known])
            keys = np.concatenate([self.keys, new])
            seconds = np.concatenate([self.seconds, np.asarray(compute(new), dtype=np.float64)])
            if len(keys) > self.LIMIT:  # start over with this call's values alone
                keys, seconds = new, seconds[len(self.keys):]
            order = np.argsort(keys, kind="stable")
            self.keys, self.seconds = keys[order], seconds[order]
            pos = np.searchsorted(self.keys, flat)
        return self.seconds[pos].reshape(np.shape(values))


def _no_fallback(op: Op) -> np.ndarray:
    raise AssertionError(f"{op.id}: a kernel table answers this op, yet its fallback was asked")


def _routed_signature(comp: Compiled) -> tuple:
    """Per role, the distinct routed ops' signatures in issue order and which of them each
    routed position holds (equal for a structure's full-graph batch and its representative-op
    batches of equal ops), worked out once per compiled batch."""
    found = comp.memo.get("routed_signature")
    if found is not None:
        return found
    out = []
    for role in ("experts", "dispatch", "combine"):
        idx = comp.routed[role].ravel()
        # positions holding one op object share its signature: group them by representative
        groups = idx if comp.rep_index is None else comp.rep_index[idx]
        _, first, inverse = np.unique(groups, return_index=True, return_inverse=True)
        distinct: dict[tuple, int] = {}
        code = [distinct.setdefault(op_cost_key(comp.ops[i]), len(distinct))
                for i in idx[first].tolist()]
        out.append((tuple(distinct), np.asarray(code, dtype=np.int64)[inverse].tobytes()))
    found = comp.memo["routed_signature"] = tuple(out)
    return found


def _routed_times(comp: Compiled, model: ModelConfig, plan: ParallelPlan,
                  profile: HardwareProfile, sampled: _Sampled, memo: StepMemo,
                  explain: bool = False) -> tuple[_RoutedTimes, dict[str, np.ndarray]]:
    """The routed ops' seconds under ``sampled``'s routing, and with ``explain`` the tokens
    each was looked up at."""
    routing = sampled.routing
    # the step's costing context; routed ops exist only under EP: the fused MoE's table is
    # the EP layout's in this step's exchange mode, the exchanges' groups every rank
    ctx = comp.cost.with_profile(profile)
    ranks = plan.world_size
    gpus = routing.pairs.shape[-1]
    captured = comp.captured
    node_s = comp.program.node_s
    ex_idx, di_idx, co_idx = comp.routed["experts"], comp.routed["dispatch"], comp.routed["combine"]
    # fused MoE per GPU from its own experts' counts: [L, mb, gpus]; routed ops exist only
    # under EP, so its table is the EP layout's in this step's exchange mode (decode and
    # prefill alike: each rank's own routed pairs set its time, the imbalance included)
    per_expert = routing.slot_pairs.reshape(*routing.slot_pairs.shape[:2], gpus, -1)
    ex_op = comp.ops[ex_idx[0, 0]]
    row_tokens = comp.row_tokens  # [rows, mb]: the MoE layers' and the draft passes' own

    def expert_tokens() -> np.ndarray:
        # a rank's tokens-equivalent: the pairs it computes over the kernel's top-k (its own
        # tokens join the routed pairs when the kernel runs the shared expert too)
        pairs = per_expert.sum(axis=-1)
        shared = ex_op.dims.get("shared_experts", 0)
        if shared:
            pairs = pairs + shared * row_tokens[:, :, None]
        return pairs / (op_top_k(ex_op, comp.top_k) or 1.0)

    by_value = comp.memo.get("experts_seconds")
    if by_value is None:  # worked out once per compiled batch: whether a table answers
        by_value = comp.memo["experts_seconds"] = (
            SecondsByValue() if timing.answered_by_table(ex_op, ctx) else False)
    if by_value is not False:
        # a function of the token count alone: kept per compiled batch across samples
        t_exp = by_value.get(expert_tokens(), lambda v: timing.routed_seconds(
            ex_op, ctx, lambda: v, lambda: _no_fallback(ex_op)))
    else:
        t_exp = timing.routed_seconds(
            ex_op, ctx, expert_tokens,
            lambda: calibrated(ex_op.kind, grouped_gemm_time(ex_op, profile, per_expert),
                               profile))
    nodes = np.arange(ranks) // plan.gpus_per_node
    mode = comp.exchange
    times, swept = [], {}
    # token rows per link: rank r to GPU g, or node-then-GPU; the combine's go back (transpose)
    rows = a2a.link_traffic("dispatch", mode, routing.tokens, nodes, lambda: node_tokens(
        routing, row_tokens, model.moe.top_k, plan.gpus_per_node))
    for role, idx, traffic in (("dispatch", di_idx, rows),
                               ("combine", co_idx, np.swapaxes(rows, -1, -2))):
        op = comp.ops[idx[0, 0]]
        t_roof = comm.collective_time(role, traffic * op.dims["bytes_per_token"], profile, nodes,
                                      captured)

        def tokens(role=role, idx=idx, t_roof=t_roof) -> np.ndarray:
            # the tokens per rank that, uniformly routed, would load the busiest link as much
            lat = comm.collective_latency(role, profile, captured, ranks)
            nominal = comp.memo.get(role)
            if nominal is None:  # this batch's, whatever the routing: worked out once
                nominal = comp.memo[role] = _nominal_rows(comp, idx, profile, nodes, captured,
                                                          mode, memo)
            bw = nominal - lat
            return row_tokens * np.where(bw > 0, (t_roof - lat) / np.where(bw > 0, bw, 1.0), 1.0)

        t = timing.routed_seconds(op, ctx, tokens, lambda t_roof=t_roof: t_roof)
        times.append(t)
        if explain:
            swept[role] = tokens()
    if explain:
        swept["experts"] = expert_tokens()
    out = _RoutedTimes(weakref.ref(sampled.placement), weakref.ref(comp.graph),
                       (floored(np.asarray(t_exp, dtype=np.float64),
                                kernel_count(ex_op, profile, comp.deployment),
                                profile.require_efficiency().kernel_floor_s, node_s)
                        + node_s) * comp.share,
                       np.asarray(times[0], dtype=np.float64),
                       np.asarray(times[1], dtype=np.float64), sampled.imbalance)
    for a in (out.experts, out.dispatch, out.combine):
        a.setflags(write=False)
    return out, swept


def _nominal_rows(comp: Compiled, idx: np.ndarray, profile: HardwareProfile,
                  nodes: np.ndarray, captured: bool, mode: a2a.A2AMode | None,
                  memo: StepMemo) -> np.ndarray:
    """``[rows, mb]`` each routed collective's time under uniform routing (ops of equal
    signature costed once: the MoE layers' repeat, the draft passes' differ; and once per
    profile across batches)."""
    context = (profile.fingerprint, nodes.tobytes(), captured, mode)
    # positions holding one representative op hold its value: cost each distinct op once
    groups = idx.reshape(-1) if comp.rep_index is None else comp.rep_index[idx.reshape(-1)]
    _, first, where = np.unique(groups, return_index=True, return_inverse=True)
    values = []
    for i in idx.reshape(-1)[first].tolist():
        op = comp.ops[i]
        key = (context, op.kind, op.peer_bytes, tuple(op.dims.items()))
        value = memo.nominal.get(key)
        if value is None:
            value = remember(memo.nominal, key, comm.nominal_collective(
                op, profile, nodes, captured, mode), NOMINAL_KEPT)
        values.append(value)
    return np.asarray(values, dtype=np.float64)[where].reshape(idx.shape)
