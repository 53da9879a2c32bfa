"""A simulated benchmark written as ``vllm bench serve --save-result`` writes a measured one.

:func:`vllm_result` builds the object with the keys vLLM's ``main_async()`` and ``benchmark()``
write (vllm-project/vllm vllm/benchmarks/serve.py at 009e6d4a), in their order, but for the
statistics of two populations vLLM adds under conditions (``*_client_queue_time_ms`` with a
concurrency cap, ``*_e2el_including_client_queue_ms`` at a finite rate): not written yet,
though their populations are computed below;
from a finished :class:`~epsim.sim.serving.simulate.ServingRun` and its metrics; epsim's own figures
(the deployment, decode throughput, the step breakdown, ...) go under the ``"epsim"`` key, where
no vLLM reader looks. Without ``detailed`` the per-request lists vLLM drops without
``--save-detailed`` are dropped too (``latencies`` and ``queue_times`` stay, as in vLLM).

The per-request populations and vLLM's peak figures are computed here, once, for the writer and
for a replay's predictions (``epsim.sim.replay``):

    populations_s            ttft, tpot (requests with more than one output token), itl (every
                             gap, pooled), e2el, client_queue_time (arrival to send) and
                             e2el_including_client_queue, in seconds
    max_output_tokens_per_s  the most outputs in one whole second from the first send (vLLM
                             counts one per streamed chunk: the first token and each gap)
    max_concurrent_requests  the most requests between send and last token at once (vLLM's
                             sweep over half-open intervals)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import numpy as np

from .metrics import latency_stats, per_request_itls_s, percentile_word
from .simulate import ServingRun
from .tally import Weighted

#: the lists vLLM removes from the result without --save-detailed (main_async)
DETAILED_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts",
                 "errors")
#: what the writer names as the client in vLLM's ``backend`` / ``endpoint_type`` keys
BACKEND = "epsim"


def populations_s(run: ServingRun) -> dict[str, np.ndarray | Weighted]:
    """The per-request (ITL: per-gap) values vLLM's statistics are taken over, in seconds."""
    outs = run.requests.output_lens
    ttft = run.first_token_s - run.send_s
    e2el = run.done_s - run.send_s
    multi = outs > 1
    queue = run.send_s - run.requests.issue_times_s
    return {"ttft": ttft, "tpot": (e2el[multi] - ttft[multi]) / (outs[multi] - 1),
            "itl": run.gaps.population(), "e2el": e2el, "client_queue_time": queue,
            "e2el_including_client_queue": e2el + queue}


def stat_ms(values_s: np.ndarray | Weighted, word: str) -> float:
    """``mean``/``median``/``std``/``pNN`` of ``values_s`` in ms, as ``metrics.latency_stats``
    gives it (an empty list counts as [0], as vLLM's ``np.mean(x or 0)``)."""
    if word in ("mean", "median", "std"):
        return latency_stats("x", values_s, (), False)[f"{word}_x_ms"]
    p = float(word[1:])
    return latency_stats("x", values_s, (p,), True)[f"p{percentile_word(p)}_x_ms"]


def max_output_tokens_per_s(run: ServingRun) -> float:
    """vLLM's peak: outputs per one-second bucket from the first send, the fullest bucket
    (each output at the instant the run emitted it)."""
    return run.gaps.peak_outputs_per_s(float(run.send_s.min()), float(run.done_s.max()))


def max_concurrent_requests(run: ServingRun) -> int:
    """The most requests in flight at once: [send, last token) intervals, ends before starts."""
    events = sorted([(t, 1) for t in run.send_s.tolist()] + [(t, -1) for t in run.done_s.tolist()])
    now = peak = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return peak


def _setup(result: Mapping[str, Any], label: str | None) -> dict[str, Any]:
    rate = result.get("request_rate", "inf")
    if rate == "trace":  # a replayed trace: its offered rate (the arrivals go with the file)
        rate = result["trace_arrival_rate"]
    return {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": BACKEND,
            "backend": BACKEND, "label": label, "model_id": result.get("model"),
            "tokenizer_id": result.get("model"), "num_prompts": result["num_prompts"],
            "request_rate": "inf" if rate in ("inf", math.inf) else rate,
            "burstiness": result.get("burstiness", 1.0),
            "max_concurrency": result.get("max_concurrency")}


def _per_request(run: ServingRun, detailed: bool) -> dict[str, Any]:
    n = len(run.requests)
    lat = populations_s(run)
    return {"input_lens": run.requests.input_lens.tolist(),
            "output_lens": run.requests.output_lens.tolist(),
            "ttfts": lat["ttft"].tolist(), "itls": per_request_itls_s(run) if detailed else [],
            "latencies": lat["e2el"].tolist(), "start_times": run.send_s.tolist(),
            "queue_times": lat["client_queue_time"].tolist(),
            "generated_texts": [""] * n, "errors": [""] * n}


def vllm_result(run: ServingRun, result: Mapping[str, Any], *, detailed: bool = False,
                goodput: Sequence[tuple[str, float]] = (), label: str | None = None
                ) -> dict[str, Any]:
    """vLLM's result object for a simulated run (``result``: ``run_scenario``'s dict), with
    epsim's own keys under ``"epsim"``."""
    out = _setup(result, label)
    out.update({k: result[k] for k in ("duration", "completed")})
    out["failed"] = 0
    out.update({k: result[k] for k in ("total_input_tokens", "total_output_tokens",
                                       "request_throughput")})
    out["request_goodput"] = result.get("request_goodput") if goodput else None
    out.update({k: result[k] for k in ("output_throughput", "total_token_throughput")})
    out.update(_per_request(run, detailed))
    out.update({"max_output_tokens_per_s": max_output_tokens_per_s(run),
                "max_concurrent_requests": max_concurrent_requests(run), "rtfx": 0.0})
    out.update({k: v for k, v in result.items() if k.startswith("spec_decode_")})
    stats = {k: v for k, v in result.items()
             if k.endswith("_ms") and k.split("_")[-2] in ("ttft", "tpot", "itl", "e2el")}
    out.update(stats)
    if not detailed:
        for key in DETAILED_KEYS:
            out.pop(key, None)
    out["epsim"] = {**{k: v for k, v in result.items() if k not in out and k not in stats},
                    "goodput": dict(goodput)}
    return out
