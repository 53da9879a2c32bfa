"""epsim's model package: what is computed (configs, plans, the op graph, placement, accounting).

Pure Python + numpy + networkx; it never imports the simulator or the runtime.
"""

from .accounting import (
    kv_bytes_for_sequence,
    kv_bytes_per_token,
    memory_budget,
    param_counts,
    weight_bytes_per_rank,
)
from .config import ModelConfig, load_model, model_from_hf_config, shipped_models
from .errors import EpsimError
from .graph import build_step_graph
from .opgraph import OP_KINDS, Batch, Op, OpGraph
from .plan import Fusion, ParallelPlan, make_plan
from .schedule import Schedule, Slot

__all__ = [
    "OP_KINDS", "Batch", "EpsimError", "Fusion", "ModelConfig", "Op", "OpGraph", "ParallelPlan",
    "Schedule", "Slot", "build_step_graph", "kv_bytes_for_sequence", "kv_bytes_per_token",
    "load_model", "make_plan", "memory_budget", "model_from_hf_config", "param_counts",
    "shipped_models", "weight_bytes_per_rank",
]
