"""Step times for the serving loop: what one step of every dp rank costs.

    StepCost           one step's wall time, its breakdown and expert imbalance
    StepTimeModel      the protocol: ``decode(seqs, context)`` and ``prefill(seqs, prompt, prefix)``
    MemoStepTime       any exact step-time function, memoised and interpolated on a (batch,
                       context) grid so a several-thousand-request benchmark costs a few dozen
                       exact evaluations
    SimulatedStepTime  the step simulator (``epsim.sim.step.simulate_step``) behind that memo: the
                       serving side's one door to ``epsim.sim.step``
    StepPolicy         how an engine runs a step: up to which batch a captured graph replays,
                       when two microbatches (DBO) are used, the host time it pays per step
    EngineStepTime     a step's cost under a :class:`StepPolicy`, from the step-time model of
                       each (graph, DBO) variant of the plan; mixed steps (prefill chunks and
                       decodes in one batch, as vLLM schedules them) are costed here too
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from epsim.model.config import ModelConfig
from epsim.model.opgraph import Batch
from epsim.model.placement import Placement
from epsim.model.plan import ParallelPlan
from epsim.sim.hardware import HardwareProfile
from epsim.sim.step import StepMemo, simulate_step


@dataclass(frozen=True)
class StepCost:
    """What one step of every rank costs.

    seconds: the step's wall time (the busiest rank's). Example: 0.19.
    breakdown_ms: milliseconds by category (attention, moe_experts, dispatch, ...), as the step
        simulator reports them. Example: ``{"attention": 60.1, "dispatch": 20.3, ...}``.
    expert_imbalance: max GPU expert load / mean (1.0 = perfectly balanced). Example: 1.04.
    exposed_comm_ms: communication time not hidden behind compute.
    """

    seconds: float
    breakdown_ms: Mapping[str, float] = field(default_factory=dict)
    expert_imbalance: float = 1.0
    exposed_comm_ms: float = 0.0


class StepTimeModel(Protocol):
    """Step times of one engine (one dp rank's batch; every rank steps together)."""

    def decode(self, seqs: int, context: int) -> StepCost:
        """A decode step: ``seqs`` sequences per rank, each attending to ``context`` tokens."""
        ...

    def prefill(self, seqs: int, prompt: int, prefix: int) -> StepCost:
        """A prefill step: ``seqs`` sequences per rank of ``prompt - prefix`` new tokens each,
        after ``prefix`` tokens already cached (chunked prefill)."""
        ...


def mix_costs(a: StepCost, b: StepCost, w: float) -> StepCost:
    """``(1 - w) * a + w * b``, field by field (breakdown keys united)."""
    if w <= 0.0:
        return a
    if w >= 1.0:
        return b
    da, db = a.breakdown_ms, b.breakdown_ms
    if da.keys() == db.keys():  # the usual case (the key order is a's either way)
        breakdown = {k: (1 - w) * x + w * db[k] for k, x in da.items()}
    else:
        keys = list(dict.fromkeys([*da, *db]))
        breakdown = {k: (1 - w) * da.get(k, 0.0) + w * db.get(k, 0.0) for k in keys}
    return StepCost(
        seconds=(1 - w) * a.seconds + w * b.seconds,
        breakdown_ms=breakdown,
        expert_imbalance=(1 - w) * a.expert_imbalance + w * b.expert_imbalance,
        exposed_comm_ms=(1 - w) * a.exposed_comm_ms + w * b.exposed_comm_ms,
    )


#: values up to this are their own grid points; above it the grid is geometric
GRID_EXACT = 16


@functools.lru_cache(maxsize=1 << 16)  # asked several times per simulated step
def grid_bracket(x: int, per_octave: int = 8) -> tuple[int, int]:
    """The grid points just below and above ``x`` (equal when ``x`` is one) -> (lo, hi).

    The grid: every integer up to ``GRID_EXACT``, then ``round(GRID_EXACT * 2**(k/per_octave))``.
    """
    if x <= GRID_EXACT:
        return x, x
    k = per_octave * math.log2(x / GRID_EXACT)
    lo = round(GRID_EXACT * 2 ** (math.floor(k + 1e-9) / per_octave))
    hi = round(GRID_EXACT * 2 ** (math.ceil(k - 1e-9) / per_octave))
    lo, hi = min(lo, x), max(hi, x)
    return lo, hi


@functools.lru_cache(maxsize=1 << 16)
def grid_nearest(x: int, per_octave: int = 8) -> int:
    """The grid point nearest to ``x`` in log space (``x`` itself up to ``GRID_EXACT``)."""
    lo, hi = grid_bracket(x, per_octave)
    if lo == hi:
        return lo
    return lo if math.log(x / lo) <= math.log(hi / x) else hi


#: interpolated decode costs one model keeps by exact shape, at most (then it starts again)
DECODED_KEPT = 1 << 15  # about 0.8 kB each: some 27 MB per memoised model at most


class MemoStepTime:
    """Memoise and interpolate any exact step-time function on the (batch, context) grid.

    ``decode(seqs, context)`` is bilinear between the four surrounding grid points (the step
    time is smooth in both); ``prefill`` rounds seqs and new tokens to the nearest grid point and
    the prefix to a coarser one. ``calls`` counts the exact evaluations made.
    """

    def __init__(self, decode_exact: Callable[[int, int], StepCost],
                 prefill_exact: Callable[[int, int, int], StepCost], per_octave: int = 8) -> None:
        self._decode_exact = decode_exact
        self._prefill_exact = prefill_exact
        self.per_octave = per_octave
        self._memo: dict[tuple[Any, ...], StepCost] = {}
        # interpolated decode costs by their exact shape (a serving run meets a shape again
        # often): the same value as interpolating again, the grid points being fixed once met
        self._decoded: dict[tuple[int, int], StepCost] = {}
        self.calls = 0

    def _get(self, key: tuple[Any, ...], fn: Callable[[], StepCost]) -> StepCost:
        cost = self._memo.get(key)
        if cost is None:
            cost = fn()
            self.calls += 1
            self._memo[key] = cost
        return cost

    def decode(self, seqs: int, context: int) -> StepCost:
        found = self._decoded.get((seqs, context))
        if found is None:
            if len(self._decoded) >= DECODED_KEPT:
                self._decoded.clear()
            found = self._decoded[(seqs, context)] = self._interpolate(seqs, context)
        return found

    def _interpolate(self, seqs: int, context: int) -> StepCost:
        s0, s1 = grid_bracket(seqs, self.per_octave)
        c0, c1 = grid_bracket(context, self.per_octave)

        def at(s: int, c: int) -> StepCost:
            return self._get(("d", s, c), lambda: self._decode_exact(s, c))

        ws = 0.0 if s1 == s0 else (seqs - s0) / (s1 - s0)
        wc = 0.0 if c1 == c0 else (context - c0) / (c1 - c0)
        low = mix_costs(at(s0, c0), at(s0, c1), wc) if wc else at(s0, c0)
        if not ws:
            return low
        high = mix_costs(at(s1, c0), at(s1, c1), wc) if wc else at(s1, c0)
        return mix_costs(low, high, ws)

    def prefill(self, seqs: int, prompt: int, prefix: int) -> StepCost:
        s = grid_nearest(seqs, self.per_octave)
        new = grid_nearest(prompt - prefix, self.per_octave)
        # a chunk's mean prefix matters through attention only, next to the new tokens' own
        # attention: under 1/16 of them it is dropped, above it a coarse grid (2 per octave)
        pre = grid_nearest(prefix, 2) if prefix * 16 >= new else 0
        return self._get(("p", s, new, pre), lambda: self._prefill_exact(s, pre + new, pre))


def _cost_from_step_result(result: Any) -> StepCost:
    """A :class:`StepCost` from the step simulator's ``StepResult`` (ms or s fields alike)."""
    if hasattr(result, "step_s"):
        seconds = float(result.step_s)
    else:
        seconds = float(result.step_ms) / 1e3
    return StepCost(
        seconds=seconds,
        breakdown_ms={str(k): float(v) for k, v in dict(getattr(result, "breakdown_ms", {})).items()},
        expert_imbalance=float(getattr(result, "expert_imbalance", 1.0) or 1.0),
        exposed_comm_ms=float(getattr(result, "exposed_comm_ms", 0.0) or 0.0),
    )


class SimulatedStepTime(MemoStepTime):
    """Step times from the step simulator, memoised on the (batch, context) grid.

    model / plan / profile: what ``epsim.sim.step.simulate_step`` simulates.
    loads / placement / eplb / mode / seed: passed through (expert loads, placement, whether
        EPLB re-places experts, the simulator's mode, the routing seed).
    memo: the step simulator's kept values (``epsim.sim.step.StepMemo``), shared by the models
        of one owner (a ``StepCache``); None: this model's own.
    """

    def __init__(self, model: ModelConfig, plan: ParallelPlan, profile: HardwareProfile, *,
                 loads: np.ndarray | None = None, placement: Placement | None = None,
                 eplb: bool = True, mode: str = "fast", seed: int = 0, per_octave: int = 8,
                 memo: StepMemo | None = None) -> None:
        step_memo = memo if memo is not None else StepMemo()

        def run(batch: Batch) -> StepCost:
            return _cost_from_step_result(simulate_step(
                model, plan, batch, profile, loads=loads, placement=placement, eplb=eplb,
                mode=mode, seed=seed, memo=step_memo))

        super().__init__(lambda s, c: run(Batch.decode(s, c)),
                         lambda s, p, pre: run(Batch.prefill(s, p, pre)), per_octave)


# --------------------------------------------------------------------------------------------
# How an engine runs a step
# --------------------------------------------------------------------------------------------

#: the step-time model of one variant of the plan: ``(captured graph?, two microbatches?)``
Variants = Callable[..., StepTimeModel]


@dataclass(frozen=True)
class StepPolicy:
    """How an engine runs its steps: the plan's options as each step meets them.

    graph / dbo: the plan's graph mode and DBO (``--no-graph``, ``--dbo`` / ``--no-dbo``).
    graph_max_bs: decode steps of at most this many sequences per rank replay a captured graph,
        larger ones run eagerly (vLLM's largest ``cudagraph_capture_sizes``, SGLang's
        ``cuda_graph_max_bs``). ``None``: every step as ``graph`` says (no eager fallback).
    prefill_eager: a rank that prefills runs eagerly (the engines capture decode steps only;
        vLLM's piecewise graphs for mixed batches stop at the same capture sizes).
    eager_if_any_prefill: a step where any rank prefills runs eagerly on every rank (SGLang's DP
        attention decides graph replay for all ranks together).
    dbo_min_decode_tokens / dbo_min_prefill_tokens: DBO splits a rank's batch only above these
        tokens (vLLM's ``dbo_decode_token_threshold`` / ``dbo_prefill_token_threshold``).
    host_s / host_per_request_s / host_per_token_s / host_dp_sync_s: the engine's host work per
        step on the busiest rank (scheduling, input preparation, sampling, output processing,
        the DP ranks' per-step synchronisation): fixed seconds, seconds per request the rank
        runs in the step, per token it schedules, and per step when dp > 1
        (:meth:`host_seconds`).
    host_overlap: the host prepares the next step while the GPU runs this one (vLLM's async
        scheduling, SGLang's overlap scheduler): a step lasts ``max(GPU, host)``; else the sum.
    """

    graph: bool = True
    dbo: bool = True
    graph_max_bs: int | None = None
    prefill_eager: bool = False
    eager_if_any_prefill: bool = False
    dbo_min_decode_tokens: int = 0
    dbo_min_prefill_tokens: int = 0
    host_s: float = 0.0
    host_per_request_s: float = 0.0
    host_per_token_s: float = 0.0
    host_dp_sync_s: float = 0.0
    host_overlap: bool = True

    def host_seconds(self, requests: int | np.ndarray = 0, tokens: int | np.ndarray = 0
                     ) -> float:
        """The host's seconds for a step whose ranks run ``requests`` requests scheduling
        ``tokens`` tokens (numbers, or arrays by rank): every rank's engine core works in
        parallel and the ranks meet each step, so the busiest rank sets the step's host time."""
        per_rank = (self.host_per_request_s * np.asarray(requests)
                    + self.host_per_token_s * np.asarray(tokens))
        return self.host_s + self.host_dp_sync_s + float(np.max(per_rank, initial=0.0))


class EngineStepTime:
    """A step's parts costed under a :class:`StepPolicy` (one per side of a deployment and run).

    ``variants(graph, dbo[, with_prefill])`` gives the step-time model of that variant of the
    plan (``with_prefill``: for a decode batch in a step where some rank prefills, whose EP
    exchanges run as the prefill's, ``sim.hardware.a2a.with_prefill_choice``). Each is a memoised model
    of a :class:`~epsim.sim.scenario.StepCache`, so a variant no step needs is never simulated. ``touched`` records, per model first used, its exact-call count then, so
    the run can report the evaluations it made itself.
    """

    def __init__(self, variants: Variants, policy: StepPolicy | None = None) -> None:
        self.variants = variants
        self.policy = policy or StepPolicy()
        self.touched: dict[int, tuple[StepTimeModel, int]] = {}
        # prefill costs by their exact shape: a serving run costs a chunk per request, and
        # its variant and grid point are the same every time a shape comes back
        self._prefills: dict[tuple[int, int, int], StepCost] = {}

    @classmethod
    def of(cls, model: StepTimeModel, policy: StepPolicy | None = None) -> EngineStepTime:
        """Every variant is ``model`` (an analytic model, or a plan costed as it is)."""
        return cls(lambda graph, dbo, with_prefill=False: model, policy)

    def _variant(self, graph: bool, tokens: int, prefill: bool, with_prefill: bool = False
                 ) -> StepTimeModel:
        p = self.policy
        floor = p.dbo_min_prefill_tokens if prefill else p.dbo_min_decode_tokens
        dbo = p.dbo and tokens > floor
        model = self.variants(graph, dbo, True) if with_prefill else self.variants(graph, dbo)
        if id(model) not in self.touched:
            self.touched[id(model)] = (model, int(getattr(model, "calls", 0)))
        return model

    def decode_graph(self, seqs: int, any_prefill: bool = False) -> bool:
        """Whether a decode batch of ``seqs`` per rank replays a captured graph."""
        p = self.policy
        return (p.graph and (p.graph_max_bs is None or seqs <= p.graph_max_bs)
                and not (any_prefill and p.eager_if_any_prefill))

    def decode(self, seqs: int, context: int, any_prefill: bool = False) -> StepCost:
        """The busiest rank's decode batch: ``seqs`` sequences of ``context`` tokens each."""
        graph = self.decode_graph(seqs, any_prefill)
        return self._variant(graph, seqs, False, any_prefill).decode(seqs, context)

    def prefill(self, seqs: int, prompt: int, prefix: int) -> StepCost:
        """One rank's prefill chunk: ``seqs`` sequences of ``prompt - prefix`` new tokens."""
        key = (seqs, prompt, prefix)
        found = self._prefills.get(key)
        if found is None:
            if len(self._prefills) >= DECODED_KEPT:
                self._prefills.clear()
            graph = self.policy.graph and not self.policy.prefill_eager
            found = self._prefills[key] = self._variant(graph, seqs * (prompt - prefix),
                                                        True).prefill(seqs, prompt, prefix)
        return found

    def mixed(self, seqs: int, prompt: int, prefix: int, decode_seqs: int, context: int
              ) -> StepCost:
        """One rank's batch of a prefill chunk and ``decode_seqs`` decodes, run as one forward.

        No op graph has both phases, so it is composed: the chunk's prefill with the decode
        tokens joining its new tokens (GEMMs, experts and dispatch meet every token once, their
        weights are read once), plus the decodes' own attention over their contexts.
        """
        extra = math.ceil(decode_seqs / seqs)
        pre = self.prefill(seqs, prompt + extra, prefix)
        graph = self.policy.graph and not self.policy.prefill_eager
        tokens = seqs * (prompt + extra - prefix)
        att_ms = self._variant(graph, tokens, True).decode(decode_seqs, context).breakdown_ms.get(
            "attention", 0.0)
        breakdown = dict(pre.breakdown_ms)
        breakdown["attention"] = breakdown.get("attention", 0.0) + att_ms
        return StepCost(pre.seconds + att_ms / 1e3, breakdown, pre.expert_imbalance,
                        pre.exposed_comm_ms)

    def wall(self, gpu_s: float, requests: int | np.ndarray = 0,
             tokens: int | np.ndarray = 0) -> float:
        """The step's wall time given its GPU time and the host's (``requests`` and ``tokens``
        of the step, by rank or of the busiest rank: :meth:`StepPolicy.host_seconds`)."""
        host = self.policy.host_seconds(requests, tokens)
        if not host:
            return gpu_s
        return max(gpu_s, host) if self.policy.host_overlap else gpu_s + host
