"""The step's program and its fast executor: every rank's compute stream and communication queue, walking the schedule.

Semantics (both executors implement exactly these; ``tests/sim/step/test_sim_executor.py`` checks they agree):

* The host issues the ops of ``OpGraph.schedule`` in order. Eager: every op (compute or comm)
  costs the host ``Program.launch_s`` (each of its kernels' ``kernel_launch_s`` plus the
  framework's ``framework_dispatch_s``: ``sim.hardware.kernel_inventory``) and cannot start
  before it is issued, and after issuing an EP
  dispatch the host waits for its count exchange: until every rank of the group has reached the
  dispatch plus ``host_release_s`` (the exchange's latency), when it can read the received-token
  counts and size the expert buffers (the reason a captured graph must pad them to a static
  maximum). The payload then moves on the communication engine while the host goes on issuing.
  Captured graph: one launch (``graph_launch_s``), then the GPU runs every kernel without the host.
  In both modes every kernel pays ``graph_node_s`` on its stream: the GPU-side gap between kernels.
* Per rank, a **compute stream** runs compute ops in issue order; an op starts when the stream is
  free, its data dependencies are done and the host has issued it.
* Per rank, a **communication engine** with ``comm_slots`` slots runs collectives in issue order:
  one slot on a GPU (one communication stream), two for torch's gloo (its default of two worker
  threads runs two asynchronous collectives at once). A collective takes a slot once its
  dependencies are done, it is issued and a slot is free (not before the previous collective took
  one), starts when every rank of its group has done so, and lasts its cost-model duration
  (slowest link); every member finishes together.
* While a collective is in flight on a rank, compute ops there progress at ``1 - s`` of their
  speed (``s`` = ``efficiency.comm_compute_slowdown``: the CUs the comm kernel holds): a fluid
  model, so an op overlapping half its length with communication takes ``d * (1 + s / 2 / (1-s))``.
  A collective whose kernel holds no compute units once its messages are issued (``quiet``: EP
  exchanges in ``sim.hardware.a2a``'s ``low_latency`` mode) slows nothing.
* The step ends when the last op of the last rank ends.

``run_exact`` (``sim/step/executor/exact.py``) simulates that with simpy (one compute process and one
comm process per rank, a barrier per collective and group, rate changes as events). ``run_fast``
(here) computes the same times
directly in issue order, vectorised over ranks with numpy, and folds runs of compute ops that wait
on nothing but the previous op into one step (their fluid progress composes exactly). A collective
waits for its dependencies except those another of them reads (``collective_waits``); the fold is
exact when those are issued just before the collective, which is how
``epsim.model.graph.build_step_graph`` builds them.

The fast executor's folded runs know only the run's total time, so when comm interference
stretches a run that mixes categories, the stretch is shared among them in proportion to their own
time (the exact executor charges it op by op); step times and totals are identical.

Breakdown: on the rank that finishes last, every instant of its compute stream is either busy
(charged to the op's category; the graph-node cost to ``launch``) or idle waiting (charged to the
binding constraint: the collective it waited for, ``launch`` when it waited for the host, or the
dispatch the host was itself waiting for (eager)), so the parts sum to the step time.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from epsim.model.opgraph import OP_CATEGORIES

#: breakdown buckets: the graph's op categories, and the host/launch time only the executor knows
CATEGORIES: tuple[str, ...] = (*OP_CATEGORIES, "launch")
_CAT = {c: i for i, c in enumerate(CATEGORIES)}
_LAUNCH = _CAT["launch"]


@dataclass(frozen=True, eq=False)
class Program:
    """One step, compiled for the executors: ops in issue order with per-rank durations.

    op_ids / kinds / categories / layers / microbatches: per op, issue order. Example op id
        ``"L3.moe.dispatch.mb0"``.
    is_coll: ``[n]`` bool, collective or compute.
    deps: per op, the indices of its data dependencies.
    work: ``[n, ranks]`` seconds: compute ops: cost-model time plus the graph-node cost;
        collectives: start-to-end duration.
    node_s: the graph-node cost included in ``work`` of every op (0 when eager).
    floor: ``[n]`` earliest start set by the graph launch (0 when eager).
    launch_s: ``[n]`` eager: host seconds to issue each op: its kernels' launches and framework
        dispatch (0 inside a captured graph); a number is taken for every op.
    host_sync: ``[n]`` bool: eager: the host waits on this collective before issuing more
        (EP dispatch: the host reads the received-token counts to size the expert buffers).
    host_release_s: ``[n]`` seconds after such a collective starts when the host resumes (the
        count exchange's latency; 0 elsewhere).
    group_size: ``[n]`` ranks per collective group (consecutive ranks form a group); 0 for compute.
    slowdown: compute speed lost while a collective is in flight.
    comm_slots: collectives one rank can have in flight at once (1 on GPUs).
    steps: the fast executor's precomputed steps (``plan_steps``), None to compute them per run.
    quiet: ``[n]`` bool: this collective holds no compute units (no interference); None: every
        collective does.
    """

    op_ids: tuple[str, ...]
    kinds: tuple[str, ...]
    categories: np.ndarray
    layers: tuple[int, ...]
    microbatches: tuple[int, ...]
    is_coll: np.ndarray
    deps: tuple[tuple[int, ...], ...]
    work: np.ndarray
    node_s: float
    floor: np.ndarray
    launch_s: np.ndarray
    host_sync: np.ndarray
    host_release_s: np.ndarray
    group_size: np.ndarray
    slowdown: float
    steps: LaunchPlan | None = None
    comm_slots: int = 1
    quiet: np.ndarray | None = None

    def __post_init__(self) -> None:
        # one number (a test's program, a uniform launch) stands for every op's
        launch = np.broadcast_to(np.asarray(self.launch_s, dtype=np.float64), (len(self.op_ids),))
        object.__setattr__(self, "launch_s", np.ascontiguousarray(launch))

    @property
    def eager(self) -> bool:
        """The host issues each op (launches or syncs): no captured graph."""
        return bool(self.launch_s.any()) or bool(self.host_sync.any())

    @property
    def ranks(self) -> int:
        return self.work.shape[1]

    def __len__(self) -> int:
        return len(self.op_ids)


@dataclass(frozen=True)
class Timeline:
    """What an executor computed.

    start / end: ``[n, ranks]`` seconds per op and rank (NaN for ops folded into a run).
    rank_end: ``[ranks]`` when each rank's last op ended.
    breakdown: ``[ranks, len(CATEGORIES)]`` seconds per category (sums to each rank's compute end).
    slowdown_s: ``[ranks]`` compute time added by comm interference (inside ``breakdown``).
    comm_busy: ``[ranks, len(CATEGORIES)]`` seconds each comm category was in flight.
    """

    start: np.ndarray
    end: np.ndarray
    rank_end: np.ndarray
    breakdown: np.ndarray
    slowdown_s: np.ndarray
    comm_busy: np.ndarray


def collective_waits(i: int, is_coll: np.ndarray, deps: tuple[tuple[int, ...], ...]
                     ) -> tuple[int, ...]:
    """The dependencies collective ``i`` waits for: all but the compute ones that another of its
    dependencies reads itself (those end before that one starts, so they never bind). Example:
    an EP dispatch reads the norm's rows and the router's choice; the router reads the norm."""
    implied = {d for other in deps[i] for d in deps[other]}
    return tuple(d for d in deps[i] if is_coll[d] or d not in implied)


def build_chains(is_coll: np.ndarray, deps: tuple[tuple[int, ...], ...], fold: bool
                 ) -> tuple[tuple[int, ...], ...]:
    """Cut the issue order into executor steps: a collective alone, or a run of compute ops of
    which only the first waits on a collective and none is interrupted by a collective in issue
    order. ``fold=False``: every op alone."""
    chains: list[tuple[int, ...]] = []
    current: list[int] = []
    # a collective reads the end time of each compute op it waits for: they must end a run
    ends_run = {d for i in range(len(is_coll)) if is_coll[i]
                for d in collective_waits(i, is_coll, deps) if not is_coll[d]}
    for i in range(len(is_coll)):
        if is_coll[i]:
            if current:
                chains.append(tuple(current))
                current = []
            chains.append((i,))
            continue
        waits = any(is_coll[d] for d in deps[i])
        if current and (waits or not fold):
            chains.append(tuple(current))
            current = []
        current.append(i)
        if i in ends_run:
            chains.append(tuple(current))
            current = []
    if current:
        chains.append(tuple(current))
    return tuple(chains)


# --------------------------------------------------------------------------------------------
# The fast executor
# --------------------------------------------------------------------------------------------


def _fluid(t0: np.ndarray, work: np.ndarray, intervals: list[tuple], s: float) -> np.ndarray:
    """End times of ``work`` seconds of compute starting at ``t0`` ([ranks] each) that runs at
    ``1 - s`` inside the given comm intervals (sorted, disjoint per rank) and at full speed
    elsewhere."""
    if s == 0.0:
        return t0 + work
    t = t0
    w = work
    slow = 1.0 - s
    for cs, ce, *_ in intervals:
        # full speed until the interval starts
        use = np.minimum(w, np.maximum(cs - t, 0.0))
        t = t + use
        w = w - use
        # slowed inside it
        at = np.maximum(t, cs)
        use = np.minimum(w, np.maximum(ce - at, 0.0) * slow)
        t = np.where(use > 0, at + use / slow, t)
        w = w - use
    return t + w


@dataclass(frozen=True)
class _Step:
    """One executor step (a collective, or a run of compute ops), precomputed."""

    coll: bool
    first: int
    last: int
    ops: tuple[int, ...]
    waits: tuple[int, ...]  # collectives the first op depends on (compute: coll deps only)
    group: int
    cat: int
    cats: np.ndarray  # runs: the categories present
    shares: np.ndarray  # runs: each category's share of the run's own time (uniform over ranks)
    nodes: float  # runs: graph-node time inside the run


@dataclass(frozen=True, eq=False)
class LaunchPlan:
    """A program's executor steps, with what the accounting after a walk needs of them: worked
    out on first use and kept with the steps, since a compiled program is run for every step the
    serving simulator times."""

    steps: tuple[_Step, ...]
    #: runs of compute ops were folded (``plan_steps(prog, fold=True)``)
    fold: bool = True
    #: ``[compute steps, categories]`` the shares of another batch on these steps (a compiled
    #: step's structure reused, ``sim.step.compile``); None: the steps' own
    share: np.ndarray | None = None

    @cached_property
    def compute_steps(self) -> tuple[_Step, ...]:
        return tuple(st for st in self.steps if not st.coll)

    @cached_property
    def node_times(self) -> np.ndarray:
        """``[compute steps]`` graph-node time inside each compute step."""
        return np.array([st.nodes for st in self.compute_steps])

    @cached_property
    def node_shares(self) -> tuple[np.ndarray, np.ndarray]:
        """``[compute steps]`` graph-node time and ``[compute steps, categories]`` share of each
        category in each compute step's own time."""
        if self.share is not None:
            return self.node_times, self.share
        compute = self.compute_steps
        share = np.zeros((len(compute), len(CATEGORIES)))
        for j, st in enumerate(compute):
            share[j, st.cats] = st.shares
        return self.node_times, share

    @cached_property
    def arrays(self) -> tuple[np.ndarray, ...]:
        """The steps as the compiled walk reads them (``sim.step.executor.walk``): ``coll, first,
        last, group, cat, ops_ptr, ops_idx, waits_ptr, waits_idx``."""
        steps = self.steps
        ops_ptr = np.zeros(len(steps) + 1, dtype=np.int64)
        waits_ptr = np.zeros(len(steps) + 1, dtype=np.int64)
        ops_ptr[1:] = np.cumsum([len(st.ops) for st in steps])
        waits_ptr[1:] = np.cumsum([len(st.waits) for st in steps])
        flat = [i for st in steps for i in st.ops]
        waits = [d for st in steps for d in st.waits]
        return (np.array([st.coll for st in steps], dtype=np.bool_),
                np.array([st.first for st in steps], dtype=np.int64),
                np.array([st.last for st in steps], dtype=np.int64),
                np.array([st.group for st in steps], dtype=np.int64),
                np.array([st.cat for st in steps], dtype=np.int64),
                ops_ptr, np.array(flat, dtype=np.int64),
                waits_ptr, np.array(waits, dtype=np.int64))

    def with_shares(self, share: np.ndarray) -> LaunchPlan:
        """These steps with another batch's category shares (what does not depend on them is
        carried over, worked out once)."""
        other = LaunchPlan(self.steps, self.fold, share)
        other.__dict__["compute_steps"] = self.compute_steps
        other.__dict__["node_times"] = self.node_times
        other.__dict__["arrays"] = self.arrays
        return other


def plan_steps(prog: Program, fold: bool) -> LaunchPlan:
    """The executor steps of ``prog``. Runs of several ops are folded only when their ops take the
    same time on every rank (true of every op but the fused MoE, which waits on its dispatch)."""
    chains = build_chains(prog.is_coll, prog.deps, fold)
    uniform = (prog.work == prog.work[:, :1]).all(axis=1)
    net_all = prog.work[:, 0] - prog.node_s
    cats_all = prog.categories.tolist()
    steps = []
    for chain in chains:
        first = chain[0]
        if prog.is_coll[first]:
            steps.append(_Step(True, first, first, chain,
                               collective_waits(first, prog.is_coll, prog.deps),
                               int(prog.group_size[first]), cats_all[first],
                               np.zeros(0, dtype=np.int64), np.zeros(0), 0.0))
            continue
        if len(chain) > 1 and not all(uniform[i] for i in chain):
            # rank-dependent durations inside a run: do not fold it
            for i in chain:
                steps.extend(plan_steps_single(prog, i))
            continue
        by_cat: dict[int, float] = {}
        for i in chain:
            by_cat[cats_all[i]] = by_cat.get(cats_all[i], 0.0) + float(net_all[i])
        total = sum(by_cat.values())
        ucats = np.array(sorted(by_cat), dtype=np.int64)
        shares = np.array([by_cat[c] for c in sorted(by_cat)]) / (total if total > 0 else 1.0)
        waits = tuple(d for d in prog.deps[first] if prog.is_coll[d])
        steps.append(_Step(False, first, chain[-1], chain, waits, 0, cats_all[first], ucats,
                           shares, prog.node_s * len(chain)))
    return LaunchPlan(tuple(steps), fold)


def plan_steps_single(prog: Program, i: int) -> list[_Step]:
    cat = int(prog.categories[i])
    waits = tuple(d for d in prog.deps[i] if prog.is_coll[d])
    return [_Step(False, i, i, (i,), waits, 0, cat, np.array([cat]), np.ones(1), prog.node_s)]


def run_fast(prog: Program, fold: bool = True) -> Timeline:
    """The executors' semantics computed in issue order, every rank at once (module docstring):
    the walk itself is compiled (``sim.step.executor.walk.walk``), the accounting after it vectorised."""
    n, ranks = prog.work.shape
    eager = prog.eager
    fold = fold and not eager  # the host may hold any eager kernel: no runs
    plan = (prog.steps if prog.steps is not None and prog.steps.fold == fold
            else plan_steps(prog, fold))
    start = np.full((n, ranks), np.nan)
    end = np.full((n, ranks), np.nan)
    stream = np.zeros(ranks)
    comm_free = np.zeros((prog.comm_slots, ranks))  # when each comm slot frees, per rank
    # per compute step, for the accounting after the walk
    k = len(plan.compute_steps)
    held = np.zeros((k, ranks))
    held_cat = np.full(k, _LAUNCH)
    gaps = np.zeros((k, ranks))
    gap_cat = np.empty((k, ranks), dtype=np.int64)
    busy_all = np.zeros((k, ranks))
    work_steps = np.zeros((k, ranks))
    from .walk import walk  # numba loads on the first step, not on import

    walk(*plan.arrays, np.ascontiguousarray(prog.work, dtype=np.float64),
         np.asarray(prog.categories, dtype=np.int64), np.asarray(prog.floor, dtype=np.float64),
         np.asarray(prog.host_sync, dtype=np.bool_),
         np.asarray(prog.host_release_s, dtype=np.float64),
         np.zeros(n, dtype=np.bool_) if prog.quiet is None
         else np.asarray(prog.quiet, dtype=np.bool_), prog.launch_s, eager,
         int(prog.comm_slots), float(prog.slowdown), _LAUNCH,
         start, end, held, held_cat, gaps, gap_cat, busy_all, work_steps, stream, comm_free)
    cats = prog.categories
    work_all = prog.work
    # accounting: idle gaps to what they waited for, busy time to the runs' categories
    cat_count = len(CATEGORIES)
    # sums by (rank, category) in the order np.add.at would add them (bincount adds each bin's
    # weights in index order from 0, as add.at does into zeros), at a fraction of its cost
    rows = np.broadcast_to(np.arange(ranks), gaps.shape)
    breakdown = np.bincount((rows * cat_count + gap_cat).ravel(), weights=gaps.ravel(),
                            minlength=ranks * cat_count).reshape(ranks, cat_count)
    if eager:
        np.add.at(breakdown.T, held_cat, held)
    nodes, share = plan.node_shares
    breakdown[:, _LAUNCH] += nodes.sum()
    breakdown += (busy_all - nodes[:, None]).T @ share
    coll = np.flatnonzero(prog.is_coll)
    cells = np.arange(ranks)[None, :] * cat_count + np.asarray(cats)[coll][:, None]
    comm_busy = np.bincount(cells.ravel(), weights=work_all[coll].ravel(),
                            minlength=ranks * cat_count).reshape(ranks, cat_count)
    slowdown = (busy_all - work_steps).sum(axis=0)
    rank_end = np.maximum(stream, comm_free.max(axis=0))
    return Timeline(start=start, end=end, rank_end=rank_end, breakdown=breakdown,
                    slowdown_s=slowdown, comm_busy=comm_busy)
