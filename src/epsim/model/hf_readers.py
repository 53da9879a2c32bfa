"""Readers of Hugging Face ``config.json`` files, one per architecture family, and their registries
(``CONFIG_READERS`` by ``model_type``, ``ARCHITECTURE_READERS`` by ``architectures`` class);
``epsim.model.config`` picks one and checks what it read.

Where each family's layer pattern comes from:
    deepseek_v3, deepseek_v32  MoE from ``first_k_dense_replace`` on, every ``moe_layer_freq``-th
                               layer; V3.2 adds the lightning indexer (``index_*`` keys).
    glm4_moe                   MoE from ``first_k_dense_replace`` on; GQA with q/k/v biases and
                               partial RoPE.
    llama4                     MoE where ``(layer + 1) % interleave_moe_layer_step == 0``; NoPE
                               layers every 4th (``no_rope_layers``), the others chunked.
    gpt_oss, qwen3_moe, mixtral
                               MoE in every layer (Qwen3: but ``mlp_only_layers``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from .bounds import show
from .errors import EpsimError
from .shapes import AttentionConfig, ModelConfig, MoEConfig

_QUANT_TO_DTYPE = {"fp8": "fp8_block128", "mxfp4": "mxfp4"}


def require(cfg: Mapping[str, Any], key: str, source: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise EpsimError(f"{source}: config.json lacks required key {key!r}")
    return cfg[key]


def positive_int(cfg: Mapping[str, Any], key: str, source: str, default: Any = None) -> int:
    value = cfg.get(key, default) if default is not None else require(cfg, key, source)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise EpsimError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def dtypes(cfg: Mapping[str, Any], source: str) -> tuple[str, str]:
    """(linear weight dtype, expert weight dtype) from ``quantization_config``."""
    quant = cfg.get("quantization_config") or {}
    if not isinstance(quant, Mapping):
        raise EpsimError(f"{source}: quantization_config must be an object, got {show(quant)}")
    method = quant.get("quant_method")
    if method is None:
        return "bf16", "bf16"
    if method not in _QUANT_TO_DTYPE:
        raise EpsimError(
            f"{source}: unsupported quant_method {method!r} (known: {', '.join(_QUANT_TO_DTYPE)})"
        )
    dtype = _QUANT_TO_DTYPE[method]
    if method == "mxfp4":
        # GPT-OSS quantises only the experts; attention, router and embeddings stay bf16.
        return "bf16", dtype
    return dtype, dtype


def deepseek(cfg: Mapping[str, Any], name: str) -> ModelConfig:
    layers = positive_int(cfg, "num_hidden_layers", name)
    heads = positive_int(cfg, "num_attention_heads", name)
    nope = positive_int(cfg, "qk_nope_head_dim", name)
    rope = positive_int(cfg, "qk_rope_head_dim", name)
    first_dense = int(cfg.get("first_k_dense_replace", 0))
    freq = int(cfg.get("moe_layer_freq", 1))
    n_routed = positive_int(cfg, "n_routed_experts", name)
    moe_inter = positive_int(cfg, "moe_intermediate_size", name)
    n_shared = int(cfg.get("n_shared_experts") or 0)
    q_lora = cfg.get("q_lora_rank")
    weight_dtype, expert_dtype = dtypes(cfg, name)
    mtp_layers = int(cfg.get("num_nextn_predict_layers") or 0)
    if mtp_layers < 0:
        raise EpsimError(f"{name}: num_nextn_predict_layers must be 0 or more, got {mtp_layers}")
    attention = AttentionConfig(
        kind="mla",
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=nope + rope,
        v_head_dim=positive_int(cfg, "v_head_dim", name),
        layer_types=("full",) * layers,
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=positive_int(cfg, "kv_lora_rank", name),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
    )
    moe = MoEConfig(
        num_experts=n_routed,
        top_k=positive_int(cfg, "num_experts_per_tok", name),
        intermediate_size=moe_inter,
        layers=tuple(i for i in range(first_dense, layers) if i % freq == 0),
        num_shared_experts=n_shared,
        shared_intermediate_size=n_shared * moe_inter,
        scoring=str(cfg.get("scoring_func", "softmax")),
        n_group=int(cfg.get("n_group") or 1),
        topk_group=int(cfg.get("topk_group") or 1),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        router_bias=True,  # e_score_correction_bias (the runtime's router reads one too)
    )
    return ModelConfig(
        name=name,
        family="deepseek_v3",
        vocab_size=positive_int(cfg, "vocab_size", name),
        hidden_size=positive_int(cfg, "hidden_size", name),
        num_layers=layers,
        dense_intermediate_size=int(cfg.get("intermediate_size", 0)),
        attention=attention,
        moe=moe,
        weight_dtype=weight_dtype,
        expert_weight_dtype=expert_dtype,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        mtp_layers=mtp_layers,
        # the MTP layer is numbered after the decoder layers (HF's model.layers.{num_layers}),
        # and vLLM's DeepseekV2DecoderLayer gives it an MoE FFN by the main layers' rule
        mtp_moe=layers >= first_dense and layers % freq == 0,
    )


def gqa_attention(cfg: Mapping[str, Any], name: str, layers: int, *,
                   window_everywhere: bool = False, **extra: Any) -> AttentionConfig:
    """GQA attention; ``window_everywhere``: without ``layer_types``, a ``sliding_window`` applies
    to every layer (Mixtral's convention; the others name their sliding layers)."""
    heads = positive_int(cfg, "num_attention_heads", name)
    hidden = positive_int(cfg, "hidden_size", name)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise EpsimError(
            f"{name}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != layers:
            raise EpsimError(f"{name}: layer_types has {len(types)} entries for {layers} layers")
        layer_types = tuple("sliding" if "sliding" in str(t) else "full" for t in types)
    elif window and cfg.get("use_sliding_window", True) and window_everywhere:
        layer_types = ("sliding",) * layers
    else:
        layer_types = ("full",) * layers
    if "sliding" not in layer_types:
        window = None
    return AttentionConfig(
        kind="gqa",
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        layer_types=layer_types,
        sliding_window=int(window) if window else None,
        **extra,
    )


def _gpt_oss(cfg: Mapping[str, Any], name: str) -> ModelConfig:
    layers = positive_int(cfg, "num_hidden_layers", name)
    inter = positive_int(cfg, "intermediate_size", name)
    weight_dtype, expert_dtype = dtypes(cfg, name)
    return ModelConfig(
        name=name,
        family="gpt_oss",
        vocab_size=positive_int(cfg, "vocab_size", name),
        hidden_size=positive_int(cfg, "hidden_size", name),
        num_layers=layers,
        dense_intermediate_size=0,
        attention=gqa_attention(
            cfg, name, layers, sinks=True, bias=bool(cfg.get("attention_bias", True)),
            o_bias=bool(cfg.get("attention_bias", True)),
        ),
        moe=MoEConfig(
            num_experts=positive_int(cfg, "num_local_experts", name),
            top_k=positive_int(cfg, "num_experts_per_tok", name),
            intermediate_size=inter,
            layers=tuple(range(layers)),
            scoring="softmax",
            expert_bias=True,
            router_bias=True,
        ),
        weight_dtype=weight_dtype,
        expert_weight_dtype=expert_dtype,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=float(cfg.get("rope_theta", 150000.0)),
    )


def _qwen3_moe(cfg: Mapping[str, Any], name: str) -> ModelConfig:
    layers = positive_int(cfg, "num_hidden_layers", name)
    step = int(cfg.get("decoder_sparse_step", 1))
    dense_only = set(cfg.get("mlp_only_layers") or [])
    weight_dtype, expert_dtype = dtypes(cfg, name)
    return ModelConfig(
        name=name,
        family="qwen3_moe",
        vocab_size=positive_int(cfg, "vocab_size", name),
        hidden_size=positive_int(cfg, "hidden_size", name),
        num_layers=layers,
        dense_intermediate_size=int(cfg.get("intermediate_size", 0)),
        attention=gqa_attention(cfg, name, layers, qk_norm=True),
        moe=MoEConfig(
            num_experts=positive_int(cfg, "num_experts", name),
            top_k=positive_int(cfg, "num_experts_per_tok", name),
            intermediate_size=positive_int(cfg, "moe_intermediate_size", name),
            layers=tuple(
                i for i in range(layers) if i not in dense_only and (i + 1) % step == 0
            ),
            scoring="softmax",
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        ),
        weight_dtype=weight_dtype,
        expert_weight_dtype=expert_dtype,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", 1e6)),
    )


def _mixtral(cfg: Mapping[str, Any], name: str) -> ModelConfig:
    layers = positive_int(cfg, "num_hidden_layers", name)
    weight_dtype, expert_dtype = dtypes(cfg, name)
    return ModelConfig(
        name=name,
        family="mixtral",
        vocab_size=positive_int(cfg, "vocab_size", name),
        hidden_size=positive_int(cfg, "hidden_size", name),
        num_layers=layers,
        dense_intermediate_size=0,
        attention=gqa_attention(cfg, name, layers, window_everywhere=True),
        moe=MoEConfig(
            num_experts=positive_int(cfg, "num_local_experts", name),
            top_k=positive_int(cfg, "num_experts_per_tok", name),
            intermediate_size=positive_int(cfg, "intermediate_size", name),
            layers=tuple(range(layers)),
            scoring="softmax",
        ),
        weight_dtype=weight_dtype,
        expert_weight_dtype=expert_dtype,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=float(cfg.get("rope_theta", 1e6)),
    )


def deepseek_v32(cfg: Mapping[str, Any], name: str) -> ModelConfig:
    """DeepSeek-V3.2: DeepSeek-V3 plus the lightning indexer of DSA (``index_n_heads``,
    ``index_head_dim``, ``index_topk``); its query projection reads MLA's compressed query, so
    a ``q_lora_rank`` is required (DeepSeek-V3.2-Exp ``inference/model.py``, class Indexer)."""
    base = deepseek(cfg, name)
    if not base.attention.q_lora_rank:
        raise EpsimError(f"{name}: the DSA indexer needs a q_lora_rank")
    attention = replace(
        base.attention,
        index_n_heads=positive_int(cfg, "index_n_heads", name),
        index_head_dim=positive_int(cfg, "index_head_dim", name),
        index_topk=positive_int(cfg, "index_topk", name),
    )
    return replace(base, family="deepseek_v32", attention=attention)


def glm4_moe(cfg: Mapping[str, Any], name: str) -> ModelConfig:
    """GLM-4.5/4.6/4.7 (``glm4_moe``): GQA with q/k/v biases, optional per-head q/k RMSNorm
    (``use_qk_norm``) and RoPE on ``partial_rotary_factor`` of each head; layers from
    ``first_k_dense_replace`` on are MoE with sigmoid routing, a score-correction bias and
    shared experts, as DeepSeek-V3's (SGLang ``python/sglang/srt/models/glm4_moe.py`` at
    005ffc65: q/k norm before RoPE, ``Glm4MoeGate`` with ``e_score_correction_bias``)."""
    layers = positive_int(cfg, "num_hidden_layers", name)
    first_dense = _non_negative(cfg, "first_k_dense_replace", name)
    moe_inter = positive_int(cfg, "moe_intermediate_size", name)
    n_shared = _non_negative(cfg, "n_shared_experts", name)
    fraction = float(cfg.get("partial_rotary_factor", 0.5))
    if not 0.0 < fraction <= 1.0:
        raise EpsimError(f"{name}: partial_rotary_factor must be in (0, 1], got {fraction!r}")
    weight_dtype, expert_dtype = dtypes(cfg, name)
    mtp_layers = _non_negative(cfg, "num_nextn_predict_layers", name)
    return ModelConfig(
        name=name,
        family="glm4_moe",
        vocab_size=positive_int(cfg, "vocab_size", name),
        hidden_size=positive_int(cfg, "hidden_size", name),
        num_layers=layers,
        dense_intermediate_size=int(cfg.get("intermediate_size", 0)),
        attention=gqa_attention(cfg, name, layers, qk_norm=bool(cfg.get("use_qk_norm", False)),
                                bias=bool(cfg.get("attention_bias", False)),
                                rotary_fraction=fraction),
        moe=MoEConfig(
            num_experts=positive_int(cfg, "n_routed_experts", name),
            top_k=positive_int(cfg, "num_experts_per_tok", name),
            intermediate_size=moe_inter,
            layers=tuple(range(first_dense, layers)),
            num_shared_experts=n_shared,
            shared_intermediate_size=n_shared * moe_inter,
            scoring="sigmoid",
            n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            router_bias=True,  # e_score_correction_bias
        ),
        weight_dtype=weight_dtype,
        expert_weight_dtype=expert_dtype,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=float(cfg.get("rope_theta", 1e6)),
        mtp_layers=mtp_layers,
        mtp_moe=layers >= first_dense,  # the MTP layer (index num_layers) follows the rule
    )


def _non_negative(cfg: Mapping[str, Any], key: str, source: str) -> int:
    value = cfg.get(key) or 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise EpsimError(f"{source}: {key} must be a non-negative integer, got {value!r}")
    return value


def _llama4_rope_layers(text: Mapping[str, Any], name: str, layers: int) -> list[bool]:
    """Per layer whether it rotates (``no_rope_layers``: 1 = RoPE, 0 = NoPE); an empty or
    missing list means every ``no_rope_layer_interval``-th layer (default 4) is NoPE, as
    transformers' ``Llama4TextConfig`` fills it."""
    given = text.get("no_rope_layers") or []
    if given:
        if not isinstance(given, list) or len(given) != layers:
            raise EpsimError(f"{name}: no_rope_layers must list one 0/1 per layer ({layers})")
        return [bool(v) for v in given]
    interval = positive_int(text, "no_rope_layer_interval", name, default=4)
    return [(i + 1) % interval != 0 for i in range(layers)]


def llama4(cfg: Mapping[str, Any], name: str) -> ModelConfig:
    """Llama-4 Scout/Maverick (``llama4``; the text model's keys under ``text_config``): a layer
    is MoE when ``(layer + 1) % interleave_moe_layer_step == 0``, else a dense FFN of
    ``intermediate_size_mlp``; MoE layers route top-1 with a sigmoid weight on the expert's
    input, beside one shared expert; RoPE layers attend chunks of ``attention_chunk_size``, the
    NoPE layers the whole context (vLLM ``vllm/model_executor/models/llama4.py`` at 0121c95e)."""
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), Mapping) else cfg
    layers = positive_int(text, "num_hidden_layers", name)
    step = _non_negative(text, "interleave_moe_layer_step", name)
    moe_layers = [i for i in range(layers) if step and (i + 1) % step == 0]
    rope = _llama4_rope_layers(text, name, layers)
    chunk = text.get("attention_chunk_size")
    if chunk is not None:
        chunk = positive_int(text, "attention_chunk_size", name)
    inter = positive_int(text, "intermediate_size", name)
    attention = replace(
        # Llama-4's QK norm is a weightless L2 norm (no parameters), so qk_norm stays False
        gqa_attention(text, name, layers, bias=bool(text.get("attention_bias", False))),
        layer_types=tuple("chunked" if r and chunk else "full" for r in rope),
        chunk_size=chunk if any(rope) else None,
        nope_layers=tuple(i for i, r in enumerate(rope) if not r),
        qk_l2_norm=bool(text.get("use_qk_norm", False)),
    )
    weight_dtype, expert_dtype = dtypes(text, name)
    return ModelConfig(
        name=name,
        family="llama4",
        vocab_size=positive_int(text, "vocab_size", name),
        hidden_size=positive_int(text, "hidden_size", name),
        num_layers=layers,
        dense_intermediate_size=int(text.get("intermediate_size_mlp", 0)),
        attention=attention,
        moe=MoEConfig(
            num_experts=positive_int(text, "num_local_experts", name),
            top_k=positive_int(text, "num_experts_per_tok", name),
            intermediate_size=inter,
            layers=tuple(moe_layers),
            num_shared_experts=1,
            shared_intermediate_size=inter,
            scoring="sigmoid",
            norm_topk_prob=False,
            weight_on_input=True,
        ),
        weight_dtype=weight_dtype,
        expert_weight_dtype=expert_dtype,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings",
                                         text.get("tie_word_embeddings", False))),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)),
        rope_theta=float(text.get("rope_theta", 500000.0)),
    )


Reader = Callable[[Mapping[str, Any], str], ModelConfig]

#: Hugging Face model_type -> reader; add a family by registering its reader here and its
#: architecture class below.
CONFIG_READERS: dict[str, Reader] = {
    "deepseek_v3": deepseek,
    "deepseek_v2": deepseek,
    "gpt_oss": _gpt_oss,
    "qwen3_moe": _qwen3_moe,
    "mixtral": _mixtral,
    "deepseek_v32": deepseek_v32,
    "glm4_moe": glm4_moe,
    "llama4": llama4,
    "llama4_text": llama4,
}

#: Hugging Face ``architectures`` class -> reader: the fallback for a file whose model_type is
#: a derivative's own name on a known architecture (Kimi-K2: ``kimi_k2`` on DeepseekV3ForCausalLM)
ARCHITECTURE_READERS: dict[str, Reader] = {
    "DeepseekV3ForCausalLM": deepseek,
    "DeepseekV2ForCausalLM": deepseek,
    "GptOssForCausalLM": _gpt_oss,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "MixtralForCausalLM": _mixtral,
    "DeepseekV32ForCausalLM": deepseek_v32,
    "Glm4MoeForCausalLM": glm4_moe,
    "Llama4ForConditionalGeneration": llama4,
    "Llama4ForCausalLM": llama4,
}
