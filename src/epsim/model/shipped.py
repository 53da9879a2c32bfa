"""Data that ships inside the package, addressed by name (read with ``importlib.resources``, so
editable and wheel installs alike find it).

    package folder                          names (``--flag NAME``)
    epsim.model  configs/*.json             models: ``deepseek-r1``, ``tiny-deepseek``, ...
    epsim.model  data/loads/*.json          load statistics: ``decode_in2000out100``, ...
    epsim.sim.hardware profiles/*.json      hardware profiles: ``mi300x``, ``h200``, ...
    epsim.calibrate grids/*.json            validation grids: ``cpu``, ``gpu1``

A name is a file's stem. Each reader decides whether a path given by the user wins over a name.
"""

from __future__ import annotations

from importlib import resources

from .bounds import MAX_NAME_CHARS


def shipped_names(package: str, folder: str) -> list[str]:
    """Stems of the ``.json`` files in ``folder`` of ``package``, sorted. Example:
    ``shipped_names("epsim.calibrate", "grids") == ["cpu", "gpu1"]``."""
    base = resources.files(package) / folder
    return sorted(p.name[: -len(".json")] for p in base.iterdir() if p.name.endswith(".json"))


def shipped_text(package: str, folder: str, name: str) -> str | None:
    """The text of the shipped ``name`` (``folder/name.json`` of ``package``), None when no such
    file ships."""
    if "/" in name or "\\" in name or name.startswith(".") or "\0" in name \
            or len(name) > MAX_NAME_CHARS - len(".json"):  # the OS refuses such a file name
        return None
    file = resources.files(package) / folder / f"{name}.json"
    return file.read_text(encoding="utf-8") if file.is_file() else None
