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

from dataclasses import dataclass, field

import torch

from epsim.model.config import ModelConfig
from epsim.model.ids import NO_LAYER, weight_key
from epsim.model.mtp import draft_layer, runtime_accepted

from . import kernels, lifecycle
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
    decode: the decode steps (under MTP a row per verified token, sequence by sequence).
    kv_cache_err: the largest :func:`rounding_error` of a stored cache entry.
    drafts: under MTP, each step's draft passes.
    """

    prefill: ReferenceStep | None
    decode: list[ReferenceStep]
    kv_cache_err: float
    drafts: list[DraftStep] = field(default_factory=list)


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


class StepWrites:
    """The cache entries the ranks wrote in one step, as stored and widened, every rank's rows
    in rank order (under MTP a later step overwrites a rejected draft's entries, so the final
    cache cannot stand in for them): ``{(layer, tag): (seq [n], pos [n], c [n, r], pe [n, p])}``
    (``tag``: the draft pass writing, None for the main model)."""

    def __init__(self, writes: dict[tuple[int, int | None], tuple[torch.Tensor, ...]]) -> None:
        self.writes = writes

    def lookup(self, layer: int, tag: int | None, rows: torch.Tensor, cols: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        seq, pos, c, pe = self.writes[(layer, tag)]
        where = {(int(s), int(q)): i for i, (s, q) in enumerate(zip(seq, pos, strict=True))}
        index = torch.tensor([where[(int(s), int(q))] for s, q in zip(rows, cols, strict=True)])
        return c[index], pe[index]


@dataclass
class DraftStep:
    """An MTP step's draft passes for all ranks: ``logits`` per pass ``[R*B, vocab]`` and the
    ``tokens [R*B, mtp]`` proposed."""

    logits: list[torch.Tensor]
    tokens: torch.Tensor


class _Dense:
    """The unsharded model over every rank's sequences, its KV cache as the ranks stored it."""

    def __init__(self, model: ModelConfig, seed: int, seqs: int, cap: int, kv_dtype: str,
                 stored: StoredCache, draft: bool) -> None:
        self.m, self.a, moe = model, model.attention, model.moe
        self.w = W.dense_weights(model, seed, draft=draft)
        layers = list(model.moe_layers) + ([draft_layer(model)] if draft and model.mtp_moe
                                           else [])
        self.experts = {layer: W.expert_weights(model, seed, layer, range(moe.num_experts))
                        for layer in layers}
        self.seqs, self.storage, self.stored = seqs, KV_STORAGE[kv_dtype], stored
        n_layers = model.num_layers + (1 if draft else 0)
        # the cache as stored (rounded to the storage dtype), kept widened to fp32
        c_width, pe_width = W.cache_widths(model)  # GQA: keys and values
        self.c_cache = torch.zeros(n_layers, seqs, cap, c_width)
        self.pe_cache = torch.zeros(n_layers, seqs, cap, pe_width)
        self.kv_err = 0.0
        self.writes: StepWrites | None = None  # this step's (MTP), else the final cache
        # DSA's index keys, as the indexer caches them (unquantised, as the runtime keeps them)
        self.i_cache = torch.zeros(n_layers, seqs, cap, self.a.index_head_dim)

    def weight(self, layer: int, name: str) -> torch.Tensor:
        return self.w[weight_key(layer, name)]

    def store(self, layer: int, pos: torch.Tensor, c: torch.Tensor, pe: torch.Tensor,
              tag: int | None = None) -> None:
        """Entries at ``pos [S, T]`` of every sequence: the runtime's, once checked to be a
        rounding of the reference's values ``c`` / ``pe`` (``[S * T, .]``)."""
        rows = torch.arange(pos.shape[0]).repeat_interleave(pos.shape[1])
        cols = pos.reshape(-1)
        if self.writes is None:
            got_c, got_pe = self.stored.c[layer, rows, cols], self.stored.pe[layer, rows, cols]
        else:
            got_c, got_pe = self.writes.lookup(layer, tag, rows, cols)
        self.kv_err = max(self.kv_err, rounding_error(c, got_c, self.storage),
                          rounding_error(pe, got_pe, self.storage))
        self.c_cache[layer, rows, cols], self.pe_cache[layer, rows, cols] = got_c, got_pe

    def layer(self, layer: int, x: torch.Tensor, residual: torch.Tensor | None,
              pos: torch.Tensor, causal_prompt: bool, moe_ffn: bool,
              tag: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer over ``x [S * T, h]`` at positions ``pos [S, T]`` -> (its FFN
        output, the residual stream); decode attends over the cache up to each token, a prompt
        causally over its own fresh K/V (it only stores the cache)."""
        eps = self.m.rms_norm_eps
        residual = x if residual is None else residual + x
        h = kernels.rms_norm(residual, self.weight(layer, "attn_norm"), eps)
        attend = self.mla if self.a.kind == "mla" else self.gqa
        residual = residual + attend(layer, h, pos, causal_prompt, tag)
        h = kernels.rms_norm(residual, self.weight(layer, "ffn_norm"), eps)
        return self.ffn(layer, h, moe_ffn), residual

    def mla(self, layer: int, h: torch.Tensor, pos: torch.Tensor, causal_prompt: bool,
            tag: int | None) -> torch.Tensor:
        """MLA in its plain form (per-head K and V expanded from the latent): ``[S * T, h]``."""
        a, eps = self.a, self.m.rms_norm_eps
        H, n, p, r = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank
        S, T = pos.shape
        rows = S * T
        cos, sin = kernels.rope_cos_sin(pos.reshape(-1), p, self.m.rope_theta, torch.float32)
        q_a = h
        if a.q_lora_rank:
            q_a = kernels.rms_norm(h @ self.weight(layer, "attn.q_a"),
                                   self.weight(layer, "attn.q_a_norm"), eps)
            q = q_a @ self.weight(layer, "attn.q_b")
        else:
            q = h @ self.weight(layer, "attn.q_proj")
        q = q.view(rows, H, n + p)
        q_nope, q_pe = q[..., :n], kernels.apply_rope(q[..., n:], cos, sin)
        kv = h @ self.weight(layer, "attn.kv_a")
        c_new = kernels.rms_norm(kv[:, :r], self.weight(layer, "attn.kv_a_norm"), eps)
        pe_new = kernels.apply_rope(kv[:, r:], cos, sin)
        self.store(layer, pos, c_new, pe_new, tag)
        if causal_prompt:
            c_all, pe_all = c_new.view(S, T, r), pe_new.view(S, T, p)
        else:
            upto = int(pos.max()) + 1
            c_all, pe_all = self.c_cache[layer, :, :upto], self.pe_cache[layer, :, :upto]
        kv_b = self.weight(layer, "attn.kv_b")  # [H, n + v, r]
        k_nope = torch.einsum("slr,hdr->slhd", c_all, kv_b[:, :n])
        values = torch.einsum("slr,hdr->slhd", c_all, kv_b[:, n:])
        qn, qp = q_nope.view(S, T, H, n), q_pe.view(S, T, H, p)
        scores = (torch.einsum("sqhd,slhd->shql", qn, k_nope)
                  + torch.einsum("sqhd,sld->shql", qp, pe_all)) * (n + p) ** -0.5
        if causal_prompt:
            mask = torch.ones(T, T, dtype=torch.bool).tril()
        else:  # each token sees the cache up to its own position
            mask = (torch.arange(c_all.shape[1])[None, None, :] <= pos[:, :, None])[:, None]
        if a.sparse:  # DSA: only the entries the indexer keeps
            mask = mask & self.indexer_keep(layer, h, q_a, pos, cos, sin, causal_prompt)[:, None]
        scores = scores.masked_fill(~mask, float("-inf"))
        attn = torch.einsum("shql,slhd->sqhd", torch.softmax(scores, -1), values)
        return attn.reshape(rows, -1) @ self.weight(layer, "attn.o_proj")

    def sees(self, layer: int, i: int, j: int) -> bool:
        """Whether the query at position ``i`` attends the key at ``j`` in ``layer``."""
        a = self.a
        kind = a.layer_type(layer)
        if kind == "sliding" and a.sliding_window and i - j >= a.sliding_window:
            return False
        if kind == "chunked" and a.chunk_size and j // a.chunk_size != i // a.chunk_size:
            return False
        return j <= i

    def gqa(self, layer: int, h: torch.Tensor, pos: torch.Tensor, causal_prompt: bool,
            tag: int | None) -> torch.Tensor:
        """GQA with each key/value head repeated for its query heads: ``[S * T, h]``."""
        a, eps = self.a, self.m.rms_norm_eps
        H, KV, d = a.num_heads, a.num_kv_heads, a.head_dim
        S, T = pos.shape
        qkv = h @ self.weight(layer, "attn.qkv_proj")
        if a.bias:
            qkv = qkv + self.weight(layer, "attn.qkv_proj.bias")
        q = qkv[:, :H * d].reshape(S * T, H, d)
        k = qkv[:, H * d:(H + KV) * d].reshape(S * T, KV, d)
        v = qkv[:, (H + KV) * d:].reshape(S * T, KV, d)
        if a.qk_norm:
            norm_w = self.weight(layer, "attn.qk_norm")
            q, k = kernels.rms_norm(q, norm_w[0], eps), kernels.rms_norm(k, norm_w[1], eps)
        if layer not in a.nope_layers:
            rot = int(d * a.rotary_fraction)
            cos, sin = kernels.rope_cos_sin(pos.reshape(-1), rot, self.m.rope_theta,
                                            torch.float32)
            q = torch.cat([kernels.apply_rope(q[..., :rot], cos, sin), q[..., rot:]], dim=-1)
            k = torch.cat([kernels.apply_rope(k[..., :rot], cos, sin), k[..., rot:]], dim=-1)
            if a.qk_l2_norm:  # Llama-4 Scout: after RoPE, each head scaled to unit RMS
                q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps)
                k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps)
        self.store(layer, pos, k.reshape(S * T, -1), v.reshape(S * T, -1), tag)
        if causal_prompt:
            keys, values = k.view(S, T, KV, d), v.view(S, T, KV, d)
        else:
            upto = int(pos.max()) + 1
            keys = self.c_cache[layer, :, :upto].view(S, upto, KV, d)
            values = self.pe_cache[layer, :, :upto].view(S, upto, KV, d)
        keys = keys.repeat_interleave(H // KV, dim=2)
        values = values.repeat_interleave(H // KV, dim=2)
        scores = torch.einsum("sqhd,slhd->shql", q.view(S, T, H, d), keys) * d ** -0.5
        seen = torch.tensor([[[self.sees(layer, int(pos[s, t]), j)
                               for j in range(keys.shape[1])] for t in range(T)]
                             for s in range(S)])
        scores = scores.masked_fill(~seen[:, None], float("-inf"))
        attn = torch.einsum("shql,slhd->sqhd", torch.softmax(scores, -1), values)
        out = attn.reshape(S * T, -1) @ self.weight(layer, "attn.o_proj")
        return out + self.weight(layer, "attn.o_proj.bias") if a.o_bias else out

    def indexer_keep(self, layer: int, h: torch.Tensor, q_a: torch.Tensor, pos: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, causal_prompt: bool) -> torch.Tensor:
        """DSA's indexer, one query at a time: ``[S, T, L]`` the cache entries each query of
        ``pos [S, T]`` keeps (its ``index_topk`` best by ``sum_h w_h relu(q_h . k)``)."""
        a = self.a
        heads, dim, p = a.index_n_heads, a.index_head_dim, a.qk_rope_head_dim
        S, T = pos.shape

        def rotate_front(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([kernels.apply_rope(x[..., :p], cos, sin), x[..., p:]], dim=-1)

        q = rotate_front((q_a @ self.weight(layer, "attn.indexer.wq_b")).view(S * T, heads, dim))
        k = torch.nn.functional.layer_norm(
            h @ self.weight(layer, "attn.indexer.wk"), (dim,),
            self.weight(layer, "attn.indexer.k_norm"),
            self.weight(layer, "attn.indexer.k_norm.bias"), 1e-6)
        k = rotate_front(k)
        w = h @ self.weight(layer, "attn.indexer.weights_proj") * (heads * dim) ** -0.5
        self.i_cache[layer, torch.arange(S).repeat_interleave(T), pos.reshape(-1)] = k
        keys = k.view(S, T, dim) if causal_prompt else self.i_cache[layer, :, :int(pos.max()) + 1]
        keep = torch.zeros(S, T, keys.shape[1], dtype=torch.bool)
        for s in range(S):
            for t in range(T):
                row, limit = s * T + t, (t if causal_prompt else int(pos[s, t])) + 1
                scores = (torch.relu(keys[s, :limit] @ q[row].T) * w[row]).sum(-1) + 0.0
                # equal scores: the earlier entry first (Python's sort is stable)
                chosen = sorted(range(limit), key=lambda j: -float(scores[j]))[:a.index_topk]
                keep[s, t, chosen] = True
        return keep

    def ffn(self, layer: int, h: torch.Tensor, moe_ffn: bool) -> torch.Tensor:
        moe = self.m.moe
        if not moe_ffn:
            act = kernels.silu_and_mul(h @ self.weight(layer, "mlp.gate_up"))
            return act @ self.weight(layer, "mlp.down")
        # no score-correction bias (Llama-4): routed as with a zero one
        bias = self.w.get(weight_key(layer, "moe.router.bias"), torch.zeros(moe.num_experts))
        ids, weights = route_reference(
            h @ self.weight(layer, "moe.router"), bias, moe.top_k, moe.n_group,
            moe.topk_group, moe.routed_scaling_factor, moe.norm_topk_prob)
        gate_up, down = self.experts[layer]
        if moe.weight_on_input:  # Llama-4: each expert reads the token scaled by its weight
            x = torch.zeros_like(h)
            for i, (chosen, ws) in enumerate(zip(ids, weights, strict=True)):
                for e, wt in zip(chosen, ws, strict=True):
                    x[i] += kernels.silu_and_mul((h[i] * wt) @ gate_up[e]) @ down[e]
        else:
            x = kernels.moe_per_token(h, torch.tensor(ids), torch.tensor(weights), gate_up,
                                      down)
        if moe.num_shared_experts:
            shared = kernels.silu_and_mul(h @ self.weight(layer, "moe.shared.gate_up"))
            x = x + shared @ self.weight(layer, "moe.shared.down")
        return x

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, causal_prompt: bool,
                every_row: bool) -> ReferenceStep:
        """The main model over ``tokens [S, T]`` at ``pos [S, T]``: the LM head over each
        sequence's last token, or (``every_row``, an MTP verify step) over every token."""
        m = self.m
        x = self.weight(NO_LAYER, "embed")[tokens.reshape(-1)]
        residual = None
        for layer in range(m.num_layers):
            x, residual = self.layer(layer, x, residual, pos, causal_prompt,
                                     m.is_moe_layer(layer))
            lifecycle.progress()  # rank 0 checks while its peers wait: its work shows
        out = (residual + x).view(*tokens.shape, -1)
        rows = out.reshape(-1, out.shape[-1]) if every_row else out[:, -1]
        hidden = kernels.rms_norm(rows, self.weight(NO_LAYER, "final_norm"), m.rms_norm_eps)
        logits = hidden @ self.weight(NO_LAYER, "lm_head")
        return ReferenceStep(logits, logits.argmax(-1), hidden)

    def drafts(self, inputs: torch.Tensor, pos: torch.Tensor, accepted: torch.Tensor,
               main: ReferenceStep) -> DraftStep:
        """The MTP draft passes after a verify step of ``inputs [S, 1 + N]`` at ``pos`` with
        ``accepted [S]`` drafts: pass 0 over every verified position (each one's next token,
        the main model's where it was not accepted), pass k at the last accepted + k."""
        m, eps = self.m, self.m.rms_norm_eps
        S, q = inputs.shape
        d = draft_layer(m)
        sampled = main.next_tokens.view(S, q)
        follow = torch.arange(q)[None, :] < accepted[:, None]
        tokens = torch.where(follow, inputs.roll(-1, dims=1), sampled).reshape(-1)
        hidden, at, logits, proposed = main.hidden, pos, [], []
        for k in range(q - 1):
            e = kernels.rms_norm(self.weight(d, "mtp.embed")[tokens],
                                 self.weight(d, "mtp.enorm"), eps)
            hh = kernels.rms_norm(hidden, self.weight(d, "mtp.hnorm"), eps)
            x = torch.cat([e, hh], dim=-1) @ self.weight(d, "mtp.eh_proj")
            x, residual = self.layer(d, x, None, at, False, m.mtp_moe, tag=k)
            out = residual + x
            if k == 0:  # each sequence's last accepted row goes on
                out = out.view(S, q, -1)[torch.arange(S), accepted]
            head = kernels.rms_norm(out, self.weight(d, "mtp.head_norm"), eps)
            logits.append(head @ self.weight(d, "mtp.lm_head"))
            tokens = logits[-1].argmax(-1)
            proposed.append(tokens)
            hidden, at = out, (pos[:, 0] + accepted + k + 1)[:, None]
        return DraftStep(logits, torch.stack(proposed, dim=1))


def reference_decode(model: ModelConfig, seed: int, world: int, batch: int, context: int,
                     steps: int, kv_dtype: str, prefill: bool = False,
                     *, stored: StoredCache, mtp: int = 0, acceptance: float = 0.0,
                     writes: list[StepWrites] | None = None) -> ReferenceRun:
    """Decode ``steps`` steps of ``world * batch`` sequences in fp32, one process, no sharding.

    With ``prefill`` the cache is filled by running each sequence's prompt (``context - 1``
    tokens) first, whose step is returned too; otherwise it holds the drawn initial entries.
    ``stored`` is the runtime's cache after the run: every entry the reference would store is
    checked against the runtime's (:func:`rounding_error`) and the runtime's is kept, so each
    step is compared from the same cache.

    With ``mtp`` each step verifies every sequence's last token and its ``mtp`` drafts (a
    causal multi-token decode step over the cached context), accepts the drafts the runtime's
    sampled chain accepts (``epsim.model.mtp.runtime_accepted``, per rank and step), runs the
    draft passes and advances each sequence by its accepted drafts plus one; ``writes`` are the
    entries the ranks wrote in each step (a later step overwrites rejected ones), and
    :attr:`ReferenceRun.drafts` the draft passes' outputs.

    Returns:
        A :class:`ReferenceRun`.
    """
    seqs = world * batch
    cap = stored.c.shape[2]
    ref = _Dense(model, seed, seqs, cap, kv_dtype, stored, draft=bool(mtp))
    first: ReferenceStep | None = None
    if prefill:
        prompts = torch.cat([W.initial_prompt(model, seed, rk, batch, context - 1)
                             for rk in range(world)])
        first = ref.forward(prompts, torch.arange(context - 1).repeat(seqs, 1),
                            causal_prompt=True, every_row=False)
        tokens = first.next_tokens
    else:
        tokens = torch.cat([W.initial_tokens(model, seed, rk, batch) for rk in range(world)])
        drawn_pos = torch.arange(context - 1).repeat(seqs, 1)
        for layer in range(ref.c_cache.shape[0]):
            drawn = [W.initial_cache(model, seed, rk, layer, batch, context - 1)
                     for rk in range(world)]
            ref.store(layer, drawn_pos, torch.cat([c for c, _ in drawn]).reshape(seqs * (
                context - 1), -1), torch.cat([pe for _, pe in drawn]).reshape(
                seqs * (context - 1), -1))
            if model.attention.sparse:
                ref.i_cache[layer, :, :context - 1] = torch.cat([
                    W.initial_index_keys(model, seed, rk, layer, batch, context - 1)
                    for rk in range(world)])
    out: list[ReferenceStep] = []
    drafts_out: list[DraftStep] = []
    drafts = torch.cat([W.initial_drafts(model, seed, rk, batch, mtp) for rk in range(world)])
    starts = torch.full((seqs,), context - 1)
    for step in range(steps):
        inputs = torch.cat([tokens[:, None], drafts], dim=1)
        pos = starts[:, None] + torch.arange(1 + mtp)[None, :]
        if writes is not None:
            ref.writes = writes[step]
        result = ref.forward(inputs, pos, causal_prompt=False, every_row=bool(mtp))
        out.append(result)
        if not mtp:
            tokens, starts = result.next_tokens, starts + 1
            continue
        accepted = torch.cat([torch.as_tensor(runtime_accepted(seed, rk, step, batch, mtp,
                                                               acceptance))
                              for rk in range(world)])
        step_drafts = ref.drafts(inputs, pos, accepted, result)
        drafts_out.append(step_drafts)
        tokens = result.next_tokens.view(seqs, 1 + mtp)[torch.arange(seqs), accepted]
        drafts, starts = step_drafts.tokens, starts + 1 + accepted
    return ReferenceRun(first, out, ref.kv_err, drafts_out)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|`` (fp32/fp64): the error measure of ``--check``."""
    got, want = got.double(), want.double()
    scale = want.abs().max().item()
    return (got - want).abs().max().item() / (scale if scale > 0 else 1.0)
