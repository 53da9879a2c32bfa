"""The executor: runs one rank's op graph in the order of the shared schedule, timing every op.

``RankRuntime.step()`` builds ``build_step_graph(model, plan, Batch.decode(batch, context))`` for
the step, walks ``graph.schedule.slots`` in order and calls ``OP_IMPLS[op.kind]`` (``epsim.runtime.ops``)
for each op id with the values the op reads, as the graph's edges say (``OpGraph.inputs``), and
keeps what it writes under ``(op id, value name)`` until the last op that reads it has run
(:class:`ValueFlow`). Collectives (dispatch, combine) return a :class:`epsim.runtime.comm.Pending`; the
executor waits on it only when an op that reads its result comes up, so under DBO one
microbatch's exchange is in flight while the other computes.

Every op becomes a :class:`epsim.model.trace.TraceEvent` with the graph's op id, in issue order: compute
ops on the ``compute`` stream (wall clock on the CPU, CUDA events on a GPU), collectives on
``comm`` from issue to the end of the wait that needed them, with ``args["issue_us"]``: how long
the issuing call held the host (a dispatch's blocking count exchange, gloo's asynchronous call).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import numpy as np
import torch

from epsim.model.config import ModelConfig
from epsim.model.errors import EpsimError
from epsim.model.graph import build_step_graph
from epsim.model.ids import weight_key
from epsim.model.mtp import draft_layer, routing_layer, runtime_accepted
from epsim.model.opgraph import Batch, Op, OpGraph
from epsim.model.placement import Placement
from epsim.model.plan import ParallelPlan
from epsim.model.trace import TraceEvent

from . import comm, gqa, kernels, lifecycle
from . import weights as W
from .backends import select_exchange, select_moe_backend
from .kv_cache import KV_STORAGE, LatentCache
from .ops import OP_IMPLS, MicrobatchState, last_token_rows
from .options import RunOptions, cache_positions

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: step graphs a rank keeps built (the captured step's, the current one's, a caller's look-back)
GRAPHS_KEPT = 4


@dataclass
class RankStepOutput:
    """What one step (decode, or the prefill) of one rank produced, and how long it took.

    logits: ``[B, vocab]`` fp32 of each sequence's last token. next_tokens: ``[B]``.
    hidden: ``[B, h]`` final-norm output. step_us: wall time of the step.
    events: per-op trace events (times from the step start).
    Under MTP (``mtp = N``) logits, next_tokens and hidden have a row per verified token
    (``B * (1 + N)``, sequence by sequence), and:
    draft_logits: per draft pass ``[B, vocab]``; draft_tokens: ``[B, N]`` the drafts proposed;
    accepted: ``[B]`` the drafts of this step's input accepted (simulated).
    """

    logits: torch.Tensor
    next_tokens: torch.Tensor
    hidden: torch.Tensor
    step_us: float
    events: list[TraceEvent]
    draft_logits: list[torch.Tensor] = field(default_factory=list)
    draft_tokens: torch.Tensor | None = None
    accepted: torch.Tensor | None = None


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
        opts: the run (see :class:`epsim.runtime.options.RunOptions`).
        model / plan / placement: from ``epsim.runtime.options.validate(opts)``.
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
        # GQA (no MLA dims): its RoPE tables span the rotated part of a head
        self.heads, self.nope, self.rope = (a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim
                                            if a.kind == "mla" else gqa.rotary_dim(a))
        self.latent, self.v_dim = a.kv_lora_rank, a.v_head_dim
        self.softmax_scale = (self.nope + self.rope) ** -0.5
        self.w = self._load_weights()
        self.slots_per_rank = placement.slots_per_gpu
        ep_rank = rank if plan.expert_parallel else 0
        self.slot_base = ep_rank * self.slots_per_rank
        self.experts = self._load_experts()
        l2p, replicas = placement.logical_to_physical, placement.replica_counts
        if plan.mtp and model.mtp_moe:  # the draft layer sits like its routing layer
            row = routing_layer(model)
            l2p = np.concatenate([l2p, l2p[row:row + 1]])
            replicas = np.concatenate([replicas, replicas[row:row + 1]])
        self.l2p = torch.as_tensor(l2p, device=self.device)
        self.replicas = torch.as_tensor(replicas, device=self.device)
        self.moe_backend = select_moe_backend(self)
        self.exchange = select_exchange(self)
        # Per-sequence state: cache, lengths (cached tokens before the step), next inputs
        b, ctx = opts.batch, opts.context
        self.mtp = plan.mtp
        cache_layers = model.num_layers + (1 if self.mtp else 0)  # + the draft layer's own
        capacity = cache_positions(opts) if self.mtp else ctx + opts.steps
        c_width, pe_width = W.cache_widths(model)
        self.cache = LatentCache(cache_layers, b, capacity, c_width, pe_width,
                                 KV_STORAGE[opts.kv_dtype], self.device)
        if self.mtp and opts.check:  # the check replays each step's writes (rejected drafts')
            self.cache.journal = {}
        if model.attention.sparse:
            self.cache.enable_index(model.attention.index_head_dim, self.dtype)
        if opts.prefill:  # the cache fills in prefill(); its last logits give the tokens
            self.lengths = torch.zeros(b, dtype=torch.int64, device=self.device)
            self.tokens = torch.zeros(b, dtype=torch.int64, device=self.device)
        else:  # cached entries drawn from the seed stand in for a prefill
            for layer in range(cache_layers):
                c, pe = W.initial_cache(model, opts.seed, rank, layer, b, ctx - 1)
                seqs = torch.arange(b, device=self.device).repeat_interleave(ctx - 1)
                pos = torch.arange(ctx - 1, device=self.device).repeat(b)
                self.cache.write(layer, seqs, pos, c.to(self.device).reshape(-1, c_width),
                                 pe.to(self.device).reshape(-1, pe_width))
                if model.attention.sparse:
                    keys = W.initial_index_keys(model, opts.seed, rank, layer, b, ctx - 1)
                    self.cache.write_index(layer, seqs, pos, keys.to(self.device).reshape(
                        b * (ctx - 1), -1))
            self.lengths = torch.full((b,), ctx - 1, dtype=torch.int64, device=self.device)
            self.tokens = W.initial_tokens(model, opts.seed, rank, b).to(self.device)
        # under MTP the drafts the next step verifies (drawn for the first)
        self.drafts = W.initial_drafts(model, opts.seed, rank, b, self.mtp).to(self.device)
        self.steps_done = 0
        # each step's graph differs in its sizes (the context grows): keep only the last few
        self._graphs: OrderedDict[int, OpGraph] = OrderedDict()
        # ...but not in its ops and edges, so how values flow is worked out once per phase
        self._flows: dict[str, ValueFlow] = {}
        self.batch_index = rank * b  # first rank-global sequence index

    # -- set-up -----------------------------------------------------------------------------

    def _load_weights(self) -> dict[str, torch.Tensor]:
        w = W.dense_weights(self.model, self.opts.seed, draft=bool(self.plan.mtp))
        layers = self.model.num_layers + (1 if self.plan.mtp else 0)
        for layer in range(layers):
            key = partial(weight_key, layer)
            if self.model.attention.kind == "mla":
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
        p2l = self.placement.physical_to_logical
        placed = [(layer, layer) for layer in self.model.moe_layers]
        if self.plan.mtp and self.model.mtp_moe:  # placed as its routing layer
            placed.append((draft_layer(self.model), routing_layer(self.model)))
        for layer, row in placed:
            logical = p2l[row, lo:hi].tolist()
            gu, down = W.expert_weights(self.model, self.opts.seed, layer, logical)
            out[layer] = (gu.to(self.device, self.dtype), down.to(self.device, self.dtype))
        return out

    def graph(self, step: int) -> OpGraph:
        """The op graph of decode step ``step`` (context grows by one per step); step -1 is the
        prefill of ``context - 1`` prompt tokens per sequence."""
        return self._step_graph(step)[0]

    def _step_graph(self, step: int) -> tuple[OpGraph, ValueFlow]:
        if step not in self._graphs:
            if step < 0:
                batch = Batch.prefill(self.opts.batch, self.opts.context - 1)
            else:
                batch = Batch.decode(self.opts.batch, self.opts.context + step)
            self._graphs[step] = build_step_graph(self.model, self.plan, batch)
            while len(self._graphs) > GRAPHS_KEPT:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(step)
        graph = self._graphs[step]
        phase = graph.batch.phase
        if phase not in self._flows:  # the first graph of its phase: check it once
            missing = sorted({op.kind for op in graph} - set(OP_IMPLS))
            if missing:
                raise EpsimError(f"the runtime has no implementation of op kind(s) "
                                 f"{', '.join(missing)} for this plan")
            self._check_weights(graph)
            self._flows[phase] = value_flow(graph)
        return graph, self._flows[phase]

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

    def step(self, capturing: bool = False) -> RankStepOutput:
        """Run one decode step of every sequence of this rank; advance the state in place.

        ``capturing``: the step is being recorded into a CUDA graph: no timing events, no
        synchronisation, no host reads (static shapes only); the returned tensors are the
        graph's static outputs.
        """
        if capturing and not self.static:
            raise AssertionError("graph capture needs the static-shape step")
        graph, flow = self._step_graph(0 if capturing else self.steps_done)
        if self.mtp:
            return self._verify_step(graph, flow)
        positions = self.lengths.clone()
        states, start = [], 0
        for mb, n in enumerate(graph.microbatch_seqs):
            seqs = slice(start, start + n)
            start += n
            seq_ids = torch.arange(seqs.start, seqs.stop, device=self.device)
            states.append(self._state(mb, seqs, self.tokens[seqs], positions[seqs], seq_ids,
                                      (self.batch_index + seq_ids)[:, None]))
        result = self._run(graph, flow, states, capturing)
        # in place, so a captured graph's replay advances the same buffers
        self.lengths += 1
        self.tokens.copy_(result.next_tokens)
        self.steps_done += 1
        return result

    def _verify_step(self, graph: OpGraph, flow: ValueFlow) -> RankStepOutput:
        """An MTP step: every sequence's last token and its ``mtp`` drafts through the main
        model (a causal multi-token decode over its cache), then the draft passes; the accepted
        drafts are this step's sampled chain (``epsim.model.mtp.runtime_accepted``), and each
        sequence advances by them plus the main model's token after the last one."""
        n, q = self.opts.batch, 1 + self.mtp
        accepted = torch.as_tensor(runtime_accepted(
            self.opts.seed, self.rank, self.steps_done, n, self.mtp, self.opts.mtp_acceptance),
            device=self.device)
        inputs = torch.cat([self.tokens[:, None], self.drafts], dim=1)  # [B, 1 + mtp]
        states, start = [], 0
        for mb, seqs_n in enumerate(graph.microbatch_seqs):
            seqs = slice(start, start + seqs_n)
            start += seqs_n
            states.append(self._verify_state(mb, seqs, inputs[seqs], accepted[seqs]))
        result = self._run(graph, flow, states, False)
        sampled = result.next_tokens.view(n, q)
        rows = torch.arange(n, device=self.device)
        self.tokens.copy_(sampled[rows, accepted])  # the token after the last accepted draft
        self.drafts.copy_(result.draft_tokens)
        self.lengths += 1 + accepted
        self.steps_done += 1
        return replace(result, accepted=accepted)

    def _verify_state(self, mb: int, seqs: slice, inputs: torch.Tensor,
                      accepted: torch.Tensor) -> MicrobatchState:
        """One microbatch's state of an MTP step, its draft passes' within."""
        n, q = inputs.shape
        dev = self.device
        seq_ids = torch.arange(seqs.start, seqs.stop, device=dev)
        per_token = seq_ids.repeat_interleave(q)
        offsets = torch.arange(q, device=dev)
        positions = (self.lengths[seqs][:, None] + offsets[None, :]).reshape(-1)
        index = ((self.batch_index + per_token) * q + offsets.repeat(n))[:, None]
        main = self._state(mb, seqs, inputs.reshape(-1), positions, per_token, index)
        # pass 0: the verified rows; each row's next input is the token after it
        follow = (offsets[None, :] < accepted[:, None]).reshape(-1)
        shifted = inputs.roll(-1, dims=1).reshape(-1)
        last = torch.arange(n, device=dev) * q + accepted
        passes = [replace(main, last_rows=last, draft_inputs=(shifted, follow))]
        for k in range(1, self.mtp):  # one row per sequence, k past its last accepted token
            pos = self.lengths[seqs] + accepted + k
            passes.append(self._state(mb, seqs, torch.zeros_like(pos), pos, seq_ids,
                                      ((self.batch_index + seq_ids) * q + k)[:, None]))
        return replace(main, passes=tuple(passes))

    def prefill(self) -> RankStepOutput:
        """Run the prompts (``context - 1`` random tokens per sequence) through the prefill graph,
        filling the KV cache; the last tokens' logits give the first decode inputs."""
        graph, flow = self._step_graph(-1)
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
        result = self._run(graph, flow, states, False)
        self.lengths += prompt_len
        self.tokens.copy_(result.next_tokens)
        return result

    def _state(self, mb: int, seqs: slice, tokens: torch.Tensor, positions: torch.Tensor,
               seq_ids: torch.Tensor, token_index: torch.Tensor,
               last_rows: torch.Tensor | None = None) -> MicrobatchState:
        cos, sin = kernels.rope_cos_sin(positions, self.rope, self.model.rope_theta, self.dtype)
        return MicrobatchState(mb, seqs, tokens, positions, seq_ids, token_index, cos, sin,
                               last_rows)

    def _run(self, graph: OpGraph, flow: ValueFlow, states: list[MicrobatchState],
             capturing: bool) -> RankStepOutput:
        """Walk the schedule: issue every op with the values its graph edges bring, wait on a
        collective where the first op that reads its result comes up."""
        clock = Clock(self.device)
        marks: list[list[Any]] = []  # [op, stream, start, end] in issue order
        pending: dict[str, tuple[comm.Pending, list[Any]]] = {}
        values: dict[tuple[str, str], Any] = {}  # (producer op id, value name) -> value
        now = (lambda: None) if capturing else clock.now
        wall0 = time.perf_counter()
        if not capturing:
            clock.start()
        for slot in graph.schedule.slots:
            for op_id in slot.op_ids:
                op = graph.ops[op_id]
                state = states[slot.microbatch]
                if op.draft is not None:  # an MTP draft pass runs on its own rows
                    state = state.passes[op.draft]
                reads = flow.reads[op_id]
                for producer, _ in reads:
                    if producer in pending:
                        handle, mark = pending.pop(producer)
                        _store(values, mark[0], handle.wait())
                        mark[3] = now()
                mark = [op, "compute", now(), None, None]
                marks.append(mark)
                result = OP_IMPLS[op.kind](self, op, {v: values[(p, v)] for p, v in reads}, state)
                lifecycle.progress()
                if isinstance(result, comm.Pending):
                    mark[1] = "comm"
                    mark[4] = now()  # the issuing call returned: how long it held the host
                    pending[op_id] = (result, mark)
                else:
                    mark[3] = now()
                    _store(values, op, result)
                for key in flow.release.get(op_id, ()):
                    del values[key]
        if pending:  # the graph ends in sample, which depends on everything: a bug if not
            raise AssertionError(f"collectives never waited on: {sorted(pending)}")
        if self.device.type == "cuda" and not capturing:
            torch.cuda.synchronize()
        step_us = (time.perf_counter() - wall0) * 1e6
        events = [] if capturing else [
            TraceEvent(op.id, op.kind, self.rank, stream, clock.us(t0),
                       max(0.0, clock.us(t1) - clock.us(t0)), op.layer, op.microbatch,
                       {"tokens": _state_of(states, op).num_tokens} if issued is None else
                       {"tokens": _state_of(states, op).num_tokens,
                        "issue_us": max(0.0, clock.us(issued) - clock.us(t0))})
            for op, stream, t0, t1, issued in marks]
        outputs = [{name: values[where] for name, where in graph.results[s.microbatch].items()}
                   for s in states]
        passes = range(self.plan.mtp)
        return RankStepOutput(
            logits=torch.cat([o["logits"] for o in outputs]),
            next_tokens=torch.cat([o["next_tokens"] for o in outputs]),
            hidden=torch.cat([last_token_rows(s, o["hidden"])
                              for s, o in zip(states, outputs, strict=True)]),
            step_us=step_us, events=events,
            draft_logits=[torch.cat([o[f"draft_logits{k}"] for o in outputs]) for k in passes],
            draft_tokens=torch.cat([torch.stack([o[f"draft_tokens{k}"] for k in passes], dim=1)
                                    for o in outputs]) if self.plan.mtp else None)


def _state_of(states: list[MicrobatchState], op: Op) -> MicrobatchState:
    """The state ``op`` ran on: its microbatch's, or that microbatch's draft pass's."""
    state = states[op.microbatch]
    return state if op.draft is None else state.passes[op.draft]


def _store(values: dict[tuple[str, str], Any], op: Op, written: dict[str, Any]) -> None:
    """Keep what ``op`` wrote, once it is exactly what the graph says it writes."""
    if set(written) != set(op.outputs):
        raise AssertionError(f"{op.id} wrote {sorted(written)}, the graph says {op.outputs}")
    for name, value in written.items():
        values[(op.id, name)] = value


@dataclass(frozen=True)
class ValueFlow:
    """How values move through one step graph, worked out once per graph.

    reads: op id -> ``(producer op id, value name)`` of each value it reads (``OpGraph.inputs``).
    release: op id -> the ``(producer op id, value name)`` of every value no op issued after it
        reads: they are dropped once it ran, so a step holds only the live activations, not
        every layer's.
    """

    reads: dict[str, tuple[tuple[str, str], ...]]
    release: dict[str, tuple[tuple[str, str], ...]]


def value_flow(graph: OpGraph) -> ValueFlow:
    """The :class:`ValueFlow` of ``graph`` in its schedule's issue order; the step's results
    (``OpGraph.results``) are never released."""
    reads: dict[str, tuple[tuple[str, str], ...]] = {}
    last_reader: dict[str, str] = {}
    for op_id in graph.schedule.order():
        reads[op_id] = tuple(graph.inputs(op_id))
        for producer, _ in reads[op_id]:
            last_reader[producer] = op_id
    kept = {producer for results in graph.results for producer, _ in results.values()}
    release: dict[str, list[tuple[str, str]]] = {}
    for producer, reader in last_reader.items():
        if producer not in kept:
            release.setdefault(reader, []).extend(
                (producer, name) for name in graph.ops[producer].outputs)
    return ValueFlow(reads, {op_id: tuple(keys) for op_id, keys in release.items()})
