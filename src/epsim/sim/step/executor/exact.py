"""The exact executor: the executors' semantics (``sim.step.executor.program``'s docstring) as a
discrete-event simulation (simpy), every op of every rank.

    run_exact   one compute process and one communication process per rank (and a host process
                when eager), a barrier per collective and group, comm-interference rate changes
                as events
    attribute   per-op start and end times -> the step's ``Timeline`` and its breakdown

``run_fast`` (``sim.step.executor.program``) computes the same times in issue order; a test checks that
the two agree.
"""

from __future__ import annotations

import numpy as np
import simpy

from .program import _LAUNCH, CATEGORIES, Program, Timeline


class _Barrier:
    """Members of one collective group arriving; fires when the last one has."""

    def __init__(self, env: simpy.Environment, size: int) -> None:
        self.left = size
        self.event = env.event()

    def arrive(self) -> simpy.Event:
        self.left -= 1
        if self.left == 0:
            self.event.succeed()
        return self.event


class _ExactRun:
    """One program's simulation: its events, per-op times and the ranks' processes.

    start / end / issue: ``[ops, ranks]`` when each op started, ended and was issued.
    done / begun / issued: ``[ops][ranks]`` events: an op ended, a collective started (its
        group complete), the host issued an op (eager only; None in a captured graph).
    comm_active: ``[ranks]`` collectives in flight that occupy compute units.
    comm_change: ``[ranks]`` the event that fires when that count next changes.
    """

    def __init__(self, prog: Program) -> None:
        n, ranks = prog.work.shape
        self.prog, self.n, self.ranks = prog, n, ranks
        self.env = env = simpy.Environment()
        self.start = np.full((n, ranks), np.nan)
        self.end = np.full((n, ranks), np.nan)
        self.done = [[env.event() for _ in range(ranks)] for _ in range(n)]
        self.comm_active = [0] * ranks
        self.slots = [simpy.Resource(env, capacity=prog.comm_slots) for _ in range(ranks)]
        self.comm_change = [env.event() for _ in range(ranks)]
        self.barriers: dict[tuple[int, int], _Barrier] = {}
        self.compute_ops = [i for i in range(n) if not prog.is_coll[i]]
        self.coll_ops = [i for i in range(n) if prog.is_coll[i]]
        self.eager = prog.eager
        self.issued = ([[env.event() for _ in range(ranks)] for _ in range(n)] if self.eager
                       else None)
        self.begun = [[env.event() for _ in range(ranks)] for _ in range(n)]
        self.issue = np.tile(prog.floor[:, None], (1, ranks))

    def run(self) -> Timeline:
        for r in range(self.ranks):
            if self.eager:
                self.env.process(self.host(r))
            self.env.process(self.compute(r))
            self.env.process(self.communicate(r))
        self.env.run()
        return attribute(self.prog, self.start, self.end, self.issue)

    def host(self, rank: int):
        """Eager: the host launches every op in issue order and waits on the syncs."""
        prog, env = self.prog, self.env
        for i in range(self.n):
            if prog.launch_s[i] > 0.0:
                yield env.timeout(prog.launch_s[i])
            if prog.floor[i] > env.now:
                yield env.timeout(prog.floor[i] - env.now)
            self.issue[i, rank] = env.now
            self.issued[i][rank].succeed()
            if prog.host_sync[i] and not prog.is_coll[i]:
                if not self.done[i][rank].processed:
                    yield self.done[i][rank]
            elif prog.host_sync[i]:
                if not self.begun[i][rank].processed:
                    yield self.begun[i][rank]
                release = self.start[i, rank] + prog.host_release_s[i]
                if release > env.now:
                    yield env.timeout(release - env.now)

    def wait_issue(self, i: int, rank: int):
        if self.eager:
            if not self.issued[i][rank].processed:
                yield self.issued[i][rank]
        elif self.prog.floor[i] > self.env.now:
            yield self.env.timeout(self.prog.floor[i] - self.env.now)

    def flip(self, rank: int, delta: int) -> None:
        self.comm_active[rank] += delta
        old = self.comm_change[rank]
        self.comm_change[rank] = self.env.event()
        old.succeed()

    def compute(self, rank: int):
        """The compute stream: ops in issue order, slowed while a collective holds CUs."""
        prog, env, s = self.prog, self.env, self.prog.slowdown
        for i in self.compute_ops:
            for d in prog.deps[i]:
                if not self.done[d][rank].processed:
                    yield self.done[d][rank]
            yield from self.wait_issue(i, rank)
            self.start[i, rank] = env.now
            w = prog.work[i, rank]
            while w > 0.0:
                rate = (1.0 - s) if self.comm_active[rank] else 1.0
                t0 = env.now
                timer = env.timeout(w / rate)
                change = self.comm_change[rank]
                yield timer | change
                if timer.processed or (timer.triggered and env.now >= t0 + w / rate):
                    w = 0.0
                else:
                    w -= (env.now - t0) * rate
                    if w <= 1e-15:
                        w = 0.0
            self.end[i, rank] = env.now
            self.done[i][rank].succeed()

    def communicate(self, rank: int):
        """The communication engine: collectives in issue order, each on a free slot."""
        prog = self.prog
        for i in self.coll_ops:
            for d in prog.deps[i]:
                if not self.done[d][rank].processed:
                    yield self.done[d][rank]
            yield from self.wait_issue(i, rank)
            slot = self.slots[rank].request()
            yield slot
            self.env.process(self.collective(i, rank, slot))

    def collective(self, i: int, rank: int, slot: simpy.resources.resource.Request):
        """One member of a collective: waits for its group, then lasts its duration."""
        prog, env = self.prog, self.env
        g = int(prog.group_size[i])
        key = (i, rank // g)
        if key not in self.barriers:
            self.barriers[key] = _Barrier(env, g)
        yield self.barriers[key].arrive()
        self.start[i, rank] = env.now
        self.begun[i][rank].succeed()
        holds = prog.quiet is None or not prog.quiet[i]  # its kernel occupies compute units
        if holds:
            self.flip(rank, 1)
        yield env.timeout(prog.work[i, rank])
        if holds:
            self.flip(rank, -1)
        self.end[i, rank] = env.now
        self.done[i][rank].succeed()
        self.slots[rank].release(slot)


def run_exact(prog: Program) -> Timeline:
    """The executors' semantics as a discrete-event simulation (simpy), every op of every rank."""
    return _ExactRun(prog).run()


def attribute(prog: Program, start: np.ndarray, end: np.ndarray,
              issue: np.ndarray | None = None) -> Timeline:
    """Breakdown of per-op start/end times (every op timed) as in the module docstring."""
    n, ranks = prog.work.shape
    breakdown = np.zeros((ranks, len(CATEGORIES)))
    comm_busy = np.zeros((ranks, len(CATEGORIES)))
    slowdown = np.zeros(ranks)
    stream = np.zeros(ranks)
    comm_end = np.zeros(ranks)
    cats = prog.categories
    rows = np.arange(ranks)
    sync_end = np.zeros(ranks)
    sync_cat = _LAUNCH
    for i in range(n):
        if prog.is_coll[i]:
            comm_busy[:, cats[i]] += end[i] - start[i]
            comm_end = np.maximum(comm_end, end[i])
            if prog.host_sync[i]:
                # the ops issued after this one were issued after its count exchange
                sync_end, sync_cat = start[i] + prog.host_release_s[i], cats[i]
            continue
        wait_cat = np.full(ranks, _LAUNCH)
        wait_end = np.full(ranks, prog.floor[i]) if issue is None else issue[i]
        for d in prog.deps[i]:
            if prog.is_coll[d]:
                later = end[d] > wait_end
                wait_cat = np.where(later, cats[d], wait_cat)
                wait_end = np.maximum(wait_end, end[d])
        gap = start[i] - stream
        # waiting for a host that was itself waiting on a sync: that part is the sync's
        hold = np.where(wait_cat == _LAUNCH,
                        np.clip(np.minimum(sync_end, start[i]) - stream, 0.0, None), 0.0)
        breakdown[:, sync_cat] += hold
        np.add.at(breakdown, (rows, wait_cat), gap - hold)
        busy = end[i] - start[i]
        breakdown[:, _LAUNCH] += prog.node_s
        breakdown[:, cats[i]] += busy - prog.node_s
        slowdown += busy - prog.work[i]
        stream = end[i]
        if prog.host_sync[i]:
            sync_end, sync_cat = end[i], cats[i]
    return Timeline(start=start, end=end, rank_end=np.maximum(stream, comm_end),
                    breakdown=breakdown, slowdown_s=slowdown, comm_busy=comm_busy)

