"""Per-instance figures of a run with several instances, and the aggregate they make.

A deployment cut into instances (``--instance-nodes``) is reported twice: the benchmark as the
client sees it (``compute_metrics`` over every request: the top level of the result, under the
same keys as with one instance) and one entry per instance (``instance_metrics``): the requests
routed to it, its throughputs, its requests' TTFT (and, where it decodes, ITL, TPOT and E2E
latency) and its own steps.

Each side's instances partition the requests, so their figures combine into the aggregate:
    throughputs     divided by the benchmark's duration (first send to last token, as the
                    aggregate's), so one side's instances sum to the aggregate
                    (``request_throughput``, ``output_throughput``, ``total_token_throughput``)
    decode_throughput
                    tokens of an instance's pure decode steps / their time; instances step in
                    parallel, so the aggregate is the sum over the decoding instances (the
                    pooled ratio would be their mean)
    steps, preemptions   sums; ``max_running_per_rank``: the maximum
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .metrics import latency_stats
from .simulate import ServingRun
from .tally import DECODING_ENGINES, StepFigures, Weighted

#: the roles a step's engine plays, and whether that role decodes
DECODING = {role: role in DECODING_ENGINES for role in ("colocated", "decode", "prefill")}


def _step_figures(f: StepFigures) -> dict[str, Any]:
    """One instance's steps: decode-only throughput and step time, KV use, batch peak."""
    dec_time, busy = f.dec_time, f.busy
    return {
        "decode_throughput": f.dec_tokens / dec_time if dec_time else 0.0,
        "mean_decode_step_ms": dec_time / f.dec_steps * 1e3 if f.dec_steps else 0.0,
        "num_steps": f.steps,
        "busy_s": busy,
        "kv_cache_usage": f.kv_time / busy if busy else 0.0,
        "max_running_per_rank": f.peak,
    }


def _request_figures(run: ServingRun, mine: np.ndarray, decodes: bool, duration: float,
                     percentiles: Sequence[float], pct_metrics: Sequence[str],
                     itls_s: Weighted) -> dict[str, Any]:
    """The requests ``mine`` (a mask): counts, throughputs over ``duration``, latencies."""
    req = run.requests
    ins, outs = req.input_lens[mine], req.output_lens[mine]
    n_in, n_out = int(ins.sum()), int(outs.sum())
    out: dict[str, Any] = {
        "requests": int(np.count_nonzero(mine)),
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": int(np.count_nonzero(mine)) / duration,
        "output_throughput": n_out / duration,
        "total_token_throughput": (n_in + n_out) / duration,
    }
    ttft = run.first_token_s[mine] - run.send_s[mine]
    out.update(latency_stats("ttft", ttft, percentiles, "ttft" in pct_metrics))
    if decodes:
        e2el = run.done_s[mine] - run.send_s[mine]
        multi = outs > 1
        tpot = (e2el[multi] - ttft[multi]) / (outs[multi] - 1)
        for name, values in (("tpot", tpot), ("itl", itls_s), ("e2el", e2el)):
            out.update(latency_stats(name, values, percentiles, name in pct_metrics))
    return out


def instance_metrics(run: ServingRun, duration: float, percentiles: Sequence[float],
                     pct_metrics: Sequence[str]) -> list[dict[str, Any]]:
    """One entry per instance (prefill instances first, then the decoding ones, each in
    index order): ``role``, ``index`` and its figures; the caller adds its nodes and plan."""
    n = len(run.requests)
    owner = run.instance if run.instance is not None else np.zeros(n, dtype=np.int64)
    cfg = run.config
    roles = [("prefill", run.prefill_instance, cfg.prefill_instances)] \
        if run.prefill_instance is not None else []
    roles.append(("decode" if run.prefill_instance is not None else "colocated", owner,
                  cfg.instances))
    out = []
    for role, of, count in roles:
        for k in range(count):
            itls = run.gaps.population(k if DECODING[role] else -1)
            entry = {"role": role, "index": k}
            entry.update(_request_figures(run, of == k, DECODING[role], duration, percentiles,
                                          pct_metrics, itls))
            pre = run.request_preemptions
            entry["preemptions"] = int(pre[of == k].sum()) if pre is not None else 0
            entry.update(_step_figures(run.tally.of(role, k)))
            out.append(entry)
    return out


def aggregate(metrics: dict[str, Any], instances: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The top-level metrics of a run with instances: ``decode_throughput`` is the sum of the
    decoding instances' (they step in parallel); every other key is the benchmark's own."""
    decoding = [i for i in instances if DECODING[i["role"]]]
    return {**metrics, "decode_throughput": sum(i["decode_throughput"] for i in decoding)}
