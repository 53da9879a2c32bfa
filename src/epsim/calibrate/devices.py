"""What calibration does differently per device kind: one recipe each, looked up by name.

``epsim calibrate --device NAME`` takes :data:`DEVICES`\\ ``[NAME]``; ``calibrate/profile.py``
runs the same sweeps and writes the same keys for every kind, and asks the recipe only where a
kind differs. Adding a kind is adding a recipe here, not a branch there.

Recipe fields (:class:`DeviceRecipe`):
    name                      the ``--device`` word, also the torch device the sweeps run on.
                              Example: ``"cpu"``
    fit_compute               ops table -> :class:`~.fit.ComputeFit`: ``fit_compute_sum`` (one
                              CPU core computes and moves bytes in turn: ``roofline: "sum"``) or
                              ``fit_compute`` (a GPU overlaps them: ``"max"``)
    gpus_per_node             machine facts -> the profile's ``gpus_per_node``. Example: a CPU's
                              cores (``{"cpu_count": 2}`` -> 2); a GPU: 1
    hbm_bytes                 machine facts -> the profile's ``hbm_bytes``. Example: a CPU's RAM
    hbm_source                ``sources["hbm_bytes"]``
    kernel_launch_placeholder ``sources["kernel_launch_s"]`` where ``kernel_launch_s`` is a
                              negligible 1e-9; ``None``: it is the steps' median gap (measured)
    local_ranks               whether the machine runs several local ranks: then ``calibrate``
                              measures the ranks sweep, the all-to-all and the contention;
                              otherwise world size 1 and the communication figures of ``--base``
    default_base              the ``--base`` profile when none is given. Example: ``"h200"``
    extra_efficiency          () -> ``{key: (value, source)}``: efficiency keys only this kind
                              writes. Example: ``{"comm_concurrency": (2, "...")}``
    check_available           () -> None; raises EpsimError where the device is absent
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pandas as pd

from epsim.model.errors import EpsimError

from .fit import ComputeFit, fit_compute, fit_compute_sum


def _memory_bytes() -> float:
    """The machine's physical memory in bytes (8e9 where the OS does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8e9


def _gloo_worker_threads() -> int:
    """Asynchronous collectives gloo runs at once: its worker threads (torch's default is 2)."""
    try:
        import torch.distributed as dist

        return max(1, int(dist.ProcessGroupGloo._Options()._threads))
    except Exception:  # an older or newer torch without the attribute: one at a time
        return 1


def _gloo_concurrency() -> dict[str, tuple[Any, str]]:
    """The CPU's exchanges run on gloo's worker threads, side by side up to their number."""
    threads = _gloo_worker_threads()
    return {"comm_concurrency": (
        threads, "torch.distributed.ProcessGroupGloo default options on this machine: "
        f"{threads} worker threads run asynchronous collectives side by side")}


def _no_extras() -> dict[str, tuple[Any, str]]:
    return {}


def _always_available() -> None:
    return None


def _require_cuda() -> None:
    try:
        import torch

        ok = torch.cuda.is_available()
    except Exception:  # torch missing or broken: no device to calibrate either way
        ok = False
    if not ok:
        raise EpsimError("--device cuda but torch sees no CUDA device")


@dataclass(frozen=True)
class DeviceRecipe:
    """How one device kind is calibrated (the module docstring lists the fields)."""

    name: str
    fit_compute: Callable[[pd.DataFrame], ComputeFit]
    gpus_per_node: Callable[[dict[str, Any]], int]
    hbm_bytes: Callable[[dict[str, Any]], float]
    hbm_source: str
    kernel_launch_placeholder: str | None
    local_ranks: bool
    default_base: str | None = None
    extra_efficiency: Callable[[], dict[str, tuple[Any, str]]] = _no_extras
    check_available: Callable[[], None] = _always_available


CPU = DeviceRecipe(
    name="cpu",
    fit_compute=fit_compute_sum,
    # a CPU node's "GPUs" are its local ranks: one per core by default (epsim step
    # --gpus-per-node W simulates W local ranks, as epsim run --world-size W runs them)
    gpus_per_node=lambda machine: int(machine.get("cpu_count") or 1),
    hbm_bytes=lambda machine: _memory_bytes(),
    hbm_source="physical memory of the machine (os.sysconf)",
    # the CPU runtime issues and computes an op on the same core: what issuing costs is in the
    # fitted op_overhead_s, so a launch figure would count it twice
    kernel_launch_placeholder="the CPU runtime has no separate host: what issuing an op costs is "
                              "in efficiency.op_overhead_s; this is a negligible placeholder",
    local_ranks=True,
    extra_efficiency=_gloo_concurrency,
)

CUDA = DeviceRecipe(
    name="cuda",
    fit_compute=fit_compute,
    gpus_per_node=lambda machine: 1,
    # torch reports the GPU's memory where it sees one; RAM is the figure of last resort
    hbm_bytes=lambda machine: machine.get("gpu_memory_bytes") or _memory_bytes(),
    hbm_source="the GPU's memory (torch.cuda.get_device_properties)",
    kernel_launch_placeholder=None,
    # one GPU: world size 1, no exchange to measure; a shipped profile lends the fabric
    local_ranks=False,
    default_base="h200",
    check_available=_require_cuda,
)

#: ``--device`` name -> recipe
DEVICES: dict[str, DeviceRecipe] = {r.name: r for r in (CPU, CUDA)}


def device_recipe(name: str) -> DeviceRecipe:
    """The recipe of device kind ``name``; EpsimError for a kind calibration does not know."""
    if name not in DEVICES:
        raise EpsimError(f"device must be {' or '.join(DEVICES)}, got {name!r}")
    return DEVICES[name]
