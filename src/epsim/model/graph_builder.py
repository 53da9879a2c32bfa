"""The blocks of one step's op graph: ``StepBuilder`` emits a microbatch's embedding, decoder
layers (attention, dense MLP, MoE with its shared and routed experts) and head, each made of the
generic op shapes of ``epsim.model.graph_emit``.

``epsim.model.graph`` runs it over the main model (``build_step_graph``); ``epsim.model.mtp`` runs
it over the MTP draft module's passes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .attention_keys import indexer_cost, keys_sum
from .dtypes import bytes_per_element
from .graph_emit import ACT, OpShapes, Read
from .ids import NO_LAYER


def prob_rank_hit(num_experts: int, experts_per_rank: int, top_k: int) -> float:
    """Chance that a token's ``top_k`` distinct experts (uniform) include one of a given rank's."""
    miss = math.comb(num_experts - experts_per_rank, top_k) / math.comb(num_experts, top_k)
    return 1.0 - miss


class StepBuilder(OpShapes):
    """Builds one microbatch's ops for a model, plan and batch (see ``build_step_graph``):
    ``embedding()``, then per decoder layer ``attention`` and ``moe`` or ``dense_mlp``, then
    ``head``; each returns what the next reads. The fields are :class:`OpShapes`'."""


    def embedding(self) -> str:
        act_bytes = self.act_elem_bytes
        self.emitter.begin_block()
        h, t = self.model.hidden_size, self.tokens
        out = self.emitter.emit(
            NO_LAYER, "embed", "embedding", "other", deps=[], outputs=("hidden",),
            dims={"tokens": t, "hidden": h, "vocab": self.model.vocab_size // self.plan.tp},
            dtype=ACT, flops=0.0,
            bytes_read=t * h * act_bytes + t * 8, bytes_written=t * h * act_bytes,
        )
        if self.plan.tp > 1:  # vocab-parallel table: each rank fills its rows, then sum
            out = self.collective(NO_LAYER, "embed.all_reduce", "all_reduce", "tp_comm", t, h,
                                  self.plan.tp, "tp", out="hidden")
        return out

    def attention(self, layer: int, layer_inputs: Sequence[str]) -> str:
        a = self.model.attention
        norm = self.add_norm(layer, "attn_norm", "attention", layer_inputs)
        if a.kind == "mla":
            out = self._mla(layer, norm)
        else:
            out = self._gqa(layer, norm)
        if self.plan.tp > 1:
            out = self.collective(layer, "attn.all_reduce", "all_reduce", "tp_comm", self.tokens,
                                  self.model.hidden_size, self.plan.tp, "tp", out="attn_out",
                                  deps=[out])
        return out

    def _mla(self, layer: int, norm: str) -> str:
        act_bytes = self.act_elem_bytes
        a, h, t = self.model.attention, self.model.hidden_size, self.tokens
        heads = a.num_heads // self.plan.tp
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        latent = a.kv_lora_rank + a.qk_rope_head_dim
        cat = "attention"
        q_a = None
        if a.q_lora_rank:
            self.gemm(layer, "attn.q_a", cat, t, a.q_lora_rank, h, out="q_a", deps=[norm])
            q_a = self.norm(layer, "attn.q_a_norm", cat, a.q_lora_rank, outputs=("q_a",))
            q = self.gemm(layer, "attn.q_b", cat, t, heads * qk, a.q_lora_rank, out="q")
        else:
            q = self.gemm(layer, "attn.q_proj", cat, t, heads * qk, h, out="q", deps=[norm])
        self.gemm(layer, "attn.kv_a", cat, t, latent, h, out="kv_a", deps=[norm])
        # normalises the latent (the first kv_lora_rank features); the RoPE key passes through
        latent_norm = kv = self.norm(layer, "attn.kv_a_norm", cat, a.kv_lora_rank,
                                     outputs=("c_kv", "k_pe"))
        rope_width = heads * a.qk_rope_head_dim + a.qk_rope_head_dim
        rope_flops = 6.0 * t * rope_width  # rotate pairs: 4 mul + 2 add per pair of values
        if not self.plan.fusion.fused_rope:  # else the attention kernel rotates q and k_pe
            q = kv = self.emitter.emit(
                layer, "attn.rope", "rope", cat, deps=[q, (kv, "k_pe")], outputs=("q", "k_pe"),
                dims={"tokens": t, "width": rope_width}, dtype=ACT, flops=rope_flops,
                bytes_read=t * rope_width * act_bytes, bytes_written=t * rope_width * act_bytes,
            )
            rope_flops = 0.0
        # attention caches the latent and the (rotated) RoPE key of the new tokens
        cached: list[Read] = [(kv, "k_pe"), (latent_norm, "c_kv")]
        kv_cache_dt = bytes_per_element(self.plan.kv_dtype)
        if a.sparse and q_a is not None:  # DSA: the indexer picks each query's keys
            cached.append(self._indexer(layer, norm, q_a))
        if self.batch.phase == "decode":
            attn = self._mla_decode(layer, q, cached, heads, rope_flops)
        else:
            # prefill: expand the latent into per-head K and V, then causal attention
            new = self.new_tokens
            ctx = self.context
            kv_up = self.gemm(layer, "attn.kv_b", cat, t,
                              heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank,
                              out="kv_up", deps=[(latent_norm, "c_kv")])
            pre = self.batch.prefix
            attended = self.seqs * keys_sum("full", pre + 1, pre + new, topk=a.index_topk)
            prefix_read = self.seqs * pre * latent * kv_cache_dt
            attn = self.emitter.emit(
                layer, "attn.core", "attention_prefill", cat, deps=[q, kv_up, *cached],
                outputs=("attn_v",),
                dims={"seqs": self.seqs, "heads": heads, "new_tokens": new, "context": ctx,
                      "qk_dim": qk, "v_dim": a.v_head_dim, "kv_heads": heads,
                      "kv_dtype": self.plan.kv_dtype, "topk": a.index_topk},
                dtype=ACT,
                flops=2.0 * heads * attended * (qk + a.v_head_dim) + rope_flops,
                bytes_read=t * heads * (2 * qk + a.v_head_dim) * act_bytes + prefix_read,
                bytes_written=t * heads * a.v_head_dim * act_bytes + t * latent * kv_cache_dt,
            )
        return self.gemm(layer, "attn.o_proj", cat, t, h, heads * a.v_head_dim, out="attn_out",
                         deps=[attn])

    def _mla_decode(self, layer: int, q: str, cached: Sequence[Read], heads: int,
                    rope_flops: float) -> str:
        """Absorbed MLA decode: queries move into the latent space (``attn.q_absorb``),
        attention runs over the latent cache (under DSA over each query's top-k entries), the
        result leaves it (``attn.v_absorb``)."""
        act_bytes, a, t, cat = self.act_elem_bytes, self.model.attention, self.tokens, "attention"
        latent = a.kv_lora_rank + a.qk_rope_head_dim
        kv_cache_dt = bytes_per_element(self.plan.kv_dtype)
        q_lat = self.gemm(layer, "attn.q_absorb", cat, t, a.kv_lora_rank, a.qk_nope_head_dim,
                          batch=heads, out="q_lat", deps=[q])
        # the step's q = 1 + mtp queries per sequence read its ctx entries once (the
        # cache and the new tokens); query i attends the ctx - q + 1 + i before it
        q_len, ctx = self.new_tokens, self.kv_len
        topk = a.index_topk
        attended = keys_sum("full", ctx - q_len + 1, ctx, topk=topk)
        # DSA gathers each query's top-k rows: at most min(ctx, q_len * topk) distinct ones
        rows = min(ctx, q_len * topk) if topk else ctx
        seqs = self.seqs
        core = self.emitter.emit(
            layer, "attn.core", "attention_decode", cat, deps=[q_lat, *cached, q],
            outputs=("o_lat",),
            dims={"seqs": seqs, "heads": heads, "context": ctx, "qk_dim": latent,
                  "v_dim": a.kv_lora_rank, "kv_heads": 1, "kv_dtype": self.plan.kv_dtype,
                  "query_tokens": q_len, "topk": topk, "keys": min(ctx, topk) if topk else ctx},
            dtype=ACT,
            flops=2.0 * seqs * heads * attended * (latent + a.kv_lora_rank) + rope_flops,
            bytes_read=seqs * rows * latent * kv_cache_dt + t * heads * latent * act_bytes,
            bytes_written=t * heads * a.kv_lora_rank * act_bytes + t * latent * kv_cache_dt,
        )
        return self.gemm(layer, "attn.v_absorb", cat, t, a.v_head_dim, a.kv_lora_rank,
                         batch=heads, out="attn_v", deps=[core])

    def _indexer(self, layer: int, norm: str, q_a: str) -> Read:
        """DSA's lightning indexer (``epsim.model.attention_keys``): its query heads from the
        compressed query, one key and the per-head weights from the layer's input, then one op
        that normalises and rotates the key, caches it (FP8), scores every cached key and keeps
        the ``index_topk`` best per query (``topk_idx``). The indexer is replicated over tp."""
        a, h, t = self.model.attention, self.model.hidden_size, self.tokens
        heads, dim, cat = a.index_n_heads, a.index_head_dim, "attention"
        iq = self.gemm(layer, "attn.indexer.wq_b", cat, t, heads * dim, a.q_lora_rank or 0,
                       out="index_q", deps=[q_a])
        ik = self.gemm(layer, "attn.indexer.wk", cat, t, dim, h, out="index_k", deps=[norm])
        # the head weights stay bf16 in the checkpoint (not among its FP8 weights)
        iw = self.gemm(layer, "attn.indexer.weights_proj", cat, t, heads, h, out="index_w",
                       deps=[norm], weight_elem_bytes=self.act_elem_bytes, dtype=ACT)
        q_len = self.new_tokens
        if self.batch.phase == "decode":
            first, rows = self.kv_len - q_len + 1, self.kv_len
        else:
            first, rows = self.batch.prefix + 1, self.context
        cost = indexer_cost(self.seqs, q_len, first, rows, heads, dim, a.index_topk,
                            self.act_elem_bytes)
        return self.emitter.emit(
            layer, "attn.indexer", "indexer", cat, deps=[iq, ik, iw], outputs=("topk_idx",),
            dims={"seqs": self.seqs, "query_tokens": q_len, "context": rows, "heads": heads,
                  "head_dim": dim, "topk": a.index_topk},
            dtype="fp8", flops=cost.flops, bytes_read=cost.bytes_read,
            bytes_written=cost.bytes_written,
        )

    def _gqa(self, layer: int, norm: str) -> str:
        act_bytes = self.act_elem_bytes
        a, h, t = self.model.attention, self.model.hidden_size, self.tokens
        heads = a.num_heads // self.plan.tp
        kv_heads = max(1, a.num_kv_heads // self.plan.tp)
        d = a.head_dim
        cat = "attention"
        qkv = self.gemm(layer, "attn.qkv_proj", cat, t, (heads + 2 * kv_heads) * d, h,
                        out="qkv", deps=[norm])
        if a.qk_norm:  # per-head RMSNorm of queries and keys before RoPE (Qwen3, GLM-4.5)
            width = (heads + kv_heads) * d
            qkv = self.emitter.emit(
                layer, "attn.qk_norm", "norm", cat, outputs=("qkv",),
                dims={"tokens": t, "width": width, "residual": 0, "head_dim": d},
                dtype=ACT, flops=5.0 * t * width,
                bytes_read=t * width * act_bytes + 2 * d * act_bytes,
                bytes_written=t * width * act_bytes, weight_bytes=2 * d * act_bytes,
            )
        # partial RoPE (GLM) rotates a share of each head; NoPE layers (Llama-4) none
        rotates = layer not in a.nope_layers
        if a.qk_l2_norm and rotates:
            # Llama-4's weightless per-head norm follows RoPE; a rotation keeps a head's norm,
            # so normalising first is the same
            width = (heads + kv_heads) * d
            qkv = self.emitter.emit(
                layer, "attn.qk_l2_norm", "norm", cat, outputs=("qkv",),
                dims={"tokens": t, "width": width, "residual": 0, "head_dim": d},
                dtype=ACT, flops=4.0 * t * width, bytes_read=t * width * act_bytes,
                bytes_written=t * width * act_bytes,
            )
        rope_width = int((heads + kv_heads) * d * a.rotary_fraction) if rotates else 0
        rope_flops = 3.0 * t * rope_width
        if rope_width and not self.plan.fusion.fused_rope:
            qkv = self.emitter.emit(
                layer, "attn.rope", "rope", cat, outputs=("qkv",),
                dims={"tokens": t, "width": rope_width}, dtype=ACT, flops=rope_flops,
                bytes_read=t * rope_width * act_bytes, bytes_written=t * rope_width * act_bytes,
            )
            rope_flops = 0.0
        kind = a.layer_type(layer)
        # a chunked layer's cache holds at most its chunk, as a sliding layer's its window
        window = a.kv_bound(kind)
        chunk = a.chunk_size if kind == "chunked" else None
        slide = a.sliding_window if kind == "sliding" and a.sliding_window else 0
        kv_dt = bytes_per_element(self.plan.kv_dtype)
        kv_row = 2 * kv_heads * d
        if self.batch.phase == "decode":
            # one context for every sequence: a chunked layer is costed at its bound
            ctx = min(self.context, window) if window else self.context
            core = self.emitter.emit(
                layer, "attn.core", "attention_decode", cat, deps=[qkv], outputs=("attn_v",),
                dims={"seqs": self.seqs, "heads": heads, "context": ctx, "qk_dim": d, "v_dim": d,
                      "kv_heads": kv_heads, "kv_dtype": self.plan.kv_dtype,
                      "window": slide, "chunk": chunk or 0},
                dtype=ACT,
                flops=2.0 * self.seqs * heads * ctx * 2 * d + rope_flops,
                bytes_read=self.seqs * ctx * kv_row * kv_dt + t * heads * d * act_bytes,
                bytes_written=t * heads * d * act_bytes + t * kv_row * kv_dt,
            )
        else:
            new, pre = self.new_tokens, self.batch.prefix
            attended = self.seqs * keys_sum(kind, pre + 1, pre + new, window=a.sliding_window,
                                            chunk=a.chunk_size)
            core = self.emitter.emit(
                layer, "attn.core", "attention_prefill", cat, deps=[qkv], outputs=("attn_v",),
                dims={"seqs": self.seqs, "heads": heads, "new_tokens": new,
                      "context": self.context, "qk_dim": d, "v_dim": d, "kv_heads": kv_heads,
                      "kv_dtype": self.plan.kv_dtype, "window": slide,
                      "chunk": chunk or 0},
                dtype=ACT,
                flops=2.0 * heads * attended * 2 * d + rope_flops,
                bytes_read=t * (heads * d + kv_row) * act_bytes
                + self.seqs * min(pre, window or pre) * kv_row * kv_dt,
                bytes_written=t * heads * d * act_bytes + t * kv_row * kv_dt,
            )
        return self.gemm(layer, "attn.o_proj", cat, t, h, heads * d, out="attn_out", deps=[core])

    def dense_mlp(self, layer: int, attn_out: str) -> str:
        h, t, tp = self.model.hidden_size, self.tokens, self.plan.tp
        inter = self.model.dense_intermediate_size // tp
        self.add_norm(layer, "ffn_norm", "dense", [attn_out])
        self.gemm(layer, "mlp.gate_up", "dense", t, 2 * inter, h, out="gate_up")
        self.elementwise(layer, "mlp.act", "dense", 2 * inter, inter, 4.0)
        out = self.gemm(layer, "mlp.down", "dense", t, h, inter, out="mlp_out")
        if tp > 1:
            out = self.collective(layer, "mlp.all_reduce", "all_reduce", "tp_comm", t, h, tp, "tp",
                                  out="mlp_out")
        return out

    def _shared_expert(self, layer: int, norm: str, tokens: int, shards: int) -> str:
        h = self.model.hidden_size
        inter = self.model.moe.shared_intermediate_size // shards
        cat = "moe_experts"
        # the shared expert's weights are stored (and computed) as the routed experts'
        elem, dtype = self.expert_elem_bytes, self.expert_compute_dtype
        if self.plan.fusion.merged_shared_expert:
            up = self.gemm(layer, "moe.shared.gate_up", cat, tokens, 2 * inter, h,
                           weight_elem_bytes=elem, dtype=dtype, out="gate_up", deps=[norm])
            act = self.elementwise(layer, "moe.shared.act", cat, 2 * inter, inter, 4.0, deps=[up],
                                   tokens=tokens)
        else:
            gate = self.gemm(layer, "moe.shared.gate", cat, tokens, inter, h,
                             weight_elem_bytes=elem, dtype=dtype, out="gate", deps=[norm])
            up = self.gemm(layer, "moe.shared.up", cat, tokens, inter, h,
                           weight_elem_bytes=elem, dtype=dtype, out="up", deps=[norm])
            act = self.elementwise(layer, "moe.shared.act", cat, 2 * inter, inter, 4.0,
                                   deps=[gate, up], tokens=tokens)
        return self.gemm(layer, "moe.shared.down", cat, tokens, h, inter,
                         weight_elem_bytes=elem, dtype=dtype, out="shared_out", deps=[act])

    def moe(self, layer: int, attn_out: str) -> list[Read]:
        """The MoE block; returns the values the next layer's input adds up."""
        act_bytes = self.act_elem_bytes
        model, plan = self.model, self.plan
        h, moe = model.hidden_size, model.moe
        norm = self.add_norm(layer, "ffn_norm", "moe_experts", [attn_out])
        # under EP with tp > 1, the tp ranks of a dp group split its tokens before dispatch
        tokens = math.ceil(self.tokens / plan.tp) if plan.expert_parallel else self.tokens
        router = self.emitter.emit(
            layer, "moe.router", "router", "moe_experts", deps=[norm], outputs=("topk",),
            dims={"tokens": tokens, "hidden": h, "experts": moe.num_experts, "top_k": moe.top_k,
                  "n_group": moe.n_group, "topk_group": moe.topk_group},
            dtype=ACT,
            flops=2.0 * tokens * h * moe.num_experts + 4.0 * tokens * moe.num_experts,
            bytes_read=h * moe.num_experts * act_bytes + tokens * h * act_bytes,
            bytes_written=tokens * moe.top_k * 8,  # int32 ids + fp32 weights
            weight_bytes=h * moe.num_experts * act_bytes,
        )
        # the rank's expert slots (replicas included); expectations below treat a token's top-k
        # choices as uniform over the slots (the step simulator samples the real split)
        slots = plan.expert_slots(model)
        experts_local = plan.slots_per_gpu(model)
        inter = moe.intermediate_size // plan.moe_tp
        if plan.expert_parallel:
            hit = prob_rank_hit(slots, experts_local, moe.top_k)
            per_peer_tokens = tokens * hit
            meta = moe.top_k * 8
            disp_row = h * bytes_per_element(plan.dispatch_dtype) + meta
            comb_row = h * act_bytes
            received = per_peer_tokens * plan.ep  # token copies arriving from all ranks
            # the token rows of the norm go to the ranks the router chose
            dispatch = self.ep_exchange(
                layer, "dispatch", tokens, per_peer_tokens, disp_row, deps=[router, (norm, "h")],
                out="recv", dtype=plan.dispatch_dtype, flops=0.0,
                bytes_read=tokens * h * act_bytes, bytes_written=received * disp_row)
            global_tokens = tokens * plan.ep
            expert_inputs: list[Read] = [dispatch]
        else:  # every expert is local: the experts read the routing and the norm's rows
            expert_inputs = [router, (norm, "h")]
            global_tokens = tokens
        pairs = tokens * moe.top_k  # under EP a rank receives, on average, what it sends
        untouched = (1.0 - moe.top_k / slots) ** global_tokens
        active = experts_local * (1.0 - untouched)
        shared_in_moe = plan.fusion.shared_expert_in_moe
        if shared_in_moe and plan.expert_parallel:  # the shared expert reads the rank's own rows
            expert_inputs = [*expert_inputs, (norm, "h")]
        experts = self._routed_experts(layer, expert_inputs, pairs, experts_local, active, inter,
                                       shared_tokens=tokens if shared_in_moe else 0)
        if plan.expert_parallel:
            # the results go back where the dispatch's layout says they came from
            combine = self.ep_exchange(
                layer, "combine", tokens, per_peer_tokens, comb_row,
                deps=[experts, (dispatch, "recv")], out="routed_out", dtype=ACT,
                flops=float(pairs * h), bytes_read=pairs * h * act_bytes,
                bytes_written=tokens * h * act_bytes)
            outputs = [combine]
        else:
            outputs = [experts]
        if moe.num_shared_experts and shared_in_moe:
            outputs.append((experts, "shared_out"))
        elif moe.num_shared_experts:
            shards = 1 if plan.expert_parallel else plan.tp
            outputs.append(self._shared_expert(layer, norm, tokens, shards))
        if plan.tp > 1:
            kind, name = ("all_gather", "moe.all_gather") if plan.expert_parallel else (
                "all_reduce", "moe.all_reduce")
            width_tokens = tokens if plan.expert_parallel else self.tokens
            outputs = [self.collective(layer, name, kind, "tp_comm", width_tokens, h, plan.tp, "tp",
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
        act_bytes = self.act_elem_bytes
        h, plan = self.model.hidden_size, self.plan
        expert_bytes = self.expert_elem_bytes
        bias = (2 * inter + h) if self.model.moe.expert_bias else 0
        cat = "moe_experts"
        ex_dt = self.expert_compute_dtype
        if plan.fusion.fused_moe:
            shared = self.model.moe.num_shared_experts if shared_tokens else 0
            shared_pairs = shared_tokens * shared
            all_pairs = pairs + shared_pairs
            weights = (active + shared) * (3 * h * inter * expert_bytes + bias * act_bytes)
            experts = self.emitter.emit(
                layer, "moe.experts_shared" if shared else "moe.experts", "grouped_gemm", cat,
                deps=inputs, outputs=("expert_out", "shared_out") if shared else ("expert_out",),
                dims={"pairs": pairs, "experts": experts_local, "active_experts": active,
                      "n": 2 * inter, "k": h, "inter": inter, "hidden": h, "gemms": 2,
                      "fused": 1, "top_k": self.model.moe.top_k, "shared_experts": shared,
                      "shared_pairs": shared_pairs},
                dtype=ex_dt,
                flops=6.0 * all_pairs * h * inter + 4.0 * all_pairs * inter,
                bytes_read=weights + all_pairs * h * act_bytes,
                bytes_written=all_pairs * h * act_bytes,
                weight_bytes=weights, routed=True,
            )
        else:
            w_up = active * (2 * h * inter * expert_bytes + bias * act_bytes)
            # writes the pair layout too (which rows go through which local expert), for down
            gate_up = self.emitter.emit(
                layer, "moe.experts.gate_up", "grouped_gemm", cat, deps=inputs,
                outputs=("gate_up", "pairs"),
                dims={"pairs": pairs, "experts": experts_local, "active_experts": active,
                      "n": 2 * inter, "k": h, "gemms": 1, "fused": 0},
                dtype=ex_dt, flops=4.0 * pairs * h * inter,
                bytes_read=w_up + pairs * h * act_bytes,
                bytes_written=pairs * 2 * inter * act_bytes,
                weight_bytes=w_up, routed=True,
            )
            act = self.elementwise(layer, "moe.experts.act", cat, 2 * inter, inter, 4.0,
                                   tokens=pairs, routed=True)
            w_down = active * h * inter * expert_bytes
            experts = self.emitter.emit(
                layer, "moe.experts.down", "grouped_gemm", cat, deps=[act, (gate_up, "pairs")],
                outputs=("expert_out",),
                dims={"pairs": pairs, "experts": experts_local, "active_experts": active,
                      "n": h, "k": inter, "gemms": 1, "fused": 0},
                dtype=ex_dt, flops=2.0 * pairs * h * inter,
                bytes_read=w_down + pairs * inter * act_bytes, bytes_written=pairs * h * act_bytes,
                weight_bytes=w_down, routed=True,
            )
        return experts

    def head(self, layer_outputs: Sequence[str]) -> str:
        act_bytes = self.act_elem_bytes
        self.emitter.begin_block()
        h, v, tp = self.model.hidden_size, self.model.vocab_size, self.plan.tp
        # prefill only needs the logits of each sequence's last token
        rows = self.tokens if self.batch.phase == "decode" else self.seqs
        final = self.add_norm(NO_LAYER, "final_norm", "other", layer_outputs)
        weights = h * (v // tp) * act_bytes
        out = self.emitter.emit(
            NO_LAYER, "lm_head", "lm_head", "other", outputs=("logits",),
            dims={"tokens": rows, "hidden": h, "vocab": v // tp},
            dtype=ACT, flops=2.0 * rows * h * (v // tp),
            bytes_read=weights + rows * h * act_bytes, bytes_written=rows * (v // tp) * 4,
            weight_bytes=weights,
        )
        if tp > 1:
            out = self.collective(NO_LAYER, "lm_head.all_gather", "all_gather", "tp_comm", rows,
                                  v // tp, tp, "tp", out="logits")
        sample = self.emitter.emit(
            NO_LAYER, "sample", "sample", "other", deps=[out], outputs=("next_tokens",),
            dims={"tokens": rows, "vocab": v}, dtype="fp32", flops=float(rows * v),
            bytes_read=rows * v * 4, bytes_written=rows * 8,
        )
        self.emitter.results = {"hidden": (final, "h"), "logits": (out, "logits"),
                          "next_tokens": (sample, "next_tokens")}
        return sample
