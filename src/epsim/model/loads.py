"""Expert load statistics: how many tokens the router sent to each expert of each layer.

Format (SGLang's expert-distribution dump, as in ``shared/data/expert_loads/``): a JSON object
``{"logical_count": [layers][experts]}`` of non-negative counts; dense layers are all-zero rows.
SGLang's ``.pt`` dumps (a dict with a ``logical_count`` tensor, optionally with a leading
step/window axis that is summed) are read too when torch is installed.

Loads are counts, not probabilities; ``frequencies`` normalises each layer.

Shipped load statistics (``model/data/loads/``, see its README for provenance): SGLang's published
DeepSeek-V3 expert-distribution statistics, named by their workload. ``read_loads`` takes such a
name or a path; an existing file of that name wins over a shipped name.

    decode_in2000out100    decode of requests with 2000 input / 100 output tokens
    decode_in1000out1000   decode, 1000 input / 1000 output tokens
    prefill_in2048         prefill of 2048-token prompts
    prefill_in4096         prefill of 4096-token prompts

Synthetic loads (``synthetic_loads``: no ``--loads`` file, for the simulator and ``epsim run``):
each layer's expert weights are a lognormal group factor (sigma 0.5, one per router group of
contiguous experts; DeepSeek-V3 routes to 4 of 8 groups) times a lognormal expert factor (sigma
0.6), drawn with a fixed seed. Over DeepSeek-R1's 58 MoE layers they give a hottest/mean expert
ratio of 5.85 and a contiguous-placement imbalance over 8 GPUs of 1.86 (mean over layers, 3.24 at
worst); the real decode counts in ``shared/data/expert_loads`` give 6.07 and 1.88 (3.72 at
worst), the four files 5.6-8.1 and 1.86-2.07.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from .bounds import (
    MAX_ID,
    MAX_LAYERS,
    MAX_LOAD_CELLS,
    check_count,
    parse_json,
    read_json_file,
)
from .config import ModelConfig
from .errors import EpsimError
from .shipped import shipped_names, shipped_text

#: the synthetic loads' generator seed, lognormal sigmas (per router group, per expert) and
#: tokens per MoE layer (the counts are scaled to it)
SYNTHETIC_SEED = 0
SYNTHETIC_GROUP_SIGMA = 0.5
SYNTHETIC_EXPERT_SIGMA = 0.6
SYNTHETIC_TOKENS_PER_LAYER = 1_000_000.0
#: the kinds of synthetic loads: DeepSeek-like skew, or every expert equally likely
LOAD_KINDS = ("skewed", "uniform")


def _as_loads(obj: Any, where: str, windows: bool = False) -> np.ndarray:
    if not isinstance(obj, dict) or "logical_count" not in obj:
        raise EpsimError(f"{where}: expected an object with a 'logical_count' [layers][experts] array")
    raw = obj["logical_count"]
    if hasattr(raw, "detach"):  # a torch tensor from a .pt dump
        raw = raw.detach().cpu().double().numpy()
    try:
        arr = np.asarray(raw, dtype=np.float64)
    except (TypeError, ValueError):
        raise EpsimError(f"{where}: logical_count must be a rectangular array of numbers") from None
    _check_shape(arr.shape, where)
    steps = arr if arr.ndim == 3 else arr[None]
    if arr.ndim == 3:  # [steps, layers, experts] windows: summed (or kept apart: windows)
        arr = arr.sum(axis=0)
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 2:
        raise EpsimError(
            f"{where}: logical_count must be [layers][experts] with at least 2 experts, "
            f"got shape {list(arr.shape)}"
        )
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise EpsimError(f"{where}: logical_count holds negative or non-finite counts")
    if not np.any(arr.sum(axis=1) > 0):
        raise EpsimError(f"{where}: logical_count is all zeros")
    if windows:  # windows without any load (idle steps) carry no information: dropped
        return steps[steps.sum(axis=(1, 2)) > 0]
    return arr


def _check_shape(shape: tuple[int, ...], where: str) -> None:
    """Layers, experts and cells within their bounds (epsim.model.bounds) before any work is
    sized from them (balance's grows with every cell)."""
    if len(shape) in (2, 3):
        check_count(shape[-2], MAX_LAYERS, "logical_count's layers", where)
        check_count(shape[-1], MAX_ID, "logical_count's experts", where)
        check_count(math.prod(shape), MAX_LOAD_CELLS, "logical_count's cells", where)


def shipped_loads() -> list[str]:
    """Names of the load statistics shipped with epsim. Example: ``["decode_in1000out1000",
    "decode_in2000out100", "prefill_in2048", "prefill_in4096"]``."""
    return shipped_names("epsim.model", "data/loads")


def read_loads(name_or_path: str | Path, *, windows: bool = False) -> np.ndarray:
    """Read load statistics by shipped name (``decode_in2000out100``) or from a ``.json``/``.pt``
    file; returns float64 ``[layers, experts]`` counts (dense layers all zero).

    ``windows``: return ``[snapshots, layers, experts]`` instead, keeping a dump's leading
    step/window axis apart (one snapshot when it has none), for balancers that fit each."""
    p = Path(name_or_path)
    if not p.is_file():
        shipped = shipped_text("epsim.model", "data/loads", str(name_or_path))
        if shipped is not None:
            return _as_loads(parse_json(shipped, str(name_or_path)), str(name_or_path), windows)
        raise EpsimError(f"load file not found: {p} (nor a shipped name: "
                         f"{', '.join(shipped_loads())})")
    if p.suffix == ".pt":
        try:
            import torch
        except Exception:
            raise EpsimError(f"{p}: reading .pt load dumps needs torch (pip install epsim[runtime])") from None
        try:
            obj = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise EpsimError(f"{p}: not a readable torch dump ({type(exc).__name__})") from None
        return _as_loads(obj, str(p), windows)
    return _as_loads(read_json_file(p, "load file"), str(p), windows)


def loads_from_object(obj: Any, where: str = "loads") -> np.ndarray:
    """Validate an in-memory ``{"logical_count": ...}`` object (see :func:`read_loads`).

    Exists for tests (a dump's windows checked without writing a file); the commands read files.
    """
    return _as_loads(obj, where)


def moe_layer_rows(loads: np.ndarray) -> np.ndarray:
    """Indices of the rows that carry load (the MoE layers). Shape ``[moe_layers]``."""
    return np.flatnonzero(loads.sum(axis=1) > 0)


def frequencies(loads: np.ndarray) -> np.ndarray:
    """Per-layer probabilities ``[layers, experts]``; all-zero rows stay zero."""
    totals = loads.sum(axis=1, keepdims=True)
    return np.divide(loads, totals, out=np.zeros_like(loads, dtype=np.float64), where=totals > 0)


def hottest_to_mean(loads: np.ndarray) -> float:
    """Mean over loaded layers of (hottest expert's load / mean expert load). Example: 6.07 for
    ``decode_in2000out100``, 5.85 for DeepSeek-R1's synthetic loads.

    Exists for tests: the one that holds the synthetic loads to the real files' statistics (the
    figures quoted in this module's docstring and docs/simulator.md)."""
    rows = loads[moe_layer_rows(loads)]
    return float(np.mean(rows.max(axis=1) / rows.mean(axis=1))) if len(rows) else math.nan


def synthetic_loads(model: ModelConfig, kind: str = "skewed") -> np.ndarray:
    """Load statistics standing in for measured ones.

    Args:
        model: the model (its layers, MoE layers, experts and router groups).
        kind: ``"skewed"`` (the DeepSeek-like distribution of the module docstring) or
            ``"uniform"`` (every expert equally likely).

    Returns:
        float64 ``[num_layers, num_experts]`` counts; dense layers are zero rows.
    """
    if kind not in LOAD_KINDS:
        raise EpsimError(f"synthetic loads must be one of {', '.join(LOAD_KINDS)}, got {kind!r}")
    experts = model.moe.num_experts
    loads = np.zeros((model.num_layers, experts))
    rows = np.asarray(model.moe_layers, dtype=np.int64)
    if kind == "uniform":
        loads[rows] = SYNTHETIC_TOKENS_PER_LAYER / experts
        return loads
    groups = model.moe.n_group if model.moe.n_group > 1 and experts % model.moe.n_group == 0 else 8
    if experts % groups:
        groups = 1
    rng = np.random.default_rng(SYNTHETIC_SEED)
    # Step 1: a hot or cold factor per router group of contiguous experts
    group_factor = rng.lognormal(0.0, SYNTHETIC_GROUP_SIGMA, (len(rows), groups))
    # Step 2: a factor per expert, times its group's
    weights = rng.lognormal(0.0, SYNTHETIC_EXPERT_SIGMA, (len(rows), experts))
    weights *= np.repeat(group_factor, experts // groups, axis=1)
    loads[rows] = weights / weights.sum(axis=1, keepdims=True) * SYNTHETIC_TOKENS_PER_LAYER
    return loads
