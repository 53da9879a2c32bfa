"""Service-level objectives: bounds on the metric keys a scenario's run reports.

    SLO          ``"median_itl_ms<=100,p90_ttft_ms<=5000"``: a conjunction of bounds on keys of
                 ``epsim.sim.serving.metrics.compute_metrics``
    latency key  ``<mean|median|std|pNN>_<metric>_ms`` with a metric of ``epsim.sim.serving.metrics.METRICS``
                 (a ``pNN`` key must have its percentile computed: ``with_slo_metrics``)
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from epsim.model.errors import EpsimError
from epsim.sim.serving.metrics import METRICS
from epsim.sim.spec import Scenario

#: the comparisons a term may use
OPERATORS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt,
}
_LATENCY_KEY = re.compile(r"(mean|median|std|p(\d+(?:\.\d+)?))_(" + "|".join(METRICS) + r")_ms")
#: non-latency metrics an SLO may bound too
SLO_OTHER_KEYS = ("output_throughput", "total_token_throughput", "request_throughput",
                  "decode_throughput", "mean_decode_step_ms", "kv_cache_usage",
                  "expert_imbalance")


def is_latency_key(key: str) -> bool:
    """Whether ``key`` names a latency statistic. Example: ``"p90_ttft_ms"`` -> True."""
    return _LATENCY_KEY.fullmatch(key) is not None


@dataclass(frozen=True)
class SLO:
    """A conjunction of bounds on metric keys.

    terms: ``((metric, op, value), ...)``. Example: ``(("median_itl_ms", "<=", 100.0),)``.
    """

    terms: tuple[tuple[str, str, float], ...]

    def met(self, metrics: Mapping[str, Any]) -> bool:
        return all(OPERATORS[op](float(metrics[k]), v) for k, op, v in self.terms)

    def _percentile_keys(self) -> list[re.Match[str]]:
        """The terms on a percentile (``pNN_<metric>_ms``), parsed."""
        found = (_LATENCY_KEY.fullmatch(k) for k, _, _ in self.terms)
        return [m for m in found if m and m.group(2)]

    def percentiles(self) -> tuple[float, ...]:
        """The percentiles the SLO names (they must be computed)."""
        return tuple(float(m.group(2)) for m in self._percentile_keys())

    def metrics(self) -> tuple[str, ...]:
        """The metrics whose percentiles the SLO names (``"ttft"``, ``"itl"``, ...)."""
        return tuple(m.group(3) for m in self._percentile_keys())

    def __str__(self) -> str:
        return ",".join(f"{k}{op}{v:g}" for k, op, v in self.terms)


def _parse_term(part: str) -> tuple[str, str, float]:
    m = re.fullmatch(r"([A-Za-z0-9_.]+)\s*(<=|>=|<|>)\s*([-+0-9.eE]+)", part)
    if not m:
        raise EpsimError(f"SLO term {part!r} does not parse (expected e.g. median_itl_ms<=100)")
    key, op, value = m.group(1), m.group(2), m.group(3)
    latency = _LATENCY_KEY.fullmatch(key)
    if not (latency or key in SLO_OTHER_KEYS):
        raise EpsimError(
            f"unknown SLO metric {key!r} (use mean_/median_/pNN_ of "
            f"{', '.join(METRICS)} with _ms, or one of {', '.join(SLO_OTHER_KEYS)})")
    if latency and latency.group(2) and not 0 <= float(latency.group(2)) <= 100:
        raise EpsimError(f"SLO metric {key!r}: percentile must be in [0, 100]")
    try:
        bound = float(value)
    except ValueError:
        raise EpsimError(f"SLO term {part!r}: {value!r} is not a number") from None
    if not math.isfinite(bound):
        raise EpsimError(f"SLO term {part!r}: bound must be finite")
    # a latency, a throughput or a step time is a positive quantity; a usage or an imbalance
    # may be bounded at 0
    if bound < 0 or (bound == 0 and (latency or key.endswith(("_ms", "throughput")))):
        raise EpsimError(f"SLO term {part!r}: the bound must be positive")
    return key, op, bound


def parse_slo(text: str) -> SLO:
    """``"median_itl_ms<=100,p90_ttft_ms<=5000"`` -> :class:`SLO`; one-line error otherwise."""
    parts = [part.strip() for part in (text or "").split(",")]
    if not any(parts):
        raise EpsimError(f"empty SLO {text!r} (expected e.g. median_itl_ms<=100)")
    if not all(parts):
        raise EpsimError(f"SLO {text!r} has an empty term")
    terms = tuple(_parse_term(part) for part in parts)
    return SLO(terms)


def with_slo_metrics(sc: Scenario, slo: SLO) -> Scenario:
    """``sc`` computing every percentile and metric the SLO names."""
    pct = tuple(dict.fromkeys([*sc.measurement.percentiles, *slo.percentiles()]))
    mets = tuple(dict.fromkeys([*sc.measurement.percentile_metrics, *slo.metrics()]))
    return sc.with_(percentiles=pct, percentile_metrics=mets)
