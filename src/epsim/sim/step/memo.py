"""What the step simulator keeps between calls: ``StepMemo``, held by one owner.

Glossary:
    owner       whoever makes a ``StepMemo`` and passes it to every ``simulate_step`` call that
                may share work: one serving run's step models (``epsim.sim.scenario.StepCache``
                makes one and hands it to each model it holds), a validation grid, a bench
                script. A call given none gets a fresh one and shares nothing. Never a module.
    kept value  every entry is the value a fresh computation gives (same draws from the same
                seed, same functions of the same ops in the same order), so what a memo holds
                changes how long a step takes to simulate, never its result.
    LRU         each table keeps its most recently used entries up to its size (``remember``).

Keys that hold an object's ``id()`` (a placement, a structure, an op graph) are used only
together with a reference to that very object, checked on every hit, so a recycled id never
answers for another object.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

#: compiled steps (and structures) kept: a serving run's grid points beyond it are recosted
CACHE_SIZE = 64
#: op costs kept across batches (a few new ones per batch: its attention's)
OP_CACHE_SIZE = 8192
#: samples kept (about 0.36 MB each for DeepSeek-R1 on 8 GPUs): a batch's variants (graph or
#: eager, with a prefill or not) ask for its sample close together, so a few suffice (a
#: 40,960-request open loop draws 157 samples for 467 step simulations keeping 4, 144 keeping 64)
SAMPLES_KEPT = 8
#: routed times kept (about 7 kB each): a serving run's distinct batches, with room to spare
ROUTED_KEPT = 1024
#: uniform-routing collective times kept (one per distinct exchange op and profile)
NOMINAL_KEPT = 4096


def remember(cache: OrderedDict, key: tuple, value: Any, size: int = CACHE_SIZE) -> Any:
    """Put ``value`` in the LRU ``cache`` under ``key``, dropping the oldest past ``size``."""
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > size:
        cache.popitem(last=False)
    return value


def _table() -> OrderedDict:
    return OrderedDict()


@dataclass(eq=False)
class StepMemo:
    """The step simulator's kept values, one LRU table each (module docstring).

    Inputs (``sim.step.simulate``):
    placements: ``(loads key, gpus, eplb, redundant) -> Placement`` the default placement of a
        load matrix. Example key: ``(("9f2c...", (61, 256)), 8, True, 0)``.
    frequencies: ``(loads key, id(placement)) -> (placement, [moe_layers, slots])`` each slot's
        pair probabilities (the placement itself kept to check the id).
    synthetic: ``(model, kind) -> ([layers, experts] loads, loads key)`` the synthetic loads
        (read-only arrays, shared by every call) with their digest.

    The compiled step (``sim.step.compile``):
    compiled: ``(model, plan, batch, profile fingerprint) -> Compiled`` (``CACHE_SIZE``).
    structures: ``(model, plan, phase, microbatches, profile fingerprint) -> structure``
        (``CACHE_SIZE``).
    op_seconds: ``(costing context, *op cost key) -> seconds`` one op's cost-model time
        (``OP_CACHE_SIZE``). Example value: ``4.1e-05``.
    costed: ``(id(structure), phase, seqs, new tokens per seq) -> costing`` a batch's
        representative ops and their seconds, for batches differing from it in context alone
        (``CACHE_SIZE``).

    The routing (``sim.step.routed``):
    samples: ``(model, loads key, id(placement), mb tokens, draft tokens, ranks, seed) ->
        sample`` (``SAMPLES_KEPT``).
    routed: ``(sample key, id(graph), ...) -> routed times`` the routed ops' seconds under a
        sample (``ROUTED_KEPT``).
    nominal: ``(context, kind, peer bytes, dims) -> seconds`` an exchange op's time under
        uniform routing (``NOMINAL_KEPT``).
    """

    placements: OrderedDict = field(default_factory=_table)
    frequencies: OrderedDict = field(default_factory=_table)
    synthetic: OrderedDict = field(default_factory=_table)
    compiled: OrderedDict = field(default_factory=_table)
    structures: OrderedDict = field(default_factory=_table)
    op_seconds: OrderedDict = field(default_factory=_table)
    costed: OrderedDict = field(default_factory=_table)
    samples: OrderedDict = field(default_factory=_table)
    routed: OrderedDict = field(default_factory=_table)
    nominal: OrderedDict = field(default_factory=_table)
