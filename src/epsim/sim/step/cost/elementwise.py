"""The elementwise (streaming) family: ``norm``, ``rope``, ``router``, ``elementwise``,
``embedding``, ``sample``: a plain roofline on the op's dtype (BF16 where the profile has no
peak for it) and HBM. No kernel table times them (no ``kernel_tables.FEATURES`` entry).

``times(ops, ctx)`` costs many of them at once from arrays of their FLOPs, bytes and rates; one
op's time is ``times`` at ``[op]`` (``KindCosting.seconds``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from epsim.model.opgraph import Op

from .context import CostContext
from .roofline import STREAMING_KEYS, KindCosting, roof_rows, streaming_dtype

KINDS = ("norm", "rope", "router", "elementwise", "embedding", "sample")


def times(ops: Sequence[Op], ctx: CostContext) -> np.ndarray:
    """``[ops]`` seconds of norms, RoPE, activations, embedding, router, sampling (any mix, or
    a kind outside every family): a plain roofline each, before ``calibrated``."""
    profile = ctx.profile
    return roof_rows(profile, [op.flops for op in ops], [op.bytes for op in ops],
                     [streaming_dtype(op, profile) for op in ops], [op.kind for op in ops])


#: the entry of every kind here, and of a kind outside every family
STREAMING = KindCosting("elementwise", times, STREAMING_KEYS)

#: op kind -> how it is costed
COSTING: dict[str, KindCosting] = {kind: STREAMING for kind in KINDS}
