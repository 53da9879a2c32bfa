"""Where a search's points run: serial, a local process pool, or a Ray cluster (one registry).

    Executor       ``map(fn, items, progress)`` -> ``[fn(item, cache) for item in items]``, in
                   the items' order whatever order they finish in; a context manager that owns
                   its workers (started on the first ``map``, stopped on exit)
    serial         this process, with the caller's :class:`StepCache`
    pool           ``workers`` local processes (``concurrent.futures``; forkserver where the
                   platform has it, else spawn, so nothing of the parent's state but ``fn`` and
                   the item travels)
    ray            Ray tasks (``pip install 'epsim[ray]'``): ``local`` starts a Ray instance on
                   this machine, ``auto`` or an address joins a running cluster, whose nodes
                   must have epsim installed; an already initialised Ray is used as it is

A point's result depends only on the point (the step simulator seeds each step from the
scenario's seed), so every executor returns what the serial run returns. What may differ is
diagnostic: wall times and how many steps a worker's cache had to simulate (``DIAGNOSTIC_KEYS``,
moved under ``"diagnostics"`` by :func:`split_diagnostics`).

Step caches: serial runs share the caller's cache; each worker process owns one
:class:`StepCache` for its life (the pool's, or the Ray job's). ``map``'s ``group`` keeps items
that share step models (a search's points of one plan, differing in concurrency only) in one task,
run in order in one worker, so a plan's step models are simulated once, not once per worker;
groups are split only while there are fewer tasks than workers (:func:`chunks`). ``fn`` must be a
module-level function (it is pickled by name).

Errors: an :class:`EpsimError` raised by ``fn`` in a worker comes back as a value and is raised
again here with the same one-line message; a worker that dies (e.g. killed for memory) is an
EpsimError too. Any other exception is a bug and propagates as it is.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import multiprocessing.util
import os
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from threadpoolctl import threadpool_limits

from epsim.model.errors import EpsimError
from epsim.sim.scenario import StepCache, run_scenario
from epsim.sim.spec import Scenario

from .lifeline import stop_workers, watch_parent
from .reach import probe

#: the result keys that measure the run rather than the deployment (they may differ between a
#: serial and a parallel run of the same point)
DIAGNOSTIC_KEYS = ("sim_wall_s", "step_sim_calls")

Progress = Callable[[int, int], None] | None
Task = Callable[[Any, StepCache], Any]
Group = Callable[[Any], Hashable] | None


def default_workers() -> int:
    """The cores this process may use (its CPU affinity where the platform reports one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def split_diagnostics(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with its :data:`DIAGNOSTIC_KEYS` moved under ``"diagnostics"``."""
    out = {k: v for k, v in result.items() if k not in DIAGNOSTIC_KEYS}
    out["diagnostics"] = {k: result[k] for k in DIAGNOSTIC_KEYS if k in result}
    return out


@dataclass(frozen=True)
class _Failed:
    """An EpsimError in a worker, carried back as a value (its message)."""

    message: str


_PROCESS_CACHE: StepCache | None = None


def _worker_cache() -> StepCache:
    """The step cache this worker process owns (created on its first point)."""
    global _PROCESS_CACHE
    if _PROCESS_CACHE is None:
        _PROCESS_CACHE = StepCache()
    return _PROCESS_CACHE


def _guarded(fn: Task, item: Any, cache: StepCache) -> Any:
    try:
        return fn(item, cache)
    except EpsimError as exc:
        return _Failed(str(exc))


def run_in_worker(fn: Task, items: Sequence[Any]) -> list[Any]:
    """A task's items in a worker process, in order, with the worker's own cache."""
    cache = _worker_cache()
    return [_guarded(fn, item, cache) for item in items]


def chunks(items: Sequence[Any], group: Group, workers: int) -> list[list[int]]:
    """The items' indices as tasks: one per ``group`` key (first-seen order; every item its own
    task without ``group``), the largest split in halves while there are fewer tasks than
    ``workers``."""
    if group is None:
        return [[i] for i in range(len(items))]
    by_key: dict[Hashable, list[int]] = {}
    for i, item in enumerate(items):
        by_key.setdefault(group(item), []).append(i)
    tasks = list(by_key.values())
    while len(tasks) < workers:
        big = max(range(len(tasks)), key=lambda t: len(tasks[t]))
        if len(tasks[big]) < 2:
            break
        half = len(tasks[big]) // 2
        tasks[big:big + 1] = [tasks[big][:half], tasks[big][half:]]
    return tasks


def run_scenario_task(sc: Scenario, cache: StepCache) -> dict[str, Any]:
    """One scenario as an executor's task (sweep's points)."""
    return run_scenario(sc, cache)


def _unwrap(value: Any) -> Any:
    if isinstance(value, _Failed):
        raise EpsimError(value.message)
    return value


class Executor:
    """The interface (and the serial executor): ``with make_executor(...) as ex: ex.map(...)``."""

    name = "serial"

    def __init__(self, workers: int = 1, address: str | None = None,
                 cache: StepCache | None = None) -> None:
        self.workers, self.address = workers, address
        self.cache = cache if cache is not None else StepCache()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers (nothing to stop here)."""

    def describe(self) -> dict[str, Any]:
        """What ran the points, for the JSON's ``"diagnostics"``."""
        return {"executor": self.name, "workers": self.workers}

    def map(self, fn: Task, items: Sequence[Any], progress: Progress = None,
            group: Group = None) -> list[Any]:
        """``fn(item, cache)`` for each item, in order (``group``: see the module docstring)."""
        out = []
        for n, item in enumerate(items, 1):
            out.append(_unwrap(_guarded(fn, item, self.cache)))
            if progress:
                progress(n, len(items))
        return out


def _start_worker(tempdir: str | None) -> None:
    """A pool worker's start: it watches its command (``lifeline.watch_parent``) and runs
    numpy's BLAS on one thread. The pool has a worker per core, and each worker's own BLAS
    threads oversubscribed them: bench/bench_search.py's 1,008 points took 64.9 s on 2 workers
    with OpenBLAS's default threads, 49.5 s with one (docs/performance.md)."""
    watch_parent(tempdir)
    threadpool_limits(limits=1, user_api="blas")


class PoolExecutor(Executor):
    """``workers`` local processes."""

    name = "pool"

    def __init__(self, workers: int = 1, address: str | None = None,
                 cache: StepCache | None = None) -> None:
        super().__init__(workers, address, cache)
        self._pool: cf.ProcessPoolExecutor | None = None

    def _start(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            methods = multiprocessing.get_all_start_methods()
            ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods
                                              else "spawn")
            if ctx.get_start_method() == "forkserver":
                ctx.set_forkserver_preload(["epsim.sim.scenario"])  # each fork starts warm
            # workers end with this process, even killed (epsim.sim.search.lifeline)
            self._pool = cf.ProcessPoolExecutor(
                max_workers=self.workers, mp_context=ctx, initializer=_start_worker,
                initargs=(multiprocessing.util.get_temp_dir(),))
        return self._pool

    def __exit__(self, exc_type: object, *_exc: object) -> None:
        if exc_type is not None and self._pool is not None:  # a signal or error mid-search:
            stop_workers(self._pool)  # no point waiting for points nobody will read
            self._pool = None
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def map(self, fn: Task, items: Sequence[Any], progress: Progress = None,
            group: Group = None) -> list[Any]:
        pool = self._start()
        tasks = chunks(items, group, self.workers)
        futures = {pool.submit(run_in_worker, fn, [items[i] for i in task]): task
                   for task in tasks}
        out: list[Any] = [None] * len(items)
        done = 0
        try:
            for fut in cf.as_completed(futures):
                for i, value in zip(futures[fut], fut.result(), strict=True):
                    out[i] = value
                done += len(futures[fut])
                if progress:
                    progress(done, len(items))
        except cf.process.BrokenProcessPool:
            self._pool = None
            raise EpsimError(f"a search worker process died (out of memory?); try fewer than "
                             f"--workers {self.workers}") from None
        return [_unwrap(v) for v in out]


class RayExecutor(Executor):
    """Ray tasks on a local instance (``local``) or a cluster (``auto``, ``ray://HOST:PORT``)."""

    name = "ray"

    def __init__(self, workers: int = 1, address: str | None = None,
                 cache: StepCache | None = None) -> None:
        super().__init__(workers, address, cache)
        self._started = False
        self._task: Any = None

    def _start(self) -> Any:
        try:
            import ray
        except ImportError:
            raise EpsimError("--ray needs Ray (pip install 'epsim[ray]')") from None
        if not ray.is_initialized():
            address = None if self.address in (None, "local") else self.address
            if address is not None:
                probe(address)  # nothing there: one line now, not minutes of Ray's retries
            try:
                ray.init(address=address, log_to_driver=False, include_dashboard=False,
                         logging_level="ERROR")
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise EpsimError(f"--ray {self.address}: cannot start or reach Ray "
                                 f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
                                 ) from None
            self._started = True
        if self._task is None:
            self._task = ray.remote(run_in_worker)
        return ray

    def describe(self) -> dict[str, Any]:
        return {"executor": self.name, "address": self.address or "local"}

    def close(self) -> None:
        if self._started:
            import ray
            ray.shutdown()
            self._started = False

    def map(self, fn: Task, items: Sequence[Any], progress: Progress = None,
            group: Group = None) -> list[Any]:
        ray = self._start()
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        tasks = {self._task.remote(fn, [items[i] for i in task]): task
                 for task in chunks(items, group, cpus)}
        out: list[Any] = [None] * len(items)
        pending, done = list(tasks), 0
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                for i, value in zip(tasks[ref], _ray_values(ray, ref), strict=True):
                    out[i] = value
                done += len(tasks[ref])
                if progress:
                    progress(done, len(items))
        return [_unwrap(v) for v in out]


def _ray_values(ray: Any, ref: Any) -> list[Any]:
    """A Ray task's results; a worker or node that died on the way is one line, as the pool's."""
    died = tuple(getattr(ray.exceptions, name) for name in (
        "WorkerCrashedError", "NodeDiedError", "OutOfMemoryError", "LocalRayletDiedError")
        if hasattr(ray.exceptions, name))
    try:
        return ray.get(ref)
    except died as exc:
        raise EpsimError(f"a Ray worker died while evaluating points ({type(exc).__name__}); "
                         "see the Ray dashboard or logs for why") from None


#: every executor by name
EXECUTORS: dict[str, type[Executor]] = {"serial": Executor, "pool": PoolExecutor,
                                        "ray": RayExecutor}


def make_executor(workers: int | None = None, ray: str | None = None,
                  cache: StepCache | None = None) -> Executor:
    """The executor the flags ask for: ``ray`` (an address, ``auto`` or ``local``) wins; else
    a pool of ``workers`` processes (``None``: :func:`default_workers`), serial at 1."""
    if ray is not None:
        return EXECUTORS["ray"](address=ray, cache=cache)
    n = default_workers() if workers is None else workers
    if n < 1:
        raise EpsimError(f"workers must be at least 1, got {n}")
    return EXECUTORS["serial" if n == 1 else "pool"](workers=n, cache=cache)
