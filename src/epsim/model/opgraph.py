"""The op graph of one forward step on one rank: the contract between simulator and runtime.

This module holds what the contract is made of (the op kinds, categories and dims, ``Batch``,
``Op``, ``OpGraph``); ``epsim.model.graph`` builds one (``build_step_graph``).

Glossary:
    op id      ``L{layer}.{name}.mb{microbatch}`` for ops inside decoder layers
               (``L12.moe.dispatch.mb1``), ``{name}.mb{microbatch}`` outside them
               (``embed.mb0``, ``lm_head.mb0``), built by :func:`epsim.model.ids.op_id`. Stable: the
               same model, plan and batch give the same ids, and the runtime's trace uses them too.
    name       the op's role inside its layer (``attn.q_a``, ``moe.experts``); with the layer it
               names the weights an op uses (:func:`epsim.model.ids.weight_key`).
    kind       what sort of kernel it is (``OP_KINDS``); cost models and runtime implementations are
               registered per kind.
    category   where its time is reported (``OP_CATEGORIES``): attention, moe_experts, dense,
               other, dispatch, combine, tp_comm.
    routed     the op's cost depends on the step's expert routing (the routed experts, EP dispatch
               and combine): the simulator replaces its nominal figures with sampled routing.
    dims       the kind-specific sizes a cost model or an implementation needs (``KIND_DIMS``).
    value      a tensor an op writes, named per op (``Op.outputs``: ``"h"`` and ``"residual"`` for
               a fused add+norm, ``"q"`` for ``attn.q_b``); an edge u -> v carries the names of
               u's values v reads (``values``), so ``OpGraph.inputs`` says what every op consumes
               and from whom. The runtime passes values along exactly these edges.
    tokens     rows of the activations an op works on; decode: one per sequence, or 1 + ``mtp``
               under MTP speculative decoding (the last token and the drafts it verifies).
    draft pass one run of the MTP draft module (``epsim.model.mtp``): ``Op.draft`` is its index
               (0 .. mtp - 1), ``None`` for the main model's ops.
    pairs      (token, expert) pairs a rank's routed experts process.

Bytes are HBM traffic: ``bytes_read`` (weights + activations in), ``bytes_written``.
``weight_bytes`` is the weight part of ``bytes_read``. Collectives carry ``peer_bytes``: the bytes
this rank sends to each member of its group (index = rank in the group; the own entry stays local).
Nominal figures assume uniform routing; the simulator replaces them with sampled routing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from .config import ModelConfig
from .errors import EpsimError
from .plan import ParallelPlan
from .schedule import Schedule

OP_KINDS: tuple[str, ...] = (
    "gemm", "grouped_gemm", "attention_decode", "attention_prefill", "norm", "rope", "router",
    "dispatch", "combine", "all_reduce", "all_gather", "elementwise", "embedding", "lm_head",
    "sample", "indexer",
)
COLLECTIVE_KINDS = frozenset({"dispatch", "combine", "all_reduce", "all_gather"})
#: where an op's time is reported (the simulator's breakdown adds its own ``launch``)
OP_CATEGORIES: tuple[str, ...] = (
    "attention", "moe_experts", "dense", "other", "dispatch", "combine", "tp_comm",
)

#: the dims each kind carries (every op of the kind has at least these keys)
KIND_DIMS: dict[str, tuple[str, ...]] = {
    "gemm": ("batch", "m", "n", "k"),  # batch > 1: a batched GEMM (MLA's per-head absorption)
    "grouped_gemm": ("pairs", "experts", "active_experts", "n", "k", "gemms"),
    "attention_decode": ("seqs", "heads", "context", "qk_dim", "v_dim", "kv_heads"),
    "attention_prefill": ("seqs", "heads", "new_tokens", "context", "qk_dim", "v_dim", "kv_heads"),
    "norm": ("tokens", "width"),
    "rope": ("tokens", "width"),
    "router": ("tokens", "hidden", "experts", "top_k"),
    "dispatch": ("tokens", "group"),
    "combine": ("tokens", "group"),
    "all_reduce": ("tokens", "width", "group"),
    "all_gather": ("tokens", "width", "group"),
    "elementwise": ("tokens", "width"),
    "embedding": ("tokens", "hidden"),
    "lm_head": ("tokens", "hidden", "vocab"),
    "sample": ("tokens", "vocab"),
    # DSA's lightning indexer: scores the cached keys, keeps the top-k per query
    "indexer": ("seqs", "query_tokens", "context", "heads", "head_dim", "topk"),
}

PHASES = ("decode", "prefill")


@dataclass(frozen=True)
class Batch:
    """What one dp group's GPUs process in one step.

    phase: ``"decode"`` (one new token per sequence; 1 + ``ParallelPlan.mtp`` under MTP) or
        ``"prefill"``.
    seqs: sequences in the step. Example: 512.
    context: decode: cached tokens each sequence attends to, the new one included
        (example: 2100; under MTP the first of the 1 + mtp new tokens'); prefill: prompt
        length.
    prefix: prefill only: prompt tokens already cached (chunked prefill, prefix caching).
    """

    phase: str
    seqs: int
    context: int
    prefix: int = 0

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise EpsimError(f"phase must be one of {', '.join(PHASES)}, got {self.phase!r}")
        for name in ("seqs", "context"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EpsimError(f"batch {name} must be a positive integer, got {value!r}")
        if not 0 <= self.prefix < self.context:
            raise EpsimError(f"prefix {self.prefix} must be in [0, context {self.context})")
        if self.phase == "decode" and self.prefix:
            raise EpsimError("a decode batch has no prefix")

    @property
    def new_tokens_per_seq(self) -> int:
        return 1 if self.phase == "decode" else self.context - self.prefix

    @property
    def tokens(self) -> int:
        return self.seqs * self.new_tokens_per_seq

    @staticmethod
    def decode(seqs: int, context: int) -> Batch:
        return Batch("decode", seqs, context)

    @staticmethod
    def prefill(seqs: int, prompt: int, prefix: int = 0) -> Batch:
        return Batch("prefill", seqs, prompt, prefix)


@dataclass(frozen=True, eq=False)
class Op:
    """One kernel (or one collective) of one microbatch on one rank.

    id: stable id, e.g. ``"L12.moe.dispatch.mb1"``.
    kind: one of ``OP_KINDS``.
    name: role inside the layer, e.g. ``"moe.dispatch"``.
    layer: decoder layer, ``NO_LAYER`` (-1) outside the layers.
    microbatch: 0, or 1 under DBO.
    category: breakdown bucket, one of ``OP_CATEGORIES``.
    dims: kind-specific sizes, see ``KIND_DIMS``. Example for a gemm: ``{"batch": 1, "m": 512,
        "n": 1536, "k": 7168}``.
    dtype: compute dtype (``"fp8"`` for DeepSeek's FP8 GEMMs, else ``"bf16"``).
    flops: floating-point operations (a multiply-add is 2).
    bytes_read / bytes_written: HBM traffic in bytes.
    weight_bytes: the weight part of ``bytes_read``.
    peer_bytes: collectives only: bytes sent to each group member, index = rank in the group.
    routed: its cost follows the step's expert routing (routed experts, dispatch, combine); the
        figures above assume uniform routing.
    outputs: names of the values it writes, the first its main one. Example: ``("c_kv",
        "k_pe")`` for ``attn.kv_a_norm`` (the normalised latent, the RoPE key passed through).
    draft: the MTP draft pass the op belongs to (``epsim.model.mtp``), ``None`` for the main
        model's ops.
    """

    id: str
    kind: str
    name: str
    layer: int
    microbatch: int
    category: str
    dims: Mapping[str, Any]
    dtype: str
    flops: float
    bytes_read: float
    bytes_written: float
    weight_bytes: float = 0.0
    peer_bytes: tuple[float, ...] | None = None
    routed: bool = False
    outputs: tuple[str, ...] = ("out",)
    draft: int | None = None

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVE_KINDS

    @property
    def bytes(self) -> float:
        return self.bytes_read + self.bytes_written

    def in_microbatch(self, microbatch: int, ident: str) -> Op:
        """This op as microbatch ``microbatch``'s, with id ``ident`` (its own copy of ``dims``),
        made without ``dataclasses.replace``'s second run of the frozen ``__init__`` (a
        representative build copies a second, equal microbatch's every op so)."""
        new = object.__new__(Op)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(id=ident, microbatch=microbatch, dims=dict(self.dims))
        return new


@dataclass
class OpGraph:
    """One rank's step: ops, their data dependencies and the schedule that issues them.

    model / plan / batch: what was built.
    ops: op id -> :class:`Op`, in issue order of microbatch 0 then 1.
    graph: networkx DiGraph over op ids; an edge u -> v means v reads what u wrote: its
        ``values`` attribute names which of u's outputs. Example: ``L3.attn.kv_a_norm.mb0 ->
        L3.attn.core.mb0`` carries ``("k_pe", "c_kv")`` (decode, fused RoPE).
    schedule: the issue order (:mod:`epsim.model.schedule`).
    captured: the step is one captured graph launch (decode under graph mode).
    microbatch_tokens: tokens of each microbatch. Example: ``(256, 256)``.
    microbatch_seqs: sequences of each microbatch. Example: ``(256, 256)``.
    results: per microbatch, where the step's outputs are: ``{"hidden": (final_norm id, "h"),
        "logits": (op id, "logits"), "next_tokens": (sample id, "next_tokens")}``; under MTP
        also each draft pass's ``"draft_logits{k}"`` and ``"draft_tokens{k}"``.
    """

    model: ModelConfig
    plan: ParallelPlan
    batch: Batch
    ops: dict[str, Op]
    graph: nx.DiGraph
    schedule: Schedule
    captured: bool
    microbatch_tokens: tuple[int, ...]
    microbatch_seqs: tuple[int, ...] = field(default=())
    results: tuple[Mapping[str, tuple[str, str]], ...] = field(default=())

    def __iter__(self):
        return iter(self.ops.values())

    def __len__(self) -> int:
        return len(self.ops)

    def op(self, op_id: str) -> Op:
        """The op ``op_id``, or a KeyError naming it. Exists for tests (the code reads ``ops``)."""
        try:
            return self.ops[op_id]
        except KeyError:
            raise KeyError(f"no op {op_id!r} in this graph") from None

    def inputs(self, op_id: str) -> list[tuple[str, str]]:
        """``(producer op id, value name)`` of every value ``op_id`` reads: producers in the order
        the builder first listed them, each one's values in its edge's order (a fused add+norm
        sums its block inputs in this order)."""
        edges = self.graph.pred[op_id]
        return [(producer, value) for producer, data in edges.items()
                for value in data["values"]]

    @property
    def bytes(self) -> float:
        """Bytes read and written by all ops. Exists for tests (what fusions save)."""
        return sum(op.bytes for op in self.ops.values())
