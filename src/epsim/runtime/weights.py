"""Random model weights with a fixed seed, identical on every rank and in the dense reference.

Every tensor is drawn from its own generator seeded by ``crc32(f"{seed}/{key}")``, so a rank that
holds only some experts draws exactly the values the dense reference draws for them, without
drawing the rest. Keys are the op graph's weight keys (``epsim.model.ids``): ``"L3.attn.q_a"``,
``"L3.expert7.gate_up"``.

Layout (``x @ W`` everywhere, i.e. ``[in, out]``):
    embed             [vocab, hidden]
    L{l}.attn_norm    [hidden]                      (also ffn_norm, final_norm at layer -1)
    L{l}.attn.q_a     [hidden, q_lora]              (attn.q_proj [hidden, heads*qk] without q_lora)
    L{l}.attn.q_a_norm[q_lora]
    L{l}.attn.q_b     [q_lora, heads*(nope+rope)]
    L{l}.attn.kv_a    [hidden, kv_lora+rope]
    L{l}.attn.kv_a_norm [kv_lora]
    L{l}.attn.kv_b    [heads, nope+v, kv_lora]      (split into q_absorb / v_absorb by the runtime)
    L{l}.attn.o_proj  [heads*v, hidden]
  GQA instead (GLM-4.5, Llama-4):
    L{l}.attn.qkv_proj [hidden, (heads+2*kv_heads)*head_dim] (+ .bias)   L{l}.attn.o_proj (+ .bias)
    L{l}.attn.qk_norm  [2, head_dim]                 (queries' and keys' RMSNorm weights)
  with DSA (DeepSeek-V3.2's lightning indexer, ``index_n_heads`` x ``index_head_dim``):
    L{l}.attn.indexer.wq_b [q_lora, iheads*idim]  L{l}.attn.indexer.wk [hidden, idim]
    L{l}.attn.indexer.weights_proj [hidden, iheads]
    L{l}.attn.indexer.k_norm / L{l}.attn.indexer.k_norm.bias [idim] (a LayerNorm)
    L{l}.mlp.gate_up  [hidden, 2*inter]  L{l}.mlp.down [inter, hidden]
    L{l}.moe.router   [hidden, experts]  L{l}.moe.router.bias [experts] (e_score_correction_bias)
    L{l}.moe.shared.gate_up [hidden, 2*shared_inter]  L{l}.moe.shared.down [shared_inter, hidden]
    L{l}.expert{e}.gate_up  [hidden, 2*inter]         L{l}.expert{e}.down  [inter, hidden]
    lm_head           [hidden, vocab]
  with the MTP draft module (``draft=True``), its layer ``D = num_layers`` has a decoder layer's
  weights (MoE ones when the model's draft layer is MoE) plus
    L{D}.mtp.enorm / L{D}.mtp.hnorm / L{D}.mtp.head_norm  [hidden]
    L{D}.mtp.eh_proj  [2*hidden, hidden]            (input: [enorm(embedding); hnorm(hidden)])
    L{D}.mtp.embed / L{D}.mtp.lm_head               the main ``embed`` / ``lm_head`` (shared)
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from epsim.model.config import ModelConfig
from epsim.model.ids import NO_LAYER, expert_weight_key, weight_key
from epsim.model.mtp import draft_layer

from . import lifecycle


def _generator(seed: int, key: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(zlib.crc32(f"{seed}/{key}".encode()) + (seed << 32))
    return g


def randn(seed: int, key: str, shape: Sequence[int], std: float = 1.0,
          mean: float = 0.0) -> torch.Tensor:
    """fp32 normal values for ``key``; the same on every process for the same seed."""
    lifecycle.progress()  # building a large model's weights is work, not a hang
    return torch.randn(tuple(shape), generator=_generator(seed, key)) * std + mean


def dense_weights(model: ModelConfig, seed: int, draft: bool = False) -> dict[str, torch.Tensor]:
    """Every weight except the routed experts' (see :func:`expert_weights`), fp32 on the CPU;
    ``draft``: the MTP draft module's too (layer ``num_layers``)."""
    a, h = model.attention, model.hidden_size
    w: dict[str, torch.Tensor] = {}

    def lin(layer: int, name: str, fan_in: int, *shape: int) -> None:
        key = weight_key(layer, name)
        w[key] = randn(seed, key, shape, std=fan_in ** -0.5)

    def norm(layer: int, name: str, width: int) -> None:
        key = weight_key(layer, name)
        w[key] = randn(seed, key, (width,), std=0.1, mean=1.0)

    embed = weight_key(NO_LAYER, "embed")
    w[embed] = randn(seed, embed, (model.vocab_size, h))
    layers = [(layer, model.is_moe_layer(layer)) for layer in range(model.num_layers)]
    if draft:
        layers.append((draft_layer(model), model.mtp_moe))
    for layer, is_moe in layers:
        norm(layer, "attn_norm", h)
        norm(layer, "ffn_norm", h)
        if a.kind == "mla":
            _mla_weights(w, model, seed, layer)
        else:
            _gqa_weights(w, model, seed, layer)
        if is_moe:
            moe = model.moe
            # a wider router spread makes the top-k choice far from ties
            lin(layer, "moe.router", h // 16 or 1, h, moe.num_experts)
            if moe.router_bias:
                bias = weight_key(layer, "moe.router.bias")
                w[bias] = randn(seed, bias, (moe.num_experts,), std=0.1)
            if moe.num_shared_experts:
                si = moe.shared_intermediate_size
                lin(layer, "moe.shared.gate_up", h, h, 2 * si)
                lin(layer, "moe.shared.down", si, si, h)
        else:
            inter = model.dense_intermediate_size
            lin(layer, "mlp.gate_up", h, h, 2 * inter)
            lin(layer, "mlp.down", inter, inter, h)
    norm(NO_LAYER, "final_norm", h)
    lin(NO_LAYER, "lm_head", h, h, model.vocab_size)
    if draft:
        d = draft_layer(model)
        for name in ("mtp.enorm", "mtp.hnorm", "mtp.head_norm"):
            norm(d, name, h)
        lin(d, "mtp.eh_proj", 2 * h, 2 * h, h)
        # the report's shared embedding and output head: the same tensors
        w[weight_key(d, "mtp.embed")] = w[embed]
        w[weight_key(d, "mtp.lm_head")] = w[weight_key(NO_LAYER, "lm_head")]
    return w


def _mla_weights(w: dict[str, torch.Tensor], model: ModelConfig, seed: int, layer: int) -> None:
    """MLA's projections and norms of ``layer`` (and DSA's indexer) into ``w``."""
    a, h = model.attention, model.hidden_size
    heads, nope, rope = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim
    r, v = a.kv_lora_rank, a.v_head_dim

    def lin(name: str, fan_in: int, *shape: int) -> None:
        key = weight_key(layer, name)
        w[key] = randn(seed, key, shape, std=fan_in ** -0.5)

    def norm(name: str, width: int) -> None:
        key = weight_key(layer, name)
        w[key] = randn(seed, key, (width,), std=0.1, mean=1.0)

    if a.q_lora_rank:
        lin("attn.q_a", h, h, a.q_lora_rank)
        norm("attn.q_a_norm", a.q_lora_rank)
        lin("attn.q_b", a.q_lora_rank, a.q_lora_rank, heads * (nope + rope))
    else:
        lin("attn.q_proj", h, h, heads * (nope + rope))
    lin("attn.kv_a", h, h, r + rope)
    norm("attn.kv_a_norm", r)
    lin("attn.kv_b", r, heads, nope + v, r)
    lin("attn.o_proj", heads * v, heads * v, h)
    if a.sparse:
        _indexer_weights(w, model, seed, layer)


def _gqa_weights(w: dict[str, torch.Tensor], model: ModelConfig, seed: int, layer: int) -> None:
    """GQA's projections of ``layer`` (their biases, its q/k norm where the model has them)."""
    a, h = model.attention, model.hidden_size
    qkv, out = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim, a.num_heads * a.head_dim
    for name, fan_in, shape, bias in (("attn.qkv_proj", h, (h, qkv), a.bias),
                                      ("attn.o_proj", out, (out, h), a.o_bias)):
        key = weight_key(layer, name)
        w[key] = randn(seed, key, shape, std=fan_in ** -0.5)
        if bias:
            w[key + ".bias"] = randn(seed, key + ".bias", (shape[1],), std=0.1)
    if a.qk_norm:  # [queries' weight, keys' weight]
        key = weight_key(layer, "attn.qk_norm")
        w[key] = randn(seed, key, (2, a.head_dim), std=0.1, mean=1.0)


def cache_widths(model: ModelConfig) -> tuple[int, int]:
    """Values per token the KV cache keeps in its two parts: MLA's latent and RoPE key, or
    GQA's keys and values (``KV * head_dim`` each)."""
    a = model.attention
    if a.kind == "mla":
        return a.kv_lora_rank, a.qk_rope_head_dim
    return a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim


def _indexer_weights(w: dict[str, torch.Tensor], model: ModelConfig, seed: int,
                     layer: int) -> None:
    """DSA's indexer of ``layer`` into ``w`` (layout in the module docstring)."""
    a, h = model.attention, model.hidden_size
    heads, dim = a.index_n_heads, a.index_head_dim
    shapes = {"attn.indexer.wq_b": ((a.q_lora_rank or 0), heads * dim),
              "attn.indexer.wk": (h, dim), "attn.indexer.weights_proj": (h, heads)}
    for name, (fan_in, out) in shapes.items():
        key = weight_key(layer, name)
        w[key] = randn(seed, key, (fan_in, out), std=fan_in ** -0.5)
    key = weight_key(layer, "attn.indexer.k_norm")
    w[key] = randn(seed, key, (dim,), std=0.1, mean=1.0)
    w[key + ".bias"] = randn(seed, key + ".bias", (dim,), std=0.1)


def initial_index_keys(model: ModelConfig, seed: int, rank: int, layer: int, seqs: int,
                       cached: int) -> torch.Tensor:
    """DSA: the indexer keys ``[seqs, cached, index_head_dim]`` of the drawn cached tokens
    (normalised and rotated, as the indexer caches them), beside :func:`initial_cache`."""
    return randn(seed, f"cache/rank{rank}/L{layer}/index", (seqs, cached,
                                                           model.attention.index_head_dim))


def expert_weights(model: ModelConfig, seed: int, layer: int,
                   logical_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked weights of the given logical experts of one layer.

    Returns:
        ``gate_up [len(ids), hidden, 2*inter]`` and ``down [len(ids), inter, hidden]``, fp32.
    """
    h, inter = model.hidden_size, model.moe.intermediate_size
    gate_up = [randn(seed, expert_weight_key(layer, e, "gate_up"), (h, 2 * inter), std=h ** -0.5)
               for e in logical_ids]
    down = [randn(seed, expert_weight_key(layer, e, "down"), (inter, h), std=inter ** -0.5)
            for e in logical_ids]
    if not gate_up:
        return torch.zeros(0, h, 2 * inter), torch.zeros(0, inter, h)
    return torch.stack(gate_up), torch.stack(down)


def initial_tokens(model: ModelConfig, seed: int, rank: int, seqs: int) -> torch.Tensor:
    """``[seqs]`` int64: the token each of a rank's sequences feeds into the first decode step."""
    g = _generator(seed, f"tokens/rank{rank}")
    return torch.randint(0, model.vocab_size, (seqs,), generator=g)


def initial_drafts(model: ModelConfig, seed: int, rank: int, seqs: int,
                   drafts: int) -> torch.Tensor:
    """``[seqs, drafts]`` int64: the draft tokens the first MTP verify step checks (standing in
    for the drafts a prefill's draft pass would have proposed)."""
    g = _generator(seed, f"drafts/rank{rank}")
    return torch.randint(0, model.vocab_size, (seqs, drafts), generator=g)


def initial_prompt(model: ModelConfig, seed: int, rank: int, seqs: int,
                   length: int) -> torch.Tensor:
    """``[seqs, length]`` int64: each of a rank's sequences' prompt (``--prefill``)."""
    g = _generator(seed, f"prompt/rank{rank}")
    return torch.randint(0, model.vocab_size, (seqs, length), generator=g)


def initial_cache(model: ModelConfig, seed: int, rank: int, layer: int, seqs: int,
                  cached: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent KV entries of the ``cached`` tokens before the first decode step (fp32).

    Stands in for a prefill: a normalised latent ``[seqs, cached, kv_lora]`` and an already
    rotated RoPE key ``[seqs, cached, rope]``, per rank and layer (GQA: the keys and values,
    ``[seqs, cached, KV * head_dim]`` each, :func:`cache_widths`).
    """
    c_width, pe_width = cache_widths(model)
    c = randn(seed, f"cache/rank{rank}/L{layer}/c", (seqs, cached, c_width))
    pe = randn(seed, f"cache/rank{rank}/L{layer}/pe", (seqs, cached, pe_width))
    return c, pe
