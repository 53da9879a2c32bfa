"""What made a result (docs/provenance.md).

:func:`stamp_provenance` is the one function every output path calls (every ``--json`` through
``emit_json``, every CSV row through ``write_csv``, the frontier chart's footer,
``--save-result``, calibrate's profiles, ``epsim.fidelity.stamp``): ``epsim_version``
(``epsim --version``), the hardware profile's name, ``profile_hash`` (SHA-256 of the profile
file's bytes), the kernel set and each of its tables' source commits. A simulated result echoes
its profile's part (``HardwareProfile.provenance()``, ``epsim.sim.hardware.profile``: the sim
knows which profile it ran, the front door knows the version); this module completes it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, MutableMapping
from typing import Any

from epsim import __version__

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
