"""Per-step expert routing: which GPU's experts each token goes to, sampled from load statistics.

Glossary:
    loads       ``[layers, experts]`` counts (``epsim.model.loads``); dense layers are all-zero rows.
    frequencies each MoE layer's loads normalised to probabilities.
    pairs       (token, expert) assignments; a token makes ``top_k`` of them per MoE layer.
    slot        a physical expert place (``epsim.model.placement``); GPU ``g`` holds slots
                ``g * slots_per_gpu ..``.

Sampling model (documented in docs/simulator.md): for every MoE layer, microbatch and source rank,
the ``tokens * top_k`` pairs of that rank's microbatch are one multinomial draw over the layer's
expert frequencies (DP attention: every rank has its own batch, so every rank draws its own).
It is drawn in two exact stages: each rank's pairs over the GPUs (a multinomial over the GPUs'
summed frequencies), then each GPU's total over its slots (the sum of independent multinomials with
the same probabilities, conditioned on its total, is multinomial with the within-GPU shares). When
a GPU's slots average 16 pairs or more, that last split is drawn from the normal law with the
multinomial's mean and covariance (rounded, clipped at 0): it only sets tile padding and which
experts are idle, and costs a tenth of the exact draw.
Logical experts go to physical slots through :func:`model.placement.remap` (a replicated expert's
pairs are shared round-robin among its replicas). Tokens sent from rank ``r`` to GPU ``g`` count a
token once however many of its experts sit on ``g``: with ``n`` of the rank's ``T * k`` pairs on
``g``, a token misses ``g`` with probability ``(1 - n / (T k)) ** k``, so
``tokens = T * (1 - (1 - n / (T k)) ** k)`` (exact for uniform routing up to sampling without
replacement: 0.656 vs 0.662 of the tokens for 32 of 256 experts and top-8).

Synthetic loads (no ``--loads`` file) are ``epsim.model.loads.synthetic_loads``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from epsim.model.compiled import compiled as _compiled
from epsim.model.config import ModelConfig
from epsim.model.errors import EpsimError
from epsim.model.placement import Placement, remap


@dataclass(frozen=True)
class RoutingSample:
    """One step's routing, per MoE layer and microbatch.

    layers: ``[L]`` the model layer of each row. Example: ``[3, 4, ..., 60]``.
    slot_pairs: ``[L, mb, slots]`` pairs each physical slot receives from all ranks.
    pairs: ``[L, mb, ranks, gpus]`` pairs rank ``r`` sends to GPU ``g`` (``g == r`` stays local).
    tokens: ``[L, mb, ranks, gpus]`` token copies rank ``r`` sends to GPU ``g`` (dispatch rows).
    slots_per_gpu: 32 for 256 experts on 8 GPUs.
    """

    layers: np.ndarray
    slot_pairs: np.ndarray
    pairs: np.ndarray
    tokens: np.ndarray
    slots_per_gpu: int

    @property
    def gpu_pairs(self) -> np.ndarray:
        """``[L, mb, gpus]`` pairs each GPU's experts process."""
        return self.pairs.sum(axis=2)

    def imbalance(self) -> np.ndarray:
        """``[L, mb]`` busiest GPU's pairs over the mean GPU's."""
        g = self.gpu_pairs
        return g.max(axis=-1) / np.maximum(g.mean(axis=-1), 1e-12)


def slot_frequencies(freqs: np.ndarray, placement: Placement, rows: np.ndarray) -> np.ndarray:
    """Per-slot probability of a pair: ``[L, experts]`` logical -> ``[L, slots]`` physical.

    Each logical expert's probability is shared among its replicas through ``remap``: replica ``j``
    of an expert with ``n`` replicas gets ``1 / n`` (round-robin over tokens, on average).
    """
    l2p = placement.logical_to_physical
    counts = placement.replica_counts
    num_logical = placement.num_logical
    out = np.zeros((len(rows), placement.num_slots))
    ids = np.arange(num_logical, dtype=np.int64)[:, None]  # one "token" per logical expert
    for i, layer in enumerate(rows):
        reps = counts[layer]
        for j in range(int(reps.max())):
            slots = remap(ids, l2p[layer], reps, np.full((num_logical, 1), j))[:, 0]
            share = np.where(j < reps, freqs[i] / reps, 0.0)
            np.add.at(out[i], slots, share)
    return out


#: mean pairs per slot from which a GPU's split over its slots is drawn from the normal law with the
#: multinomial's mean and covariance instead of exactly (numpy's multinomial costs one binomial
#: draw per slot; at 16+ pairs per slot the two laws differ by well under a tile of padding)
NORMAL_SPLIT_MIN_MEAN = 16.0


def _split_counts(total: np.ndarray, probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``[..., G]`` totals split over ``[..., G, S]`` shares: multinomial counts ``[..., G, S]``."""
    slots = probs.shape[-1]
    if total.size == 0 or total.min() / slots < NORMAL_SPLIT_MIN_MEAN:
        return rng.multinomial(total, probs)
    # mean N p, covariance N (diag p - p p^T): sqrt(N p) z has N diag(p); removing p times its
    # sum gives the multinomial covariance exactly
    mean = total[..., None] * probs
    y = np.sqrt(mean) * rng.standard_normal(mean.shape)
    y_sum = y.sum(axis=-1)
    counts = np.empty(mean.shape)
    shares = probs if probs.shape == mean.shape else np.broadcast_to(probs, mean.shape)
    _round_split(total.reshape(-1).astype(np.float64), shares.reshape(-1, slots),
                 mean.reshape(-1, slots), y.reshape(-1, slots), y_sum.reshape(-1),
                 counts.reshape(-1, slots))
    return counts


@_compiled
def _round_split(total, probs, mean, y, y_sum, out):  # noqa: ANN001, ANN202
    """The normal draw rounded to counts, row by row (``out`` ``[rows, S]``): each slot's
    ``rint(mean + y - p * sum(y))`` clipped at 0; rounding leaves a row's total off by a few
    pairs, which its likeliest slot (the first of the largest share) absorbs, clipped at 0. The
    arithmetic is numpy's whole-array expression element for element, so the counts are equal."""
    for r in range(out.shape[0]):
        placed = 0.0
        hot = 0
        for s in range(out.shape[1]):
            c = np.rint(mean[r, s] + y[r, s] - probs[r, s] * y_sum[r])
            c = c if c > 0.0 else 0.0  # as np.maximum(c, 0.0): -0.0 becomes 0.0
            out[r, s] = c
            placed += c
            if probs[r, s] > probs[r, hot]:
                hot = s
        fixed = out[r, hot] + (total[r] - placed)
        out[r, hot] = fixed if fixed > 0.0 else 0.0


def placed_frequencies(loads: np.ndarray, placement: Placement, rows: np.ndarray) -> np.ndarray:
    """``[layers, experts]`` counts -> ``[len(rows), slots]`` per-slot pair probabilities."""
    moe_loads = loads[rows]
    totals = moe_loads.sum(axis=1, keepdims=True)
    if np.any(totals <= 0):
        layer = int(rows[np.flatnonzero(totals[:, 0] <= 0)[0]])
        raise EpsimError(f"loads carry no tokens for MoE layer {layer}")
    return slot_frequencies(moe_loads / totals, placement, rows)


def sample_routing(model: ModelConfig, loads: np.ndarray, placement: Placement,
                   microbatch_tokens: tuple[int, ...], ranks: int,
                   rng: np.random.Generator, p_slot: np.ndarray | None = None
                   ) -> RoutingSample:
    """Sample one step's routing (module docstring).

    Args:
        model: the model (top-k, MoE layers).
        loads: ``[num_layers, experts]`` counts.
        placement: where the experts sit (``num_gpus`` GPUs, ``[num_layers, slots]``).
        microbatch_tokens: tokens per rank in each microbatch. Example: ``(256, 256)``.
        ranks: source ranks (each draws its own tokens' experts).
        rng: the step's random generator.
        p_slot: ``[moe_layers, slots]`` precomputed :func:`slot_frequencies` (a cache's).

    Returns:
        A :class:`RoutingSample`.
    """
    rows = np.asarray(model.moe_layers, dtype=np.int64)
    if loads.shape != (model.num_layers, model.moe.num_experts):
        raise EpsimError(f"loads of shape {list(loads.shape)} do not match the model's "
                         f"[{model.num_layers}, {model.moe.num_experts}] layers x experts")
    if placement.num_layers != model.num_layers or placement.num_logical != model.moe.num_experts:
        raise EpsimError(f"placement of {placement.num_layers} layers x {placement.num_logical} "
                         f"experts does not match {model.name}")
    if p_slot is None:
        p_slot = placed_frequencies(loads, placement, rows)  # [L, S]
    return sample_rows(rows, p_slot, model.moe.top_k, placement, microbatch_tokens, ranks, rng)


def sample_rows(rows: np.ndarray, p_slot: np.ndarray, k: int, placement: Placement,
                microbatch_tokens: tuple[int, ...], ranks: int, rng: np.random.Generator
                ) -> RoutingSample:
    """The routing of the rows of ``p_slot`` (``[L, slots]`` per-slot pair probabilities, the
    model layer of each in ``rows``), ``microbatch_tokens`` tokens per rank in each microbatch
    and ``k`` experts per token (:func:`sample_routing`'s draw; an MTP draft pass's MoE layer is
    sampled on its own, with its own tokens)."""
    num_gpus = placement.num_gpus
    per_gpu = placement.slots_per_gpu
    mbs = len(microbatch_tokens)
    layers = len(rows)
    # the GPU of each pair, and the slot of a pair given its GPU
    p_gpu = p_slot.reshape(layers, num_gpus, per_gpu).sum(axis=2)  # [L, G]
    p_within = p_slot.reshape(layers, num_gpus, per_gpu) / np.maximum(p_gpu, 1e-300)[..., None]
    slot_pairs = np.zeros((layers, mbs, placement.num_slots))
    pairs = np.zeros((layers, mbs, ranks, num_gpus))
    tokens = np.zeros_like(pairs)
    for mb, t in enumerate(microbatch_tokens):
        # Step 1: every rank's T * k pairs over the GPUs (a multinomial over the GPUs' summed
        # frequencies: the per-slot multinomial grouped by GPU)
        n = rng.multinomial(t * k, p_gpu[:, None, :], size=(layers, ranks))  # [L, R, G]
        pairs[:, mb] = n
        # Step 2: given each GPU's total from all ranks, its slots' counts (the sum of the ranks'
        # per-slot multinomials, conditioned on that total, is this multinomial)
        total = n.sum(axis=1)  # [L, G]
        slot_pairs[:, mb] = _split_counts(total, p_within, rng).reshape(layers, -1)
        # Step 3: a token goes once to each GPU holding any of its experts
        tokens[:, mb] = once_per_destination(n, t, k)
    return RoutingSample(layers=np.asarray(rows, dtype=np.int64), slot_pairs=slot_pairs,
                         pairs=pairs, tokens=tokens, slots_per_gpu=per_gpu)


def once_per_destination(pairs: np.ndarray, tokens: np.ndarray | float, k: int) -> np.ndarray:
    """Tokens a rank sends to a destination (a GPU, or a node: its GPUs' pairs summed) that got
    ``pairs`` of the rank's ``tokens * k`` pairs: each token once (module docstring)."""
    return tokens * (1.0 - (1.0 - pairs / (tokens * k)) ** k)


def node_tokens(routing: RoutingSample, row_tokens: np.ndarray, k: int, gpus_per_node: int
                ) -> np.ndarray:
    """``[L, mb, ranks, nodes]`` tokens rank ``r`` sends to node ``b`` in a node-then-GPU
    dispatch (once per token and node; ``row_tokens``: ``[L, mb]`` tokens per rank)."""
    pairs = routing.pairs
    per_node = pairs.reshape(*pairs.shape[:-1], -1, gpus_per_node).sum(axis=-1)
    return once_per_destination(per_node, np.asarray(row_tokens)[:, :, None, None], k)


def stack_routing(samples: list[RoutingSample]) -> RoutingSample:
    """Several samples' rows one after another (the main layers', then each draft pass's)."""
    if len(samples) == 1:
        return samples[0]
    return RoutingSample(
        layers=np.concatenate([s.layers for s in samples]),
        slot_pairs=np.concatenate([s.slot_pairs for s in samples]),
        pairs=np.concatenate([s.pairs for s in samples]),
        tokens=np.concatenate([s.tokens for s in samples]),
        slots_per_gpu=samples[0].slots_per_gpu)
