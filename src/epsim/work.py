"""Work estimated before it starts, and refused past a stated budget unless ``--force``.

A sweep of 10^6 points or a benchmark of 10^7 ShareGPT requests is a valid request that runs
for hours and holds gigabytes; a user who mistyped a list should hear so at once, not after
the machine started swapping. So predict, sweep, tune and plan estimate their work from the
flags alone, before any scenario is simulated (nothing is sampled or built to count it):

    points      serving simulations the command runs: sweep's grid (every list's length
                multiplied); a search's grid (``--search grid``, or ``auto`` up to
                ``GRID_MAX_POINTS``), its optuna trials or its bisections' probe budget
                (``probe_budget``: deployments x the most probes each); plan's, once per unit
                (each hardware x unit layout); predict: 1
    requests    requests simulated over all points: each point's ``--num-prompts``, else its
                concurrency (a burst run), else the steady window's first sizing
                (``steady_num_prompts`` at the deployment's GPUs as ranks); a trace without
                ``--num-prompts`` counts its bound, not its rows (not read here)
    memory      the largest point's requests x ``BYTES_PER_REQUEST`` x the points that run
                at once (the workers)

The budget (:data:`BUDGET`) is far above what a real study asks (a reference tune is 26
points and about 10^5 requests) and far below what never finishes. Over it, the command is
refused in one line naming the estimate and the budget; ``--force`` runs it anyway.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, replace

from epsim.model.errors import EpsimError
from epsim.sim.search.tune import SearchSpace
from epsim.sim.serving.window import steady_num_prompts
from epsim.sim.spec import Scenario

#: bytes of memory one simulated request holds while its point runs (its lengths, times and
#: per-request metrics): measured on this project's build machine as the peak RSS growth of
#: ``epsim predict --model deepseek-r1 --hardware mi300x --concurrency 256`` from 2,000 to
#: 200,000 requests (105 MB over 198,000 requests: 530 B), rounded up
BYTES_PER_REQUEST = 600

#: the GPUs per node a deployment is assumed to have when the flags do not say (the steady
#: window's sizing counts ranks)
ASSUMED_GPUS_PER_NODE = 8


@dataclass(frozen=True)
class WorkBudget:
    """What a command may do without ``--force``.

    points: serving simulations (10^4: hours of CPU at the reference's seconds a point).
    requests: simulated requests over all points (4 x 10^6: about 15 minutes of one core at
    the measured ~0.2 ms a request). memory_fraction: of this machine's physical memory.
    """

    points: int = 10_000
    requests: int = 4_000_000
    memory_fraction: float = 0.5


BUDGET = WorkBudget()


@dataclass(frozen=True)
class WorkEstimate:
    points: int
    requests: int
    memory_bytes: int


def add_force_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    from .inputs import HELP

    # the budget's figures are stated in the one help text (epsim.inputs.HELP)
    parser.add_argument("--force", action="store_true", help=HELP["--force"].replace("%", "%%"))


def physical_memory() -> int:
    """This machine's memory in bytes (0 where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0


def point_requests(sc: Scenario) -> int:
    """The requests one point of ``sc`` simulates (see the module docstring)."""
    w = sc.workload
    if w.num_prompts is not None:
        return w.num_prompts
    if w.measure == "steady":
        gpus = (sc.deployment.plan.nodes or 1) * (sc.deployment.plan.gpus_per_node or ASSUMED_GPUS_PER_NODE)
        return steady_num_prompts(w.concurrency, gpus)
    return w.concurrency or 1


def estimate(per_point: Iterable[tuple[int, int]], parallel: int) -> WorkEstimate:
    """The work of ``(points, requests each)`` groups, ``parallel`` points at once."""
    groups = [(n, r) for n, r in per_point if n > 0]
    points = sum(n for n, _ in groups)
    requests = sum(n * r for n, r in groups)
    largest = max((r for _, r in groups), default=0)
    memory = largest * BYTES_PER_REQUEST * max(1, min(parallel, points))
    return WorkEstimate(points, requests, memory)


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def check(command: str, work: WorkEstimate, force: bool, budget: WorkBudget = BUDGET,
          memory: int | None = None, hint: str = "narrow the lists or --num-prompts") -> None:
    """One line when ``work`` is past ``budget`` and not ``force``d (``hint``: what to change)."""
    memory = physical_memory() if memory is None else memory
    over = []
    if work.points > budget.points:
        over.append(f"{work.points:,} points (budget {budget.points:,})")
    if work.requests > budget.requests:
        over.append(f"{work.requests:,} simulated requests (budget {budget.requests:,})")
    if memory and work.memory_bytes > budget.memory_fraction * memory:
        over.append(f"about {_gb(work.memory_bytes)} of memory (budget "
                    f"{budget.memory_fraction:.0%} of this machine's {_gb(memory)})")
    if over and not force:
        raise EpsimError(f"{command} would run {'; '.join(over)}: {hint}, or add --force to "
                         "run it anyway")


def search_points(space: SearchSpace, strategy: str, trials: int | None,
                  variable: str | None = None) -> int:
    """The points a search of ``space`` evaluates at most: the search's own plan of points
    (``tune.planned_points``: its grid, optuna's asks, or the bisections' probe budget), an
    optuna point asked twice simulated once (so at most the space)."""
    from epsim.sim.search.samplers import choose
    from epsim.sim.search.tune import SearchOptions, planned_points

    planned = planned_points(space, SearchOptions(strategy=strategy, trials=trials,
                                                  variable=variable or "max_concurrency"))
    return planned if choose(strategy, space.size()) == "bisect" \
        else min(planned, space.size())


def workers_of(args: argparse.Namespace) -> int:
    if getattr(args, "ray", None) is not None:
        return 1  # points run on the cluster's nodes, not in this machine's memory
    from epsim.sim.search.executors import default_workers

    return args.workers if getattr(args, "workers", None) else default_workers()


def check_search(command: str, args: argparse.Namespace, base: Scenario, space: SearchSpace,
                 units: int = 1) -> None:
    """tune's and plan's work: ``units`` searches of ``space``, its concurrencies equally
    often."""
    points = units * search_points(space, args.search, args.trials,
                                   getattr(args, "sla_variable", None))
    each = points / max(1, len(space.concurrency))
    groups = []
    for c in space.concurrency:
        w = base.workload
        own = w.num_prompts if w.kind.replays else None if w.measure == "steady" else c
        sc = base.with_(workload=replace(w, concurrency=c,
                                         num_prompts=args.num_prompts or own))
        groups.append((math.ceil(each), point_requests(sc)))
    check(command, estimate(groups, workers_of(args)), args.force)


def check_grid(command: str, args: argparse.Namespace, lists: dict[str, list]) -> None:
    """sweep's work: every combination of ``lists`` (``concurrency`` among them)."""
    from .options import scenario_from_args

    points = math.prod(len(v) for v in lists.values())
    each = points // max(1, len(lists["concurrency"]))
    groups = [(each, point_requests(scenario_from_args(
        args, **{k: v[0] for k, v in lists.items() if k != "concurrency"}, concurrency=c)))
        for c in lists["concurrency"]]
    check(command, estimate(groups, workers_of(args)), args.force)


@dataclass(frozen=True)
class BalanceBudget:
    """What ``balance`` may do without ``--force``. Its cost grows faster than the experts of
    a layer (one layer of 2^16 experts over 8 GPUs: 3.6 s; of 2^18: 27 s, measured on the
    loaded 2-core build machine), so the budget bounds a layer's experts and the cells
    (snapshots x layers x experts) in all: 2^16 experts, as the largest real MoE by far, and
    2^22 cells, 16 times DeepSeek-V3's 58 x 256 with 256 snapshots' worth of room."""

    experts: int = 2**16
    cells: int = 2**22


BALANCE_BUDGET = BalanceBudget()


def check_balance(shape: tuple[int, ...], force: bool,
                  budget: BalanceBudget = BALANCE_BUDGET) -> None:
    """One line when a load array of ``shape`` (``[snapshots,] layers, experts``) is past the
    budget and not ``force``d; called after the file is read, before any balancing."""
    cells, experts = math.prod(shape), shape[-1]
    over = []
    if experts > budget.experts:
        over.append(f"{experts:,} experts a layer (budget {budget.experts:,})")
    if cells > budget.cells:
        over.append(f"{cells:,} loads in all (budget {budget.cells:,})")
    if over and not force:
        raise EpsimError(f"balance would place {'; '.join(over)}: add --force to run it "
                         "anyway")


#: bytes ``step`` holds per pair of ranks of its largest collective group (the collective
#: models' rank x rank float64 matrices and their temporaries): measured as the peak RSS growth
#: of ``step --nodes 512 --redundant-experts 3840`` (ep 4096: 460 MB) and ``--nodes 1024
#: --redundant-experts 7936`` (ep 8192: 1.8 GB), 27 B a pair, rounded up
STEP_BYTES_PER_RANK_PAIR = 32


def check_step(ep: int, tp: int, force: bool, memory: int | None = None) -> None:
    """``step``'s memory: its largest collective group's rank pairs (``--nodes 4096`` at ep
    32768 would need about 34 GB), refused in one line past the budget unless ``force``d."""
    ranks = max(ep, tp)
    check("step", WorkEstimate(1, 0, ranks * ranks * STEP_BYTES_PER_RANK_PAIR), force,
          memory=memory, hint=f"a smaller expert-parallel group than {ranks:,} GPUs")
