"""Microbenchmarks of every op kind through the runtime's own implementations (one process).

Two sweeps, each returning a pandas DataFrame with one row per measured op shape:

``op_sweep``   single-rank decode steps (``epsim.runtime.executor.RankRuntime.step``, world size 1) of
               synthetic DeepSeek-shaped models (``CALIBRATION_SHAPES``) over batch sizes and
               contexts: every op of the step is timed by the executor itself, so the rows cover
               GEMMs at decode's skinny M, MLA decode attention over batch and context, the
               torch-sorted MoE backend over tokens per expert, norms, elementwise, router,
               embedding, LM head and sampling. The executor's own time between ops (the step's
               wall time minus its ops) is kept per step as ``gap_s``.
``gemm_sweep`` the runtime's GEMM implementation (``epsim.runtime.ops.OP_IMPLS["gemm"]``) over an (M, N, K) grid
               larger than the models', which pins the achievable FLOP/s.

Every row carries the op's graph features (``flops``, ``bytes``, dims) exactly as
``epsim.model.graph.build_step_graph`` computes them, so the fit works in the simulator's terms.
torch is imported inside the functions: importing this module is cheap.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from epsim.model.opgraph import Op
from epsim.model.shipped import shipped_text


@dataclass(frozen=True)
class Shape:
    """A synthetic DeepSeek-shaped model used only for calibration.

    name: tag in the CSV. Example: ``"calib-b"``.
    overrides: ``config.json`` keys replacing those of ``tiny-deepseek`` (hidden size, experts...).
    """

    name: str
    overrides: dict[str, Any]


#: model shapes the op sweep runs; none equals a shipped model (validate checks disjointness)
CALIBRATION_SHAPES: tuple[Shape, ...] = (
    Shape("calib-a", {"hidden_size": 32, "intermediate_size": 96, "moe_intermediate_size": 16,
                      "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
                      "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
                      "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 24,
                      "qk_rope_head_dim": 8, "v_head_dim": 8, "qk_nope_head_dim": 8,
                      "vocab_size": 256}),
    Shape("calib-b", {"hidden_size": 128, "intermediate_size": 320, "moe_intermediate_size": 64,
                      "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 6,
                      "n_routed_experts": 24, "num_experts_per_tok": 6, "n_group": 4,
                      "topk_group": 2, "kv_lora_rank": 48, "q_lora_rank": 64,
                      "qk_rope_head_dim": 8, "v_head_dim": 24, "qk_nope_head_dim": 24,
                      "vocab_size": 768}),
    Shape("calib-c", {"hidden_size": 384, "intermediate_size": 768, "moe_intermediate_size": 192,
                      "num_hidden_layers": 2, "num_attention_heads": 12, "num_key_value_heads": 12,
                      "n_routed_experts": 48, "num_experts_per_tok": 8, "n_group": 8,
                      "topk_group": 4, "kv_lora_rank": 96, "q_lora_rank": 128,
                      "qk_rope_head_dim": 16, "v_head_dim": 48, "qk_nope_head_dim": 48,
                      "vocab_size": 1536}),
)
#: (batch, context) points of the op sweep; quick mode keeps a subset
SWEEP_POINTS: tuple[tuple[int, int], ...] = (
    (1, 40), (6, 160), (20, 40), (20, 400), (48, 160), (96, 40), (96, 400),
)
QUICK_POINTS: tuple[tuple[int, int], ...] = ((6, 160), (48, 40))
#: (M, N, K) of the GEMM sweep
GEMM_GRID: tuple[tuple[int, int, int], ...] = tuple(
    (m, n, k) for m in (1, 8, 64, 256) for n in (192, 768) for k in (384, 1536))
QUICK_GEMM_GRID: tuple[tuple[int, int, int], ...] = ((8, 768, 384), (256, 768, 1536))


def write_shape_config(shape: Shape, folder: Path) -> Path:
    """Write ``shape`` as a ``config.json`` (tiny-deepseek with the overrides) under ``folder``."""
    base = json.loads(shipped_text("epsim.model", "configs", "tiny-deepseek"))
    base.update(shape.overrides)
    base["_comment"] = "calibration-only shape (epsim calibrate), not a shipped model"
    path = folder / f"{shape.name}.json"
    path.write_text(json.dumps(base, indent=1))
    return path


def op_features(op: Op) -> dict[str, Any]:
    """The graph features of one op that the cost model and the fit read."""
    d = op.dims
    row: dict[str, Any] = {"kind": op.kind, "name": op.name, "dtype": op.dtype,
                           "flops": op.flops, "bytes": op.bytes, "weight_bytes": op.weight_bytes}
    if "batch" in d:  # a GEMM's batch (heads of MLA's absorption), not the step's sequences
        row["gemm_batch"] = d["batch"]
    for key in ("m", "n", "k", "tokens", "width", "seqs", "heads", "pairs", "experts",
                "active_experts", "gemms"):
        if key in d:
            row[key] = d[key]
    if "context" in d:  # the op's own context (the step's grows by one per step)
        row["kv_context"] = d["context"]
    if "kv_dtype" in d:
        row["kv_dtype"] = d["kv_dtype"]
    return row


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def op_sweep(folder: Path, shapes: Sequence[Shape] = CALIBRATION_SHAPES,
             points: Iterable[tuple[int, int]] = SWEEP_POINTS, steps: int = 5,
             device: str = "cpu", dbo_points: int = 1, rounds: int = 2
             ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Time single-rank decode steps of each shape at each (batch, context).

    Args:
        folder: where the shapes' config.json files are written.
        shapes / points: what to run; ``steps`` decode steps each (the first is a warm-up).
        device: ``"cpu"`` or ``"cuda"`` (one GPU).
        dbo_points: also run the first ``dbo_points`` points with two microbatches.
        rounds: passes over everything (a configuration's samples spread over the sweep).

    Returns:
        ``ops``: one row per (shape, batch, context, dbo, op id): graph features and ``time_s``
        (median over the timed steps of every round), ``p10_s``, ``p90_s``, ``repeats``;
        ``steps``: one row per timed step: ``step_s``, ``ops_s`` (sum of its ops), ``n_ops``,
        ``gap_s`` (executor time per op outside the ops).
    """
    import torch

    from epsim.runtime.executor import RankRuntime
    from epsim.runtime.options import RunOptions, validate

    torch.set_num_threads(1)  # as each runtime rank does
    samples: dict[tuple, list[float]] = {}
    features: dict[tuple, dict[str, Any]] = {}
    step_rows: list[dict[str, Any]] = []
    points = list(points)
    for rnd in range(rounds):  # rounds spread each configuration over the sweep's duration
        for shape in shapes:
            path = write_shape_config(shape, folder)
            runs = [(b, c, False) for b, c in points] + [
                (b, c, True) for b, c in points[:dbo_points] if b >= 2]
            for batch, context, dbo in runs:
                opts = RunOptions(model=str(path), world_size=1, batch=batch, context=context,
                                  steps=steps, dbo=dbo, device=device, trace=True)
                model, plan, placement = validate(opts)
                rt = RankRuntime(opts, model, plan, placement, 0)
                for s in range(steps):
                    _sync(device)
                    result = rt.step()
                    if s == 0:
                        continue  # warm-up
                    ops_s = 0.0
                    for e in result.events:
                        key = (shape.name, batch, context, dbo, e.op_id)
                        samples.setdefault(key, []).append(e.dur_us * 1e-6)
                        ops_s += e.dur_us * 1e-6
                    n_ops = len(rt.graph(s))
                    step_s = result.step_us * 1e-6
                    step_rows.append({"shape": shape.name, "batch": batch, "context": context,
                                      "dbo": dbo, "round": rnd, "step": s, "step_s": step_s,
                                      "ops_s": ops_s, "n_ops": n_ops,
                                      "gap_s": max(0.0, step_s - ops_s) / n_ops})
                # op features from the first timed step's graph (context grows by one per step)
                graph = rt.graph(1)
                for op_id, op in graph.ops.items():
                    features[(shape.name, batch, context, dbo, op_id)] = op_features(op)
                del rt
    rows = []
    for key, times in samples.items():
        times.sort()
        name, batch, context, dbo, op_id = key
        rows.append({"shape": name, "batch": batch, "context": context, "dbo": dbo,
                     "op_id": op_id, **features[key], "time_s": statistics.median(times),
                     "p10_s": times[len(times) // 10], "p90_s": times[(len(times) * 9) // 10],
                     "repeats": len(times)})
    return pd.DataFrame(rows), pd.DataFrame(step_rows)


def gemm_sweep(grid: Iterable[tuple[int, int, int]] = GEMM_GRID, repeats: int = 15,
               device: str = "cpu") -> pd.DataFrame:
    """Time the runtime's GEMM implementation (``epsim.runtime.ops.OP_IMPLS["gemm"]``) over an
    (M, N, K) grid, fp32, one thread on the CPU.

    Returns:
        One row per shape: graph features of the equivalent ``gemm`` op (as ``build_step_graph``
        computes them), ``time_s`` (median of ``repeats`` after two warm-ups), ``p10_s``,
        ``p90_s``, ``gflops`` (measured).
    """
    import types

    import torch

    from epsim.runtime.ops import OP_IMPLS, MicrobatchState

    torch.set_num_threads(1)
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for m, n, k in grid:
        w = torch.randn(k, n, generator=gen).to(dev)
        x = torch.randn(m, k, generator=gen).to(dev)
        op = gemm_op(m, n, k)
        rt = types.SimpleNamespace(weight=lambda op, suffix="", w=w: w)
        st = MicrobatchState(0, slice(0, m), torch.zeros(m), torch.zeros(m), torch.zeros(m),
                             torch.zeros(m, 1), torch.zeros(1), torch.zeros(1))
        impl = OP_IMPLS["gemm"]
        times = []
        for i in range(repeats + 2):
            _sync(device)
            t0 = time.perf_counter()
            impl(rt, op, {"h": x}, st)
            _sync(device)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        times.sort()
        med = statistics.median(times)
        rows.append({"shape": "gemm-grid", "batch": 0, "context": 0, "dbo": False,
                     "op_id": f"gemm.{m}x{n}x{k}", **op_features(op), "time_s": med,
                     "p10_s": times[len(times) // 10], "p90_s": times[(len(times) * 9) // 10],
                     "repeats": len(times), "gflops": 2.0 * m * n * k / med / 1e9})
    return pd.DataFrame(rows)


def gemm_op(m: int, n: int, k: int) -> Op:
    """A graph ``gemm`` op of shape ``[m, k] @ [k, n]`` with bf16 weights, as
    ``epsim.model.graph_emit.OpShapes.gemm`` builds it (the role ``attn.q_a``: its input is ``h``)."""
    w, act = 2.0, 2.0
    return Op(id=f"gemm.{m}x{n}x{k}", kind="gemm", name="attn.q_a", layer=0, microbatch=0,
              category="attention", dims={"batch": 1, "m": m, "n": n, "k": k}, dtype="bf16",
              flops=2.0 * m * n * k, bytes_read=k * n * w + m * k * act,
              bytes_written=m * n * act, weight_bytes=k * n * w)


#: (batch, context) points the multi-rank sweep repeats (a subset of SWEEP_POINTS)
RANKS_POINTS: tuple[tuple[int, int], ...] = ((6, 160), (96, 40), (20, 400))


def ranks_sweep(folder: Path, shapes: Sequence[Shape], points: Iterable[tuple[int, int]],
                worlds: Sequence[int] = (1, 2, 4), steps: int = 5, rounds: int = 2,
                before_launch: Callable[[], Any] | None = None) -> pd.DataFrame:
    """The op sweep's configurations again on ``world`` local ranks (EP over all of them, no
    DBO), through ``epsim.runtime.launch.launch_local`` as ``epsim run`` starts them: how much slower
    each op runs when it shares the machine with the other ranks and their exchanges (world 1
    in the same way gives the reference). ``before_launch`` runs before each launch (the
    machine probe).

    Returns:
        One row per (shape, world, batch, context, op id): ``kind``, ``time_s`` (median over the
        timed steps, ranks and ``rounds``), ``step_s`` (that median scaled by
        :func:`step_scales`, what the op adds to a median step: the fits of a step's costs use
        it), ``repeats``; exchanges (dispatch, combine) also
        ``straggler_s``: median over the timed steps of the mean minus the least of the ranks'
        times from issue to the end of their wait. The exchange ends on every rank at about one
        moment, so a rank's time is how long before the last one it arrived plus the exchange's
        own latency: mean minus least is how long after the average rank the last one arrives
        (the expected latest of ``world`` jittered arrivals, less the average), what a
        simulator whose ranks arrive together must add; and ``segment_s``: the median over the
        timed steps of the ranks' mean compute time since the previous exchange (in issue
        order), which the straggler grows with. Every row of a configuration run on more than
        one rank also has ``rank_skew_s``: the median over the timed steps and rounds of the
        slowest rank's step time minus the ranks' mean (a step lasts as long as its slowest
        rank; ranks time-sliced on shared cores do not finish together). Exchange rows measured
        by a runtime that reports it also have ``host_s``: the median over the timed steps,
        ranks and rounds of how long the call that issued the exchange held the host (the
        trace's ``issue_us``: a dispatch's blocking count exchange, a combine's asynchronous
        call).
    """
    from epsim.runtime import RunOptions, launch_local

    points = list(points)
    samples: dict[tuple, tuple[str, list[float]]] = {}
    # per (op, round, step): each rank's (wait, compute since the previous exchange)
    arrivals: dict[tuple, list[tuple[float, float]]] = {}
    skews: dict[tuple, list[float]] = {}  # per configuration: slowest minus mean rank, per step
    holds: dict[tuple, list[float]] = {}  # per exchange op: each issue call's seconds
    # per configuration: {(round, step, rank, part): the part's summed op seconds}
    part_sums: dict[tuple, dict[tuple, float]] = {}
    for rnd in range(rounds):  # rounds alternate the world sizes (background load is bursty)
        for world in worlds:
            options, keys = [], []
            for shape in shapes:
                path = write_shape_config(shape, folder)
                for batch, context in points:
                    options.append(RunOptions(model=str(path), world_size=world, batch=batch,
                                              context=context, steps=steps, trace=True))
                    keys.append((shape.name, batch, context))
            if before_launch is not None:
                before_launch()
            summaries = launch_local(options, world)
            for (name, batch, context), summary in zip(keys, summaries, strict=True):
                for e in summary["trace_events"]:
                    if e.args.get("step", 0) < 1:
                        continue  # warm-up
                    key = (name, world, batch, context, e.op_id)
                    samples.setdefault(key, (e.kind, []))[1].append(e.dur_us * 1e-6)
                    cell = (rnd, e.args["step"], e.rank, step_part(e.kind))
                    sums = part_sums.setdefault(key[:4], {})
                    sums[cell] = sums.get(cell, 0.0) + e.dur_us * 1e-6
                    if "issue_us" in e.args:
                        holds.setdefault(key, []).append(e.args["issue_us"] * 1e-6)
                if world > 1:
                    skews.setdefault((name, world, batch, context), []).extend(
                        rank_skews(summary["step_ms_per_rank"]))
                for op_id, step, wait, since in exchange_records(summary["trace_events"]):
                    arrivals.setdefault(((name, world, batch, context, op_id), rnd, step),
                                        []).append((wait, since))
    return pd.DataFrame(_ranks_rows(samples, arrivals, holds, skews,
                                    step_scales(samples, part_sums)))


def _ranks_rows(samples: Mapping[tuple, tuple[str, Sequence[float]]],
                arrivals: Mapping[tuple, Sequence[tuple[float, float]]],
                holds: Mapping[tuple, Sequence[float]], skews: Mapping[tuple, Sequence[float]],
                scales: Mapping[tuple, float]) -> list[dict[str, Any]]:
    """The ranks sweep's rows (:func:`ranks_sweep`'s Returns) from its samples: per op
    ``samples`` (key ``(shape, world, batch, context, op id)``), per exchange and (round, step)
    each rank's ``arrivals`` (wait, compute since the previous exchange), the issuing calls'
    ``holds``, per configuration the ``skews`` and the :func:`step_scales`."""
    late: dict[tuple, list[tuple[float, float]]] = {}
    for (key, _, _), per_rank in arrivals.items():
        waits = [w for w, _ in per_rank]
        late.setdefault(key, []).append((statistics.fmean(waits) - min(waits),
                                         statistics.fmean(s for _, s in per_rank)))
    rows = []
    for key, (kind, times) in samples.items():
        name, world, batch, context, op_id = key
        median = statistics.median(times)
        row = {"shape": name, "world": world, "batch": batch, "context": context,
               "op_id": op_id, "kind": kind, "time_s": median,
               "step_s": median * scales[(key[:4], step_part(kind))], "repeats": len(times)}
        if key in late:
            row["straggler_s"] = statistics.median(v for v, _ in late[key])
            row["segment_s"] = statistics.median(v for _, v in late[key])
        if key in holds:
            row["host_s"] = statistics.median(holds[key])
        if key[:4] in skews:
            row["rank_skew_s"] = statistics.median(skews[key[:4]])
        rows.append(row)
    return rows


def step_part(kind: str) -> str:
    """Which part of a step an op's time is summed in for :func:`step_scales`."""
    return "exchange" if kind in ("dispatch", "combine") else "compute"


def step_scales(samples: Mapping[tuple, tuple[str, Sequence[float]]],
                part_sums: Mapping[tuple, Mapping[tuple, float]]) -> dict[tuple, float]:
    """``{(configuration, part): factor}``: per configuration (``(shape, world, batch,
    context)``) and part (compute, exchange: :func:`step_part`), the median over the timed steps
    of a rank's summed op seconds in that part (the ranks' mean), over the sum of the part's op
    medians.

    A step is a sum of ops, and ranks time-sliced on shared cores are preempted in a few long
    samples of each op, which the op's median drops: on 2 cores the medians summed 1-14 %
    (compute) and 14-20 % (exchanges) short of the steps' median at 2 ranks, 16-23 % and 7-11 %
    at 4 (three runs of ``bench/bench_step_sums.py``). The ops' means would hold the
    preemptions, and a burst of background load too, which validation's medians of steps leave
    out; scaling the medians by the steps' own median keeps the one and not the other.

    Args:
        samples: ``{(shape, world, batch, context, op id): (kind, [seconds per sample])}``.
        part_sums: ``{configuration: {(round, step, rank, part): seconds}}``.
    """
    medians: dict[tuple, float] = {}
    for key, (kind, times) in samples.items():
        cell = (key[:4], step_part(kind))
        medians[cell] = medians.get(cell, 0.0) + statistics.median(times)
    out = {}
    for config, sums in part_sums.items():
        per_step: dict[tuple, list[float]] = {}
        for (rnd, step, _, part), seconds in sums.items():
            per_step.setdefault((part, rnd, step), []).append(seconds)
        for part in {p for p, _, _ in per_step}:
            steps = [statistics.fmean(v) for (p, _, _), v in per_step.items() if p == part]
            total = medians.get((config, part), 0.0)
            out[(config, part)] = statistics.median(steps) / total if total > 0 else 1.0
    return out


def rank_skews(step_ms_per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per timed step (the first is a warm-up), the slowest rank's step seconds minus the
    ranks' mean (``step_ms_per_rank``: ``[rank][step]`` ms, the runtime summary's)."""
    steps = min(len(r) for r in step_ms_per_rank)
    return [(max(r[s] for r in step_ms_per_rank)
             - statistics.fmean(r[s] for r in step_ms_per_rank)) / 1e3 for s in range(1, steps)]


def exchange_records(events: Iterable[Any]) -> list[tuple[str, int, float, float]]:
    """``(op id, step, seconds from issue to the end of its wait, compute seconds since the
    previous exchange)`` of every exchange in timed steps' trace events, rank by rank in issue
    order."""
    by_rank: dict[tuple[int, int], list[Any]] = {}
    for e in events:
        if e.args.get("step", 0) >= 1:
            by_rank.setdefault((e.rank, e.args["step"]), []).append(e)
    out = []
    for (_, step), evs in sorted(by_rank.items()):
        since = 0.0
        for e in sorted(evs, key=lambda e: e.start_us):
            if e.kind in ("dispatch", "combine"):
                out.append((e.op_id, step, e.dur_us * 1e-6, since))
                since = 0.0
            elif e.stream == "compute":
                since += e.dur_us * 1e-6
    return out
