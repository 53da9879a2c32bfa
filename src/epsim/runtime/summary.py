"""What a run measured: each rank's per-step records, and rank 0's summary of them all.

A rank keeps one record per step (:func:`step_record`: its time, per-kind op times, next tokens,
and under ``--check`` its outputs); rank 0 gathers every rank's records and KV cache and
:func:`summarise` turns them into the run's figures (``epsim run --json``), comparing them with
the dense reference under ``--check`` (:func:`check_against_reference`). torch and the reference
are imported inside the functions: ``epsim.runtime.launch`` imports this module in the launching
parent, which stays light.
"""

from __future__ import annotations

import math
from typing import Any

from .options import RunOptions


def percentiles(values: list[float]) -> dict[str, float]:
    """``{mean, median, p10, p90}`` (linear interpolation, as numpy's default)."""
    xs = sorted(values)

    def q(f: float) -> float:
        pos = f * (len(xs) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"mean": sum(xs) / len(xs), "median": q(0.5), "p10": q(0.1), "p90": q(0.9)}


def step_record(opts: RunOptions, result: Any, phase: str = "decode",
                writes: dict[Any, Any] | None = None) -> dict[str, Any]:
    """One step of one rank as rank 0 gathers it (``result``: the step's ``RankStepOutput``;
    ``writes``: its KV-cache writes, kept under MTP for ``--check``)."""
    record = {
        "phase": phase,
        "step_us": result.step_us,
        "logits": result.logits.cpu() if opts.check else None,
        "next_tokens": result.next_tokens.cpu(),
        "hidden": result.hidden.cpu() if opts.check else None,
        "events": result.events if opts.trace else [],
        "op_us": _op_us(result.events),
    }
    if opts.mtp:  # the verify step's draft passes and its simulated acceptance
        record.update(
            accepted=result.accepted.cpu(), draft_tokens=result.draft_tokens.cpu(),
            draft_logits=[x.cpu() for x in result.draft_logits] if opts.check else None,
            kv_writes=writes)
    return record


def _op_us(events: list[Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for e in events:
        out[e.kind] = out.get(e.kind, 0.0) + e.dur_us
    return out


def _split(records: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """A rank's records -> (its prefill record or None, its decode steps)."""
    if records and records[0]["phase"] == "prefill":
        return records[0], records[1:]
    return None, records


def summarise(opts: RunOptions, model: Any, per_rank: list[list[dict[str, Any]]],
              caches: list[tuple[Any, Any]] | None = None) -> dict[str, Any]:
    """The run's figures from every rank's per-step records (rank 0 only); ``caches``: each
    rank's KV cache after the run (``--check``)."""
    world = len(per_rank)
    split = [_split(records) for records in per_rank]
    prefills = [p for p, _ in split]
    decode = [d for _, d in split]
    # a step takes as long as its slowest rank; the first step warms up when there are others
    step_ms = [max(decode[r][s]["step_us"] for r in range(world)) / 1e3
               for s in range(opts.steps)]
    timed = step_ms[1:] if len(step_ms) > 1 else step_ms
    stats = percentiles(timed)
    kinds = sorted({k for rank in decode for st in rank for k in st["op_us"]})
    out: dict[str, Any] = {
        "model": model.name,
        "world_size": world,
        "batch_per_rank": opts.batch,
        "context": opts.context,
        "steps": opts.steps,
        "steps_timed": len(timed),
        "dbo": opts.dbo,
        "static": opts.static_shapes,
        "capture": opts.capture,
        "kv_dtype": opts.kv_dtype,
        "dtype": opts.dtype,
        "device": opts.device,
        "placement": opts.placement or ("table" if opts.placement_table is not None
                                        else "contiguous"),
        "unfused": opts.unfused,
        "prefill": opts.prefill,
        "step_ms": stats,
        "step_ms_per_step": step_ms,  # every step, warm-up included (the slowest rank's)
        # each rank's own: how far the slowest lags the others (epsim calibrate's rank skew)
        "step_ms_per_rank": [[st["step_us"] / 1e3 for st in rank] for rank in decode],
        "tokens_per_s": _emitted_per_step(opts, decode, world) / (stats["mean"] / 1e3),
        "op_ms_per_step_by_kind": {
            k: sum(st["op_us"].get(k, 0.0) for rank in decode for st in rank)
            / (world * opts.steps) / 1e3 for k in kinds},
        "next_tokens": [[st["next_tokens"].tolist() for st in rank] for rank in decode],
    }
    if opts.mtp:
        accepted = [sum(int(st["accepted"].sum()) for st in (rank[s] for rank in decode))
                    for s in range(opts.steps)]
        out["mtp"] = {"draft_tokens": opts.mtp, "acceptance": opts.mtp_acceptance,
                      "accepted_per_step": accepted,
                      "tokens_per_request_step": 1 + sum(accepted) / (world * opts.batch
                                                                      * opts.steps)}
    prefill_ms = 0.0
    if opts.prefill:
        prefill_ms = max(p["step_us"] for p in prefills if p is not None) / 1e3
        out["prefill_ms"] = prefill_ms
        out["prefill_tokens_per_s"] = world * opts.batch * (opts.context - 1) / (prefill_ms / 1e3)
    if opts.trace:
        # prefill first (step -1), then the decode steps one after another
        out["trace_events"] = [
            _shift(e, -1, 0.0) for p in prefills if p is not None for e in p["events"]] + [
            _shift(e, s, prefill_ms + sum(step_ms[:s]))
            for rank in decode for s, st in enumerate(rank) for e in st["events"]]
    if opts.check:
        assert caches is not None, "--check needs every rank's KV cache"
        out.update(check_against_reference(opts, model, prefills, decode, caches))
    return out


def _emitted_per_step(opts: RunOptions, decode: list[list[dict[str, Any]]],
                      world: int) -> float:
    """Tokens the ranks emit per timed step: one per sequence, plus its accepted drafts under
    MTP (the warm-up step is not timed when there are others)."""
    if not opts.mtp:
        return world * opts.batch
    timed = range(1, opts.steps) if opts.steps > 1 else range(opts.steps)
    emitted = [world * opts.batch + sum(int(rank[s]["accepted"].sum()) for rank in decode)
               for s in timed]
    return sum(emitted) / len(emitted)


def _shift(event: Any, step: int, offset_ms: float) -> Any:
    from dataclasses import replace

    return replace(event, start_us=event.start_us + offset_ms * 1e3,
                   args={**dict(event.args), "step": step})


def check_against_reference(opts: RunOptions, model: Any, prefills: list[dict[str, Any] | None],
                            decode: list[list[dict[str, Any]]],
                            caches: list[tuple[Any, Any]]) -> dict[str, Any]:
    """Compare every rank's logits, final hidden states, tokens and stored KV cache with the
    dense reference (which decodes from the cache as the ranks stored it)."""
    import torch

    from .reference import StoredCache, reference_decode, relative_error

    world, b = len(decode), opts.batch
    stored = StoredCache(torch.cat([c for c, _ in caches], dim=1),
                         torch.cat([pe for _, pe in caches], dim=1))
    writes = _step_writes(decode, b) if opts.mtp else None
    run = reference_decode(model, opts.seed, world, b, opts.context, opts.steps, opts.kv_dtype,
                           prefill=opts.prefill, stored=stored, mtp=opts.mtp,
                           acceptance=opts.mtp_acceptance, writes=writes)
    ref_prefill, ref = run.prefill, run.decode
    errs = {"logits": 0.0, "hidden": 0.0, "kv_cache": run.kv_cache_err}
    if opts.mtp:
        errs["draft_logits"] = 0.0
    mismatches = 0
    q = 1 + opts.mtp  # rows per sequence of a verify step
    for r in range(world):
        rows, seqs = slice(r * b * q, (r + 1) * b * q), slice(r * b, (r + 1) * b)
        pairs = list(zip(decode[r], ref, strict=True))
        if ref_prefill is not None:
            pairs.append((prefills[r], ref_prefill))
        for got, want in pairs:
            part = seqs if got["phase"] == "prefill" else rows
            errs["logits"] = max(errs["logits"], relative_error(got["logits"], want.logits[part]))
            errs["hidden"] = max(errs["hidden"], relative_error(got["hidden"], want.hidden[part]))
            mismatches += int((got["next_tokens"] != want.next_tokens[part]).sum())
        for got, want in zip(decode[r], run.drafts, strict=True) if opts.mtp else ():
            # MTP: the draft passes
            for logits, ref_logits in zip(got["draft_logits"], want.logits, strict=True):
                errs["draft_logits"] = max(errs["draft_logits"],
                                           relative_error(logits, ref_logits[seqs]))
            mismatches += int((got["draft_tokens"] != want.tokens[seqs]).sum())
    return {"max_rel_err": max(errs.values()), "max_rel_err_by_output": errs,
            "token_mismatches": mismatches}


def _step_writes(decode: list[list[dict[str, Any]]], batch: int) -> list[Any]:
    """Each step's cache writes of every rank, sequences numbered rank by rank."""
    import torch

    from .reference import StepWrites

    out = []
    for s in range(len(decode[0])):
        merged: dict[Any, list[Any]] = {}
        for r, rank in enumerate(decode):
            for key, (seq, pos, c, pe) in rank[s]["kv_writes"].items():
                merged.setdefault(key, []).append((seq + r * batch, pos, c, pe))
        out.append(StepWrites({key: tuple(torch.cat(x) for x in zip(*parts, strict=True))
                               for key, parts in merged.items()}))
    return out
