"""How many keys the queries of one attention layer read, and what DSA's lightning indexer costs:
the formulas the op graph (``epsim.model.graph_builder``) puts into its attention ops' FLOPs and
bytes, kept apart so a test can check them by hand.

A query at position ``c - 1`` (``c`` tokens up to and including itself) attends, by layer type
(``AttentionConfig.keys_attended``):

    full       ``c`` keys
    sliding    ``min(c, window)``
    chunked    ``(c - 1) % chunk + 1``: the tokens of its own chunk up to itself (Llama-4; vLLM
               runs each chunk as its own sequence). The decode graph, which knows one context for
               all sequences, takes the bound ``min(c, chunk)``.
    sparse     ``min(c, index_topk)``: DSA keeps the top-k keys its indexer scores (DeepSeek-V3.2)

DSA's indexer (DeepSeek-V3.2-Exp ``inference/model.py`` class Indexer; SGLang
``python/sglang/srt/layers/attention/nsa/nsa_indexer.py`` at 005e8bf8, which calls DeepGEMM's
``fp8_mqa_logits`` / ``fp8_paged_mqa_logits``) scores every earlier key for every query:
``logit[s] = sum_h w_h * relu(q_h . k_s)`` over ``index_n_heads`` heads of ``index_head_dim``,
queries and keys in FP8 (one fp32 scale per key), then keeps the ``index_topk`` best. Per
(query, key) pair scored that is ``2 * heads * dim`` FLOPs for the dots plus ``3 * heads`` for
ReLU, weight and sum (:func:`indexer_cost`).
"""

from __future__ import annotations

from dataclasses import dataclass


def sum_min(first: int, last: int, cap: int) -> float:
    """``sum(min(c, cap) for c in range(first, last + 1))`` in closed form (0 when empty)."""
    def upto(n: int) -> float:
        if n <= 0:
            return 0.0
        if n <= cap:
            return n * (n + 1) / 2
        return cap * (cap + 1) / 2 + (n - cap) * cap
    return upto(last) - upto(first - 1)


def sum_chunked(first: int, last: int, chunk: int) -> float:
    """``sum((c - 1) % chunk + 1 for c in range(first, last + 1))`` in closed form."""
    def upto(n: int) -> float:
        if n <= 0:
            return 0.0
        whole, rest = divmod(n, chunk)
        return whole * chunk * (chunk + 1) / 2 + rest * (rest + 1) / 2
    return upto(last) - upto(first - 1)


def keys_sum(layer_type: str, first: int, last: int, *, window: int | None = None,
             chunk: int | None = None, topk: int = 0) -> float:
    """Keys attended by the queries at contexts ``first .. last`` (one sequence) in a layer of
    ``layer_type`` (``"full"``, ``"sliding"``, ``"chunked"``; ``topk`` > 0: DSA)."""
    if layer_type == "sliding" and window:
        return sum_min(first, last, window)
    if layer_type == "chunked" and chunk:
        return sum_chunked(first, last, chunk)
    if topk:
        return sum_min(first, last, topk)
    return sum_min(first, last, max(last, 1))


#: bytes per cached indexer key beyond its FP8 values: one fp32 scale (per 128 values)
INDEX_KEY_SCALE_BYTES = 4
#: bytes of one fp32 logit, one int32 selected index
LOGIT_BYTES = 4
INDEX_BYTES = 4


@dataclass(frozen=True)
class IndexerCost:
    """FLOPs and HBM bytes of one layer's indexer op for one microbatch on one rank."""

    flops: float
    bytes_read: float
    bytes_written: float


def indexer_cost(seqs: int, queries: int, first: int, cache_rows: int, heads: int, dim: int,
                 topk: int, act_bytes: float) -> IndexerCost:
    """The indexer over ``seqs`` sequences of ``queries`` new tokens each, at contexts
    ``first .. first + queries - 1`` (``cache_rows``: keys per sequence in the index cache once
    the new ones are in):

        pairs         = seqs * sum over the queries of their context (every earlier key scored)
        flops         = pairs * (2 * heads * dim + 3 * heads)
        bytes_read    = seqs * cache_rows * (dim + 4)       FP8 keys and their scales
                        + tokens * (heads * dim + heads * 4) FP8 queries, fp32 head weights
                        + tokens * dim * act_bytes          the new keys before quantising
                        + pairs * 4                         the logits, read by the top-k
        bytes_written = tokens * (dim + 4)                  the new keys into the cache
                        + pairs * 4                         the logits
                        + tokens * topk * 4                 the selected indices
    """
    tokens = seqs * queries
    pairs = seqs * sum_min(first, first + queries - 1, first + queries)
    key_row = dim + INDEX_KEY_SCALE_BYTES
    flops = pairs * (2.0 * heads * dim + 3.0 * heads)
    read = (seqs * cache_rows * key_row + tokens * (heads * dim + heads * LOGIT_BYTES)
            + tokens * dim * act_bytes + pairs * LOGIT_BYTES)
    written = tokens * key_row + pairs * LOGIT_BYTES + tokens * topk * INDEX_BYTES
    return IndexerCost(flops=flops, bytes_read=read, bytes_written=written)
