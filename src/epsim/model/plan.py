"""How a model is laid out over GPUs and which execution options a step uses.

Glossary:
    world      all GPUs of the deployment: ``nodes * gpus_per_node``.
    dp         data-parallel attention groups; each holds its own requests and KV cache.
    tp         tensor parallelism inside a dp group: attention heads (and, with ``ep == 1``, each
               expert's intermediate dimension) are sharded over ``tp`` GPUs, and partial results are
               summed by all-reduce.
    ep         expert parallelism: ``ep == dp * tp`` puts ``slots / ep`` whole experts on each
               GPU and moves tokens to them (dispatch) and back (combine); ``ep == 1`` keeps every
               expert on every GPU of a dp group, tensor-parallel (SGLang's plain ``--tp 8``).
    slots      expert places per MoE layer: the routed experts plus ``redundant_experts`` replicas
               of the hottest ones (DeepSeek's and SGLang's EPLB "redundant experts"); ``ep`` must
               divide the slots, not the experts (SGLang's EP72: 256 + 32 = 288 slots, 4 per GPU).
    microbatches
               1, or 2 for dual-batch overlap (DBO): the step's batch is split in two and the halves
               interleave so one half's dispatch/combine overlaps the other's compute.
    graph mode the decode step is captured once (CUDA/HIP graph) and replayed: one launch per step
               instead of one per kernel, at the price of static shapes.
    mtp        speculative decoding with DeepSeek's multi-token-prediction module: a decode step
               verifies 1 + ``mtp`` tokens per sequence and runs the draft module ``mtp`` times
               (``epsim.model.mtp``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from .config import ModelConfig
from .errors import EpsimError

KV_DTYPES = ("fp8", "bf16")
#: the most draft tokens per step a plan may verify (vLLM and SGLang take any count; beyond a
#: few the chain's acceptance makes more drafts pointless: P**16 < 0.2 even at P = 0.9)
MAX_MTP = 16
#: share of HBM an engine may use, as vLLM's gpu_memory_utilization default
DEFAULT_MEM_FRACTION = 0.9


@dataclass(frozen=True)
class Fusion:
    """Kernel-fusion switches; each one changes the op graph.

    fused_rope: RoPE is applied inside the attention/KV-store kernel instead of as its own op
        (the reference deployment's "vertical fusion").
    merged_shared_expert: the shared expert's gate and up projections run as one GEMM
        (the reference deployment's "horizontal fusion").
    fused_moe: the routed experts' gate/up GEMM, activation and down GEMM run as one fused-MoE
        kernel instead of three ops.
    shared_expert_in_moe: the shared expert runs inside that fused-MoE kernel as one more local
        expert that every one of the rank's own tokens picks (aiter's DeepSeek kernels: 32 local
        experts + 1 shared, top-8 + 1), instead of as its own GEMMs beside it (DeepSeek's and
        SGLang's default). Needs ``fused_moe`` and a shared expert as wide as a routed one.
    """

    fused_rope: bool = True
    merged_shared_expert: bool = True
    fused_moe: bool = True
    shared_expert_in_moe: bool = False


@dataclass(frozen=True)
class ParallelPlan:
    """A deployment's parallel layout and execution options.

    nodes / gpus_per_node: the hardware. Example: 1 / 8 for one MI300X server.
    dp / tp / ep: see the module glossary; ``dp * tp`` must equal the world size and ``ep`` is
        1 or the world size.
    microbatches: 1, or 2 for DBO.
    kv_dtype: KV-cache storage, ``"fp8"`` or ``"bf16"``.
    graph_mode: capture and replay the decode step.
    fusion: kernel-fusion switches.
    dispatch_dtype: dtype of the hidden states sent by EP dispatch (``"fp8_token128"``: FP8 with a
        scale per 128 values, as MORI-EP and DeepEP send them) ; combine always returns bf16.
    placement: name or path of an expert placement (``None``: the contiguous one).
    mem_fraction: share of HBM the engine may use for weights, activations and KV cache
        (vLLM's ``gpu_memory_utilization``).
    redundant_experts: extra expert slots per MoE layer holding replicas (``0``: none); needs
        ``ep > 1``. Example: 32 (SGLang's EP72 and DeepSeek's EP144 decode).
    mtp: draft tokens per decode step (MTP speculative decoding; 0: off). Example: 1, as
        DeepSeek's own decode deployment runs.
    """

    nodes: int = 1
    gpus_per_node: int = 8
    dp: int = 8
    tp: int = 1
    ep: int = 8
    microbatches: int = 2
    kv_dtype: str = "fp8"
    graph_mode: bool = True
    fusion: Fusion = field(default_factory=Fusion)
    dispatch_dtype: str = "fp8_token128"
    placement: str | None = None
    mem_fraction: float = DEFAULT_MEM_FRACTION
    redundant_experts: int = 0
    mtp: int = 0

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def expert_parallel(self) -> bool:
        """Experts sharded over GPUs (dispatch/combine), as opposed to tensor-parallel MoE."""
        return self.ep > 1

    @property
    def moe_tp(self) -> int:
        """Shards of each expert's intermediate dimension (``tp`` when ``ep == 1``, else 1)."""
        return 1 if self.expert_parallel else self.tp

    def expert_slots(self, model: ModelConfig) -> int:
        """Expert places per MoE layer: the routed experts plus the redundant ones."""
        return model.moe.num_experts + self.redundant_experts

    def slots_per_gpu(self, model: ModelConfig) -> int:
        """Expert weights one GPU holds per MoE layer (every slot on every GPU without EP)."""
        return self.expert_slots(model) // self.ep

    def with_(self, **changes: object) -> ParallelPlan:
        """A copy with some fields changed (and validated by the caller)."""
        return replace(self, **changes)

    def validate(self, model: ModelConfig | None = None) -> ParallelPlan:
        """Check every size that must divide; raise :class:`EpsimError` naming the numbers."""
        for name in ("nodes", "gpus_per_node", "dp", "tp", "ep", "microbatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EpsimError(f"{name} must be a positive integer, got {value!r}")
        r = self.redundant_experts
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise EpsimError(f"redundant experts must be a non-negative integer, got {r!r}")
        if self.dp * self.tp != self.world_size:
            raise EpsimError(
                f"dp {self.dp} x tp {self.tp} = {self.dp * self.tp} does not match the "
                f"{self.world_size} GPUs ({self.nodes} nodes x {self.gpus_per_node} GPUs)"
            )
        if self.ep not in (1, self.world_size):
            raise EpsimError(
                f"ep {self.ep} must be 1 (tensor-parallel MoE) or the world size {self.world_size}"
            )
        if self.microbatches not in (1, 2):
            raise EpsimError(f"microbatches must be 1 or 2 (DBO), got {self.microbatches}")
        if self.kv_dtype not in KV_DTYPES:
            raise EpsimError(f"kv dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise EpsimError(f"mem_fraction must be in (0, 1], got {self.mem_fraction}")
        if isinstance(self.mtp, bool) or not isinstance(self.mtp, int) \
                or not 0 <= self.mtp <= MAX_MTP:
            raise EpsimError(f"mtp (draft tokens per step) must be an integer in [0, {MAX_MTP}], "
                             f"got {self.mtp!r}")
        if model is not None:
            self._validate_for(model)
        return self

    def _validate_for(self, model: ModelConfig) -> None:
        attn, moe = model.attention, model.moe
        if attn.num_heads % self.tp:
            raise EpsimError(
                f"tp {self.tp} does not divide the {attn.num_heads} attention heads of {model.name}"
            )
        if attn.kind == "gqa" and attn.num_kv_heads % self.tp and self.tp % attn.num_kv_heads:
            raise EpsimError(
                f"tp {self.tp} and the {attn.num_kv_heads} KV heads of {model.name} do not divide "
                "one another"
            )
        self._check_slots(model)
        if moe.intermediate_size % self.moe_tp:
            raise EpsimError(
                f"tp {self.tp} does not divide the expert intermediate size "
                f"{moe.intermediate_size} of {model.name}"
            )
        if model.dense_layers and model.dense_intermediate_size % self.tp:
            raise EpsimError(
                f"tp {self.tp} does not divide the dense intermediate size "
                f"{model.dense_intermediate_size} of {model.name}"
            )
        if moe.shared_intermediate_size % self.tp:
            raise EpsimError(
                f"tp {self.tp} does not divide the shared-expert intermediate size "
                f"{moe.shared_intermediate_size} of {model.name}"
            )
        self._check_shared_in_moe(model)
        if self.mtp and not model.mtp_layers:
            raise EpsimError(f"--mtp {self.mtp}: {model.name} has no MTP draft module "
                             "(num_nextn_predict_layers is 0 in its config.json)")

    def _check_slots(self, model: ModelConfig) -> None:
        """``ep`` divides the expert slots (experts + redundant); replicas need EP."""
        experts, r = model.moe.num_experts, self.redundant_experts
        if r and not model.moe_layers:
            raise EpsimError(f"{model.name} has no MoE layers: no experts to replicate "
                             f"(redundant experts {r})")
        if r and not self.expert_parallel:
            raise EpsimError(f"redundant experts ({r}) replicate experts over EP ranks; "
                             "with ep 1 every GPU holds every expert")
        if not r and experts % self.ep:
            raise EpsimError(
                f"ep {self.ep} does not divide the {experts} experts of {model.name} "
                "(redundant experts make experts + R slots: ep must divide those)"
            )
        if r and (experts + r) % self.ep:
            raise EpsimError(
                f"ep {self.ep} does not divide the {experts} experts + {r} redundant = "
                f"{experts + r} expert slots of {model.name}"
            )

    def _check_shared_in_moe(self, model: ModelConfig) -> None:
        if self.fusion.shared_expert_in_moe:
            problem = self.shared_in_moe_problem(model)
            if problem:
                raise EpsimError(problem)

    def shared_in_moe_problem(self, model: ModelConfig) -> str | None:
        """Why the shared expert cannot run inside the routed experts' fused kernel (as one more
        of them) under this plan, or ``None`` when it can."""
        moe = model.moe
        if not self.fusion.fused_moe:
            return ("the shared expert runs inside the fused-MoE kernel only when the routed "
                    "experts are fused (fused_moe)")
        if not moe.num_shared_experts:
            return f"{model.name} has no shared expert to fuse into its MoE kernel"
        if self.expert_parallel and self.tp > 1:
            return ("the shared expert fuses into the MoE kernel with tp = 1 under EP "
                    f"(tp {self.tp} splits each dp group's tokens before dispatch)")
        if moe.shared_intermediate_size // moe.num_shared_experts != moe.intermediate_size:
            return (f"{model.name}'s shared expert ({moe.shared_intermediate_size} wide) is not "
                    f"as wide as a routed one ({moe.intermediate_size}): it cannot run as one "
                    "of them")
        return None


def with_implied_fusions(plan: ParallelPlan, model: ModelConfig,
                         options: Mapping[str, bool]) -> ParallelPlan:
    """``plan`` with the fusions a kernel library implies (``options``: ``Fusion`` field names,
    e.g. ``{"shared_expert_in_moe": True}`` for aiter), each where the model and plan admit it:
    a library that runs the shared expert inside its fused-MoE kernel runs a model without one,
    or a plan it cannot fuse under, as before."""
    if not options:
        return plan
    fused = plan.with_(fusion=replace(plan.fusion, **options))
    if fused.fusion.shared_expert_in_moe and fused.shared_in_moe_problem(model):
        fused = fused.with_(fusion=replace(fused.fusion, shared_expert_in_moe=False))
    return fused.validate(model)


def make_plan(
    model: ModelConfig | None = None,
    *,
    nodes: int = 1,
    gpus_per_node: int = 8,
    dp: int | None = None,
    tp: int | None = None,
    ep: int | None = None,
    **options: object,
) -> ParallelPlan:
    """A validated plan, filling what the caller left out the way users expect.

    Defaults: with neither dp nor tp given, DP attention over every GPU (``dp = world``, ``tp = 1``);
    with one of them given, the other completes the world; ``ep`` defaults to the world size (EP
    MoE) when ``dp > 1`` and to 1 (tensor-parallel MoE) when the plan is pure TP.
    """
    world = nodes * gpus_per_node
    if dp is None and tp is None:
        dp, tp = world, 1
    elif dp is None:
        dp = world // tp if tp and world % tp == 0 else 0
        if dp == 0:
            raise EpsimError(f"tp {tp} does not divide the {world} GPUs")
    elif tp is None:
        tp = world // dp if dp and world % dp == 0 else 0
        if tp == 0:
            raise EpsimError(f"dp {dp} does not divide the {world} GPUs")
    if ep is None:
        ep = world if dp > 1 else 1
    plan = ParallelPlan(nodes=nodes, gpus_per_node=gpus_per_node, dp=dp, tp=tp, ep=ep, **options)
    return plan.validate(model)
