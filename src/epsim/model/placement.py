"""Expert placement: which physical expert slot on which GPU holds which logical expert.

Glossary (as in vLLM's ``eplb_state.py`` and DeepSeek's EPLB):
    logical expert   the router's numbering, ``0 .. num_logical - 1``.
    physical slot    a place for one expert's weights; GPU ``g`` holds slots
                     ``g * slots_per_gpu .. (g + 1) * slots_per_gpu - 1``.
    replica          a logical expert may sit in several slots (redundant experts); its tokens
                     are then shared among them.
    imbalance        per layer, the busiest GPU's load over the mean GPU load (1.0 = perfect).

The router's output is remapped from logical ids to physical slots by :func:`remap`, the one
function that the simulator and the runtime both use.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .bounds import MAX_EXPERTS, MAX_ID, MAX_LAYERS, check_count, read_json_file
from .errors import EpsimError


@dataclass(frozen=True, eq=False)
class Placement:
    """Expert-to-slot tables for every layer.

    physical_to_logical: ``[layers, num_slots]`` int64, the logical expert in each slot.
        Example (1 layer, 4 experts, 2 GPUs, no replicas): ``[[2, 0, 1, 3]]`` puts experts
        2 and 0 on GPU 0 and experts 1 and 3 on GPU 1.
    num_gpus: GPUs the slots are spread over. Example: 8.
    num_logical: logical experts per layer. Example: 256.
    """

    physical_to_logical: np.ndarray
    num_gpus: int
    num_logical: int

    def __post_init__(self) -> None:
        p2l = np.asarray(self.physical_to_logical, dtype=np.int64)
        if p2l.ndim != 2:
            raise EpsimError(f"physical_to_logical must be [layers][slots], got shape {list(p2l.shape)}")
        layers, slots = p2l.shape
        if self.num_gpus < 1 or slots % self.num_gpus:
            raise EpsimError(f"{slots} slots do not split evenly over {self.num_gpus} GPUs")
        if p2l.min(initial=0) < 0 or p2l.max(initial=0) >= self.num_logical:
            raise EpsimError(f"physical_to_logical holds ids outside 0..{self.num_logical - 1}")
        counts = np.zeros((layers, self.num_logical), dtype=np.int64)
        np.add.at(counts, (np.arange(layers)[:, None], p2l), 1)
        if np.any(counts == 0):
            layer, expert = np.argwhere(counts == 0)[0]
            raise EpsimError(f"layer {layer}: logical expert {expert} has no physical slot")
        object.__setattr__(self, "physical_to_logical", p2l)
        object.__setattr__(self, "_replica_counts", counts)

    @property
    def num_layers(self) -> int:
        return self.physical_to_logical.shape[0]

    @property
    def num_slots(self) -> int:
        return self.physical_to_logical.shape[1]

    @property
    def slots_per_gpu(self) -> int:
        return self.num_slots // self.num_gpus

    @property
    def replica_counts(self) -> np.ndarray:
        """``[layers, num_logical]`` slots holding each logical expert (1 without replicas)."""
        return self._replica_counts  # type: ignore[attr-defined]

    @property
    def logical_to_physical(self) -> np.ndarray:
        """``[layers, num_logical, max_replicas]`` slots of each expert, padded with -1."""
        layers = self.num_layers
        width = int(self.replica_counts.max())
        table = np.full((layers, self.num_logical, width), -1, dtype=np.int64)
        for layer in range(layers):
            order = np.argsort(self.physical_to_logical[layer], kind="stable")
            experts = self.physical_to_logical[layer][order]
            first = np.searchsorted(experts, experts)  # first index of each expert's run
            table[layer, experts, np.arange(len(order)) - first] = order
        return table

    def gpu_of_slot(self, slots: np.ndarray) -> np.ndarray:
        """The GPU of each physical slot (same shape). Exists for tests (the code divides by
        ``slots_per_gpu`` where it needs it)."""
        return np.asarray(slots) // self.slots_per_gpu

    def gpu_loads(self, loads: np.ndarray) -> np.ndarray:
        """``[layers, experts]`` loads -> ``[layers, num_gpus]``; a replicated expert's load is
        shared equally by its replicas (what round-robin replica choice gives on average)."""
        self._check_loads(loads)
        per_slot = np.take_along_axis(loads, self.physical_to_logical, axis=1)
        per_slot = per_slot / np.take_along_axis(self.replica_counts, self.physical_to_logical,
                                                 axis=1)
        return per_slot.reshape(self.num_layers, self.num_gpus, self.slots_per_gpu).sum(axis=2)

    def imbalance(self, loads: np.ndarray) -> np.ndarray:
        """``[layers]`` max GPU load / mean GPU load; NaN for layers without load."""
        g = self.gpu_loads(loads)
        mean = g.mean(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(mean > 0, g.max(axis=1) / np.where(mean > 0, mean, 1), np.nan)

    def _check_loads(self, loads: np.ndarray) -> None:
        if loads.shape != (self.num_layers, self.num_logical):
            raise EpsimError(
                f"loads of shape {list(loads.shape)} do not match the placement's "
                f"[{self.num_layers}, {self.num_logical}]"
            )

    def to_json(self) -> dict[str, Any]:
        return {"num_gpus": self.num_gpus, "num_logical": self.num_logical,
                "physical_to_logical": self.physical_to_logical.tolist()}


def contiguous_placement(num_layers: int, num_experts: int, num_gpus: int,
                         redundant: int = 0) -> Placement:
    """Experts ``0..E/G-1`` on GPU 0, the next ``E/G`` on GPU 1, ... in every layer.

    With ``redundant`` extra slots the numbering wraps round: slot ``s`` holds expert
    ``s % E``, so experts ``0..R-1`` get a second replica on the last GPUs (the layout
    ``epsim.model.eplb.balance_placement`` gives dense layers). Example: 4 experts, 2 redundant,
    3 GPUs: ``[[0, 1], [2, 3], [0, 1]]`` per GPU.
    """
    slots = num_experts + redundant
    if redundant < 0 or slots % num_gpus:
        extra = f" + {redundant} redundant slots" if redundant else ""
        raise EpsimError(f"{num_gpus} GPUs do not divide {num_experts} experts{extra}")
    table = np.tile(np.arange(slots, dtype=np.int64) % num_experts, (num_layers, 1))
    return Placement(table, num_gpus=num_gpus, num_logical=num_experts)


def remap(logical_ids: Any, logical_to_physical: Any, replica_counts: Any, token_index: Any) -> Any:
    """Logical expert ids -> physical slots, choosing among replicas by the flattened position.

    The rule is vLLM's EPLB mapping (``vllm/model_executor/layers/fused_moe/router/
    base_router.py``, ``_eplb_map_and_record_i32_kernel``, commit 03919875d6): the pair at
    flattened position ``p = t * top_k + j`` of the ``[tokens, top_k]`` choices takes replica
    ``p % replicas``, so over a batch the replicas share an expert's pairs evenly. Every pair
    lands on exactly one slot, and that slot holds its expert. Pure indexing arithmetic, so it
    works on numpy arrays and torch tensors alike (the simulator passes numpy, the runtime torch).

    Args:
        logical_ids: ``[tokens, top_k]`` router output for one layer.
        logical_to_physical: ``[num_logical, max_replicas]`` one layer's table (-1 padded).
        replica_counts: ``[num_logical]`` one layer's replica counts.
        token_index: ``[tokens, 1]`` (or ``[tokens, top_k]``) the token's index ``t`` (the
            runtime passes a rank-global one, so a token's replica does not depend on how the
            batch is cut into microbatches).

    Returns:
        ``[tokens, top_k]`` physical slot ids.
    """
    top_k = logical_ids.shape[-1]
    offsets = token_index * top_k + (token_index * 0 + _arange_like(logical_ids, top_k))
    replica = offsets % replica_counts[logical_ids]
    return logical_to_physical[logical_ids, replica]


def _arange_like(ref: Any, n: int) -> Any:
    if hasattr(ref, "new_tensor"):  # torch
        import torch

        return torch.arange(n, device=ref.device, dtype=ref.dtype)
    return np.arange(n, dtype=np.asarray(ref).dtype)


def _integer_array(value: object) -> np.ndarray:
    """``physical_to_logical`` as int64, refusing non-integers instead of truncating them."""
    arr = np.asarray(value, dtype=object)
    if arr.ndim != 2 or arr.size == 0:
        raise EpsimError("physical_to_logical must be a non-empty [layers][slots] list")
    bad = [v for v in arr.ravel() if isinstance(v, bool) or not isinstance(v, int)]
    if bad:
        raise EpsimError(f"physical_to_logical holds a non-integer id {bad[0]!r}")
    return arr.astype(np.int64)


def read_placement(path: str | Path, num_layers: int | None = None,
                   num_experts: int | None = None) -> Placement:
    """Read a placement file written by ``epsim balance --out`` (or :meth:`Placement.to_json`)."""
    p = Path(path)
    obj = read_json_file(p, "placement file")
    try:
        # the counts bounded before the placement sizes its [layers, experts] tables from them
        num_gpus = check_count(obj["num_gpus"], MAX_ID, "num_gpus", "placement")
        num_logical = check_count(obj["num_logical"], MAX_EXPERTS, "num_logical", "placement")
        table = _integer_array(obj["physical_to_logical"])
        check_count(table.shape[0], MAX_LAYERS, "physical_to_logical's layers", "placement")
        placement = Placement(table, num_gpus=num_gpus, num_logical=num_logical)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        if isinstance(exc, EpsimError):
            raise EpsimError(f"{p}: {exc}") from None
        raise EpsimError(f"{p}: not a placement file ({type(exc).__name__}: {exc})") from None
    if num_layers is not None and placement.num_layers != num_layers:
        raise EpsimError(f"{p}: {placement.num_layers} layers, the model has {num_layers}")
    if num_experts is not None and placement.num_logical != num_experts:
        raise EpsimError(f"{p}: {placement.num_logical} experts, the model has {num_experts}")
    return placement
