"""Measured benchmark results as their clients write them, read into one frozen record.

    vllm     ``vllm bench serve --save-result`` (``--save-detailed`` adds the per-request lists):
             one JSON object, or one per line under ``--append-result``; keys as
             ``benchmark()`` and ``main_async()`` write them (vllm-project/vllm
             vllm/benchmarks/serve.py at 009e6d4a): ``num_prompts``, ``request_rate`` (``"inf"``
             or a number), ``burstiness``, ``max_concurrency``, ``duration``, ``completed``,
             ``failed``, ``total_input_tokens``, ``total_output_tokens``, the throughputs,
             ``mean_/median_/std_/pNN_{ttft,tpot,itl,e2el}_ms``; detailed: ``input_lens``,
             ``output_lens``, ``ttfts``, ``itls`` (one list per request), ``start_times``,
             ``errors``; always ``latencies`` and ``queue_times`` (each request's wait for a
             concurrency slot after its arrival).
    sglang   ``python -m sglang.bench_serving`` appends one JSON line per run to its
             ``--output-file`` (``--output-details`` adds ``input_lens``, ``output_lens``,
             ``ttfts``, ``itls``): sgl-project/sglang python/sglang/bench_serving.py at 0033168f,
             ``benchmark()``. Its own keys: no ``num_prompts`` (``completed`` counts them),
             ``input_throughput``, ``total_output_tokens_retokenized``,
             ``mean_/median_/std_/p99_e2e_latency_ms`` (read here as ``*_e2el_ms``),
             ``p95_itl_ms``, ``concurrency`` (summed E2E latency over the duration),
             ``dataset_name`` and its ``random_*`` flags; arrivals Poisson (no burstiness).

:func:`read_bench_file` -> :class:`BenchResult`: the workload (how many requests, their lengths
when listed, the arrival process) and every measured metric, under epsim's (vLLM's) names. A
file of neither format, one without the keys that define the workload, or whose counts disagree
by more than ``COUNT_TOLERANCE`` is an :class:`EpsimError` (one line).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from epsim.model.bounds import (
    MAX_CONCURRENCY,
    MAX_PROMPTS,
    MAX_TOKENS,
    MIN_BURSTINESS,
    MIN_REQUEST_RATE,
    check_count,
    parse_json,
    show,
)
from epsim.model.errors import EpsimError

from .spec import Requests, issue_times

#: how far two counts of one file may disagree (sum(input_lens) vs total_input_tokens, ...)
COUNT_TOLERANCE = 1e-3

#: keys only a vLLM result has, and keys only an SGLang result line has (format detection)
VLLM_KEYS = frozenset({"num_prompts", "burstiness", "date", "endpoint_type", "failed",
                       "request_goodput", "total_token_throughput", "max_output_tokens_per_s",
                       "max_concurrent_requests", "latencies", "start_times", "queue_times",
                       "mean_e2el_ms"})
SGLANG_KEYS = frozenset({"total_output_tokens_retokenized", "input_throughput",
                         "mean_e2e_latency_ms", "dataset_name", "random_input_len",
                         "sharegpt_output_len", "accept_length", "concurrency"})

#: a latency statistic's key: mean/median/std/pNN of a metric, in ms
STAT_KEY = re.compile(r"^(mean|median|std|p\d+(?:\.\d+)?)_([a-z0-9_]+?)_ms$")
#: SGLang's metric names -> vLLM's (epsim's)
SGLANG_METRIC_NAMES = {"e2e_latency": "e2el"}
#: single-number metrics compared when present (besides the latency statistics)
SCALAR_METRICS = ("duration", "request_throughput", "request_goodput", "output_throughput",
                  "total_token_throughput", "input_throughput", "max_output_tokens_per_s",
                  "max_concurrent_requests", "concurrency", "spec_decode_acceptance_length",
                  "spec_decode_acceptance_rate")


@dataclass(frozen=True)
class ResultFormat:
    """One benchmark client's result file: ``name`` (``--bench-client``), ``title`` (in
    messages), ``keys`` (only its files have them: format detection) and ``metric_names`` (its
    latency statistics' metric names -> epsim's, which are vLLM's)."""

    name: str
    title: str
    keys: frozenset[str]
    metric_names: Mapping[str, str]


#: the clients whose result files epsim reads, by name (the names of ``BENCH_CLIENTS``)
RESULT_FORMATS: dict[str, ResultFormat] = {f.name: f for f in (
    ResultFormat("vllm", "vLLM", VLLM_KEYS, {}),
    ResultFormat("sglang", "SGLang", SGLANG_KEYS, SGLANG_METRIC_NAMES))}
#: SGLang's single-number metric names -> epsim's (read from either client's file)
SGLANG_SCALARS = {"accept_length": "spec_decode_acceptance_length",
                  "total_throughput": "total_token_throughput"}
#: the keys that set the workload replayed (read by ``_Workload`` and ``_listed_lengths``)
WORKLOAD_KEYS = frozenset({"num_prompts", "completed", "failed", "duration",
                           "total_input_tokens", "total_output_tokens", "max_concurrency",
                           "request_rate", "burstiness"})
#: each workload key's range, checked before anything is sized from it (epsim.model.bounds; a
#: duration of 10**9 s is 31 years, 1e-6 s a microsecond); request_rate may be inf (all at once)
_TOTAL_TOKENS = MAX_PROMPTS * MAX_TOKENS
WORKLOAD_BOUNDS: dict[str, tuple[float, float]] = {
    "num_prompts": (1, MAX_PROMPTS), "completed": (1, MAX_PROMPTS), "failed": (0, MAX_PROMPTS),
    "max_concurrency": (1, MAX_CONCURRENCY), "request_rate": (MIN_REQUEST_RATE, 1e9),
    "burstiness": (MIN_BURSTINESS, 1e6), "duration": (1e-6, 1e9),
    "total_input_tokens": (1, _TOTAL_TOKENS), "total_output_tokens": (1, _TOTAL_TOKENS),
}
_RUN_METADATA = "the run's metadata, not a measurement"
_RETOKENIZED = "SGLang's re-tokenized count: total_output_tokens (the server's) is replayed"
#: keys of either client's file that are read but neither replayed nor compared, and why; any
#: other key epsim does not know is listed under ``ignored`` too ("not a key of ...")
IGNORED_KEYS: dict[str, str] = {
    **dict.fromkeys(("date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id",
                     "server_info", "tag", "num_processes", "benchmark_start_time",
                     "benchmark_end_time", "metric_accounting_version", "dataset_name",
                     "random_input_len", "random_output_len", "random_range_ratio",
                     "sharegpt_output_len", "ramp_up_strategy", "ramp_up_start_rps",
                     "ramp_up_end_rps"), _RUN_METADATA),
    "latencies": "per-request E2E latencies: their statistics (*_e2el_ms) are compared",
    "ttfts": "per-request TTFTs: their statistics (*_ttft_ms) are compared",
    "itls": "per-request token gaps: their statistics (*_itl_ms) are compared",
    "generated_texts": "the outputs' text: the replay needs only their lengths",
    "max_itl_ms": "the single longest gap of the run: a maximum over one run's samples is not "
                  "predicted (the simulator models no noise)",
    "rtfx": "vLLM's real-time factor of audio transcription: no audio is simulated",
    "total_output_tokens_retokenized": _RETOKENIZED,
    "output_throughput_retokenized": _RETOKENIZED, "total_throughput_retokenized": _RETOKENIZED,
}


@dataclass(frozen=True)
class BenchResult:
    """One measured benchmark: its workload and its metrics.

    client: the format and the client whose semantics replay it (``"vllm"`` or ``"sglang"``).
    source: the file (and the line, for a file of several results).
    num_prompts: requests replayed (the completed ones). Example: 1000.
    duration_s / total_input_tokens / total_output_tokens: as measured.
    max_concurrency / request_rate / burstiness: the arrival process (rate ``inf``: all at 0).
    input_lens / output_lens: per completed request, when the file lists them, else ``None``.
    issue_times_s: when each request arrived at the client (vLLM's ``start_times`` minus
        ``queue_times``), from 0; ``None`` when the file does not say.
    measured: every metric the file has, under epsim's names (``mean_ttft_ms``, ...).
    goodput: the SLOs of ``request_goodput`` when the file says them (epsim's own files do).
    notes: what the replay had to assume (mean lengths, drawn arrivals, dropped failures).
    epsim: the ``epsim`` block of a file ``epsim predict --save-result`` wrote, else empty.
    ignored: every key of the file neither replayed nor compared -> why (nothing is dropped
        silently).
    """

    client: str
    source: str
    num_prompts: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    max_concurrency: int | None
    request_rate: float
    burstiness: float
    input_lens: tuple[int, ...] | None
    output_lens: tuple[int, ...] | None
    issue_times_s: tuple[float, ...] | None
    measured: Mapping[str, float]
    goodput: tuple[tuple[str, float], ...] = ()
    notes: tuple[str, ...] = ()
    epsim: Mapping[str, Any] = field(default_factory=dict)
    ignored: Mapping[str, str] = field(default_factory=dict)

    @property
    def has_lengths(self) -> bool:
        return self.input_lens is not None

    def requests(self, seed: int = 0) -> Requests:
        """The requests to replay: the listed lengths, else the totals spread evenly (each
        request the mean, the remainder one token each on the first ones, so the totals are
        exact); arrivals as listed, else drawn from the rate (``seed``), all 0 at rate inf."""
        n = self.num_prompts
        if self.input_lens is not None and self.output_lens is not None:
            ins = np.array(self.input_lens, dtype=np.int64)
            outs = np.array(self.output_lens, dtype=np.int64)
        else:
            ins, outs = even_lengths(self.total_input_tokens, n), even_lengths(
                self.total_output_tokens, n)
        if math.isinf(self.request_rate):
            times = np.zeros(n)
        elif self.issue_times_s is not None:
            times = np.array(self.issue_times_s, dtype=float)
        else:
            times = issue_times(np.random.default_rng(seed), n, self.request_rate,
                                self.burstiness)
        return Requests(input_lens=ins, output_lens=outs, issue_times_s=times)

    def workload(self) -> dict[str, Any]:
        """The workload as a report shows it."""
        return {"client": self.client, "num_prompts": self.num_prompts,
                "max_concurrency": self.max_concurrency,
                "request_rate": "inf" if math.isinf(self.request_rate) else self.request_rate,
                "burstiness": self.burstiness, "duration_s": self.duration_s,
                "total_input_tokens": self.total_input_tokens,
                "total_output_tokens": self.total_output_tokens,
                "mean_input_len": self.total_input_tokens / self.num_prompts,
                "mean_output_len": self.total_output_tokens / self.num_prompts,
                "lengths": "listed" if self.has_lengths else "mean of the totals",
                "arrivals": ("all at 0" if math.isinf(self.request_rate) else
                             "listed" if self.issue_times_s is not None else "drawn")}


def even_lengths(total: int, n: int) -> np.ndarray:
    """``n`` lengths summing to ``total``, as even as integers allow -> (n,) int64."""
    base, extra = divmod(int(total), n)
    out = np.full(n, base, dtype=np.int64)
    out[:extra] += 1
    return out


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def read_bench_file(path: str | Path, client: str | None = None) -> BenchResult:
    """Read a vLLM or SGLang result file -> :class:`BenchResult`.

    ``client``: the format to assume when the file's keys do not tell (a file with only the
    workload keys); a file whose keys say otherwise is an error. A file of several results
    (one JSON object per line, as both clients append them) is read at its last line.
    """
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise EpsimError(f"cannot read benchmark result {file}: {exc.strerror}") from None
    obj, where = _last_object(text, str(file))
    return parse_bench(obj, source=where, client=client)


def _last_object(text: str, name: str) -> tuple[dict[str, Any], str]:
    """The file's object, or its last line's when it holds one object per line; a parse error
    names the line and column (of the file, in a file of lines)."""
    lines = [(i, ln) for i, ln in enumerate(text.splitlines(), 1) if ln.strip()]
    first = lines[0][1].strip() if lines else ""
    if len(lines) > 1 and first.startswith("{") and first.endswith("}"):
        objs = []  # one object per line, as both clients append them
        for number, line in lines:
            objs.append(parse_json(line, f"{name} line {number}", "result line"))
        if all(isinstance(o, dict) for o in objs):
            return objs[-1], f"{name} line {len(objs)} of {len(objs)}"
    else:
        obj = parse_json(text, name, "result JSON")
        if isinstance(obj, dict):
            return obj, name
    raise EpsimError(f"{name}: neither a vllm bench serve result (a JSON object) nor an "
                     "SGLang bench_serving result line")


def detect_client(obj: Mapping[str, Any], client: str | None = None, source: str = "") -> str:
    """Which client wrote ``obj``: its keys say, else ``client``; both at once is an error."""
    keys = set(obj)
    formats = [f for f in RESULT_FORMATS.values() if keys & f.keys]
    if len(formats) > 1:
        a, b = formats[:2]
        raise EpsimError(f"{source}: mixes keys of {a.title}'s result ({sorted(keys & a.keys)[0]})"
                         f" and {b.title}'s ({sorted(keys & b.keys)[0]})")
    found = formats[0].name if formats else None
    if found and client and client != found:
        raise EpsimError(f"{source}: a {found} result, but --bench-client {client} was given")
    if client is not None and client not in RESULT_FORMATS:
        raise EpsimError(f"unknown benchmark client {client!r}")
    if found is None and client is None:
        raise EpsimError(f"{source}: neither a vllm bench serve result nor an SGLang "
                         "bench_serving line (no key of either; --bench-client names the format)")
    return found or str(client)


def parse_bench(obj: Mapping[str, Any], source: str = "result",
                client: str | None = None) -> BenchResult:
    """One result object -> :class:`BenchResult` (see :func:`read_bench_file`)."""
    client = detect_client(obj, client, source)
    w = _Workload.read(obj, client, source)
    lens = _listed_lengths(obj, w, source)
    notes = list(w.notes)
    if lens is None:
        notes.append(f"no per-request lengths in the file: {w.n} requests replayed at the mean "
                     f"lengths of its totals ({w.total_in / w.n:.1f} in, {w.total_out / w.n:.1f}"
                     " out)")
    times = _issue_times(obj, lens[2] if lens else None, w)
    if times is None and not math.isinf(w.rate):
        notes.append(f"arrivals drawn at {w.rate:g} req/s, burstiness {w.burstiness:g} "
                     "(the file does not list them)")
    epsim = obj.get("epsim") if isinstance(obj.get("epsim"), Mapping) else {}
    measured = measured_metrics(obj, client, source)
    used = (WORKLOAD_KEYS | set(measured) | {"epsim"}
            | ({"input_lens", "output_lens", "errors"} if lens else set())
            | ({"start_times", "queue_times"} if times is not None else set()))
    return BenchResult(
        client=client, source=source, num_prompts=w.n, duration_s=w.duration,
        total_input_tokens=w.total_in, total_output_tokens=w.total_out,
        max_concurrency=w.concurrency, request_rate=w.rate, burstiness=w.burstiness,
        input_lens=lens[0] if lens else None, output_lens=lens[1] if lens else None,
        issue_times_s=times, measured=measured, goodput=_goodput(epsim, source),
        notes=tuple(notes), epsim=dict(epsim), ignored=_ignored(obj, used, client))


def _ignored(obj: Mapping[str, Any], used: set[str], client: str) -> dict[str, str]:
    """Every key of ``obj`` that is neither replayed nor compared -> why."""
    out: dict[str, str] = {}
    for key in obj:
        if _metric_name(key, client) in used or key in used:
            continue
        if key in IGNORED_KEYS:
            out[key] = IGNORED_KEYS[key]
        elif key in ("start_times", "queue_times", "input_lens", "output_lens", "errors"):
            out[key] = ("arrivals are read from start_times and queue_times with the lengths "
                        "listed, all of one length")
        elif obj[key] is None:
            out[key] = "null: no value"
        elif isinstance(obj[key], float) and not math.isfinite(obj[key]):
            out[key] = f"{obj[key]}: not a finite number"
        else:
            out[key] = (f"not a key of {client}'s result that epsim replays or predicts")
    return out


def _number(obj: Mapping[str, Any], key: str, source: str, *, integer: bool = False,
            positive: bool = True) -> Any:
    value = obj.get(key)
    if isinstance(value, str) and value.strip().lower() in ("inf", "infinity"):
        value = math.inf
    ok = isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)
    if ok and integer:
        ok = float(value).is_integer()
    if ok and positive:
        ok = value > 0
    if not ok:
        raise EpsimError(f"{source}: {key} must be a {'positive ' if positive else ''}"
                         f"{'integer' if integer else 'number'}, got {show(value)}")
    low, high = WORKLOAD_BOUNDS[key]
    if not (low <= value <= high or (key == "request_rate" and math.isinf(value))):
        raise EpsimError(f"{source}: {key} {show(value)} is outside [{low:g}, {high:g}] "
                         "(docs/inputs.md)")
    return int(value) if integer else float(value)


@dataclass(frozen=True)
class _Workload:
    n: int
    duration: float
    total_in: int
    total_out: int
    concurrency: int | None
    rate: float
    burstiness: float
    notes: tuple[str, ...]

    @classmethod
    def read(cls, obj: Mapping[str, Any], client: str, source: str) -> _Workload:
        missing = [k for k in ("duration", "total_input_tokens", "total_output_tokens")
                   if obj.get(k) is None]
        if obj.get("num_prompts") is None and obj.get("completed") is None:
            missing.insert(0, "num_prompts or completed")
        if obj.get("max_concurrency") is None and obj.get("request_rate") is None:
            missing.append("max_concurrency or request_rate")
        if missing:
            raise EpsimError(f"{source}: lacks the workload key(s) {', '.join(missing)}")
        notes: list[str] = []
        key = "completed" if obj.get("completed") is not None else "num_prompts"
        n = _number(obj, key, source, integer=True)
        if obj.get("num_prompts") is not None and key == "completed":
            prompts = _number(obj, "num_prompts", source, integer=True)
            failed = _number(obj, "failed", source, integer=True, positive=False) \
                if obj.get("failed") is not None else 0
            if _disagree(n + failed, prompts):
                raise EpsimError(f"{source}: completed {n} + failed {failed} disagree with "
                                 f"num_prompts {prompts}")
            if failed:
                notes.append(f"{failed} failed requests are not replayed")
        conc = obj.get("max_concurrency")
        rate = (_number(obj, "request_rate", source) if obj.get("request_rate") is not None
                else math.inf)
        burst = (_number(obj, "burstiness", source) if obj.get("burstiness") is not None
                 else 1.0)
        if math.isinf(burst):
            raise EpsimError(f"{source}: burstiness inf (evenly spaced arrivals) is not "
                             "replayed; epsim draws gamma gaps")
        return cls(n, _number(obj, "duration", source),
                   _number(obj, "total_input_tokens", source, integer=True),
                   _number(obj, "total_output_tokens", source, integer=True),
                   None if conc is None else _number(obj, "max_concurrency", source,
                                                     integer=True),
                   rate, burst, tuple(notes))


def _disagree(a: float, b: float) -> bool:
    return abs(a - b) > COUNT_TOLERANCE * max(abs(a), abs(b), 1)


def _int_list(obj: Mapping[str, Any], key: str, source: str) -> list[int]:
    values = obj[key]
    if not isinstance(values, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_TOKENS
            for v in values):
        raise EpsimError(f"{source}: {key} must be a list of integers in [0, {MAX_TOKENS}]")
    check_count(len(values), MAX_PROMPTS, f"{key}'s length", source)
    return values


def _listed_lengths(obj: Mapping[str, Any], w: _Workload, source: str
                    ) -> tuple[tuple[int, ...], tuple[int, ...], np.ndarray] | None:
    """(input lens, output lens, which listed requests completed), or None when not listed."""
    if obj.get("input_lens") is None and obj.get("output_lens") is None:
        return None
    if obj.get("input_lens") is None or obj.get("output_lens") is None:
        raise EpsimError(f"{source}: lists only one of input_lens and output_lens")
    ins, outs = _int_list(obj, "input_lens", source), _int_list(obj, "output_lens", source)
    if len(ins) != len(outs):
        raise EpsimError(f"{source}: {len(ins)} input_lens but {len(outs)} output_lens")
    errors = obj.get("errors")
    if isinstance(errors, list) and len(errors) == len(ins):
        ok = np.array([not e for e in errors], dtype=bool)
    else:  # vLLM writes 0 output tokens for a failed request
        ok = np.array(outs, dtype=np.int64) > 0
    ins_ok = [v for v, k in zip(ins, ok, strict=True) if k]
    outs_ok = [v for v, k in zip(outs, ok, strict=True) if k]
    for what, got, want in (("completed requests listed", len(ins_ok), w.n),
                            ("sum(input_lens)", sum(ins_ok), w.total_in),
                            ("sum(output_lens)", sum(outs_ok), w.total_out)):
        if _disagree(got, want):
            raise EpsimError(f"{source}: {what} {got} disagrees with "
                             f"{'completed' if 'requests' in what else 'the total'} {want} by "
                             f"more than {COUNT_TOLERANCE:.1%}")
    if min(outs_ok, default=1) < 1 or min(ins_ok, default=1) < 1:
        raise EpsimError(f"{source}: a completed request lists 0 input or output tokens")
    return tuple(ins_ok), tuple(outs_ok), ok


def _issue_times(obj: Mapping[str, Any], ok: np.ndarray | None, w: _Workload
                 ) -> tuple[float, ...] | None:
    """Arrivals from vLLM's ``start_times`` - ``queue_times`` (both per request), from 0."""
    starts, queues = obj.get("start_times"), obj.get("queue_times")
    if ok is None or not (isinstance(starts, list) and isinstance(queues, list)) \
            or not len(starts) == len(queues) == len(ok):
        return None
    try:
        t = np.array(starts, dtype=float)[ok] - np.array(queues, dtype=float)[ok]
    except (TypeError, ValueError):
        return None
    if not np.isfinite(t).all() or len(t) != w.n:
        return None
    return tuple(float(x) for x in t - t.min())


def _metric_name(key: str, client: str) -> str | None:
    """epsim's name of metric ``key`` (``mean_e2e_latency_ms`` -> ``mean_e2el_ms`` for SGLang),
    or None for a key that is not a metric."""
    m = STAT_KEY.match(key)
    if m:
        metric = RESULT_FORMATS[client].metric_names.get(m.group(2), m.group(2))
        return f"{m.group(1)}_{metric}_ms"
    if key in SCALAR_METRICS or key in SGLANG_SCALARS:
        return SGLANG_SCALARS.get(key, key)
    return None


def measured_metrics(obj: Mapping[str, Any], client: str, source: str = "result"
                     ) -> dict[str, float]:
    """Every metric of the file, under epsim's names: the latency statistics and the scalars
    of ``SCALAR_METRICS``. ``None`` (as vLLM writes an unset goodput) or a non-finite value is
    absent (listed as ignored); any other non-number is an error naming the key."""
    out: dict[str, float] = {}
    for key, value in obj.items():
        name = _metric_name(key, client)
        if name is None or value is None or key in IGNORED_KEYS:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise EpsimError(f"{source}: {key} must be a number (or null), got {show(value)}")
        if math.isfinite(value):
            out[name] = float(value)
    return out


def _goodput(epsim: Mapping[str, Any], source: str) -> tuple[tuple[str, float], ...]:
    """The SLOs an epsim file states (``epsim.goodput``: {metric: ms})."""
    slos = epsim.get("goodput") if epsim else None
    if slos is None:
        return ()
    if not isinstance(slos, Mapping) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0
            for v in slos.values()):
        raise EpsimError(f"{source}: epsim.goodput must map each metric to positive ms, got "
                         f"{show(slos)}")
    return tuple((str(k), float(v)) for k, v in slos.items())
