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

Optional (the step simulator needs it; ``epsim calibrate`` fits the same keys):

    efficiency               achievable-efficiency tables, every key required when present:
      gemm_flops_fraction    {dtype: achievable / peak FLOP/s of a large GEMM}, at least bf16, fp8
      gemm_tile_m            rows of the matrix-core tile: a GEMM of M rows computes
                             ceil(M / tile) * tile rows (the skinny-M decode penalty)
      hbm_fraction           achievable / peak HBM bandwidth (streaming kernels)
      attention_split_tokens KV tokens per split-KV work item of decode attention; work items =
                             seqs * ceil(context / split), occupancy = items over whole waves of CUs
      link_bandwidth_usable  bytes/s per direction one xGMI link (full_mesh) or one GPU's NVLink
                             (switch) delivers to an all-to-all
      nic_bandwidth_usable   bytes/s per direction per GPU over the inter-node NIC
      a2a_latency_s          fixed cost of one EP dispatch or combine kernel
      collective_latency_s   fixed cost of a small all-reduce / all-gather, eager
      collective_latency_graph_s   the same inside a captured graph
      graph_launch_s         CPU cost of launching one captured graph
      graph_node_s           GPU-side gap between two kernels of a replayed graph
      comm_compute_slowdown  share of compute throughput lost while a comm kernel runs on the GPU
                             (the CUs/SMs the comm kernel occupies)
    optional efficiency keys (absent: the default named):
      attention_decode_flops {KV dtype: FLOP/s} a published decode-attention kernel's achieved rate
                             at full occupancy (MLA decode kernels run far below the GEMM rate:
                             softmax, split-KV reduction); absent: the GEMM's achievable rate
    sources["efficiency.<key>"] gives each one's source.

Shipped profiles are built from public component measurements (``docs/hardware.md``); ``epsim
calibrate`` writes profiles of the same schema. ``load_profile`` takes a shipped name or a path.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
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


EFFICIENCY_KEYS: tuple[str, ...] = (
    "gemm_flops_fraction", "gemm_tile_m", "hbm_fraction", "attention_split_tokens",
    "link_bandwidth_usable", "nic_bandwidth_usable", "a2a_latency_s", "collective_latency_s",
    "collective_latency_graph_s", "graph_launch_s", "graph_node_s", "comm_compute_slowdown",
)
_FRACTION_KEYS = ("hbm_fraction", "comm_compute_slowdown")


@dataclass(frozen=True)
class Efficiency:
    """Achievable-efficiency figures the cost model reads (see the module docstring).

    gemm_flops_fraction: ``{dtype: fraction}``. Example (MI300X hipBLASLt): ``{"bf16": 0.5415,
        "fp8": 0.4868}`` (708 / 1307.4 and 1273 / 2614.9).
    gemm_tile_m: 16 (CDNA3 MFMA 16x16 tiles).
    hbm_fraction: 0.7925 (4.2 of 5.3 TB/s).
    attention_split_tokens: 512.
    link_bandwidth_usable: 48e9 (xGMI per link).
    nic_bandwidth_usable: 45e9.
    a2a_latency_s: 21.8e-6 (MORI-EP, derived in docs/hardware.md).
    collective_latency_s / collective_latency_graph_s: 13e-6 / 6.8e-6.
    graph_launch_s / graph_node_s: 4.5e-6 / 1e-6.
    comm_compute_slowdown: 0.21 (64 of 304 CUs).
    attention_decode_flops: ``{kv dtype: FLOP/s}``, empty when no kernel figure is published.
        Example (MI300X, aiter FP8 MLA decode): ``{"fp8": 3.67e14}``.
    """

    gemm_flops_fraction: Mapping[str, float]
    gemm_tile_m: int
    hbm_fraction: float
    attention_split_tokens: int
    link_bandwidth_usable: float
    nic_bandwidth_usable: float
    a2a_latency_s: float
    collective_latency_s: float
    collective_latency_graph_s: float
    graph_launch_s: float
    graph_node_s: float
    comm_compute_slowdown: float
    attention_decode_flops: Mapping[str, float] = field(default_factory=dict)

    def gemm_fraction(self, dtype: str) -> float:
        """Achievable fraction for a compute dtype (fp16/fp32 fall back to bf16)."""
        if dtype in self.gemm_flops_fraction:
            return self.gemm_flops_fraction[dtype]
        return self.gemm_flops_fraction["bf16"]


def _efficiency(obj: Any, sources: Mapping[str, Any], where: str) -> Efficiency:
    if not isinstance(obj, Mapping):
        raise EpsimError(f"{where}: efficiency must be an object")
    for key in EFFICIENCY_KEYS:
        if key not in obj:
            raise EpsimError(f"{where}: efficiency lacks required key {key!r}")
    fractions = obj["gemm_flops_fraction"]
    if not isinstance(fractions, Mapping) or not {"bf16", "fp8"} <= set(fractions):
        raise EpsimError(f"{where}: efficiency.gemm_flops_fraction must be an object with at "
                         "least bf16 and fp8")
    gemm = {d: _number(fractions, d, f"{where}: efficiency.gemm_flops_fraction")
            for d in fractions}
    values: dict[str, Any] = {"gemm_flops_fraction": gemm}
    for key in EFFICIENCY_KEYS[1:]:
        values[key] = _number(obj, key, f"{where}: efficiency")
    for key in ("gemm_flops_fraction", *_FRACTION_KEYS):
        numbers = gemm.values() if key == "gemm_flops_fraction" else [values[key]]
        if any(v > 1 for v in numbers):
            raise EpsimError(f"{where}: efficiency.{key} must be a fraction in (0, 1]")
    if values["comm_compute_slowdown"] >= 1:
        raise EpsimError(f"{where}: efficiency.comm_compute_slowdown must be below 1")
    missing = [k for k in EFFICIENCY_KEYS if not sources.get(f"efficiency.{k}")]
    if missing:
        raise EpsimError(f"{where}: sources lacks an entry for "
                         + ", ".join(f"efficiency.{k}" for k in missing))
    if "attention_decode_flops" in obj:
        table = obj["attention_decode_flops"]
        where_table = f"{where}: efficiency.attention_decode_flops"
        if not isinstance(table, Mapping) or not table:
            raise EpsimError(f"{where_table} must be an object {{kv dtype: FLOP/s}}")
        if not sources.get("efficiency.attention_decode_flops"):
            raise EpsimError(f"{where}: sources lacks an entry for efficiency.attention_decode_flops")
        values["attention_decode_flops"] = {str(k): _number(table, k, where_table) for k in table}
    values["gemm_tile_m"] = int(values["gemm_tile_m"])
    values["attention_split_tokens"] = int(values["attention_split_tokens"])
    return Efficiency(**values)


@dataclass(frozen=True)
class HardwareProfile:
    """One device type. ``raw`` keeps the whole JSON object for the tables the cost model reads.

    name: e.g. ``"mi300x"``.
    peak_flops: dense peak FLOP/s per dtype. Example: ``{"bf16": 1.3074e15, "fp8": 2.6149e15}``.
    hbm_bytes / hbm_bandwidth: 192e9 / 5.3e12 on MI300X.
    fabric: see :class:`Fabric`.
    nic_bandwidth_per_gpu: inter-node bytes/s per GPU per direction. Example: 50e9 (400 Gb/s).
    kernel_launch_s: 4.5e-6 on MI300X.
    efficiency: the achievable-efficiency tables (:class:`Efficiency`), ``None`` when the
        profile has none (it then describes hardware but cannot drive the simulator).
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
    efficiency: Efficiency | None = None

    def require_efficiency(self) -> Efficiency:
        """The efficiency tables, or an error naming the profile that lacks them."""
        if self.efficiency is None:
            raise EpsimError(f"profile {self.name} has no 'efficiency' tables; the simulator "
                             "needs them (see sim/hardware.py)")
        return self.efficiency

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
        efficiency=_efficiency(obj["efficiency"], sources, where) if "efficiency" in obj else None,
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
