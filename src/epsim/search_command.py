"""The skeleton ``epsim tune`` and ``epsim plan`` share: the parser (a scenario, the SLO and
search space, where the points run, the frontier chart), the checks before any point runs, the
search itself (its work budget, the progress bar, the executor) and the outputs (``--plot``,
``--frontier-csv``, one ``--json`` object or the text). Each command keeps what differs: its
own flags, the search it calls and how it reports the answer.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from epsim.sim.scenario import Scenario
from epsim.sim.search.executors import Executor
from epsim.sim.search.tune import SearchOptions, SearchSpace

from .common import Progress, emit_json
from .frontier_chart import (
    add_frontier_args,
    check_prices,
    require_matplotlib,
    write_frontier_outputs,
)
from .search_args import (
    DEFAULT_SEARCH_HARDWARE,
    add_search_args,
    executor_from_args,
    search_base_from_args,
    search_diagnostics,
    search_options_from_args,
    search_space_from_args,
)
from .work import check_search

T = TypeVar("T")
#: adds a command's own flags to its parser
FlagAdder = Callable[[argparse.ArgumentParser], None]


def add_search_parser(subparsers: argparse._SubParsersAction, name: str, *, help: str,
                      description: str, run: Callable[[argparse.Namespace], int],
                      before: Iterable[FlagAdder] = (), after: Iterable[FlagAdder] = (),
                      prices: bool = True) -> argparse.ArgumentParser:
    """A search command's parser: ``before`` (its own flags first), the search's flags
    (``search_args.add_search_args``), ``after``, the frontier chart's flags (``prices``: with
    tune's ``--gpu-hour-usd``; plan defines its own)."""
    p = subparsers.add_parser(name, help=help, description=description)
    for add in before:
        add(p)
    add_search_args(p)
    for add in after:
        add(p)
    add_frontier_args(p, prices=prices)
    p.set_defaults(run=run)
    return p


@dataclass(frozen=True)
class SearchInputs:
    """What the flags of a search say, checked before any point runs."""

    hardware: list[str]
    space: SearchSpace
    base: Scenario


def search_inputs(args: argparse.Namespace, *, units: bool = False,
                  check: Callable[[list[str]], None] | None = None) -> SearchInputs:
    """The hardware searched (default ``DEFAULT_SEARCH_HARDWARE``), the search space
    (``units``: plan's) and the base scenario, after the checks every search makes (prices
    for hardware that is run, matplotlib for ``--plot``) and the command's own ``check``
    (given the hardware)."""
    space = search_space_from_args(args, units=units)
    hardware = list(args.hardware or (DEFAULT_SEARCH_HARDWARE,))
    if check is not None:
        check(hardware)
    check_prices(args.gpu_hour_usd, hardware)
    if args.plot:
        require_matplotlib()
    return SearchInputs(hardware, space, search_base_from_args(args, hardware[0]))


@dataclass(frozen=True)
class Searched(Generic[T]):
    """A finished search: its result, and what ran it (the JSON's ``diagnostics``)."""

    result: T
    executor: Executor
    started: float

    def diagnostics(self, strategy: str) -> dict[str, Any]:
        return search_diagnostics(self.executor, strategy, time.perf_counter() - self.started)


def run_search(command: str, args: argparse.Namespace, inputs: SearchInputs,
               search: Callable[[SearchOptions, Progress], T], *, units: int = 1) -> Searched[T]:
    """``search(options, progress)`` within the work budget (``work.check_search``: ``units``
    searches of the space), on the executor ``--workers`` / ``--ray`` ask for, with a progress
    bar on stderr (none under ``--json``)."""
    check_search(command, args, inputs.base, inputs.space, units=units)
    bar = Progress(command, enabled=not args.json)
    started = time.perf_counter()
    try:
        with executor_from_args(args) as executor:
            result = search(search_options_from_args(args, executor), bar)
    finally:
        bar.close()
    return Searched(result, executor, started)


def finish(command: str, args: argparse.Namespace, points: Sequence[Mapping[str, Any]],
           first: Mapping[str, Any] | None, as_json: Callable[[], dict[str, Any]],
           as_text: Callable[[], None]) -> int:
    """The frontier chart and CSV of ``points`` where asked (``first``: the search's first
    point, for the chart's title), then one JSON object or the text."""
    if points and first is not None:
        write_frontier_outputs(args, points, first, command, args.slo)
    if args.json:
        emit_json(as_json())
    else:
        as_text()
    return 0
