"""Expert-parallel load balancing: placing experts on GPUs so every GPU carries the same load.

The public entry point is :func:`balance_placement`. Algorithms are registered in ``BALANCERS``:

    greedy     heaviest expert first onto the least-loaded GPU that still has a free slot
               (the public baseline).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .errors import EpsimError
from .placement import Placement


def greedy_groups(weights: np.ndarray, num_groups: int) -> np.ndarray:
    """Heaviest-first packing into groups of exactly ``n / num_groups`` items.

    Args:
        weights: ``[layers, n]`` non-negative item weights.
        num_groups: groups per layer; must divide ``n``.

    Returns:
        ``[layers, n]`` int64: the group of each item.
    """
    layers, n = weights.shape
    size = n // num_groups
    groups = np.empty((layers, n), dtype=np.int64)
    rows = np.arange(layers)
    # Step 1: visit items heaviest first (stable, so ties keep expert order)
    order = np.argsort(-weights, axis=1, kind="stable")
    sums = np.zeros((layers, num_groups))
    fill = np.zeros((layers, num_groups), dtype=np.int64)
    for step in range(n):
        item = order[:, step]
        # Step 2: the lightest group that still has room takes it (all layers at once)
        candidate = np.where(fill < size, sums, np.inf)
        g = np.argmin(candidate, axis=1)
        groups[rows, item] = g
        sums[rows, g] += weights[rows, item]
        fill[rows, g] += 1
    return groups


def _placement_from_groups(groups: np.ndarray, num_gpus: int) -> Placement:
    """``[layers, experts]`` GPU of each expert -> a placement with each GPU's slots contiguous."""
    # a stable sort by GPU lists every GPU's experts in its slot range
    p2l = np.argsort(groups, axis=1, kind="stable")
    return Placement(p2l, num_gpus=num_gpus, num_logical=groups.shape[1])


def _greedy(loads: np.ndarray, num_gpus: int) -> Placement:
    return _placement_from_groups(greedy_groups(loads, num_gpus), num_gpus)


#: name -> balancer(loads [layers, experts], num_gpus) -> Placement
BALANCERS: dict[str, Callable[[np.ndarray, int], Placement]] = {
    "greedy": _greedy,
}


def balance_placement(loads: np.ndarray, num_gpus: int, method: str = "greedy") -> Placement:
    """Place each layer's experts on ``num_gpus`` GPUs, ``experts / num_gpus`` each, so that the
    summed loads per GPU are as equal as possible.

    Args:
        loads: ``[layers, experts]`` non-negative counts (all-zero rows are dense layers and get
            the contiguous placement).
        num_gpus: GPUs; must divide the experts.
        method: a key of ``BALANCERS``.

    Returns:
        A :class:`Placement` with ``[layers, experts]`` slots.
    """
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim != 2:
        raise EpsimError(f"loads must be [layers][experts], got shape {list(loads.shape)}")
    if loads.shape[1] % num_gpus:
        raise EpsimError(f"{num_gpus} GPUs do not divide {loads.shape[1]} experts")
    if method not in BALANCERS:
        raise EpsimError(f"unknown balancer {method!r} (known: {', '.join(BALANCERS)})")
    return BALANCERS[method](loads, num_gpus)
