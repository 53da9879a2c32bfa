"""A measured benchmark replayed through the simulator, and measured against predicted.

:func:`replay` runs a :class:`~epsim.sim.workload.bench_results.BenchResult`'s workload (its requests,
concurrency, arrivals; :meth:`BenchResult.requests`) under a deployment (a
:class:`~epsim.sim.scenario.Scenario`, whose own workload only carries the seed) and predicts
every metric the file measured, computed as the client computes it:

    latency statistics   ``mean``/``median``/``std``/``pNN`` of TTFT, TPOT, ITL, E2EL and vLLM's
                         client queue time over the simulated requests (``bench_write``)
    throughputs          from the simulated duration, over the replayed tokens (SGLang's
                         ``input_throughput`` too)
    request_goodput      under the SLOs given (``--goodput``) or written in an epsim file
    peaks                vLLM's ``max_output_tokens_per_s`` and ``max_concurrent_requests``
    concurrency          SGLang's: summed E2E latency over the duration

``error_pct`` is ``(predicted - measured) / measured * 100`` (``None`` for a measured 0 with a
non-zero prediction). A metric the simulator cannot predict (e.g. ``rtfx``) is listed as skipped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from epsim.sim.serving.bench_write import (
    max_concurrent_requests,
    max_output_tokens_per_s,
    populations_s,
    stat_ms,
)
from epsim.sim.serving.metrics import good_requests
from epsim.sim.serving.simulate import ServingRun
from epsim.sim.workload.bench_results import STAT_KEY, BenchResult
from epsim.sim.workload.spec import WorkloadSpec

from .scenario import StepCache, run_scenario
from .spec import Scenario


def replay_scenario(bench: BenchResult, sc: Scenario) -> Scenario:
    """``sc`` with the file's workload: its number of requests, concurrency, rate, burstiness
    and client (the lengths themselves are passed to ``run_scenario`` as requests)."""
    req = bench.requests(sc.workload.seed)
    w = WorkloadSpec(dataset="fixed", num_prompts=bench.num_prompts,
                     isl=int(req.input_lens.max()), osl=int(req.output_lens.max()),
                     concurrency=bench.max_concurrency, request_rate=bench.request_rate,
                     burstiness=bench.burstiness, seed=sc.workload.seed,
                     bench_client=bench.client).validate()
    return replace(sc, workload=w)


def predicted_value(name: str, run: ServingRun, result: dict[str, Any],
                    slos: Sequence[tuple[str, float]]) -> float | None:
    """The simulated value of measured metric ``name``; ``None`` when it cannot be predicted."""
    m = STAT_KEY.match(name)
    if m:
        pops = populations_s(run)
        return stat_ms(pops[m.group(2)], m.group(1)) if m.group(2) in pops else None
    duration = float(result["duration"])
    derived = {
        "input_throughput": lambda: result["total_input_tokens"] / duration,
        "concurrency": lambda: float(np.sum(populations_s(run)["e2el"])) / duration,
        "max_output_tokens_per_s": lambda: max_output_tokens_per_s(run),
        "max_concurrent_requests": lambda: float(max_concurrent_requests(run)),
        "request_goodput": lambda: good_requests(run, slos) / duration if slos else None,
    }
    if name in derived:
        return derived[name]()
    value = result.get(name)
    return float(value) if isinstance(value, int | float) else None


def error_pct(measured: float, predicted: float) -> float | None:
    """``(predicted - measured) / measured`` in %; ``None`` where it is not a finite number
    (a measured 0, or one so small the ratio overflows: never NaN or Infinity in JSON)."""
    if measured == 0:
        return 0.0 if predicted == 0 else None
    err = (predicted - measured) / measured * 100.0
    return err if math.isfinite(err) else None


def replay(bench: BenchResult, sc: Scenario, cache: StepCache | None = None,
           goodput: Sequence[tuple[str, float]] = ()) -> dict[str, Any]:
    """Simulate ``bench``'s workload under ``sc``'s deployment -> a report: ``metrics``
    ({name: {measured, predicted, error_pct}}), ``skipped`` (metrics not predicted, and why),
    ``ignored`` (the file's keys neither replayed nor compared, and why),
    ``workload``, ``notes``, ``deployment`` (the simulated result without its metrics) and the
    median and largest absolute error."""
    sc = replay_scenario(bench, sc)
    runs: list[ServingRun] = []
    result = run_scenario(sc, cache, run_out=runs,
                          requests=bench.requests(sc.workload.seed))
    run = runs[0]
    slos = tuple(goodput) or bench.goodput
    metrics: dict[str, dict[str, float | None]] = {}
    skipped: dict[str, str] = {}
    for name, measured in bench.measured.items():
        if name == "request_goodput" and not slos:
            skipped[name] = "the file does not say its SLOs: give them with --goodput"
            continue
        predicted = predicted_value(name, run, result, slos)
        if predicted is None or not math.isfinite(predicted):
            skipped[name] = "not simulated"
            continue
        metrics[name] = {"measured": measured, "predicted": predicted,
                         "error_pct": error_pct(measured, predicted)}
    errors = [abs(v["error_pct"]) for v in metrics.values() if v["error_pct"] is not None]
    return {
        "bench": bench.source, "format": bench.client, "workload": bench.workload(),
        "notes": list(bench.notes), "metrics": metrics, "skipped": skipped,
        "ignored": dict(bench.ignored),
        "median_abs_error_pct": float(np.median(errors)) if errors else None,
        "max_abs_error_pct": max(errors) if errors else None,
        "deployment": {k: v for k, v in result.items()
                       if k in _ECHO_KEYS},
        "sim_wall_s": result["sim_wall_s"],
    }


#: the simulated result's keys that describe the deployment (the report's ``deployment``)
_ECHO_KEYS = ("model", "hardware", "nodes", "gpus_per_node", "gpus", "dp", "tp", "ep", "dbo",
              "eplb", "graph", "kv_dtype", "disagg", "kernels", "mtp", "engine", "scheduler",
              "max_num_seqs", "max_num_batched_tokens", "chunked_prefill_size",
              "cuda_graph_max_bs", "kv_capacity_tokens_per_rank", "seed")
