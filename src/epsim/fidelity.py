"""What every prediction carries besides its figures: the expected error of its regime.

Glossary:
    regime: the kind of deployment a prediction describes, as the published checks are grouped:
        ``ep_decode`` (expert-parallel decode, co-located serving included), ``tp_decode``
        (tensor-parallel MoE decode), ``prefill`` (a prefill step), ``disaggregated`` (prefill
        and decode on separate nodes). Example: ``"ep_decode"``.
    band: per regime, the median and largest |error| of epsim against the published checks of
        that regime, and how many checks there are. Written by ``bench/fidelity.py
        --write-bands`` into ``epsim/data/error_bands.json`` and shipped with the package.
        Example: ``{"median_abs_error": 0.089, "max_abs_error": 0.174, "checks": 8}``.
    model version: the epsim version and a hash of the shipped hardware profiles the band was
        measured with (:func:`model_version`); a band measured on other profiles is ``stale``.

:func:`stamp` is the one function that adds ``error_band`` to a JSON result (``step``,
``predict``, ``sweep`` rows, ``tune`` and ``plan``), and its provenance with it
(``epsim.provenance.stamp_provenance``); :func:`band_text` is its line in text output.
A regime without published checks says so (``"checked": false``) rather than borrowing another
regime's band. TTFT is checked by none of the development checks, so TTFT metrics say that too.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, MutableMapping
from functools import cache
from importlib import resources
from typing import Any

from epsim import __version__

from .provenance import stamp_provenance

#: the regimes, in the order docs and tables list them
REGIMES = ("ep_decode", "tp_decode", "prefill", "disaggregated")
REGIME_NAMES = {"ep_decode": "EP decode", "tp_decode": "TP decode", "prefill": "prefill",
                "disaggregated": "disaggregated"}
#: the figures of a step, and of a serving result, the band speaks for
STEP_HEADLINE = ("step_ms",)
SERVING_HEADLINE = ("output_throughput", "decode_throughput", "mean_tpot_ms", "median_tpot_ms",
                    "mean_itl_ms", "median_itl_ms", "mean_ttft_ms", "median_ttft_ms")
#: headline metrics no development check measures (their band says so)
UNCHECKED_METRICS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms")


def regime_of(*, ep: int, phase: str = "decode", disaggregated: bool = False) -> str:
    """The regime of a prediction. Example: ``regime_of(ep=8) == "ep_decode"``."""
    if disaggregated:
        return "disaggregated"
    if phase == "prefill":
        return "prefill"
    return "ep_decode" if ep > 1 else "tp_decode"


@cache
def model_version() -> dict[str, str]:
    """The epsim version and a 12-hex hash of the shipped hardware profiles (name and bytes)."""
    digest = hashlib.sha256()
    folder = resources.files("epsim.sim.hardware") / "profiles"
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            digest.update(entry.name.encode() + b"\0" + entry.read_bytes())
    return {"epsim": __version__, "profiles": digest.hexdigest()[:12]}


@cache
def shipped_bands() -> dict[str, Any]:
    """``epsim/data/error_bands.json`` as shipped (an empty set of regimes when absent)."""
    entry = resources.files("epsim") / "data" / "error_bands.json"
    if not entry.is_file():
        return {"regimes": {}, "measured_on": {}}
    return json.loads(entry.read_text())


def error_band(regime: str, metrics: Iterable[str],
               bands: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``error_band`` object of a result in ``regime`` whose headline ``metrics`` are
    given: per metric the expected |error| (the regime's median over its published checks) and
    the largest seen, or ``checked: false`` where no published check covers it."""
    doc = shipped_bands() if bands is None else bands
    band = doc.get("regimes", {}).get(regime)
    measured_on = doc.get("measured_on", {})
    stale = {k: measured_on.get(k) for k in ("epsim", "profiles")} != model_version()
    per_metric: dict[str, Any] = {}
    for metric in metrics:
        if band is None or metric in UNCHECKED_METRICS:
            per_metric[metric] = {"checked": False}
        else:
            per_metric[metric] = {"checked": True, "expected_abs_error": band["median_abs_error"],
                                  "max_abs_error": band["max_abs_error"]}
    out: dict[str, Any] = {"regime": regime, "checks": band["checks"] if band else 0,
                           "metrics": per_metric, "source": "bench/fidelity.py over "
                           "bench/data/published_checks.json", "measured_on": measured_on}
    if band is None:
        out["note"] = (f"outside every checked regime: no published check of "
                       f"{REGIME_NAMES.get(regime, regime)} is in the development set")
    if stale:
        out["stale"] = True  # measured on other profiles or another epsim version
    return out


def stamp(result: MutableMapping[str, Any], regime: str, metrics: Iterable[str],
          figures: Mapping[str, Any] | None = None) -> MutableMapping[str, Any]:
    """Add ``error_band`` to ``result`` (in place) for those of ``metrics`` it carries (or
    ``figures`` carries: a search's best point), and its provenance (:func:`stamp_provenance`),
    and return it."""
    have = result if figures is None else figures
    result["error_band"] = error_band(regime, [m for m in metrics if m in have])
    return stamp_provenance(result)


def band_text(band: Mapping[str, Any]) -> str:
    """The band as one line. Example: ``"±8.9 %, 8 published checks of EP decode"``."""
    name = REGIME_NAMES.get(band["regime"], band["regime"])
    checked = [m for m in band["metrics"].values() if m.get("checked")]
    if not checked:
        return f"none: {band.get('note', 'no published check covers these metrics')}"
    text = (f"±{100 * checked[0]['expected_abs_error']:.1f} % (largest "
            f"{100 * checked[0]['max_abs_error']:.0f} %), {band['checks']} published checks "
            f"of {name}")
    unchecked = [k for k, m in band["metrics"].items() if not m.get("checked")]
    if unchecked:
        text += f"; no check of {', '.join(unchecked)}"
    return text + (" [measured on other profiles]" if band.get("stale") else "")
