"""What one runtime run executes: options, the plan they imply, and a hash ranks compare."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from epsim.model.config import ModelConfig, check_context_length, load_model
from epsim.model.errors import EpsimError
from epsim.model.mtp import DEFAULT_ACCEPTANCE, check_acceptance
from epsim.model.placement import Placement, contiguous_placement, read_placement
from epsim.model.plan import Fusion, ParallelPlan, make_plan

DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class RunOptions:
    """One configuration the runtime executes on every rank.

    model: shipped name or config.json path. Example: ``"tiny-deepseek"``.
    world_size: ranks. Example: 4.
    batch: sequences per rank (each rank is its own dp group). Example: 8.
    context: tokens each sequence attends to in the first decode step, the new one included.
    steps: decode steps. Example: 4.
    dp / ep: parallel degrees (None: dp = world, ep = world when world > 1).
    dbo: two microbatches interleaved by the shared schedule.
    static: static-shape dispatch/combine and MoE (what graph capture needs).
    capture: capture the decode step as a CUDA/HIP graph (needs a GPU; implies static).
    placement: path of a placement file (``epsim.model.placement.read_placement``), None: contiguous.
    placement_table: a placement given in memory: ``physical_to_logical`` per layer (what
        ``epsim run --redundant-experts`` balances from load statistics); not with ``placement``.
    redundant_experts: replica slots per MoE layer; a placement (file or table) sets them, and
        this must then agree; without one, the contiguous layout with the slots wrapping round.
    kv_dtype: KV-cache storage, ``"fp8"`` (float8_e4m3fn) or ``"bf16"``.
    check: compare every rank's outputs with the dense single-process reference.
    seed: weights, initial tokens and cache contents.
    dtype: compute dtype, ``"fp32"`` or ``"bf16"``.
    device: ``"cpu"`` or ``"cuda"``.
    unfused: run the unfused op graph (RoPE, gate/up and the routed experts as separate ops).
    shared_expert_in_moe: run the shared expert inside the fused-MoE op as one more local expert
        (``epsim.model.plan.Fusion.shared_expert_in_moe``, as aiter's kernels do).
    trace: keep every rank's per-op trace events.
    prefill: fill the KV cache by a real prefill step over random prompts of ``context - 1``
        tokens (timed and checked like the decode steps) instead of drawing the cached entries.
    mtp: MTP speculative decoding: each decode step verifies 1 + ``mtp`` tokens per sequence
        and runs the draft module ``mtp`` times (``epsim.model.mtp``); 0: off.
    mtp_acceptance: the probability a draft is accepted given the one before was; acceptance
        is simulated (``epsim.model.mtp.runtime_accepted``), the compute is real.
    """

    model: str
    world_size: int
    batch: int
    context: int
    steps: int
    dp: int | None = None
    ep: int | None = None
    dbo: bool = False
    static: bool = False
    capture: bool = False
    placement: str | None = None
    kv_dtype: str = "fp8"
    check: bool = False
    seed: int = 0
    dtype: str = "fp32"
    device: str = "cpu"
    unfused: bool = False
    shared_expert_in_moe: bool = False
    trace: bool = False
    prefill: bool = False
    placement_table: tuple[tuple[int, ...], ...] | None = None
    redundant_experts: int = 0
    mtp: int = 0
    mtp_acceptance: float = DEFAULT_ACCEPTANCE

    @property
    def static_shapes(self) -> bool:
        """Static dispatch/MoE shapes: asked for, or needed by graph capture."""
        return self.static or self.capture

    def with_(self, **changes: object) -> RunOptions:
        return replace(self, **changes)

    def to_json(self) -> dict:
        return asdict(self)

    def digest(self) -> str:
        """A hash of everything that must agree across ranks (the placement file's content too)."""
        obj = self.to_json()
        if self.placement:
            try:
                obj["placement_content"] = hashlib.sha256(
                    Path(self.placement).read_bytes()).hexdigest()
            except OSError:
                obj["placement_content"] = None
        return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def cache_positions(opts: RunOptions) -> int:
    """Positions a sequence's KV cache must hold: the drawn ``context - 1``, every step's
    ``1 + mtp`` at most, and under MTP the drafts written past the last step's start."""
    return opts.context + opts.steps * (1 + opts.mtp) + 2 * opts.mtp


def _check_runtime_model(model: ModelConfig) -> None:
    """Refuse a model whose layers the runtime cannot execute exactly."""
    a, moe = model.attention, model.moe
    if a.kind == "gqa" and a.sinks:
        raise EpsimError(f"the runtime does not implement attention sinks ({model.name})")
    if moe.weight_on_input and moe.top_k != 1:
        raise EpsimError(f"{model.name}: a weight on the expert's input needs top-1 routing")
    if moe.scoring != "sigmoid" or moe.expert_bias:
        raise EpsimError(f"the runtime implements sigmoid routing without expert biases; "
                         f"{model.name} routes by {moe.scoring}")


def validate(opts: RunOptions) -> tuple[ModelConfig, ParallelPlan, Placement]:
    """Check the options; return the model, the plan and the expert placement they imply."""
    model = load_model(opts.model)
    _check_runtime_model(model)
    for name in ("world_size", "batch", "context", "steps"):
        value = getattr(opts, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EpsimError(f"{name} must be a positive integer, got {value!r}")
    # the last decode step attends context + steps - 1 tokens (under MTP each step may advance
    # 1 + mtp and verifies mtp past its start, and the draft passes run mtp - 1 further)
    check_context_length(model, opts.context + opts.steps - 1, f"--context {opts.context} + --steps {opts.steps} - 1")
    if opts.mtp and (model.attention.sparse or model.attention.kind != "mla"):
        raise EpsimError(f"--mtp with {model.name} is not implemented in the runtime (its MTP "
                         "module is DeepSeek's, over dense MLA)")
    if opts.mtp:
        check_context_length(model, cache_positions(opts),
                             f"--context {opts.context} + --steps {opts.steps} x (1 + --mtp "
                             f"{opts.mtp}) + 2 x --mtp")
        check_acceptance(opts.mtp_acceptance)
        for flag, on in (("--prefill", opts.prefill), ("--capture", opts.capture)):
            if on:
                raise EpsimError(f"--mtp with {flag} is not implemented in the runtime "
                                 "(the simulator covers it); drop one of them")
    if opts.world_size > 64:
        raise EpsimError(f"world size {opts.world_size} is too large for local ranks (max 64)")
    if opts.dtype not in DTYPES:
        raise EpsimError(f"dtype must be one of {', '.join(DTYPES)}, got {opts.dtype!r}")
    if opts.device not in ("cpu", "cuda"):
        raise EpsimError(f"device must be cpu or cuda, got {opts.device!r}")
    if opts.capture and opts.device != "cuda":
        raise EpsimError("graph capture needs a GPU (CUDA or ROCm); this run is on the CPU "
                         "(drop --capture or run with --device cuda)")
    if opts.check and opts.dtype != "fp32":
        raise EpsimError("--check compares in fp32; drop --dtype bf16")
    world = opts.world_size
    dp = world if opts.dp is None else opts.dp
    if dp != world:
        raise EpsimError(f"the runtime runs DP attention over every rank: dp must be the world "
                         f"size {world}, got {dp} (tp > 1 is not implemented)")
    if opts.unfused and opts.shared_expert_in_moe:
        raise EpsimError("the shared expert runs inside the fused-MoE op: drop --unfused")
    fusion = (Fusion(False, False, False) if opts.unfused
              else Fusion(shared_expert_in_moe=opts.shared_expert_in_moe))
    given = _given_placement(opts, model)
    plan = make_plan(model, nodes=1, gpus_per_node=world, dp=dp, tp=1, ep=opts.ep,
                     microbatches=2 if opts.dbo else 1, kv_dtype=opts.kv_dtype,
                     graph_mode=opts.capture, fusion=fusion, placement=opts.placement,
                     redundant_experts=_redundant(opts, model, given), mtp=opts.mtp)
    if opts.prefill and opts.context < 2:
        raise EpsimError("--prefill needs --context >= 2 (a prompt of context - 1 tokens)")
    if opts.dbo and opts.batch < 2:
        raise EpsimError("--dbo splits the batch in two microbatches: it needs --batch >= 2")
    return model, plan, _placement(opts, model, plan, given)


def _given_placement(opts: RunOptions, model: ModelConfig) -> Placement | np.ndarray | None:
    """The placement file's placement, the table's ``[layers, slots]`` array, or None."""
    layers, experts = model.num_layers, model.moe.num_experts
    if opts.placement and opts.placement_table is not None:
        raise EpsimError("give a placement file or a placement table, not both")
    if opts.placement:
        return read_placement(opts.placement, num_layers=layers, num_experts=experts)
    if opts.placement_table is None:
        return None
    table = np.asarray(opts.placement_table, dtype=np.int64)
    if table.ndim != 2 or table.shape[0] != layers:
        raise EpsimError(f"placement table of shape {list(table.shape)}: {model.name} has "
                         f"{layers} layers")
    return table


def _redundant(opts: RunOptions, model: ModelConfig, given: Placement | np.ndarray | None
               ) -> int:
    """The run's redundant experts: a given placement's extra slots (``opts.redundant_experts``
    must then be 0 or agree), else ``opts.redundant_experts``."""
    r = opts.redundant_experts
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        raise EpsimError(f"redundant experts must be a non-negative integer, got {r!r}")
    if given is None:
        return r
    slots = given.num_slots if isinstance(given, Placement) else given.shape[1]
    extra = slots - model.moe.num_experts
    if r and r != extra:
        where = opts.placement or "the placement table"
        raise EpsimError(f"{where}: {slots} slots = {model.moe.num_experts} experts + "
                         f"{extra} redundant, but redundant experts is {r}")
    return extra


def _placement(opts: RunOptions, model: ModelConfig, plan: ParallelPlan,
               given: Placement | np.ndarray | None) -> Placement:
    """The placement the run uses over the plan's EP ranks (without one given: contiguous, the
    redundant slots wrapping round)."""
    gpus = plan.ep if plan.expert_parallel else 1
    layers, experts = model.num_layers, model.moe.num_experts
    if given is None:
        return contiguous_placement(layers, experts, gpus, plan.redundant_experts)
    if isinstance(given, np.ndarray):
        return Placement(given, num_gpus=gpus, num_logical=experts)
    if given.num_gpus != gpus:
        raise EpsimError(f"{opts.placement}: placement for {given.num_gpus} GPUs, the run "
                         f"has {gpus} expert-parallel ranks")
    return given
