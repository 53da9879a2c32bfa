"""Model configurations read from Hugging Face ``config.json`` files.

The shapes (``ModelConfig``, ``AttentionConfig``, ``MoEConfig`` and their glossary: MLA, GQA, DSA,
chunked attention, routed and shared experts) live in ``epsim.model.shapes``; the reader of each
family (``CONFIG_READERS`` by ``model_type``, ``ARCHITECTURE_READERS`` by ``architectures``) in
``epsim.model.hf_readers``. Both are re-exported here.

Shipped configurations (``model/configs/*.json``) are the Hugging Face files of the public models
(weights are never downloaded; ``docs/architecture.md`` lists them with their sources) plus tiny
test models the CPU runtime can execute. ``load_model(name_or_path)`` takes a shipped name or a
path to any supported ``config.json``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from .bounds import check_config_bounds, is_file, parse_json
from .errors import EpsimError
from .hf_readers import ARCHITECTURE_READERS, CONFIG_READERS, Reader, positive_int
from .shapes import AttentionConfig, ModelConfig, MoEConfig
from .shipped import shipped_names, shipped_text

__all__ = [
    "ARCHITECTURE_READERS", "CONFIG_READERS", "AttentionConfig", "ModelConfig", "MoEConfig",
    "check_context_length", "load_model", "model_from_hf_config", "shipped_models",
]


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
    return positive_int(cfg, "max_position_embeddings", name)


def model_from_hf_config(cfg: Mapping[str, Any], name: str = "config.json") -> ModelConfig:
    """Build a :class:`ModelConfig` from the parsed contents of a Hugging Face ``config.json``."""
    if not isinstance(cfg, Mapping):
        raise EpsimError(f"{name}: config.json must hold a JSON object")
    check_config_bounds(cfg, name)  # before anything is sized from it
    reader = _reader_for(cfg, name)
    # Llama-4's file nests the text model's keys under text_config
    fields = cfg.get("text_config") if isinstance(cfg.get("text_config"), Mapping) else cfg
    try:
        model = replace(reader(cfg, name), max_position_embeddings=_context_limit(fields, name))
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
    if attn.sparse and attn.kind != "mla":
        raise EpsimError(f"{model.name}: the DSA indexer is implemented for MLA models only")


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
