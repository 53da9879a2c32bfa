"""Fitted factors that cannot be true are refused (``calibrate --from-bench``, ``--from-trace``).

A fit to measured runs or a trace sets per-op-class factors on the times the profile's sourced
figures give (``efficiency.op_final_scale``, ``efficiency.op_time_scale``). A factor far from 1
says the op class runs far from its own component measurement, which is not what a fit of a
few end-to-end numbers can establish: more often the fit has absorbed a cost the model lacks (a
launch floor, host time, imbalance) into the class that happens to carry it, where it then
scales every shape. So a factor outside ``PLAUSIBLE_FACTOR`` is refused: the sourced value is
kept (the factor the fit started from), the refusal is reported (stderr, text and JSON) and the
other factors are refitted without it. The range and its reasoning: docs/validation.md,
"Implausible fits".
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

#: a fitted per-op-class factor must lie in [low, high]. Below 0.25 an op class would run 4x
#: faster than its sourced time: the achievable fractions are 0.5-0.9 of peak and measured
#: kernels sit near them, so 4x faster puts most classes above the device's peak. Above 4 the
#: class would run at under a quarter of its own measured kernel or achievable roofline, beyond
#: the spread of implementations the kernel tables show for one op, and the sign of a missing
#: component rather than a slow kernel. An assumption, stated (docs/validation.md).
PLAUSIBLE_FACTOR = (0.25, 4.0)


def refusals(fitted: Mapping[str, float], kept: Mapping[str, float]
             ) -> list[dict[str, Any]]:
    """``[{"factor", "fitted", "range", "kept"}]`` for each of ``fitted`` (``{name: factor}``)
    outside ``PLAUSIBLE_FACTOR``; ``kept``: the sourced value each one keeps (default 1)."""
    low, high = PLAUSIBLE_FACTOR
    return [{"factor": name, "fitted": float(value), "range": [low, high],
             "kept": float(kept.get(name, 1.0))}
            for name, value in fitted.items() if not low <= value <= high]


def warn(refused: list[dict[str, Any]], what: str) -> None:
    """One warning line on stderr per refused factor."""
    for r in refused:
        print(f"warning: {what}: fitted {r['factor']} factor {r['fitted']:.4g}x lies outside "
              f"the plausible range [{r['range'][0]:g}, {r['range'][1]:g}]; refused, the "
              f"sourced value {r['kept']:g} is kept (docs/validation.md)", file=sys.stderr)
