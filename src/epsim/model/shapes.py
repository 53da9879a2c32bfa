"""The shape of a model as far as cost, memory and the runtime are concerned: ``ModelConfig`` with
its ``AttentionConfig`` and ``MoEConfig`` (``epsim.model.config`` reads them from a Hugging Face
``config.json``; ``epsim.model.hf_readers`` holds the readers of each family).

Glossary:
    MLA       multi-head latent attention (DeepSeek-V2/V3/R1): keys and values are projected from
              one compressed latent of ``kv_lora_rank`` values plus a shared RoPE key of
              ``qk_rope_head_dim`` values, which is all the KV cache stores per token and layer.
    GQA       grouped-query attention: ``num_kv_heads`` key/value heads shared by the query heads.
    DSA       DeepSeek sparse attention (DeepSeek-V3.2): MLA whose queries each attend only the
              ``index_topk`` keys a lightning indexer scores highest (its own small attention
              over the whole context, FP8 in the released kernels).
    chunked   Llama-4's local attention: the sequence is cut into ``chunk_size``-token chunks and
              a token attends only the tokens of its own chunk (up to itself).
    routed    experts chosen per token by the router (``top_k`` of ``num_experts``).
    shared    experts every token goes through (DeepSeek has one per MoE layer).
    group-limited routing
              DeepSeek-V3's router first keeps the ``topk_group`` best of ``n_group`` expert groups,
              then the ``top_k`` best experts inside them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionConfig:
    """Shape of the attention blocks.

    kind: ``"mla"`` or ``"gqa"``.
    num_heads: query heads. Example: 128 for DeepSeek-R1.
    num_kv_heads: key/value heads (GQA); equal to ``num_heads`` for MLA (after up-projection).
    head_dim: query/key head dimension (GQA). For MLA: ``qk_nope_head_dim + qk_rope_head_dim``.
    v_head_dim: value head dimension. Example: 128 (DeepSeek-R1), 64 (GPT-OSS).
    q_lora_rank: MLA query compression rank, ``None`` when queries are projected directly.
    kv_lora_rank: MLA latent width cached per token. Example: 512.
    qk_nope_head_dim / qk_rope_head_dim: MLA per-head key parts without / with rotary embedding.
    layer_types: per layer ``"full"``, ``"sliding"`` (a window of the last ``sliding_window``
        tokens) or ``"chunked"`` (Llama-4's local attention: a token attends the tokens of its own
        ``chunk_size``-token chunk, up to itself); length ``num_layers``.
    sliding_window: window of the sliding layers in tokens, ``None`` without sliding layers.
    chunk_size: chunk of the chunked layers in tokens (``attention_chunk_size``), ``None``
        without chunked layers. Example: 8192 (Llama-4).
    nope_layers: layers without rotary embedding (Llama-4's NoPE layers). Example: 3, 7, ..., 47.
    rotary_fraction: the share of each head's dims that RoPE rotates (GLM-4.5: 0.5).
    o_bias: a bias on the output projection too (GPT-OSS; GLM-4.5 has q/k/v biases only).
    index_n_heads / index_head_dim / index_topk: DeepSeek-V3.2's lightning indexer (DSA): its
        heads and head width, and the keys each query's sparse attention keeps. Example: 64,
        128, 2048; 0 without an indexer (dense attention).
    sinks: learned attention-sink logits per head (GPT-OSS).
    qk_norm: per-head RMSNorm on queries and keys (Qwen3, GLM-4.5 with ``use_qk_norm``).
    qk_l2_norm: a weightless per-head RMS norm of queries and keys after RoPE on the RoPE layers
        (Llama-4 with ``use_qk_norm``: Scout; the op ``attn.qk_l2_norm``).
    bias: biases on the q/k/v/o projections (GPT-OSS).
    """

    kind: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    layer_types: tuple[str, ...]
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    sliding_window: int | None = None
    sinks: bool = False
    qk_norm: bool = False
    qk_l2_norm: bool = False
    bias: bool = False
    o_bias: bool = False
    chunk_size: int | None = None
    nope_layers: tuple[int, ...] = ()
    rotary_fraction: float = 1.0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0

    @property
    def sparse(self) -> bool:
        """DSA: a lightning indexer picks ``index_topk`` keys per query."""
        return self.index_topk > 0

    def layer_type(self, layer: int) -> str:
        """``layer_types[layer]``; an MTP draft layer (numbered past the decoder layers) attends
        the whole context."""
        return self.layer_types[layer] if layer < len(self.layer_types) else "full"

    def kv_bound(self, layer_type: str) -> int | None:
        """Most tokens a layer of ``layer_type`` keeps cached per sequence (its window or its
        chunk), ``None`` for a full layer."""
        return {"sliding": self.sliding_window, "chunked": self.chunk_size}.get(layer_type)

    def keys_attended(self, layer: int, context: int) -> int:
        """Keys a query at position ``context - 1`` attends in ``layer``: the whole context,
        its sliding window, its chunk's tokens up to itself, or DSA's ``index_topk``."""
        kind = self.layer_type(layer)
        if kind == "sliding" and self.sliding_window:
            return min(context, self.sliding_window)
        if kind == "chunked" and self.chunk_size:
            return (context - 1) % self.chunk_size + 1
        return min(context, self.index_topk) if self.sparse else context


@dataclass(frozen=True)
class MoEConfig:
    """Shape and routing of the MoE blocks.

    num_experts: routed experts per MoE layer. Example: 256 (DeepSeek-R1).
    top_k: routed experts per token. Example: 8.
    intermediate_size: each routed expert's FFN width. Example: 2048.
    num_shared_experts: always-active experts. Example: 1 (DeepSeek), 0 (others).
    shared_intermediate_size: total width of the shared experts (0 without them).
    scoring: ``"sigmoid"`` (DeepSeek-V3) or ``"softmax"``.
    n_group / topk_group: group-limited routing; ``1`` / ``1`` means no grouping.
    routed_scaling_factor: multiplier on the routed output. Example: 2.5.
    norm_topk_prob: renormalise the chosen experts' weights to sum to one.
    layers: indices of the MoE layers. Example: 3..60 for DeepSeek-R1.
    expert_bias: biases inside each expert's projections (GPT-OSS).
    router_bias: the router has a bias (DeepSeek's and GLM's score-correction bias, GPT-OSS's).
    weight_on_input: the routing weight scales the expert's input, not its output (Llama-4).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    layers: tuple[int, ...]
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    expert_bias: bool = False
    router_bias: bool = False
    weight_on_input: bool = False


@dataclass(frozen=True)
class ModelConfig:
    """One decoder-only MoE model, as far as cost and memory are concerned.

    name: shipped name or the path it was read from.
    family: the architecture read: ``deepseek_v3``, ``deepseek_v32``, ``glm4_moe``, ``llama4``,
        ``gpt_oss``, ``qwen3_moe``, ``mixtral`` (a
        config.json of another ``model_type`` with a known ``architectures`` entry, e.g. Kimi-K2's
        ``kimi_k2`` / ``DeepseekV3ForCausalLM``, gets its architecture's family).
    num_layers: decoder layers (DeepSeek's MTP layer is not counted: it is a separate draft model).
    mtp_layers: DeepSeek's multi-token-prediction (draft) modules, ``num_nextn_predict_layers``
        in config.json. Example: 1 (DeepSeek-V3/R1), 0 (a model without one).
    mtp_moe: the draft module's decoder layer has an MoE FFN (DeepSeek's rule for layer
        ``num_layers``: at or past ``first_k_dense_replace`` and on ``moe_layer_freq``).
    dense_intermediate_size: FFN width of the non-MoE layers (0 when every layer is MoE).
    weight_dtype: storage of the attention/dense linear weights (see ``epsim.model.dtypes``).
    expert_weight_dtype: storage of routed and shared expert weights.
    max_position_embeddings: the longest sequence (prompt + output tokens) the model's positions
        cover, from config.json; ``None`` when the file does not say. Example: 163840 (R1).
    """

    name: str
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    dense_intermediate_size: int
    attention: AttentionConfig
    moe: MoEConfig
    weight_dtype: str = "bf16"
    expert_weight_dtype: str = "bf16"
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int | None = None
    mtp_layers: int = 0
    mtp_moe: bool = False

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return self.moe.layers

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self._moe_layer_set

    @property
    def _moe_layer_set(self) -> frozenset[int]:
        return frozenset(self.moe.layers)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        moe = self._moe_layer_set
        return tuple(i for i in range(self.num_layers) if i not in moe)
