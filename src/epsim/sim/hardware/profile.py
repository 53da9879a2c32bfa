"""Hardware profiles: what a device can do, as data (``sim/hardware/profiles/*.json``).

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
    optional efficiency keys (absent: the default named / no effect):
      attention_decode_flops {KV dtype: FLOP/s} a published decode-attention kernel's achieved rate
                             at full occupancy (MLA decode kernels run far below the GEMM rate:
                             softmax, split-KV reduction); absent: the GEMM's achievable rate
    fitted by ``epsim calibrate`` for CPU runtimes (where the host that issues ops is the
    device that computes them):
      op_overhead_s          {op kind: seconds} fixed cost added to each compute op of that kind,
                             not overlapped (e.g. Python dispatch around a CPU kernel); a key
                             may be an op class (``gemm.batched``: batched GEMMs), which falls
                             back to its kind
      op_time_scale          {op kind: factor} multiplies that kind's roofline time (a kernel
                             family below or above the shared roofline); under ``roofline: sum``
                             its FLOP term only
      op_bytes_scale         {op kind: factor} on the bytes term under ``roofline: sum``
      roofline               "max" (default: compute and memory traffic overlap, as on a GPU) or
                             "sum" (they add: one CPU core does both in turn)
      a2a_latency_per_peer_s extra fixed cost of a dispatch (and a combine, unless
                             ``combine_latency_per_peer_s``) per peer in its group
      combine_latency_s      fixed cost of a combine when it differs from a dispatch's
                             (``a2a_latency_s`` otherwise)
      combine_latency_per_peer_s   per-peer cost of a combine when it differs
      a2a_latency_by_group_s {"dispatch" | "combine": {group size: seconds}}: measured fixed
                             costs per group size, used instead of the two lines above (linear
                             in between, the last two points' slope beyond, the first below)
      rank_compute_slowdown  {ranks per node: factor}: each compute op takes ``factor`` times as
                             long when that many ranks share the node's cores (measured points;
                             linear in between from (1, 1), proportional to ranks beyond the last)
      rank_compute_slowdown_by_kind  {op class: {ranks per node: factor}}: the same per op class
                             (short ops and long ones suffer differently); classes not listed
                             use ``rank_compute_slowdown``
      comm_concurrency       collectives one rank can have in flight at once (default 1: a GPU's
                             one communication stream; 2 for torch's gloo, whose two worker
                             threads run asynchronous collectives side by side)
      a2a_host_block_by_group_s  {"dispatch" | "combine": {group size: seconds}}: how long an
                             eager host is held inside the call that issues the exchange,
                             measured per group size (gloo: the dispatch's blocking count
                             exchange; the combine's asynchronous call, which returns only when
                             the rank's threads get a core); absent: a dispatch holds the host
                             for its whole fixed cost, a combine not at all
      a2a_host_block_fraction  {ranks per node: fraction}: a dispatch's blocking count exchange
                             holds the eager host this share of the compute issued since the
                             previous exchange beyond its ``a2a_host_block_by_group_s`` entry
                             (it waits for ranks that drifted apart over that compute; under
                             DBO half a layer's); 0 at one rank, linear between (absent: 0)
      exchange_straggler_fraction  {ranks per node: fraction}: the last rank reaches an EP exchange
                             this fraction of the compute since the previous exchange after the
                             average one (ranks time-sliced on shared cores drift apart in
                             proportion to the work between two meetings); the exchange and the
                             host's wait on a dispatch last that much longer (absent: 0)
      comm_compute_slowdown_by_group  {ranks per node: share}: ``comm_compute_slowdown``
                             measured at each number of ranks sharing a node's cores (gloo's
                             threads take more of a core the more ranks share them); linear
                             between the points, the nearest end outside; absent: the scalar
      rank_skew_by_group_s   {ranks per node: seconds}: how much longer the slowest of the ranks
                             sharing a node's cores takes per step than the mean one (a step
                             lasts as long as its slowest rank; the simulator's ranks run alike);
                             added to the step's ``launch`` time; 0 at one rank, linear between
                             the points, the last two points' slope beyond (absent: 0)
    fitted by ``epsim calibrate --from-bench`` (and ``--from-trace``) to measured runs of one
    stack; they act under any kernel set (no shipped profile has them):
      op_final_scale         {factor: multiplier} on an op's final time (kernel table or
                             roofline, after every other figure): a key is an op class
                             (``gemm.batched``), an op kind, or a group of kinds
                             (``SCALE_GROUPS``: attention, communication, other); the most
                             specific key present wins, absent ones are 1
      host_ms_per_step       the engine's host time per step measured on this stack: used under
                             ``--engine`` when ``--host-ms-per-step`` is not given
    sources["efficiency.<key>"] gives each one's source (optional keys included when present).

Optional:

    kernels                  measured kernel tables per kernel library (``epsim.sim.hardware.kernel_sets``
                             documents the schema): ``{"default", "sources", "sets"}``; every
                             point names its source there. ``load_profile(..., kernels=NAME)``
                             or ``profile.with_kernels(NAME)`` picks a set; ``"none"`` (always
                             there) is the roofline alone, the default without the section.

Shipped profiles are built from public component measurements (``docs/hardware.md``); ``epsim
calibrate`` writes profiles of the same schema. ``load_profile`` takes a shipped name or a path.

Provenance (docs/provenance.md): a loaded profile knows the SHA-256 of its file's bytes
(``profile_hash``: what ``sha256sum`` prints for the file), and ``provenance()`` is what a result
carries of it: name, hash, kernel set and each of the set's tables' source commits.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from epsim.model.bounds import MAX_ID, check_count, is_file, parse_json
from epsim.model.errors import EpsimError
from epsim.model.shipped import shipped_names, shipped_text

from .a2a import AUTO, check_choice
from .efficiency import Efficiency, number, parse_efficiency
from .kernel_sets import NONE, KernelSet, KernelSets, parse_kernels
from .table_guard import Roof

TOPOLOGIES = ("full_mesh", "switch")
#: profiles kept parsed (by file content and name): every shipped one and a few files
PARSED_PROFILES = 32
_NUMBER_KEYS = ("compute_units", "gpus_per_node", "hbm_bytes", "hbm_bandwidth",
                "nic_bandwidth_per_gpu", "kernel_launch_s")
_WHOLE_KEYS = ("compute_units", "gpus_per_node")
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
    efficiency: the achievable-efficiency tables (:class:`Efficiency`), ``None`` when the
        profile has none (it then describes hardware but cannot drive the simulator).
    kernels: the measured kernel sets (``epsim.sim.hardware.kernel_sets.KernelSets``), ``None`` without a
        ``kernels`` section.
    kernel_set: the selected set's name: the section's ``default`` unless chosen with
        :meth:`with_kernels`; ``"none"``: the roofline alone.
    a2a_mode: how EP dispatch/combine run (``epsim.sim.hardware.a2a``: ``"auto"``, ``"low_latency"`` or
        ``"normal"``), chosen with :meth:`with_a2a_mode`; an engine's choice carried beside the
        kernel set, as both select kernels.
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
    kernels: KernelSets | None = None
    kernel_set: str = NONE
    a2a_mode: str = AUTO
    #: SHA-256 hex digest of the file the profile was read from ("": built from a dict)
    content_hash: str = ""

    @property
    def kernel_sets(self) -> tuple[str, ...]:
        """The kernel set names ``--kernels`` accepts (``"none"`` always; listed last)."""
        return self.kernels.names if self.kernels is not None else (NONE,)

    @property
    def active_kernels(self) -> KernelSet | None:
        """The selected kernel set, ``None`` for the roofline alone."""
        return None if self.kernels is None else self.kernels.get(self.kernel_set)

    @property
    def plan_options(self) -> dict[str, Any]:
        """Plan options the selected kernel set implies (``{}`` for ``"none"``). Example:
        ``{"shared_expert_in_moe": True}`` (aiter's fused MoE runs the shared expert inside it)."""
        active = self.active_kernels
        return {} if active is None else dict(active.plan_options)

    def with_kernels(self, name: str | None) -> HardwareProfile:
        """This profile with kernel set ``name`` selected (None: the profile's default); an
        unknown name is one line listing the sets."""
        if name is None:
            name = self.kernels.default if self.kernels is not None else NONE
        if name not in self.kernel_sets:
            raise EpsimError(f"unknown kernel set {name!r} for hardware {self.name}; choose one "
                             f"of {', '.join(self.kernel_sets)}")
        return self if name == self.kernel_set else replace(self, kernel_set=name)

    def with_a2a_mode(self, mode: str | None) -> HardwareProfile:
        """This profile with EP exchange mode ``mode`` (None: ``"auto"``); an unknown name is
        one line listing the modes."""
        mode = check_choice(AUTO if mode is None else mode)
        return self if mode == self.a2a_mode else replace(self, a2a_mode=mode)

    @cached_property
    def fingerprint(self) -> str:
        """The profile's whole content, selected kernel set and a2a mode, as one string (a
        cache key)."""
        return (json.dumps(self.raw, sort_keys=True, default=str) + "|" + self.kernel_set
                + "|" + self.a2a_mode)

    @property
    def profile_hash(self) -> str:
        """The SHA-256 hex digest of the profile file's bytes; a profile built from a dict (not
        read from a file) digests its canonical JSON (keys sorted, no spaces) instead."""
        if self.content_hash:
            return self.content_hash
        canonical = json.dumps(self.raw, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    def provenance(self) -> dict[str, Any]:
        """What a result carries of the profile that made it. Example: ``{"hardware_profile":
        "mi300x", "profile_hash": "9f2c...", "kernel_set": "aiter", "table_sources":
        {"aiter-gemm-mi300x": "ROCm/aiter@e4048607..."}}`` (``{}``: the roofline alone)."""
        cited = self.kernels.cited(self.kernel_set) if self.kernels is not None else {}
        return {"hardware_profile": self.name, "profile_hash": self.profile_hash,
                "kernel_set": self.kernel_set, "table_sources": cited}

    @property
    def roof(self) -> Roof:
        """The peaks the table guard judges kernel-table points against (``table_guard``)."""
        return Roof(self.peak_flops, self.hbm_bandwidth, self.fabric.gpu_bandwidth,
                    self.nic_bandwidth_per_gpu, self.fabric.topology == "switch")

    def require_efficiency(self) -> Efficiency:
        """The efficiency tables, or an error naming the profile that lacks them."""
        if self.efficiency is None:
            raise EpsimError(f"profile {self.name} has no 'efficiency' tables; the simulator "
                             "needs them (see sim/hardware/profile.py)")
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
    return shipped_names("epsim.sim.hardware", "profiles")


def shipped_profile_hashes() -> dict[str, str]:
    """Every shipped profile's ``profile_hash`` by name (``epsim --version`` prints them)."""
    return {name: hashlib.sha256(_shipped_bytes(name)).hexdigest()
            for name in shipped_profiles()}


def _shipped_bytes(name: str) -> bytes:
    text = shipped_text("epsim.sim.hardware", "profiles", name)
    return b"" if text is None else text.encode("utf-8")



def profile_from_dict(obj: Any, where: str = "profile", content_hash: str = ""
                      ) -> HardwareProfile:
    """Validate a parsed profile object and build a :class:`HardwareProfile` (``content_hash``:
    the digest of the file it was read from, if any)."""
    if not isinstance(obj, Mapping):
        raise EpsimError(f"{where}: a hardware profile must be a JSON object")
    for key in ("name", "peak_flops", "fabric", "sources"):
        if key not in obj:
            raise EpsimError(f"{where}: profile lacks required key {key!r}")
    numbers = {key: number(obj, key, where) for key in _NUMBER_KEYS}
    for key in _WHOLE_KEYS:  # counts: half a compute unit would size a wave of zero
        check_count(numbers[key], MAX_ID, key, where)
    peaks = obj["peak_flops"]
    if not isinstance(peaks, Mapping) or not {"bf16", "fp8"} <= set(peaks):
        raise EpsimError(f"{where}: peak_flops must be an object with at least bf16 and fp8")
    peak_flops = {dtype: number(peaks, dtype, f"{where}: peak_flops") for dtype in peaks}
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
        links_per_gpu=check_count(number(fabric_obj, "links_per_gpu", f"{where}: fabric"),
                                  MAX_ID, "links_per_gpu", f"{where}: fabric"),
        link_bandwidth=number(fabric_obj, "link_bandwidth", f"{where}: fabric"),
    )
    sources = obj["sources"]
    if not isinstance(sources, Mapping):
        raise EpsimError(f"{where}: sources must be an object")
    missing = [k for k in _SOURCED_KEYS if not sources.get(k)]
    if missing:
        raise EpsimError(f"{where}: sources lacks an entry for {', '.join(missing)}")
    roof = Roof(peak_flops, numbers["hbm_bandwidth"], fabric.gpu_bandwidth,
                numbers["nic_bandwidth_per_gpu"], fabric.topology == "switch")
    kernels = parse_kernels(obj["kernels"], where, roof) if "kernels" in obj else None
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
        efficiency=parse_efficiency(obj["efficiency"], sources, where) if "efficiency" in obj else None,
        kernels=kernels, kernel_set=kernels.default if kernels is not None else NONE,
        content_hash=content_hash,
    )


def load_profile(name_or_path: str | Path, kernels: str | None = None,
                 a2a_mode: str | None = None) -> HardwareProfile:
    """A shipped profile by name (``mi300x``) or a path to a profile JSON file, with kernel set
    ``kernels`` selected (None: the profile's default; ``"none"``: the roofline alone) and EP
    exchange mode ``a2a_mode`` (None: ``"auto"``, ``epsim.sim.hardware.a2a``)."""
    text_name = str(name_or_path)
    path = Path(text_name)
    if path.suffix == ".json" or is_file(path):
        if not path.is_file():
            raise EpsimError(f"hardware profile file not found: {path}")
        where, data = str(path), path.read_bytes()
    else:
        shipped = shipped_text("epsim.sim.hardware", "profiles", text_name)
        if shipped is None:
            raise EpsimError(
                f"unknown hardware {text_name!r}: not a shipped profile "
                f"({', '.join(shipped_profiles())}) nor a path to a profile JSON"
            )
        where, data = text_name, shipped.encode("utf-8")
    return profile_from_bytes(data, where).with_kernels(kernels).with_a2a_mode(a2a_mode)


def profile_from_bytes(data: bytes, where: str = "profile") -> HardwareProfile:
    """A profile from the bytes of its file (``profile_hash``: their SHA-256). Parsed once per
    content and name: a search loads its profile for every point, and the kernel tables'
    parsing was a fifth of a steady point's time; a profile is frozen, so sharing it is safe."""
    return _parsed_profile(data, where)


@functools.lru_cache(maxsize=PARSED_PROFILES)
def _parsed_profile(data: bytes, where: str) -> HardwareProfile:
    obj = parse_json(data.decode("utf-8", errors="replace"), where, "profile JSON")
    return profile_from_dict(obj, where, hashlib.sha256(data).hexdigest())
