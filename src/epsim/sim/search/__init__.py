"""Searches over scenarios: tuning one deployment for an SLO and planning capacity.

    slo.py        service-level objectives: bounds on a run's metric keys (``SLO``)
    tune.py       every point of a search space run, the best within the SLO and the frontier
    capacity.py   how many deployment units serve a target throughput within the SLO
    frontier.py   throughput per GPU against tok/s per user: the Pareto points per series
    samplers.py   how a search picks its points: the grid, optuna's samplers or bisection (a
                  registry)
    bisect.py     each deployment's highest concurrency or request rate within the SLO, by
                  bisection as ``vllm bench sweep serve_sla``
    executors.py  where points run: serial, a process pool, a Ray cluster (a registry)
    lifeline.py   a pool's workers end with their command, even killed; signals are its own
    reach.py      a Ray address probed before Ray is asked: nothing there is one line in 5 s

Uses the root's ``epsim.sim.scenario`` and ``epsim.sim.serving.metrics``.
"""

from .capacity import CapacityPlan, plan_capacity
from .slo import SLO, parse_slo
from .tune import SearchOptions, SearchSpace, TuneResult, tune

__all__ = ["SLO", "CapacityPlan", "SearchOptions", "SearchSpace", "TuneResult", "parse_slo",
           "plan_capacity", "tune"]
