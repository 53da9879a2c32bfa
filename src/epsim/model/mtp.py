"""MTP speculative decoding: DeepSeek's multi-token-prediction module as a draft model.

Glossary:
    draft tokens  ``N = ParallelPlan.mtp``: tokens the draft module proposes per step and the next
                  decode step verifies. A verify step computes ``1 + N`` tokens per sequence (the
                  last emitted token and the N drafts) through the main model, as one causal
                  multi-token decode step over the cached context.
    acceptance    ``P``: the probability that a draft token is accepted given the one before it
                  was. A step emits ``1 + a`` tokens per sequence, ``a`` the number of leading
                  drafts accepted (a chain of Bernoulli(P) trials, at most N), so a sequence
                  advances by ``sum_{k=0..N} P**k`` tokens per step on average.
    draft pass    one run of the draft module; a step runs N of them after the main model. Pass 0
                  runs over every verified position (the draft layer's own KV cache needs them;
                  the last accepted one proposes the first draft), pass ``k >= 1`` over one token
                  per sequence one position further (vLLM's ``EagleProposer.propose``, method
                  ``mtp``: vllm-project/vllm vllm/v1/spec_decode/eagle.py at 008603a3).
    draft layer   DeepSeek-V3's MTP module (arXiv 2412.19437, section 2.2; vLLM's
                  ``DeepSeekMultiTokenPredictorLayer``, vllm/model_executor/models/deepseek_mtp.py
                  at 03356f8c): the embedding of the next token and the main model's hidden state,
                  each RMS-normalised (``enorm``, ``hnorm``), concatenated (embedding first) and
                  projected 2h -> h (``eh_proj``), one decoder layer (MLA and, for DeepSeek-V3, an
                  MoE FFN), then the shared head's RMSNorm and the output head. The embedding and
                  the output head are the main model's (the report's "shared embedding" and
                  "shared output head"). It is numbered ``num_layers`` (61 for DeepSeek-V3, as in
                  its checkpoint's ``model.layers.61``); passes share its weights and KV cache.

Op names of the draft module (layer ``num_layers``, ``Op.draft`` = the pass): ``mtp.embed``,
``mtp.enorm``, ``mtp.hnorm``, ``mtp.eh_proj``, the decoder layer's own names (``attn_norm``,
``attn.q_a``, ..., ``moe.experts``), ``mtp.head_norm``, ``mtp.lm_head``, ``mtp.sample``. The
draft head computes logits for one row per sequence: its last accepted position (pass 0), its
only row (later passes); it also hands that row's hidden state (before the head norm) to the
next pass, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .config import ModelConfig
from .errors import EpsimError
from .graph_builder import StepBuilder
from .graph_emit import ACT
from .opgraph import Batch

#: default ``P``: DeepSeek-V3 Technical Report (arXiv 2412.19437), section 5.4.3: "Based on our
#: evaluation, the acceptance rate of the second token prediction ranges between 85% and 90%
#: across various generation topics, demonstrating consistent reliability." The lower end.
DEFAULT_ACCEPTANCE = 0.85
ACCEPTANCE_SOURCE = ("DeepSeek-V3 Technical Report, arXiv 2412.19437, section 5.4.3: the "
                     "acceptance rate of the second token prediction ranges between 85% and 90%")
#: a fixed word mixed into the runtime's acceptance seeds, so they are no other stream's
_RUNTIME_STREAM = 0x6D7470


def expected_tokens(drafts: int, acceptance: float) -> float:
    """Tokens a sequence advances per step on average: ``sum_{k=0..drafts} acceptance**k``.

    Example: ``expected_tokens(1, 0.6) == 1.6``; ``expected_tokens(0, p) == 1``.
    """
    check_acceptance(acceptance)
    return float(sum(acceptance ** k for k in range(drafts + 1)))


def check_acceptance(acceptance: float) -> float:
    if isinstance(acceptance, bool) or not isinstance(acceptance, (int, float)) \
            or not 0.0 <= acceptance <= 1.0:
        raise EpsimError(f"MTP acceptance must be a probability in [0, 1], got {acceptance!r}")
    return float(acceptance)


def sample_accepted(drafts: int, acceptance: float, rng: np.random.Generator,
                    size: int) -> np.ndarray:
    """``[size]`` accepted drafts per sequence: the leading successes of ``drafts`` Bernoulli
    trials of probability ``acceptance`` each (a draft counts only if every one before it was
    accepted). Draws ``size * drafts`` uniforms from ``rng`` (none when ``drafts`` is 0)."""
    check_acceptance(acceptance)
    if drafts == 0 or size == 0:
        return np.zeros(size, dtype=np.int64)
    trials = rng.random((size, drafts)) < acceptance
    return np.cumprod(trials, axis=1).sum(axis=1).astype(np.int64)


def runtime_accepted(seed: int, rank: int, step: int, seqs: int, drafts: int,
                     acceptance: float) -> np.ndarray:
    """The accepted drafts of each of a rank's sequences in decode step ``step`` of an
    ``epsim run`` (the runtime simulates acceptance; its dense reference replays the same)."""
    rng = np.random.default_rng((seed, _RUNTIME_STREAM, rank, step))
    return sample_accepted(drafts, acceptance, rng, seqs)


def draft_layer(model: ModelConfig) -> int:
    """The draft module's layer number: right after the decoder layers (61 for DeepSeek-V3)."""
    return model.num_layers


def routing_layer(model: ModelConfig) -> int:
    """The main-model layer whose expert statistics and placement the draft layer's routed
    experts take: no load statistics of DeepSeek's MTP layer are published, so it routes and
    sits like the last MoE layer (an assumption, docs/simulator.md)."""
    if not model.moe_layers:
        raise EpsimError(f"{model.name} has no MoE layer for its draft layer to route like")
    return model.moe_layers[-1]


# --------------------------------------------------------------------------------------------
# The draft module's ops (called by epsim.model.graph for each pass)
# --------------------------------------------------------------------------------------------


def emit_draft_pass(main: StepBuilder, k: int) -> None:
    """Emit draft pass ``k`` of one microbatch after ``main`` (the main model's builder, whose
    head has been emitted, as have passes ``0 .. k-1``)."""
    model, emitter = main.model, main.emitter
    layer = draft_layer(model)
    emitter.draft = k
    if k == 0:  # over every position the main model verified, at its context
        builder = StepBuilder(model, main.plan, main.batch, main.seqs, emitter)
        token_src, hidden_src = emitter.results["next_tokens"], emitter.results["hidden"]
    else:  # one token per sequence, k positions past the verified ones
        builder = StepBuilder(model, main.plan, Batch.decode(main.batch.seqs, main.kv_len + k),
                              main.seqs, emitter, new_tokens=1)
        token_src = emitter.results[f"draft_tokens{k - 1}"]
        hidden_src = (emitter.draft_carry, "hidden")  # the previous pass's head wrote it
    x = _draft_input(builder, layer, token_src, hidden_src)
    emitter.begin_block()
    attn = builder.attention(layer, [x])
    outputs = (builder.moe(layer, attn) if model.mtp_moe
               else [builder.dense_mlp(layer, attn)])
    _draft_head(builder, layer, outputs, last=k == main.plan.mtp - 1)
    emitter.draft = None


def _draft_input(builder: StepBuilder, layer: int, token_src: tuple[str, str],
                 hidden_src: tuple[str, str]) -> str:
    """``eh_proj([enorm(embed(next tokens)); hnorm(hidden)])``: the draft layer's input."""
    emitter, h, t = builder.emitter, builder.model.hidden_size, builder.tokens
    act_bytes, tp = builder.act_elem_bytes, builder.plan.tp
    emitter.begin_block()
    emb = emitter.emit(
        layer, "mtp.embed", "embedding", "other", deps=[token_src], outputs=("emb",),
        dims={"tokens": t, "hidden": h, "vocab": builder.model.vocab_size // tp},
        dtype=ACT, flops=0.0,
        bytes_read=t * h * act_bytes + t * 8, bytes_written=t * h * act_bytes,
    )
    if tp > 1:  # the vocab-parallel table, as the main embedding
        emb = builder.collective(layer, "mtp.embed.all_reduce", "all_reduce", "tp_comm", t, h,
                                 tp, "tp", out="emb", deps=[emb])
    enorm = builder.norm(layer, "mtp.enorm", "other", h, outputs=("e",), deps=[emb])
    hnorm = builder.norm(layer, "mtp.hnorm", "other", h, outputs=("hh",), deps=[hidden_src])
    return builder.gemm(layer, "mtp.eh_proj", "other", t, h, 2 * h, out="x",
                        deps=[enorm, hnorm])


def _draft_head(builder: StepBuilder, layer: int, outputs: Sequence[object],
                last: bool) -> None:
    """The shared head over one row per sequence; records ``draft_logits{k}`` (its op also
    writes the row's hidden state for the next pass) and ``draft_tokens{k}``."""
    emitter, act_bytes, tp = builder.emitter, builder.act_elem_bytes, builder.plan.tp
    h, v = builder.model.hidden_size, builder.model.vocab_size
    emitter.begin_block()
    norm = builder.add_norm(layer, "mtp.head_norm", "other", outputs)
    rows = builder.seqs
    weights = h * (v // tp) * act_bytes
    # the row's hidden state before the head norm goes on to the next pass
    carry = [] if last else [(norm, "residual")]
    head = emitter.emit(
        layer, "mtp.lm_head", "lm_head", "other", deps=[(norm, "h"), *carry],
        outputs=("logits", "hidden") if carry else ("logits",),
        dims={"tokens": rows, "hidden": h, "vocab": v // tp},
        dtype=ACT, flops=2.0 * rows * h * (v // tp),
        bytes_read=weights + rows * h * act_bytes * (1 if last else 2),
        bytes_written=rows * (v // tp) * 4 + (0 if last else rows * h * act_bytes),
        weight_bytes=weights,
    )
    logits = head
    if tp > 1:
        logits = builder.collective(layer, "mtp.lm_head.all_gather", "all_gather", "tp_comm",
                                    rows, v // tp, tp, "tp", out="logits", deps=[(head, "logits")])
    sample = emitter.emit(
        layer, "mtp.sample", "sample", "other", deps=[(logits, "logits")],
        outputs=("next_tokens",), dims={"tokens": rows, "vocab": v}, dtype="fp32",
        flops=float(rows * v), bytes_read=rows * v * 4, bytes_written=rows * 8,
    )
    k = emitter.draft
    emitter.results[f"draft_logits{k}"] = (logits, "logits")
    emitter.results[f"draft_tokens{k}"] = (sample, "next_tokens")
    emitter.draft_carry = None if last else head
