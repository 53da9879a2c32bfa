"""The executor: runs one rank's op graph in the order of the shared schedule, timing every op.

``RankRuntime.step()`` builds ``build_step_graph(model, plan, Batch.decode(batch, context))`` for
the step, walks ``graph.schedule.slots`` in order and calls ``OP_IMPLS[op.kind]`` for each op id.
An implementation reads and writes its microbatch's named values (``"h"``, ``"q"``, ...) and the
weights named by the op (``model.ids.weight_key``). Collectives (dispatch, combine) return a
:class:`runtime.comm.Pending`; the executor waits on it only when an op whose graph predecessor
it is comes up, so under DBO one microbatch's exchange is in flight while the other computes.

Every op becomes a :class:`model.trace.TraceEvent` with the graph's op id: compute ops on the
``compute`` stream (wall clock on the CPU, CUDA events on a GPU), collectives on ``comm`` from
issue to the end of the wait that needed them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from epsim.model.config import ModelConfig
from epsim.model.errors import EpsimError
from epsim.model.graph import Batch, Op, OpGraph, build_step_graph
from epsim.model.ids import weight_key
from epsim.model.placement import Placement, remap
from epsim.model.plan import ParallelPlan
from epsim.model.trace import TraceEvent

from . import comm, kernels
from . import weights as W
from .backends import select_moe_backend, select_mori
from .options import RunOptions

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
KV_STORAGE = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}
_BITS = {1: torch.uint8, 2: torch.int16}


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


@dataclass
class StepResult:
    """One decode step of one rank.

    logits: ``[B, vocab]`` fp32. next_tokens: ``[B]``. hidden: ``[B, h]`` final-norm output.
    step_us: wall time of the step. events: per-op trace events (times from the step start).
    """

    logits: torch.Tensor
    next_tokens: torch.Tensor
    hidden: torch.Tensor
    step_us: float
    events: list[TraceEvent]


class LatentCache:
    """MLA's KV cache: per layer a latent ``[B, capacity, r]`` and a RoPE key ``[B, capacity, p]``,
    stored in bf16 or float8_e4m3fn (fp8: one fp32 scale per token row), widened on read."""

    def __init__(self, layers: int, seqs: int, capacity: int, latent: int, rope: int,
                 storage: torch.dtype, device: torch.device) -> None:
        self.storage = storage
        self.capacity = capacity
        self.c = [torch.zeros(seqs, capacity, latent, dtype=storage, device=device)
                  for _ in range(layers)]
        self.c_scale = [torch.ones(seqs, capacity, device=device) for _ in range(layers)]
        self.pe = [torch.zeros(seqs, capacity, rope, dtype=storage, device=device)
                   for _ in range(layers)]
        self.pe_scale = [torch.ones(seqs, capacity, device=device) for _ in range(layers)]

    def write(self, layer: int, seqs: torch.Tensor, positions: torch.Tensor, c: torch.Tensor,
              pe: torch.Tensor) -> None:
        """Store ``c [t, r]`` and ``pe [t, p]`` of sequences ``seqs [t]`` at ``positions [t]``."""
        qc, sc = kernels.quantize_rows(c, self.storage)
        qp, sp = kernels.quantize_rows(pe, self.storage)
        # write through an integer view of the same bits: index_put is not implemented for
        # float8 on every device
        bits = _BITS[self.c[layer].element_size()]
        self.c[layer].view(bits)[seqs, positions] = qc.view(bits)
        self.c_scale[layer][seqs, positions] = sc
        self.pe[layer].view(bits)[seqs, positions] = qp.view(bits)
        self.pe_scale[layer][seqs, positions] = sp

    def widened(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's entries as stored, widened to fp32 on the CPU: ``c [layers, seqs,
        capacity, r]`` and ``pe [layers, seqs, capacity, p]`` (what ``--check`` compares)."""
        c = [kernels.dequantize_rows(q, s, torch.float32) for q, s in zip(self.c, self.c_scale,
                                                                           strict=True)]
        pe = [kernels.dequantize_rows(q, s, torch.float32) for q, s in zip(self.pe, self.pe_scale,
                                                                            strict=True)]
        return torch.stack(c).cpu(), torch.stack(pe).cpu()

    def read(self, layer: int, seqs: slice, upto: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[t, upto, r]`` and ``[t, upto, p]`` widened to ``dtype``."""
        c = kernels.dequantize_rows(self.c[layer][seqs, :upto], self.c_scale[layer][seqs, :upto],
                                    dtype)
        pe = kernels.dequantize_rows(self.pe[layer][seqs, :upto],
                                     self.pe_scale[layer][seqs, :upto], dtype)
        return c, pe


class Clock:
    """Op timestamps: wall clock on the CPU, CUDA events (resolved after the step) on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.origin: Any = None

    def start(self) -> None:
        self.origin = self.now()

    def now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def us(self, mark: Any) -> float:
        """Microseconds from the step start to ``mark`` (synchronise first on a GPU)."""
        if self.cuda:
            return self.origin.elapsed_time(mark) * 1e3
        return (mark - self.origin) * 1e6


class RankRuntime:
    """One rank's model shard, KV cache and decode loop.

    Args:
        opts: the run (see :class:`runtime.options.RunOptions`).
        model / plan / placement: from ``runtime.options.validate(opts)``.
        rank: this rank; group: the EP process group (None: the default group).
    """

    def __init__(self, opts: RunOptions, model: ModelConfig, plan: ParallelPlan,
                 placement: Placement, rank: int, group: Any = None) -> None:
        self.opts, self.model, self.plan, self.placement = opts, model, plan, placement
        self.rank, self.group = rank, group
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if opts.device == "cuda" else torch.device("cpu")
        self.dtype = TORCH_DTYPES[opts.dtype]
        self.static = opts.static_shapes
        a = model.attention
        self.heads, self.nope, self.rope = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim
        self.latent, self.v_dim = a.kv_lora_rank, a.v_head_dim
        self.softmax_scale = (self.nope + self.rope) ** -0.5
        self.w = self._load_weights()
        self.ep_rank = rank if plan.expert_parallel else 0
        self.slots_per_rank = placement.slots_per_gpu
        self.slot_base = self.ep_rank * self.slots_per_rank
        self.experts = self._load_experts()
        self.l2p = torch.as_tensor(placement.logical_to_physical, device=self.device)
        self.replicas = torch.as_tensor(placement.replica_counts, device=self.device)
        self.moe_backend = select_moe_backend(self)
        self.mori = select_mori(self)
        # Per-sequence state: cache, lengths (cached tokens before the step), next inputs
        b, ctx = opts.batch, opts.context
        self.cache = LatentCache(model.num_layers, b, ctx + opts.steps, self.latent, self.rope,
                                 KV_STORAGE[opts.kv_dtype], self.device)
        if opts.prefill:  # the cache fills in prefill(); its last logits give the tokens
            self.lengths = torch.zeros(b, dtype=torch.int64, device=self.device)
            self.tokens = torch.zeros(b, dtype=torch.int64, device=self.device)
        else:  # cached entries drawn from the seed stand in for a prefill
            for layer in range(model.num_layers):
                c, pe = W.initial_cache(model, opts.seed, rank, layer, b, ctx - 1)
                seqs = torch.arange(b, device=self.device).repeat_interleave(ctx - 1)
                pos = torch.arange(ctx - 1, device=self.device).repeat(b)
                self.cache.write(layer, seqs, pos, c.to(self.device).reshape(-1, self.latent),
                                 pe.to(self.device).reshape(-1, self.rope))
            self.lengths = torch.full((b,), ctx - 1, dtype=torch.int64, device=self.device)
            self.tokens = W.initial_tokens(model, opts.seed, rank, b).to(self.device)
        self.steps_done = 0
        self._graphs: dict[int, OpGraph] = {}
        self.batch_index = rank * b  # first rank-global sequence index

    # -- set-up -----------------------------------------------------------------------------

    def _load_weights(self) -> dict[str, torch.Tensor]:
        w = W.dense_weights(self.model, self.opts.seed)
        for layer in range(self.model.num_layers):
            key = partial(weight_key, layer)
            kv_b = w[key("attn.kv_b")]  # [H, nope + v, r]
            w[key("attn.q_absorb")] = kv_b[:, :self.nope, :].contiguous()  # [H, nope, r]
            w[key("attn.v_absorb")] = kv_b[:, self.nope:, :].transpose(1, 2).contiguous()
            # prefill's up-projection as a plain GEMM: [r, H * (nope + v)]
            w[key("attn.kv_b")] = kv_b.permute(2, 0, 1).reshape(self.latent, -1).contiguous()
            if key("moe.shared.gate_up") in w:
                gate, up = w[key("moe.shared.gate_up")].chunk(2, dim=1)
                w[key("moe.shared.gate")], w[key("moe.shared.up")] = (gate.contiguous(),
                                                                      up.contiguous())
        return {k: v.to(self.device, self.dtype) for k, v in w.items()}

    def _load_experts(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """layer -> (gate_up [S, h, 2I], down [S, I, h]) for this rank's slots."""
        out = {}
        lo, hi = self.slot_base, self.slot_base + self.slots_per_rank
        for layer in self.model.moe_layers:
            logical = self.placement.physical_to_logical[layer, lo:hi].tolist()
            gu, down = W.expert_weights(self.model, self.opts.seed, layer, logical)
            out[layer] = (gu.to(self.device, self.dtype), down.to(self.device, self.dtype))
        return out

    def graph(self, step: int) -> OpGraph:
        """The op graph of decode step ``step`` (context grows by one per step); step -1 is the
        prefill of ``context - 1`` prompt tokens per sequence."""
        if step not in self._graphs:
            if step < 0:
                batch = Batch.prefill(self.opts.batch, self.opts.context - 1)
            else:
                batch = Batch.decode(self.opts.batch, self.opts.context + step)
            graph = build_step_graph(self.model, self.plan, batch)
            missing = sorted({op.kind for op in graph} - set(OP_IMPLS))
            if missing:
                raise EpsimError(f"the runtime has no implementation of op kind(s) "
                                 f"{', '.join(missing)} for this plan")
            self._check_weights(graph)
            self._graphs[step] = graph
        return self._graphs[step]

    def _check_weights(self, graph: OpGraph) -> None:
        """Every GEMM's weight has the graph's ``[batch,] k, n`` shape: the contract holds."""
        for op in graph:
            if op.kind == "gemm":
                d = op.dims
                want = (d["k"], d["n"]) if d["batch"] == 1 else (d["batch"], d["k"], d["n"])
                got = tuple(self.weight(op).shape)
                if got != want:
                    raise AssertionError(f"{op.id}: weight {got} but the graph says {want}")

    def weight(self, op: Op, suffix: str = "") -> torch.Tensor:
        return self.w[weight_key(op.layer, op.name + suffix)]

    # -- the step ---------------------------------------------------------------------------

    def step(self, capturing: bool = False) -> StepResult:
        """Run one decode step of every sequence of this rank; advance the state in place.

        ``capturing``: the step is being recorded into a CUDA graph: no timing events, no
        synchronisation, no host reads (static shapes only); the returned tensors are the
        graph's static outputs.
        """
        if capturing and not self.static:
            raise AssertionError("graph capture needs the static-shape step")
        graph = self.graph(0 if capturing else self.steps_done)
        positions = self.lengths.clone()
        states, start = [], 0
        for mb, n in enumerate(graph.microbatch_seqs):
            seqs = slice(start, start + n)
            start += n
            seq_ids = torch.arange(seqs.start, seqs.stop, device=self.device)
            states.append(self._state(mb, seqs, self.tokens[seqs], positions[seqs], seq_ids,
                                      (self.batch_index + seq_ids)[:, None]))
        result = self._run(graph, states, capturing)
        # in place, so a captured graph's replay advances the same buffers
        self.lengths += 1
        self.tokens.copy_(result.next_tokens)
        self.steps_done += 1
        return result

    def prefill(self) -> StepResult:
        """Run the prompts (``context - 1`` random tokens per sequence) through the prefill graph,
        filling the KV cache; the last tokens' logits give the first decode inputs."""
        graph = self.graph(-1)
        prompt_len = self.opts.context - 1
        prompts = W.initial_prompt(self.model, self.opts.seed, self.rank, self.opts.batch,
                                   prompt_len).to(self.device)
        states, start = [], 0
        for mb, n in enumerate(graph.microbatch_seqs):
            seqs = slice(start, start + n)
            start += n
            seq_ids = torch.arange(seqs.start, seqs.stop, device=self.device)
            positions = torch.arange(prompt_len, device=self.device).repeat(n)
            per_token = seq_ids.repeat_interleave(prompt_len)
            index = ((self.batch_index + per_token) * prompt_len + positions)[:, None]
            last = torch.arange(n, device=self.device) * prompt_len + prompt_len - 1
            states.append(self._state(mb, seqs, prompts[seqs].reshape(-1), positions, per_token,
                                      index, last))
        result = self._run(graph, states, False)
        self.lengths += prompt_len
        self.tokens.copy_(result.next_tokens)
        return result

    def _state(self, mb: int, seqs: slice, tokens: torch.Tensor, positions: torch.Tensor,
               seq_ids: torch.Tensor, token_index: torch.Tensor,
               last_rows: torch.Tensor | None = None) -> MicrobatchState:
        cos, sin = kernels.rope_cos_sin(positions, self.rope, self.model.rope_theta, self.dtype)
        return MicrobatchState(mb, seqs, tokens, positions, seq_ids, token_index, cos, sin,
                               last_rows)

    def _run(self, graph: OpGraph, states: list[MicrobatchState], capturing: bool) -> StepResult:
        """Walk the schedule: issue every op, wait on collectives where the graph says."""
        clock = Clock(self.device)
        marks: list[tuple[Op, str, Any, Any]] = []
        pending: dict[str, tuple[comm.Pending, Any, Op]] = {}
        now = (lambda: None) if capturing else clock.now
        wall0 = time.perf_counter()
        if not capturing:
            clock.start()
        for slot in graph.schedule.slots:
            state = states[slot.microbatch]
            for op_id in slot.op_ids:
                op = graph.ops[op_id]
                # wait exactly where the graph says this op reads a collective's result
                for pred in graph.graph.predecessors(op_id):
                    if pred in pending:
                        handle, t0, pop = pending.pop(pred)
                        handle.wait()
                        marks.append((pop, "comm", t0, now()))
                t0 = now()
                result = OP_IMPLS[op.kind](self, op, state)
                if isinstance(result, comm.Pending):
                    pending[op_id] = (result, t0, op)
                else:
                    marks.append((op, "compute", t0, now()))
        if pending:  # the graph ends in sample, which depends on everything: a bug if not
            raise AssertionError(f"collectives never waited on: {sorted(pending)}")
        if self.device.type == "cuda" and not capturing:
            torch.cuda.synchronize()
        step_us = (time.perf_counter() - wall0) * 1e6
        events = [] if capturing else [
            TraceEvent(op.id, op.kind, self.rank, stream, clock.us(t0),
                       max(0.0, clock.us(t1) - clock.us(t0)), op.layer, op.microbatch,
                       {"tokens": states[op.microbatch].num_tokens})
            for op, stream, t0, t1 in marks]
        logits = torch.cat([s.values["logits"] for s in states])
        next_tokens = torch.cat([s.values["next_tokens"] for s in states])
        hidden = torch.cat([_last(s, s.values["final_hidden"]) for s in states])
        return StepResult(logits, next_tokens, hidden, step_us, events)


def _last(st: MicrobatchState, x: torch.Tensor) -> torch.Tensor:
    """Prefill: each sequence's last row; decode: every row."""
    return x if st.last_rows is None else x.index_select(0, st.last_rows)


# --------------------------------------------------------------------------------------------
# Op implementations, one per kind; within a kind, tables keyed by the op's name
# --------------------------------------------------------------------------------------------

Impl = Callable[[RankRuntime, Op, MicrobatchState], Any]


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
    st.values["logits"] = _last(st, st.values["final_hidden"]).float() @ rt.weight(op).float()


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
