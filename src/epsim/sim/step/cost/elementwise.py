"""The elementwise (streaming) family: ``norm``, ``rope``, ``router``, ``elementwise``,
``embedding``, ``sample``: a plain roofline on the op's dtype (BF16 where the profile has no
peak for it) and HBM. No kernel table times them (no ``kernel_tables.FEATURES`` entry).
"""

from __future__ import annotations

from epsim.model.opgraph import Op
from epsim.sim.hardware.profile import HardwareProfile

from .roofline import STREAMING_KEYS, KindCosting, roofline, streaming_dtype

KINDS = ("norm", "rope", "router", "elementwise", "embedding", "sample")


def streaming_time(op: Op, profile: HardwareProfile) -> float:
    """Norms, RoPE, activations, embedding, router, sampling: a plain roofline."""
    return roofline(profile, op.flops, op.bytes, streaming_dtype(op, profile), op.kind)


#: the entry of every kind here, and of a kind outside every family
STREAMING = KindCosting("elementwise", streaming_time, STREAMING_KEYS)

#: op kind -> how it is costed
COSTING: dict[str, KindCosting] = {kind: STREAMING for kind in KINDS}
