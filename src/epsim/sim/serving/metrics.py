"""Benchmark metrics with the names and definitions of ``vllm bench serve``, plus epsim's own.

Per request (vLLM's ``calculate_metrics``):
    ttft    first token's arrival - send time (queueing for a KV slot and prefill included)
    e2el    last token's arrival - send time
    tpot    (e2el - ttft) / (output tokens - 1), for requests with more than one output token
    itl     every gap between consecutive outputs of a request, all requests pooled
For each: ``mean_X_ms``, ``median_X_ms``, ``std_X_ms`` and ``pP_X_ms`` for each selected
percentile ``P`` (``--metric-percentiles``) of each selected metric (``--percentile-metrics``);
``P`` is written as vLLM writes it (``p99``, ``p99.9``). Percentiles are numpy's linear ones.

Throughputs divide by the benchmark's duration (first send to last token):
``request_throughput``, ``output_throughput`` and ``total_token_throughput`` (input + output).
``request_goodput`` (only with SLOs, ``--goodput ttft:MS tpot:MS e2el:MS``): requests that meet
every SLO given, per second of the duration; a request's TPOT counts as 0 when it has one output
token (vLLM's ``calculate_metrics`` and ``check_goodput_args``, vllm/benchmarks/serve.py at
009e6d4a).

Under speculative decoding (MTP) a step may emit several tokens of a request at once, as one
output: ``itl`` has one gap per output after the first (vLLM's client appends one per streamed
chunk: vllm-project/vllm vllm/benchmarks/lib/endpoint_request_func.py at 02cfb534), while
``tpot`` divides by the output tokens (``calculate_metrics`` counts them, "since multiple output
tokens may be bundled together": vllm/benchmarks/serve.py at 009e6d4a). vLLM's ``spec_decode_*``
counters join the result then (``epsim.sim.serving.speculation``).

epsim's own (docs/design.md section 3):
    decode_throughput     tokens produced by pure decode steps / the time those steps took:
                          decode time only, prefill excluded, as the reference report measures
    mean_decode_step_ms   mean duration of the pure decode steps
    step_breakdown_ms     the step simulator's per-category milliseconds, averaged over them
    expert_imbalance      max / mean GPU expert load, averaged over them
    kv_cache_usage        reserved share of the decode ranks' KV cache, time-averaged over the
                          decode engine's steps (``max_kv_cache_usage``: its peak)
    preemptions           times a request's KV was taken back to be recomputed (vLLM's
                          preemption, SGLang's retraction; 0 under ``prefill_first``)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from epsim.model.errors import EpsimError

from .simulate import ServingRun
from .tally import Weighted


class NoSteadyWindow(EpsimError):
    """``--measure steady`` found no window between the warm-up and the cool-down: every request
    was sent before the warm-up's completions (an open loop faster than the engine drains, or
    too few ``--num-prompts``). A search counts such a point as over its SLO."""

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (10.0, 25.0, 50.0, 75.0, 90.0, 99.0)
DEFAULT_PERCENTILE_METRICS = METRICS


def percentile_word(p: float) -> str:
    """vLLM's spelling of a percentile in a key: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def parse_percentiles(text: str) -> tuple[float, ...]:
    """``"10,50,90"`` -> ``(10.0, 50.0, 90.0)``; each in [0, 100]."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise EpsimError(f"--metric-percentiles {text!r} has an empty item")
        try:
            p = float(part)
        except ValueError:
            raise EpsimError(f"metric percentile {part!r} is not a number") from None
        if not 0.0 <= p <= 100.0 or not math.isfinite(p):
            raise EpsimError(f"metric percentile {part} must be in [0, 100]")
        out.append(p)
    if not out:
        raise EpsimError("--metric-percentiles is empty")
    return tuple(out)


def parse_percentile_metrics(text: str) -> tuple[str, ...]:
    """``"ttft,itl"`` -> ``("ttft", "itl")``; each one of ``METRICS``."""
    out = [m.strip() for m in text.split(",")]
    if any(out) and not all(out):
        raise EpsimError(f"--percentile-metrics {text!r} has an empty item")
    out = [m for m in out if m]
    for m in out:
        if m not in METRICS:
            raise EpsimError(f"unknown percentile metric {m!r} (one of {', '.join(METRICS)})")
    if not out:
        raise EpsimError("--percentile-metrics is empty")
    return tuple(out)


#: the per-request metrics vLLM's --goodput takes SLOs on
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput_item(text: str) -> tuple[str, float]:
    """One of vLLM's ``--goodput`` pairs: ``"ttft:500"`` -> ``("ttft", 500.0)`` (milliseconds,
    non-negative, the key one of ``GOODPUT_METRICS``)."""
    name, colon, value = text.partition(":")
    if not colon or name not in GOODPUT_METRICS:
        raise EpsimError(f"a goodput SLO is KEY:MS with KEY one of {', '.join(GOODPUT_METRICS)}"
                         f", got {text!r}")
    try:
        ms = float(value)
    except ValueError:
        raise EpsimError(f"goodput SLO {text!r}: {value!r} is not a number") from None
    if not math.isfinite(ms) or ms < 0:
        raise EpsimError(f"goodput SLO {text!r} must be a non-negative number of milliseconds")
    return name, ms


def goodput_slos(items: Sequence[tuple[str, float]] | None) -> tuple[tuple[str, float], ...]:
    """The pairs of ``--goodput`` as one tuple in ``GOODPUT_METRICS`` order; a key given twice
    is an error."""
    items = tuple(items or ())
    names = [n for n, _ in items]
    for n in set(names):
        if names.count(n) > 1:
            raise EpsimError(f"--goodput gives {n} twice")
    return tuple(sorted(items, key=lambda kv: GOODPUT_METRICS.index(kv[0])))


def request_latencies_s(run: ServingRun) -> dict[str, np.ndarray]:
    """Per request, in seconds: ``ttft``, ``e2el`` and ``tpot`` (0 for one output token, as
    vLLM's goodput counts it)."""
    outs = run.requests.output_lens
    ttft = run.first_token_s - run.send_s
    e2el = run.done_s - run.send_s
    tpot = np.where(outs > 1, (e2el - ttft) / np.maximum(outs - 1, 1), 0.0)
    return {"ttft": ttft, "tpot": tpot, "e2el": e2el}


def good_requests(run: ServingRun, slos: Sequence[tuple[str, float]]) -> int:
    """Requests whose every SLO'd metric is at most its SLO (vLLM: ``slo >= value``)."""
    lat = request_latencies_s(run)
    good = np.ones(len(run.requests), dtype=bool)
    for name, ms in slos:
        good &= lat[name] <= ms / 1e3
    return int(good.sum())


def per_request_itls_s(run: ServingRun) -> list[list[float]]:
    """Each request's inter-token gaps in order (vLLM's per-request ``itls``), from the pooled
    ``itls_s`` and their ``itl_request_ids`` (a run with ``details``)."""
    if run.itls_s is None or run.itl_request_ids is None:
        raise ValueError("the run kept no per-request gaps (simulate_serving(details=True))")
    out: list[list[float]] = [[] for _ in range(len(run.requests))]
    for i, gap in zip(run.itl_request_ids.tolist(), run.itls_s.tolist(), strict=True):
        out[i].append(gap)
    return out


def latency_stats(name: str, values_s: np.ndarray | Weighted, percentiles: Sequence[float],
                  with_pct: bool) -> dict[str, float]:
    """``mean_/median_/std_`` (and with ``with_pct`` the ``pNN_``) ``{name}_ms`` of seconds,
    given one by one or as a weighted population (``sim.serving.tally.Weighted``)."""
    if not len(values_s):
        values_s = np.zeros(1)  # vLLM: np.mean(x or 0)
    if isinstance(values_s, Weighted):
        ms = values_s.scaled(1e3)
        out = {f"mean_{name}_ms": ms.mean(), f"median_{name}_ms": ms.median(),
               f"std_{name}_ms": ms.std()}
        pct = ms.percentile(list(percentiles)) if with_pct else ()
    else:
        ms = values_s * 1e3
        out = {f"mean_{name}_ms": float(np.mean(ms)), f"median_{name}_ms": float(np.median(ms)),
               f"std_{name}_ms": float(np.std(ms))}
        pct = np.percentile(ms, list(percentiles)) if with_pct else ()
    if with_pct:
        for p, v in zip(percentiles, pct, strict=True):
            out[f"p{percentile_word(p)}_{name}_ms"] = float(v)
    return out


def compute_metrics(run: ServingRun, percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                    percentile_metrics: Sequence[str] = DEFAULT_PERCENTILE_METRICS,
                    goodput: Sequence[tuple[str, float]] = ()) -> dict[str, Any]:
    """The benchmark's metrics from a finished run -> a flat JSON-able dict (vLLM key names);
    ``goodput``: SLOs (``goodput_slos``) that add ``request_goodput``."""
    req = run.requests
    ins, outs = req.input_lens, req.output_lens
    ttft = run.first_token_s - run.send_s
    e2el = run.done_s - run.send_s
    multi = outs > 1
    tpot = (e2el[multi] - ttft[multi]) / (outs[multi] - 1)
    duration = float(run.done_s.max() - min(0.0, float(run.send_s.min())))
    total_in, total_out = int(ins.sum()), int(outs.sum())
    m: dict[str, Any] = {
        "completed": int(np.count_nonzero(~np.isnan(run.done_s))),
        "num_prompts": len(req),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(req) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    if goodput:
        m["request_goodput"] = good_requests(run, goodput) / duration
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", run.gaps.population()),
                         ("e2el", e2el)):
        m.update(latency_stats(name, values, percentiles, name in percentile_metrics))

    # the step figures, summed in step order as the steps ended (sim.serving.tally.StepTally)
    every, decoding = run.tally.run, run.tally.decoding
    dec_n, dec_time = every.dec_steps, every.dec_time
    m["decode_throughput"] = every.dec_tokens / dec_time if dec_time else 0.0
    m["mean_decode_step_ms"] = dec_time / dec_n * 1e3 if dec_n else 0.0
    m["step_breakdown_ms"] = {k: v / dec_n for k, v in every.breakdown.items()} if dec_n else {}
    m["expert_imbalance"] = every.imbalance / dec_n if dec_n else 1.0
    busy = decoding.busy
    m["kv_cache_usage"] = decoding.kv_time / busy if busy else 0.0
    m["max_kv_cache_usage"] = decoding.max_kv
    m["num_decode_steps"] = dec_n
    m["num_steps"] = every.steps
    m["max_running_per_rank"] = run.max_running_per_rank
    m["preemptions"] = run.preemptions
    m["step_sim_calls"] = run.sim_calls
    m.update(run.speculation)  # MTP: vLLM's spec_decode_* keys (none without it, as vLLM)
    return m
