"""Expert-parallel load balancing: placing experts on GPUs so every GPU carries the same load.

The public entry point is :func:`balance_placement`. Per layer it solves a *balanced number
partitioning* problem: split the layer's items (experts, or expert replicas) into ``G`` groups of
exactly ``n / G`` items whose summed loads are as equal as possible. Algorithms are registered
in ``BALANCERS`` (each maps ``[rows, n]`` weights and a group count to ``[rows, n]`` groups):

    greedy     heaviest item first onto the least-loaded GPU that still has a free slot
               (the public baseline, as in DeepSeek's EPLB ``balanced_packing``).
    kk         balanced largest differencing (Karmarkar-Karp with group sizes kept), no refinement.
    kk-swap    ``kk``, then pairwise-swap refinement.
    greedy-swap  ``greedy``, then the same refinement (epsim's default).
    greedy-swap2 ``greedy-swap`` plus two-for-two exchanges where single swaps stall.
    exact      every partition tried (small instances only).

The ``-swap`` methods solve instances with at most ``EXACT_LIMIT`` partitions exactly.

Options around the packer (vectorised over layers in numpy; the loops of the packers, replicas
and swaps also compiled with numba, one layer at a time, in ``kernels``: same choices):

* redundant slots: replicate the hottest experts (highest load per replica first, as in
  DeepSeek's EPLB ``replicate_experts``), then pack the replicas, each carrying ``load / replicas``;
* hierarchical placement for multi-node EP: experts (or whole routing groups) to nodes first,
  then each node's experts (and its share of the redundant slots) to that node's GPUs;
* a previous placement: GPU labels are matched to it so the fewest experts move, and with
  ``max_moves`` the previous placement is only improved by swaps within that move budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter

import numpy as np

from ..errors import EpsimError
from ..placement import Placement, contiguous_placement
from .pack import EXACT_LIMIT, exact_groups, greedy_groups, kk_groups, partition_count
from .replicas import _spread_duplicates, replicate_experts
from .snapshots import SNAPSHOT_BALANCERS, snapshot_weights
from .swaps import refine_swaps

# --------------------------------------------------------------------------------------------
# The registry of packers: [rows, n] weights -> [rows, n] group ids, exactly n / G per group
# --------------------------------------------------------------------------------------------


def _with_swaps(start: Callable[[np.ndarray, int], np.ndarray], exchange: bool = False
                ) -> Callable[[np.ndarray, int], np.ndarray]:
    """``start`` then :func:`refine_swaps`; instances small enough are solved exactly."""
    def packer(weights: np.ndarray, num_groups: int) -> np.ndarray:
        if partition_count(weights.shape[1], num_groups) <= EXACT_LIMIT:
            return exact_groups(weights, num_groups)
        return refine_swaps(weights, start(weights, num_groups), num_groups, exchange=exchange)
    return packer


_greedy_swap = _with_swaps(greedy_groups)
_greedy_swap2 = _with_swaps(greedy_groups, exchange=True)
_kk_swap = _with_swaps(kk_groups)


#: name -> packer(weights [rows, n], num_groups) -> groups [rows, n] (exactly n / num_groups each)
BALANCERS: dict[str, Callable[[np.ndarray, int], np.ndarray]] = {
    "greedy": greedy_groups,
    "kk": kk_groups,
    "kk-swap": _kk_swap,
    "greedy-swap": _greedy_swap,
    "greedy-swap2": _greedy_swap2,
    "exact": exact_groups,
    # fits the worst of several snapshots (SNAPSHOT_BALANCERS); one snapshot: greedy-swap
    "minmax": _greedy_swap,
}

#: the start of each refined method (with replicas, the refinement runs once, constrained)
_STARTS: dict[str, Callable[[np.ndarray, int], np.ndarray]] = {
    "kk-swap": kk_groups, "greedy-swap": greedy_groups, "greedy-swap2": greedy_groups,
    "minmax": greedy_groups,
}

#: epsim's choice: heaviest-first spreads the hottest experts one per GPU (which is what holds
#: up on loads it was not fitted to), the swaps then close the remaining gap almost exactly
DEFAULT_METHOD = "greedy-swap"

#: with several snapshots: fit the worst of them (held out far better than their mean on the
#: shipped files, docs/placement.md; about 4x greedy-swap's time, still under DeepSeek's EPLB)
DEFAULT_SNAPSHOTS_METHOD = "minmax"


# --------------------------------------------------------------------------------------------
# GPU relabelling, moves
# --------------------------------------------------------------------------------------------


def _match_labels(new_groups: np.ndarray, item_log: np.ndarray, prev_inc: np.ndarray,
                  num_groups: int) -> np.ndarray:
    """Renumber each row's groups so that as many (GPU, expert) pairs as possible stay where the
    previous placement had them (fewer weights to move; the loads per GPU do not change).

    Greedy matching on the overlap matrix, then pairwise label exchanges while any helps.

    Args:
        new_groups: ``[rows, n]`` group of each item.  item_log: ``[rows, n]`` its expert.
        prev_inc: ``[rows, G, E]`` bool, expert held by GPU in the previous placement.

    Returns:
        ``[rows, n]`` relabelled groups.
    """
    rows, n = new_groups.shape
    k = num_groups
    idx = np.arange(rows)
    # overlap[r, g, h]: items of new group g whose expert GPU h held before
    held = prev_inc[idx[:, None, None], np.arange(k)[None, None, :], item_log[:, :, None]]
    overlap = np.zeros((rows, k, k), dtype=np.int64)
    np.add.at(overlap, (idx[:, None], new_groups), held.astype(np.int64))
    # Step 1: greedy: the largest remaining overlap fixes one label per pass
    label = np.full((rows, k), -1, dtype=np.int64)
    work = overlap.astype(np.float64)
    for _ in range(k):
        flat = np.argmax(work.reshape(rows, -1), axis=1)
        g, h = flat // k, flat % k
        label[idx, g] = h
        work[idx, g, :] = -np.inf
        work[idx, :, h] = -np.inf
    # Step 2: 2-opt: exchange the labels of two groups while that keeps more in place
    g1, g2 = np.triu_indices(k, 1)
    for _ in range(4 * k):
        l1, l2 = label[:, g1], label[:, g2]
        now = overlap[idx[:, None], g1, l1] + overlap[idx[:, None], g2, l2]
        then = overlap[idx[:, None], g1, l2] + overlap[idx[:, None], g2, l1]
        best = np.argmax(then - now, axis=1)
        better = (then - now)[idx, best] > 0
        if not better.any():
            break
        r = idx[better]
        a, b = g1[best[better]], g2[best[better]]
        la, lb = label[r, a].copy(), label[r, b].copy()
        label[r, a], label[r, b] = lb, la
    return np.take_along_axis(label, new_groups, axis=1)


def gpu_incidence(placement: Placement) -> np.ndarray:
    """``[layers, G, E]`` bool: whether each GPU holds (a replica of) each logical expert."""
    p2l = placement.physical_to_logical
    layers = p2l.shape[0]
    gpu = np.broadcast_to(np.arange(placement.num_slots) // placement.slots_per_gpu, p2l.shape)
    inc = np.zeros((layers, placement.num_gpus, placement.num_logical), dtype=bool)
    inc[np.arange(layers)[:, None], gpu, p2l] = True
    return inc


def moved_experts(previous: Placement, new: Placement) -> np.ndarray:
    """``[layers]`` expert weights to copy to go from ``previous`` to ``new``: the (GPU, expert)
    pairs that ``new`` has and ``previous`` had not."""
    if (previous.num_layers, previous.num_gpus, previous.num_logical) != \
            (new.num_layers, new.num_gpus, new.num_logical):
        raise EpsimError(
            f"previous placement is [{previous.num_layers} layers, {previous.num_gpus} GPUs, "
            f"{previous.num_logical} experts], the new one [{new.num_layers}, {new.num_gpus}, "
            f"{new.num_logical}]"
        )
    return (gpu_incidence(new) & ~gpu_incidence(previous)).sum(axis=(1, 2))


# --------------------------------------------------------------------------------------------
# The entry point
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Packed:
    """Items of every row packed into groups.

    item_log: ``[rows, n]`` logical expert of each item (replicas repeat it).
    groups: ``[rows, n]`` GPU of each item, exactly ``n / G`` per GPU.
    """

    item_log: np.ndarray
    groups: np.ndarray


def _pack_flat(loads: np.ndarray, num_gpus: int, redundant: int, method: str) -> _Packed:
    """Replicate, then pack the replicas (each ``load / replicas``) onto ``num_gpus`` GPUs."""
    item_log, counts = replicate_experts(loads, redundant, max_replicas=num_gpus)
    item_w = np.take_along_axis(loads, item_log, axis=1) / np.take_along_axis(
        counts, item_log, axis=1)
    refined = method in _STARTS and partition_count(item_w.shape[1], num_gpus) > EXACT_LIMIT
    if not redundant or not refined:
        groups = BALANCERS[method](item_w, num_gpus)
    else:
        groups = _STARTS[method](item_w, num_gpus)
    if redundant:
        # replicas of one expert on one GPU waste a slot: spread them, then refine without
        # letting two meet again
        groups = _spread_duplicates(item_w, item_log, groups, num_gpus)
        if refined:
            # the no-two-replicas-on-a-GPU rule blocks many single swaps; two-for-two
            # exchanges get around it
            groups = refine_swaps(item_w, groups, num_gpus, item_log=item_log, exchange=True)
    return _Packed(item_log, groups)


def _pack_hierarchical(loads: np.ndarray, num_gpus: int, nodes: int, redundant: int,
                       method: str, expert_groups: int | None) -> _Packed:
    """Experts (or whole routing groups of ``E / expert_groups`` experts) to nodes, then each
    node's experts and ``redundant / nodes`` extra slots to its ``num_gpus / nodes`` GPUs."""
    rows, e = loads.shape
    per_node = e // nodes
    if expert_groups:
        # Step 1a: routing groups to nodes (group-limited routing then crosses fewer nodes)
        size = e // expert_groups
        group_loads = loads.reshape(rows, expert_groups, size).sum(axis=2)
        node_of_group = BALANCERS[method](group_loads, nodes)
        node_of_expert = np.repeat(node_of_group, size, axis=1)
    else:
        # Step 1b: single experts to nodes, E / nodes each
        node_of_expert = BALANCERS[method](loads, nodes)
    # Step 2: each (row, node) becomes a row of its own with that node's experts
    experts = np.argsort(node_of_expert, axis=1, kind="stable").reshape(rows * nodes, per_node)
    node_loads = np.take_along_axis(np.repeat(loads, nodes, axis=0), experts, axis=1)
    inner = _pack_flat(node_loads, num_gpus // nodes, redundant // nodes, method)
    # Step 3: back to global expert ids and GPU numbers (node n owns GPUs n*G/N ..)
    item_log = np.take_along_axis(experts, inner.item_log, axis=1)
    node = np.tile(np.arange(nodes), rows)[:, None]
    groups = inner.groups + node * (num_gpus // nodes)
    n_items = item_log.shape[1]
    return _Packed(item_log.reshape(rows, nodes * n_items),
                   groups.reshape(rows, nodes * n_items))


def _to_p2l(packed: _Packed, num_gpus: int) -> np.ndarray:
    """Items and their GPUs -> ``[rows, slots]`` physical_to_logical, each GPU's slots contiguous
    and, within a GPU, experts in ascending order."""
    key = packed.groups * (packed.item_log.max(initial=0) + 1) + packed.item_log
    order = np.argsort(key, axis=1, kind="stable")
    return np.take_along_axis(packed.item_log, order, axis=1)


def _check_balance_args(loads: np.ndarray, num_gpus: int, method: str, redundant: int,
                        nodes: int, expert_groups: int | None, previous: Placement | None,
                        max_moves: int | None) -> None:
    """Every input error of :func:`balance_placement`, as one-line EpsimErrors."""
    if loads.ndim not in (2, 3) or (loads.ndim == 3 and loads.shape[0] < 1):
        raise EpsimError(f"loads must be [layers][experts] (or [snapshots][layers][experts]), "
                         f"got shape {list(loads.shape)}")
    if not np.all(np.isfinite(loads)) or np.any(loads < 0):
        raise EpsimError("loads must be finite and non-negative")
    layers, e = loads.shape[-2:]
    if method not in BALANCERS:
        raise EpsimError(f"unknown balancer {method!r} (known: {', '.join(BALANCERS)})")
    if num_gpus < 1 or redundant < 0 or nodes < 1:
        raise EpsimError(f"need num_gpus >= 1, redundant >= 0 and nodes >= 1, got {num_gpus}, "
                         f"{redundant}, {nodes}")
    slots = e + redundant
    if slots % num_gpus:
        raise EpsimError(f"{num_gpus} GPUs do not divide {e} experts + {redundant} redundant slots")
    if nodes > 1:
        if num_gpus % nodes or e % nodes or redundant % nodes:
            raise EpsimError(f"{nodes} nodes must divide the GPUs ({num_gpus}), experts ({e}) "
                             f"and redundant slots ({redundant})")
        if expert_groups and (e % expert_groups or expert_groups % nodes):
            raise EpsimError(f"{expert_groups} expert groups must divide the {e} experts and be "
                             f"a multiple of the {nodes} nodes")
    if previous is not None:
        if (previous.num_layers, previous.num_logical, previous.num_gpus) != (layers, e, num_gpus):
            raise EpsimError(
                f"previous placement is [{previous.num_layers} layers, {previous.num_logical} "
                f"experts, {previous.num_gpus} GPUs], the loads need [{layers}, {e}, {num_gpus}]")
        if max_moves is not None and previous.num_slots != slots:
            raise EpsimError(f"previous placement has {previous.num_slots} slots; with "
                             f"max_moves the redundant slots must stay {previous.num_slots - e}")
    if max_moves is not None and (previous is None or max_moves < 0):
        raise EpsimError("max_moves needs a previous placement and must be >= 0")
    if max_moves is not None and loads.ndim == 3 and loads.shape[0] > 1:
        raise EpsimError("max_moves re-places for one snapshot of loads, got "
                         f"{loads.shape[0]} snapshots")


def balance_placement(loads: np.ndarray, num_gpus: int, method: str | None = None, *,
                      redundant: int = 0, nodes: int = 1, expert_groups: int | None = None,
                      previous: Placement | None = None, max_moves: int | None = None
                      ) -> Placement:
    """Place each layer's experts on ``num_gpus`` GPUs, the same number of slots each, so that
    the summed loads per GPU are as equal as possible.

    Args:
        loads: ``[layers, experts]`` non-negative counts (all-zero rows are dense layers and get
            the contiguous placement), or ``[snapshots, layers, experts]``: several measurements
            (load files, windows) of the workloads to serve. With several snapshots each is
            scaled to the same total per layer; ``minmax`` (``SNAPSHOT_BALANCERS``) fits the
            worst of them, every other method their mean.
        num_gpus: GPUs ``G``; must divide ``experts + redundant``.
        method: a key of ``BALANCERS``; None: :func:`default_method` (``DEFAULT_METHOD``
            for one snapshot, ``DEFAULT_SNAPSHOTS_METHOD`` for several).
        redundant: extra slots ``R`` per layer for replicas of the hottest experts, so each GPU
            has ``(experts + R) / G`` slots. Example: 32 (36 slots per GPU for 256 experts).
        nodes: ``N`` > 1 places hierarchically: experts to nodes, then to the node's GPUs
            (``N`` must divide ``G``, ``experts`` and ``R``).
        expert_groups: with ``nodes``, keep the model's routing groups (DeepSeek-V3: 8 groups of
            32 experts) whole on one node; ``N`` must divide it.
        previous: the placement in use; the new one's GPU numbers are matched to it so the
            fewest experts move (see :func:`moved_experts`).
        max_moves: with ``previous``: start from it and only swap experts, at most this many
            away from their previous GPU per layer (replica counts are kept; one snapshot).

    Returns:
        A :class:`Placement` with ``[layers, experts + R]`` slots.
    """
    # Step 1: check the inputs; one snapshot is the two-dimensional case
    loads = np.asarray(loads, dtype=np.float64)
    if method is None:
        method = default_method(loads.shape[0] if loads.ndim == 3 else 1)
    _check_balance_args(loads, num_gpus, method, redundant, nodes, expert_groups, previous,
                        max_moves)
    snapshots = None
    if loads.ndim == 3:
        if loads.shape[0] == 1:
            loads = loads[0]
        else:
            snapshots = snapshot_weights(loads)
            loads = snapshots.mean(axis=0)
    layers, e = loads.shape
    slots = e + redundant

    # Step 2: dense rows keep the contiguous layout (replica slots wrap around)
    p2l = np.tile(np.arange(slots, dtype=np.int64) % e, (layers, 1))
    rows = np.flatnonzero(loads.sum(axis=1) > 0)
    if len(rows) == 0:
        return Placement(p2l, num_gpus=num_gpus, num_logical=e)
    w = loads[rows]

    # Step 3: pack the MoE rows
    if max_moves is not None:
        packed = _pack_from_previous(w, previous.physical_to_logical[rows],
                                     previous.replica_counts[rows], num_gpus, max_moves)
    elif snapshots is not None and method in SNAPSHOT_BALANCERS:
        packed = _Packed(*SNAPSHOT_BALANCERS[method](snapshots[:, rows], num_gpus, nodes,
                                                     redundant, expert_groups))
    elif nodes > 1:
        packed = _pack_hierarchical(w, num_gpus, nodes, redundant, method, expert_groups)
    else:
        packed = _pack_flat(w, num_gpus, redundant, method)
    if previous is not None and max_moves is None:
        packed = _relabel_for(previous, packed, rows, num_gpus, nodes)
    p2l[rows] = _to_p2l(packed, num_gpus)
    return Placement(p2l, num_gpus=num_gpus, num_logical=e)


def _relabel_for(previous: Placement, packed: _Packed, rows: np.ndarray, num_gpus: int,
                 nodes: int) -> _Packed:
    """Renumber GPUs (within each node, which keeps the node split) to move the fewest."""
    inc = gpu_incidence(previous)[rows]
    per = num_gpus // nodes
    n_rows, n_items = packed.groups.shape
    groups = packed.groups.reshape(n_rows, nodes, n_items // nodes).copy()
    logs = packed.item_log.reshape(n_rows, nodes, n_items // nodes)
    for node in range(nodes):
        local = groups[:, node] - node * per  # node-major items (see _pack_hierarchical)
        block = inc[:, node * per:(node + 1) * per]
        groups[:, node] = _match_labels(local, logs[:, node], block, per) + node * per
    return _Packed(packed.item_log, groups.reshape(n_rows, n_items))


def _pack_from_previous(loads: np.ndarray, prev_p2l: np.ndarray, prev_counts: np.ndarray,
                        num_gpus: int, max_moves: int) -> _Packed:
    """Swap refinement starting from the previous placement, with a move budget."""
    item_log = prev_p2l
    item_w = np.take_along_axis(loads, item_log, axis=1) / np.take_along_axis(
        prev_counts, item_log, axis=1)
    home = np.broadcast_to(np.arange(prev_p2l.shape[1]) // (prev_p2l.shape[1] // num_gpus),
                           prev_p2l.shape)
    groups = refine_swaps(item_w, home, num_gpus, home=home, max_moves=max_moves)
    return _Packed(item_log, groups)


# --------------------------------------------------------------------------------------------
# Summaries (what ``epsim balance`` prints)
# --------------------------------------------------------------------------------------------


def _worst_snapshot(per_layer: Callable[[np.ndarray], np.ndarray], loads: np.ndarray
                    ) -> np.ndarray:
    """``[layers]`` per-layer figures of ``[layers, E]`` loads, or, for ``[S, layers, E]``, the
    worst (largest) over the snapshots that load the layer; NaN where none does."""
    if loads.ndim == 2:
        return per_layer(loads)
    return np.fmax.reduce(np.stack([per_layer(x) for x in loads]), axis=0)


def _summary(per_layer: np.ndarray, loads: np.ndarray) -> dict[str, float]:
    rows = np.flatnonzero(loads.reshape(-1, *loads.shape[-2:]).sum(axis=(0, 2)) > 0)
    return {"mean": float(np.mean(per_layer[rows])), "max": float(np.max(per_layer[rows]))}


def imbalance_summary(placement: Placement, loads: np.ndarray) -> dict[str, float]:
    """``{"mean", "max"}`` over the loaded layers of max GPU load / mean GPU load; for
    ``[S, layers, E]`` snapshots, of each layer's worst snapshot."""
    return _summary(_worst_snapshot(placement.imbalance, loads), loads)


def _layer_bounds(loads: np.ndarray, num_gpus: int, redundant: int) -> np.ndarray:
    """``[layers]`` the bound of :func:`lower_bound` per layer (NaN where no load)."""
    out = np.full(loads.shape[0], np.nan)
    loaded = loads.sum(axis=1) > 0
    rows = loads[loaded]
    mean = rows.sum(axis=1) / num_gpus
    split = min(num_gpus, redundant + 1)
    bound = np.maximum(mean, rows.max(axis=1) / split)
    if redundant == 0 and np.all(rows == np.round(rows)):
        bound = np.maximum(bound, np.ceil(mean - 1e-9))
    out[loaded] = bound / mean
    return out


def lower_bound(loads: np.ndarray, num_gpus: int, redundant: int = 0) -> dict[str, float]:
    """``{"mean", "max"}`` over loaded layers of an imbalance no placement can beat (for
    ``[S, layers, E]`` snapshots: on the layer's worst snapshot).

    The busiest GPU carries at least the mean, at least the hottest expert's share (its load
    over the replicas it can have, one per GPU at most), and, for integer counts without
    replicas, the mean rounded up."""
    return _summary(_worst_snapshot(lambda x: _layer_bounds(x, num_gpus, redundant), loads),
                    loads)


def default_method(num_snapshots: int = 1) -> str:
    """The balancer used when none is named: ``DEFAULT_METHOD`` for one snapshot (the fast
    path), ``DEFAULT_SNAPSHOTS_METHOD`` for several (held-out balance first)."""
    return DEFAULT_METHOD if num_snapshots <= 1 else DEFAULT_SNAPSHOTS_METHOD


def balance_report(loads: np.ndarray, num_gpus: int, method: str | None = None, *,
                   redundant: int = 0, nodes: int = 1, expert_groups: int | None = None,
                   previous: Placement | None = None, max_moves: int | None = None,
                   eval_loads: np.ndarray | None = None) -> tuple[Placement, dict]:
    """Balance, and measure the result: the placement and the summary ``epsim balance --json``
    prints (keys ``layers``, ``snapshots``, ``imbalance_before``/``imbalance_after`` as
    ``{"mean", "max"}`` (with several snapshots: of each layer's worst snapshot, and
    ``imbalance_after_per_snapshot``), ``lower_bound``, ``eval`` on ``eval_loads``,
    ``moved_experts`` with a previous placement, ``wall_ms`` of the balancing alone).

    ``loads``: ``[layers, E]`` or ``[S, layers, E]``; ``method`` None: :func:`default_method`.
    "Before" is the previous placement when there is one, else the contiguous placement
    (without replicas when the GPUs divide the experts, else with the redundant slots wrapping
    round: :func:`~epsim.model.placement.contiguous_placement`).
    """
    loads = np.asarray(loads, dtype=np.float64)
    snaps = loads.shape[0] if loads.ndim == 3 else 1
    method = default_method(snaps) if method is None else method
    if eval_loads is not None and eval_loads.shape != loads.shape[-2:]:
        raise EpsimError(f"evaluation loads of shape {list(eval_loads.shape)} do not match the "
                         f"fitted loads' {list(loads.shape[-2:])}")
    start = perf_counter()
    placement = balance_placement(loads, num_gpus, method, redundant=redundant, nodes=nodes,
                                  expert_groups=expert_groups, previous=previous,
                                  max_moves=max_moves)
    wall_ms = (perf_counter() - start) * 1e3
    layers, experts = loads.shape[-2:]
    before = previous if previous is not None else contiguous_placement(
        layers, experts, num_gpus, 0 if experts % num_gpus == 0 else redundant)
    out: dict = {
        "layers": int(np.count_nonzero(loads.reshape(-1, layers, experts).sum(axis=(0, 2)) > 0)),
        "experts": experts,
        "snapshots": snaps,
        "gpus": num_gpus,
        "nodes": nodes,
        "redundant": redundant,
        "slots_per_gpu": placement.slots_per_gpu,
        "method": method,
        "before": "previous" if previous is not None else "contiguous",
        "imbalance_before": imbalance_summary(before, loads),
        "imbalance_after": imbalance_summary(placement, loads),
        "lower_bound": lower_bound(loads, num_gpus, redundant),
    }
    if snaps > 1:
        out["imbalance_after_per_snapshot"] = [imbalance_summary(placement, x) for x in loads]
    if eval_loads is not None:
        out["eval"] = {"imbalance_before": imbalance_summary(before, eval_loads),
                       "imbalance_after": imbalance_summary(placement, eval_loads)}
    if previous is not None:
        moved = moved_experts(previous, placement)
        out["moved_experts"] = int(moved.sum())
        out["moved_experts_max_layer"] = int(moved.max())
    out["wall_ms"] = wall_ms
    return placement, out
