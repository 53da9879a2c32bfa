"""Torch implementations of the math behind each op kind (no communication, no state).

Shapes use: t tokens, H heads, r = kv_lora_rank, p = qk_rope_head_dim, n = qk_nope_head_dim,
v = v_head_dim, E experts, k = top_k, S local expert slots, I expert intermediate size.
Everything computes in the dtype of its inputs (fp32 for checks); the KV cache may be stored in
bf16 or fp8 and is widened before use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: largest finite float8_e4m3fn value
FP8_MAX = 448.0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``[t, d] -> [t, d]``: x / rms(x) * weight, computed in fp32."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * weight.float()).to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[..., 2I] -> [..., I]``: silu(gate) * up with gate the first half."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``[t] positions -> cos, sin [t, dim]`` (rotate-half layout)."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device)
                           / dim))
    angles = positions.to(torch.float64)[:, None] * inv[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [t, ..., dim]`` by per-token ``cos/sin [t, dim]`` (broadcast over middle axes)."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * c + rotated * s


# -- KV cache storage -------------------------------------------------------------------------

def quantize_rows(x: torch.Tensor, storage: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., d]`` -> (stored values, per-row fp32 scale ``[...]``).

    fp8 (float8_e4m3fn) stores ``x / scale`` with ``scale = amax / 448`` per row; wider dtypes
    store ``x`` with scale 1.
    """
    if storage == torch.float8_e4m3fn:
        amax = x.float().abs().amax(-1).clamp_min(1e-12)
        scale = amax / FP8_MAX
        return (x.float() / scale[..., None]).to(storage), scale
    return x.to(storage), torch.ones(x.shape[:-1], dtype=torch.float32, device=x.device)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[..., None]).to(dtype)


# -- attention ----------------------------------------------------------------------------------

def mla_decode_absorbed(q_lat: torch.Tensor, q_pe: torch.Tensor, c_cache: torch.Tensor,
                        pe_cache: torch.Tensor, lengths: torch.Tensor,
                        softmax_scale: float, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA decode attention over a latent KV cache (one new token per sequence).

    Args:
        q_lat: ``[t, H, r]`` queries moved into the latent space (q_nope @ W_UK).
        q_pe: ``[t, H, p]`` rotated RoPE part of the queries.
        c_cache: ``[t, L, r]`` latents of each sequence's cache (widened), L >= lengths.
        pe_cache: ``[t, L, p]`` rotated RoPE keys.
        lengths: ``[t]`` valid cache entries per sequence (the new token included).
        softmax_scale: 1/sqrt(n + p).
        keep: ``[t, L]`` the entries each query may attend (DSA's top-k), None for all.

    Returns:
        ``[t, H, r]`` attention output in the latent space (multiply by W_UV next).
    """
    # scores over the whole buffer, masked past each sequence's length (static shapes)
    scores = torch.einsum("thr,tlr->thl", q_lat, c_cache)
    scores = scores + torch.einsum("thp,tlp->thl", q_pe, pe_cache)
    scores = scores * softmax_scale
    positions = torch.arange(c_cache.shape[1], device=c_cache.device)
    valid = positions[None, :] < lengths[:, None]
    if keep is not None:
        valid = valid & keep
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q_lat.dtype)
    return torch.einsum("thl,tlr->thr", probs, c_cache)


def indexer_keep(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                 lengths: torch.Tensor, topk: int) -> torch.Tensor:
    """DSA's lightning indexer: which cached entries each query keeps.

    ``q [t, H, d]`` the indexer's query heads, ``weights [t, H]`` their weights (scales
    folded in), ``keys [t, L, d]`` each query's sequence's index keys, ``lengths [t]`` its
    valid entries (the query's own included). Scores ``sum_h w_h * relu(q_h . k_l)`` and keeps
    the ``topk`` best valid entries, the earlier of equal scores first: ``[t, L]`` bool.
    """
    scores = torch.einsum("thd,tld->thl", q.float(), keys.float()).relu()
    scores = torch.einsum("thl,th->tl", scores, weights.float())
    positions = torch.arange(keys.shape[1], device=keys.device)
    valid = positions[None, :] < lengths[:, None]
    # ties (keys every head's ReLU zeroes score exactly 0) go to the earlier entry, as a stable
    # sort leaves them: a rule the dense reference can follow (+ 0.0 turns -0.0 into 0.0)
    scores = scores.masked_fill(~valid, float("-inf")) + 0.0
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    chosen = order[:, :min(topk, keys.shape[1])]
    keep = torch.zeros_like(valid).scatter_(1, chosen, True)
    return keep & valid


# -- routing ------------------------------------------------------------------------------------

def route_grouped_sigmoid(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
                          topk_group: int, scaling: float,
                          normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 ``noaux_tc`` routing: group-limited top-k over sigmoid scores.

    Args:
        logits: ``[t, E]`` router logits.
        bias: ``[E]`` e_score_correction_bias; it steers the choice but not the weights.
        top_k / n_group / topk_group: keep the ``topk_group`` best groups (a group's score is
            the sum of its two best biased scores), then the ``top_k`` best experts inside them.
        scaling: routed_scaling_factor, folded into the weights.
        normalize: renormalise the chosen weights to sum to one first.

    Returns:
        ``ids [t, k]`` int64 logical experts and ``weights [t, k]`` fp32.
    """
    t, experts = logits.shape
    scores = torch.sigmoid(logits.float())
    biased = scores + bias.float()[None, :]
    if n_group > 1:
        # Step 1: score each group by its two best biased experts, keep the best groups
        grouped = biased.view(t, n_group, experts // n_group)
        group_scores = grouped.topk(min(2, experts // n_group), dim=-1).values.sum(-1)
        keep = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros(t, n_group, dtype=torch.bool, device=logits.device)
        group_mask.scatter_(1, keep, True)
        expert_mask = group_mask[:, :, None].expand(t, n_group, experts // n_group)
        biased = biased.masked_fill(~expert_mask.reshape(t, experts), float("-inf"))
    # Step 2: the best experts among the kept groups; weights come from the unbiased scores
    ids = biased.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * scaling


# -- routed experts -------------------------------------------------------------------------

@dataclass
class SortedPairs:
    """The (row, choice) pairs a rank computes, sorted by local slot.

    rows: ``[P]`` row of each pair; weights: ``[P]`` its routing weight; counts: pairs per slot
    (a host list: the dynamic backend's segment lengths); num_rows: N.
    """

    rows: torch.Tensor
    weights: torch.Tensor
    counts: list[int]
    num_rows: int


def sort_pairs(local: torch.Tensor, weights: torch.Tensor, slots: int) -> SortedPairs:
    """``local [N, k]`` local slot per choice (-1: not here) -> pairs sorted by slot."""
    rows, cols = (local >= 0).nonzero(as_tuple=True)
    chosen = local[rows, cols]
    order = torch.argsort(chosen, stable=True)
    rows, cols, chosen = rows[order], cols[order], chosen[order]
    counts = torch.bincount(chosen, minlength=slots).tolist()
    return SortedPairs(rows, weights[rows, cols], counts, local.shape[0])


def sorted_gate_up(x: torch.Tensor, pairs: SortedPairs, gate_up: torch.Tensor) -> torch.Tensor:
    """``[P, 2I]``: one gate/up matmul per non-empty slot segment."""
    xs = x.index_select(0, pairs.rows)
    out = xs.new_empty(xs.shape[0], gate_up.shape[2])
    start = 0
    for slot, count in enumerate(pairs.counts):
        if count:
            out[start:start + count] = xs[start:start + count] @ gate_up[slot]
            start += count
    return out


def sorted_down(act: torch.Tensor, pairs: SortedPairs, down: torch.Tensor) -> torch.Tensor:
    """``[P, I] -> [N, h]``: one down matmul per segment, weighted, summed per row."""
    ys = act.new_empty(act.shape[0], down.shape[2])
    start = 0
    for slot, count in enumerate(pairs.counts):
        if count:
            ys[start:start + count] = act[start:start + count] @ down[slot]
            start += count
    out = act.new_zeros(pairs.num_rows, down.shape[2])
    return out.index_add_(0, pairs.rows, ys * pairs.weights[:, None].to(ys.dtype))


def moe_sorted(x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor,
               gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The dynamic torch fused-MoE backend: pairs sorted by expert, one matmul per segment.

    Args:
        x: ``[N, h]`` token rows this rank computes for.
        local: ``[N, k]`` local slot of each row's choice, -1 where the slot lives elsewhere.
        weights: ``[N, k]`` routing weights (routed scaling included).
        gate_up / down: ``[S, h, 2I]`` / ``[S, I, h]`` the rank's slots.

    Returns:
        ``[N, h]``: per row, the weighted sum of its local experts' outputs.
    """
    pairs = sort_pairs(local, weights, gate_up.shape[0])
    return sorted_down(silu_and_mul(sorted_gate_up(x, pairs, gate_up)), pairs, down)


def masked_gate_up(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """``[N, h] -> [S, N, 2I]``: every slot over every row (static shapes)."""
    return torch.einsum("nh,shi->sni", x, gate_up)


def masked_down(act: torch.Tensor, local: torch.Tensor, weights: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """``[S, N, I] -> [N, h]``: rows not routed to a slot get weight zero."""
    slots = down.shape[0]
    onehot = local[:, :, None] == torch.arange(slots, device=local.device)[None, None, :]
    per_slot = (onehot * weights[:, :, None].to(act.dtype)).sum(1)  # [N, S]
    ys = torch.einsum("sni,sih->snh", act, down)
    return torch.einsum("snh,ns->nh", ys, per_slot)


def moe_masked(x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor,
               gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The static-shape torch fused-MoE backend (graph capture): every slot runs over every row
    as one batched matmul and rows not routed to a slot get weight zero. Same contract as
    :func:`moe_sorted`; no host synchronisation and no data-dependent shapes."""
    return masked_down(silu_and_mul(masked_gate_up(x, gate_up)), local, weights, down)


def moe_per_token(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The naive baseline: a loop over tokens and their chosen experts (``ids`` index the
    stacked weights directly). Used by the dense reference and the MoE benchmark."""
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[i, j])
            out[i] += weights[i, j].to(x.dtype) * (silu_and_mul(x[i] @ gate_up[e]) @ down[e])
    return out
