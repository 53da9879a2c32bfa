"""What a serving run keeps as it goes, so that its memory does not grow with its tokens.

    Weighted   a population of values with multiplicities, sorted: ``mean``, ``std``,
               ``median`` and numpy's linear ``percentile`` of the expanded population, the
               order statistics exact (no sketch: see below)
    GapLog     the inter-token gaps as the steps emit them, kept as (value, count): an emit's
               first gap and how many share it, the emit's other gaps buffered per instance
               and counted by a sort when the buffer fills; the raw per-request lists only
               when asked (``keep_requests``)
    Gaps       the finished log: every gap's value and multiplicity and its instance, the
               outputs emitted per instant (vLLM's peak output rate), and the raw lists if kept
    StepTally  the step figures the metrics take (decode-only throughput, breakdown, KV use,
               counts), accumulated per step in step order, for the run and per (role,
               instance)

Why exact and small: one step emits one gap per decoding request, and every request that also
decoded in the step before gets the same gap (the step's own duration, the same float), so a
step's gaps take one value per request that joined since plus one; a run keeps about one value
per step and per request instead of one per output token (a million ShareGPT-like requests:
~300 M gaps, ~1.5 M kept values). Order statistics of the expanded population are read off the
cumulative counts, so percentiles equal numpy's on the expanded array; mean and standard
deviation are weighted sums, equal to numpy's to rounding (numpy sums pairwise).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: the sides whose steps decode (a disaggregated prefill side's do not)
DECODING_ENGINES = ("colocated", "decode")


class Weighted:
    """Values with multiplicities: ``values[k]`` occurs ``counts[k]`` times (any order in)."""

    def __init__(self, values: np.ndarray, counts: np.ndarray | None = None) -> None:
        values = np.asarray(values, dtype=np.float64)
        counts = np.ones(len(values), dtype=np.int64) if counts is None \
            else np.asarray(counts, dtype=np.int64)
        order = np.argsort(values, kind="stable")
        self.values, self.counts = values[order], counts[order]
        self.cum = np.cumsum(self.counts)
        self.n = int(self.cum[-1]) if len(self.cum) else 0

    def __len__(self) -> int:
        return self.n

    def scaled(self, factor: float) -> Weighted:
        """Every value times ``factor`` (multiplied elementwise, as numpy would)."""
        out = Weighted.__new__(Weighted)
        out.values, out.counts, out.cum, out.n = self.values * factor, self.counts, self.cum, \
            self.n
        return out

    def at(self, k: np.ndarray) -> np.ndarray:
        """The ``k``-th smallest values (0-based) of the expanded population."""
        return self.values[np.searchsorted(self.cum, np.asarray(k) + 1, side="left")]

    # sums by numpy's pairwise summation, not np.dot: BLAS's dot splits a long sum over its
    # threads, so its last bit depended on how many the process had (a search worker runs one)
    def mean(self) -> float:
        return float(np.sum(self.values * self.counts) / self.n)

    def std(self) -> float:
        dev = self.values - self.mean()
        return float(np.sqrt(np.sum(dev * dev * self.counts) / self.n))

    def median(self) -> float:
        half = self.n // 2
        if self.n % 2:
            return float(self.at(half))
        return float(np.mean(self.at(np.array([half - 1, half]))))

    def percentile(self, q: Sequence[float]) -> np.ndarray:
        """numpy's ``percentile(expanded, q)`` (method "linear"): the virtual index
        ``(n - 1) * q / 100`` between two order statistics, numpy's own interpolation."""
        virtual = (self.n - 1) * (np.asarray(q, dtype=np.float64) / 100)
        below = np.floor(virtual)
        gamma = virtual - below
        lo = below.astype(np.int64)
        a, b = self.at(lo), self.at(np.minimum(lo + 1, self.n - 1))
        diff = b - a
        out = a + diff * gamma
        return np.where(gamma >= 0.5, b - diff * (1 - gamma), out)


#: gaps a :class:`GapLog` buffers per instance before it counts them (a sort): 2 MB
REST_BUFFER_GAPS = 1 << 18


class GapLog:
    """The gaps of a run as its steps emit them (``add``, or ``add_counted`` where the emit has
    counted its first gap's and buffered the others), then :meth:`finish`."""

    def __init__(self, keep_requests: bool) -> None:
        self.keep_requests = keep_requests
        # per emit, the first gap's value, how many gaps had it, the instance
        self._bulk_value: list[float] = []
        self._bulk_count: list[int] = []
        self._bulk_instance: list[int] = []
        # the emit's other values, with their counts
        self._other: list[np.ndarray] = []
        self._other_counts: list[np.ndarray] = []
        self._other_instance: list[int] = []
        self._other_sizes: list[int] = []
        self._emit_t: list[float] = []
        self._emit_n: list[int] = []
        self._raw: list[np.ndarray] = []
        self._raw_ids: list[np.ndarray] = []
        # per instance, the gaps of :meth:`add_counted` emits that differ from their emit's
        # first, uncounted yet (a buffer and its fill): counted by one sort when full
        self._rest: dict[int, np.ndarray] = {}
        self._rest_n: dict[int, int] = {}

    def first_tokens(self, t: float, n: int) -> None:
        """``n`` first tokens reached the client at ``t`` (outputs, not gaps)."""
        self._emit_t.append(t)
        self._emit_n.append(n)

    def add(self, gaps: np.ndarray, ids: np.ndarray, t: float, instance: int) -> None:
        """One output each for ``ids`` at ``t``, ``gaps`` after their previous ones."""
        if not len(gaps):
            return
        # most requests share a gap with many others (those that decoded in the same steps
        # since their last output): the first gap's by a comparison, the others by a sort
        same = gaps == gaps[0]
        n_same = int(np.count_nonzero(same))
        self._bulk_value.append(float(gaps[0]))
        self._bulk_count.append(n_same)
        self._bulk_instance.append(instance)
        if n_same < len(gaps):
            values, counts = np.unique(gaps[~same], return_counts=True)
            self._other.append(values)
            self._other_counts.append(counts)
            self._other_instance.append(instance)
            self._other_sizes.append(len(values))
        self._emit_t.append(t)
        self._emit_n.append(len(gaps))
        if self.keep_requests:
            self._raw.append(gaps)
            self._raw_ids.append(ids.copy())

    def rest_buffer(self, instance: int, need: int) -> tuple[np.ndarray, int]:
        """Instance ``instance``'s buffer of uncounted gaps with room for ``need`` more, and its
        fill (where an emit writes its gaps that differ from its first)."""
        buf, n = self._rest.get(instance), self._rest_n.get(instance, 0)
        if buf is None or n + need > len(buf):
            self._count_rest(instance)
            n = 0
            if buf is None or need > len(buf):
                buf = self._rest[instance] = np.empty(max(need, REST_BUFFER_GAPS))
        return buf, n

    def add_counted(self, first_gap: float, n_same: int, n: int, rest_n: int, t: float,
                    instance: int) -> None:
        """One output each for ``n`` requests at ``t``: ``n_same`` gaps of ``first_gap``, the
        others written to :meth:`rest_buffer`'s buffer, which is now filled to ``rest_n`` (the
        per-request lists are not kept on this path)."""
        self._bulk_value.append(first_gap)
        self._bulk_count.append(n_same)
        self._bulk_instance.append(instance)
        self._rest_n[instance] = rest_n
        self._emit_t.append(t)
        self._emit_n.append(n)

    def _count_rest(self, instance: int) -> None:
        n = self._rest_n.get(instance, 0)
        if n:
            values, counts = np.unique(self._rest[instance][:n], return_counts=True)
            self._other.append(values)
            self._other_counts.append(counts)
            self._other_instance.append(instance)
            self._other_sizes.append(len(values))
        self._rest_n[instance] = 0

    def finish(self) -> Gaps:
        for instance in list(self._rest):
            self._count_rest(instance)

        def cat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
            return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

        raw = cat(self._raw, np.float64) if self.keep_requests else None
        raw_ids = cat(self._raw_ids, np.int64) if self.keep_requests else None
        return Gaps(values=np.concatenate([np.array(self._bulk_value, dtype=np.float64),
                                           cat(self._other, np.float64)]),
                    counts=np.concatenate([np.array(self._bulk_count, dtype=np.int64),
                                           cat(self._other_counts, np.int64)]),
                    instance=np.concatenate([
                        np.array(self._bulk_instance, dtype=np.int64),
                        np.repeat(np.array(self._other_instance, dtype=np.int64),
                                  np.array(self._other_sizes, dtype=np.int64))]),
                    emit_t=np.array(self._emit_t), emit_n=np.array(self._emit_n, dtype=np.int64),
                    raw=raw, raw_request_ids=raw_ids)


@dataclass
class Gaps:
    """A run's inter-token gaps.

    values / counts / instance: ``[entries]`` a gap's value in seconds, how many gaps had it
        in one emit, and the instance that emitted them. Example: ``[0.081, 0.081, 0.12]``,
        ``[4093, 4091, 2]``, ``[0, 0, 0]``.
    emit_t / emit_n: ``[emits]`` when outputs reached the client (first tokens included) and
        how many at once.
    raw / raw_request_ids: every gap in emit order and its request (``None`` unless the run
        kept the per-request lists).
    """

    values: np.ndarray
    counts: np.ndarray
    instance: np.ndarray
    emit_t: np.ndarray = field(default_factory=lambda: np.zeros(0))
    emit_n: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    raw: np.ndarray | None = None
    raw_request_ids: np.ndarray | None = None

    @classmethod
    def from_raw(cls, gaps: np.ndarray, request_ids: np.ndarray | None = None,
                 instance: np.ndarray | None = None,
                 first_token_s: np.ndarray | None = None) -> Gaps:
        """The log of pooled gaps given whole (each a count of 1); with their requests and the
        requests' first tokens, the outputs' instants too (each request's first token plus its
        gaps so far)."""
        gaps = np.asarray(gaps, dtype=np.float64)
        inst = np.zeros(len(gaps), dtype=np.int64) if instance is None \
            else np.asarray(instance, dtype=np.int64)
        emit_t = np.zeros(0)
        if request_ids is not None and first_token_s is not None:
            ids = np.asarray(request_ids, dtype=np.int64)
            if len(ids) != len(gaps):
                raise ValueError(f"{len(gaps)} gaps but {len(ids)} request ids")
            # each request's outputs: its first token, then its own gaps summed in emit order
            order = np.argsort(ids, kind="stable")
            sorted_ids = ids[order]
            cuts = np.flatnonzero(np.diff(sorted_ids)) + 1
            first = np.asarray(first_token_s, dtype=np.float64)
            times = [first] + [first[part_ids[0]] + np.cumsum(part)
                               for part, part_ids in zip(np.split(gaps[order], cuts),
                                                         np.split(sorted_ids, cuts), strict=True)
                               if len(part)]
            emit_t = np.concatenate(times)
        return cls(values=gaps, counts=np.ones(len(gaps), dtype=np.int64), instance=inst,
                   emit_t=emit_t, emit_n=np.ones(len(emit_t), dtype=np.int64), raw=gaps,
                   raw_request_ids=request_ids)

    def population(self, instance: int | None = None) -> Weighted:
        """Every gap (or those ``instance`` emitted) as one weighted population."""
        if instance is None:
            return Weighted(self.values, self.counts)
        mine = self.instance == instance
        return Weighted(self.values[mine], self.counts[mine])

    def peak_outputs_per_s(self, start: float, end: float) -> float:
        """vLLM's ``max_output_tokens_per_s``: outputs per one-second bucket from ``start``
        (the first send) to ``end`` (the last token), the fullest bucket."""
        buckets = int(np.ceil(end - start)) + 1
        idx = (self.emit_t - start).astype(np.int64)
        keep = (idx >= 0) & (idx < buckets)
        counts = np.bincount(idx[keep], weights=self.emit_n[keep], minlength=buckets)
        return float(counts.max()) if buckets else 0.0


class StepFigures:
    """One set of step sums, added to in step order (the same float sums the step lists
    gave)."""

    def __init__(self) -> None:
        self.steps = 0
        self.busy = 0.0
        self.kv_time = 0.0
        self.max_kv = 0.0
        self.peak = 0
        self.dec_steps = 0
        self.dec_time = 0.0
        self.dec_tokens = 0
        self.breakdown: dict[str, float] = {}
        self.imbalance = 0.0

    def add(self, s: Any, decode: bool, peak: int, costs: bool) -> None:
        """Step ``s`` (a decode-only step when ``decode``; ``peak``: its most sequences on one
        rank); ``costs``: sum its breakdown and imbalance too."""
        self.steps += 1
        self.busy += s.seconds
        self.kv_time += s.kv_usage * s.seconds
        self.max_kv = max(self.max_kv, s.kv_usage)
        self.peak = max(self.peak, peak)
        if decode:
            self.dec_steps += 1
            self.dec_time += s.seconds
            self.dec_tokens += s.decode_tokens
            if costs and s.cost is not None:
                for k, v in s.cost.breakdown_ms.items():
                    self.breakdown[k] = self.breakdown.get(k, 0.0) + v
                self.imbalance += s.cost.expert_imbalance


class StepTally:
    """The step figures of a run, per step as it ends (:meth:`add`): over every step
    (``run``), over the decoding sides' steps (``decoding``: KV use) and per
    ``(role, instance)`` (``of``)."""

    DECODING = DECODING_ENGINES

    def __init__(self) -> None:
        self.run = StepFigures()
        self.decoding = StepFigures()
        self.parts: dict[tuple[str, int], StepFigures] = {}

    def add(self, s: Any, peak: int | None = None) -> None:
        """Step ``s`` as it ends; ``peak``: its most sequences on one rank, where the caller
        knows it (else read off ``s.rank_decode_seqs``)."""
        decode = s.kind == "decode"
        if peak is None:
            seqs = s.rank_decode_seqs
            peak = max(seqs.tolist()) if seqs is not None and len(seqs) else 0
        self.run.add(s, decode, peak, True)  # the run's breakdown and imbalance: its metrics'
        if s.role in self.DECODING:
            self.decoding.add(s, decode, peak, False)
        key = (s.role, s.instance)
        part = self.parts.get(key)
        if part is None:
            part = self.parts[key] = StepFigures()
        part.add(s, decode, peak, False)

    @classmethod
    def of_steps(cls, steps: Sequence[Any]) -> StepTally:
        tally = cls()
        for s in steps:
            tally.add(s)
        return tally

    def of(self, role: str, instance: int) -> StepFigures:
        return self.parts.get((role, instance)) or StepFigures()
