"""The runtime's half of the op-graph contract: one implementation per op kind (``OP_IMPLS``).

An implementation ``impl(rt, op, ins, st)`` runs one op of the graph for one microbatch:

    rt       the rank it runs on, as far as an op reads it (:class:`RankView`; the executor's
             ``RankRuntime`` is one), so this module needs nothing of the executor.
    ins      the values the op reads, by name, as the graph's edges deliver them
             (``OpGraph.inputs``: ``{"q_lat": ..., "k_pe": ..., "c_kv": ..., "q": ...}`` for MLA
             decode attention); the executor gathers them, no implementation looks one up.
    returns  the values it writes, by name: exactly ``op.outputs`` (the executor checks), or for a
             collective a :class:`epsim.runtime.comm.Pending` whose ``wait()`` returns them.

Beyond ``ins`` an op reads only its weights (``epsim.model.ids.weight_key`` of its layer and name), the
microbatch's step inputs (token ids, positions, RoPE tables: :class:`MicrobatchState`) and the KV
cache. Names of values come from the graph (``epsim.model.graph``): ``h`` the normalised hidden state,
``residual`` the residual stream, ``q`` the queries, ``c_kv`` / ``k_pe`` the latent and RoPE key,
``topk`` the routing, ``recv`` what a dispatch received, ``gate_up`` / ``gate`` / ``up`` / ``act``
the halves of a SwiGLU. The math lives in :mod:`epsim.runtime.kernels`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from epsim.model.config import ModelConfig
from epsim.model.errors import EpsimError
from epsim.model.ids import weight_key
from epsim.model.opgraph import Op
from epsim.model.placement import remap
from epsim.model.plan import ParallelPlan

from . import comm, gqa, kernels
from .backends import MoEFn
from .kv_cache import LatentCache


@runtime_checkable
class RankView(Protocol):
    """What an op implementation reads from the rank it runs on: exactly the members below
    (``epsim.runtime.executor.RankRuntime`` has them all; a stand-in needs only those its ops
    read, as ``calibrate.micro``'s GEMM sweep passes one with ``weight`` alone).

    model: the model (``rms_norm_eps``, ``moe``: top-k, groups, routed scaling).
    plan: the parallel plan (``fusion.fused_rope``: RoPE inside attention, no rope op).
    device / dtype: where and in what the rank computes: ``cpu``, ``torch.float32``.
    static: fixed shapes (``--static``): masked experts, attention over the whole cache buffer.
    heads / nope / rope / v_dim: MLA's heads and per-head dims; DeepSeek-V3: 128, 128, 64, 128.
    softmax_scale: ``(nope + rope) ** -0.5``; DeepSeek-V3: ``192 ** -0.5``.
    w: every dense weight by ``epsim.model.ids.weight_key``, e.g. ``w["L3.moe.shared.gate_up"]``
        ``[h, 2I]``.
    weight(op, suffix=""): ``w`` of the op's layer and name (+ ``suffix``: ``".bias"``).
    experts: MoE layer -> ``(gate_up [S, h, 2I], down [S, I, h])`` of the rank's ``S`` slots.
    slot_base / slots_per_rank: the rank's first global physical slot and how many it holds
        (EP rank ``r`` of 8 over 256 slots: ``32 * r`` and 32).
    l2p / replicas: ``[layers, experts, max_replicas]`` physical slots of each expert (-1
        padded) and ``[layers, experts]`` replica counts, on the device (``placement.remap``).
    cache: the rank's MLA KV cache (:class:`epsim.runtime.kv_cache.LatentCache`).
    moe_backend: the routed-expert backend, ``(x [N, h], local [N, k], weights [N, k], gate_up,
        down) -> [N, h]`` (``epsim.runtime.backends.select_moe_backend``).
    exchange: the EP dispatch/combine (:class:`epsim.runtime.comm.Exchange`).
    """

    model: ModelConfig
    plan: ParallelPlan
    device: torch.device
    dtype: torch.dtype
    static: bool
    heads: int
    nope: int
    rope: int
    v_dim: int
    softmax_scale: float
    w: dict[str, torch.Tensor]
    experts: dict[int, tuple[torch.Tensor, torch.Tensor]]
    slot_base: int
    slots_per_rank: int
    l2p: torch.Tensor
    replicas: torch.Tensor
    cache: LatentCache
    moe_backend: MoEFn
    exchange: comm.Exchange

    def weight(self, op: Op, suffix: str = "") -> torch.Tensor: ...


@dataclass
class MicrobatchState:
    """One microbatch's step inputs.

    microbatch: 0 or 1. seqs: the rank's sequences it holds (a slice of the batch).
    tokens: ``[t]`` input token ids (decode: one per sequence; prefill: each sequence's prompt,
        one after another). positions: ``[t]`` position of each token in its sequence.
    seq_ids: ``[t]`` the sequence (row of the rank's cache) of each token.
    token_index: ``[t, 1]`` a rank-global token index (replica round-robin in remap).
    cos / sin: ``[t, rope]`` rotary tables.
    last_rows: prefill only: ``[seqs]`` row of each sequence's last token (the LM head's input);
        an MTP draft pass 0: the row of each sequence's last accepted token.
    passes: under MTP, the states of the microbatch's draft passes (``Op.draft`` picks one):
        pass 0 over the verified rows, pass ``k`` one row per sequence at its last accepted
        position + ``k``.
    draft_inputs: an MTP draft pass 0: ``(shifted [t], accepted [t])``, each row's next input
        token (the token after it) and whether the row was accepted; a row that was not takes
        the main model's sampled token instead (vLLM's ``EagleProposer``: the input ids shifted
        by one, the sampled token at the last accepted row).
    """

    microbatch: int
    seqs: slice
    tokens: torch.Tensor
    positions: torch.Tensor
    seq_ids: torch.Tensor
    token_index: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    last_rows: torch.Tensor | None = None
    passes: tuple[MicrobatchState, ...] = ()
    draft_inputs: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]


@dataclass(frozen=True)
class TopK:
    """The router's choice per token: ``slots [t, k]`` physical expert slots (the placement's
    remap of the chosen experts) and ``weights [t, k]`` (routed scaling included);
    ``input_weights [t, 1]``: a top-1 router's weight on the expert's input (Llama-4; then
    ``weights`` are ones), None when the weights scale the outputs."""

    slots: torch.Tensor
    weights: torch.Tensor
    input_weights: torch.Tensor | None = None


Values = Mapping[str, Any]
#: ``impl(rt, op, ins, st)`` -> the op's outputs, or a Pending that returns them
Impl = Callable[[RankView, Op, Values, MicrobatchState], "dict[str, Any] | comm.Pending"]


def last_token_rows(st: MicrobatchState, x: torch.Tensor) -> torch.Tensor:
    """Prefill: each sequence's last row; decode: every row."""
    return x if st.last_rows is None else x.index_select(0, st.last_rows)


def _only(ins: Values) -> Any:
    (value,) = ins.values()
    return value


def _embedding(rt: RankView, op: Op, ins: Values, st: MicrobatchState) -> dict[str, Any]:
    return {op.outputs[0]: rt.weight(op)[st.tokens]}


def _draft_embedding(rt: RankView, op: Op, ins: Values, st: MicrobatchState
                     ) -> dict[str, Any]:
    """The MTP draft pass's next tokens, embedded: pass 0 each verified row's following token
    (the sampled one where the row was not accepted), a later pass the previous draft."""
    sampled = ins["next_tokens"]
    if st.draft_inputs is not None:
        shifted, accepted = st.draft_inputs
        sampled = torch.where(accepted, shifted, sampled)
    return {op.outputs[0]: rt.weight(op)[sampled]}


#: embeddings by op name: the step's input tokens, or the draft module's next tokens
EMBEDDINGS: dict[str, Impl] = {"embed": _embedding, "mtp.embed": _draft_embedding}


def _embed(rt: RankView, op: Op, ins: Values, st: MicrobatchState) -> dict[str, Any]:
    return EMBEDDINGS[op.name](rt, op, ins, st)


def _norm(rt: RankView, op: Op, ins: Values, st: MicrobatchState) -> dict[str, Any]:
    eps = rt.model.rms_norm_eps
    if op.name == "attn.qk_l2_norm":  # Llama-4's weightless per-head norm
        return {op.outputs[0]: gqa.qk_norm(rt.model.attention, _only(ins), None, eps)}
    w = rt.weight(op)
    if op.name == "attn.qk_norm":  # GQA's per-head norm of queries and keys
        return {op.outputs[0]: gqa.qk_norm(rt.model.attention, _only(ins), w, eps)}
    if "residual" in op.outputs:
        # fused add + RMSNorm: the residual stream absorbs the block outputs, then normalise
        blocks = [v for name, v in ins.items() if name != "residual"]
        new = blocks[0]
        for extra in blocks[1:]:
            new = new + extra
        residual = ins["residual"] + new if op.dims["residual"] else new
        return {"h": kernels.rms_norm(residual, w, eps), "residual": residual}
    # the norm covers the first ``width`` features; a second output passes the rest through
    # (MLA's kv_a_norm: the latent is normalised, the RoPE key is not)
    x, width = _only(ins), op.dims["width"]
    out = {op.outputs[0]: kernels.rms_norm(x[:, :width], w, eps)}
    if len(op.outputs) == 2:
        out[op.outputs[1]] = x[:, width:]
    return out


#: GEMMs that may carry a bias (``weight_key + ".bias"``): GLM's q/k/v, GPT-OSS's projections
_BIASED_GEMMS = frozenset({"attn.qkv_proj", "attn.o_proj"})


def _gemm(rt: RankView, op: Op, ins: Values, st: MicrobatchState) -> dict[str, Any]:
    # several inputs are concatenated in the graph's order (MTP's eh_proj: [embedding; hidden])
    x = _only(ins) if len(ins) == 1 else torch.cat(list(ins.values()), dim=-1)
    w = rt.weight(op)
    t, batch = x.shape[0], op.dims["batch"]
    if batch > 1:
        # a batched GEMM over heads (MLA's absorption): per head, the leading k features (the
        # no-RoPE part of each head's query for q_absorb)
        y = torch.einsum("tbk,bkn->tbn", x.view(t, batch, -1)[..., :op.dims["k"]], w)
    else:
        y = x.reshape(t, -1) @ w  # heads flattened into features (o_proj)
    if op.name in _BIASED_GEMMS:
        bias = rt.w.get(weight_key(op.layer, op.name + ".bias"))
        if bias is not None:
            y = y + bias
    return {op.outputs[0]: y}


def _elementwise(rt: RankView, op: Op, ins: Values, st: MicrobatchState) -> dict[str, Any]:
    # SwiGLU: one merged gate/up tensor, or the two halves from separate GEMMs
    if "gate_up" in ins:
        return {op.outputs[0]: kernels.silu_and_mul(ins["gate_up"])}
    return {op.outputs[0]: torch.nn.functional.silu(ins["gate"]) * ins["up"]}


def _rotate(rt: RankView, st: MicrobatchState, q: torch.Tensor, k_pe: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [t, H * (n + p)]`` with its RoPE part rotated (as ``[t, H, n + p]``), ``k_pe`` too."""
    q = q.view(st.num_tokens, rt.heads, rt.nope + rt.rope)
    q_pe = kernels.apply_rope(q[..., rt.nope:], st.cos, st.sin)
    return torch.cat([q[..., :rt.nope], q_pe], dim=-1), kernels.apply_rope(k_pe, st.cos, st.sin)


def _rope(rt: RankView, op: Op, ins: Values, st: MicrobatchState) -> dict[str, Any]:
    if "qkv" in ins:  # GQA
        return {"qkv": gqa.rotate(rt.model.attention, op.layer, ins["qkv"], st.cos, st.sin)}
    q, k_pe = _rotate(rt, st, ins["q"], ins["k_pe"])
    return {"q": q.reshape(st.num_tokens, -1), "k_pe": k_pe}


def _attention_inputs(rt: RankView, ins: Values, st: MicrobatchState
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [t, H, n + p]`` and ``k_pe [t, p]``, rotated here when RoPE is fused into attention
    (the graph then has no rope op)."""
    if rt.plan.fusion.fused_rope:
        return _rotate(rt, st, ins["q"], ins["k_pe"])
    return ins["q"].view(st.num_tokens, rt.heads, rt.nope + rt.rope), ins["k_pe"]


def _attention_decode(rt: RankView, op: Op, ins: Values, st: MicrobatchState
                      ) -> dict[str, Any]:
    if "qkv" in ins:
        return gqa.attention(rt, op, ins, st)
    q, k_pe = _attention_inputs(rt, ins, st)
    rt.cache.write(op.layer, st.seq_ids, st.positions, ins["c_kv"], k_pe, op.draft)
    # eager reads only the filled part; static shapes read the whole buffer, masked
    upto = rt.cache.capacity if rt.static else int(st.positions.max()) + 1
    c, pe = rt.cache.read(op.layer, st.seqs, upto, rt.dtype)
    if st.num_tokens != c.shape[0]:  # several queries per sequence (MTP): each its cache
        rows = st.seq_ids - st.seqs.start
        c, pe = c.index_select(0, rows), pe.index_select(0, rows)
    o_lat = kernels.mla_decode_absorbed(ins["q_lat"], q[..., rt.nope:].contiguous(), c, pe,
                                        st.positions + 1, rt.softmax_scale,
                                        keep=ins.get("topk_idx"))
    return {op.outputs[0]: o_lat}


def _rope_front(x: torch.Tensor, st: MicrobatchState, width: int) -> torch.Tensor:
    """``x [t, ..., d]`` with its first ``width`` dims rotated (the indexer's RoPE part comes
    first, DeepSeek-V3.2-Exp ``inference/model.py``)."""
    return torch.cat([kernels.apply_rope(x[..., :width], st.cos, st.sin), x[..., width:]], -1)


def _indexer(rt: RankView, op: Op, ins: Values, st: MicrobatchState) -> dict[str, Any]:
    """DSA's lightning indexer: normalise (LayerNorm) and rotate the new tokens' index keys,
    cache them, score every cached key for each query and keep its ``topk`` best (a ``[t, L]``
    mask over the entries attention reads). The released model rotates queries and keys by a
    Hadamard matrix before quantising them to FP8: an orthogonal map that leaves the dot
    products, and so the choice, unchanged; the runtime keeps them unquantised."""
    heads, dim, topk = op.dims["heads"], op.dims["head_dim"], op.dims["topk"]
    t = st.num_tokens
    k = torch.nn.functional.layer_norm(ins["index_k"].float(), (dim,),
                                       rt.weight(op, ".k_norm").float(),
                                       rt.weight(op, ".k_norm.bias").float(), 1e-6)
    k = _rope_front(k.to(rt.dtype), st, rt.rope)
    q = _rope_front(ins["index_q"].view(t, heads, dim), st, rt.rope)
    rt.cache.write_index(op.layer, st.seq_ids, st.positions, k)
    upto = rt.cache.capacity if rt.static else int(st.positions.max()) + 1
    keys = rt.cache.read_index(op.layer, st.seqs, upto)
    if t != keys.shape[0]:  # several queries per sequence (prefill): each its sequence's keys
        keys = keys.index_select(0, st.seq_ids - st.seqs.start)
    weights = ins["index_w"] * (heads ** -0.5 * dim ** -0.5)
    keep = kernels.indexer_keep(q, weights, keys, st.positions + 1, topk)
    return {op.outputs[0]: keep}


def _attention_prefill(rt: RankView, op: Op, ins: Values, st: MicrobatchState
                       ) -> dict[str, Any]:
    """Causal MLA over each sequence's prompt with per-head K and V from ``attn.kv_b``; the
    latents and RoPE keys go into the cache for the decode steps (no cached prefix here)."""
    if op.dims["new_tokens"] != op.dims["context"]:
        raise EpsimError("prefill with a cached prefix (chunked prefill) is not implemented")
    if "qkv" in ins:
        return gqa.attention(rt, op, ins, st)
    t, H, n, p = st.num_tokens, rt.heads, rt.nope, rt.rope
    q, k_pe = _attention_inputs(rt, ins, st)
    rt.cache.write(op.layer, st.seq_ids, st.positions, ins["c_kv"], k_pe)
    kv = ins["kv_up"].view(t, H, n + rt.v_dim)
    seqs, length = st.seqs.stop - st.seqs.start, op.dims["new_tokens"]
    q_full = q.reshape(seqs, length, H, n + p)
    k_full = torch.cat([kv[..., :n], k_pe[:, None, :].expand(t, H, p)], dim=-1)
    k_full = k_full.view(seqs, length, H, n + p)
    v = kv[..., n:].reshape(seqs, length, H, rt.v_dim)
    scores = torch.einsum("sqhd,skhd->shqk", q_full, k_full) * rt.softmax_scale
    causal = torch.ones(length, length, dtype=torch.bool, device=rt.device).tril()
    if "topk_idx" in ins:  # DSA: each query attends only its kept entries
        causal = causal & ins["topk_idx"].view(seqs, length, -1)[:, None, :, :length]
    scores = scores.masked_fill(~causal, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    attn_v = torch.einsum("shqk,skhd->sqhd", probs, v).reshape(t, H, rt.v_dim)
    return {op.outputs[0]: attn_v}


def _router(rt: RankView, op: Op, ins: Values, st: MicrobatchState) -> dict[str, Any]:
    moe = rt.model.moe
    logits = ins["h"].float() @ rt.weight(op).float()
    # a router without a score-correction bias (Llama-4) chooses as one with a zero bias
    bias = rt.w.get(weight_key(op.layer, op.name + ".bias"))
    ids, weights = kernels.route_grouped_sigmoid(
        logits, torch.zeros_like(logits[0]) if bias is None else bias, moe.top_k, moe.n_group,
        moe.topk_group, moe.routed_scaling_factor, moe.norm_topk_prob)
    slots = remap(ids, rt.l2p[op.layer], rt.replicas[op.layer], st.token_index)
    if moe.weight_on_input:  # Llama-4 (top-1): the weight scales the expert's input
        return {op.outputs[0]: TopK(slots, torch.ones_like(weights), weights)}
    return {op.outputs[0]: TopK(slots, weights)}


def _then(handle: comm.Pending, name: str) -> comm.Pending:
    """``handle`` whose wait returns ``{name: its result}``."""
    finish = handle.finish
    return comm.Pending(handle.works, lambda: {name: finish()})


def _dispatch(rt: RankView, op: Op, ins: Values, st: MicrobatchState) -> comm.Pending:
    topk = ins["topk"]
    sent = rt.exchange.dispatch(_routed_rows(ins["h"], topk), topk.slots, topk.weights,
                                capacity=st.num_tokens)
    return _then(sent, op.outputs[0])


def _combine(rt: RankView, op: Op, ins: Values, st: MicrobatchState) -> comm.Pending:
    return _then(rt.exchange.combine(ins["expert_out"], ins["recv"]), op.outputs[0])


def _received(ins: Values) -> comm.DispatchResult:
    """The rows the routed experts compute for: what the dispatch received, or without EP the
    norm's own rows with the router's choice (every slot is local)."""
    if "recv" in ins:
        return ins["recv"]
    topk = ins["topk"]
    return comm.DispatchResult(_routed_rows(ins["h"], topk), topk.slots, topk.weights, None)


def _routed_rows(h: torch.Tensor, topk: TopK) -> torch.Tensor:
    """The rows the routed experts read: the norm's, scaled by a top-1 router's weight when it
    weighs the input (Llama-4)."""
    return h if topk.input_weights is None else h * topk.input_weights.to(h.dtype)


def _local_slots(rt: RankView, recv: comm.DispatchResult) -> torch.Tensor:
    local = recv.slots - rt.slot_base
    mine = (local >= 0) & (local < rt.slots_per_rank)
    return torch.where(mine, local, torch.full_like(local, -1))


def _experts_fused(rt: RankView, op: Op, ins: Values, st: MicrobatchState) -> dict[str, Any]:
    recv, (gate_up, down) = _received(ins), rt.experts[op.layer]
    y = rt.moe_backend(recv.x, _local_slots(rt, recv), recv.weights, gate_up, down)
    return {op.outputs[0]: y}


def _experts_with_shared(rt: RankView, op: Op, ins: Values, st: MicrobatchState
                         ) -> dict[str, Any]:
    """The fused-MoE kernel that also runs the shared expert over the rank's own rows
    (``Fusion.shared_expert_in_moe``): ``expert_out`` for the received rows, ``shared_out`` for
    the own ones, as aiter's 33-expert kernel computes both in one launch."""
    routed = _experts_fused(rt, op, ins, st)[op.outputs[0]]
    gate_up = rt.w[weight_key(op.layer, "moe.shared.gate_up")]
    down = rt.w[weight_key(op.layer, "moe.shared.down")]
    shared = kernels.silu_and_mul(ins["h"] @ gate_up) @ down
    return {op.outputs[0]: routed, op.outputs[1]: shared}


def _experts_gate_up(rt: RankView, op: Op, ins: Values, st: MicrobatchState
                     ) -> dict[str, Any]:
    """Writes ``gate_up`` and ``pairs``: the layout down needs (static: every slot over every row
    with the routing weights; dynamic: the pairs sorted by slot)."""
    recv, (gate_up, _) = _received(ins), rt.experts[op.layer]
    local = _local_slots(rt, recv)
    if rt.static:
        return {"gate_up": kernels.masked_gate_up(recv.x, gate_up),
                "pairs": (local, recv.weights)}
    pairs = kernels.sort_pairs(local, recv.weights, gate_up.shape[0])
    return {"gate_up": kernels.sorted_gate_up(recv.x, pairs, gate_up), "pairs": pairs}


def _experts_down(rt: RankView, op: Op, ins: Values, st: MicrobatchState) -> dict[str, Any]:
    act, pairs, (_, down) = ins["act"], ins["pairs"], rt.experts[op.layer]
    if rt.static:
        local, weights = pairs
        return {op.outputs[0]: kernels.masked_down(act, local, weights, down)}
    return {op.outputs[0]: kernels.sorted_down(act, pairs, down)}


#: the routed experts by op name: one fused op, or gate/up and down around an activation
GROUPED_GEMMS: dict[str, Impl] = {
    "moe.experts": _experts_fused,
    "moe.experts_shared": _experts_with_shared,
    "moe.experts.gate_up": _experts_gate_up,
    "moe.experts.down": _experts_down,
}


def _grouped_gemm(rt: RankView, op: Op, ins: Values, st: MicrobatchState) -> dict[str, Any]:
    return GROUPED_GEMMS[op.name](rt, op, ins, st)


def _lm_head(rt: RankView, op: Op, ins: Values, st: MicrobatchState) -> dict[str, Any]:
    rows = last_token_rows(st, ins["h"])
    out = {op.outputs[0]: rows.float() @ rt.weight(op).float()}
    if "hidden" in op.outputs:  # an MTP draft head hands its rows' hidden state on
        out["hidden"] = last_token_rows(st, ins["residual"])
    return out


def _sample(rt: RankView, op: Op, ins: Values, st: MicrobatchState) -> dict[str, Any]:
    return {op.outputs[0]: _only(ins).argmax(-1)}  # greedy


#: op kind -> implementation (the runtime's half of the op-graph contract)
OP_IMPLS: dict[str, Impl] = {
    "embedding": _embed,
    "norm": _norm,
    "gemm": _gemm,
    "elementwise": _elementwise,
    "rope": _rope,
    "attention_decode": _attention_decode,
    "attention_prefill": _attention_prefill,
    "router": _router,
    "dispatch": _dispatch,
    "grouped_gemm": _grouped_gemm,
    "combine": _combine,
    "lm_head": _lm_head,
    "sample": _sample,
    "indexer": _indexer,
}
