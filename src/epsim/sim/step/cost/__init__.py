"""One op's seconds on one GPU: one home per op-kind family, one roofline, one context.

Each family's ``times(ops, ctx)`` costs many ops of its kinds at once (arrays of FLOPs, bytes,
rates, tile padding); an op's scalar cost is ``times`` at ``[op]`` (``KindCosting.seconds``), so
each family has one formula. Every timer takes the op and the step's ``CostContext``.

    roofline.py     the roofline once (``roof``: arrays in, seconds out; ``roof_at`` on a
                    profile's achievable figures, ``roof_rows`` on each row's own), the
                    calibrated profile's per-class figures (``calibrated``, ``final_scaled``,
                    ``op_class``) and ``KindCosting``
    gemm.py         gemm, grouped_gemm (fused MoE), lm_head
    attention.py    attention_decode, attention_prefill, DSA's indexer
    comm.py         dispatch, combine, all_reduce, all_gather: the busiest link
                    (``collective_time``)
    elementwise.py  norm, rope, router, elementwise, embedding, sample: a streaming roofline
    context.py      ``CostContext``: what costing an op reads besides the op (the profile, the
                    model's top-k, captured, the step's exchange mode and MoE layout, the
                    ranks' nodes), built once per compiled step
    registry.py     op kind -> its family's entry (``KIND_COSTING``, ``FAMILIES``), the roofline
                    of an op (``roofline_op_time``), what the timers ask of a kind
    timing.py       the selected kernel set's table, else the roofline (``op_time``), and how it
                    was timed (``describe``, ``explain``)

How to add an op kind: README.md beside this file. Uses ``epsim.sim.hardware`` and
``epsim.model``.
"""

from .context import CostContext
from .registry import FAMILIES, KIND_COSTING, roofline_op_time
from .roofline import roof
from .timing import op_time

__all__ = ["FAMILIES", "KIND_COSTING", "CostContext", "op_time", "roof", "roofline_op_time"]
