"""The names the op-graph contract shares: op ids and weight keys, built in one place.

Glossary:
    op id        ``L{layer}.{name}.mb{microbatch}`` inside decoder layers (``L12.moe.dispatch.mb1``),
                 ``{name}.mb{microbatch}`` outside them (``embed.mb0``, ``lm_head.mb0``). The
                 simulator's and the runtime's traces carry it, so the two can be compared op by op.
                 An op of the MTP draft module's pass ``k`` (``epsim.model.mtp``) carries it too:
                 ``L61.attn.q_a.d0.mb0`` (pass 0 of DeepSeek-R1's draft layer 61).
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


def op_id(layer: int, name: str, microbatch: int, draft: int | None = None) -> str:
    """The id of op ``name`` of ``layer`` in ``microbatch`` (``draft``: the MTP draft pass it
    belongs to, ``None`` for the main model's ops).

    Example: ``op_id(12, "moe.dispatch", 1) == "L12.moe.dispatch.mb1"``, ``op_id(-1, "lm_head",
    0) == "lm_head.mb0"``, ``op_id(61, "attn.q_a", 0, draft=1) == "L61.attn.q_a.d1.mb0"``.
    """
    pass_ = "" if draft is None else f".d{draft}"
    return f"{weight_key(layer, name)}{pass_}.mb{microbatch}"
