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
``predict``, ``sweep`` rows, ``tune`` and ``plan``); :func:`band_text` is its line in text output.

Provenance: :func:`stamp_provenance` is the one function every output path calls (every
``--json`` through ``emit_json``, every CSV row through ``write_csv``, the frontier chart's
footer, ``--save-result``, calibrate's profiles): ``epsim_version`` (``epsim --version``), the
hardware profile's name, ``profile_hash`` (SHA-256 of the profile file's bytes), the kernel set
and each of its tables' source commits. A simulated result echoes its profile's part
(``HardwareProfile.provenance()``, ``epsim.sim.hardware.profile``: the sim knows which profile
it ran, the front door knows the version); this module completes it. docs/provenance.md.
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


# --------------------------------------------------------------------------------------------
# Provenance: what made a result (docs/provenance.md)
# --------------------------------------------------------------------------------------------

#: the keys of a provenance object, in order
PROVENANCE_KEYS = ("epsim_version", "hardware_profile", "profile_hash", "kernel_set",
                   "table_sources")
#: the profile's part of it (``HardwareProfile.provenance()``, echoed by every simulated result)
_PROFILE_KEYS = PROVENANCE_KEYS[1:4]


def provenance(*profiles: Mapping[str, Any]) -> dict[str, Any]:
    """The provenance object of an output made with ``profiles`` (each a profile's
    ``provenance()``, as a simulated result echoes it): ``epsim_version`` and the profile's keys.
    Made with several distinct profiles (a sweep over ``--hardware a,b``): each profile key a
    list, in first-seen order, ``table_sources`` merged; with none: those keys ``None``."""
    distinct: dict[str, Mapping[str, Any]] = {}
    for p in profiles:
        distinct.setdefault(json.dumps([p.get(k) for k in _PROFILE_KEYS]), p)
    out: dict[str, Any] = {"epsim_version": __version__}
    found = list(distinct.values())
    for key in _PROFILE_KEYS:
        values = [p.get(key) for p in found]
        out[key] = values[0] if len(values) == 1 else (values or None)
    out["table_sources"] = {k: v for p in found for k, v in p.get("table_sources", {}).items()}
    return out


def _carried(obj: Any, found: list[dict[str, Any]]) -> None:
    """Complete every result nested in ``obj`` that echoes a profile's provenance with
    ``epsim_version`` (its ``provenance`` moved last, after the figures) and collect them."""
    if isinstance(obj, list | tuple):
        for item in obj:
            _carried(item, found)
        return
    if not isinstance(obj, MutableMapping):
        return
    mark = obj.get("provenance")
    # one profile's (a result's); an output's own over several, or over none, is not collected
    if isinstance(mark, Mapping) and isinstance(mark.get("profile_hash"), str):
        whole = mark if "epsim_version" in mark else provenance(mark)
        del obj["provenance"]
        obj["provenance"] = whole
        found.append(whole)
    for key, value in obj.items():
        if key != "provenance" and isinstance(value, list | tuple | MutableMapping):
            _carried(value, found)


def stamp_provenance(out: MutableMapping[str, Any], *profiles: Mapping[str, Any]
                     ) -> MutableMapping[str, Any]:
    """The one function every output path calls (``emit_json``, ``write_csv``, the frontier
    chart's footer, ``--save-result``, calibrate's profiles, ``stamp``): every result nested in
    ``out`` gets ``epsim_version`` beside its profile's provenance, and ``out`` itself (in
    place, ``provenance`` its first key, where ``head`` shows it) the provenance of all of them
    and of ``profiles`` (those an output not made of simulated results was made with)."""
    found: list[dict[str, Any]] = []
    _carried(out, found)
    whole = provenance(*profiles, *found)
    rest = [(k, out.pop(k)) for k in list(out) if k != "provenance"]
    out["provenance"] = whole
    out.update(rest)
    return out


def row_provenance(row: Mapping[str, Any]) -> dict[str, Any]:
    """A CSV row's provenance: its own, completed (``None`` profile keys when it has none)."""
    mark = row.get("provenance")
    if isinstance(mark, Mapping) and "epsim_version" in mark:
        return dict(mark)
    return provenance(mark) if isinstance(mark, Mapping) else provenance()


def footer_text(prov: Mapping[str, Any], width: int = 120) -> str:
    """A chart's footer: the version, each profile (name, first 16 hex of its hash, kernel
    set) and each table's source at 12 hex of its commit, wrapped at ``width``. Example:
    ``"epsim 0.1.0 | mi300x sha256:9f2c1e0a4b5d6e7f kernels aiter\\ntables: aiter-gemm-mi300x
    ROCm/aiter@e4048607a535, ..."``."""
    names, hashes, sets = (prov.get(k) for k in _PROFILE_KEYS)
    many = isinstance(names, list)
    triples = zip(names, hashes, sets, strict=True) if many else [(names, hashes, sets)]
    parts = [f"epsim {prov['epsim_version']}"]
    for name, digest, kset in triples:
        if name is not None:
            parts.append(f"{name} sha256:{str(digest)[:16]} kernels {kset}")
    lines = [" | ".join(parts)]
    tables = [f"{sid} {_short(where)}" for sid, where in prov.get("table_sources", {}).items()]
    line = "tables:"
    for n, item in enumerate(tables):
        piece = f" {item}" + ("," if n < len(tables) - 1 else "")
        if len(line) + len(piece) > width:
            lines.append(line)
            line = " "
        line += piece
    if tables:
        lines.append(line)
    return "\n".join(lines)


def _short(where: str) -> str:
    """``repo@<40 hex>`` as ``repo@<12 hex>`` (a footer's room); anything else as it is."""
    repo, at, commit = where.partition("@")
    return f"{repo}@{commit[:12]}" if at and "://" not in where else where


def version_text() -> str:
    """What ``epsim --version`` prints: the version, then every shipped profile's hash."""
    from epsim.sim.hardware.profile import shipped_profile_hashes

    rows = shipped_profile_hashes()
    width = max(map(len, rows), default=0)
    return "\n".join([f"epsim {__version__}", "shipped hardware profiles (sha256):",
                      *(f"  {name:<{width}}  {digest}" for name, digest in rows.items())])
