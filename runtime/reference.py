"""The dense single-process reference: every rank's sequences through one unsharded model.

Written independently of the executor on purpose: MLA in its plain (non-absorbed) form, with K
and V expanded per head from the cached latent; routing as a per-token loop over the groups; the
routed experts as a per-token loop over all logical experts (no placement, no dispatch). It shares
only the weights, the initial tokens/cache (``epsim.runtime.weights``), RMSNorm/RoPE/SiLU primitives and
the KV storage rounding, so a match checks the runtime's absorption, routing, placement remap,
dispatch/combine and fused-MoE backends.

The KV cache is where the two may legitimately part: storing a latent rounds it to the cache's
dtype, and where a value sits at a rounding midpoint (within the last bits in which the runtime's
fp32 sums and the reference's differ) the two round it to neighbouring values, a whole FP8 step
(up to 1/8 of the value) apart, which the next decode step reads. So ``--check`` also takes every
rank's stored cache: the reference checks each stored entry against its own value
(:func:`rounding_error`: its own rounding, or the other neighbour of a value at their midpoint) and
then decodes from the entries the runtime stored, so each step is compared from the same cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epsim.model.config import ModelConfig
from epsim.model.ids import NO_LAYER, weight_key

from . import kernels
from . import weights as W
from .kv_cache import KV_STORAGE


@dataclass
class ReferenceStep:
    """One step for all ranks: ``logits [R*B, vocab]``, ``next_tokens [R*B]``, ``hidden [R*B, h]``
    (rank r's sequences are rows ``r*B .. (r+1)*B - 1``)."""

    logits: torch.Tensor
    next_tokens: torch.Tensor
    hidden: torch.Tensor


@dataclass
class ReferenceRun:
    """The reference's steps and its check of the runtime's KV cache.

    prefill: the prefill step, or None (the cache held drawn entries).
    decode: the decode steps.
    kv_cache_err: the largest :func:`rounding_error` of a stored cache entry.
    """

    prefill: ReferenceStep | None
    decode: list[ReferenceStep]
    kv_cache_err: float


@dataclass
class StoredCache:
    """What the ranks' caches held after the run, widened to fp32, every rank's sequences in
    rank order: ``c [layers, seqs, capacity, r]`` and ``pe [layers, seqs, capacity, p]``."""

    c: torch.Tensor
    pe: torch.Tensor


def rounding_error(exact: torch.Tensor, stored: torch.Tensor, storage: torch.dtype) -> float:
    """How far ``stored`` (a cache entry as stored and widened) is from being ``exact`` rounded
    to ``storage``, as a share of each row's largest magnitude (the scale a row is stored with).

    Per element the error is the smaller of ``|stored - own|`` (``own``: the reference's own
    rounding of ``exact``) and ``|exact - (stored + own) / 2|``: the second is small only when
    ``stored`` is the other neighbour of a value that sits at the midpoint of the two, where fp32
    sums that differ in their last bits may round either way. A wrong entry is far from both.
    """
    qe, se = kernels.quantize_rows(exact, storage)
    own = kernels.dequantize_rows(qe, se, torch.float64)
    exact, stored = exact.double(), stored.double()
    scale = exact.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    same = (stored - own).abs()
    flipped = (exact - (stored + own) / 2).abs()
    return (torch.minimum(same, flipped) / scale).max().item() if exact.numel() else 0.0


def route_reference(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
                    topk_group: int, scaling: float, normalize: bool
                    ) -> tuple[list[list[int]], list[list[float]]]:
    """Group-limited sigmoid routing, one token at a time in plain Python."""
    ids_out, w_out = [], []
    per_group = logits.shape[1] // n_group
    for row in logits.tolist():
        scores = [1.0 / (1.0 + torch.exp(torch.tensor(-v, dtype=torch.float64)).item())
                  for v in row]
        biased = [s + b for s, b in zip(scores, bias.tolist(), strict=True)]
        group_score = []
        for g in range(n_group):
            members = sorted(biased[g * per_group:(g + 1) * per_group], reverse=True)
            group_score.append(sum(members[:min(2, per_group)]))
        groups = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        allowed = [e for g in groups for e in range(g * per_group, (g + 1) * per_group)]
        chosen = sorted(allowed, key=lambda e: -biased[e])[:top_k]
        weights = [scores[e] for e in chosen]
        if normalize:
            total = sum(weights) + 1e-20
            weights = [w / total for w in weights]
        ids_out.append(chosen)
        w_out.append([w * scaling for w in weights])
    return ids_out, w_out


def reference_decode(model: ModelConfig, seed: int, world: int, batch: int, context: int,
                     steps: int, kv_dtype: str, prefill: bool = False,
                     *, stored: StoredCache) -> ReferenceRun:
    """Decode ``steps`` steps of ``world * batch`` sequences in fp32, one process, no sharding.

    With ``prefill`` the cache is filled by running each sequence's prompt (``context - 1``
    tokens) first, whose step is returned too; otherwise it holds the drawn initial entries.
    ``stored`` is the runtime's cache after the run: every entry the reference would store is
    checked against the runtime's (:func:`rounding_error`) and the runtime's is kept, so each
    step is compared from the same cache.

    Returns:
        A :class:`ReferenceRun`.
    """
    a, moe = model.attention, model.moe
    H, n, p, r, v = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank, a.v_head_dim
    eps = model.rms_norm_eps
    w = W.dense_weights(model, seed)
    experts = {layer: W.expert_weights(model, seed, layer, range(moe.num_experts))
               for layer in model.moe_layers}
    seqs = world * batch
    storage = KV_STORAGE[kv_dtype]

    def weight(layer: int, name: str) -> torch.Tensor:
        return w[weight_key(layer, name)]

    cap = context - 1 + steps
    # the cache as stored (rounded to the storage dtype), kept widened to fp32
    c_cache = torch.zeros(model.num_layers, seqs, cap, r)
    pe_cache = torch.zeros(model.num_layers, seqs, cap, p)

    kv_err = 0.0

    def store(layer: int, pos: slice, c: torch.Tensor, pe: torch.Tensor) -> None:
        nonlocal kv_err
        # the runtime's entries, once checked to be a rounding of the reference's values
        got_c, got_pe = stored.c[layer, :, pos], stored.pe[layer, :, pos]
        kv_err = max(kv_err, rounding_error(c, got_c, storage),
                     rounding_error(pe, got_pe, storage))
        c_cache[layer, :, pos], pe_cache[layer, :, pos] = got_c, got_pe

    def forward(tokens: torch.Tensor, start: int, causal_prompt: bool) -> ReferenceStep:
        """``tokens [S, T]`` at positions ``start ..``; decode (T = 1) attends over the stored
        cache, a prompt attends causally over its own fresh K/V and only stores the cache."""
        T = tokens.shape[1]
        rows = seqs * T
        positions = torch.arange(start, start + T).repeat(seqs)
        cos, sin = kernels.rope_cos_sin(positions, p, model.rope_theta, torch.float32)
        x = weight(NO_LAYER, "embed")[tokens.reshape(-1)]
        residual = None
        for layer in range(model.num_layers):
            residual = x if residual is None else residual + x
            h = kernels.rms_norm(residual, weight(layer, "attn_norm"), eps)
            # -- MLA, plain form: per-head K and V expanded from the latent ----------------
            if a.q_lora_rank:
                q_a = kernels.rms_norm(h @ weight(layer, "attn.q_a"),
                                       weight(layer, "attn.q_a_norm"), eps)
                q = q_a @ weight(layer, "attn.q_b")
            else:
                q = h @ weight(layer, "attn.q_proj")
            q = q.view(rows, H, n + p)
            q_nope, q_pe = q[..., :n], kernels.apply_rope(q[..., n:], cos, sin)
            kv = h @ weight(layer, "attn.kv_a")
            c_new = kernels.rms_norm(kv[:, :r], weight(layer, "attn.kv_a_norm"), eps)
            pe_new = kernels.apply_rope(kv[:, r:], cos, sin)
            store(layer, slice(start, start + T), c_new.view(seqs, T, r), pe_new.view(seqs, T, p))
            if causal_prompt:
                c_all, pe_all = c_new.view(seqs, T, r), pe_new.view(seqs, T, p)
            else:
                c_all = c_cache[layer, :, :start + T]
                pe_all = pe_cache[layer, :, :start + T]
            kv_b = weight(layer, "attn.kv_b")  # [H, n + v, r]
            k_nope = torch.einsum("slr,hdr->slhd", c_all, kv_b[:, :n])
            values = torch.einsum("slr,hdr->slhd", c_all, kv_b[:, n:])
            qn, qp = q_nope.view(seqs, T, H, n), q_pe.view(seqs, T, H, p)
            scores = (torch.einsum("sqhd,slhd->shql", qn, k_nope)
                      + torch.einsum("sqhd,sld->shql", qp, pe_all)) * (n + p) ** -0.5
            if causal_prompt:
                mask = torch.ones(T, T, dtype=torch.bool).tril()
                scores = scores.masked_fill(~mask, float("-inf"))
            attn = torch.einsum("shql,slhd->sqhd", torch.softmax(scores, -1), values)
            attn_out = attn.reshape(rows, H * v) @ weight(layer, "attn.o_proj")
            residual = residual + attn_out
            h = kernels.rms_norm(residual, weight(layer, "ffn_norm"), eps)
            # -- FFN ---------------------------------------------------------------------
            if model.is_moe_layer(layer):
                ids, weights = route_reference(
                    h @ weight(layer, "moe.router"), weight(layer, "moe.router.bias"), moe.top_k,
                    moe.n_group, moe.topk_group, moe.routed_scaling_factor, moe.norm_topk_prob)
                gate_up, down = experts[layer]
                routed = kernels.moe_per_token(h, torch.tensor(ids), torch.tensor(weights),
                                               gate_up, down)
                x = routed
                if moe.num_shared_experts:
                    shared = kernels.silu_and_mul(h @ weight(layer, "moe.shared.gate_up"))
                    x = routed + shared @ weight(layer, "moe.shared.down")
            else:
                act = kernels.silu_and_mul(h @ weight(layer, "mlp.gate_up"))
                x = act @ weight(layer, "mlp.down")
        # each sequence's last token feeds the LM head
        last = (residual + x).view(seqs, T, -1)[:, -1]
        hidden = kernels.rms_norm(last, weight(NO_LAYER, "final_norm"), eps)
        logits = hidden @ weight(NO_LAYER, "lm_head")
        return ReferenceStep(logits, logits.argmax(-1), hidden)

    first: ReferenceStep | None = None
    if prefill:
        prompts = torch.cat([W.initial_prompt(model, seed, rk, batch, context - 1)
                             for rk in range(world)])
        first = forward(prompts, 0, causal_prompt=True)
        tokens = first.next_tokens
    else:
        tokens = torch.cat([W.initial_tokens(model, seed, rk, batch) for rk in range(world)])
        for layer in range(model.num_layers):
            drawn = [W.initial_cache(model, seed, rk, layer, batch, context - 1)
                     for rk in range(world)]
            store(layer, slice(0, context - 1), torch.cat([c for c, _ in drawn]),
                  torch.cat([pe for _, pe in drawn]))
    out: list[ReferenceStep] = []
    for step in range(steps):
        result = forward(tokens[:, None], context - 1 + step, causal_prompt=False)
        tokens = result.next_tokens
        out.append(result)
    return ReferenceRun(first, out, kv_err)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|`` (fp32/fp64): the error measure of ``--check``."""
    got, want = got.double(), want.double()
    scale = want.abs().max().item()
    return (got - want).abs().max().item() / (scale if scale > 0 else 1.0)
