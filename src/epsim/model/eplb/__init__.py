"""Expert-parallel load balancing: placing experts (and their replicas) on GPUs so every GPU
carries the same load.

The face of the balancer: :func:`balance_placement` places, :func:`balance_report` places and
measures (``epsim balance``), :func:`default_placement` is the placement a run gets when none is
given (the simulator's and ``epsim run``'s). Its files:

    balance.py          the entry point: ``balance_placement``, the ``BALANCERS`` registry, flat
                        and hierarchical packing, GPU relabelling against a previous placement
                        (``gpu_incidence``, ``moved_experts``), the summaries (``balance_report``,
                        ``imbalance_summary``, ``lower_bound``)
    default.py          ``default_placement``: balanced or contiguous
    pack.py             the packers: greedy, Karmarkar-Karp, exact
    swaps.py            the pairwise-swap refinement (and two-for-two exchanges)
    replicas.py         the redundant slots: which experts get replicas, spreading duplicates
    snapshots.py        ``minmax``: a placement for several load snapshots (their worst)
    kernels.py          the loops of pack / replicas / swaps compiled with numba (same choices)
    kernels_minmax.py   the minmax refinement's loops compiled with numba

Everything else is imported from its module (``from epsim.model.eplb.balance import
lower_bound``, ``from epsim.model.eplb.pack import greedy_groups``).
"""

from .balance import (
    BALANCERS,
    DEFAULT_METHOD,
    DEFAULT_SNAPSHOTS_METHOD,
    balance_placement,
    balance_report,
    gpu_incidence,
    moved_experts,
)
from .default import default_placement

__all__ = [
    "BALANCERS", "DEFAULT_METHOD", "DEFAULT_SNAPSHOTS_METHOD", "balance_placement",
    "balance_report", "default_placement", "gpu_incidence", "moved_experts",
]
