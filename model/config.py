"""Model configurations read from Hugging Face ``config.json`` files.

Glossary:
    MLA       multi-head latent attention (DeepSeek-V2/V3/R1): keys and values are projected from
              one compressed latent of ``kv_lora_rank`` values plus a shared RoPE key of
              ``qk_rope_head_dim`` values, which is all the KV cache stores per token and layer.
    GQA       grouped-query attention: ``num_kv_heads`` key/value heads shared by the query heads.
    routed    experts chosen per token by the router (``top_k`` of ``num_experts``).
    shared    experts every token goes through (DeepSeek has one per MoE layer).
    group-limited routing
              DeepSeek-V3's router first keeps the ``topk_group`` best of ``n_group`` expert groups,
              then the ``top_k`` best experts inside them.

Shipped configurations (``model/configs/*.json``) are the Hugging Face files of the public models
(weights are never downloaded) plus tiny DeepSeek-shaped test models the CPU runtime can execute.
``load_model(name_or_path)`` takes a shipped name or a path to any supported ``config.json``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .bounds import check_config_bounds, is_file, parse_json, show
from .errors import EpsimError
from .shipped import shipped_names, shipped_text


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
    layer_types: per layer ``"full"`` or ``"sliding"``; length ``num_layers``.
    sliding_window: window of the sliding layers in tokens, ``None`` without sliding layers.
    sinks: learned attention-sink logits per head (GPT-OSS).
    qk_norm: per-head RMSNorm on queries and keys (Qwen3).
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
    bias: bool = False


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


@dataclass(frozen=True)
class ModelConfig:
    """One decoder-only MoE model, as far as cost and memory are concerned.

    name: shipped name or the path it was read from.
    family: the architecture read: ``deepseek_v3``, ``gpt_oss``, ``qwen3_moe``, ``mixtral`` (a
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


# --------------------------------------------------------------------------------------------
# Reading config.json
# --------------------------------------------------------------------------------------------

_QUANT_TO_DTYPE = {"fp8": "fp8_block128", "mxfp4": "mxfp4"}


def _require(cfg: Mapping[str, Any], key: str, source: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise EpsimError(f"{source}: config.json lacks required key {key!r}")
    return cfg[key]


def _positive_int(cfg: Mapping[str, Any], key: str, source: str, default: Any = None) -> int:
    value = cfg.get(key, default) if default is not None else _require(cfg, key, source)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise EpsimError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def _dtypes(cfg: Mapping[str, Any], source: str) -> tuple[str, str]:
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


def _deepseek(cfg: Mapping[str, Any], name: str) -> ModelConfig:
    layers = _positive_int(cfg, "num_hidden_layers", name)
    heads = _positive_int(cfg, "num_attention_heads", name)
    nope = _positive_int(cfg, "qk_nope_head_dim", name)
    rope = _positive_int(cfg, "qk_rope_head_dim", name)
    first_dense = int(cfg.get("first_k_dense_replace", 0))
    freq = int(cfg.get("moe_layer_freq", 1))
    n_routed = _positive_int(cfg, "n_routed_experts", name)
    moe_inter = _positive_int(cfg, "moe_intermediate_size", name)
    n_shared = int(cfg.get("n_shared_experts") or 0)
    q_lora = cfg.get("q_lora_rank")
    weight_dtype, expert_dtype = _dtypes(cfg, name)
    mtp_layers = int(cfg.get("num_nextn_predict_layers") or 0)
    if mtp_layers < 0:
        raise EpsimError(f"{name}: num_nextn_predict_layers must be 0 or more, got {mtp_layers}")
    attention = AttentionConfig(
        kind="mla",
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=nope + rope,
        v_head_dim=_positive_int(cfg, "v_head_dim", name),
        layer_types=("full",) * layers,
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=_positive_int(cfg, "kv_lora_rank", name),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
    )
    moe = MoEConfig(
        num_experts=n_routed,
        top_k=_positive_int(cfg, "num_experts_per_tok", name),
        intermediate_size=moe_inter,
        layers=tuple(i for i in range(first_dense, layers) if i % freq == 0),
        num_shared_experts=n_shared,
        shared_intermediate_size=n_shared * moe_inter,
        scoring=str(cfg.get("scoring_func", "softmax")),
        n_group=int(cfg.get("n_group") or 1),
        topk_group=int(cfg.get("topk_group") or 1),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
    )
    return ModelConfig(
        name=name,
        family="deepseek_v3",
        vocab_size=_positive_int(cfg, "vocab_size", name),
        hidden_size=_positive_int(cfg, "hidden_size", name),
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


def _gqa_attention(cfg: Mapping[str, Any], name: str, layers: int, *,
                   window_everywhere: bool = False, **extra: Any) -> AttentionConfig:
    """GQA attention; ``window_everywhere``: without ``layer_types``, a ``sliding_window`` applies
    to every layer (Mixtral's convention; the others name their sliding layers)."""
    heads = _positive_int(cfg, "num_attention_heads", name)
    hidden = _positive_int(cfg, "hidden_size", name)
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
    layers = _positive_int(cfg, "num_hidden_layers", name)
    inter = _positive_int(cfg, "intermediate_size", name)
    weight_dtype, expert_dtype = _dtypes(cfg, name)
    return ModelConfig(
        name=name,
        family="gpt_oss",
        vocab_size=_positive_int(cfg, "vocab_size", name),
        hidden_size=_positive_int(cfg, "hidden_size", name),
        num_layers=layers,
        dense_intermediate_size=0,
        attention=_gqa_attention(
            cfg, name, layers, sinks=True, bias=bool(cfg.get("attention_bias", True))
        ),
        moe=MoEConfig(
            num_experts=_positive_int(cfg, "num_local_experts", name),
            top_k=_positive_int(cfg, "num_experts_per_tok", name),
            intermediate_size=inter,
            layers=tuple(range(layers)),
            scoring="softmax",
            expert_bias=True,
        ),
        weight_dtype=weight_dtype,
        expert_weight_dtype=expert_dtype,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=float(cfg.get("rope_theta", 150000.0)),
    )


def _qwen3_moe(cfg: Mapping[str, Any], name: str) -> ModelConfig:
    layers = _positive_int(cfg, "num_hidden_layers", name)
    step = int(cfg.get("decoder_sparse_step", 1))
    dense_only = set(cfg.get("mlp_only_layers") or [])
    weight_dtype, expert_dtype = _dtypes(cfg, name)
    return ModelConfig(
        name=name,
        family="qwen3_moe",
        vocab_size=_positive_int(cfg, "vocab_size", name),
        hidden_size=_positive_int(cfg, "hidden_size", name),
        num_layers=layers,
        dense_intermediate_size=int(cfg.get("intermediate_size", 0)),
        attention=_gqa_attention(cfg, name, layers, qk_norm=True),
        moe=MoEConfig(
            num_experts=_positive_int(cfg, "num_experts", name),
            top_k=_positive_int(cfg, "num_experts_per_tok", name),
            intermediate_size=_positive_int(cfg, "moe_intermediate_size", name),
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
    layers = _positive_int(cfg, "num_hidden_layers", name)
    weight_dtype, expert_dtype = _dtypes(cfg, name)
    return ModelConfig(
        name=name,
        family="mixtral",
        vocab_size=_positive_int(cfg, "vocab_size", name),
        hidden_size=_positive_int(cfg, "hidden_size", name),
        num_layers=layers,
        dense_intermediate_size=0,
        attention=_gqa_attention(cfg, name, layers, window_everywhere=True),
        moe=MoEConfig(
            num_experts=_positive_int(cfg, "num_local_experts", name),
            top_k=_positive_int(cfg, "num_experts_per_tok", name),
            intermediate_size=_positive_int(cfg, "intermediate_size", name),
            layers=tuple(range(layers)),
            scoring="softmax",
        ),
        weight_dtype=weight_dtype,
        expert_weight_dtype=expert_dtype,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=float(cfg.get("rope_theta", 1e6)),
    )


Reader = Callable[[Mapping[str, Any], str], ModelConfig]

#: Hugging Face model_type -> reader; add a family by registering its reader here and its
#: architecture class below.
CONFIG_READERS: dict[str, Reader] = {
    "deepseek_v3": _deepseek,
    "deepseek_v2": _deepseek,
    "gpt_oss": _gpt_oss,
    "qwen3_moe": _qwen3_moe,
    "mixtral": _mixtral,
}

#: Hugging Face ``architectures`` class -> reader: the fallback for a file whose model_type is
#: a derivative's own name on a known architecture (Kimi-K2: ``kimi_k2`` on DeepseekV3ForCausalLM)
ARCHITECTURE_READERS: dict[str, Reader] = {
    "DeepseekV3ForCausalLM": _deepseek,
    "DeepseekV2ForCausalLM": _deepseek,
    "GptOssForCausalLM": _gpt_oss,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "MixtralForCausalLM": _mixtral,
}


def _reader_for(cfg: Mapping[str, Any], name: str) -> Reader:
    """The reader of ``cfg``: by ``model_type``, else by its first known ``architectures`` entry."""
    model_type = cfg.get("model_type")
    if isinstance(model_type, str) and model_type in CONFIG_READERS:
        return CONFIG_READERS[model_type]
    architectures = cfg.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    for arch in architectures if isinstance(architectures, list) else []:
        if isinstance(arch, str) and arch in ARCHITECTURE_READERS:
            return ARCHITECTURE_READERS[arch]
    raise EpsimError(
        f"{name}: unsupported model_type {model_type!r} with architectures {architectures!r} "
        f"(supported model types: {', '.join(sorted(CONFIG_READERS))}; architectures: "
        f"{', '.join(sorted(ARCHITECTURE_READERS))})"
    )


def _context_limit(cfg: Mapping[str, Any], name: str) -> int | None:
    if cfg.get("max_position_embeddings") is None:
        return None
    return _positive_int(cfg, "max_position_embeddings", name)


def model_from_hf_config(cfg: Mapping[str, Any], name: str = "config.json") -> ModelConfig:
    """Build a :class:`ModelConfig` from the parsed contents of a Hugging Face ``config.json``."""
    if not isinstance(cfg, Mapping):
        raise EpsimError(f"{name}: config.json must hold a JSON object")
    check_config_bounds(cfg, name)  # before anything is sized from it
    reader = _reader_for(cfg, name)
    try:
        model = replace(reader(cfg, name), max_position_embeddings=_context_limit(cfg, name))
    except (TypeError, ValueError, KeyError) as exc:
        if isinstance(exc, EpsimError):
            raise
        raise EpsimError(f"{name}: malformed config.json ({exc})") from None
    _validate(model)
    return model


def check_context_length(model: ModelConfig, tokens: int, what: str) -> None:
    """Refuse a sequence of ``tokens`` positions beyond the model's ``max_position_embeddings``.

    ``what`` says where the length comes from (``"--context 200000"``); the message names the
    limit. A model whose config.json gives no limit accepts any length.
    """
    limit = model.max_position_embeddings
    if limit is not None and tokens > limit:
        raise EpsimError(f"{what}: {tokens} tokens exceed {model.name}'s context of {limit} "
                         "tokens (max_position_embeddings in its config.json)")


def _validate(model: ModelConfig) -> None:
    moe, attn = model.moe, model.attention
    if moe.top_k > moe.num_experts:
        raise EpsimError(
            f"{model.name}: top_k {moe.top_k} exceeds num_experts {moe.num_experts}"
        )
    if moe.num_experts % moe.n_group:
        raise EpsimError(
            f"{model.name}: n_group {moe.n_group} does not divide num_experts {moe.num_experts}"
        )
    if moe.topk_group > moe.n_group:
        raise EpsimError(f"{model.name}: topk_group {moe.topk_group} exceeds n_group {moe.n_group}")
    if moe.n_group > 1 and moe.top_k > moe.topk_group * (moe.num_experts // moe.n_group):
        raise EpsimError(f"{model.name}: top_k {moe.top_k} exceeds the experts of {moe.topk_group} groups")
    if model.dense_layers and model.dense_intermediate_size <= 0:
        raise EpsimError(f"{model.name}: dense layers need a positive intermediate_size")
    if attn.kind == "mla" and attn.kv_lora_rank <= 0:
        raise EpsimError(f"{model.name}: MLA needs a positive kv_lora_rank")


def shipped_models() -> list[str]:
    """Names of the configurations shipped with epsim."""
    return shipped_names("epsim.model", "configs")


def load_model(name_or_path: str | Path) -> ModelConfig:
    """A shipped model by name (``deepseek-r1``) or a path to a Hugging Face ``config.json``."""
    text_name = str(name_or_path)
    path = Path(text_name)
    if path.suffix == ".json" or is_file(path) or path.is_dir():
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise EpsimError(f"model config file not found: {path}")
        source = str(path)
        text = path.read_text(encoding="utf-8", errors="replace")
    else:
        shipped = shipped_text("epsim.model", "configs", text_name)
        if shipped is None:
            raise EpsimError(
                f"unknown model {text_name!r}: not a shipped name "
                f"({', '.join(shipped_models())}) nor a path to a config.json"
            )
        source = text_name
        text = shipped
    return model_from_hf_config(parse_json(text, source, "config.json"), source)
