"""How a search picks its points: every one (grid) or optuna's sampler (one registry).

    grid     every point of the space, in :meth:`SearchSpace.points` order
    optuna   optuna's TPE sampler (``pip install 'epsim[optuna]'``): ``trials`` asks, each point
             a categorical choice per searched dimension, maximising the objective with the SLO
             as a constraint (each term's relative violation, <= 0 when met); seeded by the
             workload's seed; a point asked twice is simulated once
    bisect   each deployment's highest concurrency or request rate meeting the SLO, by
             bisection as ``vllm bench sweep serve_sla`` (``epsim.sim.search.bisect``)
    auto     grid when the space has at most ``GRID_MAX_POINTS`` points, else optuna

Determinism: optuna asks ``OPTUNA_BATCH`` points at a time (a constant, not the worker count),
they run together on the executor, and are told in ask order, so the trials, and therefore the
result, are the same on 1 worker, 16 or a cluster.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from epsim.model.errors import EpsimError

from .bisect import bisect_search
from .slo import SLO

#: the largest space ``auto`` searches exhaustively (about a minute of tune on 16 cores at the
#: reference's 2-4 s a point); larger spaces go to optuna
GRID_MAX_POINTS = 256
#: optuna's trials when ``--trials`` is not given
DEFAULT_TRIALS = 128
#: points optuna asks for at once (independent of the workers, so results do not depend on them)
OPTUNA_BATCH = 8
STRATEGIES = ("auto", "grid", "optuna", "bisect")

#: one point's outcome: ``("ok", result)`` or ``("skip", reason)``
Outcome = tuple[str, Any]
#: runs a batch of points -> their outcomes, in order (reporting progress over the batch)
Evaluate = Callable[[Sequence[dict[str, Any]], Callable[[int, int], None] | None], list[Outcome]]


def choose(strategy: str, size: int) -> str:
    """The strategy ``auto`` stands for at ``size`` points; the others as they are."""
    if strategy not in STRATEGIES:
        raise EpsimError(f"search must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if strategy == "auto":
        return "grid" if size <= GRID_MAX_POINTS else "optuna"
    return strategy


def grid(points: Sequence[dict[str, Any]], evaluate: Evaluate,
         progress: Callable[[int, int], None] | None, **_: Any
         ) -> list[tuple[dict[str, Any], Outcome]]:
    """Every point, in order."""
    return list(zip(points, evaluate(points, progress), strict=True))


def constraint_values(slo: SLO, result: Mapping[str, Any]) -> list[float]:
    """Each SLO term's violation relative to its bound (<= 0: met), optuna's constraint."""
    out = []
    for key, op, bound in slo.terms:
        value = float(result[key])
        scale = max(abs(bound), 1e-9)
        out.append((value - bound) / scale if op in ("<=", "<") else (bound - value) / scale)
    return out


def _point_key(point: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(sorted(point.items()))


def optuna_search(points: Sequence[dict[str, Any]], evaluate: Evaluate,
                  progress: Callable[[int, int], None] | None, *, dimensions:
                  Sequence[tuple[str, tuple[Any, ...]]], objective: str, slo: SLO,
                  trials: int, seed: int, point_at: Callable[[Mapping[str, Any]], dict[str, Any]],
                  **_: Any) -> list[tuple[dict[str, Any], Outcome]]:
    """``trials`` asks of optuna's TPE sampler; each distinct point once, in first-ask order."""
    optuna = _import_optuna()
    study = optuna.create_study(direction="maximize", sampler=_sampler(optuna, seed, trials))
    seen: dict[tuple[Any, ...], Outcome] = {}
    order: list[tuple[dict[str, Any], Outcome]] = []
    asked = 0
    while asked < trials:
        batch = [study.ask() for _ in range(min(OPTUNA_BATCH, trials - asked))]
        picked = [point_at({name: values[t.suggest_categorical(name, list(range(len(values))))]
                            for name, values in dimensions}) for t in batch]
        fresh = list({_point_key(p): p for p in picked if _point_key(p) not in seen}.values())
        for p, outcome in zip(fresh, evaluate(fresh, None), strict=True):
            seen[_point_key(p)] = outcome
            order.append((p, outcome))
        for t, p in zip(batch, picked, strict=True):
            _tell(study, t, seen[_point_key(p)], objective, slo, optuna)
        asked += len(batch)
        if progress:
            progress(asked, trials)
    return order


def _tell(study: Any, trial: Any, outcome: Outcome, objective: str, slo: SLO,
          optuna: Any) -> None:
    kind, value = outcome
    if kind != "ok":
        _constrain(trial, [1.0] * len(slo.terms))
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        return
    _constrain(trial, constraint_values(slo, value))
    score = float(value[objective])
    study.tell(trial, score if math.isfinite(score) else 0.0)


def _sampler(optuna: Any, seed: int, trials: int) -> Any:
    """TPE, seeded, with the constant liar so a batch asked together spreads out."""
    # optuna 5 reads constraints set on the trial; older releases ask a constraints_func
    legacy = {} if hasattr(optuna.trial.Trial, "set_constraint") else {
        "constraints_func": lambda t: t.user_attrs["constraints"]}
    with warnings.catch_warnings():  # constant_liar (and constraints_func) are "experimental"
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, constant_liar=True,
                                          n_startup_trials=min(10, max(1, trials // 4)),
                                          **legacy)


def _constrain(trial: Any, values: Sequence[float]) -> None:
    if hasattr(trial, "set_constraint"):
        for i, v in enumerate(values):
            trial.set_constraint(f"slo{i}", v)
    else:
        trial.set_user_attr("constraints", list(values))


def _import_optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise EpsimError("--search optuna needs optuna (pip install 'epsim[optuna]')") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no line per trial on stderr
    return optuna


#: every strategy that picks points, by name (``auto`` resolves to one of them: :func:`choose`)
SEARCHES: dict[str, Callable[..., list[tuple[dict[str, Any], Outcome]]]] = {
    "grid": grid, "optuna": optuna_search, "bisect": bisect_search}
