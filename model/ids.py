"""The names the op-graph contract shares: op ids and weight keys, built in one place.

Glossary:
    op id        ``L{layer}.{name}.mb{microbatch}`` inside decoder layers (``L12.moe.dispatch.mb1``),
                 ``{name}.mb{microbatch}`` outside them (``embed.mb0``, ``lm_head.mb0``). The
                 simulator's and the runtime's traces carry it, so the two can be compared op by op.
    weight key   ``L{layer}.{name}`` inside decoder layers (``L3.attn.q_a``), ``{name}`` outside
                 (``embed``, ``lm_head``): the weights an op of that layer and name reads.
    expert key   ``L{layer}.expert{e}.{part}``: one routed expert's weights (``part`` is
                 ``gate_up`` or ``down``), which only the ranks holding the expert load.

Everything that builds or reads these strings (the graph builder, the simulator, the runtime, its
weights and reference, calibration, tests) calls the functions here.
"""

from __future__ import annotations

#: layer of the ops and weights outside the decoder layers (embedding, final norm, LM head)
NO_LAYER = -1


def weight_key(layer: int, name: str) -> str:
    """The weights of the op ``name`` of ``layer`` (``NO_LAYER`` outside the decoder layers).

    Example: ``weight_key(3, "attn.q_a") == "L3.attn.q_a"``, ``weight_key(-1, "embed") ==
    "embed"``.
    """
    return f"L{layer}.{name}" if layer >= 0 else name


def expert_weight_key(layer: int, expert: int, part: str) -> str:
    """One routed expert's weights: ``expert_weight_key(3, 7, "down") == "L3.expert7.down"``."""
    return weight_key(layer, f"expert{expert}.{part}")


def op_id(layer: int, name: str, microbatch: int) -> str:
    """The id of op ``name`` of ``layer`` in ``microbatch``.

    Example: ``op_id(12, "moe.dispatch", 1) == "L12.moe.dispatch.mb1"``, ``op_id(-1, "lm_head",
    0) == "lm_head.mb0"``.
    """
    return f"{weight_key(layer, name)}.mb{microbatch}"
