"""Op kind -> its family's costing: ``KIND_COSTING`` (every ``OP_KINDS`` member, in its order),
``FAMILIES`` (kind -> family module name), and what the timers ask of a kind.

The families (``gemm``, ``attention``, ``comm``, ``elementwise``) each own their kinds' roofline
at the op, their table features and roofline at other features, their table dtype, their scope
and source keys; this module merges their ``COSTING`` dicts and answers per op. A kind outside
every family is costed as a streaming op (the elementwise family's entry).

Table features' names and order stay in ``epsim.sim.hardware.kernel_tables.FEATURES``: the
profile parser (hardware/, which step/ may import but not the reverse) reads a table's columns
by them; ``tests/sim/step/test_op_cost.py`` checks each family's ``features`` give exactly those names.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from epsim.model.errors import EpsimError
from epsim.model.opgraph import OP_KINDS, Op
from epsim.model.plan import ParallelPlan
from epsim.sim.hardware.kernel_sets import FEATURES, LAYOUT_KINDS
from epsim.sim.hardware.profile import HardwareProfile

from . import attention, comm, elementwise, gemm
from .comm import scope_of
from .context import CostContext, as_context
from .roofline import KindCosting, calibrated, op_class

_FAMILY_MODULES = (gemm, attention, comm, elementwise)
_MERGED = {kind: entry for family in _FAMILY_MODULES for kind, entry in family.COSTING.items()}
#: op kind -> how it is costed (every ``OP_KINDS`` member, in its order)
KIND_COSTING: dict[str, KindCosting] = {kind: _MERGED[kind] for kind in OP_KINDS}
#: op kind -> its family (module name under ``sim.step.cost``)
FAMILIES: dict[str, str] = {kind: entry.family for kind, entry in KIND_COSTING.items()}
#: op kind -> (op, profile) -> seconds (nominal routing for grouped GEMMs and collectives)
COST_MODELS = {kind: entry.seconds for kind, entry in KIND_COSTING.items()}

#: kinds whose table a step picks by its deployment (exchange mode and MoE layout) besides the
#: collectives' own exchange mode: the fused MoE, whose kernel follows both
DEPLOYED = LAYOUT_KINDS


def moe_layout(plan: ParallelPlan) -> str:
    """The plan's MoE layout as kernel tables name it (``kernel_tables.LAYOUTS``): ``"ep"``
    under expert parallelism, else ``"tp"`` (every rank holds a slice of every expert)."""
    return "ep" if plan.expert_parallel else "tp"


def costing(kind: str) -> KindCosting:
    """``kind``'s entry; a kind outside the registry is costed as a streaming op (the roofline
    alone, its sources the streaming keys)."""
    return KIND_COSTING.get(kind, elementwise.STREAMING)


def roofline_op_time(op: Op, where: CostContext | HardwareProfile) -> float:
    """Seconds one op takes under its family's roofline (a compute op's with the profile's
    per-kind ``calibrated`` figures; a collective's on its group in ``where``)."""
    ctx = as_context(where)
    try:
        model = COST_MODELS[op.kind]
    except KeyError:
        raise EpsimError(f"no cost model for op kind {op.kind!r} ({op.id})") from None
    if op.is_collective:
        return model(op, ctx)
    return float(calibrated(op_class(op), model(op, ctx), ctx.profile))


def kernel_dtype(op: Op) -> str:
    """The dtype a table for ``op`` must have: the KV cache's for decode attention, else the
    op's compute dtype."""
    return costing(op.kind).table_dtype(op)


def table_scope(op: Op, ctx: CostContext) -> str:
    """The scope of the table that times ``op`` with its group on ``ctx.members(op)``."""
    return scope_of(ctx.members(op)) if costing(op.kind).scoped else "intra"


def op_features(op: Op, top_k: int | None = None) -> dict[str, float] | None:
    """The features a table of ``op.kind`` is looked up at (its family's docstring); None when
    no table can describe the op (an unfused grouped GEMM, a kind without tables)."""
    features = costing(op.kind).features
    return features(op, top_k) if features is not None else None


def feature_roofline(op: Op, ctx: CostContext, x: np.ndarray) -> np.ndarray:
    """Seconds of ``op.kind``'s roofline at each row of ``x`` (``[rows, features]`` in
    ``FEATURES[op.kind]`` order), the op's other constants (bytes per weight, head sizes, ...)
    taken from ``op``."""
    names = [n for n, _ in FEATURES[op.kind]]
    f = {n: x[:, j] for j, n in enumerate(names)}
    return costing(op.kind).roofline_at(op, ctx, f)


def roofline_sources(kind: str, profile: HardwareProfile) -> dict[str, Any]:
    """``{"profile:<key>": {"profile": <its file or name>, "key": ..., "source": ...}}`` for
    the profile figures ``kind``'s roofline reads, where the profile cites a source."""
    cited = profile.sources
    return {f"profile:{k}": {"profile": profile.name, "key": k, "source": cited[k]}
            for k in costing(kind).sources if k in cited}
