"""Benchmark workloads as ``vllm bench serve`` and ``sglang.bench_serving`` define them.

A workload is the list of requests a benchmark client sends and when it may send them:

    dataset      each request's input (prompt) and output length in tokens; one class per
                 dataset (``Dataset``), registered by name in ``DATASETS``
                 ``fixed``          every request ``isl`` in, ``osl`` out
                 ``random``         ``--dataset-name random``: lengths drawn uniformly from the
                                    integers of the benchmark client's range (``BENCH_CLIENTS``)
                                    for ``L = isl`` / ``osl`` and ``r = --random-range-ratio``:
                                    vLLM's ``[floor(L(1 - r)), ceil(L(1 + r))]``, r in ``[0, 1)``
                                    (``r = 0`` is ``fixed``); SGLang's ``[int(rL), L]``, r in
                                    ``[0, 1]`` (``r = 1`` is ``fixed``); output at least 1
                 ``sharegpt-like``  a synthetic heavy-tailed distribution standing in for the
                                    ShareGPT conversations, or, with a local ShareGPT JSON
                                    (``dataset_path``), its first-turn prompt and answer
                                    lengths; both filtered as vLLM filters ShareGPT
                                    (``sim/workload/sharegpt.py``)
                 ``trace``          a request trace's lengths *and arrival times*
                                    (``sim/workload/traces.py``: Azure's CSV columns, a file or a
                                    shipped name), the first ``num_prompts`` rows (all by
                                    default), arrivals scaled by ``time_scale``; the open loop's
                                    rate and burstiness do not apply, a concurrency cap still does
    arrivals     closed loop: ``concurrency`` requests in flight at most (a new one is sent
                 when one finishes); open loop: ``request_rate`` requests/s with exponential
                 (Poisson, ``burstiness`` 1) or gamma gaps, or ``inf`` (all sent at time 0).
                 vLLM combines them: requests are generated at the rate and then wait for a free
                 concurrency slot; a request's clock (TTFT, E2E) starts when it gets the slot.

Output lengths are always exact: the simulator generates exactly the requested number of tokens,
which is what ``--ignore-eos`` guarantees on a real server.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from epsim.model.config import ModelConfig, check_context_length
from epsim.model.errors import EpsimError
from epsim.model.fields import option

from .sharegpt import SHAREGPT_LIKE, sharegpt_file_lengths, sharegpt_like_lengths
from .traces import SHIPPED_TRACES, scaled_lengths, trace_head


@dataclass(frozen=True)
class BenchClient:
    """How one benchmark client reads ``--random-range-ratio r`` (its random dataset's lengths).

    name: the client. ratio_max / ratio_max_open: r's upper bound (open: r must stay below it).
    symmetric: lengths in ``[floor(L(1 - r)), ceil(L(1 + r))]`` (vLLM) rather than
        ``[int(rL), L]`` (SGLang).
    source: the client's code that draws them.
    """

    name: str
    ratio_max: float
    ratio_max_open: bool
    symmetric: bool
    source: str

    def length_range(self, length: int, ratio: float, minimum: int = 1) -> tuple[int, int]:
        """The integers a random-dataset length ``L`` is drawn from -> (low, high)."""
        if self.symmetric:
            low = max(minimum, math.floor(length * (1.0 - ratio)))
            return low, max(low, math.ceil(length * (1.0 + ratio)))
        # SGLang's output low is int(rL), 0 at r < 1/L; epsim's requests emit at least one token
        return max(minimum, int(length * ratio)), length

    def check_ratio(self, ratio: float) -> None:
        above = ratio >= self.ratio_max if self.ratio_max_open else ratio > self.ratio_max
        if not 0.0 <= ratio or above:
            right = ")" if self.ratio_max_open else "]"
            raise EpsimError(f"random-range-ratio must be in [0, {self.ratio_max:g}{right} for "
                             f"--bench-client {self.name}, got {ratio}")


#: the benchmark clients whose flags epsim reads (``--bench-client``), vLLM's the default
BENCH_CLIENTS: dict[str, BenchClient] = {
    "vllm": BenchClient(
        "vllm", 1.0, True, True,
        "vllm-project/vllm vllm/benchmarks/datasets.py at 0056b87f, "
        "RandomDataset.get_sampling_params"),
    "sglang": BenchClient(
        "sglang", 1.0, False, False,
        "sgl-project/sglang python/sglang/bench_serving.py at 0033168f, sample_random_requests"),
}
DEFAULT_BENCH_CLIENT = "vllm"


#: how a run's metrics are measured (``--measure``; ``sim/serving/window.py``)
MEASURES = ("burst", "steady")


@dataclass(frozen=True)
class WorkloadSpec:
    """What the benchmark client sends.

    dataset: ``"fixed"``, ``"random"``, ``"sharegpt-like"`` or ``"trace"``.
    num_prompts: requests in the benchmark. Example: 4096. For ``trace``: its first rows
        (``None``, only there: every row).
    isl / osl: input / output tokens (fixed, random); for sharegpt-like ``osl`` (when given) fixes
        every answer's length as vLLM's ``--sharegpt-output-len`` does. Example: 2000 / 100.
    random_range_ratio: ``r`` of the random dataset, as ``bench_client`` reads it.
    concurrency: closed-loop cap on requests in flight (``None``: no cap).
    request_rate: requests/s of the open loop; ``math.inf`` sends everything at time 0.
    burstiness: gamma shape of the inter-arrival gaps (1: Poisson), as vLLM's ``--burstiness``.
    dataset_path: a local ShareGPT JSON for ``sharegpt-like`` (``None``: the synthetic one);
        the request trace for ``trace`` (a CSV or a shipped name, e.g. ``"azure-conv"``).
    time_scale: ``trace`` only: arrival times multiplied by this (0.5: twice the rate).
    prefill_scale / decode_scale: ``trace`` only: each request's prompt / output tokens times
        this, truncated, at least 1 (Vidur's ``prefill_scale_factor`` / ``decode_scale_factor``).
    seed: seeds every random choice. Same seed, same requests.
    bench_client: whose ``--random-range-ratio`` this is (``BENCH_CLIENTS``). Example: "sglang".
    measure: ``"burst"`` (every request counts) or ``"steady"`` (a window without warm-up and
        cool-down, ``sim/serving/window.py``); ``num_prompts`` ``None`` there: sized for it.
    """

    dataset: str = option("fixed", "--dataset", "request lengths (default: fixed with --isl, "
                          "else sharegpt-like)", aliases=("--dataset-name",), derived=True)
    num_prompts: int | None = option(
        1000, "--num-prompts", "requests in the benchmark (default: the concurrency, else "
        "1000; --measure steady: enough for its window; --dataset trace: its first N rows, "
        "default all)", metavar="N", derived=True)
    # --random-input / --random-output: the names SGLang's bench_serving documents (argparse
    # prefixes of its --random-input-len / --random-output-len), declared so they stay valid
    isl: int | None = option(None, "--isl", "input tokens", metavar="I", swept="sweep",
                             aliases=("--random-input-len", "--random-input"))
    osl: int | None = option(None, "--osl", "output tokens (exact, as under --ignore-eos)",
                             metavar="O", swept="sweep",
                             aliases=("--random-output-len", "--random-output"))
    random_range_ratio: float = option(
        0.0, "--random-range-ratio", "random dataset: lengths uniform in [L(1-r), L(1+r)], "
        "r < 1 (vLLM), or in [rL, L], r <= 1 (--bench-client sglang)", metavar="r")
    concurrency: int | None = option(
        None, "--concurrency", "closed loop: requests in flight at most",
        aliases=("--max-concurrency",), metavar="C", swept="sweep")
    request_rate: float = option(math.inf, "--request-rate", "open loop: requests/s, Poisson "
                                 "arrivals, or inf (default)", metavar="R", swept="sweep")
    burstiness: float = option(1.0, "--burstiness",
                               "gamma shape of inter-arrival gaps (1: Poisson)")
    dataset_path: str | None = option(
        None, "--dataset-path", "a local ShareGPT JSON for --dataset sharegpt-like; a request "
        "trace CSV (Azure's TIMESTAMP, ContextTokens, GeneratedTokens or Vidur's arrived_at, "
        "num_prefill_tokens, num_decode_tokens) or a shipped one ({traces}) for --dataset "
        "trace", metavar="FILE")
    time_scale: float = option(1.0, "--time-scale", "--dataset trace: arrival times x S (0.5 "
                               "doubles the arrival rate)", metavar="S")
    prefill_scale: float = option(1.0, "--prefill-scale", "--dataset trace: prompt lengths x "
                                  "F (Vidur's prefill_scale_factor; times --length-scale)",
                                  metavar="F")
    decode_scale: float = option(1.0, "--decode-scale", "--dataset trace: output lengths x F "
                                 "(Vidur's decode_scale_factor; times --length-scale)",
                                 metavar="F")
    seed: int = option(0, "--seed", "seeds every random choice: the requests, the routing, the "
                       "runtime's weights and inputs (validate bench: default the seed an "
                       "epsim-written file records, else 0)")
    bench_client: str = option(
        DEFAULT_BENCH_CLIENT, "--bench-client", "read the benchmark flags as this client does: "
        "vllm (vllm bench serve) or sglang (python -m sglang.bench_serving)")
    measure: str = option(
        "burst", "--measure", "steady: every metric over a window without the warm-up burst "
        "and the cool-down drain, the run sized for it (default of tune and plan); burst: the "
        "whole run, as vllm bench serve reports a finite run (default of predict and sweep); "
        "docs/serving.md", metavar="steady|burst", derived=True)

    @property
    def client(self) -> BenchClient:
        return BENCH_CLIENTS[self.bench_client]

    @property
    def kind(self) -> Dataset:
        """The dataset's class (``DATASETS[dataset]``): how its requests are drawn."""
        return DATASETS[self.dataset]

    def validate(self) -> WorkloadSpec:
        """Check every field; raise :class:`EpsimError` naming the bad value."""
        if self.dataset not in DATASETS:
            raise EpsimError(f"dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}")
        kind = self.kind
        kind.check_arrivals(self)
        if self.num_prompts is not None and (isinstance(self.num_prompts, bool)
                                             or not isinstance(self.num_prompts, int)
                                             or self.num_prompts < 1):
            raise EpsimError(f"num-prompts must be a positive integer, got {self.num_prompts!r}")
        if kind.needs_lengths:
            for name in ("isl", "osl"):
                if getattr(self, name) is None:
                    raise EpsimError(f"the {self.dataset} dataset needs --{name}")
        for name in ("isl", "osl"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise EpsimError(f"{name} must be a positive integer, got {value!r}")
        if kind.draws_prompts and self.isl is not None:
            raise EpsimError(f"the {self.dataset} dataset draws prompt lengths; drop --isl "
                             "(or use --dataset fixed/random)")
        if self.bench_client not in BENCH_CLIENTS:
            raise EpsimError(f"bench-client must be one of {', '.join(BENCH_CLIENTS)}, got "
                             f"{self.bench_client!r}")
        self.client.check_ratio(self.random_range_ratio)
        if self.concurrency is not None and self.concurrency < 1:
            raise EpsimError(f"concurrency must be a positive integer, got {self.concurrency}")
        if self.measure not in MEASURES:
            raise EpsimError(f"--measure must be one of {', '.join(MEASURES)}, got "
                             f"{self.measure!r}")
        if not (self.request_rate > 0):
            raise EpsimError(f"request-rate must be positive or inf, got {self.request_rate}")
        if not (math.isfinite(self.burstiness) and self.burstiness > 0):
            raise EpsimError(f"burstiness must be a positive number, got {self.burstiness}")
        if self.dataset_path is not None and not kind.takes_path:
            raise EpsimError("--dataset-path is a ShareGPT JSON (--dataset sharegpt-like) or a "
                             "request trace (--dataset trace)")
        kind.check_path(self)
        return self


@dataclass(frozen=True)
class Requests:
    """The sampled requests, as arrays of length ``num_prompts`` (index = request id).

    input_lens / output_lens: tokens in and out (int64). Example: ``[2000, 2000, ...]``.
    issue_times_s: when the client generates each request (the open loop's schedule; all 0 for
        ``request_rate = inf``); under a concurrency cap it is sent when a slot is free too.
    """

    input_lens: np.ndarray
    output_lens: np.ndarray
    issue_times_s: np.ndarray

    def __len__(self) -> int:
        return len(self.input_lens)


def random_length_range(length: int, ratio: float, minimum: int = 1,
                        client: str = DEFAULT_BENCH_CLIENT) -> tuple[int, int]:
    """The lengths the random dataset draws from -> (low, high): vLLM's
    ``[floor(L(1-r)), ceil(L(1+r))]`` or SGLang's ``[int(rL), L]`` (``BENCH_CLIENTS``)."""
    return BENCH_CLIENTS[client].length_range(length, ratio, minimum)


def random_lengths(rng: np.random.Generator, n: int, length: int, ratio: float,
                   minimum: int = 1, client: str = DEFAULT_BENCH_CLIENT) -> np.ndarray:
    """``n`` integer lengths uniform over ``random_length_range`` (the client's rule) -> (n,)."""
    low, high = random_length_range(length, ratio, minimum, client)
    return rng.integers(low, high + 1, size=n, dtype=np.int64)


def issue_times(rng: np.random.Generator, n: int, rate: float, burstiness: float) -> np.ndarray:
    """When the client generates each request -> (n,) seconds, first at 0.

    ``rate = inf``: all at 0. Else gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)),
    exponential (Poisson arrivals) at burstiness 1, as in vLLM's ``get_request``.
    """
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def check_context(spec: WorkloadSpec, model: ModelConfig) -> None:
    """Refuse a dataset that can produce a request beyond the model's context, in one line."""
    check_context_length(model, *longest_request(spec))


def check_requests_context(req: Requests, model: ModelConfig) -> None:
    """Refuse given requests (a replayed benchmark's) of which one exceeds the model's context."""
    if len(req):
        i = int(np.argmax(req.input_lens + req.output_lens))
        check_context_length(model, int(req.input_lens[i] + req.output_lens[i]),
                             f"request {i} ({int(req.input_lens[i])} in + "
                             f"{int(req.output_lens[i])} out)")


def longest_request(spec: WorkloadSpec) -> tuple[int, str]:
    """The longest prompt + output the dataset can produce, whatever the seed, and what that is
    in the user's terms (for an error message): ``spec.kind.longest``."""
    return spec.kind.longest(spec)


def sample_requests(spec: WorkloadSpec, model: ModelConfig | None = None) -> Requests:
    """Draw the benchmark's requests from ``spec`` (deterministic in ``spec.seed``).

    With ``model``, a dataset that can produce a request longer than the model's context
    (``max_position_embeddings``) is refused before anything is drawn.
    """
    spec.validate()
    if model is not None:
        check_context(spec, model)
    return spec.kind.requests(spec)


# --------------------------------------------------------------------------------------------
# The datasets: one class each, registered by name
# --------------------------------------------------------------------------------------------


class Dataset:
    """One benchmark dataset: what it needs from a :class:`WorkloadSpec` and how it draws the
    requests. Subclasses set ``name`` and implement :meth:`lengths` and :meth:`longest`.

    needs_lengths: ``isl`` and ``osl`` are required (fixed, random).
    draws_prompts: prompt lengths come from the dataset, so ``isl`` is refused (sharegpt-like).
    takes_path: ``dataset_path`` means something to it (sharegpt-like, trace).
    replays: a recorded trace: its rows and arrival times, not drawn; the open loop's rate does
        not apply and ``num_prompts`` may be omitted (every row).
    """

    name: ClassVar[str] = ""
    needs_lengths: ClassVar[bool] = False
    draws_prompts: ClassVar[bool] = False
    takes_path: ClassVar[bool] = False
    replays: ClassVar[bool] = False

    def check_arrivals(self, spec: WorkloadSpec) -> None:
        """The number of requests and their arrivals (a drawn dataset: drawn by the client)."""
        if spec.num_prompts is None and spec.measure != "steady":  # steady: run_scenario sizes
            raise EpsimError("num-prompts may be omitted only for --dataset trace")
        if spec.time_scale != 1.0:
            raise EpsimError("--time-scale stretches a trace's arrivals; use it with "
                             "--dataset trace")
        if (spec.prefill_scale, spec.decode_scale) != (1.0, 1.0):
            raise EpsimError("--length-scale, --prefill-scale and --decode-scale scale a trace's "
                             "lengths; use them with --dataset trace (--isl/--osl set the others')")

    def check_path(self, spec: WorkloadSpec) -> None:
        """What ``dataset_path`` must be, once it is known the dataset takes one."""

    def lengths(self, spec: WorkloadSpec, rng: np.random.Generator, n: int
                ) -> tuple[np.ndarray, np.ndarray]:
        """``n`` (prompt, answer) lengths -> two (n,) int64 arrays, drawn from ``rng``."""
        raise NotImplementedError

    def longest(self, spec: WorkloadSpec) -> tuple[int, str]:
        """The longest prompt + output it can produce, and what that is in the user's terms."""
        raise NotImplementedError

    def requests(self, spec: WorkloadSpec) -> Requests:
        """The benchmark's requests: lengths, then the open loop's issue times, from one
        generator seeded by ``spec.seed`` (in that order: same seed, same requests)."""
        rng = np.random.default_rng(spec.seed)
        n = spec.num_prompts
        ins, outs = self.lengths(spec, rng, n)
        times = issue_times(rng, n, spec.request_rate, spec.burstiness)
        return Requests(input_lens=ins, output_lens=outs, issue_times_s=times)


#: every registered dataset by name (``--dataset``)
DATASETS: dict[str, Dataset] = {}


def register(cls: type[Dataset]) -> type[Dataset]:
    DATASETS[cls.name] = cls()
    return cls


@register
class Fixed(Dataset):
    """Every request ``isl`` in, ``osl`` out."""

    name = "fixed"
    needs_lengths = True

    def lengths(self, spec: WorkloadSpec, rng: np.random.Generator, n: int
                ) -> tuple[np.ndarray, np.ndarray]:
        return np.full(n, spec.isl, dtype=np.int64), np.full(n, spec.osl, dtype=np.int64)

    def longest(self, spec: WorkloadSpec) -> tuple[int, str]:
        return spec.isl + spec.osl, f"--isl {spec.isl} + --osl {spec.osl}"


@register
class Random(Dataset):
    """Lengths uniform over the benchmark client's range around ``isl`` / ``osl``."""

    name = "random"
    needs_lengths = True

    def lengths(self, spec: WorkloadSpec, rng: np.random.Generator, n: int
                ) -> tuple[np.ndarray, np.ndarray]:
        ratio, client = spec.random_range_ratio, spec.bench_client
        ins = random_lengths(rng, n, spec.isl, ratio, client=client)
        return ins, random_lengths(rng, n, spec.osl, ratio, client=client)

    def longest(self, spec: WorkloadSpec) -> tuple[int, str]:
        c = spec.bench_client
        top = (random_length_range(spec.isl, spec.random_range_ratio, client=c)[1]
               + random_length_range(spec.osl, spec.random_range_ratio, client=c)[1])
        return top, (f"the random dataset's longest request (--isl {spec.isl} + --osl "
                     f"{spec.osl} at range ratio {spec.random_range_ratio:g})")


@register
class ShareGPT(Dataset):
    """ShareGPT-like lengths: synthetic, or a local ShareGPT JSON's (``sim/workload/sharegpt.py``)."""

    name = "sharegpt-like"
    draws_prompts = True
    takes_path = True

    def check_path(self, spec: WorkloadSpec) -> None:
        if spec.dataset_path in SHIPPED_TRACES:
            raise EpsimError(f"{spec.dataset_path} is a shipped request trace; use it with "
                             "--dataset trace")

    def lengths(self, spec: WorkloadSpec, rng: np.random.Generator, n: int
                ) -> tuple[np.ndarray, np.ndarray]:
        if spec.dataset_path:
            return sharegpt_file_lengths(spec.dataset_path, rng, n, spec.osl)
        return sharegpt_like_lengths(rng, n, spec.osl)

    def longest(self, spec: WorkloadSpec) -> tuple[int, str]:
        # every kept pair, synthetic or from a file, stays under the filter's total cap
        return (SHAREGPT_LIKE.max_total_len,
                "the sharegpt-like dataset's longest request (its filter's total cap)")


@register
class Trace(Dataset):
    """A request trace's lengths and arrival times (``sim/workload/traces.py``), its first
    ``num_prompts`` rows (all by default), arrivals times ``time_scale``."""

    name = "trace"
    takes_path = True
    replays = True

    def check_arrivals(self, spec: WorkloadSpec) -> None:
        """A trace brings lengths and arrival times: the flags that would set them contradict."""
        if spec.dataset_path is None:
            raise EpsimError("--dataset trace needs --dataset-path (a CSV with TIMESTAMP, "
                             "ContextTokens, GeneratedTokens or Vidur's arrived_at, "
                             f"num_prefill_tokens, num_decode_tokens, or "
                             f"{', '.join(SHIPPED_TRACES)})")
        for name in ("isl", "osl"):
            if getattr(spec, name) is not None:
                raise EpsimError(f"the trace dataset brings each request's lengths; drop --{name}")
        if not math.isinf(spec.request_rate) or spec.burstiness != 1.0:
            raise EpsimError("the trace dataset brings its own arrival times; drop "
                             "--request-rate / --burstiness (--time-scale stretches them)")
        for name in ("time_scale", "prefill_scale", "decode_scale"):
            value = getattr(spec, name)
            if not (math.isfinite(value) and value > 0):
                raise EpsimError(f"{name.replace('_', '-')} must be a positive number, got "
                                 f"{value}")

    @staticmethod
    def _lengths(spec: WorkloadSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(arrivals, prompt, output tokens) of the trace's first rows, the lengths scaled."""
        trace = trace_head(spec.dataset_path, spec.num_prompts)
        return (trace.arrival_s,
                scaled_lengths(trace.input_lens, spec.prefill_scale, "a prompt"),
                scaled_lengths(trace.output_lens, spec.decode_scale, "an output"))

    def longest(self, spec: WorkloadSpec) -> tuple[int, str]:
        _, ins, outs = self._lengths(spec)
        total = ins + outs
        i = int(total.argmax())
        return int(total[i]), (f"request {i} of the trace {spec.dataset_path} "
                               f"({int(ins[i])} in + {int(outs[i])} out)")

    def requests(self, spec: WorkloadSpec) -> Requests:
        arrival_s, ins, outs = self._lengths(spec)
        return Requests(input_lens=ins, output_lens=outs,
                        issue_times_s=arrival_s * spec.time_scale)
