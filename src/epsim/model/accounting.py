"""Parameters, weight bytes and KV-cache bytes of a model under a plan.

Conventions (the ones model cards use):
    total parameters       every weight of the main model; DeepSeek's MTP draft layer excluded.
    activated per token    every weight a token's forward pass multiplies by: attention, dense FFN,
                           router, shared experts, its ``top_k`` routed experts, the LM head. The
                           embedding table is a lookup, not a matmul, and is not counted (OpenAI's
                           GPT-OSS model card counts the same way: 5.13e9 activated).
    KV bytes per token     what one more cached token costs on one GPU: MLA stores
                           ``kv_lora_rank + qk_rope_head_dim`` values per layer; GQA stores K and V
                           (``2 * kv_heads * head_dim``) per layer. Sliding-window layers stop
                           growing at the window, so they are left out of the per-token figure and
                           reported as a fixed per-sequence cost instead.
    MTP draft layer        a plan with ``mtp > 0`` also holds the draft module's weights (one
                           decoder layer, its three norms and ``eh_proj``; the embedding and the
                           output head are the main model's) and caches its layer's KV too.
"""

from __future__ import annotations

from dataclasses import dataclass

from .attention_keys import INDEX_KEY_SCALE_BYTES
from .config import ModelConfig
from .dtypes import bytes_per_element
from .errors import EpsimError
from .plan import ParallelPlan

NORM_DTYPE = "bf16"

#: HBM the engine keeps for activations, workspaces and graph pools beside weights and KV cache
#: (order of what vLLM's memory profiling reserves for a DeepSeek-size model at a few hundred
#: tokens per step).
DEFAULT_ACTIVATION_RESERVE_BYTES = 4 * 2**30


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts by component (whole model, unsharded).

    attention: all attention projections, norms inside attention, sinks. Example: 11.4e9 (R1).
    dense_mlp: FFNs of the dense layers. Example: 1.19e9 (R1's first three layers).
    routed_experts: all routed experts of all MoE layers. Example: 653.9e9 (R1).
    shared_experts: all shared experts. Example: 2.55e9 (R1).
    router: router weights and biases.
    norms: the per-layer input/post-attention norms and the final norm.
    embedding / lm_head: the vocabulary tables (``lm_head`` is 0 when tied).
    """

    attention: int
    dense_mlp: int
    routed_experts: int
    shared_experts: int
    router: int
    norms: int
    embedding: int
    lm_head: int
    routed_per_expert_layer: int
    top_k: int
    num_experts: int
    moe_layers: int

    @property
    def total(self) -> int:
        return (
            self.attention + self.dense_mlp + self.routed_experts + self.shared_experts
            + self.router + self.norms + self.embedding + self.lm_head
        )

    @property
    def activated_per_token(self) -> int:
        routed_active = self.routed_per_expert_layer * self.top_k * self.moe_layers
        head = self.lm_head if self.lm_head else self.embedding  # tied: the table is the head
        return (
            self.attention + self.dense_mlp + routed_active + self.shared_experts
            + self.router + self.norms + head
        )


def attention_params_per_layer(model: ModelConfig) -> dict[str, int]:
    """Parameters of one layer's attention, by projection name (the op graph's names)."""
    a, h = model.attention, model.hidden_size
    if a.kind == "mla":
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        parts: dict[str, int] = {}
        if a.q_lora_rank:
            parts["q_a"] = h * a.q_lora_rank
            parts["q_a_norm"] = a.q_lora_rank
            parts["q_b"] = a.q_lora_rank * a.num_heads * qk
        else:
            parts["q_proj"] = h * a.num_heads * qk
        parts["kv_a"] = h * (a.kv_lora_rank + a.qk_rope_head_dim)
        parts["kv_a_norm"] = a.kv_lora_rank
        parts["kv_b"] = a.kv_lora_rank * a.num_heads * (a.qk_nope_head_dim + a.v_head_dim)
        parts["o_proj"] = a.num_heads * a.v_head_dim * h
        if a.sparse:
            parts.update(indexer_params_per_layer(model))
        return parts
    bias = 1 if a.bias else 0
    q_out, kv_out = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    parts = {
        "q_proj": h * q_out + bias * q_out,
        "k_proj": h * kv_out + bias * kv_out,
        "v_proj": h * kv_out + bias * kv_out,
        "o_proj": q_out * h + (h if a.o_bias else 0),
    }
    if a.sinks:
        parts["sinks"] = a.num_heads
    if a.qk_norm:
        parts["qk_norm"] = 2 * a.head_dim
    return parts


def indexer_params_per_layer(model: ModelConfig) -> dict[str, int]:
    """DSA's lightning indexer in one layer (DeepSeek-V3.2-Exp ``inference/model.py``, class
    Indexer): ``wq_b`` from the compressed query to ``index_n_heads`` heads, ``wk`` one key head
    from the hidden state, ``k_norm`` (a LayerNorm: weight and bias), ``weights_proj`` one
    weight per head from the hidden state."""
    a, h = model.attention, model.hidden_size
    heads, dim = a.index_n_heads, a.index_head_dim
    return {"indexer.wq_b": (a.q_lora_rank or 0) * heads * dim, "indexer.wk": h * dim,
            "indexer.k_norm": 2 * dim, "indexer.weights_proj": h * heads}


def expert_params(model: ModelConfig) -> int:
    """Parameters of one routed expert (gate, up, down; biases where the model has them)."""
    h, i = model.hidden_size, model.moe.intermediate_size
    bias = (2 * i + h) if model.moe.expert_bias else 0
    return 3 * h * i + bias


def router_params_per_layer(model: ModelConfig) -> int:
    """Router weight plus its bias (DeepSeek's and GLM's score-correction bias, GPT-OSS's router
    bias)."""
    bias = model.moe.num_experts if model.moe.router_bias else 0
    return model.hidden_size * model.moe.num_experts + bias


def param_counts(model: ModelConfig) -> ParamCounts:
    """Parameter counts of the whole model by component."""
    h = model.hidden_size
    n_moe = len(model.moe_layers)
    n_dense = len(model.dense_layers)
    per_expert = expert_params(model)
    return ParamCounts(
        attention=sum(attention_params_per_layer(model).values()) * model.num_layers,
        dense_mlp=3 * h * model.dense_intermediate_size * n_dense,
        routed_experts=per_expert * model.moe.num_experts * n_moe,
        shared_experts=3 * h * model.moe.shared_intermediate_size * n_moe,
        router=router_params_per_layer(model) * n_moe,
        norms=2 * h * model.num_layers + h,
        embedding=model.vocab_size * h,
        lm_head=0 if model.tie_word_embeddings else model.vocab_size * h,
        routed_per_expert_layer=per_expert,
        top_k=model.moe.top_k,
        num_experts=model.moe.num_experts,
        moe_layers=n_moe,
    )


# --------------------------------------------------------------------------------------------
# Weight bytes per rank
# --------------------------------------------------------------------------------------------


def _attention_weight_bytes_per_rank(model: ModelConfig, tp: int) -> float:
    """One layer's attention weights on one GPU: per-head projections split by tp, the rest whole."""
    a = model.attention
    wdt = bytes_per_element(model.weight_dtype)
    ndt = bytes_per_element(NORM_DTYPE)
    parts = attention_params_per_layer(model)
    total = 0.0
    for name, count in parts.items():
        if name in ("q_a_norm", "kv_a_norm", "qk_norm", "indexer.k_norm",
                    "indexer.weights_proj"):
            total += count * ndt
        elif name in ("q_a", "kv_a", "indexer.wq_b", "indexer.wk"):
            # MLA's down-projections and DSA's indexer are not per head: replicated
            total += count * wdt
        elif name in ("k_proj", "v_proj"):
            shards = min(tp, a.num_kv_heads)  # KV heads are replicated once tp exceeds them
            total += count * wdt / shards
        elif name == "sinks":
            total += count * ndt / tp
        else:
            total += count * wdt / tp
    return total


def weight_bytes_per_rank(model: ModelConfig, plan: ParallelPlan) -> dict[str, float]:
    """Weight bytes on one GPU under ``plan``, by component, plus ``total``.

    Experts are split ``slots / ep`` per GPU under EP (slots = experts + the plan's redundant
    experts: every replica holds a full copy of its expert's weights), or each expert's
    intermediate dimension split by ``tp`` under tensor-parallel MoE; attention is replicated
    across dp groups and split by heads within one; embeddings and the LM head are split by
    vocabulary over tp.
    """
    plan.validate(model)
    h = model.hidden_size
    wdt = bytes_per_element(model.weight_dtype)
    edt = bytes_per_element(model.expert_weight_dtype)
    bf16 = bytes_per_element("bf16")
    n_moe, n_dense = len(model.moe_layers), len(model.dense_layers)
    experts_per_rank = plan.expert_slots(model) / plan.ep
    shared_tp = plan.tp if not plan.expert_parallel else 1
    parts = {
        "attention": _attention_weight_bytes_per_rank(model, plan.tp) * model.num_layers,
        "dense_mlp": 3 * h * model.dense_intermediate_size * n_dense * wdt / plan.tp,
        "routed_experts": expert_params(model) * experts_per_rank * n_moe * edt / plan.moe_tp,
        "shared_experts": 3 * h * model.moe.shared_intermediate_size * n_moe * edt / shared_tp,
        "router": router_params_per_layer(model) * n_moe * bf16,
        "norms": (2 * h * model.num_layers + h) * bf16,
        "embedding": model.vocab_size * h * bf16 / plan.tp,
        "lm_head": (0 if model.tie_word_embeddings else model.vocab_size * h) * bf16 / plan.tp,
    }
    if plan.mtp:
        parts["mtp"] = mtp_weight_bytes_per_rank(model, plan)
    parts["total"] = sum(parts.values())
    return parts


def mtp_weight_bytes_per_rank(model: ModelConfig, plan: ParallelPlan) -> float:
    """The MTP draft module's weights on one GPU: one decoder layer sharded as the main model's
    (an MoE one for DeepSeek-V3), ``enorm``, ``hnorm`` and the head norm, and ``eh_proj``
    (2h x h); the embedding and the output head are shared with the main model."""
    h = model.hidden_size
    wdt = bytes_per_element(model.weight_dtype)
    edt = bytes_per_element(model.expert_weight_dtype)
    bf16 = bytes_per_element("bf16")
    layer = _attention_weight_bytes_per_rank(model, plan.tp) + 2 * h * bf16  # + its two norms
    if model.mtp_moe:
        shared_tp = plan.tp if not plan.expert_parallel else 1
        layer += (expert_params(model) * model.moe.num_experts / plan.ep * edt / plan.moe_tp
                  + 3 * h * model.moe.shared_intermediate_size * edt / shared_tp
                  + router_params_per_layer(model) * bf16)
    else:
        layer += 3 * h * model.dense_intermediate_size * wdt / plan.tp
    return layer + 3 * h * bf16 + 2 * h * h * wdt


# --------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------


def kv_values_per_token_layer(model: ModelConfig, tp: int = 1) -> int:
    """Values one GPU caches per token in one attention layer."""
    a = model.attention
    if a.kind == "mla":
        return a.kv_lora_rank + a.qk_rope_head_dim  # one latent per token, replicated over tp
    kv_heads_per_rank = max(1, a.num_kv_heads // tp)
    return 2 * kv_heads_per_rank * a.head_dim


def index_key_bytes(model: ModelConfig) -> int:
    """Bytes DSA's indexer caches per token and layer (0 without an indexer): one FP8 key of
    ``index_head_dim`` values plus one fp32 scale per 128 of them, whatever the KV cache's dtype
    (vLLM's DeepseekV32IndexerCache: ``head_dim + head_dim // 128 * 4``, 132 for V3.2)."""
    a = model.attention
    if not a.sparse:
        return 0
    return a.index_head_dim + -(-a.index_head_dim // 128) * INDEX_KEY_SCALE_BYTES


def _layer_kv_bytes(model: ModelConfig, kv_dtype: str, tp: int) -> float:
    return (kv_values_per_token_layer(model, tp) * bytes_per_element(kv_dtype)
            + index_key_bytes(model))


def kv_bytes_per_token(model: ModelConfig, kv_dtype: str, tp: int = 1,
                       draft_layers: int = 0) -> float:
    """Marginal KV bytes of one more cached token on one GPU (full-attention layers only;
    ``draft_layers``: MTP draft layers caching it too, 1 under MTP); DSA's indexer keys
    included."""
    full_layers = sum(1 for t in model.attention.layer_types if t == "full") + draft_layers
    return full_layers * _layer_kv_bytes(model, kv_dtype, tp)


def kv_bytes_for_sequence(model: ModelConfig, kv_dtype: str, tokens: int, tp: int = 1,
                          draft_layers: int = 0) -> float:
    """KV bytes one sequence of ``tokens`` cached tokens holds on one GPU (sliding windows and
    attention chunks capped; ``draft_layers`` as :func:`kv_bytes_per_token`)."""
    a = model.attention
    per_layer = _layer_kv_bytes(model, kv_dtype, tp)
    return sum(
        per_layer * min(tokens, a.kv_bound(t) or tokens) for t in a.layer_types
    ) + draft_layers * per_layer * tokens


def draft_kv_layers(plan: ParallelPlan) -> int:
    """Layers the MTP draft module adds to the KV cache under ``plan`` (1 with MTP, else 0)."""
    return 1 if plan.mtp else 0


def kv_window_bytes_per_sequence(model: ModelConfig, kv_dtype: str, tp: int = 1) -> float:
    """The fixed KV cost of a long sequence's sliding-window and chunked layers on one GPU (0
    without them): each caches at most its window or chunk."""
    a = model.attention
    bounded = sum(a.kv_bound(t) or 0 for t in a.layer_types)
    return bounded * _layer_kv_bytes(model, kv_dtype, tp)


@dataclass(frozen=True)
class MemoryBudget:
    """How one GPU's HBM is shared out under a plan.

    hbm_bytes: the device's capacity. Example: 192e9 (MI300X).
    usable_bytes: ``hbm_bytes * mem_fraction``.
    weight_bytes: weights on this GPU.
    activation_reserve_bytes: kept for activations and workspaces.
    kv_bytes: what is left for the KV cache.
    kv_bytes_per_token: marginal bytes per cached token on this GPU.
    kv_capacity_tokens: cached tokens that fit (per dp group's GPU).
    """

    hbm_bytes: float
    usable_bytes: float
    weight_bytes: float
    activation_reserve_bytes: float
    kv_bytes: float
    kv_bytes_per_token: float
    kv_capacity_tokens: int


def memory_budget(
    model: ModelConfig,
    plan: ParallelPlan,
    hbm_bytes: float,
    activation_reserve_bytes: float = DEFAULT_ACTIVATION_RESERVE_BYTES,
) -> MemoryBudget:
    """Share one GPU's HBM between weights, activations and KV cache; error if weights don't fit."""
    weights = weight_bytes_per_rank(model, plan)["total"]
    usable = hbm_bytes * plan.mem_fraction
    kv = usable - weights - activation_reserve_bytes
    if kv <= 0:
        raise EpsimError(
            f"{model.name} does not fit: {weights / 1e9:.1f} GB of weights per GPU plus "
            f"{activation_reserve_bytes / 1e9:.1f} GB of activations exceed the "
            f"{usable / 1e9:.1f} GB usable ({plan.mem_fraction:g} of {hbm_bytes / 1e9:.0f} GB); "
            "use more GPUs or a larger ep/tp"
        )
    per_token = kv_bytes_per_token(model, plan.kv_dtype, plan.tp, draft_kv_layers(plan))
    return MemoryBudget(
        hbm_bytes=hbm_bytes,
        usable_bytes=usable,
        weight_bytes=weights,
        activation_reserve_bytes=activation_reserve_bytes,
        kv_bytes=kv,
        kv_bytes_per_token=per_token,
        kv_capacity_tokens=int(kv // per_token),
    )
