"""The placement a run gets when none is given, decided once for the simulator
(``epsim.sim.step``) and ``epsim run`` (``epsim.commands.run``): balanced for the loads, or
contiguous."""

from __future__ import annotations

import numpy as np

from ..placement import Placement, contiguous_placement
from .balance import balance_placement


def default_placement(loads: np.ndarray, num_gpus: int, *, balanced: bool,
                      redundant: int = 0) -> Placement:
    """The default expert placement over ``num_gpus`` GPUs.

    Args:
        loads: ``[layers, experts]`` counts (``epsim.model.loads``; dense layers are zero rows).
            Balanced: the balancer's input; contiguous: only its shape is read.
        num_gpus: GPUs ``G`` (the plan's ep); must divide ``experts + redundant``.
        balanced: True: :func:`~epsim.model.eplb.balance.balance_placement` with its default
            method, the ``redundant`` replicas going to the experts with the most load per
            replica; False: :func:`~epsim.model.placement.contiguous_placement` (the redundant
            slots wrapping round: slot ``s`` holds expert ``s % experts``).
        redundant: extra slots ``R`` per layer. Example: 32 (36 slots per GPU for 256 experts
            on 8 GPUs).

    Returns:
        A :class:`~epsim.model.placement.Placement` of ``[layers, experts + R]`` slots.

    Example: ``default_placement(read_loads("decode_in2000out100"), 8, balanced=True,
    redundant=32)`` is what ``epsim balance --loads decode_in2000out100 --gpus 8
    --redundant-experts 32`` prints the balance of; with ``balanced=False`` GPU 0 holds experts
    ``0..35`` of every layer, GPU 7 experts ``252..255`` and ``0..31``.
    """
    if balanced:
        return balance_placement(loads, num_gpus, redundant=redundant)
    layers, experts = np.shape(loads)
    return contiguous_placement(layers, experts, num_gpus, redundant)
