"""Building the op graph of one step on one rank: ``build_step_graph(model, plan, batch)``.

What the graph is made of (op kinds, categories, dims, ``Batch``, ``Op``, ``OpGraph``) and the
glossary of the contract are in ``epsim.model.opgraph``. This module splits the batch into
microbatches, has ``epsim.model.graph_builder.StepBuilder`` emit the ops of each (attention, dense
MLP, MoE with its shared and routed experts, the LM head, with their FLOPs, bytes and the values
they read and write; ``epsim.model.mtp`` the draft module's), joins them into a graph by the
values they read and attaches the schedule.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import networkx as nx

from .config import ModelConfig
from .graph_builder import StepBuilder
from .graph_emit import Emitter, OpsOnlyEmitter, query_tokens
from .ids import op_id
from .mtp import emit_draft_pass
from .opgraph import Batch, Op, OpGraph
from .plan import ParallelPlan
from .schedule import build_schedule


def _split(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` near-equal positive pieces, larger first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


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
    emitters: list[Emitter] = []
    for mb, seqs in enumerate(seq_split):
        emitter = Emitter(mb)
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


#: the op kinds whose ops read a batch's context (and a prefill's prefix): the attention cores
#: and DSA's indexer.
#: Every other op of a step is a function of the plan, the phase, the sequences of each
#: microbatch and the new tokens per sequence alone (``tests/model/test_graph_context.py`` checks it
#: over the shipped models), so batches differing in context alone differ in these ops alone.
CONTEXT_KINDS = frozenset({"attention_decode", "attention_prefill", "indexer"})


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
        emitter = OpsOnlyEmitter(mb, kinds)
        _build_microbatch(model, plan, batch, seqs, emitter, layers)
        ops.update(emitter.ops)
        if not mb:
            first = emitter.ops
    return ops


def _build_microbatch(model: ModelConfig, plan: ParallelPlan, batch: Batch, seqs: int,
                      emitter: Emitter, layers: Iterable[int] | None = None) -> None:
    builder = StepBuilder(model, plan, batch, seqs, emitter)
    layer_outputs = [builder.embedding()]
    for layer in range(model.num_layers) if layers is None else layers:
        emitter.begin_block()
        # the fused add+norm at the top of a layer reads every output of the previous one
        attn = builder.attention(layer, layer_outputs)
        if model.is_moe_layer(layer):
            layer_outputs = builder.moe(layer, attn)
        else:
            layer_outputs = [builder.dense_mlp(layer, attn)]
    builder.head(layer_outputs)
    for k in range(plan.mtp):  # the MTP draft module, once per draft token
        emit_draft_pass(builder, k)
