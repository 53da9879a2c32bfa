"""The runtime's grouped-query attention (GLM-4.5, Llama-4): the GQA forms of the ``rope``,
``norm`` (``attn.qk_norm``), ``attention_decode`` and ``attention_prefill`` op kinds, which
``epsim.runtime.ops`` calls for a model whose ``attention.kind`` is ``"gqa"``.

Values: ``qkv [t, (H + 2 KV) d]``, the queries of the ``H`` heads, then the keys and values of
the ``KV`` heads (vLLM's ``QKVParallelLinear`` layout); ``attn_v [t, H d]``. The KV cache is the
MLA one (:class:`epsim.runtime.kv_cache.LatentCache`) holding a token's keys where MLA keeps its
latent and its values where MLA keeps its RoPE key, ``KV d`` values each, so its storage
rounding and the reference's check of stored entries are the MLA ones.

What a query at position ``i`` sees (:func:`visible`): keys at ``j <= i``; in a sliding layer
``i - j < window``; in a chunked layer (Llama-4) the keys of its own chunk, ``j // chunk ==
i // chunk``. RoPE rotates the first ``rotary_fraction`` of each head (GLM-4.5: half), none in a
NoPE layer (Llama-4); Llama-4 Scout then normalises each query and key head (a weightless RMS
norm, which a rotation leaves unchanged, so the graph may run it before RoPE). Llama-4's NoPE layers scale queries by ``log(floor((i + 1) / floor_scale)
+ 1) * attn_scale + 1``, which is 1 below ``floor_scale`` (8192) tokens, the runtime's reach.
"""

from __future__ import annotations

from typing import Any

import torch

from epsim.model.opgraph import Op
from epsim.model.shapes import AttentionConfig

from . import kernels


def rotary_dim(a: AttentionConfig) -> int:
    """Dims of each head RoPE rotates: ``head_dim * rotary_fraction``."""
    return int(a.head_dim * a.rotary_fraction)


def split_qkv(a: AttentionConfig, qkv: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``qkv [t, (H + 2 KV) d]`` -> ``q [t, H, d]``, ``k [t, KV, d]``, ``v [t, KV, d]``."""
    t, d = qkv.shape[0], a.head_dim
    q_end, k_end = a.num_heads * d, (a.num_heads + a.num_kv_heads) * d
    return (qkv[:, :q_end].view(t, a.num_heads, d), qkv[:, q_end:k_end].view(t, -1, d),
            qkv[:, k_end:].view(t, -1, d))


def rotate(a: AttentionConfig, layer: int, qkv: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> torch.Tensor:
    """``qkv`` with the RoPE part of each query and key head rotated (unchanged in NoPE
    layers); ``cos`` / ``sin`` ``[t, rotary_dim]``."""
    if layer in a.nope_layers:
        return qkv
    q, k, v = split_qkv(a, qkv)
    rot = rotary_dim(a)

    def turn(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([kernels.apply_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)

    t = qkv.shape[0]
    return torch.cat([turn(q).reshape(t, -1), turn(k).reshape(t, -1), v.reshape(t, -1)], -1)


def qk_norm(a: AttentionConfig, qkv: torch.Tensor, weight: torch.Tensor | None,
            eps: float) -> torch.Tensor:
    """Per-head RMSNorm of the queries (``weight[0]``) and keys (``weight[1]``); ``weight``
    None: without weights (Llama-4's ``attn.qk_l2_norm``)."""
    q, k, v = split_qkv(a, qkv)
    t = qkv.shape[0]
    if weight is None:
        weight = torch.ones(2, a.head_dim, dtype=qkv.dtype, device=qkv.device)
    return torch.cat([kernels.rms_norm(q, weight[0], eps).reshape(t, -1),
                      kernels.rms_norm(k, weight[1], eps).reshape(t, -1), v.reshape(t, -1)], -1)


def visible(a: AttentionConfig, layer: int, q_pos: torch.Tensor,
            k_pos: torch.Tensor) -> torch.Tensor:
    """Whether a query at ``q_pos`` sees the key at ``k_pos`` in ``layer`` (broadcast)."""
    seen = k_pos <= q_pos
    kind = a.layer_type(layer)
    if kind == "sliding" and a.sliding_window:
        seen = seen & (q_pos - k_pos < a.sliding_window)
    if kind == "chunked" and a.chunk_size:
        seen = seen & (k_pos // a.chunk_size == q_pos // a.chunk_size)
    return seen


def attend(a: AttentionConfig, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           seen: torch.Tensor) -> torch.Tensor:
    """``q [t, H, d]`` over each query's ``keys`` / ``values [t, L, KV, d]`` where ``seen
    [t, L]``: ``[t, H d]``; each group of ``H / KV`` query heads shares a key/value head."""
    t, d = q.shape[0], a.head_dim
    group = a.num_heads // a.num_kv_heads
    qg = q.view(t, a.num_kv_heads, group, d)
    scores = torch.einsum("tkgd,tlkd->tkgl", qg, keys) * d ** -0.5
    scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
    return torch.einsum("tkgl,tlkd->tkgd", probs, values).reshape(t, -1)


def attention(rt: Any, op: Op, ins: dict[str, Any], st: Any) -> dict[str, Any]:
    """Decode or prefill GQA of one microbatch: store the new keys and values, attend (decode:
    over the cache; prefill, which has no cached prefix: over the prompt's fresh ones)."""
    a = rt.model.attention
    qkv = ins["qkv"]
    if rt.plan.fusion.fused_rope:  # the attention kernel rotates (no rope op in the graph)
        qkv = rotate(a, op.layer, qkv, st.cos, st.sin)
    q, k, v = split_qkv(a, qkv)
    t = st.num_tokens
    rt.cache.write(op.layer, st.seq_ids, st.positions, k.reshape(t, -1), v.reshape(t, -1),
                   op.draft)
    if op.kind == "attention_prefill":
        seqs = st.seqs.stop - st.seqs.start
        keys, vals = k.reshape(seqs, -1, k[0].numel()), v.reshape(seqs, -1, v[0].numel())
    else:
        upto = rt.cache.capacity if rt.static else int(st.positions.max()) + 1
        keys, vals = rt.cache.read(op.layer, st.seqs, upto, rt.dtype)
    if t != keys.shape[0]:  # several queries per sequence: each its sequence's entries
        rows = st.seq_ids - st.seqs.start
        keys, vals = keys.index_select(0, rows), vals.index_select(0, rows)
    length = keys.shape[1]
    seen = visible(a, op.layer, st.positions[:, None],
                   torch.arange(length, device=keys.device)[None, :])
    shape = (t, length, -1, a.head_dim)
    return {op.outputs[0]: attend(a, q, keys.view(shape), vals.view(shape), seen)}
