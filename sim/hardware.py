"""Hardware profiles: what a device can do, as data (``sim/profiles/*.json``).

A profile is a JSON object. Required keys (all numbers positive, SI units: bytes, bytes/s,
FLOP/s, seconds):

    name, description, vendor
    compute_units            CUs (AMD) or SMs (NVIDIA)
    gpus_per_node
    peak_flops               {dtype: dense peak FLOP/s}, at least "bf16" and "fp8"
    hbm_bytes, hbm_bandwidth peak capacity and bandwidth
    fabric                   {"topology": "full_mesh" | "switch", "links_per_gpu",
                              "link_bandwidth" (peak bytes/s per link per direction)}
    nic_bandwidth_per_gpu    inter-node bytes/s per GPU per direction
    kernel_launch_s          CPU launch cost per kernel outside a captured graph
    sources                  {key: where the figure was published}; every key above needs one

Shipped profiles are built from public component measurements (``docs/hardware.md``); ``epsim
calibrate`` writes profiles of the same schema. ``load_profile`` takes a shipped name or a path.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from model.errors import EpsimError

TOPOLOGIES = ("full_mesh", "switch")
_NUMBER_KEYS = ("compute_units", "gpus_per_node", "hbm_bytes", "hbm_bandwidth",
                "nic_bandwidth_per_gpu", "kernel_launch_s")
_SOURCED_KEYS = ("peak_flops", "hbm_bytes", "hbm_bandwidth", "fabric", "nic_bandwidth_per_gpu",
                 "kernel_launch_s")


@dataclass(frozen=True)
class Fabric:
    """The intra-node interconnect.

    topology: ``"full_mesh"`` (MI300X: a direct xGMI link to each peer) or ``"switch"``
        (NVLink through NVSwitch: any pattern at the per-GPU bandwidth).
    links_per_gpu: 7 on MI300X.
    link_bandwidth: peak bytes/s per link per direction. Example: 64e9 (xGMI on MI300X).
    """

    topology: str
    links_per_gpu: int
    link_bandwidth: float

    @property
    def gpu_bandwidth(self) -> float:
        """Peak bytes/s one GPU can send to all peers together."""
        return self.links_per_gpu * self.link_bandwidth


@dataclass(frozen=True)
class HardwareProfile:
    """One device type. ``raw`` keeps the whole JSON object for the tables the cost model reads.

    name: e.g. ``"mi300x"``.
    peak_flops: dense peak FLOP/s per dtype. Example: ``{"bf16": 1.3074e15, "fp8": 2.6149e15}``.
    hbm_bytes / hbm_bandwidth: 192e9 / 5.3e12 on MI300X.
    fabric: see :class:`Fabric`.
    nic_bandwidth_per_gpu: inter-node bytes/s per GPU per direction. Example: 50e9 (400 Gb/s).
    kernel_launch_s: 4.5e-6 on MI300X.
    """

    name: str
    description: str
    vendor: str
    compute_units: int
    gpus_per_node: int
    peak_flops: Mapping[str, float]
    hbm_bytes: float
    hbm_bandwidth: float
    fabric: Fabric
    nic_bandwidth_per_gpu: float
    kernel_launch_s: float
    sources: Mapping[str, str]
    raw: Mapping[str, Any]

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for a compute dtype (fp16 falls back to bf16, fp32 to bf16 / 8)."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        if dtype == "fp16":
            return self.peak_flops["bf16"]
        if dtype == "fp32":
            return self.peak_flops["bf16"] / 8
        raise EpsimError(f"profile {self.name} has no peak FLOP/s for dtype {dtype!r}")


def shipped_profiles() -> list[str]:
    folder = resources.files("sim") / "profiles"
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def _number(obj: Mapping[str, Any], key: str, where: str) -> float:
    if key not in obj:
        raise EpsimError(f"{where}: profile lacks required key {key!r}")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise EpsimError(f"{where}: {key} must be a positive number, got {value!r}")
    return float(value)


def profile_from_dict(obj: Any, where: str = "profile") -> HardwareProfile:
    """Validate a parsed profile object and build a :class:`HardwareProfile`."""
    if not isinstance(obj, Mapping):
        raise EpsimError(f"{where}: a hardware profile must be a JSON object")
    for key in ("name", "peak_flops", "fabric", "sources"):
        if key not in obj:
            raise EpsimError(f"{where}: profile lacks required key {key!r}")
    numbers = {key: _number(obj, key, where) for key in _NUMBER_KEYS}
    peaks = obj["peak_flops"]
    if not isinstance(peaks, Mapping) or not {"bf16", "fp8"} <= set(peaks):
        raise EpsimError(f"{where}: peak_flops must be an object with at least bf16 and fp8")
    peak_flops = {dtype: _number(peaks, dtype, f"{where}: peak_flops") for dtype in peaks}
    fabric_obj = obj["fabric"]
    if not isinstance(fabric_obj, Mapping):
        raise EpsimError(f"{where}: fabric must be an object")
    topology = fabric_obj.get("topology")
    if topology not in TOPOLOGIES:
        raise EpsimError(
            f"{where}: fabric.topology must be one of {', '.join(TOPOLOGIES)}, got {topology!r}"
        )
    fabric = Fabric(
        topology=topology,
        links_per_gpu=int(_number(fabric_obj, "links_per_gpu", f"{where}: fabric")),
        link_bandwidth=_number(fabric_obj, "link_bandwidth", f"{where}: fabric"),
    )
    sources = obj["sources"]
    if not isinstance(sources, Mapping):
        raise EpsimError(f"{where}: sources must be an object")
    missing = [k for k in _SOURCED_KEYS if not sources.get(k)]
    if missing:
        raise EpsimError(f"{where}: sources lacks an entry for {', '.join(missing)}")
    return HardwareProfile(
        name=str(obj["name"]),
        description=str(obj.get("description", "")),
        vendor=str(obj.get("vendor", "")),
        compute_units=int(numbers["compute_units"]),
        gpus_per_node=int(numbers["gpus_per_node"]),
        peak_flops=peak_flops,
        hbm_bytes=numbers["hbm_bytes"],
        hbm_bandwidth=numbers["hbm_bandwidth"],
        fabric=fabric,
        nic_bandwidth_per_gpu=numbers["nic_bandwidth_per_gpu"],
        kernel_launch_s=numbers["kernel_launch_s"],
        sources=dict(sources),
        raw=dict(obj),
    )


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A shipped profile by name (``mi300x``) or a path to a profile JSON file."""
    text_name = str(name_or_path)
    path = Path(text_name)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise EpsimError(f"hardware profile file not found: {path}")
        where, text = str(path), path.read_text(encoding="utf-8", errors="replace")
    else:
        shipped = resources.files("sim") / "profiles" / f"{text_name}.json"
        if not shipped.is_file():
            raise EpsimError(
                f"unknown hardware {text_name!r}: not a shipped profile "
                f"({', '.join(shipped_profiles())}) nor a path to a profile JSON"
            )
        where, text = text_name, shipped.read_text(encoding="utf-8")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EpsimError(f"{where}: malformed profile JSON ({exc.msg} at line {exc.lineno})") from None
    return profile_from_dict(obj, where)
