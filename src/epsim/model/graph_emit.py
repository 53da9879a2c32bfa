"""Emitting the ops of one step: the emitters that collect a microbatch's ops and the generic
op shapes (GEMM, RMSNorm, SwiGLU, EP exchange, all-reduce / all-gather) its blocks are made of.

``epsim.model.graph_builder.StepBuilder`` extends :class:`OpShapes` with the blocks (attention,
MLP, MoE, head); ``epsim.model.graph`` drives it into an :class:`~epsim.model.opgraph.OpGraph`;
``epsim.model.mtp`` drives it through the draft module's passes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .config import ModelConfig
from .dtypes import COMPUTE_DTYPE, bytes_per_element
from .ids import op_id
from .opgraph import KIND_DIMS, OP_CATEGORIES, Batch, Op
from .plan import ParallelPlan

#: activations' dtype between ops
ACT = "bf16"

#: a value an op reads: a producer's op id (its main value) or ``(op id, value name)``
Read = str | tuple[str, str]


class Emitter:
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
        """Open the next block of the schedule (the embedding, a decoder layer, the head)."""
        self.blocks.append([])

    def emit(self, layer: int, name: str, kind: str, category: str, *,
             deps: Iterable[Read | None] | None = None, outputs: Sequence[str] = ("out",),
             **fields: Any) -> str:
        """Record op ``name`` of ``layer`` reading ``deps`` (default: the last op's main value)
        and writing ``outputs``; ``fields`` are the rest of its :class:`Op`. Returns its id."""
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


class OpsOnlyEmitter(Emitter):
    """An emitter that keeps the ops alone (``build_representative_ops``: no edges are built,
    so no reads are resolved; the checks of ``Emitter.emit`` are of the builder's code, which
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


class OpShapes:
    """The generic op shapes of one microbatch of a model, plan and batch: each method emits one
    op into ``emitter`` and returns its id. ``StepBuilder`` (``epsim.model.graph_builder``) adds
    the blocks made of them.

    ``new_tokens`` / ``context`` override the batch's tokens per sequence and context (an MTP
    draft pass after the first runs one token per sequence further along, ``epsim.model.mtp``).

    Fields:
        model / plan / batch: what is built; ``batch`` is per dp group
            (``Batch.decode(512, 2100)``).
        seqs: this microbatch's sequences. Example: 256 (half of 512 under DBO).
        new_tokens: new tokens per sequence: 1 + ``plan.mtp`` in decode, the prompt chunk in
            prefill (``query_tokens``); 1 in an MTP draft pass after the first.
        context: tokens each sequence attends to (``batch.context`` unless overridden).
        tokens: ``seqs * new_tokens``, the rows of the microbatch's activations.
        emitter: the :class:`Emitter` the ops go to.
        act_elem_bytes / weight_elem_bytes / expert_elem_bytes: bytes per element of the
            activations (``ACT``), the weights and the routed experts' weights. Example: 2.0,
            1.000244140625, 1.000244140625 for DeepSeek-R1 (fp8 with a scale per 128 x 128
            block).
        compute_dtype / expert_compute_dtype: the GEMMs' dtypes (``COMPUTE_DTYPE`` of the
            weights').
        residual: the last fused add+norm's op id (it wrote the residual stream), None before.
    """

    def __init__(self, model: ModelConfig, plan: ParallelPlan, batch: Batch,
                 seqs: int, emitter: Emitter, *, new_tokens: int | None = None,
                 context: int | None = None) -> None:
        self.model, self.plan, self.batch = model, plan, batch
        self.seqs = seqs
        self.new_tokens = query_tokens(plan, batch) if new_tokens is None else new_tokens
        self.context = batch.context if context is None else context
        self.tokens = seqs * self.new_tokens
        self.emitter = emitter
        self.act_elem_bytes = bytes_per_element(ACT)
        self.weight_elem_bytes = bytes_per_element(model.weight_dtype)
        self.expert_elem_bytes = bytes_per_element(model.expert_weight_dtype)
        self.compute_dtype = COMPUTE_DTYPE[model.weight_dtype]
        self.expert_compute_dtype = COMPUTE_DTYPE[model.expert_weight_dtype]
        self.residual: str | None = None  # the last fused add+norm: it wrote the residual stream

    @property
    def kv_len(self) -> int:
        """Cache entries per sequence once the step's tokens are in: decode's context plus the
        drafts it verifies, prefill's prompt."""
        return self.context + self.new_tokens - 1 if self.batch.phase == "decode" else self.context

    # -- generic op shapes ------------------------------------------------------------------

    def gemm(self, layer: int, name: str, category: str, m: int, n: int, k: int, *, out: str,
             batch: int = 1, weight_elem_bytes: float | None = None, dtype: str | None = None,
             deps: Iterable[Read | None] | None = None) -> str:
        """``batch`` GEMMs ``[m, k] @ [k, n]`` writing ``out`` (``weight_elem_bytes`` /
        ``dtype``: the weights' bytes per element and the compute dtype, default the model's)."""
        elem = self.weight_elem_bytes if weight_elem_bytes is None else weight_elem_bytes
        weights = batch * k * n * elem
        act_bytes = self.act_elem_bytes
        return self.emitter.emit(
            layer, name, "gemm", category, deps=deps, outputs=(out,),
            dims={"batch": batch, "m": m, "n": n, "k": k},
            dtype=dtype or self.compute_dtype,
            flops=2.0 * batch * m * n * k,
            bytes_read=weights + batch * m * k * act_bytes,
            bytes_written=batch * m * n * act_bytes,
            weight_bytes=weights,
        )

    def norm(self, layer: int, name: str, category: str, width: int, *, outputs: Sequence[str],
             residual: bool = False, deps: Iterable[Read | None] | None = None) -> str:
        """An RMSNorm over ``width`` features writing ``outputs`` (``residual``: fused with the
        residual add)."""
        # a fused add+RMSNorm reads x and the residual and writes both back
        streams = 2 if residual else 1
        t, act_bytes = self.tokens, self.act_elem_bytes
        return self.emitter.emit(
            layer, name, "norm", category, deps=deps, outputs=outputs,
            dims={"tokens": t, "width": width, "residual": int(residual)},
            dtype=ACT,
            flops=(4.0 + streams) * t * width,
            bytes_read=streams * t * width * act_bytes + width * act_bytes,
            bytes_written=streams * t * width * act_bytes,
            weight_bytes=width * act_bytes,
        )

    def add_norm(self, layer: int, name: str, category: str,
                 block_outputs: Sequence[Read]) -> str:
        """A fused add+RMSNorm: the residual stream (written by the previous one; the first starts
        it) absorbs the block outputs, then is normalised. Writes ``h`` and ``residual``."""
        previous = self.residual
        deps = [*block_outputs, *([(previous, "residual")] if previous else [])]
        self.residual = self.norm(layer, name, category, self.model.hidden_size,
                                  outputs=("h", "residual"), residual=previous is not None,
                                  deps=deps)
        return self.residual

    def elementwise(self, layer: int, name: str, category: str, width_in: int, width_out: int,
                    flops_per_out: float, deps: Iterable[Read | None] | None = None,
                    tokens: float | None = None, routed: bool = False) -> str:
        """A SwiGLU activation: silu(gate) * up over ``width_out`` features (``act``)."""
        t = self.tokens if tokens is None else tokens
        return self.emitter.emit(
            layer, name, "elementwise", category, deps=deps, outputs=("act",),
            dims={"tokens": t, "width": width_out, "width_in": width_in},
            dtype=ACT,
            flops=flops_per_out * t * width_out,
            bytes_read=t * width_in * self.act_elem_bytes,
            bytes_written=t * width_out * self.act_elem_bytes,
            routed=routed,
        )

    def ep_exchange(self, layer: int, kind: str, tokens: float, per_peer_tokens: float,
                    row_bytes: float, *, deps: Iterable[Read | None], out: str, dtype: str,
                    flops: float, bytes_read: float, bytes_written: float) -> str:
        """An EP all-to-all (``kind`` ``"dispatch"`` or ``"combine"``): ``per_peer_tokens`` rows
        of ``row_bytes`` to each of the ``ep`` ranks; its cost follows the step's routing."""
        ep, moe = self.plan.ep, self.model.moe
        return self.emitter.emit(
            layer, f"moe.{kind}", kind, kind, deps=deps, outputs=(out,),
            dims={"tokens": tokens, "group": "ep", "group_size": ep,
                  "hidden": self.model.hidden_size, "top_k": moe.top_k,
                  "bytes_per_token": row_bytes, "expected_tokens_per_peer": per_peer_tokens},
            dtype=dtype, flops=flops, bytes_read=bytes_read, bytes_written=bytes_written,
            peer_bytes=tuple(per_peer_tokens * row_bytes for _ in range(ep)), routed=True,
        )

    def collective(self, layer: int, name: str, kind: str, category: str, tokens: float,
                   width: int, group_size: int, group: str, *, out: str,
                   deps: Iterable[Read | None] | None = None) -> str:
        """An all-reduce or all-gather over a full mesh of ``group_size`` GPUs (one-shot)."""
        size = tokens * width * self.act_elem_bytes
        if kind == "all_reduce":
            # reduce-scatter then all-gather: each peer gets 1/n of the buffer twice
            per_peer = 2.0 * size / group_size
            written = size
        else:  # all_gather: this rank's shard to every peer
            per_peer = size
            written = size * group_size
        peers = tuple(per_peer for _ in range(group_size))
        return self.emitter.emit(
            layer, name, kind, category, deps=deps, outputs=(out,),
            dims={"tokens": tokens, "width": width, "group": group, "group_size": group_size},
            dtype=ACT,
            flops=float(tokens * width * (group_size - 1)) if kind == "all_reduce" else 0.0,
            bytes_read=size,
            bytes_written=written,
            peer_bytes=peers,
        )
