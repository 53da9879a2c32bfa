"""The runtime's half of the op-graph contract: one implementation per op kind (``OP_IMPLS``).

An implementation ``impl(rt, op, st)`` runs one op of the graph for one microbatch: it reads and
writes the microbatch's named values (``"h"``, ``"q"``, ...) in ``st.values`` and the weights
named by the op (``model.ids.weight_key``), and returns None, or a :class:`runtime.comm.Pending`
for a collective in flight (the executor waits on it where the graph says). Within a kind, tables
keyed by the op's name pick the variant. The math lives in :mod:`runtime.kernels`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from epsim.model.errors import EpsimError
from epsim.model.graph import Op
from epsim.model.placement import remap

from . import comm, kernels

if TYPE_CHECKING:
    from .executor import RankRuntime


@dataclass
class MicrobatchState:
    """One microbatch's inputs and the values its ops produce.

    microbatch: 0 or 1. seqs: the rank's sequences it holds (a slice of the batch).
    tokens: ``[t]`` input token ids (decode: one per sequence; prefill: each sequence's prompt,
        one after another). positions: ``[t]`` position of each token in its sequence.
    seq_ids: ``[t]`` the sequence (row of the rank's cache) of each token.
    token_index: ``[t, 1]`` a rank-global token index (replica round-robin in remap).
    cos / sin: ``[t, rope]`` rotary tables.
    last_rows: prefill only: ``[seqs]`` row of each sequence's last token (the LM head's input).
    values: name -> tensor (or list of names for ``"layer_out"``: the outputs the next fused
        add+norm sums).
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
    values: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]


def last_token_rows(st: MicrobatchState, x: torch.Tensor) -> torch.Tensor:
    """Prefill: each sequence's last row; decode: every row."""
    return x if st.last_rows is None else x.index_select(0, st.last_rows)


#: ``impl(rt, op, st)``: runs ``op`` for microbatch ``st``; a collective returns its Pending
Impl = Callable[["RankRuntime", Op, MicrobatchState], Any]


def _embedding(rt: RankRuntime, op: Op, st: MicrobatchState) -> None:
    st.values["embed_out"] = rt.weight(op)[st.tokens]
    st.values["layer_out"] = ["embed_out"]


def _sum_outputs(st: MicrobatchState) -> torch.Tensor:
    outs = [st.values[k] for k in st.values["layer_out"]]
    total = outs[0]
    for extra in outs[1:]:
        total = total + extra
    return total


def _add_norm(rt: RankRuntime, op: Op, st: MicrobatchState, new: torch.Tensor,
              out_key: str) -> None:
    # fused add + RMSNorm: the residual stream absorbs the block output, then normalise
    residual = st.values["residual"] + new if op.dims.get("residual") else new
    st.values["residual"] = residual
    st.values[out_key] = kernels.rms_norm(residual, rt.weight(op), rt.model.rms_norm_eps)


def _ffn_norm(rt: RankRuntime, op: Op, st: MicrobatchState) -> None:
    _add_norm(rt, op, st, st.values["attn_out"], "h")
    st.values["layer_out"] = []  # the FFN block's outputs are collected from here on


def _norm_kv_a(rt: RankRuntime, op: Op, st: MicrobatchState) -> None:
    kv = st.values["kv_a"]
    st.values["c_kv"] = kernels.rms_norm(kv[:, :rt.latent], rt.weight(op), rt.model.rms_norm_eps)
    st.values["k_pe"] = kv[:, rt.latent:]


NORMS: dict[str, Impl] = {
    "attn_norm": lambda rt, op, st: _add_norm(rt, op, st, _sum_outputs(st), "h"),
    "ffn_norm": lambda rt, op, st: _ffn_norm(rt, op, st),
    "final_norm": lambda rt, op, st: _add_norm(rt, op, st, _sum_outputs(st), "final_hidden"),
    "attn.q_a_norm": lambda rt, op, st: st.values.__setitem__(
        "q_a", kernels.rms_norm(st.values["q_a"], rt.weight(op), rt.model.rms_norm_eps)),
    "attn.kv_a_norm": _norm_kv_a,
}


def _norm(rt: RankRuntime, op: Op, st: MicrobatchState) -> None:
    NORMS[op.name](rt, op, st)


def _q_nope(rt: RankRuntime, st: MicrobatchState) -> torch.Tensor:
    return st.values["q"].view(st.num_tokens, rt.heads, rt.nope + rt.rope)[..., :rt.nope]


#: gemm name -> (input of the microbatch, output name)
GEMMS: dict[str, tuple[Callable[[RankRuntime, MicrobatchState], torch.Tensor], str]] = {
    "attn.q_a": (lambda rt, st: st.values["h"], "q_a"),
    "attn.q_b": (lambda rt, st: st.values["q_a"], "q"),
    "attn.q_proj": (lambda rt, st: st.values["h"], "q"),
    "attn.kv_a": (lambda rt, st: st.values["h"], "kv_a"),
    "attn.kv_b": (lambda rt, st: st.values["c_kv"], "kv_up"),
    "attn.q_absorb": (_q_nope, "q_lat"),
    "attn.v_absorb": (lambda rt, st: st.values["o_lat"], "attn_v"),
    "attn.o_proj": (lambda rt, st: st.values["attn_v"].reshape(st.num_tokens, -1), "attn_out"),
    "mlp.gate_up": (lambda rt, st: st.values["h"], "mlp_gu"),
    "mlp.down": (lambda rt, st: st.values["mlp_act"], "mlp_out"),
    "moe.shared.gate_up": (lambda rt, st: st.values["h"], "shared_gu"),
    "moe.shared.gate": (lambda rt, st: st.values["h"], "shared_gate"),
    "moe.shared.up": (lambda rt, st: st.values["h"], "shared_up"),
    "moe.shared.down": (lambda rt, st: st.values["shared_act"], "shared_out"),
}
#: gemm outputs that are a block's output (summed by the next fused add+norm)
BLOCK_OUTPUTS = {"mlp_out", "shared_out"}


def _gemm(rt: RankRuntime, op: Op, st: MicrobatchState) -> None:
    source, out = GEMMS[op.name]
    x, w = source(rt, st), rt.weight(op)
    # batch > 1: MLA's per-head absorption, a batched GEMM over heads
    st.values[out] = torch.einsum("tbk,bkn->tbn", x, w) if op.dims["batch"] > 1 else x @ w
    if out in BLOCK_OUTPUTS:
        st.values["layer_out"].append(out)


def _shared_act(st: MicrobatchState) -> torch.Tensor:
    if "shared_gu" in st.values:
        return kernels.silu_and_mul(st.values["shared_gu"])
    return torch.nn.functional.silu(st.values["shared_gate"]) * st.values["shared_up"]


ELEMENTWISE: dict[str, tuple[Callable[[MicrobatchState], torch.Tensor], str]] = {
    "mlp.act": (lambda st: kernels.silu_and_mul(st.values["mlp_gu"]), "mlp_act"),
    "moe.shared.act": (_shared_act, "shared_act"),
    "moe.experts.act": (lambda st: kernels.silu_and_mul(st.values["ex_gu"]), "ex_act"),
}


def _elementwise(rt: RankRuntime, op: Op, st: MicrobatchState) -> None:
    fn, out = ELEMENTWISE[op.name]
    st.values[out] = fn(st)


def _rope(rt: RankRuntime, op: Op, st: MicrobatchState) -> None:
    t = st.num_tokens
    q = st.values["q"].view(t, rt.heads, rt.nope + rt.rope)
    q_pe = kernels.apply_rope(q[..., rt.nope:], st.cos, st.sin)
    st.values["q"] = torch.cat([q[..., :rt.nope], q_pe], dim=-1).reshape(t, -1)
    st.values["k_pe"] = kernels.apply_rope(st.values["k_pe"], st.cos, st.sin)
    st.values["roped"] = True


def _attention_decode(rt: RankRuntime, op: Op, st: MicrobatchState) -> None:
    t = st.num_tokens
    q_pe = st.values["q"].view(t, rt.heads, rt.nope + rt.rope)[..., rt.nope:]
    k_pe = st.values["k_pe"]
    if not st.values.get("roped"):  # fused RoPE: rotate inside the attention kernel
        q_pe = kernels.apply_rope(q_pe, st.cos, st.sin)
        k_pe = kernels.apply_rope(k_pe, st.cos, st.sin)
    rt.cache.write(op.layer, st.seq_ids, st.positions, st.values["c_kv"], k_pe)
    # eager reads only the filled part; static shapes read the whole buffer, masked
    upto = rt.cache.capacity if rt.static else int(st.positions.max()) + 1
    c, pe = rt.cache.read(op.layer, st.seqs, upto, rt.dtype)
    st.values["o_lat"] = kernels.mla_decode_absorbed(
        st.values["q_lat"], q_pe.contiguous(), c, pe, st.positions + 1, rt.softmax_scale)
    st.values.pop("roped", None)


def _attention_prefill(rt: RankRuntime, op: Op, st: MicrobatchState) -> None:
    """Causal MLA over each sequence's prompt with per-head K and V from ``attn.kv_b``; the
    latents and RoPE keys go into the cache for the decode steps (no cached prefix here)."""
    if op.dims["new_tokens"] != op.dims["context"]:
        raise EpsimError("prefill with a cached prefix (chunked prefill) is not implemented")
    t, H, n, p = st.num_tokens, rt.heads, rt.nope, rt.rope
    q = st.values["q"].view(t, H, n + p)
    q_pe, k_pe = q[..., n:], st.values["k_pe"]
    if not st.values.get("roped"):  # fused RoPE
        q_pe = kernels.apply_rope(q_pe, st.cos, st.sin)
        k_pe = kernels.apply_rope(k_pe, st.cos, st.sin)
    rt.cache.write(op.layer, st.seq_ids, st.positions, st.values["c_kv"], k_pe)
    kv = st.values["kv_up"].view(t, H, n + rt.v_dim)
    seqs, length = st.seqs.stop - st.seqs.start, op.dims["new_tokens"]
    q_full = torch.cat([q[..., :n], q_pe], dim=-1).view(seqs, length, H, n + p)
    k_full = torch.cat([kv[..., :n], k_pe[:, None, :].expand(t, H, p)], dim=-1)
    k_full = k_full.view(seqs, length, H, n + p)
    v = kv[..., n:].reshape(seqs, length, H, rt.v_dim)
    scores = torch.einsum("sqhd,skhd->shqk", q_full, k_full) * rt.softmax_scale
    causal = torch.ones(length, length, dtype=torch.bool, device=rt.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    st.values["attn_v"] = torch.einsum("shqk,skhd->sqhd", probs, v).reshape(t, H, rt.v_dim)
    st.values.pop("roped", None)


def _router(rt: RankRuntime, op: Op, st: MicrobatchState) -> None:
    moe = rt.model.moe
    h = st.values["h"]
    logits = h.float() @ rt.weight(op).float()
    ids, weights = kernels.route_grouped_sigmoid(
        logits, rt.weight(op, ".bias"), moe.top_k, moe.n_group, moe.topk_group,
        moe.routed_scaling_factor, moe.norm_topk_prob)
    slots = remap(ids, rt.l2p[op.layer], rt.replicas[op.layer], st.token_index)
    st.values["topk_ids"], st.values["topk_slots"], st.values["topk_w"] = ids, slots, weights
    if not rt.plan.expert_parallel:  # every slot is local: no exchange
        st.values["recv"] = comm.DispatchResult(h, slots, weights, None)


def _dispatch(rt: RankRuntime, op: Op, st: MicrobatchState) -> comm.Pending:
    if rt.mori is not None:  # MORI-EP: its own kernels, finished when they return
        x, slots, weights = rt.mori.dispatch(st.values["h"], st.values["topk_slots"],
                                             st.values["topk_w"])
        st.values["recv"] = comm.DispatchResult(x, slots, weights, None)
        return comm.Pending([], lambda: None)
    args = (st.values["h"], st.values["topk_slots"], st.values["topk_w"], rt.slots_per_rank)
    if rt.static:
        handle = comm.dispatch_static(*args, capacity=st.num_tokens, group=rt.group)
    else:
        handle = comm.dispatch_dynamic(*args, group=rt.group)
    return _then(handle, lambda result: st.values.__setitem__("recv", result))


def _combine(rt: RankRuntime, op: Op, st: MicrobatchState) -> comm.Pending:
    y, layout = st.values["expert_out"], st.values["recv"].layout
    st.values["layer_out"].append("routed_out")  # arrives when waited on
    if rt.mori is not None:
        recv = st.values["recv"]
        st.values["routed_out"] = rt.mori.combine(y, recv.weights, recv.slots)
        return comm.Pending([], lambda: None)
    if rt.static:
        handle = comm.combine_static(y, layout, group=rt.group)
    else:
        handle = comm.combine_dynamic(y, layout, group=rt.group)
    return _then(handle, lambda out: st.values.__setitem__("routed_out", out))


def _then(handle: comm.Pending, store: Callable[[Any], None]) -> comm.Pending:
    finish = handle.finish
    return comm.Pending(handle.works, lambda: store(finish()))


def _local_slots(rt: RankRuntime, st: MicrobatchState) -> torch.Tensor:
    slots = st.values["recv"].slots
    local = slots - rt.slot_base
    mine = (local >= 0) & (local < rt.slots_per_rank)
    return torch.where(mine, local, torch.full_like(local, -1))


def _experts_output(rt: RankRuntime, st: MicrobatchState, y: torch.Tensor) -> None:
    if rt.plan.expert_parallel:
        st.values["expert_out"] = y  # combine sends it back
    else:
        st.values["routed_out"] = y
        st.values["layer_out"].append("routed_out")


def _experts_fused(rt: RankRuntime, op: Op, st: MicrobatchState) -> None:
    recv = st.values["recv"]
    gate_up, down = rt.experts[op.layer]
    y = rt.moe_backend(recv.x, _local_slots(rt, st), recv.weights, gate_up, down)
    _experts_output(rt, st, y)


def _experts_gate_up(rt: RankRuntime, op: Op, st: MicrobatchState) -> None:
    recv, (gate_up, _) = st.values["recv"], rt.experts[op.layer]
    local = _local_slots(rt, st)
    st.values["ex_local"] = local
    if rt.static:
        st.values["ex_gu"] = kernels.masked_gate_up(recv.x, gate_up)
    else:
        pairs = kernels.sort_pairs(local, recv.weights, gate_up.shape[0])
        st.values["ex_pairs"] = pairs
        st.values["ex_gu"] = kernels.sorted_gate_up(recv.x, pairs, gate_up)


def _experts_down(rt: RankRuntime, op: Op, st: MicrobatchState) -> None:
    recv, (_, down) = st.values["recv"], rt.experts[op.layer]
    if rt.static:
        y = kernels.masked_down(st.values["ex_act"], st.values["ex_local"], recv.weights, down)
    else:
        y = kernels.sorted_down(st.values["ex_act"], st.values["ex_pairs"], down)
    _experts_output(rt, st, y)


GROUPED_GEMMS: dict[str, Impl] = {
    "moe.experts": _experts_fused,
    "moe.experts.gate_up": _experts_gate_up,
    "moe.experts.down": _experts_down,
}


def _grouped_gemm(rt: RankRuntime, op: Op, st: MicrobatchState) -> None:
    GROUPED_GEMMS[op.name](rt, op, st)


def _lm_head(rt: RankRuntime, op: Op, st: MicrobatchState) -> None:
    st.values["logits"] = last_token_rows(st, st.values["final_hidden"]).float() @ rt.weight(op).float()


def _sample(rt: RankRuntime, op: Op, st: MicrobatchState) -> None:
    st.values["next_tokens"] = st.values["logits"].argmax(-1)  # greedy


#: op kind -> implementation (the runtime's half of the op-graph contract)
OP_IMPLS: dict[str, Impl] = {
    "embedding": _embedding,
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
}
