"""Building the op graph of one step on one rank: ``build_step_graph(model, plan, batch)``.

What the graph is made of (op kinds, categories, dims, ``Batch``, ``Op``, ``OpGraph``) and the
glossary of the contract are in ``epsim.model.opgraph``; this module emits the ops of each layer
(attention, dense MLP, MoE with its shared and routed experts, the LM head) per microbatch, with
their FLOPs, bytes and the values they read and write, and attaches the schedule.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import networkx as nx

from .config import ModelConfig
from .dtypes import COMPUTE_DTYPE, bytes_per_element
from .ids import NO_LAYER, op_id
from .mtp import emit_draft_pass
from .opgraph import KIND_DIMS, OP_CATEGORIES, Batch, Op, OpGraph
from .plan import ParallelPlan
from .schedule import build_schedule

#: activations' dtype between ops
ACT = "bf16"

# --------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------


def _split(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` near-equal positive pieces, larger first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def prob_rank_hit(num_experts: int, experts_per_rank: int, top_k: int) -> float:
    """Chance that a token's ``top_k`` distinct experts (uniform) include one of a given rank's."""
    miss = math.comb(num_experts - experts_per_rank, top_k) / math.comb(num_experts, top_k)
    return 1.0 - miss


#: a value an op reads: a producer's op id (its main value) or ``(op id, value name)``
Read = str | tuple[str, str]


class _Emitter:
    """Collects one microbatch's ops in order; ``emit`` defaults what an op reads to the last
    op's main value."""

    def __init__(self, microbatch: int) -> None:
        self.microbatch = microbatch
        self.ops: dict[str, Op] = {}  # in emission order
        self.reads: dict[str, list[tuple[str, str]]] = {}
        self.blocks: list[list[str]] = []  # the embedding, each decoder layer, the head
        self.last: str | None = None
        self.results: dict[str, tuple[str, str]] = {}
        self.draft: int | None = None  # the MTP draft pass being emitted (epsim.model.mtp)
        self.draft_carry: str | None = None  # that pass's head: it hands the next its hidden

    def begin_block(self) -> None:
        self.blocks.append([])

    def emit(self, layer: int, name: str, kind: str, category: str, *,
             deps: Iterable[Read | None] | None = None, outputs: Sequence[str] = ("out",),
             **fields: Any) -> str:
        ident = op_id(layer, name, self.microbatch, self.draft)
        op = Op(id=ident, kind=kind, name=name, layer=layer, microbatch=self.microbatch,
                category=category, outputs=tuple(outputs), draft=self.draft, **fields)
        missing = [k for k in KIND_DIMS[kind] if k not in op.dims]
        assert not missing, f"{ident}: dims lack {missing}"
        assert category in OP_CATEGORIES, f"{ident}: unknown category {category!r}"
        self.ops[ident] = op
        chosen = [self.last] if deps is None else list(deps)
        self.reads[ident] = [self._value(d) for d in chosen if d is not None]
        # an implementation receives its inputs by value name: two of one name would collide
        names = [value for _, value in self.reads[ident]]
        assert len(set(names)) == len(names), f"{ident} reads two values of one name: {names}"
        self.blocks[-1].append(ident)
        self.last = ident
        return ident

    def _value(self, read: Read) -> tuple[str, str]:
        producer, value = (read, None) if isinstance(read, str) else read
        names = self.ops[producer].outputs
        value = names[0] if value is None else value
        assert value in names, f"{producer} writes {names}, not {value!r}"
        return producer, value


class _OpsOnlyEmitter(_Emitter):
    """An emitter that keeps the ops alone (``build_representative_ops``: no edges are built,
    so no reads are resolved; the checks of ``_Emitter.emit`` are of the builder's code, which
    every full build of the same code runs); with ``kinds``, only the ops of those kinds."""

    def __init__(self, microbatch: int, kinds: frozenset[str] | None = None) -> None:
        super().__init__(microbatch)
        self.kinds = kinds

    def emit(self, layer: int, name: str, kind: str, category: str, *,
             deps: Iterable[Read | None] | None = None, outputs: Sequence[str] = ("out",),
             **fields: Any) -> str:
        ident = op_id(layer, name, self.microbatch, self.draft)
        if self.kinds is None or kind in self.kinds:
            self.ops[ident] = Op(id=ident, kind=kind, name=name, layer=layer,
                                 microbatch=self.microbatch, category=category,
                                 outputs=tuple(outputs), draft=self.draft, **fields)
        self.last = ident
        return ident


def query_tokens(plan: ParallelPlan, batch: Batch) -> int:
    """New tokens per sequence a step computes: a decode step's 1 + ``plan.mtp`` (the last
    token and the drafts it verifies), a prefill step's prompt chunk."""
    return 1 + plan.mtp if batch.phase == "decode" else batch.new_tokens_per_seq


class _StepBuilder:
    """Builds one microbatch's ops for a model, plan and batch (see ``build_step_graph``).

    ``new_tokens`` / ``context`` override the batch's tokens per sequence and context (an MTP
    draft pass after the first runs one token per sequence further along, ``epsim.model.mtp``).
    """

    def __init__(self, model: ModelConfig, plan: ParallelPlan, batch: Batch,
                 seqs: int, emitter: _Emitter, *, new_tokens: int | None = None,
                 context: int | None = None) -> None:
        self.m, self.p, self.b = model, plan, batch
        self.seqs = seqs
        self.new = query_tokens(plan, batch) if new_tokens is None else new_tokens
        self.context = batch.context if context is None else context
        self.tokens = seqs * self.new
        self.e = emitter
        self.act = bytes_per_element(ACT)
        self.wdt = bytes_per_element(model.weight_dtype)
        self.edt = bytes_per_element(model.expert_weight_dtype)
        self.compute_dtype = COMPUTE_DTYPE[model.weight_dtype]
        self.expert_compute_dtype = COMPUTE_DTYPE[model.expert_weight_dtype]
        self.residual: str | None = None  # the last fused add+norm: it wrote the residual stream

    @property
    def kv_len(self) -> int:
        """Cache entries per sequence once the step's tokens are in: decode's context plus the
        drafts it verifies, prefill's prompt."""
        return self.context + self.new - 1 if self.b.phase == "decode" else self.context

    # -- generic op shapes ------------------------------------------------------------------

    def gemm(self, layer: int, name: str, category: str, m: int, n: int, k: int, *, out: str,
             batch: int = 1, wdt: float | None = None, dtype: str | None = None,
             deps: Iterable[Read | None] | None = None) -> str:
        wdt = self.wdt if wdt is None else wdt
        weights = batch * k * n * wdt
        return self.e.emit(
            layer, name, "gemm", category, deps=deps, outputs=(out,),
            dims={"batch": batch, "m": m, "n": n, "k": k},
            dtype=dtype or self.compute_dtype,
            flops=2.0 * batch * m * n * k,
            bytes_read=weights + batch * m * k * self.act,
            bytes_written=batch * m * n * self.act,
            weight_bytes=weights,
        )

    def norm(self, layer: int, name: str, category: str, width: int, *, outputs: Sequence[str],
             residual: bool = False, deps: Iterable[Read | None] | None = None) -> str:
        # a fused add+RMSNorm reads x and the residual and writes both back
        streams = 2 if residual else 1
        t = self.tokens
        return self.e.emit(
            layer, name, "norm", category, deps=deps, outputs=outputs,
            dims={"tokens": t, "width": width, "residual": int(residual)},
            dtype=ACT,
            flops=(4.0 + streams) * t * width,
            bytes_read=streams * t * width * self.act + width * self.act,
            bytes_written=streams * t * width * self.act,
            weight_bytes=width * self.act,
        )

    def add_norm(self, layer: int, name: str, category: str,
                 block_outputs: Sequence[Read]) -> str:
        """A fused add+RMSNorm: the residual stream (written by the previous one; the first starts
        it) absorbs the block outputs, then is normalised. Writes ``h`` and ``residual``."""
        previous = self.residual
        deps = [*block_outputs, *([(previous, "residual")] if previous else [])]
        self.residual = self.norm(layer, name, category, self.m.hidden_size,
                                  outputs=("h", "residual"), residual=previous is not None,
                                  deps=deps)
        return self.residual

    def elementwise(self, layer: int, name: str, category: str, width_in: int, width_out: int,
                    flops_per_out: float, deps: Iterable[Read | None] | None = None,
                    tokens: float | None = None, routed: bool = False) -> str:
        """A SwiGLU activation: silu(gate) * up over ``width_out`` features (``act``)."""
        t = self.tokens if tokens is None else tokens
        return self.e.emit(
            layer, name, "elementwise", category, deps=deps, outputs=("act",),
            dims={"tokens": t, "width": width_out, "width_in": width_in},
            dtype=ACT,
            flops=flops_per_out * t * width_out,
            bytes_read=t * width_in * self.act,
            bytes_written=t * width_out * self.act,
            routed=routed,
        )

    def ep_exchange(self, layer: int, kind: str, tokens: float, per_peer_tokens: float,
                    row_bytes: float, *, deps: Iterable[Read | None], out: str, dtype: str,
                    flops: float, bytes_read: float, bytes_written: float) -> str:
        """An EP all-to-all (``kind`` ``"dispatch"`` or ``"combine"``): ``per_peer_tokens`` rows
        of ``row_bytes`` to each of the ``ep`` ranks; its cost follows the step's routing."""
        ep, moe = self.p.ep, self.m.moe
        return self.e.emit(
            layer, f"moe.{kind}", kind, kind, deps=deps, outputs=(out,),
            dims={"tokens": tokens, "group": "ep", "group_size": ep, "hidden": self.m.hidden_size,
                  "top_k": moe.top_k, "bytes_per_token": row_bytes,
                  "expected_tokens_per_peer": per_peer_tokens},
            dtype=dtype, flops=flops, bytes_read=bytes_read, bytes_written=bytes_written,
            peer_bytes=tuple(per_peer_tokens * row_bytes for _ in range(ep)), routed=True,
        )

    def collective(self, layer: int, name: str, kind: str, category: str, tokens: float,
                   width: int, group_size: int, group: str, *, out: str,
                   deps: Iterable[Read | None] | None = None) -> str:
        """An all-reduce or all-gather over a full mesh of ``group_size`` GPUs (one-shot)."""
        size = tokens * width * self.act
        if kind == "all_reduce":
            # reduce-scatter then all-gather: each peer gets 1/n of the buffer twice
            per_peer = 2.0 * size / group_size
            written = size
        else:  # all_gather: this rank's shard to every peer
            per_peer = size
            written = size * group_size
        peers = tuple(per_peer for _ in range(group_size))
        return self.e.emit(
            layer, name, kind, category, deps=deps, outputs=(out,),
            dims={"tokens": tokens, "width": width, "group": group, "group_size": group_size},
            dtype=ACT,
            flops=float(tokens * width * (group_size - 1)) if kind == "all_reduce" else 0.0,
            bytes_read=size,
            bytes_written=written,
            peer_bytes=peers,
        )

    # -- blocks ---------------------------------------------------------------------------

    def embedding(self) -> str:
        self.e.begin_block()
        h, t = self.m.hidden_size, self.tokens
        out = self.e.emit(
            NO_LAYER, "embed", "embedding", "other", deps=[], outputs=("hidden",),
            dims={"tokens": t, "hidden": h, "vocab": self.m.vocab_size // self.p.tp},
            dtype=ACT, flops=0.0,
            bytes_read=t * h * self.act + t * 8, bytes_written=t * h * self.act,
        )
        if self.p.tp > 1:  # vocab-parallel table: each rank fills its rows, then sum
            out = self.collective(NO_LAYER, "embed.all_reduce", "all_reduce", "tp_comm", t, h,
                                  self.p.tp, "tp", out="hidden")
        return out

    def attention(self, layer: int, layer_inputs: Sequence[str]) -> str:
        a = self.m.attention
        norm = self.add_norm(layer, "attn_norm", "attention", layer_inputs)
        if a.kind == "mla":
            out = self._mla(layer, norm)
        else:
            out = self._gqa(layer, norm)
        if self.p.tp > 1:
            out = self.collective(layer, "attn.all_reduce", "all_reduce", "tp_comm", self.tokens,
                                  self.m.hidden_size, self.p.tp, "tp", out="attn_out",
                                  deps=[out])
        return out

    def _mla(self, layer: int, norm: str) -> str:
        a, h, t = self.m.attention, self.m.hidden_size, self.tokens
        heads = a.num_heads // self.p.tp
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        latent = a.kv_lora_rank + a.qk_rope_head_dim
        cat = "attention"
        if a.q_lora_rank:
            self.gemm(layer, "attn.q_a", cat, t, a.q_lora_rank, h, out="q_a", deps=[norm])
            self.norm(layer, "attn.q_a_norm", cat, a.q_lora_rank, outputs=("q_a",))
            q = self.gemm(layer, "attn.q_b", cat, t, heads * qk, a.q_lora_rank, out="q")
        else:
            q = self.gemm(layer, "attn.q_proj", cat, t, heads * qk, h, out="q", deps=[norm])
        self.gemm(layer, "attn.kv_a", cat, t, latent, h, out="kv_a", deps=[norm])
        # normalises the latent (the first kv_lora_rank features); the RoPE key passes through
        latent_norm = kv = self.norm(layer, "attn.kv_a_norm", cat, a.kv_lora_rank,
                                     outputs=("c_kv", "k_pe"))
        rope_width = heads * a.qk_rope_head_dim + a.qk_rope_head_dim
        rope_flops = 6.0 * t * rope_width  # rotate pairs: 4 mul + 2 add per pair of values
        if not self.p.fusion.fused_rope:  # else the attention kernel rotates q and k_pe
            q = kv = self.e.emit(
                layer, "attn.rope", "rope", cat, deps=[q, (kv, "k_pe")], outputs=("q", "k_pe"),
                dims={"tokens": t, "width": rope_width}, dtype=ACT, flops=rope_flops,
                bytes_read=t * rope_width * self.act, bytes_written=t * rope_width * self.act,
            )
            rope_flops = 0.0
        # attention caches the latent and the (rotated) RoPE key of the new tokens
        cached = [(kv, "k_pe"), (latent_norm, "c_kv")]
        kv_cache_dt = bytes_per_element(self.p.kv_dtype)
        if self.b.phase == "decode":
            # absorbed MLA: queries move into the latent space, attention runs over the latent
            q_lat = self.gemm(layer, "attn.q_absorb", cat, t, a.kv_lora_rank, a.qk_nope_head_dim,
                              batch=heads, out="q_lat", deps=[q])
            # the step's q = 1 + mtp queries per sequence read its ctx entries once (the
            # cache and the new tokens); query i attends the ctx - q + 1 + i before it
            q_len, ctx = self.new, self.kv_len
            attended = ctx if q_len == 1 else q_len * ctx - q_len * (q_len - 1) / 2
            seqs = self.seqs
            core = self.e.emit(
                layer, "attn.core", "attention_decode", cat, deps=[q_lat, *cached, q],
                outputs=("o_lat",),
                dims={"seqs": seqs, "heads": heads, "context": ctx, "qk_dim": latent,
                      "v_dim": a.kv_lora_rank, "kv_heads": 1, "kv_dtype": self.p.kv_dtype,
                      "query_tokens": q_len},
                dtype=ACT,
                flops=2.0 * seqs * heads * attended * (latent + a.kv_lora_rank) + rope_flops,
                bytes_read=seqs * ctx * latent * kv_cache_dt + t * heads * latent * self.act,
                bytes_written=t * heads * a.kv_lora_rank * self.act + t * latent * kv_cache_dt,
            )
            attn = self.gemm(layer, "attn.v_absorb", cat, t, a.v_head_dim, a.kv_lora_rank,
                             batch=heads, out="attn_v", deps=[core])
        else:
            # prefill: expand the latent into per-head K and V, then causal attention
            new = self.new
            ctx = self.context
            kv_up = self.gemm(layer, "attn.kv_b", cat, t,
                              heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank,
                              out="kv_up", deps=[(latent_norm, "c_kv")])
            attended = self.seqs * (new * self.b.prefix + new * (new + 1) / 2)
            prefix_read = self.seqs * self.b.prefix * latent * kv_cache_dt
            attn = self.e.emit(
                layer, "attn.core", "attention_prefill", cat, deps=[q, kv_up, *cached],
                outputs=("attn_v",),
                dims={"seqs": self.seqs, "heads": heads, "new_tokens": new, "context": ctx,
                      "qk_dim": qk, "v_dim": a.v_head_dim, "kv_heads": heads,
                      "kv_dtype": self.p.kv_dtype},
                dtype=ACT,
                flops=2.0 * heads * attended * (qk + a.v_head_dim) + rope_flops,
                bytes_read=t * heads * (2 * qk + a.v_head_dim) * self.act + prefix_read,
                bytes_written=t * heads * a.v_head_dim * self.act + t * latent * kv_cache_dt,
            )
        return self.gemm(layer, "attn.o_proj", cat, t, h, heads * a.v_head_dim, out="attn_out",
                         deps=[attn])

    def _gqa(self, layer: int, norm: str) -> str:
        a, h, t = self.m.attention, self.m.hidden_size, self.tokens
        heads = a.num_heads // self.p.tp
        kv_heads = max(1, a.num_kv_heads // self.p.tp)
        d = a.head_dim
        cat = "attention"
        qkv = self.gemm(layer, "attn.qkv_proj", cat, t, (heads + 2 * kv_heads) * d, h,
                        out="qkv", deps=[norm])
        rope_width = (heads + kv_heads) * d
        rope_flops = 3.0 * t * rope_width
        if not self.p.fusion.fused_rope:
            qkv = self.e.emit(
                layer, "attn.rope", "rope", cat, outputs=("qkv",),
                dims={"tokens": t, "width": rope_width}, dtype=ACT, flops=rope_flops,
                bytes_read=t * rope_width * self.act, bytes_written=t * rope_width * self.act,
            )
            rope_flops = 0.0
        window = a.sliding_window if a.layer_types[layer] == "sliding" else None
        kv_dt = bytes_per_element(self.p.kv_dtype)
        kv_row = 2 * kv_heads * d
        if self.b.phase == "decode":
            ctx = min(self.context, window) if window else self.context
            core = self.e.emit(
                layer, "attn.core", "attention_decode", cat, deps=[qkv], outputs=("attn_v",),
                dims={"seqs": self.seqs, "heads": heads, "context": ctx, "qk_dim": d, "v_dim": d,
                      "kv_heads": kv_heads, "kv_dtype": self.p.kv_dtype, "window": window or 0},
                dtype=ACT,
                flops=2.0 * self.seqs * heads * ctx * 2 * d + rope_flops,
                bytes_read=self.seqs * ctx * kv_row * kv_dt + t * heads * d * self.act,
                bytes_written=t * heads * d * self.act + t * kv_row * kv_dt,
            )
        else:
            new, pre = self.new, self.b.prefix
            if window:
                attended = self.seqs * sum(min(pre + i, window) for i in range(1, new + 1))
            else:
                attended = self.seqs * (new * pre + new * (new + 1) / 2)
            core = self.e.emit(
                layer, "attn.core", "attention_prefill", cat, deps=[qkv], outputs=("attn_v",),
                dims={"seqs": self.seqs, "heads": heads, "new_tokens": new,
                      "context": self.context, "qk_dim": d, "v_dim": d, "kv_heads": kv_heads,
                      "kv_dtype": self.p.kv_dtype, "window": window or 0},
                dtype=ACT,
                flops=2.0 * heads * attended * 2 * d + rope_flops,
                bytes_read=t * (heads * d + kv_row) * self.act
                + self.seqs * min(pre, window or pre) * kv_row * kv_dt,
                bytes_written=t * heads * d * self.act + t * kv_row * kv_dt,
            )
        return self.gemm(layer, "attn.o_proj", cat, t, h, heads * d, out="attn_out", deps=[core])

    def dense_mlp(self, layer: int, attn_out: str) -> str:
        h, t, tp = self.m.hidden_size, self.tokens, self.p.tp
        inter = self.m.dense_intermediate_size // tp
        self.add_norm(layer, "ffn_norm", "dense", [attn_out])
        self.gemm(layer, "mlp.gate_up", "dense", t, 2 * inter, h, out="gate_up")
        self.elementwise(layer, "mlp.act", "dense", 2 * inter, inter, 4.0)
        out = self.gemm(layer, "mlp.down", "dense", t, h, inter, out="mlp_out")
        if tp > 1:
            out = self.collective(layer, "mlp.all_reduce", "all_reduce", "tp_comm", t, h, tp, "tp",
                                  out="mlp_out")
        return out

    def _shared_expert(self, layer: int, norm: str, tokens: int, shards: int) -> str:
        h = self.m.hidden_size
        inter = self.m.moe.shared_intermediate_size // shards
        cat = "moe_experts"
        if self.p.fusion.merged_shared_expert:
            up = self.gemm(layer, "moe.shared.gate_up", cat, tokens, 2 * inter, h, wdt=self.edt,
                           dtype=self.expert_compute_dtype, out="gate_up", deps=[norm])
            act = self.elementwise(layer, "moe.shared.act", cat, 2 * inter, inter, 4.0, deps=[up],
                                   tokens=tokens)
        else:
            gate = self.gemm(layer, "moe.shared.gate", cat, tokens, inter, h, wdt=self.edt,
                             dtype=self.expert_compute_dtype, out="gate", deps=[norm])
            up = self.gemm(layer, "moe.shared.up", cat, tokens, inter, h, wdt=self.edt,
                           dtype=self.expert_compute_dtype, out="up", deps=[norm])
            act = self.elementwise(layer, "moe.shared.act", cat, 2 * inter, inter, 4.0,
                                   deps=[gate, up], tokens=tokens)
        return self.gemm(layer, "moe.shared.down", cat, tokens, h, inter, wdt=self.edt,
                         dtype=self.expert_compute_dtype, out="shared_out", deps=[act])

    def moe(self, layer: int, attn_out: str) -> list[Read]:
        """The MoE block; returns the values the next layer's input adds up."""
        m, p = self.m, self.p
        h, moe = m.hidden_size, m.moe
        norm = self.add_norm(layer, "ffn_norm", "moe_experts", [attn_out])
        # under EP with tp > 1, the tp ranks of a dp group split its tokens before dispatch
        tokens = math.ceil(self.tokens / p.tp) if p.expert_parallel else self.tokens
        router = self.e.emit(
            layer, "moe.router", "router", "moe_experts", deps=[norm], outputs=("topk",),
            dims={"tokens": tokens, "hidden": h, "experts": moe.num_experts, "top_k": moe.top_k,
                  "n_group": moe.n_group, "topk_group": moe.topk_group},
            dtype=ACT,
            flops=2.0 * tokens * h * moe.num_experts + 4.0 * tokens * moe.num_experts,
            bytes_read=h * moe.num_experts * self.act + tokens * h * self.act,
            bytes_written=tokens * moe.top_k * 8,  # int32 ids + fp32 weights
            weight_bytes=h * moe.num_experts * self.act,
        )
        # the rank's expert slots (replicas included); expectations below treat a token's top-k
        # choices as uniform over the slots (the step simulator samples the real split)
        slots = p.expert_slots(m)
        experts_local = p.slots_per_gpu(m)
        inter = moe.intermediate_size // p.moe_tp
        if p.expert_parallel:
            hit = prob_rank_hit(slots, experts_local, moe.top_k)
            per_peer_tokens = tokens * hit
            meta = moe.top_k * 8
            disp_row = h * bytes_per_element(p.dispatch_dtype) + meta
            comb_row = h * self.act
            received = per_peer_tokens * p.ep  # token copies arriving from all ranks
            # the token rows of the norm go to the ranks the router chose
            dispatch = self.ep_exchange(
                layer, "dispatch", tokens, per_peer_tokens, disp_row, deps=[router, (norm, "h")],
                out="recv", dtype=p.dispatch_dtype, flops=0.0,
                bytes_read=tokens * h * self.act, bytes_written=received * disp_row)
            global_tokens = tokens * p.ep
            expert_inputs: list[Read] = [dispatch]
        else:  # every expert is local: the experts read the routing and the norm's rows
            expert_inputs = [router, (norm, "h")]
            global_tokens = tokens
        pairs = tokens * moe.top_k  # under EP a rank receives, on average, what it sends
        untouched = (1.0 - moe.top_k / slots) ** global_tokens
        active = experts_local * (1.0 - untouched)
        shared_in_moe = p.fusion.shared_expert_in_moe
        if shared_in_moe and p.expert_parallel:  # the shared expert reads the rank's own rows
            expert_inputs = [*expert_inputs, (norm, "h")]
        experts = self._routed_experts(layer, expert_inputs, pairs, experts_local, active, inter,
                                       shared_tokens=tokens if shared_in_moe else 0)
        if p.expert_parallel:
            # the results go back where the dispatch's layout says they came from
            combine = self.ep_exchange(
                layer, "combine", tokens, per_peer_tokens, comb_row,
                deps=[experts, (dispatch, "recv")], out="routed_out", dtype=ACT,
                flops=float(pairs * h), bytes_read=pairs * h * self.act,
                bytes_written=tokens * h * self.act)
            outputs = [combine]
        else:
            outputs = [experts]
        if moe.num_shared_experts and shared_in_moe:
            outputs.append((experts, "shared_out"))
        elif moe.num_shared_experts:
            shards = 1 if p.expert_parallel else p.tp
            outputs.append(self._shared_expert(layer, norm, tokens, shards))
        if p.tp > 1:
            kind, name = ("all_gather", "moe.all_gather") if p.expert_parallel else (
                "all_reduce", "moe.all_reduce")
            width_tokens = tokens if p.expert_parallel else self.tokens
            outputs = [self.collective(layer, name, kind, "tp_comm", width_tokens, h, p.tp, "tp",
                                       out="moe_out", deps=outputs)]
        return outputs

    def _routed_experts(self, layer: int, inputs: Sequence[Read], pairs: float,
                        experts_local: int, active: float, inter: int,
                        shared_tokens: int = 0) -> str:
        """This rank's routed experts over ``pairs`` (token, expert) pairs: one fused op, or
        gate/up, the activation and down; returns the op that writes ``expert_out``.

        ``shared_tokens`` > 0 (``Fusion.shared_expert_in_moe``): the fused op also runs the
        shared expert(s) over the rank's own ``shared_tokens`` rows, as more local experts, and
        writes ``shared_out`` too (dims ``shared_experts``, ``shared_pairs``; ``pairs`` stays
        the routed pairs, which the routing sets)."""
        h, p = self.m.hidden_size, self.p
        bias = (2 * inter + h) if self.m.moe.expert_bias else 0
        cat = "moe_experts"
        ex_dt = self.expert_compute_dtype
        if p.fusion.fused_moe:
            shared = self.m.moe.num_shared_experts if shared_tokens else 0
            shared_pairs = shared_tokens * shared
            all_pairs = pairs + shared_pairs
            weights = (active + shared) * (3 * h * inter * self.edt + bias * self.act)
            experts = self.e.emit(
                layer, "moe.experts_shared" if shared else "moe.experts", "grouped_gemm", cat,
                deps=inputs, outputs=("expert_out", "shared_out") if shared else ("expert_out",),
                dims={"pairs": pairs, "experts": experts_local, "active_experts": active,
                      "n": 2 * inter, "k": h, "inter": inter, "hidden": h, "gemms": 2,
                      "fused": 1, "top_k": self.m.moe.top_k, "shared_experts": shared,
                      "shared_pairs": shared_pairs},
                dtype=ex_dt,
                flops=6.0 * all_pairs * h * inter + 4.0 * all_pairs * inter,
                bytes_read=weights + all_pairs * h * self.act,
                bytes_written=all_pairs * h * self.act,
                weight_bytes=weights, routed=True,
            )
        else:
            w_up = active * (2 * h * inter * self.edt + bias * self.act)
            # writes the pair layout too (which rows go through which local expert), for down
            gate_up = self.e.emit(
                layer, "moe.experts.gate_up", "grouped_gemm", cat, deps=inputs,
                outputs=("gate_up", "pairs"),
                dims={"pairs": pairs, "experts": experts_local, "active_experts": active,
                      "n": 2 * inter, "k": h, "gemms": 1, "fused": 0},
                dtype=ex_dt, flops=4.0 * pairs * h * inter,
                bytes_read=w_up + pairs * h * self.act, bytes_written=pairs * 2 * inter * self.act,
                weight_bytes=w_up, routed=True,
            )
            act = self.elementwise(layer, "moe.experts.act", cat, 2 * inter, inter, 4.0,
                                   tokens=pairs, routed=True)
            w_down = active * h * inter * self.edt
            experts = self.e.emit(
                layer, "moe.experts.down", "grouped_gemm", cat, deps=[act, (gate_up, "pairs")],
                outputs=("expert_out",),
                dims={"pairs": pairs, "experts": experts_local, "active_experts": active,
                      "n": h, "k": inter, "gemms": 1, "fused": 0},
                dtype=ex_dt, flops=2.0 * pairs * h * inter,
                bytes_read=w_down + pairs * inter * self.act, bytes_written=pairs * h * self.act,
                weight_bytes=w_down, routed=True,
            )
        return experts

    def head(self, layer_outputs: Sequence[str]) -> str:
        self.e.begin_block()
        h, v, tp = self.m.hidden_size, self.m.vocab_size, self.p.tp
        # prefill only needs the logits of each sequence's last token
        rows = self.tokens if self.b.phase == "decode" else self.seqs
        final = self.add_norm(NO_LAYER, "final_norm", "other", layer_outputs)
        weights = h * (v // tp) * self.act
        out = self.e.emit(
            NO_LAYER, "lm_head", "lm_head", "other", outputs=("logits",),
            dims={"tokens": rows, "hidden": h, "vocab": v // tp},
            dtype=ACT, flops=2.0 * rows * h * (v // tp),
            bytes_read=weights + rows * h * self.act, bytes_written=rows * (v // tp) * 4,
            weight_bytes=weights,
        )
        if tp > 1:
            out = self.collective(NO_LAYER, "lm_head.all_gather", "all_gather", "tp_comm", rows,
                                  v // tp, tp, "tp", out="logits")
        sample = self.e.emit(
            NO_LAYER, "sample", "sample", "other", deps=[out], outputs=("next_tokens",),
            dims={"tokens": rows, "vocab": v}, dtype="fp32", flops=float(rows * v),
            bytes_read=rows * v * 4, bytes_written=rows * 8,
        )
        self.e.results = {"hidden": (final, "h"), "logits": (out, "logits"),
                          "next_tokens": (sample, "next_tokens")}
        return sample


def build_step_graph(model: ModelConfig, plan: ParallelPlan, batch: Batch) -> OpGraph:
    """The op graph of one forward step of one rank (docs/design.md section 2.1).

    Args:
        model: the model.
        plan: its parallel layout and execution options (validated here).
        batch: the step's batch per dp group: ``Batch.decode(512, 2100)`` is 512 sequences of one
            new token attending to 2100 cached tokens each.

    Returns:
        An :class:`OpGraph` with one op per kernel per microbatch, data-dependency edges, and the
        schedule. Under DBO (``plan.microbatches == 2``) the sequences are split in two near-equal
        halves; a batch of one sequence runs as one microbatch.
    """
    plan.validate(model)
    microbatches = min(plan.microbatches, batch.seqs)
    seq_split = _split(batch.seqs, microbatches)
    emitters: list[_Emitter] = []
    for mb, seqs in enumerate(seq_split):
        emitter = _Emitter(mb)
        _build_microbatch(model, plan, batch, seqs, emitter)
        emitters.append(emitter)

    graph = nx.DiGraph()
    ops: dict[str, Op] = {}
    for emitter in emitters:
        for op in emitter.ops.values():
            ops[op.id] = op
            graph.add_node(op.id)
        for ident, reads in emitter.reads.items():
            for producer, value in reads:
                if graph.has_edge(producer, ident):  # another value of the same producer
                    edge = graph.edges[producer, ident]
                    assert value not in edge["values"], f"{ident} reads {producer}:{value} twice"
                    edge["values"] += (value,)
                else:
                    graph.add_edge(producer, ident, values=(value,))
    schedule = build_schedule(
        [e.blocks for e in emitters], lambda op_id: ops[op_id].is_collective
    )
    return OpGraph(
        model=model, plan=plan, batch=batch, ops=ops, graph=graph, schedule=schedule,
        captured=plan.graph_mode and batch.phase == "decode",
        microbatch_tokens=tuple(s * query_tokens(plan, batch) for s in seq_split),
        microbatch_seqs=tuple(seq_split),
        results=tuple(e.results for e in emitters),
    )


def layer_class(model: ModelConfig, layer: int) -> tuple[bool, bool, str]:
    """What, beside the batch, sets the numbers of decoder layer ``layer``'s ops: whether it
    opens the residual stream (the first layer's norm adds nothing), whether it is an MoE layer,
    and its attention type (sliding layers attend to a window). Layers of one class have ops of
    equal dims, FLOPs and bytes at every batch."""
    return (layer == 0, model.is_moe_layer(layer), model.attention.layer_types[layer])


@functools.lru_cache(maxsize=64)  # asked once per batch costed on a compiled step
def representative_layers(model: ModelConfig) -> tuple[int, ...]:
    """Per decoder layer, the first layer of its class (``layer_class``). Example: DeepSeek-R1
    (3 dense layers, then 58 MoE layers): ``(0, 1, 1, 3, 3, ..., 3)``."""
    first: dict[tuple[bool, bool, str], int] = {}
    return tuple(first.setdefault(layer_class(model, layer), layer)
                 for layer in range(model.num_layers))


#: the op kinds whose ops read a batch's context (and a prefill's prefix): the attention cores.
#: Every other op of a step is a function of the plan, the phase, the sequences of each
#: microbatch and the new tokens per sequence alone (``tests/test_graph_context.py`` checks it
#: over the shipped models), so batches differing in context alone differ in these ops alone.
CONTEXT_KINDS = frozenset({"attention_decode", "attention_prefill"})


def build_representative_ops(model: ModelConfig, plan: ParallelPlan, batch: Batch,
                             kinds: frozenset[str] | None = None) -> dict[str, Op]:
    """The ops of ``build_step_graph(model, plan, batch)`` with each class of decoder layers
    built once (its first layer, ``representative_layers``): every op of the full graph equals,
    in all but its id and layer, the op of the same name, microbatch and draft pass in its
    layer's representative. What a compiled step needs to cost a new batch without building
    the graph again (no edges, no schedule). ``kinds``: only the ops of these kinds
    (``CONTEXT_KINDS``: what a new context of a costed batch changes)."""
    plan.validate(model)
    layers = sorted(set(representative_layers(model)))
    ops: dict[str, Op] = {}
    seq_split = _split(batch.seqs, min(plan.microbatches, batch.seqs))
    first: dict[str, Op] = {}
    for mb, seqs in enumerate(seq_split):
        if mb and seqs == seq_split[0]:
            # a microbatch of as many sequences as the first has its ops but for id and index
            for op in first.values():
                ident = op_id(op.layer, op.name, mb, op.draft)
                ops[ident] = op.in_microbatch(mb, ident)
            continue
        emitter = _OpsOnlyEmitter(mb, kinds)
        _build_microbatch(model, plan, batch, seqs, emitter, layers)
        ops.update(emitter.ops)
        if not mb:
            first = emitter.ops
    return ops


def _build_microbatch(model: ModelConfig, plan: ParallelPlan, batch: Batch, seqs: int,
                      emitter: _Emitter, layers: Iterable[int] | None = None) -> None:
    b = _StepBuilder(model, plan, batch, seqs, emitter)
    layer_outputs = [b.embedding()]
    for layer in range(model.num_layers) if layers is None else layers:
        emitter.begin_block()
        # the fused add+norm at the top of a layer reads every output of the previous one
        attn = b.attention(layer, layer_outputs)
        if model.is_moe_layer(layer):
            layer_outputs = b.moe(layer, attn)
        else:
            layer_outputs = [b.dense_mlp(layer, attn)]
    b.head(layer_outputs)
    for k in range(plan.mtp):  # the MTP draft module, once per draft token
        emit_draft_pass(b, k)
